#!/usr/bin/env python
"""How long a checkpoint's encoding and writing stall the event loop.

    python bench/checkpoint_stall.py [--records 1500000] [--repeat 3]

A checkpoint encodes and writes the snapshot in a thread (`trio.to_thread`), but a thread
holds the GIL for the whole of any one C call, so a long `b"".join`, msgpack encode or
bytes concatenation stops the event loop for its whole length. This script builds the
capture of one topic of `--records` records shaped like bench/http_core.py's, then, per
round, runs in a thread (a) `snapshot.encode` + `write_snapshot` (the current layout:
records after the body, joined and written in pieces) and (b) the same work laid out as
snapshot version 1 did (one join of all records, the records inside the msgpack body, the
header concatenated in front), while a Trio task measures how long each
`trio.sleep(0)` round trip takes. Reported per layout: the median over rounds of the
longest stall and of the total time. The files go to a temporary directory on the data
disk's filesystem (`--dir`, default the system temp dir).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

import trio
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from topicd.storage import snapshot
from topicd.storage.fs import RealFs, replace_file


def make_capture(n: int) -> snapshot.Capture:
    encs: list[bytes | None] = [
        b'{"$seq":%d,"$ts":1795000000000,"data":{"room":"lab-2","celsius":21.4}}' % i
        for i in range(1, n + 1)
    ]
    run = snapshot.RunCopy(1, encs, array("q", [1795000000000] * n), array("I", [40] * n))
    topic = snapshot.TopicSnap(
        id=1, name="bench", config={}, head=n, reserved=n, earliest=1, evict_floor=0,
        evictions=[], lost=[], last_ts=0, last_write_ts=None, last_read_ts=None, runs=[],
    )  # fmt: skip
    body = snapshot.SnapshotBody(snapshot.VERSION, 0, 2, 1, [(0, 64)], [topic], [])
    return snapshot.Capture(body, [[run]], fresh=[topic])


def fresh(cap: snapshot.Capture) -> snapshot.Capture:
    for topic in cap.body.topics:
        topic.runs = []
    return cap


def current(cap: snapshot.Capture, root: str) -> int:
    pieces = snapshot.encode(fresh(cap))
    snapshot.write_snapshot(RealFs(), root, 1, pieces, 1)
    return sum(len(p) for p in pieces)


def version1(cap: snapshot.Capture, root: str) -> int:
    """The old layout's work: every record joined at once, inside the body, then copied
    once more behind the header (written as one piece)."""
    body = fresh(cap).body
    for snap, copies in zip(body.topics, cap.runs, strict=True):
        for run in copies:
            lens = array("I", [snapshot.DEAD if e is None else len(e) for e in run.encs])
            blob = b"".join([e for e in run.encs if e is not None])
            snap.runs.append(
                snapshot.RunSnap(
                    run.base, lens.tobytes(), run.ts.tobytes(), run.sizes.tobytes(), blob
                )
            )
    payload = snapshot._ENC.encode(body)
    data = (
        snapshot.HEADER.pack(snapshot.MAGIC, 1, 1, len(payload), xxhash.xxh3_64_intdigest(payload))
        + payload
    )
    replace_file(RealFs(), str(Path(root) / "v1.bin"), data)
    return len(data)


async def one(fn, cap: snapshot.Capture, root: str) -> tuple[float, float, int]:
    worst = 0.0
    done = False
    size = 0

    async def job() -> None:
        nonlocal done, size
        size = await trio.to_thread.run_sync(fn, cap, root)
        done = True

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(job)
        while not done:
            a = time.perf_counter()
            await trio.sleep(0)
            worst = max(worst, time.perf_counter() - a)
    return worst * 1000, (time.perf_counter() - t0) * 1000, size


async def main_async(args: argparse.Namespace) -> None:
    cap = make_capture(args.records)
    results: dict[str, list[tuple[float, float, int]]] = {"current": [], "version 1": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for r in range(args.repeat):
            order = [("current", current), ("version 1", version1)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                got = await one(fn, cap, root)
                results[name].append(got)
                print(f"round {r + 1} {name:10s} stall {got[0]:7.1f} ms  total {got[1]:7.1f} ms  "
                      f"{got[2] / 1e6:.1f} MB", flush=True)  # fmt: skip
    print(f"\n{args.records:,} records, medians of {args.repeat} rounds:")
    base = statistics.median(x[0] for x in results["version 1"])
    for name, rows in results.items():
        stall = statistics.median(x[0] for x in rows)
        total = statistics.median(x[1] for x in rows)
        print(f"  {name:10s} longest loop stall {stall:7.1f} ms ({stall / base:.2f}× version 1), "
              f"encode+write {total:7.1f} ms")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=1_500_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the snapshot files go")
    trio.run(main_async, p.parse_args())


if __name__ == "__main__":
    main()
