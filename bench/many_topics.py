#!/usr/bin/env python
"""Many small topics: RSS, the checkpoint's loop stall, restart to ready.

    python bench/many_topics.py [--topics 100000] [--dir DIR] [--sites 0] [--long-steps-ms 0]

Two fresh processes on one data directory (under `--dir`, default the system temp dir),
each an engine on the real file system with the daemon's thread offload and, like the
daemon, its start-up objects `gc.freeze()`-d, the daemon's collector thresholds
(`topicd.daemon.settle_gc`) and its GIL switch interval. `--long-steps-ms N` lists each
checkpoint's loop steps of at least N ms (wall time, the loop thread's CPU, collections,
where the task ran):

1. **fill**: `--topics` topics get 3 records of about 100 bytes (one write each, which
   creates the topic). Reported: the RSS after the fill and after the first checkpoint
   (every topic changed) — absolute and growth per topic —, the Python heap per topic
   (`tracemalloc`, only with `--sites N`, which also lists the N largest allocation
   sites per topic; it slows the run), and the checkpoint's duration and the longest
   gap a ticker task on the loop saw meanwhile (it sleeps 1 ms in a loop: a gap is how
   long the loop was unavailable), with the loop thread's CPU time in that gap (work on
   the loop, as opposed to waiting for the GIL or, on a busy machine, for a core), and
   the time spent in garbage collections. Then the process ends with `os._exit` — no
   final checkpoint, as after a `kill -9`.
2. **restart**: the directory is opened again the daemon's way (recovery in a worker
   thread with the collector off, then `gc.collect()` and `gc.freeze()`): restart to
   ready, timed, and the RSS then (still 3 records a topic). Then twice a write to every
   topic and a checkpoint, timed as above: the first after a start captures everything,
   the second is incremental (every topic changed).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import linecache
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from topicd import daemon
from topicd.clock import SystemWallClock
from topicd.config import Config  # noqa: TC001 - used at run time by dataclasses
from topicd.engine.engine import Engine  # noqa: TC001
from topicd.offload import ThreadOffload
from topicd.storage.checkpoint import Checkpointer
from topicd.storage.fs import RealFs
from topicd.storage.service import open_durable_engine
from topicd.testing.harness import durable_config
from topicd.wire import RecordIn, WriteIn

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / (1 << 20)


def config(data_dir: str, topics: int) -> Config:
    """No checkpoint but the ones this script takes; room for one topic more (a warm-up)."""
    cfg = durable_config(data_dir=data_dir)
    snap = dataclasses.replace(
        cfg.storage.snapshot, interval_ms=1 << 40, wal_bytes_threshold=1 << 50
    )
    limits = dataclasses.replace(cfg.limits, max_topics=max(cfg.limits.max_topics, topics + 1))
    storage = dataclasses.replace(cfg.storage, snapshot=snap)
    return dataclasses.replace(cfg, storage=storage, limits=limits)


def open_engine(cfg: Config) -> AbstractAsyncContextManager[Engine]:
    """The daemon's storage stack: real files, the thread offload, recovery in a thread."""
    offload = ThreadOffload({"wal": 8, "misc": 4, "read": 4, "snapshot": 1}, dedicated=("wal",))
    return open_durable_engine(cfg, RealFs(), offload, SystemWallClock(), boot_id="bench")


class Ticker:
    """Sleeps 1 ms in a loop; while `on`, records the longest gap between its turns, and
    the loop thread's CPU time within that gap (a gap with little CPU was the thread
    waiting — for the GIL or for a core on a busy machine —, not work on the loop).
    With `dump_s`, a gap longer than that dumps every thread's stack (what ran)."""

    def __init__(self, dump_s: float = 0.0) -> None:
        self.max_gap = 0.0
        self.max_gap_cpu = 0.0
        self.on = False
        self.since = 0.0
        self.dump_s = dump_s

    def start(self) -> None:
        self.max_gap = self.max_gap_cpu = 0.0
        self.on = True
        self.since = time.perf_counter()

    async def run(self) -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while True:
            if self.dump_s and self.on:
                faulthandler.dump_traceback_later(self.dump_s)
            await trio.sleep(0.001)
            if self.dump_s:
                faulthandler.cancel_dump_traceback_later()
            now, cpu = time.perf_counter(), time.thread_time()
            if self.on and last >= self.since and now - last > self.max_gap:
                self.max_gap, self.max_gap_cpu = now - last, cpu - last_cpu
            last, last_cpu = now, cpu


class GcClock:
    """Time spent in garbage collections (`gc.callbacks`) since `reset`: the total, the
    longest one, and the number of full (generation 2) ones. With `census_s`, a young
    collection at least that long is listed with what it walked: its objects by type and
    the big containers among them (traversing one costs a memory access per element)."""

    def __init__(self) -> None:
        self.censuses: list[str] = []
        self.reset()
        self._t0 = self._cpu0 = 0.0
        self.census_s = 0.0
        self._census: tuple[int, list[tuple[int, str]], list[str]] | None = None
        gc.callbacks.append(self._on)

    def _take_census(self, generation: int) -> None:
        objs: list[object] = []
        for g in range(generation + 1):
            objs += gc.get_objects(generation=g)
        kinds: dict[str, int] = {}
        big: list[str] = []
        for o in objs:
            name = type(o).__name__
            kinds[name] = kinds.get(name, 0) + 1
            if isinstance(o, (list, tuple, dict, set, frozenset)) and len(o) >= 5000:
                inner = type(next(iter(o.values() if isinstance(o, dict) else o))).__name__
                big.append(f"{name}[{len(o)}] of {inner}")
        top = sorted(((n, k) for k, n in kinds.items()), reverse=True)[:5]
        self._census = (len(objs), top, big)
        del objs

    def reset(self) -> None:
        self.total = self.longest = 0.0
        self.full = 0
        self.by_gen = [0, 0, 0]
        self.longest_gen = 0
        self.longest_cpu = 0.0
        self.censuses.clear()

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            if self.census_s and info["generation"] < 2:
                self._take_census(info["generation"])
            self._t0, self._cpu0 = time.perf_counter(), time.thread_time()
            return
        took = time.perf_counter() - self._t0
        if self._census is not None:
            if took >= self.census_s:
                n, top, big = self._census
                kinds = ", ".join(f"{k} {c}" for c, k in top)
                where = _where(trio.lowlevel.current_task()) if _in_trio() else "a thread"
                self.censuses.append(
                    f"  gen-{info['generation']} collection {took * 1000:.1f} ms in {where}: "
                    f"{n} objects ({kinds}); big: {', '.join(big) or 'none'}"
                )
            self._census = None
        self.total += took
        if took > self.longest:
            self.longest, self.longest_gen = took, info["generation"]
            self.longest_cpu = time.thread_time() - self._cpu0
        self.full += info["generation"] == 2
        self.by_gen[info["generation"]] += 1

    def __str__(self) -> str:
        return (
            f"GC {self.total * 1000:.0f} ms in all ({'/'.join(map(str, self.by_gen))} "
            f"collections of generation 0/1/2), longest {self.longest * 1000:.1f} ms "
            f"(generation {self.longest_gen}, {self.longest_cpu * 1000:.1f} ms CPU)"
        )


GC = GcClock()


def _in_trio() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


def _where(task: trio.lowlevel.Task) -> str:
    """The code locations a task is suspended at (outermost first, last three)."""
    out: list[str] = []
    coro: object = task.coro
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None and "/trio/" not in frame.f_code.co_filename:
            out.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(out[-3:])


class LongSteps(trio.abc.Instrument):
    """While `on`, the loop steps longer than `min_s`: which task ran, for how long, how
    much of it was garbage collection, and where the task suspended after the step (the
    await that ended it: the step ran the code before it)."""

    def __init__(self, min_s: float) -> None:
        self.min_s = min_s
        self.on = False
        self.steps: list[tuple[float, float, float, str, str, str]] = []
        self._t0 = self._gc0 = self._cpu0 = 0.0
        self._before = ""

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._t0, self._gc0, self._cpu0 = time.perf_counter(), GC.total, time.thread_time()
        if self.on:
            self._before = _where(task)

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.on and self._before:
            took = time.perf_counter() - self._t0
            if took >= self.min_s:
                gc_s, cpu = GC.total - self._gc0, time.thread_time() - self._cpu0
                self.steps.append((took, cpu, gc_s, task.name, self._before, _where(task)))
        self._before = ""

    def report(self) -> None:
        for took, cpu, gc_s, name, before, after in sorted(self.steps, reverse=True)[:6]:
            print(
                f"  step {took * 1000:6.1f} ms ({cpu * 1000:5.1f} ms CPU, GC {gc_s * 1000:5.1f}) "
                f"{name}"
            )
            print(f"      from {before}")
            print(f"      to   {after}")
        self.steps.clear()
        for line in GC.censuses:
            print(line)
        GC.censuses.clear()


STEPS = LongSteps(1.0)


async def timed_checkpoint(engine: Engine, ticker: Ticker) -> tuple[float, float, float]:
    cp = engine.checkpointer
    assert isinstance(cp, Checkpointer)
    ticker.start()
    GC.reset()
    t0 = time.perf_counter()
    STEPS.on = True
    assert await cp.checkpoint()
    STEPS.on = False
    took = time.perf_counter() - t0
    ticker.on = False
    return took * 1000, ticker.max_gap * 1000, ticker.max_gap_cpu * 1000


def show_sites(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, n: int, k: int) -> None:
    diff = after.compare_to(before, "lineno")
    for d in diff[:k]:
        f = d.traceback[0]
        where = f"{Path(f.filename).name}:{f.lineno}"
        line = linecache.getline(f.filename, f.lineno).strip()[:70]
        print(f"  {d.size_diff / n:7.0f} B {d.count_diff / n:5.2f} allocs  {where:24} {line}")


def settle_gc(cfg: Config) -> None:
    """What the daemon does once recovery is done (`topicd.daemon`; it turned automatic
    collections off before recovery): the collector's settings and, where the daemon
    has one, its GIL switch interval."""
    daemon.settle_gc(cfg.engine.gc_threshold0)
    settle_switch = getattr(daemon, "settle_switch_interval", None)
    if settle_switch is not None:  # (an older checkout's daemon has none)
        settle_switch(cfg.engine.gil_switch_interval_us)


def report_rss(what: str, rss0: float, n: int) -> None:
    rss = rss_mib()
    print(f"RSS {what}: {rss:.0f} MiB (+{(rss - rss0) * (1 << 20) / n:.0f} B per topic)")


async def fill(args: argparse.Namespace, data_dir: str) -> None:
    n = args.topics
    req = WriteIn(records=[RecordIn(data=msgspec.Raw(b'"' + b"x" * 98 + b'"'))] * 3)
    cfg = config(data_dir, n)
    ticker = Ticker(args.dump_stalls_ms / 1000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker.run)
        async with open_engine(cfg) as engine:
            settle_gc(cfg)
            await engine.append("warm", req)
            rss0 = rss_mib()
            print(f"RSS idle (engine open, no topics): {rss0:.0f} MiB")
            if args.sites:
                tracemalloc.start()
                snap0 = tracemalloc.take_snapshot()
            t0 = time.perf_counter()
            GC.reset()
            for i in range(n):
                await engine.append(f"t{i}", req)
            took_fill = time.perf_counter() - t0
            print(f"{n} topics x 3 records: filled in {took_fill:.1f} s; {GC}")
            if args.sites:
                snap1 = tracemalloc.take_snapshot()
                total = sum(s.size for s in snap1.statistics("filename")) - sum(
                    s.size for s in snap0.statistics("filename")
                )
                print(f"python heap: {total / n:.0f} B per topic before the first checkpoint")
                show_sites(snap0, snap1, n, args.sites)
            report_rss("after the fill", rss0, n)
            took, gap, cpu = await timed_checkpoint(engine, ticker)
            print(
                f"checkpoint 1 (all changed): {took:.0f} ms, longest loop gap {gap:.1f} ms "
                f"({cpu:.1f} ms of it on the loop's CPU); {GC}"
            )
            if args.sites:
                snap2 = tracemalloc.take_snapshot()
                tracemalloc.stop()
                total = sum(s.size for s in snap2.statistics("filename")) - sum(
                    s.size for s in snap0.statistics("filename")
                )
                print(f"python heap: {total / n:.0f} B per topic after it")
                show_sites(snap0, snap2, n, args.sites)
            STEPS.report()
            report_rss("after checkpoint 1", rss0, n)
            files = sum(len(f) for _, _, f in os.walk(data_dir))
            print(f"files in the data directory: {files}")
            sys.stdout.flush()
            os._exit(0)  # no final checkpoint: what a kill -9 leaves


async def restart(args: argparse.Namespace, data_dir: str) -> None:
    n = args.topics
    one = WriteIn(records=[RecordIn(data=msgspec.Raw(b'"' + b"z" * 98 + b'"'))])
    cfg = config(data_dir, n)
    ticker = Ticker(args.dump_stalls_ms / 1000)
    rss0 = rss_mib()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker.run)
        GC.reset()
        t0 = time.perf_counter()
        gc.disable()
        async with open_engine(cfg) as engine:
            settle_gc(cfg)
            ready = time.perf_counter() - t0
            print(f"restart to ready ({len(engine.topics)} topics): {ready:.2f} s; {GC}")
            report_rss("after the restart", rss0, n)
            for k, what in ((2, "the first after the start"), (3, "incremental")):
                for i in range(n):
                    await engine.append(f"t{i}", one)
                took, gap, cpu = await timed_checkpoint(engine, ticker)
                print(
                    f"checkpoint {k} ({what}, a write to each): {took:.0f} ms, longest "
                    f"loop gap {gap:.1f} ms ({cpu:.1f} ms of it on the loop's CPU); {GC}"
                )
                STEPS.report()
            report_rss(f"after checkpoint {k}", rss0, n)
        nursery.cancel_scope.cancel()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topics", type=int, default=100_000)
    ap.add_argument("--dir", default=None, help="parent of the temporary data directory")
    ap.add_argument("--sites", type=int, default=0, help="list this many allocation sites")
    ap.add_argument(
        "--dump-stalls-ms", type=float, default=0, help="dump stacks at loop gaps this long"
    )
    ap.add_argument(
        "--long-steps-ms",
        type=float,
        default=0,
        help="list the checkpoints' loop steps at least this long (task, GC, where)",
    )
    ap.add_argument(
        "--gc-census-ms",
        type=float,
        default=0,
        help="list what each young collection at least this long walked (slows collections)",
    )
    ap.add_argument("--phase", choices=("fill", "restart"), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    instruments = []
    GC.census_s = args.gc_census_ms / 1000
    if args.long_steps_ms:
        STEPS.min_s = args.long_steps_ms / 1000
        instruments.append(STEPS)
    if args.phase == "fill":
        trio.run(fill, args, args.data, instruments=instruments)
        return 0
    if args.phase == "restart":
        trio.run(restart, args, args.data, instruments=instruments)
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data = str(Path(tmp) / "data")
        rest = list(sys.argv[1:])
        for phase in ("fill", "restart"):
            cmd = [sys.executable, __file__, *rest, "--phase", phase, "--data", data]
            if subprocess.run(cmd, check=False).returncode:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
