"""The ready set of one delivery shard: banded deficit weighted round-robin with aging.

Pure logic (scheduler spec A.2-A.5, B.1-B.4); time comes in as arguments (Trio seconds),
so tests drive it without a clock.

* A dirty topic is in the ready set at most once (`item.queued`, the membership bit):
  a burst of writes is one unit of work. The bit stays set while the topic is being
  drained (in-flight guard); `done()` re-enqueues it with a fresh `enqueued_at` if more
  was published meanwhile, else clears it.
* Effective priority `P_eff = base + age_boost`, `age_boost = min(waited_ms // 10, cap)`
  (+100 per second waited, capped at +1000). `P_eff` picks one of five bands (B4 ≥ 750,
  B3 ≥ 500, B2 ≥ 250, B1 ≥ 0, B0 < 0 with the default thresholds). Inside a band topics
  are served FIFO by `enqueued_at` (a heap with lazy deletion).
* Deficit weighted round-robin: each round credits every non-empty band its weight
  (8/4/2/1/1), capped at `deficit_cap_rounds` rounds of credit; one drained topic costs
  one unit. High bands win heavily, yet B1 and B0 are served every round.
* Aging without rescans: a promotion heap holds, per queued topic, the time its `P_eff`
  will cross the next band threshold (`enqueued_at + (threshold − base) · 10 ms`); the
  50 ms aging tick pops the due entries and moves those topics up (keeping `enqueued_at`).
  `enqueued_at` is reset only when a topic is drained, so a continuously rewritten topic
  still ages.
* While `defer` is on (the governor's top rung), B0 gets no credit, and neither does a
  topic with a negative manual priority in any band.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

_T = TypeVar("_T")

N_BANDS: Final = 5


@dataclass(eq=False, slots=True)
class Slot(Generic[_T]):
    """Scheduling state of one topic (lives on the topic)."""

    topic: _T
    base: int = 0  # base priority when enqueued (manual or recency)
    manual_negative: bool = False
    queued: bool = False  # the membership bit (also set while draining)
    draining: bool = False
    enqueued_at: float = 0.0
    ripe_at: float = 0.0
    band: int = -1
    gen: int = 0  # bumped on every (re)insertion: stale heap entries are skipped


@dataclass
class BandStats:
    depth: list[int] = field(default_factory=lambda: [0] * N_BANDS)
    served: list[int] = field(default_factory=lambda: [0] * N_BANDS)


class ReadySet(Generic[_T]):
    def __init__(
        self,
        *,
        thresholds: tuple[int, ...] = (750, 500, 250, 0),
        weights: tuple[int, ...] = (8, 4, 2, 1, 1),
        aging_rate_per_s: int = 100,
        aging_cap: int = 1000,
        deficit_cap_rounds: int = 2,
    ) -> None:
        assert len(thresholds) == N_BANDS - 1
        assert len(weights) == N_BANDS
        self.thresholds = thresholds  # lower bounds of B4, B3, B2, B1
        self.weights = weights  # B4 .. B0
        self.ms_per_point = 1000 / aging_rate_per_s
        self.aging_cap = aging_cap
        self.deficit_cap_rounds = deficit_cap_rounds
        self._heaps: list[list[tuple[float, int, int, Slot[_T]]]] = [[] for _ in range(N_BANDS)]
        self._promote: list[tuple[float, int, int, Slot[_T]]] = []
        self._deficit = [0.0] * N_BANDS
        self._credited = [False] * N_BANDS
        self._tie = itertools.count()
        self.defer = False
        self.stats = BandStats()
        self._band_order = 0  # next band to visit in the current round (B4 = 0)

    # ---- priority math ------------------------------------------------------------------

    def age_boost(self, slot: Slot[_T], now: float) -> int:
        waited_ms = (now - slot.enqueued_at) * 1000
        return min(int(waited_ms // self.ms_per_point), self.aging_cap)

    def effective(self, slot: Slot[_T], now: float) -> int:
        return slot.base + self.age_boost(slot, now)

    def band_of(self, p_eff: int) -> int:
        """0 = B4 (highest) .. 4 = B0."""
        for i, bound in enumerate(self.thresholds):
            if p_eff >= bound:
                return i
        return N_BANDS - 1

    # ---- membership -------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(self.stats.depth)

    def mark(
        self,
        slot: Slot[_T],
        base: int,
        now: float,
        *,
        ripe_after: float = 0.0,
        manual_negative: bool = False,
    ) -> bool:
        """Mark a topic dirty. False if it already was (the bit suppresses duplicates)."""
        if slot.queued:
            return False
        slot.queued = True
        slot.base = base
        slot.manual_negative = manual_negative
        slot.enqueued_at = now
        slot.ripe_at = now + ripe_after
        self._insert(slot, now)
        return True

    def _insert(self, slot: Slot[_T], now: float) -> None:
        slot.gen += 1
        band = self.band_of(self.effective(slot, now))
        slot.band = band
        heapq.heappush(self._heaps[band], (slot.enqueued_at, next(self._tie), slot.gen, slot))
        self.stats.depth[band] += 1
        self._schedule_promotion(slot)

    def _schedule_promotion(self, slot: Slot[_T]) -> None:
        if slot.band == 0:
            return
        threshold = self.thresholds[slot.band - 1]  # the next band up starts here
        points = threshold - slot.base
        if points > self.aging_cap:
            return  # aging alone never gets it there
        when = slot.enqueued_at + max(points, 0) * self.ms_per_point / 1000
        heapq.heappush(self._promote, (when, next(self._tie), slot.gen, slot))

    def rebase(
        self, slot: Slot[_T], base: int, now: float, *, manual_negative: bool = False
    ) -> None:
        """A queued topic's base priority changed (config): re-band it from scratch."""
        slot.base = base
        slot.manual_negative = manual_negative
        if slot.queued and not slot.draining:
            self.stats.depth[slot.band] -= 1
            self._insert(slot, now)

    def remove(self, slot: Slot[_T]) -> None:
        """Forget a topic (deleted)."""
        if slot.queued and not slot.draining:
            self.stats.depth[slot.band] -= 1
        slot.queued = False
        slot.draining = False
        slot.gen += 1

    # ---- aging ------------------------------------------------------------------------

    def age(self, now: float) -> int:
        """Apply promotions due by `now` (the aging tick). Returns how many moved."""
        moved = 0
        heap = self._promote
        while heap and heap[0][0] <= now:
            _, _, gen, slot = heapq.heappop(heap)
            if gen != slot.gen or not slot.queued or slot.draining:
                continue
            band = self.band_of(self.effective(slot, now))
            if band < slot.band:
                self.stats.depth[slot.band] -= 1
                slot.gen += 1
                slot.band = band
                heapq.heappush(
                    self._heaps[band], (slot.enqueued_at, next(self._tie), slot.gen, slot)
                )
                self.stats.depth[band] += 1
                moved += 1
            self._schedule_promotion(slot)
        return moved

    def ripe_count(self, now: float) -> int:
        """Queued topics ready to drain now (the governor's depth signal; O(queued))."""
        n = 0
        for heap in self._heaps:
            for _, _, gen, slot in heap:
                if gen == slot.gen and slot.queued and not slot.draining and slot.ripe_at <= now:
                    n += 1
        return n

    def next_ripe_at(self) -> float | None:
        """The earliest `ripe_at` among queued topics a pick may serve, if any.

        Under defer, B0 and negative manual priorities are left out (they are not
        served, so waking for them would spin)."""
        best: float | None = None
        for band, heap in enumerate(self._heaps):
            self._drop_stale(heap)
            if not heap or not self._creditable(band):
                continue
            if self.defer:
                for _, _, gen, slot in heap:
                    if gen != slot.gen or slot.manual_negative or slot.draining:
                        continue
                    if slot.queued and (best is None or slot.ripe_at < best):
                        best = slot.ripe_at
                continue
            slot = heap[0][3]
            if best is None or slot.ripe_at < best:
                best = slot.ripe_at
        return best

    # ---- DWRR ---------------------------------------------------------------------------

    @staticmethod
    def _drop_stale(heap: list[tuple[float, int, int, Slot[_T]]]) -> None:
        while heap:
            _, _, gen, slot = heap[0]
            if gen == slot.gen and slot.queued and not slot.draining:
                return
            heapq.heappop(heap)

    def _creditable(self, band: int) -> bool:
        return not (self.defer and band == N_BANDS - 1)

    def pick(self, now: float) -> Slot[_T] | None:
        """The next topic to drain (marked draining), or None if nothing is ripe.

        The DWRR loop of scheduler spec B.2, one pick at a time: bands are visited
        B4 → B0; on arriving at a band with queued topics its deficit gains its weight
        (capped at `deficit_cap_rounds` rounds); the band is served while the deficit
        lasts and its head is ripe; an empty (or, under defer, non-creditable) band's
        deficit resets to 0. The visit position and deficits persist across calls.
        """
        for _ in range(2 * N_BANDS + 1):
            band = self._band_order
            heap = self._heaps[band]
            self._drop_stale(heap)
            if not heap or not self._creditable(band):
                self._deficit[band] = 0.0
                self._advance(band)
                continue
            if not self._credited[band]:
                self._credited[band] = True
                self._deficit[band] = min(
                    self._deficit[band] + self.weights[band],
                    self.deficit_cap_rounds * self.weights[band],
                )
            if self._deficit[band] >= 1:
                slot = self._take(band, now)
                if slot is not None:
                    self._deficit[band] -= 1
                    return slot
            self._advance(band)
        return None

    def _advance(self, band: int) -> None:
        self._credited[band] = False
        self._band_order = (band + 1) % N_BANDS

    def _take(self, band: int, now: float) -> Slot[_T] | None:
        heap = self._heaps[band]
        skipped: list[tuple[float, int, int, Slot[_T]]] = []
        found: Slot[_T] | None = None
        while heap:
            entry = heapq.heappop(heap)
            slot = entry[3]
            if entry[2] != slot.gen or not slot.queued or slot.draining:
                continue
            if slot.ripe_at > now:
                skipped.append(entry)
                break  # FIFO by enqueue: the head is not ripe, nothing behind it counts
            if self.defer and slot.manual_negative:
                skipped.append(entry)  # deferred: no credit for negative manual priority
                continue
            found = slot
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if found is not None:
            found.draining = True
            self.stats.depth[band] -= 1
            self.stats.served[band] += 1
        return found

    def done(self, slot: Slot[_T], more: bool, base: int, now: float) -> None:
        """The drain finished. `more`: records were published past what it drained."""
        slot.draining = False
        if not slot.queued:
            return  # removed while draining
        if more:
            slot.base = base
            slot.enqueued_at = now
            slot.ripe_at = now
            self._insert(slot, now)
        else:
            slot.queued = False
            slot.gen += 1
