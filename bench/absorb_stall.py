#!/usr/bin/env python
"""How late the event loop runs while a checkpoint's absorb works in a thread.

    python bench/absorb_stall.py [--mib 32] [--rounds 3] [--topicd-src DIR]

A checkpoint's absorb (`SegmentStore.absorb`) runs in a worker thread and runs Python
between its C calls (it frames the records of a run, ~0.1 ms each); the loop thread,
each time it comes back from a blocking call, waits for the GIL until that thread
releases it. This script builds one topic's capture of `--mib` MiB of 1 KiB records (a
1 GiB `bench/retention.py` fill absorbs 32 MiB into its big topic per checkpoint) and
absorbs it into a temporary directory on the real filesystem (`--dir`, default the
system temp dir) in a Trio worker thread, while on the loop (a) a task sleeps 1 ms at a
time and records how late it wakes, and (b) a task does a 100-byte round trip over a
local socket pair (send, then receive on the other end: two blocking calls), and
records its time. Variants, alternated round after round in one process: Python's
default GIL switch interval (5 ms, also `engine.gil_switch_interval_us`'s default) and
1 ms.

Reported per variant: the median over rounds of the absorb's wall time, and of the
lateness / round-trip p50, p99 and max.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import trio


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


async def one(sg: Any, fs: Any, cfg: Any, encs: list[bytes | None], tmp: str) -> dict[str, Any]:
    n = len(encs)
    ts = 1_732_540_000_000
    work = sg.AbsorbWork(
        7, [sg.AbsorbSlice(1, list(encs), array("q", [ts] * n), array("I", [1] * n))], [], 1, n
    )
    store = sg.SegmentStore(fs, tmp, cfg)
    late: list[float] = []
    rtt: list[float] = []
    done = trio.Event()
    a, b = trio.socket.socketpair()
    msg = b"x" * 100

    async def sleeper() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await trio.sleep(0.001)
            late.append((time.perf_counter() - t0) * 1000 - 1.0)

    async def pinger() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await a.send(msg)
            got = 0
            while got < len(msg):
                got += len(await b.recv(4096))
            rtt.append((time.perf_counter() - t0) * 1000)
            await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper)
        nursery.start_soon(pinger)
        await trio.sleep(0.01)
        late.clear()
        rtt.clear()
        t0 = time.perf_counter()
        await trio.to_thread.run_sync(store.absorb, [work], set(), 0)
        wall = time.perf_counter() - t0
        done.set()
    a.close()
    b.close()
    return {"wall_ms": wall * 1000, "late": late, "rtt": rtt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32, help="MiB of 1 KiB records to absorb")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the temporary directory")
    ap.add_argument(
        "--topicd-src",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        metavar="DIR",
        help="directory holding the topicd package to measure",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(args.topicd_src))
    from topicd.config import SegmentsConfig
    from topicd.storage import segments as sg
    from topicd.storage.fs import RealFs

    variants = [("5000us", 0.005), ("1000us", 0.001)]
    n = args.mib * 1024
    data = b'"' + b"x" * 998 + b'"'
    encs: list[bytes | None] = [b'{"$seq":%d,"data":%b}' % (s, data) for s in range(1, n + 1)]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    before = sys.getswitchinterval()
    print(f"topicd from {args.topicd_src}; {n:,} records of 1 KiB per absorb")
    try:
        for r in range(args.rounds):
            for name, interval in variants:
                sys.setswitchinterval(interval)
                with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                    res = trio.run(one, sg, RealFs(), SegmentsConfig(), encs, tmp)
                results[name].append(res)
                print(
                    f"round {r + 1} {name:>6}: absorb {res['wall_ms']:.0f} ms; wake-up late "
                    f"p50 {pct(res['late'], 0.5):.2f} p99 {pct(res['late'], 0.99):.2f} max "
                    f"{max(res['late']):.1f} ms; round trip p50 {pct(res['rtt'], 0.5):.2f} "
                    f"p99 {pct(res['rtt'], 0.99):.2f} max {max(res['rtt']):.1f} ms",
                    flush=True,
                )
    finally:
        sys.setswitchinterval(before)
    print("medians over rounds:")
    med = statistics.median
    for name, runs in results.items():

        def m(key: str, q: float, runs: list[dict[str, Any]] = runs) -> float:
            return med([pct(x[key], q) for x in runs])

        print(
            f"  {name:>6}: absorb {med([x['wall_ms'] for x in runs]):.0f} ms; wake-up late "
            f"p50 {m('late', 0.5):.2f} p99 {m('late', 0.99):.2f} max {m('late', 1.0):.1f} ms; "
            f"round trip p50 {m('rtt', 0.5):.2f} p99 {m('rtt', 0.99):.2f} max "
            f"{m('rtt', 1.0):.1f} ms"
        )


if __name__ == "__main__":
    main()
