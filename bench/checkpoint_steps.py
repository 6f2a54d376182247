#!/usr/bin/env python
"""The checkpoint's own loop steps while a retention-style fill runs, in one process.

    python bench/checkpoint_steps.py [--gib 3]
    PYTHONPATH=<checkout of another tree> python bench/checkpoint_steps.py --gib 3

Fills `--gib` of 1 KiB records in 1000-record `disk` writes — every other write to one
topic (`big`), the rest round-robin over 1,000 topics, as `bench/retention.py` does — from
two writer tasks calling the engine directly (no HTTP), on real files in a temporary
directory (`--dir`), with the default config, so checkpoints run as they do in the
server. Every checkpoint but the final one is timed by a `StepMeter` (loaded from this
checkout's `topicd/sched/steps.py` by path, so it also measures a tree that has none: put
that tree first on `PYTHONPATH`). Reported: the longest own step of each checkpoint —
wall time and the loop thread's CPU time in it (the CPU is what the tree costs; the wall
also holds the waits for a core on a busy machine) — as max, p90 and p50 over the
checkpoints, the steps with the most CPU and where they ran, the checkpoints' duration
and the longest garbage collection. Alternate trees in rounds and compare the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

from topicd import daemon
from topicd.clock import SystemWallClock
from topicd.offload import ThreadOffload
from topicd.storage import checkpoint
from topicd.storage.fs import RealFs
from topicd.storage.service import open_durable_engine
from topicd.testing.harness import make_config
from topicd.wire import RecordIn, WriteIn

_STEPS = Path(__file__).resolve().parent.parent / "topicd" / "sched" / "steps.py"


def load_meter() -> Any:
    spec = importlib.util.spec_from_file_location("bench_steps", _STEPS)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StepMeter


async def fill(data_dir: str, gib: float, rows: list[dict[str, Any]]) -> float:
    meter_cls = load_meter()
    original = checkpoint.Checkpointer.checkpoint

    async def timed(self: checkpoint.Checkpointer, *, final: bool = False) -> bool:
        meter = meter_cls()
        with meter.span():
            ok = await original(self, final=final)
        if not final:
            rows.append(
                {
                    "wall": meter.own_s * 1000,
                    "cpu": meter.own_cpu_s * 1000,
                    "gc": meter.gc_s * 1000,
                    "where": f"{meter.own_from} -> {meter.own_at}",
                    "ms": self.last_duration_ms,
                }
            )
        return ok

    checkpoint.Checkpointer.checkpoint = timed  # type: ignore[method-assign]
    cfg = make_config()
    cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, data_dir=data_dir))
    offload = ThreadOffload({"wal": 8, "misc": 4, "read": 4, "snapshot": 1}, dedicated=("wal",))
    req = WriteIn(records=[RecordIn(data=msgspec.Raw(b'"' + b"x" * 1022 + b'"'))] * 1000)
    async with open_durable_engine(
        cfg, RealFs(), offload, SystemWallClock(), boot_id="bench"
    ) as engine:
        daemon.settle_gc(cfg.engine.gc_threshold0)
        total = int(gib * (1 << 30)) // 1024
        written = 0
        t0 = time.perf_counter()

        async def writer(i: int) -> None:
            nonlocal written
            while written < total:
                topic = "big" if i % 2 == 0 else f"small-{(i // 2) % 1000}"
                await engine.append(topic, req)
                written += 1000
                i += 2

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer, 0)
            nursery.start_soon(writer, 1)
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=3.0)
    ap.add_argument("--dir", default=None, help="parent of the temporary data directory")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        took = trio.run(fill, tmp, args.gib, rows)
    if not rows:
        print("no checkpoint ran")
        return 1
    cpu = sorted(r["cpu"] for r in rows)
    wall = sorted(r["wall"] for r in rows)
    print(
        f"tree {Path(checkpoint.__file__).parent.parent.parent}: {args.gib:g} GiB in {took:.0f} s, "
        f"{len(rows)} checkpoints (median {statistics.median(r['ms'] for r in rows):.0f} ms, "
        f"max {max(r['ms'] for r in rows):.0f} ms); checkpoint's longest own step: CPU max "
        f"{cpu[-1]:.2f} p90 {cpu[len(cpu) * 9 // 10]:.2f} p50 {statistics.median(cpu):.2f} ms, "
        f"wall max {wall[-1]:.1f} p50 {statistics.median(wall):.1f} ms; longest collection "
        f"{max(r['gc'] for r in rows):.1f} ms"
    )
    for r in sorted(rows, key=lambda r: -r["cpu"])[:3]:
        print(f"    CPU {r['cpu']:.2f} ms, wall {r['wall']:.1f} ms: {r['where']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
