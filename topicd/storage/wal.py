"""The write-ahead log: sharded, with fair ingest and cross-topic group commit.

`WalCommitPath` implements the engine's `CommitPath` (see `engine.commit`).

**Shards.** A topic lives in shard `xxh3_64(topic_id) % N`; every frame about it goes to
that shard, so a topic's whole timeline is one ordered stream. Each shard has its own
directory of files, its own committer task, its own fsync stream and breaker.

**Fair ingest** (scheduler spec R2). A shard keeps one FIFO of submissions per topic and a
ready queue of topics (each at most once). Admission is synchronous and bounded per topic
and per shard (`storage.wal.max_pending_*`); a full queue is `429 throttled` with
`cause:"wal_ingest"` before any seq is assigned. Control mutations are exempt from the
caps and put their topic at the front of the ready queue.

**Group commit.** The committer takes up to `max_group_topics` ready topics, up to
`max_batch_per_topic` submissions from each (FIFO), within `max_batch_bytes`; topics with
work left rejoin the tail. The batch is one `pwrite` and at most one `fdatasync`, done in
a single offload call. A batch syncs when it holds an `fsync`-class write, a control
mutation or a seq reservation; before a sync it keeps taking arrivals in slices of
`gc_slice_us` while they keep coming, for at most `commit_window_ms` (the value the
governor moves between `commit_window_min_ms` and `commit_window_max_ms`), and only
until the batch carries `gc_enough_records` records: a batch that already shares its
sync that widely goes at once, and what arrives meanwhile is staged for the next batch
while this one syncs.

**Ack by class.** `fsync`: after the covering sync. `memory`/`disk`: after the write,
once a synced `HeadWatermark` covers the seqs (a reservation `max(reserve_ahead, 4n)`
ahead, so about one write in 65536 waits for a sync). `ephemeral`: no record frames; the
write is published in the handler unless the topic has unpublished submissions or needs a
new reservation, in which case it waits in its topic's FIFO like any other.

**Never ack-then-lose.** A write or sync error fails the batch and every submission still
queued in the shard (`503 storage_unavailable`), rewinds the topics' seqs, abandons the
file, and feeds the breaker. The next file's header records the valid length of the
abandoned one (the fence), so bytes of a failed batch can never surface after a crash.
Unsynced `memory`/`disk` bytes are synced in the background every
`disk_fsync_interval_ms`.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import posixpath
import random
import re
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

from topicd.clock import perf_ms
from topicd.errors import Internal, JsonValue, StorageUnavailable, Throttled, TopicdError
from topicd.model import shard_of
from topicd.sched.classes import give_back
from topicd.sched.governor import retry_after_ms as b5_retry_after_ms
from topicd.storage import frame as frames
from topicd.storage.breaker import Breaker, BreakerState
from topicd.storage.fs import Fs, drop_synced, write_all
from topicd.storage.segments import SegmentCorruption, SegmentStore

if TYPE_CHECKING:
    from collections.abc import Callable

    from topicd.clock import WallClock
    from topicd.config import Config
    from topicd.engine.commit import AppendBatch, CommitHooks
    from topicd.engine.topic import Topic
    from topicd.offload import Offload
    from topicd.sched.saturation import SaturationRegistry

log = logging.getLogger("topicd.storage")

_T = TypeVar("_T")


# upper bounds of the fsync latency histogram (api-ops §3.1); one more bucket counts +Inf
FSYNC_BUCKETS_US = (50, 100, 250, 500, 1000, 5000, 10000, 50000, 100000)


def wal_file_name(index: int) -> str:
    return f"wal-{index:016x}.log"


_WAL_NAME = re.compile(r"wal-([0-9a-f]{16})\.log")


def parse_wal_name(name: str) -> int | None:
    """The file index of a WAL file name, or None for any other name."""
    m = _WAL_NAME.fullmatch(name)
    return int(m.group(1), 16) if m else None


def shard_dir_name(shard: int) -> str:
    return f"shard-{shard:02d}"


class _WriteFailed(Exception):
    def __init__(self, exc: OSError) -> None:
        super().__init__(str(exc))
        self.exc = exc


class _SyncFailed(Exception):
    def __init__(self, exc: OSError) -> None:
        super().__init__(str(exc))
        self.exc = exc


def _records(subs: list[Submission], start: int) -> int:
    """Records written by the submissions from `start` on."""
    return sum(sub.batch.count for sub in subs[start:] if sub.batch is not None)


def _write_and_sync(
    fs: Fs, fd: int, data: bytes, offset: int, sync: bool, drop_from: int = 0
) -> float:
    """One offload call: write every byte, then (optionally) fdatasync and let the page
    cache drop what is now synced from `drop_from` on (`fs.drop_synced`). Returns sync ms."""
    try:
        write_all(fs, fd, data, offset)
    except OSError as exc:
        raise _WriteFailed(exc) from None
    if not sync:
        return 0.0
    t0 = perf_ms()
    try:
        fs.fdatasync(fd)
    except OSError as exc:
        raise _SyncFailed(exc) from None
    ms = perf_ms() - t0
    drop_synced(fs, fd, drop_from, offset + len(data))
    return ms


def _sync_and_drop(fs: Fs, fd: int, drop_from: int, end: int) -> None:
    fs.fdatasync(fd)
    drop_synced(fs, fd, drop_from, end)


def _create_file(fs: Fs, path: str, dir_path: str, header: bytes, size: int) -> int:
    """Create, preallocate, write the header, sync the file and its directory.

    A file already at `path` is the leftover of an earlier attempt that failed part way
    (the caller names a file past the current one, which nothing has been written to or
    refers to): it is replaced, so a failed breaker probe does not make every later
    probe fail with `EEXIST` once storage works again. A failed attempt also removes its
    own file, best effort."""
    try:
        fd = fs.open(path, create=True, exclusive=True)
    except FileExistsError:
        fs.unlink(path)
        fd = fs.open(path, create=True, exclusive=True)
    try:
        fs.fallocate(fd, size)
        write_all(fs, fd, header, 0)
        fs.fdatasync(fd)
        fs.fsync_dir(dir_path)
    except BaseException:
        fs.close(fd)
        with contextlib.suppress(OSError):
            fs.unlink(path)
        raise
    return fd


def _ensure_dir(fs: Fs, path: str) -> None:
    """Create a directory durably (the parent is synced after the new entry)."""
    if not fs.exists(path):
        fs.mkdir(path)
        fs.fsync_dir(posixpath.dirname(path))


def _reopen(fs: Fs, path: str, valid_len: int, file_bytes: int, repair: bool) -> tuple[int, int]:
    """Open the last file for appending at `valid_len`; clear a torn tail first."""
    fd = fs.open(path)
    try:
        size = fs.size(path)
        if repair:
            fs.ftruncate(fd, valid_len)
            size = max(size, file_bytes)
            fs.fallocate(fd, size)
            fs.fdatasync(fd)
    except BaseException:
        fs.close(fd)
        raise
    return fd, size


@dataclass(eq=False, slots=True)
class Submission:
    """One queued unit of a shard: an append (batch) or a control mutation (apply)."""

    topic: Topic
    frame: bytes
    batch: AppendBatch | None = None
    apply: Callable[[], object] | None = None
    sync: bool = False
    counted: bool = False  # counts against the ingest caps
    t0: float = 0.0
    result: object = None
    error: TopicdError | None = None
    abandoned: Callable[[], None] | None = None  # control: run if it fails (see control)
    resolved: bool = False
    waiter: trio.lowlevel.Task | None = None  # control: the task in `wait`

    def resolve(self, error: TopicdError | None = None) -> None:
        self.error = error
        self.resolved = True
        if error is not None and self.abandoned is not None:
            self.abandoned()
        waiter = self.waiter
        if waiter is not None:  # (rescheduled directly: no event object per submission)
            self.waiter = None
            trio.lowlevel.reschedule(waiter)

    async def wait(self) -> None:
        """Wait until `resolve` ran (a checkpoint even when it already had). One task
        waits (the control call that queued it); a cancelled wait abandons the wait
        only: the submission commits or fails on its own."""
        if self.resolved:
            await trio.lowlevel.checkpoint()
            return
        assert self.waiter is None, "one task waits for a submission"
        self.waiter = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self.waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


@dataclass
class ShardFiles:
    """Where a shard's log stands after recovery."""

    last_index: int = -1  # highest existing file index, -1 if none
    valid_len: int = 0  # valid length of that file: appends continue there
    repair: bool = False  # bytes after valid_len must be cleared first (torn tail)
    remove: list[str] = field(default_factory=list)  # unfinished empty files to unlink


class Shard:
    """One WAL shard: its queues, its active file and its committer task."""

    def __init__(
        self,
        index: int,
        count: int,
        root: str,
        files: ShardFiles,
        cfg: Config,
        fs: Fs,
        offload: Offload,
        clock: WallClock,
        hooks: CommitHooks,
    ) -> None:
        self.index = index
        self.count = count
        self.dir = posixpath.join(root, "wal", shard_dir_name(index))
        self.cfg = cfg
        self.wal = cfg.storage.wal
        self.fs = fs
        self.offload = offload
        self.clock = clock
        self.hooks = hooks
        b = cfg.breaker
        self.breaker = Breaker(
            index,
            failure_threshold=b.failure_threshold,
            failure_window_ms=b.failure_window_ms,
            open_ms=b.open_ms,
            max_open_ms=b.max_open_ms,
            success_threshold=b.success_threshold,
        )
        self.commit_window_ms = cfg.governor.commit_window_min_ms
        self.on_written: Callable[[], None] | None = None  # after each batch written
        # queues
        self.queues: dict[Topic, deque[Submission]] = {}
        self.ready: deque[Topic] = deque()
        self.unpublished: dict[Topic, int] = {}
        self.topic_pending: dict[Topic, list[int]] = {}  # [submissions, bytes] counted
        self.pending = 0
        self.pending_bytes = 0
        self.pending_peak = 0
        self.submit_full = 0
        self.pressure_refused = 0
        self.io_since: float | None = None  # start of the WAL write/sync in flight
        self.ewma_bytes_per_s = 0.0  # commit throughput (retry_after_ms estimate)
        # the enqueue time of the oldest counted write in the batch being written (None:
        # none), and the oldest write's wait at the governor's last sample
        self.inflight_since: float | None = None
        self.delay_ms = 0.0
        self._work = trio.Event()
        self._room = trio.Event()
        self._room_waiters = 0  # tasks in `wait_for_room`
        self.sync_due = False
        self.closing = False
        self.stopped = trio.Event()
        # file
        self._files = files
        self.fd = -1
        self.file_index = -1
        self.tail = 0
        self.allocated = 0
        self.dropped_to = 0  # the page cache was advised to drop this file's bytes below
        self.broken = False
        self.unsynced = False
        self.last_sync = 0.0
        # statistics
        self.frames_written = 0
        self.batches = 0
        self.fsyncs = 0
        self.bytes_written = 0
        self.rotations = 0
        self.fsync_us_total = 0.0
        self.records_synced = 0
        self.unsynced_heads: dict[Topic, int] = {}  # published, not yet fdatasync'ed
        self.fsync_buckets = [0] * (len(FSYNC_BUCKETS_US) + 1)  # per bucket, not cumulative

    # ---- admission (synchronous, on the handler's task) ------------------------------

    def room_for(self, topic: Topic, nbytes: int) -> str | None:
        """None if a submission of `nbytes` fits, else the scope that is full.

        A byte bound never refuses a submission that would be alone in its queue: a write
        larger than the bound (one the request limits allow) waits for an empty queue
        instead of being refused forever."""
        w = self.wal
        mine = self.topic_pending.get(topic)
        if mine is not None and (
            mine[0] >= w.max_pending_per_topic
            or (mine[1] and mine[1] + nbytes > w.max_pending_bytes_per_topic)
        ):
            return "topic"
        if self.pending >= w.max_pending_per_shard or (
            self.pending_bytes and self.pending_bytes + nbytes > w.max_pending_bytes_per_shard
        ):
            return "shard"
        return None

    def queue_delay_ms(self, now: float) -> float:
        """How long the oldest accepted, uncommitted write has waited at `now` (queued or
        in the batch being written), 0 when none waits; kept in `delay_ms` for the
        ingest's fill until the next call (the governor's sample). Writers that
        share one group commit wait for the same `fdatasync`, however many they are:
        their concurrency reads as about one commit; a queue of batches behind the disk
        reads as the time it holds them."""
        oldest = self.inflight_since
        if self.pending:
            for q in self.queues.values():
                head = q[0]
                if head.counted and (oldest is None or head.t0 < oldest):
                    oldest = head.t0
        self.delay_ms = 0.0 if not self.pending or oldest is None else max(0.0, now - oldest) * 1000
        return self.delay_ms

    def check_stall(self, now: float) -> None:
        """Open the breaker when a WAL write or sync has been outstanding longer than
        `breaker.io_stall_ms` (scheduler spec R3.2; the governor's sample calls this)."""
        since = self.io_since
        limit_s = self.cfg.breaker.io_stall_ms / 1000
        if since is None or now - since <= limit_s:
            return
        if self.breaker.poll() is BreakerState.CLOSED:
            reason = f"io stall: a WAL write/sync outstanding for {now - since:.1f} s"
            log.error(
                "WAL shard %d: %s; durable writes get 503 until it recovers", self.index, reason
            )
            self.breaker.record_sync_error(reason)

    def ingest_ratio(self, timed: bool = True) -> float:
        """How full the shard's ingest is (the largest of submissions, bytes and, when
        `timed`, the oldest write's wait against their bounds), 0..1 (above 1 past the
        time bound). An `ephemeral` write does not wait for the disk, so its admission
        reads the count and bytes only."""
        w = self.wal
        return max(
            self.pending / w.max_pending_per_shard,
            self.pending_bytes / w.max_pending_bytes_per_shard,
            self.delay_ms / w.max_pending_ms if timed and w.max_pending_ms else 0.0,
        )

    def retry_after_ms(self, pressure: float, rng: random.Random) -> int:
        """Scheduler spec B.5: `clamp(max(min + span·pressure, est_drain_ms), min, max)`
        with ± `retry_after_jitter`; `est_drain_ms` = pending bytes ÷ the EWMA commit
        throughput."""
        bp = self.cfg.backpressure
        rate = self.ewma_bytes_per_s
        ms = b5_retry_after_ms(pressure, bp, self.pending_bytes * 1000 / rate if rate > 0 else 0.0)
        j = bp.retry_after_jitter
        return max(1, round(ms * (1 + rng.uniform(-j, j))))

    def enqueue(self, sub: Submission, *, front: bool = False) -> None:
        """Queue a submission in its topic's FIFO (synchronous, never fails).

        `front`: a control mutation whose topic had nothing queued goes to the front of
        the ready queue (scheduler spec R1.6); per-topic FIFO order is always kept.
        """
        topic = sub.topic
        q = self.queues.get(topic)
        if q is None:
            q = self.queues[topic] = deque()
            if front:
                self.ready.appendleft(topic)
            else:
                self.ready.append(topic)
        q.append(sub)
        self.unpublished[topic] = self.unpublished.get(topic, 0) + 1
        if sub.counted:
            n = len(sub.frame)
            mine = self.topic_pending.get(topic)
            if mine is None:
                self.topic_pending[topic] = [1, n]
            else:
                mine[0] += 1
                mine[1] += n
            self.pending += 1
            self.pending_bytes += n
            if self.pending > self.pending_peak:
                self.pending_peak = self.pending
        self._work.set()

    def _released(self, sub: Submission) -> None:
        topic = sub.topic
        left = self.unpublished[topic] - 1
        if left:
            self.unpublished[topic] = left
        else:
            del self.unpublished[topic]
        if sub.counted:
            n = len(sub.frame)
            mine = self.topic_pending[topic]
            mine[0] -= 1
            mine[1] -= n
            if not mine[0]:
                del self.topic_pending[topic]
            self.pending -= 1
            self.pending_bytes -= n
            if self._room_waiters:  # (a new event per release only when someone waits)
                self._room.set()
                self._room = trio.Event()

    async def wait_for_room(self) -> None:
        self._room_waiters += 1
        try:
            await self._room.wait()
        finally:
            self._room_waiters -= 1

    # ---- the committer ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.offload.run(_ensure_dir, self.fs, self.dir, group="misc")
        await self._open_initial()
        task_status.started()
        try:
            while True:
                if self.breaker.poll() is not BreakerState.CLOSED:
                    await self._while_broken()
                elif self.ready:
                    await self._commit_one_batch()
                elif self.sync_due:
                    self.sync_due = False
                    if self.unsynced:
                        await self._sync_only()
                elif self.closing:
                    if self.unsynced:
                        await self._sync_only()
                    return
                else:
                    self._work = trio.Event()
                    await self._work.wait()
        finally:
            self.stopped.set()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self._close_file(final_sync=True)

    async def tail_syncer(self) -> None:
        """Ask the committer for a sync-only `fdatasync` once unsynced bytes are older than
        `disk_fsync_interval_ms` (bounds what a power loss can take from `memory`/`disk`).
        A separate ticker keeps the committer's idle wait a plain event wait."""
        interval = self.wal.disk_fsync_interval_ms / 1000
        while True:
            await trio.sleep(interval)
            if self.unsynced and trio.current_time() - self.last_sync >= interval:
                self.sync_due = True
                self._work.set()

    def _take(
        self, subs: list[Submission], out: list[bytes], nbytes: int, reserving: dict[Topic, int]
    ) -> tuple[int, bool]:
        """Move ready submissions into the batch. Returns (bytes, needs sync)."""
        w = self.wal
        sync = False
        topics = 0
        while self.ready and topics < w.max_group_topics and nbytes < w.max_batch_bytes:
            topic = self.ready.popleft()
            q = self.queues[topic]
            taken = 0
            while q and taken < w.max_batch_per_topic:
                sub = q[0]
                if subs and nbytes + len(sub.frame) > w.max_batch_bytes:
                    break
                q.popleft()
                taken += 1
                batch = sub.batch
                if batch is not None and batch.durability != "fsync":
                    covered = reserving.get(topic, topic.reserved_head)
                    if batch.last_seq > covered:
                        ahead = (
                            w.ephemeral_head_reserve_ahead
                            if batch.durability == "ephemeral"
                            else w.disk_head_reserve_ahead
                        )
                        new = batch.last_seq + max(ahead, 4 * batch.count)
                        reserving[topic] = new
                        mark = frames.encode_control(
                            frames.HEAD_WATERMARK,
                            topic.topic_id,
                            batch.ts,
                            {"reserved_head": new},
                        )
                        out.append(mark)
                        nbytes += len(mark)
                        sync = True
                subs.append(sub)
                if sub.frame:
                    out.append(sub.frame)
                    nbytes += len(sub.frame)
                sync = sync or sub.sync
            topics += 1
            if q:
                self.ready.append(topic)
            else:
                del self.queues[topic]
        return nbytes, sync

    async def _commit_one_batch(self) -> None:
        subs: list[Submission] = []
        out: list[bytes] = []
        reserving: dict[Topic, int] = {}
        nbytes, sync = self._take(subs, out, 0, reserving)
        self.inflight_since = min(
            (sub.t0 for sub in subs if sub.counted), default=None
        )  # (the batch's first write; arrivals taken while the window is open are younger)
        enough = self.wal.gc_enough_records
        if (
            sync
            and (len(subs) > 1 or self.ready)
            and any(sub.sync for sub in subs)
            and (records := _records(subs, 0)) < enough
        ):
            # concurrent durable writers: keep taking arrivals while they keep coming (a
            # lone durable write with nothing else pending syncs at once; a sync that only
            # a seq reservation needs has no one to wait for), until the batch carries
            # `gc_enough_records`: its sync is then shared widely enough, and later
            # arrivals are staged during it and join the next batch (the loop keeps
            # working while the disk syncs, instead of idling through a last slice)
            opened = trio.current_time()
            window = self.commit_window_ms / 1000
            slice_s = self.wal.gc_slice_us / 1_000_000
            while nbytes < self.wal.max_batch_bytes and trio.current_time() - opened < window:
                await trio.sleep(slice_s)
                before = len(subs)
                nbytes, _ = self._take(subs, out, nbytes, reserving)
                if len(subs) == before:
                    break  # a slice brought nothing: stop waiting
                records += _records(subs, before)
                if records >= enough:
                    break
        data = b"".join(out)
        t0 = perf_ms()
        sync_ms = 0.0
        if data:
            try:
                if self.broken or self.tail + len(data) > self.allocated:
                    await self._rotate(len(data))
                self.io_since = trio.current_time()
                try:
                    sync_ms = await self.offload.run(
                        _write_and_sync,
                        self.fs,
                        self.fd,
                        data,
                        self.tail,
                        sync,
                        self.dropped_to,
                        group="wal",
                    )
                finally:
                    self.io_since = None
            except (_WriteFailed, _SyncFailed, OSError) as exc:
                self._fail(subs, exc)
                return
            self.tail += len(data)
            elapsed_s = (perf_ms() - t0) / 1000
            if elapsed_s > 0:
                self.ewma_bytes_per_s += 0.2 * (len(data) / elapsed_s - self.ewma_bytes_per_s)
            self.batches += 1
            self.frames_written += len(out)
            self.bytes_written += len(data)
            if self.on_written is not None:
                self.on_written()
            if sync:
                self._synced(sync_ms, sum(s.batch.count for s in subs if s.batch is not None))
            else:
                self.unsynced = True
        append_ms = perf_ms() - t0
        for topic, reserved in reserving.items():
            if reserved > topic.reserved_head:
                topic.reserved_head = reserved
                topic.mark_changed()
        self.inflight_since = None
        self._publish(subs, sync_ms, append_ms if data else None, unsynced=bool(data) and not sync)

    def _durable(self) -> None:
        """A sync covered everything written: tell the engine which heads are on disk."""
        heads = self.unsynced_heads
        if heads:
            self.unsynced_heads = {}
            for topic, head in heads.items():
                self.hooks.durable(topic, head)

    def _synced(self, sync_ms: float, records: int) -> None:
        """A sync covered everything written (and advised the page cache to drop it)."""
        self._durable()
        self.dropped_to = self.tail
        self.unsynced = False
        self.last_sync = trio.current_time()
        self.fsyncs += 1
        us = sync_ms * 1000
        self.fsync_us_total += us
        self.records_synced += records
        self.fsync_buckets[bisect.bisect_left(FSYNC_BUCKETS_US, us)] += 1

    def _publish(
        self,
        subs: list[Submission],
        sync_ms: float,
        append_ms: float | None,
        *,
        unsynced: bool = False,
    ) -> None:
        """Publish a committed batch in order (one synchronous block). `unsynced`: the
        batch was written without a sync, so its record frames are published as not yet
        durable and their topics' heads wait in `unsynced_heads` for the next sync."""
        heads = self.unsynced_heads
        for sub in subs:
            self._released(sub)
            batch = sub.batch
            if batch is not None:
                batch.fsync_ms = sync_ms
                batch.wal_append_ms = append_ms
                if unsynced and sub.frame:
                    batch.synced = False
                    self.hooks.publish_append(batch)
                    if not batch.completion.error:
                        heads[batch.topic] = batch.head_after
                else:
                    self.hooks.publish_append(batch)
            elif sub.apply is not None:
                try:
                    sub.result = sub.apply()
                except TopicdError as exc:
                    sub.resolve(exc)
                else:
                    sub.resolve()

    def _fail(self, subs: list[Submission], exc: BaseException) -> None:
        """A write/sync/rotation error: fail the batch and the shard's whole tail."""
        self.inflight_since = None
        inner = exc.exc if isinstance(exc, _WriteFailed | _SyncFailed) else exc
        assert isinstance(inner, OSError)
        what = (
            "fsync"
            if isinstance(exc, _SyncFailed)
            else "write"
            if isinstance(exc, _WriteFailed)
            else "rotation"
        )
        reason = f"{what} failed: {inner.strerror or inner}"
        log.error("WAL shard %d: %s; failing the batch and the shard's queue", self.index, reason)
        if isinstance(exc, _WriteFailed):
            self.breaker.record_write_error(reason)
        else:
            self.breaker.record_sync_error(reason)
        self.broken = True  # abandon the file: the next write starts a fenced fresh one
        ms = (
            self.breaker.retry_after_ms() if self.breaker.state is not BreakerState.CLOSED else 1000
        )
        self._fail_all(
            subs,
            StorageUnavailable(
                f"WAL shard {self.index}: {reason}; nothing of this request was applied",
                {"shard": self.index, "reason": reason, "retry_after_ms": ms},
                retry_after_s=math.ceil(ms / 1000),
            ),
        )

    def _fail_all(self, subs: list[Submission], error: StorageUnavailable) -> None:
        """Fail `subs` and every submission still queued, in one synchronous step, and
        release the failed topics' seqs (storage spec §7.5)."""
        tail: list[Submission] = list(subs)
        for topic in list(self.queues):
            tail.extend(self.queues.pop(topic))
        self.ready.clear()
        topics: set[Topic] = set()
        for sub in tail:
            self._released(sub)
            topics.add(sub.topic)
            if sub.batch is not None:
                self.hooks.fail_append(sub.batch, error)
            else:
                sub.resolve(error)
        for topic in topics:
            if topic not in self.unpublished:
                self.hooks.rewind(topic)

    async def _while_broken(self) -> None:
        """Breaker open or half-open: refuse queued work, then probe a fresh file."""
        if self.ready:
            ms = self.breaker.retry_after_ms()
            self._fail_all(
                [],
                StorageUnavailable(
                    f"WAL shard {self.index} is unavailable ({self.breaker.reason})",
                    {"shard": self.index, "reason": self.breaker.reason, "retry_after_ms": ms},
                    retry_after_s=math.ceil(ms / 1000),
                ),
            )
        if self.breaker.state is BreakerState.OPEN:
            with trio.move_on_at(self.breaker.open_until):
                await self.breaker.changed.wait()
            return
        # half-open: a synthetic probe into a fresh file, never the failed one
        ok = True
        try:
            await self._rotate(0)
            probe = frames.encode_control(frames.PROBE, 0, self.clock.now_ms(), {})
            await self.offload.run(
                _write_and_sync, self.fs, self.fd, probe, self.tail, True, group="wal"
            )
            self.tail += len(probe)
        except (_WriteFailed, _SyncFailed, OSError) as exc:
            ok = False
            self.broken = True
            log.warning("WAL shard %d: probe failed: %s", self.index, exc)
        self.breaker.record_probe(ok)
        if self.breaker.state is BreakerState.HALF_OPEN:
            await trio.sleep(self.cfg.breaker.probe_interval_ms / 1000)
        elif self.breaker.state is BreakerState.CLOSED:
            log.warning("WAL shard %d: storage recovered, breaker closed", self.index)

    async def _sync_only(self) -> None:
        try:
            with trio.CancelScope(shield=True):
                t0 = perf_ms()
                self.io_since = trio.current_time()
                try:
                    await self.offload.run(
                        _sync_and_drop, self.fs, self.fd, self.dropped_to, self.tail, group="wal"
                    )
                finally:
                    self.io_since = None
            self._synced(perf_ms() - t0, 0)
        except OSError as exc:
            self._fail([], _SyncFailed(exc))

    # ---- files --------------------------------------------------------------------------

    async def _open_initial(self) -> None:
        """Continue in the shard's last file (clearing a torn tail), or create file 0."""
        files = self._files
        for path in files.remove:
            await self.offload.run(self.fs.unlink, path, group="misc")
        if files.remove:
            await self.offload.run(self.fs.fsync_dir, self.dir, group="misc")
        if files.last_index < 0:
            await self._open_next_file()
            return
        path = posixpath.join(self.dir, wal_file_name(files.last_index))
        with trio.CancelScope(shield=True):
            fd, size = await self.offload.run(
                _reopen,
                self.fs,
                path,
                files.valid_len,
                self.wal.file_bytes,
                files.repair,
                group="wal",
            )
        self.fd, self.file_index = fd, files.last_index
        self.tail, self.allocated = files.valid_len, size
        self.last_sync = trio.current_time()

    async def _open_next_file(self, need: int = 0) -> None:
        index = self.file_index + 1
        size = max(self.wal.file_bytes, frames.FILE_HEADER_LEN + need)
        prev = self.tail if self.fd >= 0 else frames.NO_PREVIOUS
        header = frames.FileHeader(
            self.index, self.count, index, self.clock.now_ms(), prev
        ).encode()
        path = posixpath.join(self.dir, wal_file_name(index))
        with trio.CancelScope(shield=True):
            fd = await self.offload.run(
                _create_file, self.fs, path, self.dir, header, size, group="wal"
            )
        old = self.fd
        self.fd, self.file_index = fd, index
        self.tail, self.allocated = frames.FILE_HEADER_LEN, size
        self.dropped_to = 0
        self.broken = False
        self.unsynced = False
        self.last_sync = trio.current_time()
        if old >= 0:
            self.rotations += 1
            await self.offload.run(self.fs.close, old, group="misc")

    async def _rotate(self, need: int) -> None:
        """Switch to a fresh file whose header fences the current one (shielded)."""
        with trio.CancelScope(shield=True):
            if self.unsynced and not self.broken:
                try:
                    await self.offload.run(
                        _sync_and_drop, self.fs, self.fd, self.dropped_to, self.tail, group="wal"
                    )
                    self._synced(0.0, 0)
                except OSError as exc:
                    raise _SyncFailed(exc) from None
            await self._open_next_file(need)

    async def _close_file(self, *, final_sync: bool) -> None:
        if self.fd < 0:
            return
        if final_sync and not self.broken and self.unsynced:
            try:
                await self.offload.run(self.fs.fdatasync, self.fd, group="wal")
                self.unsynced = False
                self._durable()
            except OSError as exc:
                log.error("WAL shard %d: final fsync failed: %s", self.index, exc)
        try:
            await self.offload.run(self.fs.close, self.fd, group="misc")
        except OSError as exc:
            log.error("WAL shard %d: close failed: %s", self.index, exc)
        self.fd = -1


class Checkpoints(Protocol):
    """What the WAL backend needs of the checkpointer (`topicd.storage.checkpoint`)."""

    segments: SegmentStore
    backlog_full: bool  # the WAL bytes awaiting a checkpoint reached their bound

    async def checkpoint(self, *, final: bool = False) -> bool: ...

    def poke(self) -> None: ...

    def backlog(self) -> int: ...

    async def wait_backlog(self) -> None: ...

    def backlog_bound(self) -> int: ...


class WalCommitPath:
    """The engine's commit path over `N` WAL shards (see module docstring)."""

    def __init__(
        self,
        cfg: Config,
        fs: Fs,
        offload: Offload,
        clock: WallClock,
        root: str,
        shard_files: list[ShardFiles],
    ) -> None:
        self.cfg = cfg
        self.fs = fs
        self.offload = offload
        self.clock = clock
        self.root = root
        self._shard_files = shard_files
        self.shards: list[Shard] = []
        self._hooks: CommitHooks | None = None
        self.pressure = 0.0  # the governor's, for pressure admission and retry hints
        self.rng = random.Random()  # retry_after_ms jitter (tests may seed it)
        # the storage seam's other half (`StorageBackend`), set by the storage service
        self.checkpointer: Checkpoints | None = None
        self.backlog_refused = 0  # writes refused while the checkpoint backlog was full

    @property
    def shard_count(self) -> int:
        return len(self._shard_files)

    def attach(self, hooks: CommitHooks) -> None:
        self._hooks = hooks
        n = len(self._shard_files)
        self.shards = [
            Shard(i, n, self.root, files, self.cfg, self.fs, self.offload, self.clock, hooks)
            for i, files in enumerate(self._shard_files)
        ]
        for shard in self.shards:
            shard.on_written = self._written

    def _written(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.poke()

    def shard(self, topic: Topic) -> Shard:
        return self.shards[shard_of(topic.topic_id, len(self.shards))]

    # ---- CommitPath ----------------------------------------------------------------------

    def admit(self, topic: Topic, nbytes: int, *, bypass: bool = False) -> None:
        shard = self.shard(topic)
        durable = topic.config.durability != "ephemeral"
        if durable:
            shard.breaker.check()
        if (
            not bypass
            and self.pressure >= self.cfg.governor.throttle_at
            and shard.ingest_ratio(timed=durable) >= self.cfg.levels.critical
        ):
            # saturated and this shard's ingest is critical (scheduler spec B.5)
            shard.pressure_refused += 1
            raise Throttled.pressure(shard.retry_after_ms(self.pressure, self.rng))
        scope = shard.room_for(topic, nbytes)
        if scope is None and not bypass and self.backlog_full(topic):
            # the records written since the last checkpoint are pinned in memory until
            # one absorbs them (topicd.storage.checkpoint): a write that waited for one
            # (`Engine.write`) as long as `backpressure.bypass_wait_ms` allows gets 429
            scope = "shard"
            self.backlog_refused += 1
        if scope is not None:
            shard.submit_full += 1
            raise Throttled.pressure(
                shard.retry_after_ms(self.pressure, self.rng), cause="wal_ingest", scope=scope
            )

    def backlog_full(self, topic: Topic) -> bool:
        cp = self.checkpointer
        return cp is not None and cp.backlog_full and topic.config.durability != "ephemeral"

    async def wait_backlog(self) -> None:
        if self.checkpointer is not None:
            await self.checkpointer.wait_backlog()

    def register_queues(self, registry: SaturationRegistry) -> None:
        """Each shard's ingest queue in the saturation registry (scheduler spec R4), and
        the WAL bytes awaiting a checkpoint (`checkpoint_backlog`, in bytes)."""
        w = self.cfg.storage.wal
        cp = self.checkpointer
        if cp is not None:
            registry.register(
                "checkpoint_backlog",
                cp.backlog,
                cp.backlog_bound,
                full=partial(getattr, self, "backlog_refused"),
            )
        for shard in self.shards:
            registry.register(
                f"wal_ingest.{shard.index}",
                partial(getattr, shard, "pending"),
                lambda: w.max_pending_per_shard,
                full=partial(getattr, shard, "submit_full"),
                peak=partial(getattr, shard, "pending_peak"),
            )

    def govern(self, pressure: float, commit_window_ms: float | None) -> None:
        self.pressure = pressure
        if commit_window_ms is not None:
            for shard in self.shards:
                shard.commit_window_ms = commit_window_ms

    def check_stalls(self, now: float) -> None:
        for shard in self.shards:
            shard.check_stall(now)

    def pool_loads(self, now: float) -> list[tuple[str, float, int]]:
        """Busy integrals of the offload groups client work waits on (the governor's s3).
        Not the `snapshot` group: its one token is a checkpoint's, which runs for seconds
        on a large data set while clients wait for nothing (topicd decision: counting it
        pinned pressure at 1.0 through every long checkpoint of an idle server). Not the
        `wal` group either: a committer syncing back to back is busy all the time at any
        load, however many writes each sync carries (it read 0.92–0.97 at the lowest
        load); the WAL's queue is read in time instead (`backlog_ratio`, s5)."""
        out: list[tuple[str, float, int]] = []
        for group in ("misc", "read"):
            tokens = self.offload.tokens(group)
            out.append((group, self.offload.stats(group).busy_integral(now), max(tokens, 1)))
        return out

    def backlog_ratio(self) -> float:
        """The longest wait of an uncommitted write over the shards ÷
        `storage.wal.max_pending_ms` (the governor's s5; 0 with no time bound)."""
        bound = self.cfg.storage.wal.max_pending_ms
        if not bound:
            return 0.0
        now = trio.current_time()
        return max(shard.queue_delay_ms(now) for shard in self.shards) / bound

    async def wait_for_room(self, topic: Topic, nbytes: int) -> None:
        shard = self.shard(topic)
        while shard.room_for(topic, nbytes) is not None:
            await shard.wait_for_room()

    def submit(self, batch: AppendBatch) -> None:
        assert self._hooks is not None
        topic = batch.topic
        shard = self.shard(topic)
        joined, batch.joined = batch.joined, None
        if batch.durability == "ephemeral":
            if topic not in shard.unpublished and batch.last_seq <= topic.reserved_head:
                self._hooks.publish_append(batch)  # in-memory only: ack = the append
                return
            frame = b""
        else:
            p = batch.prepared
            extras = (
                frames.NO_EXTRAS
                if batch.idem_key is None and not (p.tags or p.nodes or p.prios or p.shapes)
                else frames.Extras(batch.idem_key, p.tags, p.nodes, p.prios, p.shapes)
            )
            frame = frames.encode_append(
                topic.topic_id,
                batch.first_seq,
                batch.ts,
                batch.encs,
                p.sizes,
                extras,
                fsync_class=batch.durability == "fsync",
                joined=joined,
                max_frame=self.cfg.storage.wal.max_frame_bytes,
            )
        shard.enqueue(
            Submission(
                topic,
                frame,
                batch,
                sync=batch.durability == "fsync",
                counted=True,
                t0=trio.current_time(),
            )
        )

    async def control(
        self,
        topic: Topic,
        frame: bytes | None,
        apply: Callable[[], _T],
        *,
        sync: bool = True,
        abandoned: Callable[[], None] | None = None,
    ) -> _T:
        shard = self.shard(topic)
        if frame is None and topic not in shard.unpublished:
            try:
                await trio.lowlevel.checkpoint()
            except trio.Cancelled:
                if abandoned is not None:
                    abandoned()
                raise
            return apply()
        if frame is not None:
            try:
                shard.breaker.check()
            except TopicdError:
                if abandoned is not None:
                    abandoned()
                raise
        sub = Submission(topic, frame or b"", None, apply, sync=sync and frame is not None)
        sub.abandoned = abandoned
        shard.enqueue(sub, front=True)
        give_back()  # the request only waits for the WAL from here: free its client permit
        await sub.wait()
        if sub.error is not None:
            raise sub.error
        return sub.result  # type: ignore[return-value]

    def status(self) -> dict[str, JsonValue]:
        breakers: dict[str, JsonValue] = {}
        for shard in self.shards:
            state = shard.breaker.poll()
            breakers[str(shard.index)] = state.name.lower().replace("_", "-")
        return {"wal_shards": len(self.shards), "breakers": breakers}

    def check_all(self) -> None:
        for shard in self.shards:
            shard.breaker.check()

    # ---- StorageBackend -----------------------------------------------------------------

    async def checkpoint(self, *, final: bool = False) -> bool:
        assert self.checkpointer is not None
        return await self.checkpointer.checkpoint(final=final)

    async def read_stored(self, topic: Topic, seq: int, min_visible: int) -> bytes | None:
        """A record read back from its segment (offloaded, read limiter, verified)."""
        assert self.checkpointer is not None
        if seq < min_visible:
            await trio.lowlevel.checkpoint()
            return None
        store = self.checkpointer.segments
        try:
            rec = await self.offload.run(store.read_record, topic.topic_id, seq, group="read")
        except SegmentCorruption as exc:
            raise Internal(f"stored record {seq} of topic {topic.name!r} is corrupt") from exc
        except OSError as exc:
            raise Internal(f"stored record {seq} of topic {topic.name!r}: {exc}") from exc
        return None if rec is None else rec.enc

    async def read_stored_range(
        self, topic: Topic, lo: int, hi: int, max_bytes: int
    ) -> dict[int, bytes]:
        """Records read back from their segments in one offloaded call (read limiter)."""
        assert self.checkpointer is not None
        store = self.checkpointer.segments
        try:
            return await self.offload.run(
                store.read_range, topic.topic_id, lo, hi, max_bytes, group="read"
            )
        except SegmentCorruption as exc:
            raise Internal(f"stored records of topic {topic.name!r} are corrupt") from exc
        except OSError as exc:
            raise Internal(f"stored records {lo}..{hi} of topic {topic.name!r}: {exc}") from exc

    def storage_stats(self) -> dict[str, int]:
        return {} if self.checkpointer is None else self.checkpointer.segments.stats()

    # ---- lifecycle --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every shard's committer; returns once all have stopped after `close()`."""
        async with trio.open_nursery() as outer:
            for shard in self.shards:
                outer.start_soon(shard.tail_syncer)
            async with trio.open_nursery() as committers:
                for shard in self.shards:
                    await committers.start(shard.run)
                task_status.started()
            outer.cancel_scope.cancel("committers stopped")

    async def close(self) -> None:
        """Commit everything accepted, sync, and stop the committers."""
        for shard in self.shards:
            shard.closing = True
            shard._work.set()
        for shard in self.shards:
            await shard.stopped.wait()
