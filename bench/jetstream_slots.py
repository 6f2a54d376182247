"""Jetstream fronts: what the deployment-wide connection caps cost a stream's open.

Starts a nats-server (JetStream on, a temporary store, a random loopback port) and two
deployments of two `topicd serve` fronts each: `on` with the default caps
(`limits.max_sse_connections` 10000: every open takes a slot in the registry's
`front.slots` entry, every close gives it back) and `off` with
`limits.max_sse_connections = 0` and auth off (no cap applies: the count is never
asked). Each round times `--n` sequential `/work` stream opens on one deployment (a new
connection, `GET /v0/topics/q/work`, until the response head arrives: the slot is taken
before the head is sent), each closed before the next, in two patterns: `same` (every
open on the first front) and `spread` (the two fronts in turn, so each front's writes
race the other's). Deployments and patterns alternate round by round, so machine load
hits them alike. The frames of an open stream cost nothing more (no count is asked
per frame), so only opens are timed.

    python bench/jetstream_slots.py --rounds 5 --n 200
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from jetstream_bridge import start_server
from jetstream_failover import Front


def opens(ports: list[int], n: int) -> float:
    """Mean seconds from connect to the response head of a `/work` stream."""
    total = 0.0
    for i in range(n):
        conn = http.client.HTTPConnection("127.0.0.1", ports[i % len(ports)], timeout=30)
        t0 = time.perf_counter()
        conn.request("GET", "/v0/topics/q/work?node=w", headers={"Accept": "text/event-stream"})
        r = conn.getresponse()
        total += time.perf_counter() - t0
        assert r.status == 200, (r.status, r.read())
        conn.close()
    return total / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=200, help="opens per round, pattern and side")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jsslots-"))
    proc, url = start_server(root)
    fronts: dict[str, list[Front]] = {}
    try:
        for side, cap in (("on", "10000"), ("off", "0")):
            env = {
                "TOPICD_STORAGE_BACKEND": "jetstream",
                "TOPICD_JETSTREAM_SERVERS": url,
                "TOPICD_JETSTREAM_PREFIX": f"slots{side}",
                "TOPICD_MAX_SSE_CONNECTIONS": cap,
            }
            fronts[side] = []
            for i in range(2):
                front = Front(root / side, f"f{i}", env)
                front.wait_ready()
                fronts[side].append(front)
            conn = http.client.HTTPConnection("127.0.0.1", fronts[side][0].port, timeout=30)
            json_type = {"Content-Type": "application/json"}
            conn.request("PUT", "/v0/topics/q", b'{"type":"queue"}', json_type)
            assert conn.getresponse().status == 201
        time.sleep(2)  # (the fronts' lease checks see each other)
        ports = {side: [f.port for f in fs] for side, fs in fronts.items()}
        for side in ports:
            opens(ports[side], 20)  # warm-up
        got: dict[tuple[str, str], list[float]] = {}
        for k in range(args.rounds):
            sides = ("on", "off") if k % 2 == 0 else ("off", "on")
            for pattern in ("same", "spread"):
                for side in sides:
                    use = ports[side][:1] if pattern == "same" else ports[side]
                    got.setdefault((pattern, side), []).append(opens(use, args.n))
    finally:
        for fs in fronts.values():
            for front in fs:
                front.stop()
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    for pattern in ("same", "spread"):
        med = {}
        for side in ("off", "on"):
            us = sorted(x * 1e6 for x in got[(pattern, side)])
            med[side] = statistics.median(us)
            print(
                f"{pattern:6s} caps {side:3s}: /work open to response head, median "
                f"{med[side]:6.0f} µs (rounds: {', '.join(f'{x:.0f}' for x in us)})"
            )
        print(f"{pattern:6s} caps on - off: {med['on'] - med['off']:+.0f} µs per open")


if __name__ == "__main__":
    main()
