"""Snapshots: the engine's state in one checksummed file, so the WAL can be trimmed.

A snapshot holds every topic's metadata and segment registry (records up to its
`absorbed` mark live in the topic's segment files, `topicd.storage.segments`), the
records segments do not hold (an inline topic's — one that never outgrew a few KiB —, a
router destination's, and everything in a file written before segments existed: as
stored JSON, with their `$ts` and sizes in compact arrays and the sparse extras), the
unexpired idempotency entries, router and durable lease state, and per WAL shard the
position up to which the log is reflected (replay starts there). Checkpoints capture
incrementally (`capture`): only topics that changed since the last one are captured
again; the others' encoded entries are written as they were.

File: `meta/snapshot-<n:020d>.bin`; a 32-byte header (magic `TOPICDSN`, version u32,
checksum algorithm u8, 3 reserved bytes, msgpack body length u64, XXH3-64 of everything
after the header), the msgpack body, then (version 2) the records' stored JSON: each
run's bytes in body order, its length in the run's `blob_len`. An inline topic's entry
(`inline`: a topic that never outgrew a few KiB) is reused byte for byte while the topic
does not change, and its records (the same bytes objects the topic holds, not copies)
with it (`Capture.records`). A snapshot with a bad header, length or checksum is
skipped in favour of the previous one (`storage.snapshot.keep` are kept). Version 1
files (the records inside the body) are still read.

Why the records trail the body: encoding runs in a thread, but one C call holds the GIL
for its whole length, so a body that held every record (one `b"".join`, one msgpack
encode, one header concatenation, each a copy of all the data) stalled the event loop
~80-90 ms per copy per 100 MB. Now the records are joined in pieces of `CHUNK_RECORDS`,
never copied again, checksummed incrementally, and written piece by piece (each `pwrite`
releases the GIL).

Writing (checkpoint): encode (offloaded) → `snapshot-<n>.bin.tmp` → `fdatasync` → rename →
`fsync` of `meta/` (shielded) → older snapshots beyond `keep` removed → WAL files wholly
before the captured positions deleted. A crash at any step leaves either the old
snapshot (and the untrimmed log) or the new one in charge.
"""

from __future__ import annotations

import os
import posixpath
import re
import struct
import sys
from array import array
from dataclasses import dataclass, field, fields
from itertools import accumulate, chain, islice, pairwise
from operator import attrgetter
from typing import TYPE_CHECKING, Final, TypeVar, cast

import msgspec
import trio
import xxhash

from topicd.engine.queues import leases_durable
from topicd.model import TopicConfig
from topicd.storage.fs import replace_file
from topicd.storage.segments import AbsorbSlice, AbsorbWork, SegSnap

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Iterator

    from topicd.engine.engine import Engine
    from topicd.engine.topic import Topic
    from topicd.storage.fs import Fs
    from topicd.storage.segments import SegmentStore

MAGIC: Final = b"TOPICDSN"
VERSION: Final = 3
# a topic that never had a segment is *inline* (its records in its snapshot entry, no
# segment file) while it has at most this many slots and `inline_max_bytes` of records
INLINE_SLOTS: Final = 64
CHUNK_RECORDS: Final = 16384  # records joined per piece (~1 MB of typical records)
CHUNK_TOPICS: Final = 4096  # topic entries encoded per piece of the body
# a snapshot is synced every this many bytes as it is written (fs.replace_file): a WAL
# sync meanwhile never waits behind hundreds of MB of the snapshot's dirty pages
SYNC_EVERY_BYTES: Final = 8 << 20
HEADER: Final = struct.Struct("<8sIB3xQQ")  # 32 bytes
META_DIR: Final = "meta"
_NAME: Final = re.compile(r"snapshot-([0-9]{20})\.bin")
_LITTLE: Final = sys.byteorder == "little"
_V = TypeVar("_V")
# an inline topic's live records in seq order (`encode_entry`)
Records = tuple[bytes, ...]


class RunSnap(msgspec.Struct, array_like=True, gc=False):
    base: int
    lens: bytes  # u32 per slot; 0xFFFFFFFF marks a dead slot
    ts: bytes  # i64 per slot
    sizes: bytes  # u32 per slot
    blob: bytes  # the live slots' stored JSON, concatenated (empty in the file of version 2)
    blob_len: int = 0  # version 2: the length of this run's bytes after the body


class LeaseSnap(msgspec.Struct, array_like=True, gc=False):
    """A queue's durable lease state: (seq, node, lease_id, deadline_ms) leases,
    (seq, deliveries) counters, (seq, ready_ms) nack delays (wall-clock ms)."""

    leases: list[tuple[int, str, int, int]]
    deliveries: list[tuple[int, int]]
    delays: list[tuple[int, int]]


class TopicSnap(msgspec.Struct, gc=False, omit_defaults=True):
    """One topic's entry. Fields at their defaults are left out of the file, and so are
    the config fields at `TopicConfig`'s defaults (`config_entry`): most topics' entries
    are then a few dozen bytes of watermarks and segment registry."""

    id: int
    name: str
    config: dict[str, object]  # the fields that differ from the defaults
    head: int
    reserved: int
    earliest: int
    evict_floor: int
    evictions: list[tuple[int, int, str]]
    lost: list[tuple[int, int]]
    last_ts: int
    last_write_ts: int | None
    last_read_ts: int | None
    runs: list[RunSnap]
    tags: dict[int, str] = {}
    nodes: dict[int, str] = {}
    prios: dict[int, int] = {}
    shapes: dict[int, tuple[int, int]] = {}
    trims: list[tuple[int, int]] = []  # router `source_trim` ranges
    queue: LeaseSnap | None = None  # lease state of a queue with durable leases
    # version 3: the segment registry; records ≤ `absorbed` live in segments (or are
    # dead), `runs` and the extras maps hold only the records above it (an inline topic:
    # `absorbed` 0, no segments, every record in `runs`)
    segments: list[SegSnap] = []
    absorbed: int = 0


class SnapshotBody(msgspec.Struct, gc=False):
    version: int
    created_ms: int
    next_topic_id: int
    shard_count: int
    positions: list[tuple[int, int]]  # per shard: (file index, offset) replay starts at
    topics: list[TopicSnap]
    idempotency: list[tuple[int, str, int, int, int, int]]
    routers: list[dict[str, object]] = []  # definitions, bases, cursors and floors


class _LazyBody(msgspec.Struct, gc=False):
    """`SnapshotBody` with its topic entries left encoded (`decode_lazily`)."""

    version: int
    created_ms: int
    next_topic_id: int
    shard_count: int
    positions: list[tuple[int, int]]
    topics: list[msgspec.Raw]
    idempotency: list[tuple[int, str, int, int, int, int]]
    routers: list[dict[str, object]] = []


_ENC: Final = msgspec.msgpack.Encoder()
# stands in for the topics array while the rest of a body is encoded (a 16-byte bin of
# random bytes: it cannot occur elsewhere in the body by chance)
_TOPICS_MARK: Final = msgspec.Raw(b"\xc4\x10" + os.urandom(16))
_DEC: Final = msgspec.msgpack.Decoder(SnapshotBody)
_DEC_LAZY: Final = msgspec.msgpack.Decoder(_LazyBody)
_DEC_TOPIC: Final = msgspec.msgpack.Decoder(TopicSnap)
DEAD: Final = 0xFFFFFFFF


class SnapshotError(ValueError):
    """A snapshot file is unusable (bad header, length or checksum, or undecodable)."""


def snapshot_name(n: int) -> str:
    return f"snapshot-{n:020d}.bin"


def list_snapshots(fs: Fs, root: str) -> list[tuple[int, str]]:
    """(number, path) of every snapshot file, newest first."""
    meta = posixpath.join(root, META_DIR)
    if not fs.exists(meta):
        return []
    out = []
    for name in fs.listdir(meta):
        m = _NAME.fullmatch(name)
        if m:
            out.append((int(m.group(1)), posixpath.join(meta, name)))
    return sorted(out, reverse=True)


# ---- capture (synchronous, on the loop) -----------------------------------------------


def _u32(values: array[int] | list[int]) -> bytes:
    arr = values if isinstance(values, array) else array("I", values)
    if not _LITTLE:  # pragma: no cover
        arr = array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


@dataclass(slots=True)
class RunCopy:
    base: int
    encs: list[bytes | None]
    ts: array[int]
    sizes: array[int]


@dataclass(slots=True)
class Capture:
    """What `capture` copies on the loop; `encode` turns it into bytes in a thread.

    The body's topic entries are, in order, those of `entries` (with an incremental
    capture, the previous snapshot's encoded entry, `msgspec.Raw`, of each topic that
    did not change since), of `encoded` (inline topics captured now, encoded as they
    were taken) and a `TopicSnap` for each of `fresh` (the topics captured now), whose
    record copies are `runs` (aligned with `fresh`); `encode` walks them in turn, and
    `body.topics` is left empty (never one list of every topic). The records after the
    body are first those of the encoded entries that have any (inline topics: `records`
    and `inline_records`, in body order), then those of the fresh ones."""

    body: SnapshotBody  # (the fresh topics' `runs` are filled by `encode`)
    runs: list[list[RunCopy]]
    # records to copy into segments, and the topics whose registry the checkpoint fills
    # in once it absorbed them (`TopicSnap.segments`)
    works: list[AbsorbWork] = field(default_factory=list)
    fresh: list[TopicSnap] = field(default_factory=list)
    # the reused entries of the topics not captured now (incremental capture)
    entries: dict[int, msgspec.Raw] = field(default_factory=dict)
    gone_ids: set[int] = field(default_factory=set)  # deleted topics that have segments
    # the engine's `deleted_ids` this capture took (given back if the checkpoint fails)
    deleted_ids: list[int] = field(default_factory=list)
    captured: list[Topic] = field(default_factory=list)  # their `changed` flags were cleared
    # the inline topics captured now (their `changed` flags were cleared too): ids in an
    # array, which the collector never scans (a young list of 100,000 topics costs every
    # young collection that meets it ~4 ms)
    captured_inline: array[int] = field(default_factory=lambda: array("q"))
    # the encoded entries of inline topics captured now (the capture fills them in) and
    # of fresh topics without records in the file (`encode` does): reusable while the
    # topic does not change
    encoded: dict[int, msgspec.Raw] = field(default_factory=dict)
    # the records of the inline topics among `entries`, reusable with their entries (in
    # body order, they are what trails the body first, then `inline_records`): the
    # previous checkpoint's dict as it is (not copied: a fresh dict of 100,000 tuples is a
    # young container every young collection walks whole), so it also holds the records
    # of topics captured again or deleted since (`stale`); the checkpoint brings it up to
    # date once the snapshot is durable (`Checkpointer._install`). Empty for a capture
    # that reuses nothing.
    records: dict[int, Records] = field(default_factory=dict)
    # the records of the inline topics captured now (those of `encoded`)
    inline_records: dict[int, Records] = field(default_factory=dict)
    # the ids whose entries in `records` are out of date (captured again, not inline
    # now, or deleted); with the ids of `inline_records` they are every id of `records`
    # not in `entries`
    stale: array[int] = field(default_factory=lambda: array("q"))

    def topic_count(self) -> int:
        """The topic entries the body holds (before `encode`, which adds the fresh entries
        it encoded whole to `encoded`)."""
        return len(self.entries) + len(self.encoded) + len(self.fresh)


_DEFAULT_CONFIG: Final = TopicConfig()
_CONFIG_FIELDS: Final = tuple(f.name for f in fields(TopicConfig))
_CONFIG_ENTRIES: dict[TopicConfig, dict[str, object]] = {}


def config_entry(config: TopicConfig) -> dict[str, object]:
    """A topic config as its snapshot entry stores it: the fields that differ from the
    defaults (recovery fills in the rest, as it does for a config logged before a field
    existed). One dict per distinct config, shared: do not mutate it."""
    entry = _CONFIG_ENTRIES.get(config)
    if entry is None:
        if len(_CONFIG_ENTRIES) >= 4096:
            _CONFIG_ENTRIES.clear()
        entry = _CONFIG_ENTRIES[config] = {
            name: getattr(config, name)
            for name in _CONFIG_FIELDS
            if getattr(config, name) != getattr(_DEFAULT_CONFIG, name)
        }
    return entry


def capture_topic(
    topic: Topic, *, reserved: int, now_ms: int = 0, absorbed: int = 0
) -> tuple[TopicSnap, list[RunCopy]]:
    """The topic's state right now, as C-level copies (records are immutable and slots
    only ever turn dead, so the copy is consistent). Per-record work happens in `encode`.
    A queue with durable leases also carries its lease state (nack delays as wall-clock
    times from `now_ms`). Records up to `absorbed` live in segments: they are left out."""
    copies = []
    ephemeral = topic.config.durability == "ephemeral"  # records RAM-only, by design
    last = topic.runs[-1]
    floor = max(topic.earliest_seq, absorbed + 1)
    for run in topic.runs if not ephemeral else ():
        if run.end < floor and run is not last:
            continue  # nothing live left in it (or all in segments)
        start = max(run.base, floor)
        lo = start - run.base
        # above the absorbed mark every live slot holds its bytes (never `EVICTED`)
        encs = cast("list[bytes | None]", run.encs[lo:])
        copies.append(RunCopy(start, encs, run.ts[lo:], run.sizes[lo:]))
    snap = TopicSnap(
        id=topic.topic_id,
        name=topic.name,
        config=config_entry(topic.config),
        head=topic.head_seq,
        reserved=reserved,
        earliest=topic.head_seq + 1 if ephemeral else topic.earliest_seq,
        evict_floor=topic.evict_floor,
        evictions=topic.export_evictions(),
        lost=list(topic.lost_ranges),
        last_ts=topic.last_ts,
        last_write_ts=topic.last_write_ts,
        last_read_ts=topic.last_read_ts,
        runs=[],
        tags={} if ephemeral else _above(topic.tags, absorbed, topic.head_seq),
        nodes={} if ephemeral else _above(topic.nodes, absorbed, topic.head_seq),
        prios={} if ephemeral else _above(topic.prios, absorbed, topic.head_seq),
        shapes={} if ephemeral else _above(topic.shapes, absorbed, topic.head_seq),
        trims=[] if ephemeral else list(topic.trims),
        absorbed=absorbed,
    )
    if topic.queue is not None and leases_durable(topic):
        q = topic.queue.export(trio.current_time(), now_ms)
        snap.queue = LeaseSnap(q.leases, q.deliveries, q.delays)
    return snap, copies


def _above(sparse: dict[int, _V], absorbed: int, head: int) -> dict[int, _V]:
    """The entries of a sparse per-seq map above `absorbed` (all of it for 0)."""
    if not absorbed:
        return dict(sparse)
    if absorbed >= head:
        return {}
    if len(sparse) <= head - absorbed:
        return {seq: v for seq, v in sparse.items() if seq > absorbed}
    return {seq: sparse[seq] for seq in range(absorbed + 1, head + 1) if seq in sparse}


def absorbable(engine: Engine, topic: Topic) -> bool:
    """Whether a checkpoint copies `topic`'s records into segments: every persistent
    topic, except while a router feeds it (its copies are derived, re-made at recovery
    from the source and the router's state, so they stay out of segments)."""
    return topic.config.durability != "ephemeral" and topic not in engine.routers.by_dest


def inline(topic: Topic, absorbed: int, max_bytes: int) -> bool:
    """Whether a checkpoint keeps an absorbable `topic`'s records in its snapshot entry
    instead of segment files: it never had a segment (no absorbed mark, in the store or
    in the topic: a capture for absorbing raised `Topic.seg_tail` for good) and its
    retained slots are few (`INLINE_SLOTS`) and small (`max_bytes` of stored JSON, 0 =
    never inline). A topic that outgrows this moves into segments at its next
    checkpoint, once: it never becomes inline again."""
    if not max_bytes or absorbed or topic.seg_tail:
        return False
    lo, head = topic.earliest_seq, topic.head_seq
    slots = total = 0
    for run in topic.runs:  # (seqs between runs, skipped after a restart, hold no slot)
        a, b = max(lo, run.base), min(head, run.end)
        if a <= b:
            slots += b - a + 1
            if slots > INLINE_SLOTS:
                return False
            # (never evicted: nothing of the topic is absorbed, so every live slot holds bytes)
            encs = cast("list[bytes | None]", run.encs[a - run.base : b - run.base + 1])
            total += sum([len(enc) for enc in encs if enc is not None])
    return total <= max_bytes


def encode_entry(snap: TopicSnap, copies: list[RunCopy]) -> tuple[msgspec.Raw, Records]:
    """An inline topic's entry (its runs' columns, their bytes to trail the body) and its
    records in order: references to the bytes objects the topic holds, not copies. Both
    stay valid while the topic does not change (records are immutable)."""
    records: list[bytes] = []
    for run in copies:
        encs = run.encs
        lens = array("I", [DEAD if e is None else len(e) for e in encs])
        live = [e for e in encs if e is not None]
        records += live
        total = sum([len(e) for e in live])
        snap.runs.append(
            RunSnap(run.base, _u32(lens), run.ts.tobytes(), _u32(run.sizes), b"", total)
        )
    # (a tuple of bytes: untracked by the collector once it has seen it)
    return msgspec.Raw(_ENC.encode(snap)), tuple(records)


def capture_absorb(topic: Topic, absorbed: int) -> AbsorbWork:
    """The slots of `topic` above `absorbed` (C-level slices; the records are built in
    the checkpoint's thread), copies of the sparse extras there, and the absorbed seqs
    killed since the last checkpoint."""
    lo = max(absorbed + 1, topic.earliest_seq)
    head = topic.head_seq
    slices: list[AbsorbSlice] = []
    for run in topic.runs:
        a, b = max(lo, run.base), min(head, run.end)
        if a > b:
            continue
        i, j = a - run.base, b - run.base + 1
        # above the absorbed mark nothing is ever evicted (topicd.engine.payloads)
        encs = cast("list[bytes | None]", run.encs[i:j])
        slices.append(AbsorbSlice(a, encs, run.ts[i:j], run.sizes[i:j]))
    work = AbsorbWork(topic.topic_id, slices, [], topic.earliest_seq, head)
    if slices:
        work.tags = _above(topic.tags, lo - 1, head)
        work.nodes = _above(topic.nodes, lo - 1, head)
        work.prios = _above(topic.prios, lo - 1, head)
        work.shapes = {s: (v[0], v[1]) for s, v in _above(topic.shapes, lo - 1, head).items()}
    work.flips = [seq for seq in topic.seg_killed or () if seq >= topic.earliest_seq]
    topic.seg_killed = None
    topic.seg_tail = max(topic.seg_tail, head)
    return work


def capture(
    engine: Engine,
    positions: list[tuple[int, int]],
    created_ms: int,
    *,
    final: bool = False,
    segments: SegmentStore | None = None,
    absorb: bool = False,
    reuse: dict[int, msgspec.Raw] | None = None,
    records: dict[int, Records] | None = None,
    inline_max: int = 0,
) -> Capture:
    """The engine's state and the WAL positions it reflects (one synchronous step).

    `final` (clean shutdown, everything committed and synced): reservations are released
    to the heads, so the next start resumes exactly at head + 1 with no gap. With
    `segments`, records they hold are left out; with `absorb` too, every absorbable
    topic's records up to its head are captured for copying into segments instead
    (`Capture.works`), and the checkpoint fills in the new registry — except those of
    inline topics (`inline`, with `inline_max` bytes: `storage.segments.inline_max_bytes`),
    whose entries carry their records and are encoded as they are taken.

    With `reuse` (the previous snapshot's encoded entries: `Capture.entries` with
    `Capture.encoded` added) the capture is incremental: only the topics marked changed
    since (`Topic.mark_changed`), queues (their lease state), topics due to seal a
    segment by age, topics with a segment to relocate to the cold tier and topics without
    an entry are captured; every other topic keeps its
    entry byte for byte. The work on the loop then follows what changed, plus C-level
    set operations over the topic ids. `final` captures everything.

    `capture_stepwise` is the same cut taken in steps that yield to the loop.
    """
    step = _Stepwise(engine, created_ms, final, segments, absorb, reuse, records, inline_max)
    for _ in step.copy_reuse():
        pass
    step.take_all(step.first_todo())
    step.take_all(step.last_todo())
    return step.finish(positions)


async def capture_stepwise(
    engine: Engine,
    positions: Callable[[], list[tuple[int, int]]],
    created_ms: int,
    tick: Callable[[], Awaitable[None]],
    *,
    final: bool = False,
    segments: SegmentStore | None = None,
    absorb: bool = False,
    reuse: dict[int, msgspec.Raw] | None = None,
    records: dict[int, Records] | None = None,
    inline_max: int = 0,
) -> tuple[Capture, list[tuple[int, int]]]:
    """`capture`, with the per-topic work spread over loop turns (`await tick()` after
    each topic: it yields when its time quantum is used), so a checkpoint of 100,000
    changed topics never stalls the loop for the whole of it.

    The result is still one consistent cut, taken at the end: a topic captured in an
    earlier step and mutated since is marked changed again (`Topic.mark_changed`) and
    captured again, in further steps while many are, and at last in one synchronous
    step together with the queues (whose lease state is not tracked), the engine-wide
    state and the WAL `positions()` — so every entry reflects the state at that instant,
    as if everything had been captured then. Returns the capture and the positions."""
    step = _Stepwise(engine, created_ms, final, segments, absorb, reuse, records, inline_max)
    for _ in step.copy_reuse():
        await trio.lowlevel.checkpoint()
    # (what is to take, as arrays of topic ids: a young list or set of 100,000 topics or
    # ids is walked whole by every young collection that meets it, ~4 ms each time)
    todo = step.first_todo(scan=False, sliced=True)
    if step.reuse is not None:
        for _ in step.list_due():
            await tick()
        todo = step.todo
        # topics without an entry, a slice of the ids at a time
        ids = array("q", engine.by_id)
        for i in range(0, len(ids), _SCAN_IDS):
            todo += step.without_entry(ids[i : i + _SCAN_IDS])
            await tick()
        del ids
    for _ in range(_STEP_PASSES):
        for tid in todo:
            step.take(tid)
            await tick()
        todo = step.again()
        if len(todo) <= _SYNC_TOPICS:
            break
    step.take_all(todo)
    step.take_all(step.last_todo())
    at = positions()
    cap = step.cut(at)
    for _ in step.merge(cap):  # (capture-private copies, after the cut: loop turns apart)
        await trio.lowlevel.checkpoint()
    return cap, at


# chunked passes of `capture_stepwise` before the last, synchronous one (which takes
# whatever changed meanwhile); further passes only while more than this many did
_STEP_PASSES: Final = 3
_SYNC_TOPICS: Final = 256
_SCAN_IDS: Final = 4096
_TOPIC_ID: Final = attrgetter("topic_id")


class _Stepwise:
    """The state of one capture between its steps (see `capture_stepwise`)."""

    def __init__(
        self,
        engine: Engine,
        created_ms: int,
        final: bool,
        segments: SegmentStore | None,
        absorb: bool,
        reuse: dict[int, msgspec.Raw] | None,
        records: dict[int, Records] | None = None,
        inline_max: int = 0,
    ) -> None:
        self.engine = engine
        self.created_ms = created_ms
        self.final = final
        self.segments = segments
        self.absorb = absorb
        self.reuse = None if final else reuse
        # with `reuse`: its inline topics' records (read only: see `Capture.records`)
        self.records = (records or {}) if self.reuse is not None else {}
        # the entries to reuse: a copy (`copy_reuse`; untracked by the collector, like
        # every dict of ints and `Raw`s) that each step drops the topics it takes from,
        # so the last, synchronous one has only deletions to drop
        self.entries: dict[int, msgspec.Raw] = {}
        self.inline_max = inline_max
        # per captured topic id: the topic, its entry, its record copies, its absorb work
        self.got: dict[int, tuple[Topic, TopicSnap, list[RunCopy], AbsorbWork | None]] = {}
        # inline topics, taken apart: their entries are encoded at once, so what lives
        # until the checkpoint ends is an untracked `Raw` and a tuple of bytes a topic
        # (with 100,000 topics the tuples, lists and arrays of `got` fed the collector
        # enough to trigger full collections, ~0.4 s each, during the capture)
        # (by id: the keys of `inline_raw`, a dict the collector does not track)
        self.inline_raw: dict[int, msgspec.Raw] = {}
        self.inline_records: dict[int, Records] = {}
        # the ids of what the first step takes (a dict of ints: untracked, like an array)
        self.first: dict[int, None] = {}
        self.todo = array("q")
        self.due: set[Topic] = set()  # (`list_due`)

    def copy_reuse(self) -> Iterator[None]:
        """Copy the entries to reuse, before anything is taken (one C-level copy of up to
        every topic: yields after it). They are the checkpointer's, not the engine's: the
        loop may run between the steps."""
        if self.reuse is not None:
            self.entries = dict(self.reuse)
            yield

    def first_todo(self, *, scan: bool = True, sliced: bool = False) -> array[int]:
        """The ids of what the first step takes: every topic, or (incremental) the topics
        marked changed, due to seal by age, with a segment to relocate to the cold tier
        and — with `scan` — without an entry (else the caller adds those with
        `without_entry`). Queues are left to the last step. With `sliced`, the changed
        topics are listed by `list_due` (the caller runs it, and uses `todo`)."""
        engine = self.engine
        by_id = engine.by_id
        reuse = self.reuse
        queues = engine.queue_topics
        if reuse is None:
            engine.changed_topics.clear()
            engine.deleted_ids = []  # (`finish` compares every id)
            if not queues:  # (one C-level copy; `take` skips deleted topics)
                return array("q", by_id)
            return array("q", (t.topic_id for t in by_id.values() if t not in queues))
        due = set(engine.changed_topics)  # (C level: touches no topic)
        engine.changed_topics.clear()
        extra: set[int] = set()
        if scan:
            extra = by_id.keys() - reuse.keys()  # new topics, entries re-made every time
        if self.segments is not None:
            extra |= self.segments.aged(self.created_ms) & by_id.keys()
            # sealed segments to relocate (cold tier)
            extra |= self.segments.tier_due & by_id.keys()
        due.update(by_id[tid] for tid in extra)
        due -= queues
        self.due = due
        if not sliced:
            for _ in self.list_due():
                pass
        return self.todo

    def list_due(self) -> Iterator[None]:
        """Turn the changed topics `first_todo` copied into ids (`todo`, `first`), a
        slice per step (a memory access per topic: ~0.5 µs each at 100,000), then drop
        the copy (a young set of every topic, walked by each young collection)."""
        left = len(self.due)
        due: Iterator[Topic] | None = iter(self.due) if left else None
        self.due = self.due if left else set()
        while due is not None:
            ids = array("q", map(_TOPIC_ID, islice(due, _SCAN_IDS)))
            self.todo += ids
            self.first.update(dict.fromkeys(ids))
            left -= len(ids)
            if left <= 0:  # dropped before the last step's yield, not after it
                due = None
                self.due = set()
            yield

    def without_entry(self, ids: Iterable[int]) -> array[int]:
        """Of `ids`, the live topics that have no entry to reuse (entries with records in
        the file are re-made every time) and are not listed yet."""
        assert self.reuse is not None
        reuse, by_id, listed = self.reuse, self.engine.by_id, self.first
        queues = self.engine.queue_topics
        out = array("q")
        for tid in ids:
            if tid not in reuse and tid not in listed:
                t = by_id.get(tid)
                if t is not None and t not in queues:
                    out.append(tid)
        return out

    def again(self) -> array[int]:
        """The ids of the topics marked changed since the last step took them (or the
        first listed): captured again."""
        changed = self.engine.changed_topics
        out = array("q", map(_TOPIC_ID, changed))
        changed.clear()
        return out

    def last_todo(self) -> array[int]:
        out = self.again()
        out.extend(map(_TOPIC_ID, self.engine.queue_topics))
        return out

    def take_all(self, ids: Iterable[int]) -> None:
        for tid in ids:
            self.take(tid)

    def take(self, tid: int) -> None:
        """Capture topic `tid` now (again if an earlier step took it: the newer copy
        wins); nothing if it was deleted (topic ids are never reused)."""
        engine = self.engine
        t = engine.by_id.get(tid)
        if t is None or t.deleted:
            return
        # (the topic's own int from here on: the ids the capture keeps as dict keys would
        # otherwise be new int objects, boxed from an array: ~3 MB a dict at 100,000)
        tid = t.topic_id
        segments = self.segments
        t.changed = False
        self.entries.pop(tid, None)
        if self.inline_raw.pop(tid, None) is not None:
            del self.inline_records[tid]  # taken inline before: the newer copy wins
        absorbed = segments.absorbed(tid) if segments is not None else 0
        work: AbsorbWork | None = None
        if segments is not None and self.absorb and absorbable(engine, t):
            if inline(t, absorbed, self.inline_max):
                old = self.got.pop(tid, None)
                assert old is None or old[3] is None, "a topic taken for absorbing stays so"
                snap, copies = capture_topic(
                    t,
                    reserved=t.head_seq if self.final else max(t.reserved_head, t.head_seq),
                    now_ms=self.created_ms,
                )
                self.inline_raw[tid], self.inline_records[tid] = encode_entry(snap, copies)
                return
            work = capture_absorb(t, absorbed)
            absorbed = max(absorbed, t.head_seq)
            old = self.got.get(tid)
            if old is not None and old[3] is not None:
                # the earlier copy's delete flips left `seg_killed`: carry them over
                work.flips[:0] = [seq for seq in old[3].flips if seq >= t.earliest_seq]
        snap, copies = capture_topic(
            t,
            reserved=t.head_seq if self.final else max(t.reserved_head, t.head_seq),
            now_ms=self.created_ms,
            absorbed=absorbed,
        )
        if segments is not None:
            snap.segments = segments.registry(tid)
        self.got[tid] = (t, snap, copies, work)

    def finish(self, positions: list[tuple[int, int]]) -> Capture:
        """The capture as of now (synchronous: the last step)."""
        cap = self.cut(positions)
        for _ in self.merge(cap):
            pass
        return cap

    def cut(self, positions: list[tuple[int, int]]) -> Capture:
        """The capture as of now, but for `merge` (synchronous: the last step; it reads
        the engine, which `merge` does not)."""
        engine = self.engine
        by_id = engine.by_id
        cap = Capture(SnapshotBody(VERSION, self.created_ms, 0, 0, [], [], []), [])
        for tid, (t, snap, copies, work) in self.got.items():
            if t.deleted or by_id.get(tid) is not t:
                continue  # deleted after it was taken (its delete flips are moot)
            cap.captured.append(t)
            cap.fresh.append(snap)
            cap.runs.append(copies)
            if work is not None:
                cap.works.append(work)
        deleted, engine.deleted_ids = engine.deleted_ids, []
        cap.deleted_ids = deleted
        # inline topics taken and deleted since (every deletion is listed): the rest is
        # taken over whole, with C-level copies (this step is synchronous, and may have
        # every topic to take over: ~50 ms a 100,000 topics one at a time)
        inline_raw = self.inline_raw
        for tid in deleted:
            if inline_raw.pop(tid, None) is not None:
                del self.inline_records[tid]
        if VERIFY_INCREMENTAL:  # (no list of them: it would be young when collections run)
            for i in inline_raw:
                alive = by_id.get(i)
                assert alive is not None
                assert not alive.deleted
        if self.reuse is not None:
            entries, records = self.entries, self.records  # (taken ones dropped)
            for tid in deleted:  # deleted since the entries were made
                entries.pop(tid, None)
            stale = array("q", self.got)
            stale += array("q", deleted)
            if VERIFY_INCREMENTAL:
                assert not entries.keys() & (self.got.keys() | inline_raw.keys())
                assert not entries.keys() - by_id.keys(), "a deletion was not listed"
                assert not records.keys() - entries.keys() - set(stale) - inline_raw.keys()
                for tid, entry in entries.items():
                    _verify_unchanged(
                        engine, by_id[tid], entry, records.get(tid), self.created_ms, self.segments
                    )
            cap.entries = entries
            cap.records = records
            cap.stale = stale
        cap.encoded = self.inline_raw  # (no copy: this step's state ends here)
        cap.inline_records = self.inline_records
        if self.segments is not None:
            if self.reuse is None:
                # (not `keys() - keys()`: that walks every topic id, in this step)
                cap.gone_ids = {tid for tid in self.segments.topics if tid not in by_id}
            else:
                held = self.segments.topics
                cap.gone_ids = {tid for tid in deleted if tid in held and tid not in by_id}
        # a retry window is as durable as the records it points to: none for ephemeral
        # topics
        idem = [
            entry
            for entry in engine.idem.committed()
            if (owner := by_id.get(entry[0])) is not None and owner.config.durability != "ephemeral"
        ]
        cap.body = SnapshotBody(
            VERSION,
            self.created_ms,
            engine.next_topic_id,
            len(positions),
            positions,
            [],  # (`merge`)
            idem,
            engine.routers.export(),
        )
        return cap

    def merge(self, cap: Capture) -> Iterator[None]:
        """Complete a `cut`: the ids of the inline topics taken, a C-level copy of up to
        every topic in a step of its own (at 100,000 topics the capture's copies were
        ~10 ms of the synchronous last step). Reads only the capture's own state, so the
        loop may run between the steps. (The body's topic entries are not gathered into
        one list: `encode` walks `entries`, `encoded` and `fresh` in turn.)"""
        yield
        cap.captured_inline = array("q", self.inline_raw)


# Tests set this: every reused entry is checked against a fresh capture of its topic (a
# mutation that forgot to set `Topic.changed` would otherwise leave a stale entry).
VERIFY_INCREMENTAL = False


def _verify_unchanged(
    engine: Engine,
    t: Topic,
    entry: msgspec.Raw,
    records: Records | None,
    now_ms: int,
    segments: SegmentStore | None,
) -> None:
    absorbed = segments.absorbed(t.topic_id) if segments is not None else 0
    snap, copies = capture_topic(
        t, reserved=max(t.reserved_head, t.head_seq), now_ms=now_ms, absorbed=absorbed
    )
    if segments is not None:
        snap.segments = segments.registry(t.topic_id)
    # (reused entries have records only if they are inline topics': kept with them)
    fresh, live = encode_entry(snap, copies)
    assert bytes(entry) == bytes(fresh), f"topic {t.name!r} changed without Topic.changed set"
    assert (records or ()) == live, f"topic {t.name!r}: its records changed unmarked"


# ---- encoding and files (blocking: run offloaded) ------------------------------------


def _fill_runs(snap: TopicSnap, copies: list[RunCopy], pieces: list[bytes]) -> int:
    """Add the copies' columns to `snap.runs` and their records to `pieces`; returns the
    record bytes added."""
    added = 0
    for run in copies:
        encs = run.encs
        lens = array("I", [DEAD if e is None else len(e) for e in encs])
        total = 0
        for i in range(0, len(encs), CHUNK_RECORDS):
            piece = b"".join([e for e in encs[i : i + CHUNK_RECORDS] if e is not None])
            if piece:
                pieces.append(piece)
                total += len(piece)
        snap.runs.append(
            RunSnap(run.base, _u32(lens), run.ts.tobytes(), _u32(run.sizes), b"", total)
        )
        added += total
    return added


def encode(cap: Capture) -> list[bytes]:
    """The snapshot file's bytes, in pieces to write in order (blocking, CPU-bound: run
    it offloaded; no piece is larger than the body or `CHUNK_RECORDS` records)."""
    body = cap.body
    # first the records of the entries written as they are (inline topics), in body
    # order, `CHUNK_RECORDS` at a time (no list of every record or topic: a young list
    # of 100,000 is walked whole by each young collection that meets it, and a
    # collection this thread triggers holds the GIL, so the loop, throughout)
    pieces: list[bytes] = []
    chunk: list[bytes] = []
    for ids, records in ((cap.entries, cap.records), (cap.encoded, cap.inline_records)):
        for tid in ids:
            recs = records.get(tid)
            if recs:
                chunk += recs
                if len(chunk) >= CHUNK_RECORDS:
                    pieces.append(b"".join(chunk[:CHUNK_RECORDS]))
                    del chunk[:CHUNK_RECORDS]
    if chunk:
        pieces.append(b"".join(chunk))
    del chunk
    n = cap.topic_count()
    assert not body.topics or len(body.topics) == n, "body.topics is not read: see Capture"
    whole: dict[int, msgspec.Raw] = {}
    for snap, copies in zip(cap.fresh, cap.runs, strict=True):
        if not _fill_runs(snap, copies, pieces):
            # no record bytes after the body: the entry is whole, reusable as it is
            whole[snap.id] = msgspec.Raw(_ENC.encode(snap))
    # the body's topic entries in order, never gathered into one list (a young list of
    # 100,000 is walked whole by every young collection that meets it)
    entries: Iterable[TopicSnap | msgspec.Raw] = chain(
        cap.entries.values(), cap.encoded.values(), (whole.get(s.id, s) for s in cap.fresh)
    )
    body_pieces = _encode_body(body, entries, n)
    cap.encoded.update(whole)
    digest = xxhash.xxh3_64()
    for piece in body_pieces:
        digest.update(piece)
    for piece in pieces:
        digest.update(piece)
    length = sum(len(piece) for piece in body_pieces)
    header = HEADER.pack(MAGIC, VERSION, 1, length, digest.intdigest())
    return [header, *body_pieces, *pieces]


def _encode_body(
    body: SnapshotBody,
    entries: Iterable[TopicSnap | msgspec.Raw] | None = None,
    n: int = 0,
) -> list[bytes]:
    """The msgpack body in pieces: its topics array (`body.topics`, or the `n` topic
    entries of `entries`) is encoded `CHUNK_TOPICS` entries at a time around the rest,
    which is encoded with a marker in its place. (One encode of 100,000 entries is one C
    call holding the GIL, so the event loop, ~30 ms.) The bytes are those of one
    encode."""
    topics = body.topics
    if entries is None:
        entries, n = topics, len(topics)
    marker = _TOPICS_MARK
    body.topics = marker  # type: ignore[assignment]
    try:
        shell = _ENC.encode(body)
        at = shell.find(marker)
        if at < 0 or shell.find(marker, at + 1) >= 0:  # pragma: no cover - 128 random bits
            body.topics = list(entries)  # type: ignore[arg-type]
            return [_ENC.encode(body)]
    finally:
        body.topics = topics
    if n < 16:
        head = bytes([0x90 | n])
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    it = iter(entries)  # (reused entries: `Raw`)
    out = [shell[:at], head]
    out.extend(
        b"".join(
            [e if isinstance(e, msgspec.Raw) else _ENC.encode(e) for e in islice(it, CHUNK_TOPICS)]
        )
        for _ in range(0, n, CHUNK_TOPICS)
    )
    assert next(it, None) is None, "more topic entries than counted"
    out.append(shell[at + len(marker) :])
    return out


def decode(data: bytes) -> SnapshotBody:
    length = _check(data)
    version = HEADER.unpack_from(data, 0)[1]
    rest = memoryview(data)[HEADER.size :]
    try:
        body = _DEC.decode(rest[:length])
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"undecodable body: {exc}") from None
    if version == 1:
        return body
    off = length
    for topic in body.topics:
        for run in topic.runs:
            if run.blob or run.blob_len < 0 or off + run.blob_len > len(rest):
                raise SnapshotError(f"topic {topic.name!r}: record bytes out of bounds")
            run.blob = bytes(rest[off : off + run.blob_len])
            off += run.blob_len
    if off != len(rest):
        raise SnapshotError(f"{len(rest) - off} bytes after the last run")
    return body


def decode_lazily(data: bytes) -> tuple[SnapshotBody, Callable[[], Iterator[TopicSnap]]]:
    """`decode`, with the topics handed out one at a time: the body (its `topics` empty)
    and a function that yields each topic's entry, its records' bytes attached, decoding
    it only then. Recovery builds each topic from its entry before the next is decoded,
    so the entries' objects (a dozen per topic) are freed as it goes instead of all
    living until the end, interleaved in memory with the topics built meanwhile (which
    kept the allocator's arenas from being reused: at 10,000 topics the process
    held ~1.5 KiB a topic more after a restart than its live objects needed).

    The whole file is still checked first (checksum, every entry decodable, the record
    bytes exactly used), so a damaged snapshot is refused here — the caller falls back
    to the previous one — never halfway through the topics."""
    if len(data) < HEADER.size:
        raise SnapshotError("shorter than its header")
    version = HEADER.unpack_from(data, 0)[1]
    if version == 1:  # (records inside the body: small files, decoded at once)
        body = decode(data)
        old, body.topics = body.topics, []
        return body, lambda: iter(old)
    length = _check(data)
    rest = memoryview(data)[HEADER.size :]
    try:
        lazy = _DEC_LAZY.decode(rest[:length])
        off = length
        for raw in lazy.topics:  # (each decoded and dropped: nothing kept)
            for run in _DEC_TOPIC.decode(raw).runs:
                if run.blob or run.blob_len < 0 or off + run.blob_len > len(rest):
                    raise SnapshotError("record bytes out of bounds")
                off += run.blob_len
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"undecodable body: {exc}") from None
    if off != len(rest):
        raise SnapshotError(f"{len(rest) - off} bytes after the last run")
    raws = lazy.topics
    body = SnapshotBody(
        lazy.version,
        lazy.created_ms,
        lazy.next_topic_id,
        lazy.shard_count,
        lazy.positions,
        [],
        lazy.idempotency,
        lazy.routers,
    )

    def topics() -> Iterator[TopicSnap]:
        off = length
        for raw in raws:
            topic = _DEC_TOPIC.decode(raw)
            for run in topic.runs:
                run.blob = bytes(rest[off : off + run.blob_len])
                off += run.blob_len
            yield topic

    return body, topics


def _check(data: bytes) -> int:
    """Check a snapshot's header, length and checksum; returns the body's length."""
    if len(data) < HEADER.size:
        raise SnapshotError("shorter than its header")
    magic, version, alg, length, digest = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version not in (1, 2, VERSION) or alg != 1:
        raise SnapshotError("bad magic or unsupported version")
    rest = memoryview(data)[HEADER.size :]
    if len(rest) < length or (version == 1 and len(rest) != length):
        raise SnapshotError(f"length {len(rest)} != {length}")
    if xxhash.xxh3_64_intdigest(rest) != digest:
        raise SnapshotError("checksum mismatch")
    return int(length)


def write_snapshot(fs: Fs, root: str, number: int, data: list[bytes], keep: int) -> str:
    """Write durably and make it current; remove snapshots beyond `keep`. Returns the path."""
    meta = posixpath.join(root, META_DIR)
    if not fs.exists(meta):
        fs.mkdir(meta)
        fs.fsync_dir(root)
    path = posixpath.join(meta, snapshot_name(number))
    replace_file(fs, path, data, sync_every=SYNC_EVERY_BYTES)
    for _, old in list_snapshots(fs, root)[keep:]:
        fs.unlink(old)
    for name in fs.listdir(meta):
        if name.endswith(".tmp"):
            fs.unlink(posixpath.join(meta, name))
    fs.fsync_dir(meta)
    return path


def restore_runs(snap: TopicSnap) -> list[tuple[int, list[bytes | None], array[int], array[int]]]:
    """(base, encs, ts, sizes) of each run of a topic snapshot."""
    out = []
    for run in snap.runs:
        if len(run.lens) % 4 or len(run.ts) % 8 or len(run.sizes) % 4:
            raise SnapshotError(f"topic {snap.name!r}: column bytes are not whole items")
        lens = array("I")
        lens.frombytes(run.lens)
        ts = array("q")
        ts.frombytes(run.ts)
        sizes = array("I")
        sizes.frombytes(run.sizes)
        if not _LITTLE:  # pragma: no cover
            lens.byteswap()
            ts.byteswap()
            sizes.byteswap()
        live = [n for n in lens if n != DEAD]
        offs = [0, *accumulate(live)]
        if offs[-1] != len(run.blob):
            raise SnapshotError(f"topic {snap.name!r}: record lengths do not add up")
        pieces = iter([run.blob[a:b] for a, b in pairwise(offs)])
        encs: list[bytes | None] = [None if n == DEAD else next(pieces) for n in lens]
        if not (len(encs) == len(ts) == len(sizes)):
            raise SnapshotError(f"topic {snap.name!r}: column lengths differ")
        out.append((run.base, encs, ts, sizes))
    return out
