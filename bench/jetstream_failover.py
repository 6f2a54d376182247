"""Three jetstream fronts: the owner front killed with SIGKILL, and the time to the first
successful write after it.

Starts one nats-server (JetStream, a temporary store, a random loopback port), then for
each run three `topicd serve` processes on a fresh `storage.jetstream.prefix` (the first
takes the owner lease). One writer sends sequential single-record writes, each with its
own idempotency key, to a follower front, retrying a write on `503` or a lost
connection. After `--before` acknowledged writes the owner is killed with SIGKILL; the
failover time is from the kill to the first acknowledgement of a write sent after it.
The run then writes `--after` more and checks, on both surviving fronts, that every
acknowledged write is there once at its seq and that the seqs are 1..n (none reused).

    python bench/jetstream_failover.py --runs 10
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jetstream_bridge import start_server

READY_S = 30.0


class Front:
    def __init__(self, root: Path, name: str, env: dict[str, str]) -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.port_file = self.dir / "port"
        self.log = self.dir / "log"
        full = {k: v for k, v in os.environ.items() if not k.startswith("TOPICD_")}
        full.update(env)
        full["TOPICD_PORT_FILE"] = str(self.port_file)
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "topicd", "serve", "--port", "0"),
                *("--data-dir", str(self.dir / "data"), "--log-level", "info"),
            ],
            env=full,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"),
        )
        self.port = 0

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if "listening on" in self.text() and self.port_file.exists():
                self.port = int(self.port_file.read_text().strip())
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise SystemExit(f"a front did not start:\n{self.text()[-3000:]}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def post(port: int, path: str, body: dict, headers: dict[str, str]) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            path,
            json.dumps(body),
            {"Content-Type": "application/json", **headers},
        )
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def write(port: int, key: str) -> tuple[int, float]:
    """(first seq, time acknowledged), retrying on 503 and lost connections."""
    while True:
        try:
            status, body = post(
                port, "/v0/topics/f", {"records": [{"data": key}]}, {"Idempotency-Key": key}
            )
        except OSError:
            time.sleep(0.02)  # the retry's pace
            continue
        if status == 503:
            time.sleep(0.02)
            continue
        assert status in (200, 201), (status, body)
        return int(body["first_seq"]), time.perf_counter()


def one_run(root: Path, url: str, k: int, args: argparse.Namespace) -> float:
    env = {
        "TOPICD_STORAGE_BACKEND": "jetstream",
        "TOPICD_JETSTREAM_SERVERS": url,
        "TOPICD_JETSTREAM_PREFIX": f"fo{k}",
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": str(args.lease_ms),
    }
    fronts = []
    try:
        for i in range(3):
            front = Front(root / f"run{k}", f"f{i}", env)
            front.wait_ready()  # one at a time: the first is the owner
            fronts.append(front)
        owner, follower, other = fronts
        assert ": owner" in owner.text(), owner.text()[-2000:]
        acked: dict[str, int] = {}
        for i in range(args.before):
            acked[f"a{i}"], _ = write(follower.port, f"a{i}")
        owner.proc.send_signal(signal.SIGKILL)
        t_kill = time.perf_counter()
        owner.proc.wait()
        acked["b0"], t_first = write(follower.port, "b0")
        for i in range(1, args.after):
            acked[f"b{i}"], _ = write(follower.port if i % 2 else other.port, f"b{i}")
        n = len(acked)
        assert sorted(acked.values()) == list(range(1, n + 1)), "a seq reused or skipped"
        for front in (follower, other):
            status, body = post(front.port, "/v0/topics/f/diff", {"limit": 10000}, {})
            assert status == 200, body
            assert {r["data"]: r["$seq"] for r in body["records"]} == acked
        return t_first - t_kill
    finally:
        for front in fronts:
            front.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--before", type=int, default=50, help="writes before the kill")
    p.add_argument("--after", type=int, default=20, help="writes after the kill")
    p.add_argument("--lease-ms", type=int, default=3000)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jsfailover-"))
    proc, url = start_server(root)
    times = []
    try:
        for k in range(args.runs):
            dt = one_run(root, url, k, args)
            times.append(dt)
            print(f"run {k + 1}: first write {dt * 1000:.0f} ms after the kill (checks passed)")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    ms = [t * 1000 for t in times]
    print(
        f"failover to the first acknowledged write, {len(ms)} runs (lease {args.lease_ms} ms): "
        f"median {statistics.median(ms):.0f} ms, max {max(ms):.0f} ms"
    )


if __name__ == "__main__":
    main()
