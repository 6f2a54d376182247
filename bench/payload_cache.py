#!/usr/bin/env python
"""Memory with long retention: RSS while records pile up, for a payload cache bound.

    python bench/payload_cache.py [--mib 1024] [--cache-mib 64] [--dir DIR]

Runs the engine in this process on the real filesystem (a temporary directory under
`--dir`) with the daemon's thread pools, and appends `--mib` MiB of 1 KiB records in
1000-record batches to one `disk` topic, taking a checkpoint after every 64 MiB (what
`storage.snapshot.wal_bytes_threshold` would trigger). After each checkpoint it prints the
records retained, the process RSS, the payload cache's bytes and the bytes of records not
yet absorbed (pinned). At the end it reads the whole topic back from seq 0 (every miss
goes to the segments) and reports the rate and the RSS. Run it once with a cache larger
than `--mib` to see the unbounded case.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from topicd.clock import SystemWallClock
from topicd.config import Config
from topicd.offload import ThreadOffload
from topicd.storage.fs import RealFs
from topicd.storage.service import open_durable_engine
from topicd.wire import DiffIn, RecordIn, TopicConfigIn, WriteIn

RECORD = 1024
BATCH = 1000
CHECKPOINT_EVERY = 64 << 20


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def main(mib: int, cache_mib: int, root: str) -> None:
    cfg = Config()
    storage = dataclasses.replace(
        cfg.storage, data_dir=root, payload_cache_bytes=cache_mib << 20, wal_shards=1
    )
    cfg = dataclasses.replace(cfg, storage=storage)
    offload = ThreadOffload({"wal": 2, "misc": 4, "read": 8, "snapshot": 1})
    data = msgspec.Raw(b'"' + b"x" * (RECORD - 2) + b'"')
    batch = WriteIn(records=[RecordIn(data=data) for _ in range(BATCH)])
    print(f"rss at start: {rss_mib():.0f} MiB; cache bound {cache_mib} MiB")
    async with open_durable_engine(
        cfg, RealFs(), offload, SystemWallClock(), boot_id="bench"
    ) as engine:
        await engine.put_topic("t", TopicConfigIn(durability="disk"))
        topic = engine.get("t")
        written = since = 0
        t0 = time.perf_counter()
        while written < mib << 20:
            await engine.append("t", batch)
            written += BATCH * RECORD
            since += BATCH * RECORD
            if since >= CHECKPOINT_EVERY or written >= mib << 20:
                since = 0
                assert engine.checkpointer is not None
                await engine.checkpointer.checkpoint()  # type: ignore[attr-defined]
                stats = engine.payloads.stats()
                pinned = topic.resident_bytes(topic.absorbed_to + 1, topic.head_seq)
                print(
                    f"retained {written >> 20:6d} MiB  rss {rss_mib():7.0f} MiB  "
                    f"cache {stats.bytes >> 20:5d} MiB  pinned {pinned >> 20:4d} MiB"
                )
        write_s = time.perf_counter() - t0
        print(f"wrote {written >> 20} MiB in {write_s:.1f} s ({written / write_s / 1e6:.0f} MB/s)")
        t0 = time.perf_counter()
        cursor = n = 0
        while True:
            _, res = await engine.diff("t", DiffIn(from_seq=cursor, limit=1000))
            n += len(res.records)
            cursor = res.next_from_seq
            if res.caught_up:
                break
        read_s = time.perf_counter() - t0
        stats = engine.payloads.stats()
        print(
            f"diff from 0: {n} records in {read_s:.1f} s ({n / read_s:,.0f} records/s); "
            f"misses {stats.misses}, loaded {stats.loaded_bytes >> 20} MiB; "
            f"rss {rss_mib():.0f} MiB, cache {stats.bytes >> 20} MiB"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="MiB of records to retain")
    ap.add_argument("--cache-mib", type=int, default=64, help="storage.payload_cache_bytes")
    ap.add_argument("--dir", default=None, help="parent of the temporary data directory")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        trio.run(main, args.mib, args.cache_mib, str(Path(tmp) / "data"))
