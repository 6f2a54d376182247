"""Checkpoints: snapshot the engine, then trim the WAL behind it (storage spec §9).

A checkpoint runs when the WAL written since the last one reaches
`storage.snapshot.wal_bytes_threshold`, or when `storage.snapshot.interval_ms` has passed
and anything was written; checked every `check_interval_ms`. A final one runs at
graceful shutdown, after the WAL drained and synced, with every seq reservation released
to its head so a clean restart resumes with no gap.

Steps: capture (on the loop, in steps that yield: the topics that changed since the
last checkpoint, slices of their records to absorb, and at the end, in one synchronous
step, whatever changed meanwhile and the per-shard WAL positions;
`snapshot.capture_stepwise`) → absorb
into segments and encode (offloaded) → write, sync, rename, sync `meta/` (shielded) →
install the new segment registry and release the absorbed records' payloads to the
payload cache → remove WAL files that
lie wholly before the positions of the *previous* snapshot (with `keep ≥ 2`), so the
older kept snapshot can still be replayed if the newest one turns out unreadable. A
failure is logged, counted and retried at the next check; the WAL keeps its files longer.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from itertools import islice
from typing import TYPE_CHECKING, Final

import trio

from topicd.sched.classes import Budget
from topicd.sched.steps import StepMeter
from topicd.storage import snapshot
from topicd.storage.segments import AbsorbOutcome, SegmentStore
from topicd.storage.wal import WalCommitPath, parse_wal_name

if TYPE_CHECKING:
    from collections.abc import Callable

    import msgspec

    from topicd.clock import WallClock
    from topicd.config import Config
    from topicd.engine.engine import Engine
    from topicd.offload import Offload
    from topicd.storage.fs import Fs

log = logging.getLogger("topicd.checkpoint")

# durable writes wait (then get `429 wal_ingest`) once the WAL bytes written since the
# newest snapshot's capture reach this many `storage.snapshot.wal_bytes_threshold`s
BACKLOG_THRESHOLDS = 2

# topics installed per loop turn after a checkpoint (`Checkpointer._install`; their
# payloads are released a topic per budget tick), and the slice of the entries and
# records kept for the next checkpoint brought up to date per turn
_INSTALL_TOPICS: Final = 256
_SLICE: Final = 8192
# payload-cache chunks evicted per loop turn after a checkpoint (each a list write and a
# free per record: 16 chunks of 256 1 KiB records ≈ 0.5 ms; a 64 MiB absorb evicting
# in one turn held the loop ≈ 8 ms)
TRIM_CHUNKS = 16


def _remove_wal_files(fs: Fs, root: str, doomed: Callable[[int, int], bool]) -> int:
    """Delete the WAL files for which `doomed(shard, file index)`; sync the directories."""
    removed = 0
    wal = posixpath.join(root, "wal")
    if not fs.exists(wal):
        return 0
    for dir_name in fs.listdir(wal):
        if not (dir_name.startswith("shard-") and dir_name[6:].isdigit()):
            continue
        shard = int(dir_name[6:])
        shard_dir = posixpath.join(wal, dir_name)
        gone = False
        indexed = sorted(
            (index, name)
            for name in fs.listdir(shard_dir)
            if (index := parse_wal_name(name)) is not None
        )
        for index, name in indexed:  # oldest first: a crash leaves a contiguous suffix
            if doomed(shard, index):
                fs.unlink(posixpath.join(shard_dir, name))
                removed += 1
                gone = True
        if gone:
            fs.fsync_dir(shard_dir)
    return removed


def trim_wal(fs: Fs, root: str, positions: list[tuple[int, int]]) -> int:
    """Delete every WAL file wholly before its shard's position. Returns files removed."""
    return _remove_wal_files(
        fs, root, lambda shard, index: shard < len(positions) and index < positions[shard][0]
    )


def retire_wal(fs: Fs, root: str) -> int:
    """Delete every WAL file (after a re-shard snapshot made them redundant)."""
    return _remove_wal_files(fs, root, lambda shard, index: True)


class Checkpointer:
    def __init__(
        self,
        cfg: Config,
        engine: Engine,
        wal: WalCommitPath,
        fs: Fs,
        offload: Offload,
        clock: WallClock,
        number: int,
        positions: list[tuple[int, int]] | None = None,
        segments: SegmentStore | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.wal = wal
        self.fs = fs
        self.offload = offload
        self.clock = clock
        self.number = number  # the newest snapshot's number (0: none yet)
        # trimming follows the *previous* snapshot, so the older kept one stays usable if
        # the newest turns out unreadable
        self._trim_to = positions
        self.root = cfg.storage.data_dir
        self._written_at_last = self._written()
        self._last_at = trio.current_time()
        self._lock = trio.Lock()
        self._wake = trio.Event()  # set by `poke`: the WAL bytes threshold was reached
        self.count = 0
        self.failures = 0
        self.last_duration_ms = 0.0
        # the longest loop step of the last checkpoint's own work, and of anything else
        # that ran meanwhile (with that task's name): `StepMeter`
        self.meter = StepMeter()
        self.last_stall_ms = 0.0
        self.last_other_stall_ms = 0.0
        self.last_other_task = ""
        self.last_bytes = 0
        self.last_captured = 0  # topics the last checkpoint captured (the rest: reused)
        self.files_trimmed = 0
        self.segments = segments or SegmentStore(
            fs,
            cfg.storage.data_dir,
            cfg.storage.segments,
            cold_root=cfg.storage.cold_dir,
            tiering=cfg.storage.tiering,
        )
        # segment files the newest snapshot no longer references but the previous kept one
        # may: removed after the next snapshot (like WAL trimming, one snapshot behind)
        self._doomed: list[str] = []
        # the newest snapshot's entry of each topic that has not changed since (reused as
        # is: a checkpoint re-captures only what changed)
        self._encoded: dict[int, msgspec.Raw] = {}
        # the records of the inline topics among them, reused with their entries (the
        # topics' own bytes objects)
        self._records: dict[int, snapshot.Records] = {}
        # the backlog bound: a write flood faster than absorbing (in Python, slower than
        # writes can arrive) would pin ever more records in memory; at the bound durable
        # writes wait for a checkpoint to commit (`429 wal_ingest` once they waited
        # `backpressure.bypass_wait_ms`)
        self._backlog_bound = BACKLOG_THRESHOLDS * cfg.storage.snapshot.wal_bytes_threshold
        self.backlog_full = False
        self._backlog_clear = trio.Event()  # set while the backlog is below its bound
        self._backlog_clear.set()

    def _written(self) -> int:
        return sum(shard.bytes_written for shard in self.wal.shards)

    def due(self) -> bool:
        if self.segments.tier_backlog:
            return True  # the last checkpoint left segments to relocate for want of budget
        written = self._written() - self._written_at_last
        snap = self.cfg.storage.snapshot
        if written <= 0:
            # nothing written: only sealed segments waiting for the cold tier (after a
            # restart with a new bound, say) make a checkpoint worth taking
            if not self.segments.tier_due:
                return False
        elif written >= snap.wal_bytes_threshold:
            return True
        return trio.current_time() - self._last_at >= snap.interval_ms / 1000

    def poke(self) -> None:
        """The WAL wrote a batch: start a checkpoint now if the bytes threshold is reached
        (not at the next periodic check: records stay pinned in memory until absorbed),
        and note when the backlog reached its bound (writes then get 429)."""
        backlog = self._written() - self._written_at_last
        if not self._wake.is_set() and backlog >= self.cfg.storage.snapshot.wal_bytes_threshold:
            self._wake.set()
        if backlog >= self._backlog_bound and not self.backlog_full:
            self.backlog_full = True
            self._backlog_clear = trio.Event()

    def backlog(self) -> int:
        """WAL bytes written since the newest snapshot's capture: records not yet
        absorbed into segments, pinned in memory until a checkpoint commits."""
        return max(0, self._written() - self._written_at_last)

    def backlog_bound(self) -> int:
        return self._backlog_bound

    async def wait_backlog(self) -> None:
        """Until a checkpoint brought the backlog below its bound."""
        await self._backlog_clear.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        period = self.cfg.storage.snapshot.check_interval_ms / 1000
        while True:
            with trio.move_on_after(period):
                await self._wake.wait()
            self._wake = trio.Event()
            if self.due():
                await self.checkpoint()

    async def _install(
        self, outcome: AbsorbOutcome, cap: snapshot.Capture, budget: Budget
    ) -> list[str]:
        """The snapshot is durable: install the new segment registry and release the
        absorbed records' payloads to the payload cache (their bytes may leave memory,
        `TRIM_CHUNKS` chunks a turn), `_INSTALL_TOPICS` topics at a time with yields
        between (a topic is installed
        whole: readers see its old registry or its new one; the old files stay until the
        next checkpoint). Returns what the new registry no longer references."""
        by_id = self.engine.by_id
        payloads = self.engine.payloads
        # (a slice of the outcome's own dict at a time — old by now —, not a list of its
        # items: with a yield between topics below, a young list of every topic would
        # live across yields, and every young collection meeting it walks it whole)
        outcomes = iter(outcome.topics.items())
        doomed: list[str] = []
        for _ in range(0, len(outcome.topics), _INSTALL_TOPICS):
            part = dict(islice(outcomes, _INSTALL_TOPICS))
            # (the outcome's per-topic parts for these topics; its totals come once, below)
            doomed += self.segments.install(
                dataclasses.replace(
                    outcome,
                    topics=part,
                    gone_dirs=[],
                    records=0,
                    bytes=0,
                    relocated_bytes=0,
                    tier_due=outcome.tier_due & part.keys(),
                )
            )
            for tid, res in part.items():
                topic = by_id.get(tid)
                if topic is not None:
                    # (≈ 12 µs a chunk: 30-odd written topics' chunks in one turn held
                    # the loop 3-6 ms; a topic's release is whole, and only lets its
                    # chunks be evicted: a yield between topics changes no reader's view)
                    payloads.release(topic, res.state.absorbed, trim=False)
                    await budget.tick()
            await budget.pause()
            while payloads.trim(TRIM_CHUNKS):  # the bound, a few chunks a turn
                await budget.pause()
        doomed += self.segments.install(dataclasses.replace(outcome, topics={}, tier_due=set()))
        # (a slice of the capture's own dict's items at a time — nothing else changes it
        # meanwhile —, not a list of its ids or items: a young list of 100,000, or a
        # tuple per topic, is walked by every young collection that meets it; and not
        # ids boxed from an array: new int objects kept as keys, ~3 MB a dict)
        slice_ = _SLICE
        encoded = cap.encoded
        pairs = iter(encoded.items())
        for _ in range(0, len(encoded), slice_):
            cap.entries.update(islice(pairs, slice_))
            await budget.pause()
        # the inline records to reuse next time: with an incremental capture the previous
        # dict brought up to date in place, a slice at a time (it is old, so no young
        # collection walks it; a new dict of 100,000 tuples would be young), else the
        # capture's own
        inline = cap.inline_records
        old: tuple[dict[int, msgspec.Raw] | dict[int, snapshot.Records], ...]
        if cap.records is self._records:
            records, old = self._records, (self._encoded,)
            stale = cap.stale
            for i in range(0, len(stale), slice_):
                for tid in stale[i : i + slice_]:
                    records.pop(tid, None)
                await budget.pause()
            fresh = iter(inline.items())
            for _ in range(0, len(inline), slice_):
                records.update(islice(fresh, slice_))
                await budget.pause()
        else:
            records, old = inline, (self._encoded, self._records)
        self._encoded = cap.entries
        self._records = records
        # the previous entries (and records) are dropped a slice at a time: what they
        # alone held (every changed topic's old entry and record tuple) is freed as they
        # go, and at 100,000 changed topics that was ~19 ms in one loop turn
        for previous in old:
            while previous:
                for _ in range(min(len(previous), _SLICE)):
                    previous.popitem()
                await budget.pause()
        return doomed

    async def checkpoint(self, *, final: bool = False) -> bool:
        """Take one checkpoint; True on success. Never raises for I/O errors.

        While it runs (failed ones too), `meter` times every loop step: the longest of
        the checkpoint's own task (and any it starts) and the longest of any other task
        are logged with it and kept as `last_stall_ms` / `last_other_stall_ms`."""
        async with self._lock, self.engine.maintenance:
            meter = self.meter
            with meter.span():
                summary = await self._take(final)
            self.last_stall_ms = meter.own_s * 1000
            self.last_other_stall_ms = meter.other_s * 1000
            self.last_other_task = meter.other_task
            if summary is None:
                return False
            log.info(
                "%s; longest loop step %.1f ms (CPU %.1f, GC %.1f, page faults %d; from %s "
                "to %s), other tasks' %.1f ms (CPU %.1f, GC %.1f, page faults %d; %s at %s); "
                "longest collection %.1f ms (generation %d, %s)",
                summary,
                self.last_stall_ms,
                meter.own_cpu_s * 1000,
                meter.own_gc_s * 1000,
                meter.own_faults,
                meter.own_from or "-",
                meter.own_at or "-",
                self.last_other_stall_ms,
                meter.other_cpu_s * 1000,
                meter.other_gc_s * 1000,
                meter.other_faults,
                meter.other_task or "-",
                meter.other_at or "-",
                meter.gc_s * 1000,
                meter.gc_generation,
                "on the loop thread" if meter.gc_on_loop else "in a worker thread",
            )
            return True

    async def _take(self, final: bool) -> str | None:
        """The checkpoint itself: its log line's summary, or None if it failed."""
        t0 = trio.current_time()
        now_ms = self.clock.now_ms()
        classes = self.cfg.classes
        budget = Budget.for_class("maintenance", classes.quantum_base_us, classes.quantum_items)
        written = 0

        def at() -> list[tuple[int, int]]:  # the WAL positions the cut reflects
            nonlocal written
            written = self._written()
            return [(shard.file_index, shard.tail) for shard in self.wal.shards]

        cap, positions = await snapshot.capture_stepwise(
            self.engine,
            at,
            now_ms,
            budget.tick,
            final=final,
            segments=self.segments,
            absorb=True,
            reuse=self._encoded if self.count else None,  # (the first: everything)
            records=self._records,
            inline_max=self.cfg.storage.segments.inline_max_bytes,
        )
        topics = cap.topic_count()
        keep = self.cfg.storage.snapshot.keep
        try:
            outcome = await self.offload.run(
                self.segments.absorb, cap.works, cap.gone_ids, now_ms, group="snapshot"
            )
            for snap in cap.fresh:
                res = outcome.topics.get(snap.id)
                if res is not None:
                    snap.segments = [seg.snap() for seg in res.state.segments]
            data = await self.offload.run(snapshot.encode, cap, group="snapshot")
            number = self.number + 1
            with trio.CancelScope(shield=True):
                await self.offload.run(
                    snapshot.write_snapshot,
                    self.fs,
                    self.root,
                    number,
                    data,
                    keep,
                    group="snapshot",
                )
        except OSError as exc:
            for work in cap.works:  # their delete flags are flipped next time
                topic = self.engine.by_id.get(work.topic_id)
                if topic is not None:
                    topic.seg_killed = work.flips + (topic.seg_killed or [])
            for topic in cap.captured:  # captured again next time
                topic.mark_changed()
            for tid in cap.captured_inline:
                topic = self.engine.by_id.get(tid)
                if topic is not None:
                    topic.mark_changed()
            self.engine.deleted_ids[:0] = cap.deleted_ids
            self.failures += 1
            log.error("checkpoint failed (the WAL keeps its files): %s", exc)
            return None
        self.number = number
        with trio.CancelScope(shield=True):  # (the snapshot is durable: finish this)
            doomed = await self._install(outcome, cap, budget)
        if keep == 1:
            reclaim, self._doomed = self._doomed + doomed, []
        else:
            reclaim, self._doomed = self._doomed, doomed
        try:
            if self._trim_to is not None and keep > 1:
                self.files_trimmed += await self.offload.run(
                    trim_wal, self.fs, self.root, self._trim_to, group="snapshot"
                )
            elif keep == 1:
                self.files_trimmed += await self.offload.run(
                    trim_wal, self.fs, self.root, positions, group="snapshot"
                )
            self._trim_to = positions
            if reclaim:
                await self.offload.run(self.segments.reclaim, reclaim, group="snapshot")
        except OSError as exc:
            self._doomed = reclaim + self._doomed
            self.failures += 1
            log.error("checkpoint cleanup failed (retried next time): %s", exc)
            return None
        self.count += 1
        self._written_at_last = written
        self.backlog_full = self.backlog() >= self._backlog_bound
        if not self.backlog_full:
            self._backlog_clear.set()
        self._last_at = trio.current_time()
        self.last_duration_ms = (self._last_at - t0) * 1000
        self.last_bytes = sum(len(piece) for piece in data)
        self.last_captured = len(cap.captured) + len(cap.captured_inline)
        moved = sum(res.relocated for res in outcome.topics.values())
        moved_note = f", {moved} segments moved to the cold tier" if moved else ""
        return (
            f"checkpoint {number}: {topics} topics ({self.last_captured} captured), "
            f"{outcome.records} records absorbed, {self.last_bytes} bytes in "
            f"{self.last_duration_ms:.1f} ms{moved_note}{' (final)' if final else ''}"
        )
