"""The idempotency window (README §8): `(topic instance, key) → original result`.

An entry is *pending* from the moment a keyed write reserved its seqs until its commit
resolves; a concurrent write with the same key waits for it and then returns its result
(or, if the original failed, tries to append itself). A committed entry answers repeats
until `ts + idempotency_window_ms`. Expired entries are pruned lazily from a heap ordered
by expiry; the number of unexpired entries is bounded by `limits.max_idempotency_entries`
(a keyed write beyond it gets `429 {limit}`).

Entries are keyed by the topic's instance id, so a deleted-and-recreated topic never
dedupes against its previous life; `drop_topic` frees them at once.
"""

from __future__ import annotations

import heapq

import trio

from topicd.errors import Throttled


class IdemEntry:
    """One keyed write: pending until `resolve()`/`fail()`."""

    __slots__ = ("count", "done", "expires_ms", "failed", "first_seq", "head_seq", "ok")

    def __init__(self) -> None:
        self.first_seq = 0
        self.count = 0
        self.head_seq = 0
        self.expires_ms = 0
        self.ok = False
        self.failed = False
        self.done: trio.Event | None = None  # created only if someone waits

    @property
    def pending(self) -> bool:
        return not self.ok and not self.failed

    async def wait(self) -> None:
        if not self.pending:
            await trio.lowlevel.checkpoint()
            return
        if self.done is None:
            self.done = trio.Event()
        await self.done.wait()


class IdempotencyStore:
    def __init__(self, max_entries: int) -> None:
        self._max = max_entries
        self._entries: dict[tuple[int, str], IdemEntry] = {}
        self._by_topic: dict[int, set[str]] = {}
        self._heap: list[tuple[int, int, str]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def entries_of(self, topic_id: int) -> int:
        """How many entries topic `topic_id` holds (pending ones included)."""
        keys = self._by_topic.get(topic_id)
        return 0 if keys is None else len(keys)

    def lookup(self, topic_id: int, key: str, now_ms: int) -> IdemEntry | None:
        entry = self._entries.get((topic_id, key))
        if entry is None:
            return None
        if not entry.pending and entry.expires_ms <= now_ms:
            self._remove(topic_id, key)
            return None
        return entry

    def begin(self, topic_id: int, key: str, now_ms: int) -> IdemEntry:
        """Register a pending entry; `429 {limit}` if the store is full of live entries."""
        assert (topic_id, key) not in self._entries
        if self._max and len(self._entries) >= self._max:
            self.prune(now_ms)
            if len(self._entries) >= self._max:
                raise Throttled.limit("max_idempotency_entries", self._max)
        entry = IdemEntry()
        self._entries[(topic_id, key)] = entry
        self._by_topic.setdefault(topic_id, set()).add(key)
        return entry

    def resolve(
        self,
        topic_id: int,
        key: str,
        entry: IdemEntry,
        *,
        first_seq: int,
        count: int,
        head_seq: int,
        expires_ms: int,
        now_ms: int,
    ) -> None:
        """The keyed write committed: remember its result until `expires_ms`."""
        entry.first_seq, entry.count, entry.head_seq = first_seq, count, head_seq
        entry.ok = True
        entry.expires_ms = max(expires_ms, 1)
        if entry.done is not None:
            entry.done.set()
        if expires_ms <= now_ms:  # window 0: nothing to remember
            self._remove(topic_id, key)
        else:
            heapq.heappush(self._heap, (expires_ms, topic_id, key))

    def fail(self, topic_id: int, key: str, entry: IdemEntry) -> None:
        """The keyed write failed: forget it and release waiters (they retry)."""
        entry.failed = True
        if self._entries.get((topic_id, key)) is entry:
            self._remove(topic_id, key)
        if entry.done is not None:
            entry.done.set()

    def prune(self, now_ms: int) -> int:
        """Drop every expired entry; returns how many were dropped."""
        heap = self._heap
        dropped = 0
        while heap and heap[0][0] <= now_ms:
            _, topic_id, key = heapq.heappop(heap)
            entry = self._entries.get((topic_id, key))
            if entry is not None and not entry.pending and entry.expires_ms <= now_ms:
                self._remove(topic_id, key)
                dropped += 1
        return dropped

    def committed(self) -> list[tuple[int, str, int, int, int, int]]:
        """Every resolved entry: (topic_id, key, first_seq, count, head_seq, expires_ms)."""
        return [
            (tid, key, e.first_seq, e.count, e.head_seq, e.expires_ms)
            for (tid, key), e in self._entries.items()
            if e.ok
        ]

    def restore(
        self,
        topic_id: int,
        key: str,
        first_seq: int,
        count: int,
        head_seq: int,
        expires_ms: int,
        now_ms: int,
    ) -> None:
        """Re-create a committed entry (recovery); expired or surplus entries are skipped."""
        if expires_ms <= now_ms or (topic_id, key) in self._entries:
            return
        if self._max and len(self._entries) >= self._max:
            return
        entry = self.begin(topic_id, key, now_ms)
        self.resolve(
            topic_id,
            key,
            entry,
            first_seq=first_seq,
            count=count,
            head_seq=head_seq,
            expires_ms=expires_ms,
            now_ms=now_ms,
        )

    def drop_topic(self, topic_id: int) -> None:
        for key in self._by_topic.pop(topic_id, set()):
            entry = self._entries.pop((topic_id, key), None)
            if entry is not None:
                entry.failed = entry.failed or not entry.ok
                if entry.done is not None:
                    entry.done.set()

    def _remove(self, topic_id: int, key: str) -> None:
        self._entries.pop((topic_id, key), None)
        keys = self._by_topic.get(topic_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_topic[topic_id]
