#!/usr/bin/env python
"""The synchronous part of a checkpoint (the capture, on the event loop) for many topics.

    python bench/checkpoint_capture.py [--topics 20000]

An engine on the in-memory `FakeDisk` (no I/O cost) gets `--topics` topics of 3 records
of about 100 bytes; then three checkpoints are taken and `snapshot.capture` is timed in
each: the first (everything is captured), one after 10 topics got a write (incremental:
those 10), one with nothing changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from topicd.config import Config  # noqa: TC001 - used at run time by dataclasses
from topicd.storage import snapshot
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import RecordIn, WriteIn


def config() -> Config:
    """No checkpoint but the three this script takes."""
    cfg = durable_config()
    snap = dataclasses.replace(
        cfg.storage.snapshot, interval_ms=1 << 40, wal_bytes_threshold=1 << 50
    )
    return dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, snapshot=snap))


async def main(n: int) -> None:
    async with open_durable(FakeDisk(), config()) as engine:
        req = WriteIn(records=[RecordIn(data=msgspec.Raw(b'"' + b"x" * 90 + b'"'))] * 3)
        for i in range(n):
            await engine.append(f"t{i}", req)
        cp = engine.checkpointer
        assert cp is not None
        orig = snapshot.capture
        times: list[float] = []

        def timed(*a: object, **k: object) -> snapshot.Capture:
            t0 = time.perf_counter()
            out = orig(*a, **k)  # type: ignore[arg-type]
            times.append(time.perf_counter() - t0)
            return out

        snapshot.capture = timed  # type: ignore[assignment]
        try:
            await cp.checkpoint()  # type: ignore[attr-defined]
            for i in range(10):
                await engine.append(f"t{i}", req)
            await cp.checkpoint()  # type: ignore[attr-defined]
            await cp.checkpoint()  # type: ignore[attr-defined]
        finally:
            snapshot.capture = orig
        first, ten, none = (t * 1000 for t in times)
        print(
            f"{n} topics: capture of the first checkpoint {first:.1f} ms; "
            f"after 10 topics changed {ten:.1f} ms; nothing changed {none:.1f} ms"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topics", type=int, default=20000)
    trio.run(main, ap.parse_args().topics)
