"""Jetstream fronts: what the deployment-wide `limits.max_total_bytes` costs a write.

Starts a nats-server (JetStream on, a temporary store, a random loopback port) and five
deployments of two `topicd serve` fronts each: `off` (`max_total_bytes` 0: nothing is
counted), `far` (1 GiB: the deployment far from the limit, so a write fits in its
owner's share), `near` (64 KiB, 48 KiB of it held by one record written before the
rounds: each timed write is followed, untimed, by a delete of its topic's records, so
the deployment stays within 16 KiB of its limit and the fronts' shares take all of
the room left), `offdel` (0, with `near`'s deletes: its baseline) and `at` (4 KiB,
filled before the rounds from both fronts, so each holds a share: every timed write
passes the limit, so the owner reads `front.slots`, asks the other front to give back
what it does not use, and refuses with the `429`).
Each round times `--n` sequential one-record writes of 32 bytes (`POST /v0/topics/q.N`,
keep-alive, to the first front, over ten topics, so some are forwarded to the other
front, their owner) on each deployment; deployments alternate round by round, so
machine load hits them alike.

With `--entries`, the same for `limits.max_idempotency_entries`: every write carries an
idempotency key of its own, and the sides are `off` (0), `far` (1,000,000, the
default) and `at` (64 entries, filled from both fronts before the rounds).

    python bench/jetstream_budget.py --rounds 5 --n 300
    python bench/jetstream_budget.py --rounds 5 --n 300 --entries
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

SIDES = {"off": "0", "far": str(1 << 30), "offdel": "0", "near": str(64 << 10), "at": "4096"}
ENTRY_SIDES = {"off": "0", "far": "1000000", "at": "64"}
KEYS = iter(range(1 << 62))
KEYED = [False]  # (set by `--entries`)
DELETES = ("offdel", "near")  # each timed write followed by an untimed delete
HEADERS = {"Content-Type": "application/json"}
BODY = b'{"records":[{"data":"' + b"x" * 30 + b'"}]}'  # 32 bytes stored
TOPICS = 10


def body() -> bytes:
    if not KEYED[0]:
        return BODY
    return BODY[:-1] + b',"idempotency_key":"k%d"}' % next(KEYS)


def call(conn: http.client.HTTPConnection, method: str, path: str, body: bytes) -> int:
    conn.request(method, path, body, HEADERS)
    r = conn.getresponse()
    r.read()
    return r.status


def run(port: int, n: int, side: str) -> float:
    """Mean seconds per timed write."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    want = (429,) if side == "at" else (200, 201)
    took = 0.0
    try:
        for i in range(n):
            topic = f"q.{i % TOPICS}"
            data = body()
            t0 = time.perf_counter()
            status = call(conn, "POST", f"/v0/topics/{topic}", data)
            took += time.perf_counter() - t0
            assert status in want, (side, status)
            if side in DELETES:
                below = b'{"before_seq":9007199254740991}'
                assert call(conn, "POST", f"/v0/topics/{topic}/delete", below) == 200
        return took / n
    finally:
        conn.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=300, help="writes per round and side")
    p.add_argument("--entries", action="store_true", help="max_idempotency_entries instead")
    args = p.parse_args()
    KEYED[0] = args.entries
    sides = ENTRY_SIDES if args.entries else SIDES
    name = "TOPICD_MAX_IDEMPOTENCY_ENTRIES" if args.entries else "TOPICD_MAX_TOTAL_BYTES"
    root = Path(tempfile.mkdtemp(prefix="jsbudget-"))
    proc, url = start_server(root)
    fronts: dict[str, list[Front]] = {}
    try:
        for side, limit in sides.items():
            env = {
                "TOPICD_STORAGE_BACKEND": "jetstream",
                "TOPICD_JETSTREAM_SERVERS": url,
                "TOPICD_JETSTREAM_PREFIX": f"budget{side}",
                name: limit,
            }
            fronts[side] = []
            for i in range(2):
                front = Front(root / side, f"f{i}", env)
                front.wait_ready()
                fronts[side].append(front)
        time.sleep(2)  # (the fronts' lease checks see each other)
        ports = {side: fs[0].port for side, fs in fronts.items()}
        if "near" in sides:
            near = http.client.HTTPConnection("127.0.0.1", ports["near"], timeout=30)
            fill = b'{"records":[{"data":"' + b"x" * (48 * 1024 - 2) + b'"}]}'
            assert call(near, "POST", "/v0/topics/fill", fill) == 201
            near.close()
        for side in sides:
            if side != "at":
                run(ports[side], 50, side)  # warm-up (and the topics)
        # fill `at` to its limit, from both fronts (each holds a share then)
        conns = [http.client.HTTPConnection("127.0.0.1", f.port, timeout=30) for f in fronts["at"]]
        i = 0
        while call(conns[i % 2], "POST", f"/v0/topics/q.{i % TOPICS}", body()) in (200, 201):
            i += 1
        for c in conns:
            c.close()
        got: dict[str, list[float]] = {}
        for k in range(args.rounds):
            order = list(sides) if k % 2 == 0 else list(reversed(sides))
            for side in order:
                got.setdefault(side, []).append(run(ports[side], args.n, side))
    finally:
        for fs in fronts.values():
            for front in fs:
                front.stop()
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    med = {}
    for side in sides:
        us = sorted(x * 1e6 for x in got[side])
        med[side] = statistics.median(us)
        print(
            f"{side:6s}: µs per write, median {med[side]:6.0f} "
            f"(rounds: {', '.join(f'{x:.0f}' for x in us)})"
        )
    for side, base in (("far", "off"), ("near", "offdel"), ("at", "off")):
        if side not in sides:
            continue
        print(
            f"{side:4s} - {base}: {med[side] - med[base]:+.0f} µs per write "
            f"({med[side] / med[base]:.2f}x)"
        )


if __name__ == "__main__":
    main()
