#!/usr/bin/env python
"""What the client library's write costs the server, on the fast path and through Quart.

    python bench/sdk_write_path.py [--rounds 5] [--duration 3] [--warmup 1]
                                   [--concurrency 16] [--pin]

`topicd.client` writes with `?return_seqs=false` (the answer then carries the first and
last seq, not one number per record). Until 2026-11-28 the gate's fast path
(`Gate.serve_direct`: no ASGI exchange, no framework) took only writes without a query
string, so every write the client library made went through Quart. The fast path now
takes `return_seqs` alone too. This bench measures the three shapes on one server, in
one run, alternating their order each round:

* `plain`: `POST /v0/topics/:t` (no query; the fast path before and after);
* `sdk`: `POST /v0/topics/:t?return_seqs=false` (the client library's write; the fast
  path now);
* `quart`: `POST /v0/topics/:t?return_seqs=false&path=quart` (a second parameter sends it
  through Quart, as the client library's write went before).

Load: bench/loadgen.py's raw-socket keep-alive client (closed loop, `--concurrency`
connections over 2 processes), 1- and 100-record batches to topics the first write
creates (the default class), one topic per shape and batch. Reported per shape and
batch: the median over the rounds of requests/s and of the server's CPU µs per request
(from /proc). With `--pin` the server runs on CPU 0 and the load on CPU 1.
Needs nothing beyond the project's own dependencies.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import http_core
import loadgen

SHAPES = {
    "plain": "",
    "sdk": "?return_seqs=false",
    "quart": "?return_seqs=false&path=quart",
}
BATCHES = (1, 100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--pin", action="store_true", help="server on CPU 0, load on CPU 1")
    args = ap.parse_args()
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="topicd-sdkpath-") as tmp:
        server = http_core.topicd_server(Path(tmp), http_core.REPO_DIR)
        workers = http_core.Workers(2, 1 if args.pin else None)
        try:
            server.start(cpu=0 if args.pin else None)
            port = server.port
            for rnd in range(args.rounds):
                order = list(SHAPES) if rnd % 2 == 0 else list(reversed(SHAPES))
                for batch in BATCHES:
                    body = http_core.write_body(batch)
                    for shape in order:
                        path = f"/v0/topics/w{batch}-{shape}{SHAPES[shape]}"
                        req = loadgen.build_request(http_core.HOST, port, path, body)
                        res = http_core.run_throughput(
                            workers,
                            server,
                            lambda i, r=req: [r],
                            "write",
                            batch,
                            args.concurrency,
                            args,
                        )
                        if res["errors"]:
                            raise SystemExit(f"{shape} b{batch}: {res['first_error']}")
                        results.setdefault((shape, batch), []).append(res)
                print(f"round {rnd + 1} done", flush=True)
        finally:
            workers.close()
            server.stop()
    print(f"\n{shlex.join(sys.orig_argv)}")
    print(f"{'shape':8} {'batch':>5} {'req/s':>10} {'records/s':>11} {'server µs/req':>14}")
    for batch in BATCHES:
        base = statistics.median(r["server_cpu_us_per_req"] for r in results[("quart", batch)])
        for shape in SHAPES:
            rs = results[(shape, batch)]
            rps = statistics.median(r["req_per_s"] for r in rs)
            us = statistics.median(r["server_cpu_us_per_req"] for r in rs)
            print(
                f"{shape:8} {batch:5d} {rps:10,.0f} {rps * batch:11,.0f} {us:14.1f}"
                f"  ({us / base:.2f}× quart's)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
