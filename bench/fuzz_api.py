"""Long property-based fuzzing of the /v0 API from docs/openapi.yaml (the CI test,
tests/http/test_openapi_fuzz.py, runs the same driver for a second or two).

    python bench/fuzz_api.py --examples 5000 --requests 10
    python bench/fuzz_api.py --seconds 1800
    python bench/fuzz_api.py --faults --seconds 600
    python bench/fuzz_api.py --server --seconds 600

Default: each example is a fresh in-process app with a little state and `--requests`
requests generated from the document (`topicd.testing.fuzz_api`). `--server` runs one
real `topicd serve` in a subprocess instead (its own temporary data directory; the
requests then go over the socket, through the direct HTTP/1.1 path and Hypercorn) and
checks its log for tracebacks at the end. `--faults` runs each example on a durable
in-process app whose fake disk starts failing every sync, and heals, at drawn points.
Invariants: no 5xx but a documented `503`, every answer conforms to the document
strictly, no traceback in the log. A failure is
shrunk by Hypothesis and printed. At the end: the statuses seen per operation.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path

import httpx
import orjson
import trio
import trio.testing
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from topicd.testing.fuzz_api import SETUP, Fuzzer

BATCH = 200


def start_server(tmp: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    port_file = tmp / "port"
    log = tmp / "server.log"
    env = dict(os.environ, TOPICD_DATA_DIR=str(tmp / "data"), TOPICD_PORT_FILE=str(port_file))
    proc = subprocess.Popen(
        [sys.executable, "-m", "topicd", "serve", "--port", "0"],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.05)
    base = f"http://127.0.0.1:{int(port_file.read_text())}"
    while True:  # listening comes before ready (recovery)
        try:
            if httpx.get(base + "/v0/ready").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return proc, base, log


async def over_socket(fuzzer: Fuzzer, base: str, draw, n: int, seen: Counter) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:

        async def send(method, path, headers, body):
            headers = {"Accept-Encoding": "identity", **headers}  # httpx would ask for gzip
            async with client.stream(method, path, headers=headers, content=body) as r:
                raw = b"".join([chunk async for chunk in r.aiter_raw()])
            return r.status_code, dict(r.headers), raw

        await fuzzer.requests(send, draw, n, seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=10, help="requests per example")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: no bound)")
    ap.add_argument("--server", action="store_true", help="fuzz a real server in a subprocess")
    ap.add_argument(
        "--faults",
        action="store_true",
        help="in process: a durable app whose fake disk fails every sync, and heals",
    )
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--no-shrink", action="store_true", help="report a failure as found")
    args = ap.parse_args()
    fuzzer = Fuzzer(max_wait_ms=50 if args.server else None)
    seen: Counter[tuple[str, str, int]] = Counter()
    deadline = time.monotonic() + args.seconds if args.seconds else None
    # with a time bound: repeated Hypothesis runs of BATCH examples until it passes (a run
    # must not stop drawing half way, or Hypothesis reports a flaky strategy)
    examples = BATCH if deadline is not None else args.examples
    tmp = Path(tempfile.mkdtemp(prefix="fuzz_api-"))
    proc = base = log = None
    if args.server:
        proc, base, log = start_server(tmp)
        with httpx.Client(base_url=base) as c:
            for method, path, body in SETUP:
                c.request(
                    method,
                    path,
                    content=orjson.dumps(body),
                    headers={"Content-Type": "application/json"},
                )
    ran = [0]

    phases = [Phase.generate] if args.no_shrink else [Phase.generate, Phase.shrink]

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=phases,  # no "explain" phase: its tracing is slow on a whole server
    )
    @given(data=st.data())
    def run(data) -> None:
        ran[0] += 1
        if base is not None:
            trio.run(over_socket, fuzzer, base, data.draw, args.requests, seen)
        else:
            # virtual time: long-polls and timers cost nothing
            clock = trio.testing.MockClock(autojump_threshold=0)
            trio.run(
                partial(fuzzer.exercise, faults=args.faults),
                data.draw,
                args.requests,
                seen,
                clock=clock,
            )

    if args.seed is not None:
        run = seed(args.seed)(run)
    t0 = time.monotonic()
    try:
        run()
        while deadline is not None and time.monotonic() < deadline:
            run()  # a new random seed each time (no example database)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if log is not None:
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, text[-5000:]
    print(
        f"ok: {ran[0]} examples x {args.requests} requests in {time.monotonic() - t0:.1f} s"
        f" ({'server' if args.server else 'in-process'}), no invariant broken"
    )
    for key, n in sorted(seen.items()):
        print(*key, n)


if __name__ == "__main__":
    main()
