#!/usr/bin/env python
"""What recovery's search past an invalid WAL frame costs per byte.

    python bench/recovery_scan.py [--mib 64] [--repeat 3]

Recovery reads frames until the first invalid one, then searches the rest of the file
for a checksum-valid frame: none means a torn tail, one means corruption in the middle of
the log. The rest of a file can be tens of MiB of record text (a frame that failed its
checks) or of zeros (preallocated space). This script builds `--mib` MiB of each — JSON
record text with NUL separators, as an Append frame body holds, and zeros — plus one
valid frame at the very end, and times `frame.find_valid_frame` over it against the
baseline it replaced: parsing a frame head at every offset in Python (timed over 1 MiB
and scaled, since the full run takes minutes). Reported: the median over rounds in ms
and MB/s, and the ratio. Needs nothing but topicd itself.
"""

from __future__ import annotations

import argparse
import statistics
import time

from topicd.storage import frame as frames

MAX_FRAME = 16 << 20


def per_offset(buf: bytes, start: int, limit: int) -> int:
    """The old search: try to parse a frame at every offset (zero runs included)."""
    for pos in range(start, limit - frames.FRAME_HEAD_LEN + 1):
        try:
            if frames.read_frame(buf, pos, limit, MAX_FRAME) is not None:
                return pos
        except frames.FrameError:
            return pos
    return -1


def build(kind: str, size: int) -> tuple[bytes, int]:
    tail = frames.encode_control(frames.PROBE, 1, 1, {})
    if kind == "text":
        rec = b'{"$seq":123456,"$ts":1795598223095,"data":{"room":"lab-1","celsius":19.8}}\x00'
        body = (rec * (size // len(rec) + 1))[:size]
    else:
        body = bytes(size)
    return body + tail, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    size = args.mib << 20
    print(f"searching {args.mib} MiB for the one valid frame at its end, median of {args.repeat}")
    for kind in ("text", "zeros"):
        buf, expect = build(kind, size)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            found = frames.find_valid_frame(buf, 0, len(buf), MAX_FRAME)
            times.append(time.perf_counter() - t0)
            assert found == expect, (found, expect)
        scan = statistics.median(times)
        small, _ = build(kind, 1 << 20)
        t0 = time.perf_counter()
        assert per_offset(small, 0, len(small)) == 1 << 20
        old = (time.perf_counter() - t0) * args.mib
        print(
            f"{kind:6} scan {scan * 1000:8.1f} ms ({size / scan / 1e6:7.0f} MB/s)   "
            f"per-offset Python {old:7.1f} s (scaled from 1 MiB)   {old / scan:6.0f}x"
        )


if __name__ == "__main__":
    main()
