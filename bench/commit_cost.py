#!/usr/bin/env python
"""What a `disk` write costs the commit path on top of an `ephemeral` one, in process.

    python bench/commit_cost.py [--n 4000] [--conc 16] [--batch 100] [--rounds 3]

A durable engine (`open_durable_engine`: the real WAL on the real file system, in a
temporary directory, checkpoints off) and, per round and class, one topic that `--conc`
tasks write `--batch`-record batches to through `Engine.append` until `--n` writes are
done (the body decoded each time, as the HTTP path does); no sockets, no HTTP. The two
classes alternate, the first one changing every round. Per class it prints the wall
time, the process CPU (all threads, user and system) and the context switches per
write, and the medians. The `ephemeral` write publishes in its own task; the `disk` write
is framed, queued, written by the shard's committer thread and published on its return,
so the difference is what the commit path adds. For an A/B, run it from each checkout's
directory in turn (`cd DIR && python PATH/bench/commit_cost.py`): the `topicd` of the
current directory comes first on the path.

`--det` makes the work per write the same from run to run, for instruction counts on a
busy machine: the WAL calls run inline on the loop (`InlineOffload`), under Trio's
`MockClock` (time stands still, no timer fires), with the garbage collector off, and
the process ends right after the last window (no shutdown checkpoint, which would absorb
every `disk` record). Run under valgrind, the difference of the instruction counts of
`--n 3000` and `--n 1000` (one round, one class) over 2,000 writes is the instructions
per write, a measure no other load on the machine moves:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python PATH/bench/commit_cost.py --det --rounds 1 --classes disk --n 3000
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import trio
import trio.testing

sys.path.insert(0, str(Path.cwd()))

from topicd.clock import SystemWallClock
from topicd.config import Config
from topicd.offload import InlineOffload, Offload, ThreadOffload
from topicd.storage.fs import RealFs
from topicd.storage.service import open_durable_engine
from topicd.wire import TopicConfigIn, decode_write

RECORD = {"data": {"room": "lab-2", "celsius": 21.4}}  # bench/http_core.py's record


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4000, help="writes per class and round")
    p.add_argument("--conc", type=int, default=16, help="concurrent writer tasks")
    p.add_argument("--batch", type=int, default=100, help="records per write")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--classes", default="disk,ephemeral", help="comma-separated classes")
    p.add_argument("--det", action="store_true", help="deterministic work (see docstring)")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    body = orjson.dumps({"records": [RECORD] * a.batch})
    root = Path(tempfile.mkdtemp(prefix="topicd-commit-cost-"))
    cfg = Config()
    snap = dataclasses.replace(
        cfg.storage.snapshot, wal_bytes_threshold=1 << 40, interval_ms=7 * 86_400_000
    )
    storage = dataclasses.replace(cfg.storage, data_dir=str(root / "data"), snapshot=snap)
    cfg = dataclasses.replace(cfg, storage=storage)
    classes = a.classes.split(",")
    results: dict[str, list[tuple[float, float]]] = {c: [] for c in classes}

    async def run() -> None:
        offload: Offload
        if a.det:
            gc.disable()
            offload = InlineOffload()
        else:
            offload = ThreadOffload(
                {"wal": 8, "misc": 4, "read": 8, "snapshot": 1}, dedicated=("wal",)
            )
        async with open_durable_engine(
            cfg, RealFs(), offload, SystemWallClock(), boot_id="bench", recover_in_thread=not a.det
        ) as engine:
            for r in range(a.rounds):
                order = classes if r % 2 == 0 else classes[::-1]
                for c in order:
                    name = f"cost-{c}-r{r}"
                    await engine.put_topic(name, TopicConfigIn(durability=c))
                    left = [a.n]

                    async def writer(name: str = name, left: list[int] = left) -> None:
                        while left[0] > 0:
                            left[0] -= 1
                            await engine.append(name, decode_write(body))

                    ru0 = resource.getrusage(resource.RUSAGE_SELF)
                    t0 = time.perf_counter()
                    async with trio.open_nursery() as nursery:
                        for _ in range(a.conc):
                            nursery.start_soon(writer)
                    wall = time.perf_counter() - t0
                    ru1 = resource.getrusage(resource.RUSAGE_SELF)
                    user = ru1.ru_utime - ru0.ru_utime
                    system = ru1.ru_stime - ru0.ru_stime
                    results[c].append((wall, user + system))
                    per = 1e6 / a.n
                    switches = (ru1.ru_nvcsw - ru0.ru_nvcsw) + (ru1.ru_nivcsw - ru0.ru_nivcsw)
                    print(
                        f"round {r + 1} {c:<10} {a.n / wall:8,.0f} writes/s  wall "
                        f"{wall * per:6.1f} µs  CPU {(user + system) * per:6.1f} µs (user "
                        f"{user * per:.1f}, system {system * per:.1f})  context switches "
                        f"{switches / a.n:.2f} per write",
                        flush=True,
                    )
                    if a.det and r == a.rounds - 1 and c == order[-1]:
                        shutil.rmtree(root, ignore_errors=True)
                        sys.stdout.flush()
                        os._exit(0)  # no shutdown checkpoint (see docstring)
            if isinstance(offload, ThreadOffload):
                offload.close()

    kwargs: dict[str, Any] = {"clock": trio.testing.MockClock()} if a.det else {}
    try:
        trio.run(run, **kwargs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per = 1e6 / a.n
    for c in classes:
        wall = statistics.median(w for w, _ in results[c]) * per
        cpu = statistics.median(x for _, x in results[c]) * per
        print(f"{c}: median wall {wall:.1f} µs, CPU {cpu:.1f} µs per write")


if __name__ == "__main__":
    main()
