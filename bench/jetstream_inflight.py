"""Jetstream fronts: what the deployment-wide in-flight and session caps cost a request.

Starts a nats-server (JetStream on, a temporary store, a random loopback port) and two
deployments of two `topicd serve` fronts each, both with auth on (one key): `on` with
the default cap (`limits.max_inflight_per_key` 1000: every request takes a request slot
in the registry's `front.slots` entry before it runs, and gives it back, without
waiting for the write, when it ends; `limits.max_watch_sessions` 10000: every watch
session created takes a session slot there too) and `off` with both caps at 0 (nothing
is counted: what a front cost before the caps were the deployment's). Each round times one-record
writes (`POST /v0/topics/q`, keep-alive connections) on one deployment in three
patterns: `same` (`--n` sequential writes to the first front, the topic's owner),
`spread` (`--n` sequential writes, the two fronts in turn: every other one forwarded to
the owner) and `burst` (`--n` writes by `--clients` threads at once to the first front:
the requests waiting share the writer's rounds), then `--n` watch session creates
(`POST /v0/watch` of `q`, sequential, to the first front: the request's slot and the
session's). Deployments alternate round by round, so machine load hits them alike.

    python bench/jetstream_inflight.py --rounds 5 --n 300 --clients 16
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from jetstream_bridge import start_server
from jetstream_failover import Front

KEY = "bench-key-1"
PATTERNS = ("same", "spread", "burst", "watch")
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
BODY = b'{"records":[{"data":1}]}'
WATCH = b'{"topics":{"q":{}}}'


def writes(conns: list[http.client.HTTPConnection], n: int, watch: bool = False) -> None:
    path, body = ("/v0/watch", WATCH) if watch else ("/v0/topics/q", BODY)
    for i in range(n):
        conn = conns[i % len(conns)]
        conn.request("POST", path, body, HEADERS)
        r = conn.getresponse()
        out = r.read()
        assert r.status in (200, 201), (r.status, out)


def sequential(ports: list[int], n: int, watch: bool = False) -> float:
    """Mean seconds per write (or watch create), one after another."""
    conns = [http.client.HTTPConnection("127.0.0.1", p, timeout=30) for p in ports]
    try:
        t0 = time.perf_counter()
        writes(conns, n, watch)
        return (time.perf_counter() - t0) / n
    finally:
        for c in conns:
            c.close()


def burst(port: int, n: int, clients: int) -> float:
    """Mean seconds per write (wall time / writes) with `clients` writing at once."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(clients)]
    threads = [threading.Thread(target=writes, args=([c], n // clients)) for c in conns]
    try:
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return (time.perf_counter() - t0) / (clients * (n // clients))
    finally:
        for c in conns:
            c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=300, help="writes per round, pattern and side")
    p.add_argument("--clients", type=int, default=16, help="writers at once in `burst`")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jsinflight-"))
    proc, url = start_server(root)
    fronts: dict[str, list[Front]] = {}
    try:
        for side, cap, sessions in (("on", "1000", "10000"), ("off", "0", "0")):
            env = {
                "TOPICD_STORAGE_BACKEND": "jetstream",
                "TOPICD_JETSTREAM_SERVERS": url,
                "TOPICD_JETSTREAM_PREFIX": f"inflight{side}",
                "TOPICD_API_KEYS": KEY,
                "TOPICD_MAX_INFLIGHT_PER_KEY": cap,
                "TOPICD_MAX_WATCH_SESSIONS": sessions,
            }
            fronts[side] = []
            for i in range(2):
                front = Front(root / side, f"f{i}", env)
                front.wait_ready()
                fronts[side].append(front)
            conn = http.client.HTTPConnection("127.0.0.1", fronts[side][0].port, timeout=30)
            conn.request("PUT", "/v0/topics/q", b"{}", HEADERS)
            assert conn.getresponse().status == 201
        time.sleep(2)  # (the fronts' lease checks see each other)
        ports = {side: [f.port for f in fs] for side, fs in fronts.items()}
        for side in ports:
            sequential(ports[side], 50)  # warm-up
        got: dict[tuple[str, str], list[float]] = {}
        for k in range(args.rounds):
            sides = ("on", "off") if k % 2 == 0 else ("off", "on")
            for pattern in PATTERNS:
                for side in sides:
                    if pattern == "burst":
                        took = burst(ports[side][0], args.n, args.clients)
                    elif pattern == "watch":
                        took = sequential(ports[side][:1], args.n, watch=True)
                    else:
                        use = ports[side][:1] if pattern == "same" else ports[side]
                        took = sequential(use, args.n)
                    got.setdefault((pattern, side), []).append(took)
    finally:
        for fs in fronts.values():
            for front in fs:
                front.stop()
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    for pattern in PATTERNS:
        med = {}
        for side in ("off", "on"):
            us = sorted(x * 1e6 for x in got[(pattern, side)])
            med[side] = statistics.median(us)
            print(
                f"{pattern:6s} caps {side:3s}: µs per call, median {med[side]:6.0f} "
                f"(rounds: {', '.join(f'{x:.0f}' for x in us)})"
            )
        print(
            f"{pattern:6s} caps on - off: {med['on'] - med['off']:+.0f} µs per call "
            f"({med['on'] / med['off']:.2f}x)"
        )


if __name__ == "__main__":
    main()
