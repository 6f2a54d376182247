#!/usr/bin/env python
"""CPU per record of a checkpoint's absorb: records copied from memory into segments.

    python bench/absorb_cost.py [--records 200000] [--bytes 100] [--repeat 3]
    python bench/absorb_cost.py --topicd-src DIR     # another checkout's topicd

Builds one topic's capture (`AbsorbWork`: a slice of `--records` plain records of a
`--bytes` JSON string each, as `capture_absorb` takes them on the loop) and runs
`SegmentStore.absorb` on it into a temporary directory on the real filesystem, with the
default segment triggers: framing, indexing, writing, sealing and syncing, the work a
checkpoint's thread does per record written. Prints the process CPU time per record of
each repetition (`time.process_time`, so the `fdatasync` waits are not counted).
Every record a durable write makes is absorbed once, in the thread that competes with
the event loop for the GIL, so this is a per-record cost of the write path.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from array import array
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--bytes", type=int, default=100, help="bytes of each record's data")
    ap.add_argument("--repeat", type=int, default=3)
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

    n = args.records
    ts = 1_732_540_000_000
    data = b'"' + b"x" * (args.bytes - 2) + b'"'
    encs: list[bytes | None] = [
        b'{"$seq":%d,"$ts":%d,"data":%b}' % (seq, ts, data) for seq in range(1, n + 1)
    ]
    print(f"topicd from {args.topicd_src}; {n:,} records of {args.bytes} data bytes")
    for _ in range(args.repeat):
        work = sg.AbsorbWork(
            7, [sg.AbsorbSlice(1, list(encs), array("q", [ts] * n), array("I", [1] * n))], [], 1, n
        )
        with tempfile.TemporaryDirectory() as tmp:
            store = sg.SegmentStore(RealFs(), tmp, SegmentsConfig())
            t0 = time.process_time()
            store.absorb([work], set(), 0)
            cpu = time.process_time() - t0
        print(f"absorb: {cpu / n * 1e6:.2f} µs of CPU per record")


if __name__ == "__main__":
    main()
