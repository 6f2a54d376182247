"""Recovery: rebuild the engine from the data directory (storage spec §10).

Runs in one worker thread before the engine serves (or inline in tests, over `FakeDisk`)
and builds a private `Engine` that nothing else touches until recovery returns it.

1. **Open.** `FORMAT` says what wrote the directory; an empty directory (or one holding
   only what a killed first start leaves: an older version's lock file, temp files, an
   empty `wal/` tree) is a fresh start (FORMAT is written after recovery); anything else
   without FORMAT is refused.
2. **Replay** each shard's WAL files in index order. A file with a successor is valid up
   to the successor's fence (`prev_valid_len`): every frame before it must validate. In
   the last file frames are read until the first invalid one, at X; if a checksum-valid
   frame exists anywhere after X the log is corrupt in the middle (refused), otherwise the
   rest is a torn tail (ignored: the next file's header fences it).
3. **Apply** every frame through the engine's own `apply_*` methods, in log order (per
   topic, log order is commit order), so replayed state equals live state.
4. **Finish.** Names are registered from the live instances; heads are raised to their
   seq reservation. If the machine rebooted since the last run (the kernel boot id
   changed), the raised part of a `memory`/`disk` topic may have held acknowledged records
   lost with the unsynced tail: it becomes a *lost range*, announced to readers as a
   `crash` tombstone. After a mere process crash (same boot id) written bytes were in the
   page cache, so nothing was lost and no lost range is recorded.

Failures raise `RecoveryRefused` with one operator-readable message (the command exits 4);
nothing is modified by a refused recovery.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import posixpath
import re
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, TypeAlias, TypeVar

import orjson

from topicd.clock import perf_ms
from topicd.engine.engine import Engine
from topicd.engine.queues import LeaseEvent, QueueSnap
from topicd.engine.topic import EVICTED, Enc, Run, Topic
from topicd.errors import TopicNotEmpty
from topicd.model import TopicConfig
from topicd.storage import frame as frames
from topicd.storage import segments as segs
from topicd.storage import snapshot, tiering
from topicd.storage.fs import replace_file
from topicd.storage.wal import ShardFiles

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from topicd.clock import WallClock
    from topicd.config import Config
    from topicd.storage.fs import Fs

log = logging.getLogger("topicd.recovery")

FORMAT_FILE: Final = "FORMAT"
BOOT_FILE: Final = "BOOT_ID"
LOCK_FILE: Final = ".topicd.lock"
# 2: segments hold run frames (`topicd.storage.segments`); 1 (one-record frames only) is
# read as well and upgraded to 2 once recovery succeeded (an older topicd then refuses the
# directory by its FORMAT instead of misreading a run frame as damage)
STORAGE_FORMAT: Final = 2
READABLE_FORMATS: Final = frozenset({1, 2})
FORMAT_BODY: Final = b'{"storage_format":2,"checksum":"xxh3_64"}\n'
_WAL_NAME: Final = re.compile(r"wal-([0-9a-f]{16})\.log")
_SHARD_NAME: Final = re.compile(r"shard-([0-9]{2})")
_CONFIG_FIELDS: Final = frozenset(TopicConfig.__dataclass_fields__)
_MAX_DEAD_PAD: Final = 4096


MetaWrite: TypeAlias = tuple[str, bytes]  # (path, contents)


class RecoveryRefused(Exception):
    """Recovery cannot vouch for the state: do not serve (exit 4)."""


@dataclass
class LostRangeNote:
    topic: Topic
    gap_from: int
    gap_to: int


@dataclass
class RecoveryResult:
    engine: Engine
    shard_files: list[ShardFiles]
    lost: list[LostRangeNote] = field(default_factory=list)
    frames: int = 0
    bytes: int = 0
    torn: list[str] = field(default_factory=list)
    fresh: bool = False
    snapshot_number: int = 0
    snapshot_positions: list[tuple[int, int]] | None = None
    reshard_to: int | None = None  # the configured shard count differs: re-shard at start
    segments: segs.SegmentStore | None = None
    # repairs to run once recovery succeeded: (segment, registered length) to cut back
    # to, and files or topic directories no registry names
    segment_truncate: list[tuple[str, int]] = field(default_factory=list)
    segment_orphans: list[str] = field(default_factory=list)
    segment_metas: list[MetaWrite] = field(default_factory=list)  # `.meta` files to write


def config_from_wire(obj: object) -> TopicConfig:
    if not isinstance(obj, dict):
        raise frames.FrameError("config is not an object")
    values = {k: v for k, v in obj.items() if k in _CONFIG_FIELDS}
    return TopicConfig(**values)


def _int(body: dict[str, object], key: str) -> int:
    value = body[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise frames.FrameError(f"{key} is not an integer")
    return value


def _str(body: dict[str, object], key: str) -> str:
    value = body[key]
    if not isinstance(value, str):
        raise frames.FrameError(f"{key} is not a string")
    return value


def lease_events(body: dict[str, object]) -> list[LeaseEvent]:
    """The events of a `Lease` frame: `[kind, seq, node, lease_id, time_ms, deliveries]`."""
    events = body["events"]
    if not isinstance(events, list):
        raise frames.FrameError("lease events are not a list")
    out: list[LeaseEvent] = []
    for ev in events:
        if not (
            isinstance(ev, list)
            and len(ev) == 6
            and ev[0] in ("claimed", "extended", "released")
            and isinstance(ev[2], str)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in ev[3:] + ev[1:2])
        ):
            raise frames.FrameError(f"bad lease event {ev!r:.200}")
        out.append((ev[0], ev[1], ev[2], ev[3], ev[4], ev[5]))
    return out


def read_boot_id() -> str | None:
    """The kernel's boot id (Linux), or None where there is none (treated as a reboot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


class ReplayReport:
    """Progress of a long replay, logged at most every `log_every_ms` (and only once a
    replay has run that long): frames, bytes, topics and elapsed time, so an operator
    watching a slow start or `topicd verify` sees it move. `now` is a reporting clock
    (milliseconds), injectable for tests."""

    def __init__(self, log_every_ms: float, now: Callable[[], float] = perf_ms) -> None:
        self.every = log_every_ms
        self.now = now
        self.started = now()
        self.next_at = self.started + log_every_ms
        self.frames = 0
        self.bytes = 0
        self.topics = 0
        self.current = ""
        self.lines = 0

    def file(self, name: str) -> None:
        self.current = name
        self.tick()

    def advance(self, nbytes: int, topics: int) -> None:
        self.frames += 1
        self.bytes += nbytes
        self.topics = topics
        if not self.frames & 1023 or nbytes >= 1 << 20:  # a clock read per 1024 frames or MiB
            self.tick()

    def tick(self) -> None:
        t = self.now()
        if t < self.next_at:
            return
        self.next_at = t + self.every
        self.lines += 1
        log.info(
            "replay in progress: %d frames, %d bytes, %d topics, %.1f s elapsed (at %s)",
            self.frames,
            self.bytes,
            self.topics,
            (t - self.started) / 1000,
            self.current,
        )


_A = TypeVar("_A")
# topics whose registered segments are loaded ahead together (`_Replayer._load_ahead`)
_LOAD_GROUP: Final = 64
_Loaded: TypeAlias = "tuple[segs.LoadedSegment, bool, int]"
_Ahead: TypeAlias = "dict[tuple[int, int], Future[_Loaded]]"


class _Replayer:
    def __init__(
        self,
        cfg: Config,
        fs: Fs,
        clock: WallClock,
        root: str,
        progress: Callable[[float], None],
        truncate_on_corruption: bool,
        check_sealed: bool = False,
        read_workers: int = 1,
    ) -> None:
        self.cfg = cfg
        self.fs = fs
        self.clock = clock
        self.root = root
        self.progress = progress
        self.truncate = truncate_on_corruption
        # read and check every segment's data bytes too (`topicd verify`); a start reads
        # only each active segment's last frame (each read verifies what it reads)
        self.check_sealed = check_sealed
        # threads loading registered segments ahead of the topics being built (1: in
        # order, in this thread — what deterministic tests use)
        self.read_workers = read_workers
        self.engine = Engine(cfg, clock)
        self.engine.replaying = True
        self.now = clock.now_ms()
        self.frames = 0
        self.bytes_done = 0  # file bytes gone through (replay progress)
        self.replayed = 0  # bytes of valid log replayed
        self.bytes_total = 1
        self.torn: list[str] = []
        self.dirty_tail = False  # the last replayed file has non-zero bytes after its end
        self.pending: list[frames.Frame] = []  # a multi-frame write awaiting its last frame
        # routers: each topic's head as the snapshot left it, the seq ranges of replayed
        # direct writes, and gaps between them only router copies can explain
        self.snap_heads: dict[int, int] = {}
        # per topic with segments, the registry its snapshot entry names
        self.registered: dict[int, list[segs.SegSnap]] = {}
        self.direct: dict[int, list[tuple[int, int]]] = {}
        self.gaps: list[tuple[int, int, int]] = []
        self.report = ReplayReport(log_every_ms=1000.0)
        self.cold_root = cfg.storage.cold_dir
        self.segments = segs.SegmentStore(
            fs, root, cfg.storage.segments, cold_root=self.cold_root, tiering=cfg.storage.tiering
        )
        self.seg_truncate: list[tuple[str, int]] = []
        self.seg_metas: list[tuple[str, bytes]] = []
        self.filled_from: dict[int, int] = {}  # topic → lowest router source seq filled

    # ---- files ------------------------------------------------------------------------

    def shard_dirs(self) -> list[tuple[int, str]]:
        wal = posixpath.join(self.root, "wal")
        if not self.fs.exists(wal):
            return []
        out = []
        for name in self.fs.listdir(wal):
            m = _SHARD_NAME.fullmatch(name)
            if m:
                out.append((int(m.group(1)), posixpath.join(wal, name)))
        return sorted(out)

    def wal_files(self, shard_dir: str) -> list[tuple[int, str]]:
        out = []
        for name in self.fs.listdir(shard_dir):
            m = _WAL_NAME.fullmatch(name)
            if m:
                out.append((int(m.group(1), 16), posixpath.join(shard_dir, name)))
        out.sort()
        return out

    def check_contiguous(self, files: list[tuple[int, str]]) -> None:
        for (a, path_a), (b, _) in itertools.pairwise(files):
            if b != a + 1:
                raise RecoveryRefused(
                    f"{self._rel(path_a)}: WAL file index gap after {a} (next is {b}); "
                    "files are missing from the middle of the log. Restore a backup."
                )

    def _rel(self, path: str) -> str:
        return posixpath.relpath(path, self.root)

    def replay_shard(
        self, shard: int, shard_dir: str, start: tuple[int, int] | None, layout: int
    ) -> ShardFiles:
        """Replay one shard from `start` (a snapshot's position) or from its first file.

        Files written under another shard count (left over from a re-shard whose snapshot
        is durable) are stale: they are skipped and removed when the shard opens."""
        files = self.wal_files(shard_dir)
        stale: list[str] = []
        if start is not None:
            for index, path in list(files):
                head = _read_head(self.fs, path)
                try:
                    count = frames.decode_file_header(head).shard_count
                except frames.HeaderError:
                    continue
                if count != layout:
                    files.remove((index, path))
                    stale.append(path)
        if shard >= layout:
            return ShardFiles(remove=stale + [p for _, p in files])
        start_index, start_offset = start if start is not None else (0, 0)
        files = [f for f in files if f[0] >= start_index]  # older ones await trimming
        self.check_contiguous(files)
        if not files:
            if start_index > 0 and start_offset > frames.FILE_HEADER_LEN:
                raise RecoveryRefused(
                    f"{self._rel(shard_dir)}: WAL file {start_index} named by the snapshot is "
                    "missing; restore a backup."
                )
            return ShardFiles(remove=stale)
        if files[0][0] != start_index:
            raise RecoveryRefused(
                f"{self._rel(files[0][1])}: the shard's history starts at file {files[0][0]} "
                f"but {'the snapshot' if start else 'replay'} needs file {start_index}; "
                "restore a backup."
            )
        datas: list[bytes] = []
        headers: list[frames.FileHeader] = []
        remove: list[str] = []
        for index, path in files:
            try:
                data = self.fs.read(path)
            except OSError as exc:
                raise RecoveryRefused(
                    f"{self._rel(path)}: read failed ({exc.strerror}); fix the device and retry."
                ) from None
            try:
                header = frames.decode_file_header(data)
            except frames.HeaderError as exc:
                if index == files[-1][0] and frames.all_zero(
                    data, frames.FILE_HEADER_LEN, len(data)
                ):
                    # a file created (rotation, first start, re-shard) whose header never
                    # became durable: no frame was ever written to it
                    log.warning("%s: empty unfinished WAL file removed", self._rel(path))
                    files.pop()
                    remove.append(path)
                    break
                raise RecoveryRefused(f"{self._rel(path)}: {exc}; restore a backup.") from None
            if header.file_index != index or header.shard != shard:
                raise RecoveryRefused(
                    f"{self._rel(path)}: header names shard {header.shard} file "
                    f"{header.file_index}; restore a backup."
                )
            datas.append(data)
            headers.append(header)
        if not files:
            return ShardFiles(remove=stale + remove)
        self.dirty_tail = False
        valid_len = frames.FILE_HEADER_LEN
        for i, ((_index, path), data) in enumerate(zip(files, datas, strict=True)):
            fence = headers[i + 1].prev_valid_len if i + 1 < len(files) else None
            begin = max(frames.FILE_HEADER_LEN, start_offset if i == 0 else 0)
            valid_len = self.replay_file(path, data, fence, begin)
            self.replayed += max(0, valid_len - begin)
            self.bytes_done += len(data)
            self.progress(min(0.99, self.bytes_done / self.bytes_total))
        repair = self.dirty_tail
        return ShardFiles(files[-1][0], valid_len, repair, stale + remove)

    def replay_file(self, path: str, data: bytes, fence: int | None, start: int = 0) -> int:
        """Apply the frames of one file from offset `start`; return its valid length."""
        # frames topicd writes are at most max_frame_bytes, but versions before multi-frame
        # writes stored a whole write as one frame of any size: those are read too
        max_frame = max(self.cfg.storage.wal.max_frame_bytes, frames.LEGACY_MAX_FRAME)
        limit = len(data) if fence is None else fence
        if fence is not None and fence > len(data):
            raise RecoveryRefused(
                f"{self._rel(path)}: shorter ({len(data)} bytes) than the next file's fence "
                f"({fence}); restore a backup."
            )
        pos = max(frames.FILE_HEADER_LEN, start)
        self.pending = []
        self.report.file(self._rel(path))
        while pos < limit:
            try:
                frame = frames.read_frame(data, pos, limit, max_frame)
            except frames.FrameError as exc:
                raise RecoveryRefused(
                    f"{self._rel(path)} offset {pos}: {exc}; run a topicd version that knows "
                    "this format."
                ) from None
            if frame is None:
                break
            self.apply(frame, path)
            self.report.advance(frame.end - pos, len(self.engine.by_id))
            pos = frame.end
        # a write whose last frame is missing was never acknowledged: it ends the valid log
        end = self.pending[0].offset if self.pending else pos
        if fence is not None:
            if pos != fence or self.pending:
                raise RecoveryRefused(
                    f"{self._rel(path)} offset {end}: "
                    + ("invalid frame" if pos != fence else "a write's frames cut")
                    + f" before the fence at {fence} (mid-log corruption). Acknowledged "
                    "writes may lie beyond this point. Nothing was modified. To discard "
                    "everything from this offset on, restart with "
                    "--recovery-on-corruption=truncate."
                )
            return fence
        # the last file: is the rest zeros, a torn tail, or corruption? (one scan)
        first_nonzero = frames.next_nonzero(data, end, len(data))
        self.dirty_tail = first_nonzero >= 0
        self.pending = []
        if first_nonzero < 0:
            return end
        nxt = frames.find_valid_frame(data, pos + 1, len(data), max_frame)
        if nxt >= 0:
            message = (
                f"{self._rel(path)} offset {pos}: invalid frame followed by a valid frame at "
                f"offset {nxt} (mid-log corruption). Acknowledged writes may lie beyond this "
                "point."
            )
            if not self.truncate:
                raise RecoveryRefused(
                    message + " Nothing was modified. To discard everything from this offset "
                    "on, restart with --recovery-on-corruption=truncate."
                )
            discarded = 0
            at = nxt
            while at >= 0:
                try:
                    frame = frames.read_frame(data, at, len(data), max_frame)
                except frames.FrameError:
                    frame = None
                    discarded += 1
                if frame is None:
                    at = frames.find_valid_frame(data, at + 1, len(data), max_frame)
                    continue
                discarded += 1
                at = frame.end
            log.error(
                "%s Discarding the rest of the log (--recovery-on-corruption=truncate): "
                "%d checksum-valid frames dropped.",
                message,
                discarded,
            )
        else:
            self.torn.append(f"{self._rel(path)} at {end}")
        return end

    # ---- snapshot -------------------------------------------------------------------

    def load_snapshot(
        self, body: snapshot.SnapshotBody, topics: Iterable[snapshot.TopicSnap] | None = None
    ) -> None:
        """Build the engine's topics from `topics` (default `body.topics`)."""
        engine = self.engine
        engine.next_topic_id = max(engine.next_topic_id, body.next_topic_id)
        snaps = iter(body.topics if topics is None else topics)
        with contextlib.ExitStack() as stack:
            pool = (
                stack.enter_context(ThreadPoolExecutor(self.read_workers))
                if self.read_workers > 1
                else None
            )
            while group := list(itertools.islice(snaps, _LOAD_GROUP)):
                ahead = self._load_ahead(pool, group) if pool is not None else {}
                for snap in group:
                    self._build_topic(snap, ahead)
        for tid, key, first, count_, head, expires in body.idempotency:
            engine.idem.restore(tid, key, first, count_, head, expires, self.now)
        engine.routers.load(body.routers)

    def _load_ahead(self, pool: ThreadPoolExecutor, group: list[snapshot.TopicSnap]) -> _Ahead:
        """Start loading every segment the group's topics register, `read_workers` at a
        time: each load is a few reads of its own files (the `.meta`, the active
        segment's last frame), so several in flight keep the disk busy where one at a time
        would wait out each read's latency (a restart right after the page cache was
        emptied reads about 1,500 such files at 10 GiB retained)."""
        return {
            (snap.id, reg.first): pool.submit(self._load_segment, snap, reg)
            for snap in group
            for reg in snap.segments
        }

    def _build_topic(self, snap: snapshot.TopicSnap, ahead: _Ahead) -> None:
        engine = self.engine
        if snap.segments:
            self.registered[snap.id] = snap.segments
        topic = Topic(
            snap.name, snap.id, config_from_wire(snap.config), name_json=orjson.dumps(snap.name)
        )
        pieces, count, nbytes = self.load_records(topic, snap, ahead)
        topic.runs = _build_runs(pieces, snap.head)
        topic.head_seq = snap.head
        topic.next_seq = snap.head + 1
        topic.earliest_seq = snap.earliest
        topic.evict_floor = snap.evict_floor
        if snap.evictions:
            topic.evictions.load(snap.evictions)
        topic.lost_ranges = tuple((lo, hi) for lo, hi in snap.lost)
        topic.trims = tuple((lo, hi) for lo, hi in snap.trims)
        self.snap_heads[snap.id] = snap.head
        topic.last_ts = snap.last_ts
        topic.last_write_ts = snap.last_write_ts
        topic.last_read_ts = snap.last_read_ts
        topic.reserved_head = snap.reserved
        topic.count, topic.bytes = count, nbytes
        # (a topic's extras maps start shared and read-only: merge into new ones)
        if snap.tags:
            topic.tags = {**topic.tags, **snap.tags}
        if snap.nodes:
            topic.nodes = {**topic.nodes, **snap.nodes}
        if snap.prios:
            topic.prios = {**topic.prios, **snap.prios}
        if snap.shapes:
            topic.shapes = {**topic.shapes, **snap.shapes}
        if topic.tags:
            topic.tag_index.rebuild(sorted(topic.tags.items()))
        topic.seg_tail = snap.absorbed
        if topic.runs[-1].end != topic.head_seq and topic.runs[-1].encs:
            raise snapshot.SnapshotError(f"topic {snap.name!r}: runs end before head")
        engine.apply_create(topic)
        if topic.queue is not None and snap.queue is not None:
            q = snap.queue
            topic.queue.restore(QueueSnap(q.leases, q.deliveries, q.delays))
        engine.total_bytes += nbytes

    def locate(self, snap: snapshot.TopicSnap, reg: segs.SegSnap) -> bool:
        """Whether to load a registered segment from the cold tier. A cold-registered one
        is looked for only there (an older hot copy may lack delete flags flipped since);
        a hot-registered one is looked for in the cold tier too when its hot copy is gone
        (an older snapshot, used because the newest was unreadable, may name as hot a
        segment that was relocated since: `topicd.storage.tiering`)."""
        if reg.cold:
            if not self.cold_root:
                raise RecoveryRefused(
                    f"{segs.data_path('', snap.id, reg.first)}: the snapshot registers "
                    f"this segment of topic {snap.name!r} in the cold tier, but "
                    "storage.cold_dir is not set. Nothing was modified. Set storage.cold_dir "
                    "to the cold tier's directory."
                )
            return True
        return bool(
            self.cold_root
            and not self.fs.exists(segs.data_path(self.root, snap.id, reg.first))
            and self.fs.exists(segs.data_path(self.cold_root, snap.id, reg.first))
        )

    def _load_segment(self, snap: snapshot.TopicSnap, reg: segs.SegSnap) -> _Loaded:
        """One registered segment, loaded (blocking, read-only: safe in any thread),
        whether it is the cold copy, and the sum of its record sizes (read from its `.meta`
        chunks, or summed here, in the reader thread, while the topics are built). Raises
        `RecoveryRefused`."""
        cold = self.locate(snap, reg)
        max_frame = max(self.cfg.storage.wal.max_frame_bytes, frames.LEGACY_MAX_FRAME)
        try:
            loaded = segs.load_segment(
                self.fs,
                self.cold_root if cold else self.root,
                snap.id,
                reg,
                max_frame=max_frame,
                check_data=self.check_sealed,
            )
        except segs.SegmentCorruption as exc:
            where = " in the cold tier" if cold else ""
            raise RecoveryRefused(
                f"{exc.path} offset {exc.offset}: {exc.reason} (segment of topic "
                f"{snap.name!r} registered by the snapshot{where}). Nothing was "
                "modified. Restore a backup."
            ) from None
        size_sum = loaded.size_sum
        return loaded, cold, size_sum if size_sum >= 0 else sum(loaded.sizes)

    def load_records(
        self, topic: Topic, snap: snapshot.TopicSnap, ahead: _Ahead | None = None
    ) -> tuple[list[tuple[int, list[Enc], array[int], array[int]]], int, int]:
        """The topic's slots in seq order as column pieces `(base, encs, ts, sizes)` —
        its segments' slots from `earliest` on (live records `EVICTED`: their bytes
        stay in the segment files), then the snapshot's own runs above them — with the
        live count and bytes. Segment records' extras go straight into the topic's maps.
        Column work only: no Python object per record."""
        pieces: list[tuple[int, list[Enc], array[int], array[int]]] = []
        count = nbytes = 0
        if snap.segments or snap.absorbed:  # (an inline topic has no segment state)
            state = self.segments.state(snap.id)
            state.absorbed = snap.absorbed
        earliest = snap.earliest
        for reg in snap.segments:
            # (loaded ahead by the read workers, or here; a failure raises in this order)
            future = ahead.pop((snap.id, reg.first), None) if ahead else None
            loaded, cold, size_sum = future.result() if future else self._load_segment(snap, reg)
            where_root = self.cold_root if cold else self.root
            seg = loaded.segment
            seg.cold = cold
            state.segments.append(seg)
            if loaded.excess:
                self.seg_truncate.append(
                    (segs.data_path(where_root, snap.id, reg.first), reg.data_len)
                )
            if loaded.rewrite is not None:
                self.seg_metas.append(
                    (segs.meta_path(where_root, snap.id, reg.first), loaded.rewrite)
                )
            lo = max(seg.first, earliest)
            if lo > seg.last:
                continue
            i = lo - seg.first
            # (sliced only when needed: the index columns are only read here, and `ts` and
            # `sizes` are the load's own, copied into the topic's runs)
            offsets, flags = (seg.offsets[i:], seg.flags[i:]) if i else (seg.offsets, seg.flags)
            ts, sizes = (loaded.ts[i:], loaded.sizes[i:]) if i else (loaded.ts, loaded.sizes)
            n = len(offsets)
            encs: list[Enc]
            if flags.find(1) < 0 and not segs.has_absent(offsets):
                encs = [EVICTED] * n  # (the common case: nothing deleted or absent)
                count += n
                nbytes += size_sum if i == 0 else sum(sizes)
            else:
                encs = [
                    None if f or o == segs.ABSENT else EVICTED
                    for o, f in zip(offsets, flags, strict=True)
                ]
                for k, enc in enumerate(encs):
                    if enc is None:
                        sizes[k] = 0
                count += n - encs.count(None)
                nbytes += sum(sizes)
            pieces.append((lo, encs, ts, sizes))
            tags, nodes, prios, shapes = loaded.extras
            # (a topic's extras maps start shared and read-only: give it its own first)
            if tags and not topic.tags:
                topic.tags = {}
            if nodes and not topic.nodes:
                topic.nodes = {}
            if prios and not topic.prios:
                topic.prios = {}
            if shapes and not topic.shapes:
                topic.shapes = {}
            for extra, into in ((tags, topic.tags), (nodes, topic.nodes), (prios, topic.prios)):
                for seq, value in extra.items():
                    if lo <= seq <= seg.last and encs[seq - lo] is not None:
                        into[seq] = value  # type: ignore[assignment]
            for seq, shape in shapes.items():
                if lo <= seq <= seg.last and encs[seq - lo] is not None:
                    topic.shapes[seq] = (shape[0], shape[1])
        for base, run_encs, run_ts, run_sizes in snapshot.restore_runs(snap):
            for enc, size in zip(run_encs, run_sizes, strict=True):
                if enc is not None:
                    count += 1
                    nbytes += size
            pieces.append((base, list(run_encs), run_ts, run_sizes))
        return pieces, count, nbytes

    # ---- frames -------------------------------------------------------------------------

    def apply(self, frame: frames.Frame, path: str) -> None:
        self.frames += 1
        pending = self.pending
        if pending:
            # the next frame of a multi-frame write: it must continue that write
            last = pending[-1]
            if (
                frame.ftype != frames.APPEND
                or frame.topic_id != last.topic_id
                or frame.seq != last.seq + last.count
            ):
                raise RecoveryRefused(
                    f"{self._rel(path)} offset {frame.offset}: a write's frames are "
                    f"interrupted by another frame (type {frame.ftype}) (mid-log corruption). "
                    "Acknowledged writes may lie beyond this point. Nothing was modified. To "
                    "discard everything from this offset on, restart with "
                    "--recovery-on-corruption=truncate."
                )
        elif not (frame.ftype == frames.APPEND and frame.flags & frames.FLAG_MORE):
            self._guarded(self._apply, frame, path)
            return
        pending.append(frame)
        if not frame.flags & frames.FLAG_MORE:
            self.pending = []
            self._guarded(self.apply_write, pending, path)

    def _guarded(self, fn: Callable[[_A], None], arg: _A, path: str) -> None:
        try:
            fn(arg)
        except (frames.FrameError, KeyError, TypeError, ValueError) as exc:
            first = arg[0] if isinstance(arg, list) else arg
            assert isinstance(first, frames.Frame)
            raise RecoveryRefused(
                f"{self._rel(path)} offset {first.offset}: undecodable frame "
                f"(type {first.ftype}: {exc}); run a topicd version that knows this format."
            ) from None

    def _apply(self, frame: frames.Frame) -> None:
        engine = self.engine
        ftype = frame.ftype
        if ftype == frames.APPEND:
            self.apply_write([frame])
            return
        if ftype == frames.PROBE:
            return
        body = frame.control()
        if ftype == frames.TOPIC_CREATE:
            name = _str(body, "name")
            if frame.topic_id in engine.by_id:
                raise frames.FrameError(f"topic id {frame.topic_id} created twice")
            engine.apply_create(
                Topic(
                    name,
                    frame.topic_id,
                    config_from_wire(body["config"]),
                    name_json=orjson.dumps(name),
                )
            )
            return
        topic = engine.by_id.get(frame.topic_id)
        if topic is None:
            return  # a frame about a deleted instance (its deletion committed first)
        if ftype == frames.TOPIC_CONFIG:
            engine.apply_config(topic, config_from_wire(body["config"]), frame.ts_ms)
        elif ftype == frames.TOPIC_DELETE:
            with contextlib.suppress(TopicNotEmpty):  # the live apply refused it too
                engine.apply_delete_topic(topic, bool(body.get("if_empty")), frame.ts_ms)
        elif ftype == frames.RECORDS_DELETE and "seqs" in body:
            seqs = body["seqs"]
            if not isinstance(seqs, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) for s in seqs
            ):
                raise frames.FrameError("bad seqs")
            engine.apply_seqs_delete(topic, seqs)
        elif ftype == frames.RECORDS_DELETE:
            match = body.get("match")
            m: tuple[str, str] | None = None
            if match is not None:
                if not isinstance(match, list) or len(match) != 2:
                    raise frames.FrameError("bad match")
                m = (str(match[0]), str(match[1]))
            before = body.get("before_seq")
            if before is not None and not isinstance(before, int):
                raise frames.FrameError("bad before_seq")
            engine.apply_records_delete(topic, before, m, _int(body, "bound"), frame.ts_ms)
        elif ftype == frames.HEAD_WATERMARK:
            topic.reserved_head = max(topic.reserved_head, _int(body, "reserved_head"))
        elif ftype == frames.LOST_RANGE:
            lo, hi = _int(body, "gap_from"), _int(body, "gap_to")
            if hi > topic.head_seq:
                topic.add_lost_range(max(lo, topic.head_seq + 1), hi)
        elif ftype == frames.ROUTER_CREATE:
            engine.routers.replay_create(topic, body)
        elif ftype in (frames.ROUTER_CURSOR, frames.ROUTER_DELETE):
            engine.routers.replay_cursor(body, delete=ftype == frames.ROUTER_DELETE)
        elif ftype == frames.LEASE and topic.queue is not None:
            topic.queue.replay(lease_events(body))
        # EVICT_WATERMARK: nothing to restore in this version

    def apply_write(self, parts: list[frames.Frame]) -> None:
        """One write: its Append frame, or every frame of a multi-frame write."""
        frame = parts[0]
        topic = self.engine.by_id.get(frame.topic_id)
        if topic is None:
            return  # written after its topic's deletion committed: never published
        body = frames.merge_appends([(f, frames.decode_append(f)) for f in parts])
        first = frame.seq
        if first + len(body.encs) - 1 <= topic.head_seq:
            return  # already applied (from a snapshot's segments)
        if first != topic.head_seq + 1:
            if first <= topic.head_seq:
                raise frames.FrameError(
                    f"topic {topic.name!r}: append at seq {first} after head {topic.head_seq}"
                )
            if first - 1 > topic.reserved_head:
                # only router copies (derived, re-materialized in finish()) explain this
                # gap; finish() refuses the recovery if no router fills it
                self.gaps.append((topic.topic_id, topic.head_seq + 1, first - 1))
            # a restart resumed above the seq reservation (the gap never held records),
            # or router copies sit in the gap
            topic.skip_to(first - 1)
        last = first + len(body.encs) - 1
        ranges = self.direct.setdefault(topic.topic_id, [])
        if ranges and ranges[-1][1] + 1 == first:
            ranges[-1] = (ranges[-1][0], last)
        else:
            ranges.append((first, last))
        ex = body.extras
        # retention runs at the write's own time, as it did live; expired idempotency
        # entries and TTL are settled against the real clock in finish()
        self.engine.apply_records(
            topic,
            first,
            frame.ts_ms,
            body.encs,
            body.sizes,
            sum(body.sizes),
            ex.tags,
            ex.nodes,
            ex.prios,
            ex.shapes,
            frame.ts_ms,
            ex.key,
        )
        topic.next_seq = topic.head_seq + 1

    # ---- finish -------------------------------------------------------------------------

    def finish(self, rebooted: bool) -> list[LostRangeNote]:
        engine = self.engine
        lost: list[LostRangeNote] = []
        # routers: resolve their endpoints, re-derive the copies made since the snapshot
        self.fill_router_sources()
        dests = engine.routers.rederive(self.snap_heads, self.direct, self.now)
        for tid, lo, hi in self.gaps:
            if tid not in dests:
                topic = engine.by_id.get(tid)
                raise RecoveryRefused(
                    f"topic {topic.name if topic else tid!r}: append at seq {hi + 1} after "
                    f"head {lo - 1}, and no router fills the gap (replay invariant broken). "
                    "Nothing was modified. To discard the log from the first bad frame on, "
                    "restart with --recovery-on-corruption=truncate."
                )
        engine.routers.stragglers(dests, self.gaps)
        for topic in sorted(engine.by_id.values(), key=lambda t: t.topic_id):
            if topic.reserved_head > topic.head_seq:
                if rebooted and topic.config.durability in ("memory", "disk"):
                    note = LostRangeNote(topic, topic.head_seq + 1, topic.reserved_head)
                    topic.add_lost_range(note.gap_from, note.gap_to)
                    lost.append(note)
                else:
                    topic.skip_to(topic.reserved_head)
            topic.next_seq = topic.head_seq + 1
        engine.finish_replay(self.now)
        shift = engine.payloads.shift
        for topic in engine.by_id.values():  # absorbed records: evictable from now on
            absorbed = self.segments.absorbed(topic.topic_id)
            # the chunks wholly at or below the absorbed mark hold no bytes (their records
            # are only in segments) but where router sources were filled: not walked
            skip = (absorbed + 1) >> shift
            filled = self.filled_from.get(topic.topic_id)
            if filled is not None:
                skip = min(skip, filled >> shift)
            topic.released = max(topic.released, skip)
            engine.payloads.release(topic, absorbed)
        return lost

    def fill_router_sources(self) -> None:
        """Read back from the segments the source records the routers re-derive copies
        from (their bytes were left there by `load_records`)."""
        engine = self.engine
        froms: dict[int, int] = {}
        for rr in [*engine.routers.retired, *engine.routers.replay.values()]:
            lo = min([rr.cursor, *(cursor for cursor, _ in rr.anchors)])
            froms[rr.src_id] = min(froms.get(rr.src_id, lo), lo)
        for tid, lo in froms.items():
            topic = engine.by_id.get(tid)
            hi = self.segments.absorbed(tid)
            if topic is None or hi <= lo:
                continue
            try:
                got = self.segments.read_range(tid, lo + 1, min(hi, topic.head_seq), 1 << 62)
            except segs.SegmentCorruption as exc:
                raise RecoveryRefused(
                    f"{exc.path} offset {exc.offset}: {exc.reason} (segment of topic "
                    f"{topic.name!r}). Nothing was modified. Restore a backup."
                ) from None
            for seq, enc in got.items():
                topic.fill(seq, enc)
            if got:
                self.filled_from[tid] = min(got)


def recover(
    cfg: Config,
    fs: Fs,
    clock: WallClock,
    *,
    boot_id: str | None,
    progress: Callable[[float], None] = lambda _: None,
    check_sealed: bool = False,
    read_workers: int = 1,
) -> RecoveryResult:
    """Rebuild the engine from `cfg.storage.data_dir` (blocking; run it in a thread).

    A start checks each registered segment's presence, length and `.meta`, and the
    active segment's last frame, not the other data bytes (a read verifies those);
    `check_sealed` reads and checks them all too, as `topicd verify` does, so damage
    anywhere refuses. `read_workers` threads load the registered segments ahead of the
    topics being built (read-only; 1 loads each in order in this thread)."""
    root = cfg.storage.data_dir
    r = _Replayer(
        cfg,
        fs,
        clock,
        root,
        progress,
        cfg.storage.recovery.on_corruption == "truncate",
        check_sealed=check_sealed,
        read_workers=read_workers,
    )
    try:
        return _recover(r, cfg, fs, root, boot_id)
    except OSError as exc:
        raise RecoveryRefused(
            f"{root}: I/O error during recovery ({exc}); fix the device and retry."
        ) from None


def _recover(r: _Replayer, cfg: Config, fs: Fs, root: str, boot_id: str | None) -> RecoveryResult:
    fmt = posixpath.join(root, FORMAT_FILE)
    fresh = False
    if not fs.exists(fmt):
        entries = (
            [e for e in fs.listdir(root) if not _leftover_of_first_start(fs, root, e)]
            if fs.exists(root)
            else []
        )
        if entries:
            raise RecoveryRefused(
                f"{root}: not empty but has no FORMAT file; point --data-dir at a topicd "
                "data directory (or an empty one)."
            )
        fresh = True
    else:
        try:
            info = orjson.loads(fs.read(fmt))
        except orjson.JSONDecodeError:
            info = None
        if not isinstance(info, dict) or info.get("storage_format") not in READABLE_FORMATS:
            raise RecoveryRefused(
                f"{fmt}: unsupported storage format {info!r}; run the topicd version that "
                "wrote this directory."
            )
    boot_path = posixpath.join(root, BOOT_FILE)
    previous_boot = (
        fs.read(boot_path).decode("ascii", "replace").strip() if fs.exists(boot_path) else None
    )
    rebooted = previous_boot is None or boot_id is None or previous_boot != boot_id
    if r.cold_root:
        problem = tiering.owner_problem(fs, root, r.cold_root)
        if problem is not None:
            raise RecoveryRefused(f"{problem}. Nothing was modified.")
    snap, snap_number = _load_snapshot(fs, root, r)
    shards = r.shard_dirs()
    if [s for s, _ in shards] != list(range(len(shards))):
        raise RecoveryRefused(f"{root}/wal: shard directories are not 00..{len(shards) - 1}")
    r.bytes_total = max(1, sum(fs.size(path) for _, d in shards for _, path in r.wal_files(d)))
    configured = cfg.storage.wal_shards or min(8, _cpus())
    # the layout the log was written in: the snapshot's, else the directories'
    layout = snap.shard_count if snap is not None else (len(shards) or configured)
    if any(s >= layout for s, _ in shards) and snap is None:
        raise RecoveryRefused(f"{root}/wal: more shard directories than the layout")
    files = [ShardFiles() for _ in range(max(layout, len(shards)))]
    for shard, path in shards:
        start = None
        if snap is not None:
            start = snap.positions[shard] if shard < len(snap.positions) else (0, 0)
        files[shard] = r.replay_shard(shard, path, start, layout)
    lost = r.finish(rebooted and (bool(shards) or snap is not None))
    r.progress(1.0)
    result = RecoveryResult(
        r.engine,
        files[:layout],
        lost,
        r.frames,
        r.replayed,
        r.torn,
        fresh,
        snap_number,
        None if snap is None else [(i, o) for i, o in snap.positions],
    )
    result.segments = r.segments
    result.segment_truncate = r.seg_truncate
    result.segment_metas = r.seg_metas
    registered = r.registered  # (a topic without segments: any file of it is an orphan)
    cold = {tid: {s.first for s in st.segments if s.cold} for tid, st in r.segments.topics.items()}
    hot = {
        tid: [s for s in regs if s.first not in cold.get(tid, ())]
        for tid, regs in registered.items()
    }
    result.segment_orphans = segs.list_orphans(fs, root, hot)
    if r.cold_root:
        in_cold = {
            tid: [s.snap() for s in st.segments if s.cold] for tid, st in r.segments.topics.items()
        }
        result.segment_orphans += segs.list_orphans(
            fs, r.cold_root, {tid: regs for tid, regs in in_cold.items() if regs}
        )
    r.segments.refresh_tiering(r.engine.by_id)
    has_history = snap is not None or any(f.last_index >= 0 for f in files)
    if configured != layout and has_history:
        log.warning(
            "storage.wal_shards changed from %d to %d: re-sharding with a checkpoint",
            layout,
            configured,
        )
        result.reshard_to = configured
    elif configured != layout:
        result.shard_files = [ShardFiles() for _ in range(configured)]
    return result


def _build_runs(
    pieces: list[tuple[int, list[Enc], array[int], array[int]]], head: int
) -> list[Run]:
    """Runs holding the column `pieces` (ascending, not overlapping), up to `head`. The
    first run starts at the first live slot; short gaps between pieces become dead slots,
    long ones (a restart above the seq reservation) start a new run, as `Topic.skip_to`
    does."""
    runs: list[Run] = []
    for base, encs, ts, sizes in pieces:
        if not runs:
            k = next((k for k, enc in enumerate(encs) if enc is not None), None)
            if k is None:
                continue  # (leading dead slots: the runs start at the first live one)
            if k:
                base, encs, ts, sizes = base + k, encs[k:], ts[k:], sizes[k:]
            runs.append(Run(base))
        run = runs[-1]
        gap = base - run.end - 1
        if gap < 0:
            raise snapshot.SnapshotError(f"seq {base} appears twice")
        if gap > _MAX_DEAD_PAD:
            run = Run(base)
            runs.append(run)
        elif gap:
            run.encs.extend([None] * gap)
            run.ts.extend(array("q", [ts[0] if ts else run.ts[-1]]) * gap)
            run.sizes.extend(array("I", [0]) * gap)
        run.encs.extend(encs)
        run.ts.extend(ts)
        run.sizes.extend(sizes)
    if not runs:
        return [Run(head + 1)]
    run = runs[-1]
    gap = head - run.end
    if gap > _MAX_DEAD_PAD:
        runs.append(Run(head + 1))
    elif gap > 0:
        run.encs.extend([None] * gap)
        run.ts.extend(array("q", [run.ts[-1]]) * gap)
        run.sizes.extend(array("I", [0]) * gap)
    elif gap < 0:
        raise snapshot.SnapshotError(f"records above the head {head}")
    return runs


def _leftover_of_first_start(fs: Fs, root: str, name: str) -> bool:
    """What a first start killed before FORMAT existed can leave: the lock, temp files,
    BOOT_ID, and a `wal/` tree holding no WAL file (nothing was ever written)."""
    if name in (LOCK_FILE, BOOT_FILE) or name.endswith(".tmp"):
        return True
    if name != "wal":
        return False
    wal = posixpath.join(root, name)
    for shard in fs.listdir(wal):
        shard_dir = posixpath.join(wal, shard)
        if any(_WAL_NAME.fullmatch(f) for f in fs.listdir(shard_dir)):
            return False
    return True


def _read_head(fs: Fs, path: str) -> bytes:
    fd = fs.open(path)
    try:
        return fs.pread(fd, frames.FILE_HEADER_LEN, 0)
    finally:
        fs.close(fd)


def _load_snapshot(fs: Fs, root: str, r: _Replayer) -> tuple[snapshot.SnapshotBody | None, int]:
    """The newest valid snapshot (older ones are fallbacks), loaded into the replayer."""
    for number, path in snapshot.list_snapshots(fs, root):
        try:
            body, topics = snapshot.decode_lazily(fs.read(path))
        except snapshot.SnapshotError as exc:
            log.error("%s: unusable (%s); trying the previous snapshot", path, exc)
            continue
        try:
            r.load_snapshot(body, topics())
        except (snapshot.SnapshotError, frames.FrameError, KeyError, TypeError) as exc:
            raise RecoveryRefused(
                f"{posixpath.relpath(path, root)}: inconsistent snapshot ({exc}); restore a backup."
            ) from None
        return body, number
    return None, 0


def _cpus() -> int:
    import os

    return os.cpu_count() or 1


def prepare_data_dir(fs: Fs, root: str) -> None:
    """After a successful recovery: make sure FORMAT exists and names the current format
    (an older directory is upgraded: its files are all still read, and checkpoints may now
    write what an older topicd cannot read), then `wal/` (durably: each new directory
    entry is followed by a sync of its parent). FORMAT comes first, so a crash at any
    point leaves a directory recovery still reads as fresh or as formatted."""
    if not fs.exists(root):
        fs.mkdir(root)
        fs.fsync_dir(posixpath.dirname(posixpath.abspath(root)) or "/")
    fmt = posixpath.join(root, FORMAT_FILE)
    if not fs.exists(fmt) or fs.read(fmt) != FORMAT_BODY:
        replace_file(fs, fmt, FORMAT_BODY)
    wal = posixpath.join(root, "wal")
    if not fs.exists(wal):
        fs.mkdir(wal)
        fs.fsync_dir(root)


def record_boot(fs: Fs, root: str, boot_id: str | None) -> None:
    """Record this boot — only once every lost range recovery found is durable, or a crash
    in between would make the next start take a reboot for a mere process crash."""
    replace_file(fs, posixpath.join(root, BOOT_FILE), ((boot_id or "unknown") + "\n").encode())


__all__ = [
    "RecoveryRefused",
    "RecoveryResult",
    "prepare_data_dir",
    "read_boot_id",
    "record_boot",
    "recover",
]
