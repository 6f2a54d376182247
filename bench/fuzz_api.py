"""Long property-based fuzzing of the /v0 API from docs/openapi.yaml (the CI test runs
the same driver for about a second).

    python bench/fuzz_api.py --examples 5000 --requests 10
    python bench/fuzz_api.py --seconds 1800

Each example is a fresh in-process app with a little state and `--requests` requests
generated from the document (`topicd.testing.fuzz_api`); invariants: no 5xx but a
documented `503`, every answer conforms to the document strictly, no traceback in the
log. A failure is shrunk by Hypothesis and printed. At the end: the statuses seen per
operation.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topicd.testing.fuzz_api import Fuzzer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=10, help="requests per example")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: no bound)")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    fuzzer = Fuzzer()
    seen: Counter[tuple[str, str, int]] = Counter()
    deadline = time.monotonic() + args.seconds if args.seconds else None
    examples = 10**9 if args.seconds and args.examples == 2000 else args.examples

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def run(data) -> None:
        if deadline is not None and time.monotonic() > deadline:
            return
        trio.run(fuzzer.exercise, data.draw, args.requests, seen)

    if args.seed is not None:
        run = __import__("hypothesis").seed(args.seed)(run)
    t0 = time.monotonic()
    run()
    print(
        f"ok: {examples if deadline is None else 'until the time limit'} examples x "
        f"{args.requests} requests in {time.monotonic() - t0:.1f} s, no invariant broken"
    )
    for key, n in sorted(seen.items()):
        print(*key, n)


if __name__ == "__main__":
    main()
