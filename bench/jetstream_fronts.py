"""Two jetstream fronts: what forwarding a write to the owner front costs.

Starts a nats-server (JetStream on, a temporary store, a random loopback port) and two
`topicd serve` processes on one prefix: the first takes the owner lease (one shard), the
second forwards its writes to it. Each round times `--n` sequential single-record writes
(c=1, one keep-alive HTTP/1.1 connection) sent to the owner (`direct`) and the same sent
to the follower (`forwarded`: the follower's bridge, one NATS request, the owner's
engine and JetStream publish, the answer back), the two sides alternated round by round
so machine load hits both alike; then `--reads` one-record diff reads on each (a
follower's read first asks JetStream for the topic's entry and last seq).

    python bench/jetstream_fronts.py --rounds 5 --n 500
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from jetstream_bridge import start_server
from jetstream_failover import Front


def timed(conn: http.client.HTTPConnection, path: str, body: bytes, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        assert r.status in (200, 201), (r.status, data)
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=500, help="writes per round and side")
    p.add_argument("--reads", type=int, default=500, help="reads per round and side")
    p.add_argument("--size", type=int, default=100, help="pad bytes per record")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jsfronts-"))
    proc, url = start_server(root)
    env = {
        "TOPICD_STORAGE_BACKEND": "jetstream",
        "TOPICD_JETSTREAM_SERVERS": url,
        "TOPICD_JETSTREAM_PREFIX": "fronts",
    }
    fronts: list[Front] = []
    try:
        for name in ("owner", "follower"):
            front = Front(root, name, env)
            front.wait_ready()
            fronts.append(front)
        assert ": owner" in fronts[0].text()
        time.sleep(2)  # the owner's next lease checks see the follower (notices on)
        conns = {
            side: http.client.HTTPConnection("127.0.0.1", f.port, timeout=30)
            for side, f in zip(("direct", "forwarded"), fronts, strict=True)
        }
        body = json.dumps({"records": [{"data": {"i": 1, "pad": "x" * args.size}}]}).encode()
        writes: dict[str, list[float]] = {"direct": [], "forwarded": []}
        reads: dict[str, list[float]] = {"direct": [], "forwarded": []}
        for side, conn in conns.items():  # warm-up, and the topics
            timed(conn, f"/v0/topics/{side}", body, 50)
        diff = json.dumps({"from_seq": 0, "limit": 1}).encode()
        for k in range(args.rounds):
            order = ("direct", "forwarded") if k % 2 == 0 else ("forwarded", "direct")
            for side in order:
                writes[side].append(timed(conns[side], f"/v0/topics/{side}", body, args.n))
            for side in order:
                reads[side].append(timed(conns[side], f"/v0/topics/{side}/diff", diff, args.reads))
    finally:
        for front in fronts:
            front.stop()
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    for title, table in (("single-record write", writes), ("one-record diff read", reads)):
        for side, per in table.items():
            us = sorted(x * 1e6 for x in per)
            print(
                f"{side:10s} {title}, c=1: median {statistics.median(us):7.0f} µs "
                f"(rounds: {', '.join(f'{x:.0f}' for x in us)})"
            )
        ratio = statistics.median(table["forwarded"]) / statistics.median(table["direct"])
        print(f"{title}: follower / owner {ratio:.2f}x")


if __name__ == "__main__":
    main()
