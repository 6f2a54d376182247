#!/usr/bin/env python
"""The capture of a checkpoint (on the event loop, in steps that yield) for many topics.

    python bench/checkpoint_capture.py [--topics 20000]

An engine on the in-memory `FakeDisk` (no I/O cost) gets `--topics` topics of 3 records
of about 100 bytes; then three checkpoints are taken and `snapshot.capture_stepwise` is
timed in each (its wall time, its yields included: nothing else runs on the loop here):
the first (everything is captured), one after 10 topics got a write (incremental: those
10), one with nothing changed. The longest single step is what `bench/many_topics.py`
reports as the longest loop gap.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

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
        orig = snapshot.capture_stepwise
        times: list[float] = []

        async def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = await orig(*a, **k)
            times.append(time.perf_counter() - t0)
            return out

        snapshot.capture_stepwise = timed  # type: ignore[assignment]
        try:
            await cp.checkpoint()  # type: ignore[attr-defined]
            for i in range(10):
                await engine.append(f"t{i}", req)
            await cp.checkpoint()  # type: ignore[attr-defined]
            await cp.checkpoint()  # type: ignore[attr-defined]
        finally:
            snapshot.capture_stepwise = orig  # type: ignore[assignment]
        first, ten, none = (t * 1000 for t in times)
        print(
            f"{n} topics: capture of the first checkpoint {first:.1f} ms; "
            f"after 10 topics changed {ten:.1f} ms; nothing changed {none:.1f} ms"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topics", type=int, default=20000)
    trio.run(main, ap.parse_args().topics)
