"""Scale-out shape: 1 front on the embedded WAL vs 1 and 3 jetstream fronts on a
three-node JetStream cluster (all on this machine: the point is the shape, not speed).

For each setup (`topicd serve` processes; the jetstream ones on one loopback cluster of
three nats-servers, R3 streams, as many owner shards as fronts):

* **writes/s** — `--writers` client threads, each on its own keep-alive connection to
  front `i % fronts`, send single-record `disk` writes to `--topics` topics for
  `--seconds`;
* **diff records/s** — the same threads read a 5,000-record topic from seq 0 in pages of
  1,000 (`diff`), each through its front, for `--seconds`;
* **fan-out latency** — `--watchers` long-polls spread over the fronts wait on a topic;
  one write through the first front; the time from sending it to each long-poll's
  answer, over `--rounds` rounds (p50, p99);
* **failover** (3 fronts only) — the front owning a topic is killed with SIGKILL; the
  time to the first acknowledged write to it through another front.

    python bench/scale_out.py --seconds 5
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from jetstream_chaos import _placement
from jetstream_failover import Front

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.jetstream.conftest import (
    nats_server_binary,
    start_cluster,
    stop_all,
    wait_placeable,
)


class Conn:
    """One keep-alive HTTP/1.1 connection to a front."""

    def __init__(self, port: int) -> None:
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path: str, body: dict, headers: dict[str, str] | None = None):
        self.c.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
        )
        r = self.c.getresponse()
        return r.status, json.loads(r.read() or b"{}")


def timed_threads(n: int, seconds: float, work) -> int:
    """Run `work(i, deadline) -> count` on `n` threads; the total count."""
    counts = [0] * n
    deadline = time.perf_counter() + seconds

    def run(i: int) -> None:
        counts[i] = work(i, deadline)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def measure(fronts: list[Front], args: argparse.Namespace, label: str) -> dict[str, float]:
    ports = [f.port for f in fronts]
    out: dict[str, float] = {}
    first = Conn(ports[0])
    # writes/s
    for t in range(args.topics):
        first.post(f"/v0/topics/w{t}", {"records": [{"data": 0}]})

    def writes(i: int, deadline: float) -> int:
        c = Conn(ports[i % len(ports)])
        n = 0
        while time.perf_counter() < deadline:
            status, body = c.post(
                f"/v0/topics/w{(i + n) % args.topics}", {"records": [{"data": n}]}
            )
            assert status in (200, 201), (status, body)
            n += 1
        return n

    out["writes_s"] = timed_threads(args.writers, args.seconds, writes) / args.seconds
    # diff records/s
    for k in range(5):
        first.post(
            "/v0/topics/big", {"records": [{"data": {"i": k * 1000 + j}} for j in range(1000)]}
        )

    def reads(i: int, deadline: float) -> int:
        c = Conn(ports[i % len(ports)])
        n = 0
        while time.perf_counter() < deadline:
            cursor = 0
            while cursor < 5000 and time.perf_counter() < deadline:
                status, body = c.post("/v0/topics/big/diff", {"from_seq": cursor, "limit": 1000})
                assert status == 200, body
                n += len(body["records"])
                cursor = int(body["next_from_seq"])
        return n

    out["diff_records_s"] = timed_threads(args.writers, args.seconds, reads) / args.seconds
    # fan-out latency
    _, body = first.post("/v0/topics/fan", {"records": [{"data": 0}]})
    head = int(body["first_seq"])
    lat: list[float] = []
    for _ in range(args.rounds):
        got, head = fan_round(first, ports, args.watchers, head)
        lat += got
    lat.sort()
    out["fanout_p50_ms"] = statistics.median(lat)
    out["fanout_p99_ms"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    print(
        f"{label}: {out['writes_s']:.0f} writes/s, {out['diff_records_s']:.0f} diff records/s, "
        f"fan-out to {args.watchers} long-polls p50 {out['fanout_p50_ms']:.1f} ms "
        f"p99 {out['fanout_p99_ms']:.1f} ms",
        flush=True,
    )
    return out


def fan_round(first: Conn, ports: list[int], watchers: int, head: int) -> tuple[list[float], int]:
    """One fan-out round: (each long-poll's latency in ms, the new head)."""
    parked = threading.Barrier(watchers + 1)
    got: list[float] = []
    lock = threading.Lock()

    def watch(i: int) -> None:
        c = Conn(ports[i % len(ports)])
        c.post("/v0/topics/fan/diff", {"from_seq": head, "limit": 10})  # (connected)
        parked.wait()
        status, body = c.post(
            "/v0/topics/fan/diff", {"from_seq": head, "limit": 10, "wait_ms": 20000}
        )
        assert status == 200, body
        assert body["records"], body
        with lock:
            got.append(time.perf_counter())

    threads = [threading.Thread(target=watch, args=(i,)) for i in range(watchers)]
    for t in threads:
        t.start()
    parked.wait()
    time.sleep(0.3)  # (the long-polls reach their fronts and park: no signal for it)
    sent = time.perf_counter()
    _, body = first.post("/v0/topics/fan", {"records": [{"data": 1}]})
    for t in threads:
        t.join()
    return [(g - sent) * 1000 for g in got], int(body["first_seq"])


def failover(fronts: list[Front], urls: list[str], prefix: str) -> float:
    import asyncio

    _, owner_id = asyncio.run(_placement(urls, prefix, "w0"))
    owner = next(f for f in fronts if f"front {owner_id}" in f.text())
    other = next(f for f in fronts if f is not owner)
    owner.proc.send_signal(signal.SIGKILL)
    t_kill = time.perf_counter()
    owner.proc.wait()
    n = 0
    while True:
        n += 1
        try:
            status, _ = Conn(other.port).post(
                "/v0/topics/w0", {"records": [{"data": "f"}]}, {"Idempotency-Key": "fo"}
            )
        except OSError:
            status = 0
        if status in (200, 201):
            return time.perf_counter() - t_kill
        time.sleep(0.02)  # the retry's pace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--writers", type=int, default=12)
    p.add_argument("--topics", type=int, default=12)
    p.add_argument("--watchers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    binary, why = nats_server_binary()
    if binary is None:
        raise SystemExit(why)
    root = Path(tempfile.mkdtemp(prefix="scaleout-"))
    results = {}
    front = Front(root / "wal", "f0", {})
    try:
        front.wait_ready()
        results["1 front, embedded WAL"] = measure([front], args, "1 front, embedded WAL")
    finally:
        front.stop()
    servers = start_cluster(binary, root / "nats")
    urls = [s.url for s in servers]
    try:
        wait_placeable(urls, 3)
        for n in (1, 3):
            prefix = f"scale{n}"
            env = {
                "TOPICD_STORAGE_BACKEND": "jetstream",
                "TOPICD_JETSTREAM_SERVERS": ",".join(urls),
                "TOPICD_STORAGE_JETSTREAM_REPLICAS": "3",
                "TOPICD_STORAGE_JETSTREAM_SHARDS": str(n),
                "TOPICD_JETSTREAM_PREFIX": prefix,
            }
            fronts = []
            try:
                for i in range(n):
                    f = Front(root / prefix, f"f{i}", env)
                    f.wait_ready()
                    fronts.append(f)
                time.sleep(3.0)  # (the shards spread over the fronts: one lease term)
                label = f"{n} front{'s' if n > 1 else ''}, 3-node JetStream (R3)"
                results[label] = measure(fronts, args, label)
                if n == 3:
                    fo = failover(fronts, urls, prefix)
                    print(f"{label}: failover to the first acknowledged write {fo * 1000:.0f} ms")
            finally:
                for f in fronts:
                    f.stop()
    finally:
        stop_all(servers)
    base = results["1 front, embedded WAL"]
    for label, r in results.items():
        print(
            f"{label}: writes {r['writes_s'] / base['writes_s']:.2f}x, "
            f"diff {r['diff_records_s'] / base['diff_records_s']:.2f}x, "
            f"fan-out p50 {r['fanout_p50_ms'] / base['fanout_p50_ms']:.2f}x of the WAL front"
        )


if __name__ == "__main__":
    main()
