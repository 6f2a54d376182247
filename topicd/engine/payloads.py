"""The payload cache: which absorbed records keep their stored JSON in memory.

A topic's log (`topicd.engine.topic.Run`) keeps, per seq, its `$ts` and size in compact
arrays and one slot: the record's bytes, `None` once it died, or the shared `EVICTED`
marker (live, bytes only in its segment file). Records a checkpoint has not absorbed into
segments yet exist only in the WAL and in memory, so their bytes are *pinned*: they never
leave. Once a checkpoint made their segment durable, their bytes become evictable and
enter one LRU shared by every topic, bounded by `storage.payload_cache_bytes`.

The unit is a *chunk*: the 256 (`1 << CHUNK_SHIFT`) consecutive seqs `k·256 ..` of one
topic. A chunk
enters the LRU when its last seq is absorbed (`release`), is moved to the young end when a
read uses it (`touch`), and leaving the LRU turns every live slot of it into `EVICTED`. A
chunk may be partly resident (a miss loads only what a read needs); the LRU counts the
bytes of its resident slots.

A miss is served by `load`: it reads the records from the segments through the storage
seam (`StorageBackend.read_stored_range`: offloaded, read limiter, checksums verified),
puts their bytes back into the slots and the chunks at the young end. The chunks a reader
loaded stay resident until its `Hold` ends, even past the bound, so a read that needs
several loads always progresses (its walk restarts from the cursor each time); the bound
is enforced again when the hold ends. Reads never wait for the loop to do file IO.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from topicd.engine.topic import EVICTED
from topicd.errors import Internal

if TYPE_CHECKING:
    from types import TracebackType

    from topicd.engine.topic import Topic

# the chunk: 1 << CHUNK_SHIFT consecutive seqs (tests make it smaller before an engine
# starts; one engine keeps the value it started with)
CHUNK_SHIFT = 8
# one load reads at most this many payload bytes (a read of more loads again)
LOAD_BYTES_MAX: Final = 4 << 20


class Loader(Protocol):
    async def __call__(
        self, topic: Topic, lo: int, hi: int, max_bytes: int
    ) -> dict[int, bytes]: ...


@dataclass(frozen=True, slots=True)
class CacheStats:
    bound: int
    bytes: int
    chunks: int
    hits: int  # chunks a read found resident (touches)
    misses: int  # loads
    loaded_records: int
    loaded_bytes: int
    evicted_chunks: int


class Hold:
    """Chunks loaded for one reader, kept resident until the hold ends (`with`)."""

    __slots__ = ("_cache", "cold", "keys")

    def __init__(self, cache: PayloadCache) -> None:
        self._cache = cache
        self.keys: set[tuple[int, int]] = set()
        self.cold = 0  # cold-tier segments its loads read (`performance.cold_segments_read`)

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._cache.unhold(self)


class PayloadCache:
    """The global LRU of absorbed records' payloads (see module docstring)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.shift = CHUNK_SHIFT
        self.bytes = 0
        # (topic id, chunk) → bytes of its resident slots; oldest first
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._topics: dict[int, Topic] = {}  # topics with a chunk in the LRU
        self._held: dict[tuple[int, int], int] = {}  # chunk → holds keeping it
        self.loader: Loader | None = None
        self.hits = 0
        self.misses = 0
        self.loaded_records = 0
        self.loaded_bytes = 0
        self.evicted_chunks = 0

    def stats(self) -> CacheStats:
        return CacheStats(
            self.bound,
            self.bytes,
            len(self._lru),
            self.hits,
            self.misses,
            self.loaded_records,
            self.loaded_bytes,
            self.evicted_chunks,
        )

    # ---- chunks enter, move, leave ----------------------------------------------------

    def release(self, topic: Topic, absorbed: int, *, trim: bool = True) -> None:
        """Records up to `absorbed` are durable in segments: their whole chunks become
        evictable (they enter the LRU at the young end); then the bound is enforced
        (unless `trim` is False: the caller then calls `trim` itself, a slice at a
        time)."""
        topic.absorbed_to = max(topic.absorbed_to, absorbed)
        shift = self.shift
        top = (absorbed + 1) >> shift  # chunks below this end at or before `absorbed`
        if top > topic.released:
            first = max(topic.released, topic.earliest_seq >> shift)
            topic.released = top
            for k in range(first, top):
                nbytes = topic.resident_bytes(k << shift, ((k + 1) << shift) - 1)
                if nbytes:
                    self._add(topic, k, nbytes)
        if trim:
            self.trim()

    def _add(self, topic: Topic, k: int, nbytes: int) -> None:
        key = (topic.topic_id, k)
        old = self._lru.pop(key, 0)
        self._lru[key] = old + nbytes
        self.bytes += nbytes
        if topic.cached is None:
            topic.cached = set()
        topic.cached.add(k)
        self._topics[topic.topic_id] = topic

    def touch(self, topic: Topic, lo: int, hi: int) -> None:
        """A read used seqs `lo ..= hi`: their cached chunks become the youngest."""
        lru = self._lru
        tid = topic.topic_id
        cached = topic.cached
        if not cached:
            return
        for k in range(lo >> self.shift, min(hi >> self.shift, topic.released - 1) + 1):
            if k in cached:
                lru.move_to_end((tid, k))
                self.hits += 1

    def trim(self, chunks: int = 0) -> bool:
        """Evict the oldest chunks (never a held one) until the bound holds, or (with
        `chunks` > 0) until that many were evicted. True when it stopped at `chunks`
        with the bound still exceeded: call again (a checkpoint's install yields
        between calls, since evicting is a list write and a free per record)."""
        lru = self._lru
        if self.bytes <= self.bound:
            return False
        skipped: list[tuple[tuple[int, int], int]] = []
        left = chunks
        while self.bytes > self.bound and lru:
            if chunks and not left:
                break
            key, nbytes = lru.popitem(last=False)
            if key in self._held:
                skipped.append((key, nbytes))
                self.bytes -= nbytes  # (added back below)
                continue
            self.bytes -= nbytes
            topic = self._topics[key[0]]
            k = key[1]
            topic.evict_range(k << self.shift, ((k + 1) << self.shift) - 1)
            assert topic.cached is not None
            topic.cached.discard(k)
            if not topic.cached:
                topic.cached = None
                del self._topics[key[0]]
            self.evicted_chunks += 1
            left -= 1
        for key, nbytes in reversed(skipped):  # back at the old end, in their order
            lru[key] = nbytes
            lru.move_to_end(key, last=False)
            self.bytes += nbytes
        return bool(chunks) and not left and self.bytes > self.bound

    def forget(self, topic: Topic) -> None:
        """A deleted topic's chunks leave the LRU (its slots go with the topic)."""
        tid = topic.topic_id
        for k in topic.cached or ():
            self.bytes -= self._lru.pop((tid, k), 0)
        topic.cached = None
        self._topics.pop(tid, None)

    # ---- misses -----------------------------------------------------------------------

    def hold(self) -> Hold:
        return Hold(self)

    def unhold(self, hold: Hold) -> None:
        held = self._held
        for key in hold.keys:
            n = held[key] - 1
            if n:
                held[key] = n
            else:
                del held[key]
        hold.keys.clear()
        self.trim()

    async def load(self, topic: Topic, seq: int, count: int, max_bytes: int, hold: Hold) -> int:
        """Read the evicted records of `seq ..` (about `count` seqs, at most `max_bytes`
        of payload, at least one record) from the segments back into memory, held by
        `hold`. Returns how many were loaded. Raises `Internal` (500) for a record the
        segments do not hold or one failing its checksum (the seam counts those)."""
        assert self.loader is not None
        count = max(1, min(count, 16 << self.shift))
        hi = seq + count - 1
        got = await self.loader(topic, seq, hi, min(max(max_bytes, 1), LOAD_BYTES_MAX))
        self.misses += 1
        # (the segment store's result also says how many cold-tier segments it read)
        hold.cold += getattr(got, "cold", 0)
        if topic.deleted:
            return 0
        loaded = 0
        nbytes_total = 0
        per_chunk: dict[int, int] = {}
        for s, enc in got.items():
            if topic.fill(s, enc):
                loaded += 1
                nbytes_total += len(enc)
                k = s >> self.shift
                per_chunk[k] = per_chunk.get(k, 0) + len(enc)
        if topic.enc(seq) is EVICTED:
            # the segments hold no live frame for a record memory says is live
            raise Internal(f"record {seq} of topic {topic.name!r} is missing from its segment")
        self.loaded_records += loaded
        self.loaded_bytes += nbytes_total
        tid = topic.topic_id
        for k, nbytes in per_chunk.items():
            key = (tid, k)
            if k < topic.released:
                self._add(topic, k, nbytes)
            if key not in hold.keys:
                hold.keys.add(key)
                self._held[key] = self._held.get(key, 0) + 1
        self.trim()
        return loaded
