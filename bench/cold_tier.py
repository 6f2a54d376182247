#!/usr/bin/env python
"""The cold tier's cost: checkpoints that relocate segments, and reads from cold segments.

    python bench/cold_tier.py [--mib 128] [--rounds 2] [--dir DIR]

Runs the engine in this process on the real filesystem (temporary directories under
`--dir`; the cold directory is a sibling of the data directory, so on the same device:
this measures topicd's own work, not a slower disk) with the daemon's thread pools. Each
round runs two modes, alternated: `hot` (no cold tier) and `cold` (`storage.cold_dir`
set, `hot_retain_segments = 0`: every sealed segment moves). Each appends `--mib` MiB of
1 KiB records in 1000-record batches to one `disk` topic with a checkpoint after every
64 MiB, then takes one more checkpoint (it removes the hot copies of the previous one's
relocations), and reports: the summed checkpoint time, the longest event-loop stall
seen by a 1 ms ticker during the checkpoints, and the rate of a diff from seq 0 over the
whole topic with a payload cache of 0 (every record is read from its segment: hot
segments in one mode, cold ones in the other). Medians over the rounds are printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from topicd.clock import SystemWallClock
from topicd.config import Config, TieringConfig
from topicd.offload import ThreadOffload
from topicd.storage.fs import RealFs
from topicd.storage.service import open_durable_engine
from topicd.wire import DiffIn, RecordIn, TopicConfigIn, WriteIn

if TYPE_CHECKING:
    from topicd.engine.engine import Engine

RECORD = 1024
BATCH = 1000
CHECKPOINT_EVERY = 64 << 20


class Ticker:
    """The longest gap between 1 ms sleeps while `active` (the loop's stall)."""

    def __init__(self) -> None:
        self.active = False
        self.worst = 0.0

    async def run(self) -> None:
        last = time.perf_counter()
        while True:
            await trio.sleep(0.001)
            now = time.perf_counter()
            if self.active:
                self.worst = max(self.worst, now - last - 0.001)
            last = now


async def checkpoint(engine: Engine, ticker: Ticker) -> float:
    assert engine.checkpointer is not None
    ticker.active = True
    t0 = time.perf_counter()
    assert await engine.checkpointer.checkpoint()  # type: ignore[attr-defined]
    ticker.active = False
    return time.perf_counter() - t0


async def one(mode: str, mib: int, root: Path) -> dict[str, float]:
    cfg = Config()
    storage = dataclasses.replace(
        cfg.storage, data_dir=str(root / "data"), payload_cache_bytes=0, wal_shards=1
    )
    if mode == "cold":
        storage = dataclasses.replace(
            storage, cold_dir=str(root / "cold"), tiering=TieringConfig(hot_retain_segments=0)
        )
    cfg = dataclasses.replace(cfg, storage=storage)
    offload = ThreadOffload({"wal": 2, "misc": 4, "read": 8, "snapshot": 1})
    data = msgspec.Raw(b'"' + b"x" * (RECORD - 2) + b'"')
    batch = WriteIn(records=[RecordIn(data=data) for _ in range(BATCH)])
    ticker = Ticker()
    out: dict[str, float] = {}
    async with (
        open_durable_engine(cfg, RealFs(), offload, SystemWallClock(), boot_id="bench") as engine,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(ticker.run)
        await engine.put_topic("t", TopicConfigIn(durability="disk"))
        written = since = 0
        cp_s = 0.0
        while written < mib << 20:
            await engine.append("t", batch)
            written += BATCH * RECORD
            since += BATCH * RECORD
            if since >= CHECKPOINT_EVERY or written >= mib << 20:
                since = 0
                cp_s += await checkpoint(engine, ticker)
        cp_s += await checkpoint(engine, ticker)
        store = engine.checkpointer.segments  # type: ignore[union-attr]
        stats = store.stats()
        t0 = time.perf_counter()
        cursor = n = cold = 0
        while True:
            _, res = await engine.diff("t", DiffIn(from_seq=cursor, limit=1000))
            n += len(res.records)
            cold += res.cold_segments
            cursor = res.next_from_seq
            if res.caught_up:
                break
        read_s = time.perf_counter() - t0
        out = {
            "checkpoint_ms": cp_s * 1000,
            "stall_ms": ticker.worst * 1000,
            "diff_rps": n / read_s,
            "segments": stats["segments"],
            "cold_segments": stats["cold_segments"],
            "cold_reads": cold,
        }
        nursery.cancel_scope.cancel("done")
    return out


async def main(mib: int, rounds: int, parent: str | None) -> None:
    results: dict[str, list[dict[str, float]]] = {"hot": [], "cold": []}
    for r in range(rounds):
        for mode in ("hot", "cold") if r % 2 == 0 else ("cold", "hot"):
            with tempfile.TemporaryDirectory(dir=parent) as tmp:
                res = await one(mode, mib, Path(tmp))
            results[mode].append(res)
            print(
                f"round {r} {mode:4s}: checkpoints {res['checkpoint_ms']:7.0f} ms, "
                f"worst loop stall {res['stall_ms']:5.1f} ms, diff from 0 "
                f"{res['diff_rps']:9,.0f} records/s ({res['segments']:.0f} segments, "
                f"{res['cold_segments']:.0f} cold, {res['cold_reads']:.0f} cold reads)"
            )
    med = {
        mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        for mode, rs in results.items()
    }
    h, c = med["hot"], med["cold"]
    print(
        f"median: checkpoints hot {h['checkpoint_ms']:.0f} ms / cold {c['checkpoint_ms']:.0f} ms "
        f"({c['checkpoint_ms'] / h['checkpoint_ms']:.2f}x); stall hot {h['stall_ms']:.1f} / cold "
        f"{c['stall_ms']:.1f} ms; diff hot {h['diff_rps']:,.0f} / cold {c['diff_rps']:,.0f} "
        f"records/s ({c['diff_rps'] / h['diff_rps']:.2f}x)"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=128, help="MiB of records per run")
    ap.add_argument("--rounds", type=int, default=2, help="rounds (each runs both modes)")
    ap.add_argument("--dir", default=None, help="parent of the temporary directories")
    args = ap.parse_args()
    trio.run(main, args.mib, args.rounds, args.dir)
