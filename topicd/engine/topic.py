"""One topic instance: its log, watermarks, tag index, retention and the diff walk.

Everything here is synchronous and owned by the event-loop thread. The log is stored in
columns, no Python object per record:

* a `Run` covers consecutive seqs `base ..`: `encs` (each record's stored JSON, see
  `model`; `None` once it was deleted, evicted or expired; or the shared `EVICTED`
  marker while the bytes of a live record are only in its segment file, see
  `topicd.engine.payloads`) and compact `array` columns of `$ts` and payload size, all
  indexed by `seq - base` (O(1) lookup);
* a topic is normally one run. A restart that resumes above the seq reservation leaves a
  gap of seqs that never held records; the gap is not stored: a new run starts above it,
  and reads jump it in O(1);
* sparse maps by seq hold the extras only some records have: `tags`, `nodes`, `prios`
  and `shapes` (see `model.project`).

Slots below `earliest_seq` are all dead and are trimmed from the front run in bulk
(amortized O(1) per record); runs left with nothing live are dropped.

Watermarks (api-topics §1, §8.2):

* `head_seq`: highest published seq (0 if none); `next_seq` = next seq to *reserve*
  (equal to `head_seq + 1` unless submissions are in flight).
* `earliest_seq`: first live seq, `head_seq + 1` when empty; never decreases.
* `evict_floor`: `max(highest cap-evicted live seq, highest TTL-expired seq) + 1`; only
  cap/TTL loss moves it, deletes never do. It alone decides tombstones.

`$ts` is kept non-decreasing per topic (a backwards wall-clock jump re-uses the last
stamp), so TTL expiry always removes a prefix of the log and every TTL-expired record
lies below `evict_floor` (topicd decision; docs/decisions.md).
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import sys
from array import array
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, TypeAlias, TypeVar, cast

import trio

from topicd.model import project, shared_config
from topicd.sched.bands import Slot

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from topicd.engine.payloads import PayloadCache
    from topicd.engine.queues import JobQueue
    from topicd.errors import JsonValue
    from topicd.model import Shape, TopicConfig

_RUNS_MAX: Final = 64
# the extras maps of a topic that has none (most) are one shared map that refuses writes:
# a write site first gives the topic its own dict (`if not t.tags: t.tags = {}`)
_NO_EXTRAS: Final[MappingProxyType[object, object]] = MappingProxyType({})
_K = TypeVar("_K")
_V = TypeVar("_V")


def no_extras() -> dict[_K, _V]:
    """The shared empty map (typed as a dict for readers; it refuses writes)."""
    return cast("dict[_K, _V]", _NO_EXTRAS)


class Evicted(enum.Enum):
    """The slot marker of a live record whose bytes are only in its segment."""

    EVICTED = "evicted"


EVICTED: Final = Evicted.EVICTED
Enc: TypeAlias = bytes | Evicted | None  # a log slot: bytes, evicted, or dead


@dataclass(frozen=True, slots=True)
class Tombstone:
    """An in-band loss signal (api-topics §8). `reason` is informational."""

    gap_from: int
    gap_to: int
    reason: str
    earliest_seq: int
    head_seq: int

    def to_wire(self) -> dict[str, JsonValue]:
        return {
            "gap_from": self.gap_from,
            "gap_to": self.gap_to,
            "reason": self.reason,
            "missed_estimate": max(0, self.gap_to - self.gap_from + 1),
            "earliest_seq": self.earliest_seq,
            "head_seq": self.head_seq,
        }


@dataclass(slots=True, eq=False)
class DerivedSlot:
    """One seq a router fills in its destination: a copy (`enc` set) or a hole.

    Treated as immutable (`HOLE` and the routers' `TRIM` are shared markers); not frozen
    only because a frozen dataclass's constructor costs about three times as much, and
    every forwarded copy builds one."""

    enc: bytes | None
    size: int = 0
    tag: str | None = None
    node: str | None = None
    prio: int = 0
    shape: Shape | None = None
    hop: int = 0


HOLE: Final = DerivedSlot(None)


@dataclass(slots=True)
class ReadResult:
    """The outcome of one diff walk (api-topics §7.2 steps 4-8)."""

    records: list[bytes]
    next_from_seq: int
    head_seq: int
    earliest_seq: int
    tombstone: Tombstone | None
    scanned: int
    # the walk stopped before this seq: its bytes are not in memory (load, then read
    # again); the result is valid as it stands, only shorter
    missing: int | None = None
    cold_segments: int = 0  # cold-tier segments read to load its records

    @property
    def caught_up(self) -> bool:
        return self.next_from_seq == self.head_seq

    @property
    def lag(self) -> int:
        return self.head_seq - self.next_from_seq


class EvictionRuns:
    """Which reason (`cap`/`ttl`) evicted which seqs, as a bounded list of runs.

    Each run `(lo, hi, reason)` covers consecutive evicted ranges with one reason; runs are
    contiguous and ascending. Beyond `_RUNS_MAX` runs the two oldest merge (reason `mixed`
    if they differ): the tombstone *range* stays exact, only the informational reason of a
    very old range may coarsen.
    """

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: list[list[int | str]] | None = None  # (made by the first eviction)

    def add(self, lo: int, hi: int, reason: str) -> None:
        runs = self._runs
        if runs is None:
            self._runs = [[lo, hi, reason]]
            return
        if runs and runs[-1][2] == reason:
            runs[-1][1] = hi
            return
        runs.append([lo, hi, reason])
        if len(runs) > _RUNS_MAX:
            a, b = runs[0], runs[1]
            runs[0:2] = [[a[0], b[1], a[2] if a[2] == b[2] else "mixed"]]

    def export(self) -> list[tuple[int, int, str]]:
        return [(int(lo), int(hi), str(reason)) for lo, hi, reason in self._runs or ()]

    def load(self, runs: list[tuple[int, int, str]]) -> None:
        self._runs = [[lo, hi, reason] for lo, hi, reason in runs] or None

    def reason_for(self, lo: int, hi: int) -> str:
        found: set[str] = set()
        for r_lo, r_hi, reason in self._runs or ():
            assert isinstance(r_lo, int)
            assert isinstance(r_hi, int)
            assert isinstance(reason, str)
            if r_hi < lo:
                continue
            if r_lo > hi:
                break
            found.add(reason)
        if len(found) == 1:
            return found.pop()
        return "mixed" if found else "cap"


class TagIndex:
    """tag → ascending seqs, for point and prefix deletes without a log scan.

    Entries of records that died are removed lazily: lookups filter through the log, and
    the whole index is rebuilt from the live records once stale entries outnumber live
    ones (amortized O(1) per removal). Prefix (glob) lookups use a sorted tag list that
    absorbs newly seen tags in one merge when a glob query comes.
    """

    __slots__ = ("_by_tag", "_new_tags", "_sorted", "live", "stale")

    def __init__(self) -> None:
        # (made by the first tag: most topics have none)
        self._by_tag: dict[str, list[int]] = no_extras()
        self._sorted: list[str] | None = None
        self._new_tags: list[str] | None = None
        self.live = 0
        self.stale = 0

    def add(self, tag: str, seq: int) -> None:
        seqs = self._by_tag.get(tag)
        if seqs is None:
            if not self._by_tag:
                self._by_tag = {}
            self._by_tag[tag] = [seq]
            if self._new_tags is None:
                self._new_tags = [tag]
            else:
                self._new_tags.append(tag)
        else:
            seqs.append(seq)
        self.live += 1

    def removed(self) -> None:
        self.live -= 1
        self.stale += 1

    def needs_rebuild(self) -> bool:
        return self.stale > 1024 and self.stale > self.live

    def rebuild(self, live: Iterable[tuple[int, str]]) -> None:
        """Rebuild from the live `(seq, tag)` pairs, in ascending seq order."""
        self._by_tag = no_extras()
        self._sorted = None
        self._new_tags = None
        self.live = 0
        self.stale = 0
        for seq, tag in live:
            self.add(tag, seq)

    def exact(self, tag: str) -> list[int]:
        return self._by_tag.get(tag, [])

    def prefix(self, prefix: str) -> list[list[int]]:
        """Seq lists of every tag starting with `prefix` (all tags for "")."""
        if self._new_tags:
            if self._sorted is None:
                self._sorted = []
            self._sorted.extend(sorted(self._new_tags))
            self._sorted.sort()  # two sorted runs: timsort merges them in O(n)
            self._new_tags = None
        tags = self._sorted or []
        out: list[list[int]] = []
        i = bisect.bisect_left(tags, prefix)
        while i < len(tags) and tags[i].startswith(prefix):
            seqs = self._by_tag.get(tags[i])
            if seqs is not None:
                out.append(seqs)
            i += 1
        return out


def _gc_untrack() -> Callable[[object], None] | None:
    """CPython's `PyObject_GC_UnTrack` (None elsewhere)."""
    if sys.implementation.name != "cpython":
        return None
    fn = ctypes.pythonapi.PyObject_GC_UnTrack
    fn.argtypes = [ctypes.py_object]
    fn.restype = None
    return cast("Callable[[object], None]", fn)


_UNTRACK: Final = _gc_untrack()


def slot_list() -> list[Enc]:
    """An empty list for a run's slots, which the cyclic garbage collector does not
    track. The slots hold only bytes, None and the `EVICTED` singleton, so no cycle can
    pass through the list, and a full collection would otherwise visit every slot of
    every retained record (about 46 ms per 10 million slots here): with 10 GiB retained
    that was the longest loop stall left. The list is only ever changed in place, so it
    stays untracked (CPython re-tracks no list)."""
    encs: list[Enc] = []
    if _UNTRACK is not None:
        _UNTRACK(encs)
    return encs


class Run:
    """Consecutive slots `base .. base + len(encs) - 1` of a topic's log."""

    __slots__ = ("base", "encs", "sizes", "ts")

    def __init__(self, base: int) -> None:
        self.base = base
        self.encs: list[Enc] = slot_list()
        self.ts = array("q")
        self.sizes = array("I")

    @property
    def end(self) -> int:
        """The last seq of the run (`base - 1` when empty)."""
        return self.base + len(self.encs) - 1


class Topic:
    """One instance of a named topic (delete + recreate makes a new instance).

    Slotted: a topic without slots carries a ~5 KiB instance dict (more attributes than a
    shared-key dict holds), the bulk of a small topic's memory at 100,000 topics."""

    __slots__ = (
        "_evictions",
        "_tag_index",
        "_wakeup",
        "absorbed_to",
        "bytes",
        "cache",
        "cached",
        "changed",
        "config",
        "count",
        "deleted",
        "deleting",
        "drained_strong",
        "drained_to",
        "durable_head",
        "earliest_seq",
        "evict_floor",
        "head_seq",
        "hops",
        "last_read_ts",
        "last_ts",
        "last_write_ts",
        "lost_ranges",
        "name",
        "name_json",
        "next_seq",
        "nodes",
        "on_drain",
        "pending_bytes",
        "pending_records",
        "prios",
        "queue",
        "released",
        "reserved_head",
        "runs",
        "seg_killed",
        "seg_tail",
        "shapes",
        "slot",
        "tags",
        "topic_id",
        "tracker",
        "trims",
    )

    def __init__(self, name: str, topic_id: int, config: TopicConfig, *, name_json: bytes) -> None:
        self.name = name
        # a tight copy: `orjson.dumps` returns its output in a ~4 KiB buffer it never
        # shrinks, which held this short string 100 times over
        self.name_json = bytes(memoryview(name_json))
        self.topic_id = topic_id
        self.config = shared_config(config)
        self.runs: list[Run] = [Run(1)]
        # sparse per-seq extras; `no_extras()` (shared, read-only) until the first entry
        self.tags: dict[int, str] = no_extras()
        self.nodes: dict[int, str] = no_extras()
        self.prios: dict[int, int] = no_extras()
        self.shapes: dict[int, Shape] = no_extras()
        self.head_seq = 0
        self.next_seq = 1
        self.earliest_seq = 1
        self.evict_floor = 1
        self.count = 0
        self.bytes = 0
        self.last_ts = 0
        self.last_write_ts: int | None = None
        self.last_read_ts: int | None = None
        self.pending_records = 0
        self.pending_bytes = 0
        # (made on first use: most topics never tag a record nor evict one)
        self._tag_index: TagIndex | None = None
        self._evictions: EvictionRuns | None = None
        self.deleted = False
        # something the snapshot records changed since the last checkpoint captured the
        # topic (set by every such mutation; checkpoints re-capture only these)
        self.changed = True
        self.tracker: set[Topic] | None = None  # the engine's set of changed topics
        self.deleting: trio.Event | None = None  # set while a delete is being committed
        self.reserved_head = 0  # durable seq reservation (storage): seqs ≤ it may be used
        # (gap_from, gap_to), ascending; tuples, replaced on change (an empty one is shared)
        self.lost_ranges: tuple[tuple[int, int], ...] = ()
        # router destinations: seqs whose source record was gone before it was copied
        # (`source_trim` tombstones), and the hop count of each derived copy (routers)
        self.trims: tuple[tuple[int, int], ...] = ()
        self.hops: dict[int, int] = no_extras()
        self._wakeup: trio.Event | None = None
        # delivery (topicd.sched): the scheduler's slot, how far drains have pushed, and
        # the highest seq known to be on disk (what `consistency:"strong"` watchers see)
        self.slot: Slot[Topic] = Slot(self)
        self.durable_head = 0
        self.drained_to = 0
        self.drained_strong = 0
        self.on_drain: tuple[Callable[[Topic, int, int], None], ...] = ()  # hooks (tests)
        # a queue topic's lease table and claim index (`engine.queues`), told of every
        # published and every removed record; None for a log topic
        self.queue: JobQueue | None = None
        # segments (storage): records up to `seg_tail` were copied into segment files by
        # a checkpoint; those killed since are listed so the next one flips their flags
        self.seg_tail = 0
        self.seg_killed: list[int] | None = None  # (made by the first)
        # the payload cache (`topicd.engine.payloads`): chunks below `released` are
        # absorbed (evictable); `cached` are those of them in the LRU
        self.cache: PayloadCache | None = None
        self.absorbed_to = 0  # records up to here are in segments (only they can be evicted)
        self.released = 0
        self.cached: set[int] | None = None  # (created with the first: most topics never)

    @property
    def tag_index(self) -> TagIndex:
        index = self._tag_index
        if index is None:
            index = self._tag_index = TagIndex()
        return index

    @property
    def evictions(self) -> EvictionRuns:
        runs = self._evictions
        if runs is None:
            runs = self._evictions = EvictionRuns()
        return runs

    def export_evictions(self) -> list[tuple[int, int, str]]:
        """The eviction runs as a snapshot stores them (without making any)."""
        return [] if self._evictions is None else self._evictions.export()

    def mark_changed(self) -> None:
        """Something the snapshot records changed: the next checkpoint captures the topic
        (`topicd.storage.snapshot.capture`)."""
        if not self.changed:
            self.changed = True
            if self.tracker is not None:
                self.tracker.add(self)

    # ---- lookup -------------------------------------------------------------------------

    def _run(self, seq: int) -> Run | None:
        """The run holding slot `seq` (None inside a gap between runs)."""
        runs = self.runs
        if len(runs) == 1:
            return runs[0]
        i = bisect.bisect_right(runs, seq, key=lambda r: r.base) - 1
        if i < 0:
            return None
        run = runs[i]
        return run if seq <= run.end else None

    def run_at(self, seq: int) -> Run | None:
        """The run holding slot `seq` (None inside a gap between runs)."""
        return self._run(seq)

    def enc(self, seq: int) -> Enc:
        """The stored JSON of the live record `seq`, `EVICTED` if its bytes are only in
        its segment (`topicd.engine.payloads`), or None."""
        if seq < self.earliest_seq or seq > self.head_seq:
            return None
        run = self._run(seq)
        return None if run is None else run.encs[seq - run.base]

    def enc_ts(self, seq: int) -> tuple[Enc, int]:
        """`enc(seq)` and, for a live record, its `$ts` (0 otherwise): one lookup."""
        if seq < self.earliest_seq or seq > self.head_seq:
            return None, 0
        run = self._run(seq)
        if run is None:
            return None, 0
        i = seq - run.base
        return run.encs[i], run.ts[i]

    def live(self, seq: int) -> bool:
        return self.enc(seq) is not None

    def size(self, seq: int) -> int:
        run = self._run(seq)
        assert run is not None
        return run.sizes[seq - run.base]

    def ts_at(self, seq: int) -> int:
        """The `$ts` of the record in slot `seq` (which must lie in a run)."""
        run = self._run(seq)
        assert run is not None
        return run.ts[seq - run.base]

    def next_slot(self, seq: int) -> int | None:
        """The first seq `>= seq` (and `>= earliest_seq`) that lies in a run, or None
        above the head: a gap between runs is jumped in O(log runs)."""
        if seq < self.earliest_seq:
            seq = self.earliest_seq
        if seq > self.head_seq:
            return None
        if len(self.runs) == 1 or self._run(seq) is not None:
            return seq
        i = bisect.bisect_right(self.runs, seq, key=lambda r: r.base)
        return self.runs[i].base if i < len(self.runs) else None

    # ---- the payload cache's chunks (`topicd.engine.payloads`) -------------------------

    def _parts(self, lo: int, hi: int) -> list[tuple[Run, int, int]]:
        """(run, first index, end index) of the slots of seqs `lo ..= hi` in each run."""
        lo = max(lo, self.earliest_seq)
        runs = self.runs
        out = []
        i = max(0, bisect.bisect_right(runs, lo, key=lambda r: r.base) - 1)
        while i < len(runs) and runs[i].base <= hi:
            run = runs[i]
            a, b = max(lo, run.base), min(hi, run.end)
            if a <= b:
                out.append((run, a - run.base, b - run.base + 1))
            i += 1
        return out

    def resident_bytes(self, lo: int, hi: int) -> int:
        """The bytes of the records `lo ..= hi` held in memory."""
        total = 0
        for run, a, b in self._parts(lo, hi):
            encs = run.encs[a:b]
            try:
                total += sum(map(len, cast("list[bytes]", encs)))  # all resident: one C pass
            except TypeError:  # a dead or evicted slot among them
                total += sum([len(e) for e in encs if isinstance(e, bytes)])
        return total

    def evict_range(self, lo: int, hi: int) -> None:
        """Drop the bytes of the live records `lo ..= hi` (they stay live: `EVICTED`)."""
        for run, a, b in self._parts(lo, hi):
            run.encs[a:b] = [None if e is None else EVICTED for e in run.encs[a:b]]

    def fill(self, seq: int, enc: bytes) -> bool:
        """Put back the bytes of the evicted record `seq` (False: not evicted now)."""
        if seq < self.earliest_seq or seq > self.head_seq:
            return False
        run = self._run(seq)
        if run is None or run.encs[seq - run.base] is not EVICTED:
            return False
        run.encs[seq - run.base] = enc
        return True

    # ---- write side -------------------------------------------------------------------

    def stamp(self, now_ms: int) -> int:
        """The `$ts` for a new write: the wall clock, never below the previous stamp."""
        ts = now_ms if now_ms > self.last_ts else self.last_ts
        self.last_ts = ts
        self.mark_changed()
        return ts

    def publish(
        self,
        first_seq: int,
        ts: int,
        encs: list[bytes],
        sizes: list[int],
        nbytes: int,
        tags: dict[int, str],
        nodes: dict[int, str],
        prios: dict[int, int],
        shapes: dict[int, Shape],
    ) -> None:
        """Make a committed batch visible (called only by the commit path, in seq order).

        The extras maps are keyed by the record's index in the batch.
        """
        n = len(encs)
        assert n > 0
        assert first_seq == self.head_seq + 1, (first_seq, self.head_seq)
        self.mark_changed()
        run = self.runs[-1]
        assert first_seq == run.end + 1, (first_seq, run.base, len(run.encs))
        run.encs.extend(encs)
        run.ts.extend([ts] * n)
        run.sizes.extend(sizes)
        if tags:
            index = self.tag_index
            if not self.tags:
                self.tags = {}
            for i, tag in tags.items():
                self.tags[first_seq + i] = tag
                index.add(tag, first_seq + i)
        if nodes:
            if not self.nodes:
                self.nodes = {}
            for i, node in nodes.items():
                self.nodes[first_seq + i] = node
        if prios:
            if not self.prios:
                self.prios = {}
            for i, prio in prios.items():
                self.prios[first_seq + i] = prio
        if shapes:
            if not self.shapes:
                self.shapes = {}
            for i, shape in shapes.items():
                self.shapes[first_seq + i] = shape
        self.head_seq = first_seq + n - 1
        self.count += n
        self.bytes += nbytes
        if self.queue is not None:
            self.queue.published(first_seq, n, prios)

    def skip_to(self, new_head: int) -> None:
        """Raise `head_seq` to `new_head` over seqs that hold nothing (recovery: a seq
        reservation or a lost range). The gap is not stored: a new run starts above it."""
        if new_head <= self.head_seq:
            return
        self.mark_changed()
        if self.count == 0:
            self.runs = [Run(new_head + 1)]
            self.earliest_seq = new_head + 1
        elif self.runs[-1].encs:
            self.runs.append(Run(new_head + 1))
        else:
            self.runs[-1].base = new_head + 1
        self.head_seq = new_head
        self.next_seq = new_head + 1

    def add_lost_range(self, gap_from: int, gap_to: int) -> None:
        """Record seqs possibly lost in a crash (recovery); reads announce them."""
        assert gap_from <= gap_to
        self.mark_changed()
        self.lost_ranges = tuple(sorted([*self.lost_ranges, (gap_from, gap_to)]))
        self.skip_to(gap_to)

    def publish_derived(self, ts: int, slots: list[DerivedSlot]) -> int:
        """Append router copies (and the holes of passed-over source seqs) at `head + 1 ..`.

        Derived slots never go through the WAL (routers re-derive them at recovery), so
        this is the whole publication. Returns the payload bytes added."""
        assert slots
        assert self.next_seq == self.head_seq + 1, "a write is in flight"
        self.mark_changed()
        first = self.head_seq + 1
        run = self.runs[-1]
        if run.end + 1 != first:
            run = Run(first)
            self.runs.append(run)
        nbytes = 0
        count = 0
        queue = self.queue
        encs, sizes = run.encs, run.sizes
        for i, slot in enumerate(slots):
            enc = slot.enc
            encs.append(enc)
            sizes.append(slot.size)
            if enc is None:
                continue
            if slot.tag is not None or slot.node is not None or slot.prio or slot.shape or slot.hop:
                self._extras(first + i, slot)
            nbytes += slot.size
            count += 1
            if queue is not None:
                queue.published(first + i, 1, {0: slot.prio} if slot.prio else {})
        run.ts.extend([ts] * len(slots))
        self.head_seq = self.next_seq - 1 + len(slots)
        self.next_seq = self.head_seq + 1
        self.count += count
        self.bytes += nbytes
        if self.earliest_seq >= first:
            # the log held nothing live: `earliest_seq` steps over leading holes
            self._advance_earliest()
        return nbytes

    def _extras(self, seq: int, slot: DerivedSlot) -> None:
        if slot.tag is not None:
            if not self.tags:
                self.tags = {}
            self.tags[seq] = slot.tag
            self.tag_index.add(slot.tag, seq)
        if slot.node is not None:
            if not self.nodes:
                self.nodes = {}
            self.nodes[seq] = slot.node
        if slot.prio:
            if not self.prios:
                self.prios = {}
            self.prios[seq] = slot.prio
        if slot.shape is not None:
            if not self.shapes:
                self.shapes = {}
            self.shapes[seq] = slot.shape
        if slot.hop:
            if not self.hops:
                self.hops = {}
            self.hops[seq] = slot.hop

    def insert_derived(self, placed: dict[int, tuple[int, DerivedSlot]]) -> int:
        """Recovery: put re-derived slots (`seq -> (ts, slot)`) into the gaps of the log
        (seqs held by no run, above `earliest_seq`). Rebuilds the runs; returns the payload
        bytes added."""
        if not placed:
            return 0
        self.mark_changed()
        slots: dict[int, tuple[Enc, int, int]] = {}
        for run in self.runs:
            for i, enc in enumerate(run.encs):
                slots[run.base + i] = (enc, run.ts[i], run.sizes[i])
        nbytes = 0
        for seq, (ts, slot) in placed.items():
            assert seq not in slots, seq
            slots[seq] = (slot.enc, ts, slot.size)
            if slot.enc is not None:
                self._extras(seq, slot)
                nbytes += slot.size
                self.count += 1
        runs: list[Run] = []
        for seq in sorted(slots):
            enc, ts, size = slots[seq]
            if not runs or runs[-1].end + 1 != seq:
                runs.append(Run(seq))
            run = runs[-1]
            run.encs.append(enc)
            run.ts.append(ts)
            run.sizes.append(size)
        top = max(self.head_seq, runs[-1].end)
        if runs[-1].end < top:
            runs.append(Run(top + 1))
        self.runs = runs
        self.head_seq = top
        self.next_seq = top + 1
        self.bytes += nbytes
        self.tag_index.rebuild(sorted(self.tags.items()))
        if self.count == 0:
            self.earliest_seq = self.head_seq + 1
        else:
            self.earliest_seq = min(self.earliest_seq, min(placed))
            self._advance_earliest()
        return nbytes

    def add_trim(self, gap_from: int, gap_to: int) -> None:
        """Seqs a router could not fill: its source lost them first (`source_trim`)."""
        self.mark_changed()
        trims = self.trims
        if trims and trims[-1][1] + 1 == gap_from:
            self.trims = (*trims[:-1], (trims[-1][0], gap_to))
        else:
            self.trims = tuple(sorted([*trims, (gap_from, gap_to)]))

    # ---- retention --------------------------------------------------------------------

    def enforce(self, now_ms: int) -> int:
        """Apply TTL and caps; return the payload bytes freed.

        On a `discard:"reject"` topic writes never push the log over its caps (they are
        refused first), so caps evict there only after a config change tightened them
        (README §10: a tighter cap evicts at once, tombstones follow).
        """
        cfg = self.config
        freed = 0
        if cfg.ttl_ms > 0 and self.count:
            limit_ts = now_ms - cfg.ttl_ms  # expired iff now - ts > ttl  ⇔  ts < limit_ts
            while self.count:
                run = self.runs[0]
                if run.ts[self.earliest_seq - run.base] >= limit_ts:
                    break
                freed += self._evict_front("ttl")
        if cfg.cap_records > 0:
            while self.count > cfg.cap_records:
                freed += self._evict_front("cap")
        if cfg.cap_bytes > 0:
            while self.bytes > cfg.cap_bytes and self.count:
                freed += self._evict_front("cap")
        if freed:
            self._tidy_tag_index()
        return freed

    def raise_floor(self, floor: int, runs: list[tuple[int, int, str]]) -> int:
        """Take another process's eviction floor (a follower front, from the owner's
        registry entry): every live record below `floor` is evicted and `runs` become
        the eviction runs (the reasons of its tombstones). Returns the payload bytes
        freed; nothing changes when this topic's floor is already as high."""
        if floor <= self.evict_floor:
            return 0
        freed = 0
        while self.count and self.earliest_seq < floor:
            freed += self._evict_front("cap")  # (its run is replaced by `runs` below)
        self.evictions.load(runs)
        self.evict_floor = floor
        self.skip_to(floor - 1)
        if freed:
            self._tidy_tag_index()
        self.mark_changed()
        return freed

    def _evict_front(self, reason: str) -> int:
        seq = self.earliest_seq
        self.mark_changed()
        self.evictions.add(self.evict_floor, seq, reason)
        self.evict_floor = seq + 1
        if self.lost_ranges and self.lost_ranges[0][1] < seq:
            # absorbed: the cap/TTL tombstone now covers it
            self.lost_ranges = tuple(r for r in self.lost_ranges if r[1] >= seq)
        if self.trims and self.trims[0][1] < seq:
            self.trims = tuple(r for r in self.trims if r[1] >= seq)
        size = self._kill(seq, self.runs[0])
        self._advance_earliest()
        return size

    # ---- deletes ----------------------------------------------------------------------

    def _kill(self, seq: int, run: Run, notify: bool = True) -> int:
        """Remove the live record `seq` held by `run`; return its size. A queue's
        `changed()` runs for it unless not `notify` (a caller killing many calls it once)."""
        i = seq - run.base
        assert run.encs[i] is not None
        run.encs[i] = None
        if not self.changed:
            self.mark_changed()
        size = run.sizes[i]
        if seq <= self.seg_tail:
            if self.seg_killed is None:
                self.seg_killed = [seq]
            else:
                self.seg_killed.append(seq)
        self.count -= 1
        self.bytes -= size
        if self.tags and self.tags.pop(seq, None) is not None:
            self.tag_index.removed()
        if self.nodes:
            self.nodes.pop(seq, None)
        prio = self.prios.pop(seq, 0) if self.prios else 0
        if self.shapes:
            self.shapes.pop(seq, None)
        if self.hops:
            self.hops.pop(seq, None)
        if self.queue is not None:
            self.queue.dropped(seq, prio, notify)
        return size

    def _advance_earliest(self) -> None:
        """Move `earliest_seq` to the first live record (or head + 1); drop dead runs."""
        seq = self.earliest_seq
        runs = self.runs
        while True:
            run = runs[0]
            if seq < run.base:
                seq = run.base
            encs, base, end = run.encs, run.base, run.end
            while seq <= end and encs[seq - base] is None:
                seq += 1
            if seq <= end or len(runs) == 1:
                break
            runs.pop(0)  # nothing live left in this run
        run = runs[0]
        if seq > self.head_seq:
            seq = self.head_seq + 1
        self.earliest_seq = seq
        dead = min(seq, run.end + 1) - run.base
        if dead > 4096 and dead * 2 > len(run.encs):
            del run.encs[:dead]
            del run.ts[:dead]
            del run.sizes[:dead]
            run.base += dead

    def delete_records(
        self, before_seq: int | None, match: tuple[str, str] | None, bound_head: int
    ) -> tuple[int, int]:
        """Point-in-time delete (api-topics §10.2). Returns (records deleted, bytes freed)."""
        hi = bound_head
        if before_seq is not None:
            hi = min(hi, before_seq - 1)
        deleted = 0
        freed = 0
        if match is None:
            for run in list(self.runs):
                lo = max(self.earliest_seq, run.base)
                top = min(hi, run.end)
                encs, base = run.encs, run.base
                for seq in range(lo, top + 1):
                    if encs[seq - base] is not None:
                        freed += self._kill(seq, run)
                        deleted += 1
        else:
            op, value = match
            index = self.tag_index
            lists = [index.exact(value)] if op == "Eq" else index.prefix(value)
            tags = self.tags
            for seqs in lists:
                # seqs ascend: only the part inside [earliest_seq, hi] can be live
                lo_i = bisect.bisect_left(seqs, self.earliest_seq)
                hi_i = bisect.bisect_right(seqs, hi)
                for seq in seqs[lo_i:hi_i]:
                    tag = tags.get(seq)
                    if tag is None or (op == "Eq" and tag != value):
                        continue
                    holder = self._run(seq)
                    assert holder is not None
                    freed += self._kill(seq, holder)
                    deleted += 1
        if deleted:
            self._advance_earliest()
            self._tidy_tag_index()
        return deleted, freed

    def delete_seqs(self, seqs: Iterable[int]) -> tuple[int, int]:
        """Delete the listed records that are still live (queue acks and dead-letter
        moves). Returns (records deleted, bytes freed)."""
        deleted = 0
        freed = 0
        lo, hi = self.earliest_seq, self.head_seq
        queue = self.queue
        # a queue's jobs without extras (no tag, node, priority, shape or hop: the usual
        # acked job) die in this loop, `_kill`'s steps inline, and leave the queue in one
        # call (`JobQueue.dropped_plain`); any other record goes through `_kill`
        plain = queue is not None and not (
            self.tags or self.nodes or self.prios or self.shapes or self.hops
        )
        gone: list[int] = []
        seg_tail = self.seg_tail
        run: Run | None = None
        base = end = 0
        encs: list[Enc] = []
        for seq in seqs:
            if seq < lo or seq > hi:
                continue
            if run is None or seq < base or seq > end:  # (acked jobs share a run)
                run = self._run(seq)
                if run is None:
                    continue
                base, end, encs = run.base, run.end, run.encs
            i = seq - base
            if encs[i] is None:
                continue
            deleted += 1
            if not plain:
                freed += self._kill(seq, run, False)
                continue
            encs[i] = None
            freed += run.sizes[i]
            gone.append(seq)
            if seq <= seg_tail:
                if self.seg_killed is None:
                    self.seg_killed = [seq]
                else:
                    self.seg_killed.append(seq)
        if gone:
            if not self.changed:
                self.mark_changed()
            self.count -= len(gone)
            self.bytes -= freed  # (all of it: `plain` sends no record to `_kill`)
            assert queue is not None
            queue.dropped_plain(gone)
        if deleted:
            if queue is not None:
                queue.changed()  # (once for the whole delete, not once per job)
            self._advance_earliest()
            self._tidy_tag_index()
        return deleted, freed

    def _tidy_tag_index(self) -> None:
        index = self._tag_index
        if index is not None and index.needs_rebuild():
            index.rebuild(self.tags.items())  # insertion order is seq order

    # ---- read side --------------------------------------------------------------------

    def read(
        self,
        from_seq: int,
        limit: int,
        max_bytes: int,
        node_filter: frozenset[str] | None,
        include_tags: bool,
        include_meta: bool,
        max_scan: int,
        include_data: bool = True,
        upto: int | None = None,
    ) -> ReadResult:
        """The diff walk (api-topics §7.2 steps 4-8); retention must be enforced first.

        `upto` bounds the walk below the head (a watch drain's range, or the durable head
        of a `consistency:"strong"` watcher)."""
        head = self.head_seq
        earliest = self.earliest_seq
        floor = self.evict_floor
        tomb: Tombstone | None = None
        if from_seq > head:
            tomb = Tombstone(1, head, "recreated", earliest, head)
            cursor = earliest - 1
        elif from_seq + 1 < floor:
            gap_to = floor - 1
            reason = self.evictions.reason_for(from_seq + 1, gap_to)
            tomb = Tombstone(from_seq + 1, gap_to, reason, floor, head)
            cursor = max(earliest - 1, from_seq)
        else:
            cursor = from_seq
        # a lost range (seqs possibly lost in a crash) is a barrier no jump may cross
        lost: tuple[int, int, str] | None = None
        if self.lost_ranges or self.trims:
            recreated = tomb is not None and tomb.reason == "recreated"
            lost = self._next_lost(cursor if recreated else from_seq)
        barrier = lost[0] - 1 if lost is not None else head
        if cursor > barrier:
            cursor = max(barrier, from_seq)
        scanned = 0
        if cursor < earliest - 1:
            # everything below earliest_seq is dead: skip it in O(1)
            jump = min(earliest - 1, barrier)
            scanned = jump - cursor
            cursor = jump
        out: list[bytes] = []
        missing: int | None = None
        seq = cursor
        end = min(head, barrier, cursor + max_scan)
        if upto is not None and upto < end:
            end = max(upto, cursor)
        if cursor < end:
            nodes = self.nodes if node_filter is not None and self.nodes else None
            plain = include_meta and include_data and not (include_tags and self.tags)
            nbytes = 0
            full = False
            for run in self.runs:
                if run.end <= seq:
                    continue
                if run.base > end:
                    break
                if run.base > seq + 1:
                    seq = run.base - 1  # a gap between runs: nothing was ever stored there
                encs, base = run.encs, run.base
                stop = min(end, run.end)
                for seq in range(seq + 1, stop + 1):  # noqa: B020 - seq carries on
                    enc = encs[seq - base]
                    if enc is None:
                        continue
                    if enc is EVICTED:
                        missing = seq  # its bytes are in its segment only: stop before it
                        seq -= 1
                        full = True
                        break
                    if nodes is not None and nodes.get(seq) in node_filter:  # type: ignore[operator]
                        continue
                    if not plain:
                        enc = project(
                            enc,
                            self.shapes.get(seq),
                            self.tags.get(seq),
                            include_tags,
                            include_meta,
                            include_data,
                        )
                    if out and nbytes + len(enc) > max_bytes:
                        seq -= 1
                        full = True
                        break
                    out.append(enc)
                    nbytes += len(enc)
                    if len(out) >= limit:
                        full = True
                        break
                if full:
                    break
            if not full:
                seq = end  # examined every seq up to `end`, or jumped a gap holding none
            scanned += seq - cursor
            if self.cached and self.cache is not None and cursor < self.absorbed_to:
                self.cache.touch(self, cursor + 1, seq)
        if lost is not None and seq >= barrier and not out and tomb is None:
            # the walk reached a lost range with nothing to deliver: announce it
            gap_from, gap_to = max(lost[0], from_seq + 1), lost[1]
            tomb = Tombstone(gap_from, gap_to, lost[2], gap_to + 1, head)
            seq = gap_to
        return ReadResult(out, seq, head, earliest, tomb, scanned, missing)

    def _next_lost(self, from_seq: int) -> tuple[int, int, str] | None:
        """The first lost range (`crash`) or router trim (`source_trim`) ending above
        `from_seq`, if any."""
        found: tuple[int, int, str] | None = None
        for ranges, reason in ((self.lost_ranges, "crash"), (self.trims, "source_trim")):
            i = bisect.bisect_right(ranges, from_seq, key=lambda r: r[1])
            if i < len(ranges) and (found is None or ranges[i][0] < found[0]):
                found = (ranges[i][0], ranges[i][1], reason)
        return found

    # ---- waiting ------------------------------------------------------------------------

    def waiter(self) -> trio.Event:
        """An event set by the next publish (or deletion) of this topic."""
        if self._wakeup is None:
            self._wakeup = trio.Event()
        return self._wakeup

    @property
    def has_waiters(self) -> bool:
        return self._wakeup is not None

    def wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None
