"""Queue topics: the lease table, the claim index and the lease lifecycle.

A queue is a topic (`type:"queue"`); its jobs are the topic's records. `JobQueue` is the
per-topic projection the lease endpoints work on, synchronous and owned by the loop
thread like the topic itself. Every live record of a queue is in exactly one state:

* **claimable** — reachable from the claim index (below);
* **leased** — `leases[seq]`: holder node, fencing token, deadline;
* **delayed** — nacked with `delay_ms`, claimable again at `delayed[seq]`;
* **held** — its ack delete or dead-letter move is being committed.

so `ready = count - leased - delayed - held` needs no scan.

**Claim index** (claim order: highest priority, then lowest seq). Priorities live in the
topic's sparse `prios` map (0 when absent). Per priority level: a FIFO of never-claimed
seqs and a min-heap of seqs made claimable again (lease expired, nacked, released). The
level-0 FIFO is not stored: it is a cursor over the log, since every record without a
priority is a level-0 job and the log is already in seq order. A max-heap of the
non-empty levels picks the level in O(log L); within a level the lower of the retry
heap's top and the FIFO's head wins, which is "retried work first" whenever retried seqs
are older than fresh ones (always, except after a restart). Entries that stopped being
claimable (acked, deleted, evicted, leased again after a recovery) are skipped when they
reach the front, once each: lazy deletion, paid for by whatever removed them. Claiming k
jobs costs O(k log L + k log R) amortized, independent of the backlog.

**Deadlines** are Trio time (monotonic, `MockClock` in tests), so a wall-clock step never
expires or prolongs a lease; the wire `deadline` is the wall clock at claim plus the
lease. A lease is expired once the clock passed its deadline by a millisecond (`now >
deadline`); a nack delay ends at its time. Both are min-heaps swept in O(due log n) by
every operation on the queue and by the engine's expiry timer (`QueueService.run`),
which sleeps until the earliest deadline of all queues instead of polling.

`QueueService` runs the endpoints (claim, ack, nack, extend) against the engine: the
coalescing window, acks as record deletes through the commit path, and dead-letter moves.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Final, NamedTuple, TypeVar

import msgspec
import orjson
import trio

from topicd.clock import perf_ms
from topicd.engine.payloads import LOAD_BYTES_MAX
from topicd.engine.topic import EVICTED
from topicd.engine.watch import error_frame
from topicd.errors import NotAQueue, Throttled, TopicdError, TopicNotFound
from topicd.model import DATA_KEY, split
from topicd.storage import frame as frames
from topicd.wire import RecordIn, WriteIn

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from topicd.engine.engine import Engine
    from topicd.engine.forward import Forwarder
    from topicd.engine.payloads import Hold
    from topicd.engine.topic import Topic
    from topicd.engine.work import WorkConn

# a queue topic's name in the saturation registry is this, then the topic's name
LEVEL_PREFIX: Final = "jobs."
log = logging.getLogger("topicd.queues")

_T = TypeVar("_T")

# a lease is expired once the clock passed its deadline (ms resolution: `now > deadline`)
_PAST_S: Final = 0.001
_DL_KEYS: Final = ("$dead_letter_from", "$dead_letter_deliveries", "$dead_letter_src_seq")


def leases_durable(topic: Topic) -> bool:
    """Whether `topic`'s lease events are logged (`leases_durable`, never `ephemeral`)."""
    return topic.config.leases_durable and topic.config.durability != "ephemeral"


def lease_token(lease_id: int) -> str:
    """The wire form of a lease id: `lease_` + lowercase hex."""
    return f"lease_{lease_id:x}"


class Lease:
    """One job's current lease. `expires_at` is Trio time; `deadline_ms` wall time."""

    __slots__ = ("deadline_ms", "expires_at", "lease_id", "node", "seq")

    def __init__(
        self, seq: int, node: str, lease_id: int, expires_at: float, deadline_ms: int
    ) -> None:
        self.seq = seq
        self.node = node
        self.lease_id = lease_id
        self.expires_at = expires_at
        self.deadline_ms = deadline_ms


class _Level:
    """One priority's claimable jobs: never-claimed seqs (FIFO; unused for level 0, whose
    FIFO is the log cursor) and seqs made claimable again (min-heap)."""

    __slots__ = ("dead", "fresh", "retry")

    def __init__(self) -> None:
        self.fresh: deque[int] = deque()
        self.retry: list[int] = []
        self.dead = 0  # jobs of this priority that died since the last compaction


@dataclass(slots=True)
class Claimer:
    """One claim call's wants and what it got (a cohort serves several at once)."""

    node: str
    want: int
    lease_ms: int
    got: list[tuple[Lease, int]] = field(default_factory=list)  # (lease, deliveries)
    items: list[bytes] = field(default_factory=list)
    error: TopicdError | None = None
    # a `/work` stream's lease record (seq -> lease id), filled in the same synchronous
    # step that makes each lease, so a cancelled stream can always release what it got
    held: dict[int, int] | None = None


@dataclass(slots=True)
class _Cohort:
    """Claims arriving during one coalescing window (`claim_jitter_ms`)."""

    closes_at: float
    members: list[Claimer] = field(default_factory=list)
    served: bool = False
    done: trio.Event | None = None  # durable leases: set once the pass's leases are logged
    ready: int = 0
    dead_letter: tuple[str, int] = ("", 0)  # the pass's target and max_deliveries


# one lease event, as a `Lease` frame logs it: [kind, seq, node, lease_id, time_ms,
# deliveries]; kind is "claimed" / "extended" (time = the deadline) or "released" (time =
# the end of the nack delay, 0 for none)
LeaseEvent = tuple[str, int, str, int, int, int]


@dataclass(frozen=True, slots=True)
class QueueSnap:
    """A queue's lease state in a snapshot: (seq, node, lease_id, deadline_ms) leases,
    (seq, deliveries) counters, (seq, ready_ms) nack delays."""

    leases: list[tuple[int, str, int, int]]
    deliveries: list[tuple[int, int]]
    delays: list[tuple[int, int]]


class QueueCounts(NamedTuple):
    """A queue's counts (a tuple: made by every claim and ack answer)."""

    ready: int
    in_flight: int
    delayed: int


# a `/work` stream of another process refills through the owner at least every
# `queue.work_poll_ms`; one not heard from for this long is gone (no more notices)
REMOTE_WORK_STALE_S: Final = 30.0
OPS: Final = ("claim", "extend", "ack", "nack")  # the activity a queue records the time of


class JobQueue:
    """The lease projection and claim index of one queue topic (see module docstring)."""

    def __init__(self, topic: Topic, lease_seed: int) -> None:
        self.topic = topic
        self.levels: dict[int, _Level] = {0: _Level()}
        self._index: list[int] = []  # max-heap of non-empty priorities (negated)
        self._indexed: set[int] = set()
        self.cursor = topic.earliest_seq - 1  # level-0 seqs above it were never claimed
        self.leases: dict[int, Lease] = {}
        self.deliveries: dict[int, int] = {}
        self.delayed: dict[int, float] = {}  # seq -> Trio time it becomes claimable
        self.held: set[int] = set()
        self.retrying: set[int] = set()  # seqs sitting in some level's retry heap
        self._deadlines: list[tuple[float, int, int]] = []  # (expires_at, lease_id, seq)
        self._delays: list[tuple[float, int]] = []  # (ready_at, seq)
        self.next_lease_id = lease_seed
        self.dead_lettered = 0
        self.cohort: _Cohort | None = None
        self.closed = False
        self.timer_due: float | None = None  # the expiry timer's entry (QueueService)
        self.workers: dict[WorkConn, None] = {}  # attached `/work` streams
        # `/work` streams of other processes whose refills this queue's owner serves:
        # stream id -> Trio time of its last refill (`QueueService._serve_work`), and
        # what tells those processes this queue changed (set by the forwarding seam)
        self.remote_work: dict[str, float] = {}
        self.on_remote: Callable[[], None] | None = None
        self._changed: trio.Event | None = None  # set (and dropped) by `changed()`
        self.last_ms: dict[str, int] = dict.fromkeys(OPS, 0)  # wall time of the last op
        self.attached_ms = 0  # wall time this instance got its lease table (start or create)
        self._ack_rate = 0.0  # acks per second, decayed to `_ack_rate_at` (EWMA)
        self._ack_rate_at = 0.0
        # durable leases, during recovery: the projection of the replayed lease events
        # (seq -> holder, lease id, deadline ms; seq -> nack delay end ms), and whether
        # the recovered leases still wait for `resume` to set their Trio times
        self.logged: dict[int, tuple[str, int, int]] = {}
        self.logged_delays: dict[int, int] = {}
        self.unresumed = False
        self._index_add(0)
        self.live_by_prio: dict[int, int] = {}  # live jobs per priority (with 0s removed)
        self._count_prios()

    def _count_prios(self) -> None:
        """`live_by_prio` from the topic (the priorities map holds live records only)."""
        topic = self.topic
        counts: dict[int, int] = {}
        for prio in topic.prios.values():
            counts[prio] = counts.get(prio, 0) + 1
        if topic.count > len(topic.prios):
            counts[0] = topic.count - len(topic.prios)
        self.live_by_prio = counts

    def _live_delta(self, prio: int, n: int) -> None:
        left = self.live_by_prio.get(prio, 0) + n
        if left > 0:
            self.live_by_prio[prio] = left
        else:
            self.live_by_prio.pop(prio, None)

    def ready_by_priority(self, top: int) -> list[tuple[int, int]]:
        """(priority, claimable jobs) of the `top` highest priorities that hold live jobs.
        O(levels + jobs in flight, delayed or held), never O(queued jobs)."""
        levels = sorted(self.live_by_prio, reverse=True)[:top]
        if not levels:
            return []
        ready = {p: self.live_by_prio[p] for p in levels}
        prios = self.topic.prios
        for seqs in (self.leases, self.delayed, self.held):
            for seq in seqs:
                p = prios.get(seq, 0)
                if p in ready:
                    ready[p] -= 1
        return [(p, ready[p]) for p in levels]

    # ---- change notification ------------------------------------------------------------

    def changed(self) -> None:
        """Something that can free `/work` depth or make jobs claimable happened (an
        append, ack, nack, release, expiry, delete): kick every attached `/work` stream
        (a coalescing signal) and wake whoever waits for a change."""
        for conn in self.workers:
            conn.kick()
        if self.remote_work and self.on_remote is not None:
            self.on_remote()
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        ev = self._changed
        if ev is not None:
            self._changed = None
            ev.set()

    async def wait_changed(self) -> None:
        """Wait for the next `changed()` or claim (anything that moves the depth)."""
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()

    def depth(self) -> int:
        """Jobs waiting: ready plus delayed (not in flight, not being acked)."""
        return self.topic.count - len(self.leases) - len(self.held)

    def note_acks(self, n: int, now: float, window_s: float) -> None:
        """Count `n` acks at Trio time `now` into the ack-rate EWMA (time constant
        `window_s`): each ack adds `1/window_s` per second, decaying with `e^(-t/window)`."""
        self._ack_rate = self.ack_rate(now, window_s) + n / window_s
        self._ack_rate_at = now

    def ack_rate(self, now: float, window_s: float) -> float:
        """The measured ack rate (per second) at `now`."""
        age = max(now - self._ack_rate_at, 0.0)
        return self._ack_rate * math.exp(-age / window_s)

    # ---- the claim index ----------------------------------------------------------------

    def _index_add(self, prio: int) -> None:
        if prio not in self._indexed:
            self._indexed.add(prio)
            heapq.heappush(self._index, -prio)
            if prio not in self.levels:
                self.levels[prio] = _Level()

    def published(self, first_seq: int, n: int, prios: dict[int, int]) -> None:
        """New jobs `first_seq ..` (prios keyed by batch index, non-zero only)."""
        if prios:
            for i, prio in prios.items():
                self._index_add(prio)
                self.levels[prio].fresh.append(first_seq + i)
                self._live_delta(prio, 1)
            if len(prios) < n:
                self._index_add(0)
                self._live_delta(0, n - len(prios))
        else:
            self._index_add(0)
            self._live_delta(0, n)
        self.changed()

    def dropped(self, seq: int, prio: int, notify: bool = True) -> None:
        """The record `seq` (priority `prio`) is gone (acked, deleted, evicted, expired).
        Then `changed()`, unless not `notify`: a caller dropping many calls it once."""
        # only a job that was claimable can leave an entry behind in its level: a leased,
        # delayed or held one was taken out of the level already (counting those too made
        # a busy level compact every 64 acks, at a cost of the level's size)
        live = self.live_by_prio  # (`_live_delta(prio, -1)`, inlined: once per job)
        left = live.get(prio, 0) - 1
        if left > 0:
            live[prio] = left
        else:
            live.pop(prio, None)
        self.deliveries.pop(seq, None)
        held = self.held
        if seq in held:
            # an ack's or a dead-letter move's delete (the usual case): a held job is in
            # no other state (not leased, delayed, retrying or in its level)
            held.discard(seq)
        elif self.leases.pop(seq, None) is None:
            claimable = self.delayed.pop(seq, None) is None
            self.retrying.discard(seq)
            level = self.levels.get(prio)
            if level is not None and claimable:
                level.dead += 1
                if level.dead > 64 and 2 * level.dead > len(level.fresh) + len(level.retry):
                    self._compact(level)
        if notify:
            self.changed()

    def dropped_plain(self, seqs: list[int]) -> None:
        """`dropped(seq, 0, notify=False)` for each of `seqs` (a delete of jobs without
        a priority: `Topic.delete_seqs`), the held ones (acked) first in one pass."""
        deliveries, held = self.deliveries, self.held
        rest: list[int] = []
        for seq in seqs:
            deliveries.pop(seq, None)
            if seq in held:
                held.discard(seq)  # (see `dropped`: in no other state)
            else:
                rest.append(seq)
        live = self.live_by_prio
        left = live.get(0, 0) - (len(seqs) - len(rest))
        if left > 0:
            live[0] = left
        else:
            live.pop(0, None)
        for seq in rest:
            self.dropped(seq, 0, notify=False)

    def _compact(self, level: _Level) -> None:
        """Drop a level's entries of dead jobs (a starved level is never reached, so lazy
        deletion alone would keep them): O(entries), paid for by the deaths counted."""
        enc = self.topic.enc
        level.fresh = deque(s for s in level.fresh if enc(s) is not None)
        level.retry = [s for s in level.retry if s in self.retrying]
        heapq.heapify(level.retry)
        level.dead = 0

    def _unclaimable(self, seq: int) -> bool:
        return seq in self.leases or seq in self.delayed or seq in self.held

    def _peek_fresh(self, prio: int, level: _Level) -> int | None:
        topic = self.topic
        if prio != 0:
            fresh = level.fresh
            while fresh:
                seq = fresh[0]
                if topic.enc(seq) is not None and not (
                    self._unclaimable(seq) or seq in self.retrying
                ):
                    return seq
                fresh.popleft()
            return None
        prios = topic.prios
        slot = topic.next_slot(self.cursor + 1)
        while slot is not None:
            if (
                topic.enc(slot) is not None
                and slot not in prios
                and not (self._unclaimable(slot) or slot in self.retrying)
            ):
                self.cursor = slot - 1
                return slot
            slot = topic.next_slot(slot + 1)
        self.cursor = max(self.cursor, topic.head_seq)
        return None

    def _peek_retry(self, level: _Level) -> int | None:
        heap = level.retry
        while heap:
            seq = heap[0]
            if seq in self.retrying:
                return seq
            heapq.heappop(heap)  # stale: the job died or was claimed another way
        return None

    def _requeue(self, seq: int) -> None:
        """Make a live job claimable again at its own priority."""
        topic = self.topic
        if topic.enc(seq) is None or seq in self.retrying:
            return
        prio = topic.prios.get(seq, 0)
        self._index_add(prio)
        heapq.heappush(self.levels[prio].retry, seq)
        self.retrying.add(seq)

    # ---- time ---------------------------------------------------------------------------

    def sweep(self, now: float) -> int:
        """Expire leases and end nack delays due at Trio time `now`. Returns how many
        jobs became claimable."""
        n = 0
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            expires_at, lease_id, seq = heapq.heappop(heap)
            lease = self.leases.get(seq)
            if lease is None or lease.lease_id != lease_id or lease.expires_at != expires_at:
                continue  # acked, nacked, extended or re-leased since
            del self.leases[seq]
            if not self._back_off(seq, expires_at):
                self._requeue(seq)
            n += 1
        delays = self._delays
        while delays and delays[0][0] <= now:
            ready_at, seq = heapq.heappop(delays)
            if self.delayed.get(seq) != ready_at:
                continue
            del self.delayed[seq]
            self._requeue(seq)
            n += 1
        if n:
            self.changed()
        return n

    def _delay(self, seq: int, ready_at: float) -> None:
        """Keep a job out of the claim index until Trio time `ready_at`."""
        self.delayed[seq] = ready_at
        heapq.heappush(self._delays, (ready_at, seq))
        if len(self._delays) > 2 * len(self.delayed) + 64:
            self._delays = [(t, s) for s, t in self.delayed.items()]
            heapq.heapify(self._delays)

    def _back_off(self, seq: int, since: float) -> bool:
        """The retry backoff of a failed delivery (lease expired, or nacked without
        `delay_ms`): with the topic's `retry_backoff_ms > 0`, the job waits
        `min(retry_backoff_ms * deliveries^2, retry_backoff_max_ms)` from `since`.
        Returns False when there is no backoff (the caller requeues at once)."""
        cfg = self.topic.config
        if cfg.retry_backoff_ms <= 0:
            return False
        n = self.deliveries.get(seq, 0)
        wait_ms = min(cfg.retry_backoff_ms * n * n, cfg.retry_backoff_max_ms)
        if wait_ms <= 0:
            return False
        self._delay(seq, since + wait_ms / 1000)
        return True

    def next_due(self) -> float | None:
        """The Trio time of the earliest lease expiry or delay end (None: nothing)."""
        due = self._deadlines[0][0] if self._deadlines else None
        if self._delays and (due is None or self._delays[0][0] < due):
            due = self._delays[0][0]
        return due

    def _push_deadline(self, lease: Lease) -> None:
        heapq.heappush(self._deadlines, (lease.expires_at, lease.lease_id, lease.seq))
        self._compact_deadlines()

    def _compact_deadlines(self) -> None:
        if len(self._deadlines) > 2 * len(self.leases) + 64:
            # extends leave superseded entries behind: drop them (amortized O(1) each)
            self._deadlines = [(ls.expires_at, ls.lease_id, ls.seq) for ls in self.leases.values()]
            heapq.heapify(self._deadlines)

    # ---- the lease lifecycle ------------------------------------------------------------

    def ready(self) -> int:
        """Claimable jobs as of the last sweep (`counts().ready`)."""
        return self.topic.count - len(self.leases) - len(self.delayed) - len(self.held)

    def counts(self) -> QueueCounts:
        """Counts as of the last sweep (sweep first for values at `now`)."""
        leased = len(self.leases)
        delayed = len(self.delayed)
        ready = self.topic.count - leased - delayed - len(self.held)
        return QueueCounts(ready, leased, delayed)

    def claim(
        self,
        members: list[Claimer],
        now: float,
        now_ms: int,
        max_deliveries: int,
        dead_letter: bool,
        *,
        staged: bool = False,
    ) -> list[int]:
        """One claim pass (sweep first): hand out jobs in claim order, round-robin over
        the members that still want more. Jobs over `max_deliveries` (when `dead_letter`)
        are diverted instead: held, and returned for the caller to move.

        `staged` (durable leases): the leases are made but not installed: their jobs are
        held, and counters untouched, until `install` runs once their `Lease` frame is
        committed (or `unstage` after it failed).

        The jobs of the whole pass are taken from the claim index in one step
        (`_take_many`), then dealt out: the same jobs, to the same members, as taking
        them one at a time in turn would give."""
        diverted: list[int] = []
        # (a claim lowers the depth: depth-level waiters look again; `/work` streams
        # are not kicked, since a claim frees none of their depth)
        self._wake_waiters()
        total = sum(max(m.want - len(m.got), 0) for m in members)
        if total <= 0:
            return diverted
        seqs = self._take_many(total)
        if dead_letter and max_deliveries and seqs:
            # a job past `max_deliveries` is diverted, and the next one taken in its place
            deliveries = self.deliveries
            kept: list[int] = []
            batch, asked = seqs, total
            while True:
                for seq in batch:
                    if deliveries.get(seq, 0) < max_deliveries:
                        kept.append(seq)
                    else:
                        self.held.add(seq)
                        diverted.append(seq)
                asked, short = total - len(kept), len(batch) < asked
                if short or not asked:
                    break  # (a short take emptied the index)
                batch = self._take_many(asked)
            seqs = kept
        if len(members) == 1:
            self._lease_all(members[0], seqs, now, now_ms, staged)
            return diverted
        # round-robin over the members that still want more, one job each per round
        wanting = [m for m in members if len(m.got) < m.want]
        k = 0
        while wanting:
            still: list[Claimer] = []
            for m in wanting:
                if k == len(seqs):
                    return diverted
                self._lease_all(m, seqs[k : k + 1], now, now_ms, staged)
                k += 1
                if len(m.got) < m.want:
                    still.append(m)
            wanting = still
        return diverted

    def _lease_all(
        self, m: Claimer, seqs: list[int], now: float, now_ms: int, staged: bool
    ) -> None:
        """Lease `seqs` (taken from the claim index, in claim order) to `m`."""
        node = m.node
        expires_at = now + m.lease_ms / 1000 + _PAST_S
        deadline_ms = now_ms + m.lease_ms
        lease_id = self.next_lease_id
        self.next_lease_id = lease_id + len(seqs)
        deliveries = self.deliveries
        got = m.got
        mine = m.held
        if staged:
            held = self.held
            for seq in seqs:
                lease = Lease(seq, node, lease_id, expires_at, deadline_ms)
                lease_id += 1
                held.add(seq)
                got.append((lease, deliveries.get(seq, 0) + 1))
                if mine is not None:
                    mine[seq] = lease.lease_id
            return
        leases = self.leases
        heap = self._deadlines
        push = heapq.heappush
        for seq in seqs:
            n = deliveries.get(seq, 0) + 1
            deliveries[seq] = n
            lease = leases[seq] = Lease(seq, node, lease_id, expires_at, deadline_ms)
            push(heap, (expires_at, lease_id, seq))
            lease_id += 1
            got.append((lease, n))
            if mine is not None:
                mine[seq] = lease.lease_id
        self._compact_deadlines()

    def _take_many(self, k: int) -> list[int]:
        """Remove and return up to `k` claimable seqs in claim order (fewer: the index
        ran dry). A level without retried jobs gives its fresh ones in one sweep."""
        out: list[int] = []
        index = self._index
        while index and len(out) < k:
            prio = -index[0]
            level = self.levels[prio]
            retry = self._peek_retry(level)
            if retry is None:
                need = k - len(out)
                if self._take_fresh(prio, level, need, out) == need:
                    break
                # neither retried nor fresh jobs left: the level leaves the index
                heapq.heappop(index)
                self._indexed.discard(prio)
                if prio != 0:
                    del self.levels[prio]
                continue
            fresh = self._peek_fresh(prio, level)
            if fresh is None or retry < fresh:
                heapq.heappop(level.retry)
                self.retrying.discard(retry)
                out.append(retry)
                continue
            if prio == 0:
                self.cursor = fresh
            else:
                level.fresh.popleft()
            out.append(fresh)
        return out

    def _take_fresh(self, prio: int, level: _Level, need: int, out: list[int]) -> int:
        """Take up to `need` never-claimed jobs of level `prio` (appended to `out`), in
        seq order. Returns how many (fewer: the level has no fresh jobs left)."""
        topic = self.topic
        leases, delayed, held, retrying = self.leases, self.delayed, self.held, self.retrying
        taken = 0
        if prio != 0:
            fresh = level.fresh
            enc = topic.enc
            while fresh and taken < need:
                seq = fresh.popleft()
                if enc(seq) is not None and not (
                    seq in leases or seq in delayed or seq in held or seq in retrying
                ):
                    out.append(seq)
                    taken += 1
            return taken
        # level 0: a sweep of the log above the cursor, a run at a time
        prios = topic.prios
        head = topic.head_seq
        slot = topic.next_slot(self.cursor + 1)
        while slot is not None and slot <= head:
            run = topic.run_at(slot)
            if run is None:  # (an empty run above the head)
                slot = topic.next_slot(slot + 1)
                continue
            encs, base = run.encs, run.base
            end = min(base + len(encs) - 1, head)
            slot = max(slot, base)
            while slot <= end:
                if encs[slot - base] is not None and not (
                    slot in prios
                    or slot in leases
                    or slot in delayed
                    or slot in held
                    or slot in retrying
                ):
                    out.append(slot)
                    taken += 1
                    if taken == need:
                        self.cursor = slot
                        return taken
                slot += 1
            slot = topic.next_slot(end + 1)
        self.cursor = max(self.cursor, head)
        return taken

    def install(self, got: list[tuple[Lease, int]]) -> list[tuple[Lease, int]]:
        """The `Lease` frame of a staged claim is committed: its leases take effect (in
        the commit's publish step, so a snapshot never sees the frame without them).
        Returns the ones installed: a job deleted meanwhile is passed over."""
        out: list[tuple[Lease, int]] = []
        for lease, n in got:
            seq = lease.seq
            if seq not in self.held or self.topic.enc(seq) is None:
                continue
            self.held.discard(seq)
            self.leases[seq] = lease
            self.deliveries[seq] = n
            self._push_deadline(lease)
            out.append((lease, n))
        return out

    def unstage(self, got: list[tuple[Lease, int]]) -> None:
        """The `Lease` frame of a staged claim failed: its jobs are claimable again, in
        their claim order, with their counters as before."""
        self.release_held([lease.seq for lease, _ in got])

    def _held_by(self, seq: int, node: str, fence: str) -> Lease | None:
        lease = self.leases.get(seq)
        if lease is None or lease.node != node:
            return None
        if fence and fence != f"lease_{lease.lease_id:x}":  # (`lease_token`, inlined)
            return None
        return lease

    def hold_for_ack(
        self, node: str, seqs: list[int], fences: list[str]
    ) -> tuple[list[int], list[int]]:
        """Ack step one (sweep first): every seq leased to `node` (fence matching) leaves
        its lease and is held until its delete commits. Returns (held, skipped); a
        repeated seq is skipped (its lease is gone by then)."""
        leases, held_set = self.leases, self.held
        held: list[int] = []
        skipped: list[int] = []
        # (the fences are aligned with `seqs` when given: the body check made sure)
        for seq, fence in zip(seqs, fences, strict=True) if fences else zip(seqs, repeat("")):
            lease = leases.get(seq)
            if (
                lease is None
                or lease.node != node
                # (`lease_token`, inlined: this runs for every acked job)
                or (fence and fence != f"lease_{lease.lease_id:x}")
            ):
                skipped.append(seq)
                continue
            del leases[seq]
            held_set.add(seq)
            held.append(seq)
        if held:
            self.changed()
        return held, skipped

    def _holding(
        self, node: str, seqs: list[int], fences: list[str], *, releasing: bool = True
    ) -> tuple[list[Lease], list[int]]:
        """The live leases `node` holds on `seqs` (fence matching), and the seqs it does
        not hold (expired, re-leased, acked, unknown): (held leases, skipped seqs). When
        `releasing` (ack, nack) a repeated seq is skipped: its lease is gone by then."""
        held: list[Lease] = []
        skipped: list[int] = []
        taken: set[int] = set()
        for i, seq in enumerate(seqs):
            lease = self._held_by(seq, node, fences[i] if fences else "")
            if lease is None or (releasing and seq in taken):
                skipped.append(seq)
            else:
                taken.add(seq)
                held.append(lease)
        return held, skipped

    def release_held(self, seqs: Iterable[int]) -> None:
        """A delete (ack or dead-letter move) failed: the jobs are claimable again."""
        for seq in seqs:
            if seq in self.held:
                self.held.discard(seq)
                self._requeue(seq)
        self.changed()

    def release_stream(self, held: dict[int, int]) -> int:
        """A `/work` stream ended: its leases still current (`seq -> lease id`) end now
        and the jobs are claimable at once (no backoff: not a failed delivery; the
        delivery counters are kept). Returns how many were released."""
        n = 0
        for seq, lease_id in held.items():
            lease = self.leases.get(seq)
            if lease is not None and lease.lease_id == lease_id:
                del self.leases[seq]
                self._requeue(seq)
                n += 1
        held.clear()
        if n:
            self.changed()
        return n

    def nack(
        self, node: str, seqs: list[int], fences: list[str], delay_ms: int, now: float
    ) -> tuple[int, list[int]]:
        """Release leases held by `node` (sweep first), now or after `delay_ms`.
        Delivery counters are kept; without `delay_ms` the retry backoff applies.
        Returns (released, skipped)."""
        leases, skipped = self._holding(node, seqs, fences)
        self.release(leases, delay_ms, now)
        return len(leases), skipped

    def release(self, leases: list[Lease], delay_ms: int, now: float) -> int:
        """Drop `leases` that are still current (a logged nack applies at its commit);
        their jobs are claimable now, or at `now + delay_ms`. Returns how many."""
        n = 0
        for lease in leases:
            seq = lease.seq
            if self.leases.get(seq) is not lease:
                continue  # expired, acked or re-leased while the nack was logged
            n += 1
            del self.leases[seq]
            if delay_ms:
                self._delay(seq, now + delay_ms / 1000)
            elif not self._back_off(seq, now):
                self._requeue(seq)
        if n:
            self.changed()
        return n

    def extend(
        self,
        node: str,
        seqs: list[int],
        fences: list[str],
        lease_ms: int,
        now: float,
        now_ms: int,
    ) -> tuple[dict[int, int], list[int]]:
        """Move the deadline of unexpired leases held by `node` to now + `lease_ms`
        (sweep first). Returns ({seq: new deadline_ms}, skipped)."""
        leases, skipped = self._holding(node, seqs, fences, releasing=False)
        return self.set_deadlines(leases, lease_ms, now, now_ms), skipped

    def set_deadlines(
        self, leases: list[Lease], lease_ms: int, now: float, now_ms: int
    ) -> dict[int, int]:
        """Deadline = `now` + `lease_ms` for `leases` that are still current (a logged
        extend applies at its commit). Returns {seq: new deadline_ms}."""
        deadlines: dict[int, int] = {}
        for lease in leases:
            if self.leases.get(lease.seq) is not lease:
                continue  # expired, acked or re-leased while the extend was logged
            lease.expires_at = now + lease_ms / 1000 + _PAST_S
            lease.deadline_ms = now_ms + lease_ms
            self._push_deadline(lease)
            deadlines[lease.seq] = lease.deadline_ms
        return deadlines

    # ---- whole-queue changes ------------------------------------------------------------

    def rebuild(self, lease_seed: int, durable: bool) -> None:
        """After recovery: every live job is claimable, in claim order, except (with
        `durable` leases) the ones the replayed lease events leave leased or in a nack
        delay; their times are set by `resume` once the loop runs. Without durable
        leases nothing about leases survives: counters start at 0 again."""
        topic = self.topic
        self.levels = {0: _Level()}
        self._index = []
        self._indexed = set()
        self.cursor = topic.earliest_seq - 1
        self.leases.clear()
        self.delayed.clear()
        self.held.clear()
        self.retrying.clear()
        self._deadlines = []
        self._delays = []
        self.next_lease_id = max(self.next_lease_id, lease_seed)
        live = topic.enc
        if durable:
            self.deliveries = {s: n for s, n in self.deliveries.items() if live(s) is not None}
            for seq, (node, lease_id, deadline_ms) in self.logged.items():
                if live(seq) is not None:
                    self.leases[seq] = Lease(seq, node, lease_id, 0.0, deadline_ms)
                    self.next_lease_id = max(self.next_lease_id, lease_id + 1)
            self.logged_delays = {
                s: t for s, t in self.logged_delays.items() if live(s) is not None
            }
            for seq in self.logged_delays:
                self.delayed[seq] = 0.0  # until `resume`: not claimable
            self.unresumed = True
        else:
            self.deliveries.clear()
            self.logged_delays = {}
        self.logged = {}
        self._index_add(0)
        self._count_prios()
        for seq, prio in sorted(topic.prios.items()):
            if live(seq) is not None:
                self._index_add(prio)
                self.levels[prio].fresh.append(seq)

    def resume(self, now: float, now_ms: int) -> None:
        """On the loop after recovery: recovered leases expire at their wall-clock
        deadline, recovered nack delays end at theirs (either may be past already)."""
        if not self.unresumed:
            return
        self.unresumed = False
        for lease in self.leases.values():
            lease.expires_at = now + (lease.deadline_ms - now_ms) / 1000 + _PAST_S
            heapq.heappush(self._deadlines, (lease.expires_at, lease.lease_id, lease.seq))
        for seq, ready_ms in self.logged_delays.items():
            ready_at = now + max(ready_ms - now_ms, 0) / 1000
            self.delayed[seq] = ready_at
            heapq.heappush(self._delays, (ready_at, seq))
        self.logged_delays = {}

    # ---- durable leases: the log's view ----------------------------------------------

    def replay(self, events: list[LeaseEvent]) -> None:
        """Apply a replayed `Lease` frame (recovery) to the logged projection: the last
        claim of a job sets its holder, deadline and counter; an extend or release
        applies only to the lease it names (the fence), as it did live."""
        logged = self.logged
        for kind, seq, node, lease_id, time_ms, n in events:
            if kind == "claimed":
                logged[seq] = (node, lease_id, time_ms)
                self.deliveries[seq] = n
                self.logged_delays.pop(seq, None)
                continue
            current = logged.get(seq)
            if current is None or current[1] != lease_id:
                continue
            if kind == "extended":
                logged[seq] = (node, lease_id, time_ms)
            elif kind == "released":
                del logged[seq]
                if time_ms:
                    self.logged_delays[seq] = time_ms
            else:
                raise ValueError(f"unknown lease event {kind!r}")

    def export(self, now: float, now_ms: int) -> QueueSnap:
        """The lease state a snapshot carries for a queue with durable leases: leases,
        delivery counters and nack delays (as wall-clock times)."""
        leases = [(ls.seq, ls.node, ls.lease_id, ls.deadline_ms) for ls in self.leases.values()]
        if self.unresumed:
            delays = list(self.logged_delays.items())
        else:
            delays = [(s, now_ms + round((t - now) * 1000)) for s, t in self.delayed.items()]
        return QueueSnap(sorted(leases), sorted(self.deliveries.items()), sorted(delays))

    def restore(self, snap: QueueSnap) -> None:
        """Recovery: start the logged projection from a snapshot's lease state."""
        self.logged = {seq: (node, lid, dl) for seq, node, lid, dl in snap.leases}
        self.deliveries = dict(snap.deliveries)
        self.logged_delays = dict(snap.delays)

    def close(self) -> None:
        """The topic was deleted: its leases go with it."""
        self.closed = True
        self.logged = {}
        self.logged_delays = {}
        self.leases.clear()
        self.delayed.clear()
        self.held.clear()
        self.retrying.clear()
        self.deliveries.clear()
        self.levels = {0: _Level()}
        self._index = []
        self._indexed = set()
        self._deadlines = []
        self._delays = []
        self.changed()


# ---- the claim item ---------------------------------------------------------------------


def _build_items(topic: Topic, members: list[Claimer]) -> bool:
    """Every member's claim items; False (and none built) if a claimed job's payload is
    only in its segment, to be loaded first."""
    built: list[list[bytes]] = []
    for m in members:
        items = claim_items(topic, m.got)
        if items is None:
            return False
        built.append(items)
    for m, items in zip(members, built, strict=True):
        m.items = items
    return True


def claim_items(topic: Topic, got: list[tuple[Lease, int]]) -> list[bytes] | None:
    """The `claimed[]` elements of `got` (lease, deliveries), or None if a job's
    payload is only in its segment (`EVICTED`). A job with neither `$tag`, `$priority`,
    `$node` nor `meta` (a record without a shape) is one format of its stored text's
    tail; the rest go through `claim_item`."""
    items: list[bytes] = []
    shapes, tags, prios = topic.shapes, topic.tags, topic.prios
    run = None
    base = end = 0
    for lease, n in got:
        seq = lease.seq
        if (shapes and seq in shapes) or (tags and seq in tags) or (prios and seq in prios):
            item = claim_item(topic, lease, n)
            if item is None:
                return None
            items.append(item)
            continue
        if run is None or seq < base or seq > end:  # (claimed jobs share a run)
            run = topic.run_at(seq)
            assert run is not None  # a claimed job is live until its lease ends
            base, end = run.base, run.end
        enc, ts = run.encs[seq - base], run.ts[seq - base]
        if not isinstance(enc, bytes):
            assert enc is EVICTED  # a claimed job is live until its lease ends
            return None
        # the stored text is `{"$seq":..,"$ts":..,"data":..}`: the item ends with its tail
        items.append(
            b'{"$seq":%d,"lease_id":"lease_%x","deadline":%d,"$ts":%d,"deliveries":%d%b'
            % (seq, lease.lease_id, lease.deadline_ms, ts, n, enc[enc.index(DATA_KEY, 8) :])
        )
    return items


def claim_item(topic: Topic, lease: Lease, deliveries: int) -> bytes | None:
    """One `claimed[]` element: `$seq`, `lease_id`, `deadline`, `$ts`, `$tag` (if set),
    `$priority` (if not 0), `deliveries`, `data`, `meta` (if set). None if the job's
    payload is only in its segment (`EVICTED`)."""
    seq = lease.seq
    enc, ts = topic.enc_ts(seq)
    if not isinstance(enc, bytes):
        assert enc is EVICTED  # a claimed job is live until its lease ends
        return None
    data, meta = split(enc, topic.shapes.get(seq) if topic.shapes else None)
    item = b'{"$seq":%d,"lease_id":"lease_%x","deadline":%d,"$ts":%d' % (
        seq,
        lease.lease_id,  # `lease_token`, inlined: this runs for every claimed job
        lease.deadline_ms,
        ts,
    )
    if topic.tags:
        tag = topic.tags.get(seq)
        if tag is not None:
            item += b',"$tag":' + orjson.dumps(tag)
    prio = topic.prios.get(seq) if topic.prios else 0
    if prio:
        item += b',"$priority":%d' % prio
    if meta is None:
        return b'%b,"deliveries":%d,"data":%b}' % (item, deliveries, data)
    return b'%b,"deliveries":%d,"data":%b,"meta":%b}' % (item, deliveries, data, meta)


def dead_letter_meta(meta: bytes | None, source: str, deliveries: int, seq: int) -> bytes:
    """The copy's `meta`: the job's object plus the three `$dead_letter_*` string keys
    (a non-object or absent `meta` becomes a new object). The job's own text is kept
    byte for byte unless it already carries those keys (a re-driven dead letter)."""
    keys = b'"$dead_letter_from":%b,"$dead_letter_deliveries":"%d","$dead_letter_src_seq":"%d"' % (
        orjson.dumps(source),
        deliveries,
        seq,
    )
    if meta is None or meta[:1] != b"{":
        return b"{" + keys + b"}"
    if b'"$dead_letter_' in meta:
        try:
            obj = orjson.loads(meta)
        except orjson.JSONDecodeError:
            obj = None  # a literal orjson cannot read: keep the text as written
        if isinstance(obj, dict):
            for key in _DL_KEYS:
                obj.pop(key, None)
            meta = orjson.dumps(obj)
    if meta.strip() == b"{}":
        return b"{" + keys + b"}"
    return meta[:-1] + b"," + keys + b"}"


# ---- the endpoints ------------------------------------------------------------------------


@dataclass(slots=True)
class ClaimResult:
    topic: Topic
    items: list[bytes]
    ready: int


@dataclass(slots=True)
class SeqsResult:
    """Ack, nack and extend: how many were handled, which were skipped, counts after."""

    topic: Topic
    done: int
    skipped: list[int]
    counts: QueueCounts
    deadlines: dict[int, int] = field(default_factory=dict)
    fsync_ms: float = 0.0


class QueueService:
    """The queue endpoints and the expiry timer, on top of the engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg.queue
        self._timers: list[tuple[float, int, JobQueue]] = []
        self._timer_n = 0
        self._timer_wake = trio.Event()
        self.work: dict[WorkConn, None] = {}  # every open `/work` stream
        self.topics: dict[str, Topic] = {}  # live queue topics by name (metrics, dashboard)
        self.shutting_down = False

    # ---- lifecycle of queue topics --------------------------------------------------

    def attach(self, topic: Topic) -> None:
        """Give a new queue topic instance its lease table."""
        if topic.config.type == "queue" and topic.queue is None:
            topic.queue = JobQueue(topic, self._lease_seed())
            topic.queue.attached_ms = self.engine.clock.now_ms()
            self.topics[topic.name] = topic
        self.levels_changed(topic)

    def forget(self, topic: Topic) -> None:
        """A queue topic was deleted (a newer instance of the name stays)."""
        if self.topics.get(topic.name) is topic:
            del self.topics[topic.name]

    @staticmethod
    def level_name(topic: Topic) -> str:
        """The queue's name in the saturation registry (`topicd_queue_*{queue}`)."""
        return LEVEL_PREFIX + topic.name

    def levels_changed(self, topic: Topic) -> None:
        """Register a queue with `depth_soft_limit > 0` in the saturation registry
        (scheduler spec R5), or take it out (limit 0, or the topic was deleted)."""
        reg = self.engine.saturation
        name = self.level_name(topic)
        q = topic.queue
        if q is None or topic.deleted or topic.config.depth_soft_limit <= 0:
            entry = reg.queues.get(name)
            if entry is not None and entry.owner is not None and entry.owner is q:
                reg.unregister(name)
            return
        entry = reg.queues.get(name)
        if entry is not None and entry.owner is q:
            return

        def depth(q: JobQueue = q) -> int:
            return q.depth() + q.topic.pending_records

        def capacity(q: JobQueue = q) -> int:
            return q.topic.config.depth_soft_limit

        reg.register(name, depth, capacity, owner=q)

    def _lease_seed(self) -> int:
        # lease ids of a new table start above any a previous process could have handed
        # out (fewer than 2**20 per millisecond), so a fence from before a restart never
        # matches a lease made after it
        return self.engine.clock.now_ms() << 20

    def recovered(self, topic: Topic) -> None:
        if topic.queue is not None:
            topic.queue.rebuild(self._lease_seed(), leases_durable(topic))

    def resume(self) -> None:
        """On the loop, before anything is served after recovery: recovered leases and
        nack delays get their Trio times, and the expiry timer learns of them."""
        now, now_ms = trio.current_time(), self.engine.clock.now_ms()
        for topic in self.engine.by_id.values():
            q = topic.queue
            if q is not None and q.unresumed:
                q.resume(now, now_ms)
                self._schedule(q)

    # ---- the expiry timer ---------------------------------------------------------------

    def _schedule(self, q: JobQueue) -> None:
        """Make sure the timer wakes for `q`'s earliest due time."""
        due = q.next_due()
        if due is None or (q.timer_due is not None and due >= q.timer_due):
            return
        q.timer_due = due
        self._timer_n += 1
        heapq.heappush(self._timers, (due, self._timer_n, q))
        if self._timers[0][2] is q:
            self._timer_wake.set()
        if len(self._timers) > 1024 and len(self._timers) > 4 * len(self.engine.by_id):
            self._timers = [t for t in self._timers if t[0] == t[2].timer_due and not t[2].closed]
            heapq.heapify(self._timers)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Expire leases and end nack delays when they fall due (no polling: sleeps
        until the earliest due time of all queues, or until an earlier one appears)."""
        self.resume()
        task_status.started()
        while True:
            if self._timers:
                with trio.move_on_at(self._timers[0][0]):
                    await self._timer_wake.wait()
            else:
                await self._timer_wake.wait()
            self._timer_wake = trio.Event()
            now = trio.current_time()
            # `_schedule` may replace the list (compaction): always use the attribute
            while self._timers and self._timers[0][0] <= now:
                due, _, q = heapq.heappop(self._timers)
                if q.closed or due != q.timer_due:
                    continue  # superseded by an earlier entry, or the topic is gone
                q.timer_due = None
                self.engine.enforce(q.topic)
                q.sweep(now)
                self._schedule(q)

    # ---- helpers ------------------------------------------------------------------------

    def _queue_of(self, name: str, now_ms: int) -> tuple[Topic, JobQueue]:
        """The live queue topic `name` (`404`, `409 not_a_queue`), retention enforced (at
        wall time `now_ms`) and due leases swept."""
        topic, q = self._lookup(name)
        self.engine.enforce(topic, now_ms)
        q.sweep(trio.current_time())
        self._schedule(q)  # a sweep may have started retry backoffs
        return topic, q

    def _lookup(self, name: str) -> tuple[Topic, JobQueue]:
        """The live queue topic `name` (`404`, `409 not_a_queue`)."""
        topic = self.engine.get(name)
        q = topic.queue
        if q is None:
            raise NotAQueue(f"topic {name!r} is a log, not a queue", {"topic": name})
        return topic, q

    def counts(self, topic: Topic) -> QueueCounts:
        """The queue's counts now (for `GET /v0/topics/:q` and the metrics); on a process
        that does not run the queue, its owner's as last heard."""
        q = topic.queue
        assert q is not None
        fwd = self._remote(topic.name)
        if fwd is not None:
            known = fwd.queue_counts(topic)
            if known is not None:
                return QueueCounts(known[0], known[1], known[2])
        if q.sweep(trio.current_time()):
            self._schedule(q)
        return q.counts()

    # ---- depth levels (scheduler spec R5) -------------------------------------------------

    def check_depth(self, topic: Topic, bypass: bool) -> bool:
        """Admission of new jobs against the queue's depth level. Below critical: pass.
        Critical: `429 {cause:"queue_depth"}`, skipped by a bypassing write. Overflow:
        the same `429`, and a bypassing write must wait (returns True: the caller
        awaits `wait_depth`, then runs its checks again)."""
        q = topic.queue
        if q is None or topic.config.depth_soft_limit <= 0:
            return False
        level = self._level(topic, q)
        if level < 2:
            return False
        if bypass:
            return level >= 3
        raise self._depth_throttled(topic, q)

    def _level(self, topic: Topic, q: JobQueue) -> int:
        now = trio.current_time()
        if q.sweep(now):
            self._schedule(q)
        reg = self.engine.saturation
        entry = reg.queues.get(self.level_name(topic))
        if entry is None or entry.owner is not q:
            self.levels_changed(topic)
            entry = reg.queues[self.level_name(topic)]
        return reg.observe(entry, now)

    def _depth_throttled(self, topic: Topic, q: JobQueue) -> Throttled:
        """The `429` of a job queue at critical or above, `retry_after_ms` from the
        measured ack rate: `(depth - warning * soft) / max(acks per second, 1)`."""
        soft = topic.config.depth_soft_limit
        depth = q.depth() + topic.pending_records
        rate = q.ack_rate(trio.current_time(), self.cfg.ack_rate_window_ms / 1000)
        excess = depth - self.engine.cfg.levels.warning * soft
        hint = round(1000 * excess / max(rate, 1.0))
        hint = min(max(hint, self.cfg.depth_retry_min_ms), self.cfg.depth_retry_max_ms)
        return Throttled.pressure(hint, cause="queue_depth")

    async def wait_depth(self, topic: Topic) -> None:
        """A bypassing write at overflow: wait until the level drops below overflow, at
        most `backpressure.bypass_wait_ms`; then the queue's `429`."""
        q = topic.queue
        assert q is not None
        with trio.move_on_after(self.engine.cfg.backpressure.bypass_wait_ms / 1000):
            while not topic.deleted and self._level(topic, q) >= 3:
                await q.wait_changed()
            return
        raise self._depth_throttled(topic, q)

    async def _delete(
        self, topic: Topic, q: JobQueue, seqs: list[int], now_ms: int | None = None
    ) -> float:
        """Delete the held jobs `seqs` for good (at wall time `now_ms`, default now): a sync-gated
        `RecordsDelete` with explicit seqs on every WAL class, in memory only on
        `ephemeral` (unless the backend stores those records: `Engine.ephemeral_stored`;
        their acks then reach it like any other class's). Returns the wait in ms. If the
        delete fails, the jobs are released (claimable again) before the error is raised,
        and also when the caller was cancelled meanwhile: the commit path runs the
        release whether or not anyone still waits."""
        engine = self.engine

        def abandoned() -> None:
            q.release_held(seqs)
            self._schedule(q)

        try:
            engine.check_open()
        except TopicdError:
            abandoned()
            raise
        frame = None
        if topic.config.durability != "ephemeral" or engine.ephemeral_stored:
            frame = frames.encode_control(
                frames.RECORDS_DELETE,
                topic.topic_id,
                engine.clock.now_ms() if now_ms is None else now_ms,
                {"seqs": seqs},
            )
        t0 = perf_ms()
        await engine.commit.control(
            topic, frame, lambda: engine.apply_seqs_delete(topic, seqs), abandoned=abandoned
        )
        return perf_ms() - t0

    async def _log(self, topic: Topic, events: list[LeaseEvent], apply: Callable[[], _T]) -> _T:
        """Log lease events of a queue with durable leases as one `Lease` frame,
        sync-gated, and run `apply` in the commit's publish step. Raises what the commit
        raised (`503 storage_unavailable`: nothing was applied)."""
        engine = self.engine
        engine.check_open()
        frame = frames.encode_control(
            frames.LEASE,
            topic.topic_id,
            engine.clock.now_ms(),
            {"events": [list(event) for event in events]},
        )
        return await engine.commit.control(topic, frame, apply)

    # ---- claim --------------------------------------------------------------------------

    # ---- another process runs the queue (`engine.forward`) ------------------------------

    def _remote(self, name: str) -> Forwarder | None:
        """The forwarder, when another process runs `name`'s queue (else None)."""
        fwd = self.engine.forward
        return None if fwd is None or fwd.owns(name) else fwd

    async def _forwarded(
        self, fwd: Forwarder, name: str, op: str, args: dict[str, object]
    ) -> tuple[Topic, dict[str, object]]:
        ok = await fwd.queue_op(name, op, args)
        topic = self.engine.topics.get(name)
        if topic is None or topic.queue is None:
            await fwd.catch_up(name)
            topic = self.engine.get(name)
        return topic, ok

    async def _seqs_forwarded(
        self, fwd: Forwarder, name: str, op: str, args: dict[str, object]
    ) -> SeqsResult:
        topic, ok = await self._forwarded(fwd, name, op, args)
        counts = ok["counts"]
        skipped = ok["skipped"]
        deadlines = ok.get("deadlines") or {}
        assert isinstance(counts, list)
        assert isinstance(skipped, list)
        assert isinstance(deadlines, dict)
        return SeqsResult(
            topic,
            int(str(ok["done"])),
            [int(s) for s in skipped],
            QueueCounts(int(counts[0]), int(counts[1]), int(counts[2])),
            {int(k): int(v) for k, v in deadlines.items()},
            float(str(ok.get("fsync_ms", 0.0))),
        )

    async def run_forwarded(self, name: str, op: str, args: dict[str, object]) -> dict[str, object]:
        """On the owner: a queue call another process forwarded, and its answer (with the
        queue's counts after it, which that process shows until it hears newer ones)."""
        node = str(args.get("node"))
        seqs = [int(s) for s in args.get("seqs") or []]  # type: ignore[attr-defined]
        fences = [str(f) for f in args.get("fences") or []]  # type: ignore[attr-defined]
        out: dict[str, object]
        if op == "work":
            out = await self._serve_work(name, args)
            topic = self.engine.get(name)
        elif op == "release":
            topic, q = self._queue_of(name, self.engine.clock.now_ms())
            held = args["held"]
            assert isinstance(held, dict)
            q.remote_work.pop(str(args.get("stream")), None)
            out = {"released": q.release_stream({int(s): int(v) for s, v in held.items()})}
            self._schedule(q)
        elif op == "claim":
            lease_ms = args.get("lease_ms")
            res = await self.claim(
                name, node, int(str(args["want"])), None if lease_ms is None else int(str(lease_ms))
            )
            out = {"items": [i.decode() for i in res.items], "ready": res.ready}
            topic = res.topic
        else:
            if op == "ack":
                sres = await self.ack(name, node, seqs, fences)
            elif op == "nack":
                sres = await self.nack(name, node, seqs, fences, int(str(args["delay_ms"])))
            elif op == "extend":
                sres = await self.extend(name, node, seqs, fences, int(str(args["lease_ms"])))
            else:
                raise AssertionError(f"unknown queue op {op!r}")
            out = {
                "done": sres.done,
                "skipped": sres.skipped,
                "deadlines": {str(k): v for k, v in sres.deadlines.items()},
                "fsync_ms": sres.fsync_ms,
            }
            topic = sres.topic
        queue = topic.queue
        assert queue is not None
        c = queue.counts()
        out["counts"] = [c.ready, c.in_flight, c.delayed, queue.dead_lettered]
        return out

    def runs_elsewhere(self, name: str) -> bool:
        """Whether another process runs `name`'s queue (its calls are forwarded)."""
        return self._remote(name) is not None

    async def _work_forwarded(self, fwd: Forwarder, conn: WorkConn) -> list[bytes]:
        """A `/work` refill through the owner: it keeps the stream's leases still
        current, claims up to `want` in all, and answers the lot."""
        args: dict[str, object] = {
            "node": conn.node,
            "want": conn.want,
            "lease_ms": conn.lease_ms,
            "held": {str(s): lid for s, lid in conn.held.items()},
            "stream": conn.stream_id,
        }
        _, ok = await self._forwarded(fwd, conn.topic.name, "work", args)
        held = ok["held"]
        items = ok["items"]
        assert isinstance(held, dict)
        assert isinstance(items, list)
        conn.held.clear()
        conn.held.update({int(s): int(lid) for s, lid in held.items()})
        return [str(i).encode() for i in items]

    async def _serve_work(self, name: str, args: dict[str, object]) -> dict[str, object]:
        """On the owner: a `/work` refill another process forwarded (`_work_forwarded`)."""
        topic, q = self._queue_of(name, self.engine.clock.now_ms())
        stream = args.get("stream")
        if isinstance(stream, str):  # (its process hears of this queue's changes)
            now = trio.current_time()
            q.remote_work[stream] = now
            for sid, seen in list(q.remote_work.items()):
                if now - seen > REMOTE_WORK_STALE_S:
                    del q.remote_work[sid]
        held_in = args.get("held") or {}
        assert isinstance(held_in, dict)
        held: dict[int, int] = {}
        for s, lid in held_in.items():
            lease = q.leases.get(int(s))
            if lease is not None and lease.lease_id == int(lid):
                held[int(s)] = int(lid)
        want = int(str(args["want"])) - len(held)
        items: list[bytes] = []
        if want > 0:
            lease_ms = args.get("lease_ms")
            ms = self._lease_ms(topic, None if lease_ms is None else int(str(lease_ms)))
            me = Claimer(str(args["node"]), want, ms, held=held)
            items = (await self._claim(topic, q, me)).items
        return {"items": [i.decode() for i in items], "held": {str(s): v for s, v in held.items()}}

    async def release_remote(self, conn: WorkConn) -> None:
        """A `/work` stream whose queue runs elsewhere ended: the owner releases the
        leases it still holds (claimable at once). If the owner cannot be reached, they
        expire at their deadlines instead."""
        fwd = self._remote(conn.topic.name)
        if fwd is None or not conn.held:
            await trio.lowlevel.checkpoint()
            return
        args: dict[str, object] = {
            "held": {str(s): lid for s, lid in conn.held.items()},
            "stream": conn.stream_id,
        }
        try:
            await fwd.queue_op(conn.topic.name, "release", args)
        except TopicdError as err:
            log.info("work stream on %r: leases left to expire: %s", conn.topic.name, err)
            return
        conn.held.clear()

    async def claim(self, name: str, node: str, want: int, lease_ms: int | None) -> ClaimResult:
        """`POST /v0/topics/:q/claim`: lease up to `want` jobs to `node` (the pass
        enforces retention and sweeps due leases itself, when it runs)."""
        fwd = self._remote(name)
        if fwd is not None:
            args: dict[str, object] = {"node": node, "want": want, "lease_ms": lease_ms}
            topic, ok = await self._forwarded(fwd, name, "claim", args)
            items = ok["items"]
            assert isinstance(items, list)
            return ClaimResult(topic, [str(i).encode() for i in items], int(str(ok["ready"])))
        topic, q = self._lookup(name)
        me = Claimer(node, want, self._lease_ms(topic, lease_ms))
        return await self._claim(topic, q, me)

    async def claim_for_work(self, conn: WorkConn, want: int) -> list[bytes]:
        """A `/work` refill: up to `want` jobs for the stream, through the same path as
        a claim (a coalescing cohort included). The leases are recorded in
        `conn.held` as they are made. Returns the claim items."""
        topic = conn.topic
        q = topic.queue
        if q is None or topic.deleted:
            raise TopicNotFound(topic.name)
        fwd = self._remote(topic.name)
        conn.remote = fwd is not None
        if fwd is not None:
            return await self._work_forwarded(fwd, conn)
        self.engine.enforce(topic)
        q.sweep(trio.current_time())
        me = Claimer(conn.node, want, self._lease_ms(topic, conn.lease_ms), held=conn.held)
        res = await self._claim(topic, q, me)
        return res.items

    async def _claim(self, topic: Topic, q: JobQueue, me: Claimer) -> ClaimResult:
        name = topic.name
        now_ms = self.engine.clock.now_ms()
        q.last_ms["claim"] = now_ms
        jitter_ms = topic.config.claim_jitter_ms
        if jitter_ms <= 0:
            await trio.lowlevel.checkpoint()
            if topic.deleted:
                raise TopicNotFound(name)
            cohort = _Cohort(trio.current_time(), [me])
            # wall time read again after the checkpoint: the pass sweeps at the Trio
            # time of now, and a deadline computed from an earlier reading would start
            # a new lease (as answered) before the one it replaced had expired
            diverted = await self._serve(topic, q, cohort, self.engine.clock.now_ms())
        else:
            current = q.cohort
            if current is None or current.served:
                cohort = q.cohort = _Cohort(trio.current_time() + jitter_ms / 1000)
            else:
                cohort = current
            cohort.members.append(me)
            try:
                await trio.sleep_until(cohort.closes_at)
            except BaseException:
                if not cohort.served:
                    cohort.members.remove(me)
                raise
            diverted = []
            if not cohort.served:
                # the first member awake serves the whole cohort
                if q.cohort is cohort:
                    q.cohort = None
                try:
                    if topic.deleted:
                        raise TopicNotFound(name)
                    diverted = await self._serve(topic, q, cohort, self.engine.clock.now_ms())
                except TopicdError as exc:
                    cohort.served = True
                    cohort.members[0].error = exc
            elif cohort.done is not None:
                await cohort.done.wait()  # the server logs the pass's leases
        if diverted:
            await self._dead_letter(topic, q, diverted, cohort.dead_letter)
            cohort.ready = q.ready()
        if me.error is not None:
            raise me.error
        return ClaimResult(topic, me.items, cohort.ready)

    def _lease_ms(self, topic: Topic, lease_ms: int | None) -> int:
        value = topic.config.lease_ms if lease_ms is None else lease_ms
        return min(max(value, self.cfg.min_lease_ms), self.cfg.max_lease_ms)

    async def _serve(self, topic: Topic, q: JobQueue, cohort: _Cohort, now_ms: int) -> list[int]:
        """One pass for a whole cohort at wall time `now_ms` (the pass is synchronous:
        nothing interleaves). With durable leases the leases are staged, logged, and
        installed when the frame commits; if it fails, every member gets the error and
        nothing changed."""
        cohort.served = True
        engine = self.engine
        engine.enforce(topic, now_ms)
        now = trio.current_time()
        q.sweep(now)
        cfg = topic.config
        durable = leases_durable(topic)
        diverted = q.claim(
            cohort.members,
            now,
            now_ms,
            cfg.max_deliveries,
            cfg.dead_letter is not None,
            staged=durable,
        )
        if diverted:
            assert cfg.dead_letter is not None
            cohort.dead_letter = (cfg.dead_letter, cfg.max_deliveries)
        if durable or not _build_items(topic, cohort.members):
            with engine.payloads.hold() as hold:
                cohort.done = trio.Event()  # the other members wait for their items
                try:
                    if durable:
                        await self._log_claims(topic, q, cohort.members)
                    await self._load_jobs(topic, cohort.members, hold)
                finally:
                    cohort.done.set()
                built = _build_items(topic, cohort.members)
                assert built  # held: nothing loaded can be evicted again meanwhile
        cohort.ready = q.ready()
        self._schedule(q)
        return diverted

    async def _load_jobs(self, topic: Topic, members: list[Claimer], hold: Hold) -> None:
        """Load the claimed jobs whose payloads are only in their segments (offloaded),
        held until the claim items are built. A job that died meanwhile is left out; a
        failed read is every member's error (their leases simply expire)."""
        cache = self.engine.payloads
        seqs = sorted(lease.seq for m in members for lease, _ in m.got)
        try:
            # until none is missing: a load may evict a resident (not held) job's chunk
            # to make room, so a pass can end with it missing; each load holds one more
            # chunk, so this ends
            while True:
                missing = next((s for s in seqs if topic.enc(s) is EVICTED), None)
                if missing is None or topic.deleted:
                    break
                await cache.load(topic, missing, seqs[-1] - missing + 1, LOAD_BYTES_MAX, hold)
        except TopicdError as exc:
            for m in members:
                m.got = []
                m.error = exc
            return
        for m in members:
            m.got = [(lease, n) for lease, n in m.got if topic.enc(lease.seq) is not None]

    async def _log_claims(self, topic: Topic, q: JobQueue, members: list[Claimer]) -> None:
        """Log the staged leases of one pass (`claimed` events) and install them at the
        commit. Shielded: the jobs are held until the outcome is known, and only this
        task can release them if the frame fails."""
        got = [pair for m in members for pair in m.got]
        if not got:
            return

        def install() -> None:
            kept = {lease.seq for lease, _ in q.install(got)}
            for m in members:
                m.got = [(lease, n) for lease, n in m.got if lease.seq in kept]

        events = [
            ("claimed", lease.seq, lease.node, lease.lease_id, lease.deadline_ms, n)
            for lease, n in got
        ]
        try:
            with trio.CancelScope(shield=True):
                await self._log(topic, events, install)
        except TopicdError as exc:
            q.unstage(got)
            self._schedule(q)
            for m in members:
                m.got = []
                m.error = exc

    async def _dead_letter(
        self, topic: Topic, q: JobQueue, seqs: list[int], dead_letter: tuple[str, int]
    ) -> None:
        """Move held jobs to the dead-letter topic (as configured at the pass): append a
        copy, then delete the job (the ack path). A failed move makes the job claimable
        again; a later pass retries it."""
        engine = self.engine
        target, max_deliveries = dead_letter
        for i, seq in enumerate(seqs):
            if topic.enc(seq) is EVICTED:  # only in its segment: load it (offloaded)
                try:
                    with engine.payloads.hold() as hold:
                        await engine.payloads.load(topic, seq, 1, LOAD_BYTES_MAX, hold)
                        enc = topic.enc(seq)  # (read while held)
                except TopicdError as exc:
                    log.error("queue %r: job %d stays claimable: %s", topic.name, seq, exc)
                    q.release_held([seq])
                    continue
                except BaseException:
                    q.release_held(seqs[i:])
                    raise
            else:
                enc = topic.enc(seq)
            if not isinstance(enc, bytes) or seq not in q.held:
                continue
            data, meta = split(enc, topic.shapes.get(seq))
            record = RecordIn(
                data=msgspec.Raw(data),
                tag=topic.tags.get(seq),
                node=topic.nodes.get(seq),
                meta=msgspec.Raw(dead_letter_meta(meta, topic.name, max_deliveries, seq)),
                priority=topic.prios.get(seq),
            )
            try:
                await engine.append(target, WriteIn(records=[record]))
                with trio.CancelScope(shield=True):  # the copy exists: finish the move
                    await self._delete(topic, q, [seq])
            except TopicdError as exc:
                log.warning(
                    "queue %r: moving job %d to dead-letter topic %r failed (%s); it stays "
                    "claimable and the move is retried",
                    topic.name,
                    seq,
                    target,
                    exc.message,
                )
                q.release_held([seq])
                continue
            except BaseException:
                q.release_held(seqs[i:])
                raise
            q.dead_lettered += 1

    # ---- ack / nack / extend ------------------------------------------------------------

    async def ack(self, name: str, node: str, seqs: list[int], fences: list[str]) -> SeqsResult:
        """`POST /v0/topics/:q/ack`: ack = record delete, committed before the answer."""
        fwd = self._remote(name)
        if fwd is not None:
            args: dict[str, object] = {"node": node, "seqs": seqs, "fences": fences}
            return await self._seqs_forwarded(fwd, name, "ack", args)
        now_ms = self.engine.clock.now_ms()
        topic, q = self._queue_of(name, now_ms)
        q.last_ms["ack"] = now_ms
        held, skipped = q.hold_for_ack(node, seqs, fences)
        fsync_ms = 0.0
        if held:
            fsync_ms = await self._delete(topic, q, held, now_ms)  # (released if it fails)
            q.note_acks(len(held), trio.current_time(), self.cfg.ack_rate_window_ms / 1000)
        else:
            await trio.lowlevel.checkpoint()
        return SeqsResult(topic, len(held), skipped, q.counts(), fsync_ms=fsync_ms)

    async def nack(
        self, name: str, node: str, seqs: list[int], fences: list[str], delay_ms: int
    ) -> SeqsResult:
        """`POST /v0/topics/:q/nack`: release leases now or after `delay_ms`."""
        fwd = self._remote(name)
        if fwd is not None:
            args = {"node": node, "seqs": seqs, "fences": fences, "delay_ms": delay_ms}
            return await self._seqs_forwarded(fwd, name, "nack", args)
        now_ms = self.engine.clock.now_ms()
        topic, q = self._queue_of(name, now_ms)
        q.last_ms["nack"] = now_ms
        delay_ms = min(delay_ms, self.cfg.max_nack_delay_ms)
        now = trio.current_time()
        if not leases_durable(topic):
            released, skipped = q.nack(node, seqs, fences, delay_ms, now)
            self._schedule(q)
            await trio.lowlevel.checkpoint()
            return SeqsResult(topic, released, skipped, q.counts())
        # durable leases: log the `released` events first; the leases stay held (and
        # their jobs unclaimable) until the frame commits, then drop at the commit
        leases, skipped = q._holding(node, seqs, fences)
        released = 0
        if leases:
            ready_ms = now_ms + delay_ms if delay_ms else 0
            events = [
                ("released", ls.seq, ls.node, ls.lease_id, ready_ms, q.deliveries.get(ls.seq, 0))
                for ls in leases
            ]
            released = await self._log(topic, events, lambda: q.release(leases, delay_ms, now))
            self._schedule(q)
        else:
            await trio.lowlevel.checkpoint()
        return SeqsResult(topic, released, skipped, q.counts())

    async def extend(
        self, name: str, node: str, seqs: list[int], fences: list[str], lease_ms: int
    ) -> SeqsResult:
        """`POST /v0/topics/:q/extend`: deadline = now + `lease_ms` for held leases."""
        fwd = self._remote(name)
        if fwd is not None:
            args = {"node": node, "seqs": seqs, "fences": fences, "lease_ms": lease_ms}
            return await self._seqs_forwarded(fwd, name, "extend", args)
        now_ms = self.engine.clock.now_ms()
        topic, q = self._queue_of(name, now_ms)
        q.last_ms["extend"] = now_ms
        lease_ms = min(max(lease_ms, self.cfg.min_lease_ms), self.cfg.max_lease_ms)
        now = trio.current_time()
        if not leases_durable(topic):
            deadlines, skipped = q.extend(node, seqs, fences, lease_ms, now, now_ms)
            self._schedule(q)
            await trio.lowlevel.checkpoint()
            return SeqsResult(topic, len(deadlines), skipped, q.counts(), deadlines)
        # durable leases: log the `extended` events, move the deadlines at the commit
        leases, skipped = q._holding(node, seqs, fences)
        deadlines = {}
        if leases:
            events = [
                (
                    "extended",
                    ls.seq,
                    ls.node,
                    ls.lease_id,
                    now_ms + lease_ms,
                    q.deliveries.get(ls.seq, 0),
                )
                for ls in leases
            ]
            deadlines = await self._log(
                topic, events, lambda: q.set_deadlines(leases, lease_ms, now, now_ms)
            )
            skipped.extend(ls.seq for ls in leases if ls.seq not in deadlines)
            self._schedule(q)
        else:
            await trio.lowlevel.checkpoint()
        return SeqsResult(topic, len(deadlines), skipped, q.counts(), deadlines)

    # ---- `/work` streams ------------------------------------------------------------------

    def attach_work(self, conn: WorkConn) -> None:
        """Register an established `/work` stream with its queue (the SSE cap slot is
        the caller's)."""
        q = conn.topic.queue
        assert q is not None
        self.work[conn] = None
        q.workers[conn] = None
        if self.shutting_down:
            conn.stop = self._shutdown_frame(conn)

    def detach_work(self, conn: WorkConn) -> int:
        """The stream ended, however it ended: release every lease it still holds
        (claimable at once, delivery counters kept; synchronous, idempotent). Returns
        how many leases were released."""
        self.work.pop(conn, None)
        q = conn.topic.queue
        if q is None:
            return 0
        q.workers.pop(conn, None)
        if q.closed:
            conn.held.clear()
            return 0
        return q.release_stream(conn.held)

    @staticmethod
    def _shutdown_frame(conn: WorkConn) -> bytes:
        return error_frame(
            "server_shutting_down", "the server is shutting down", topic=conn.topic.name
        )

    def shutdown(self) -> None:
        """Graceful drain: every `/work` stream ends with `server_shutting_down` (its
        leases are released as it ends)."""
        self.shutting_down = True
        for conn in list(self.work):
            conn.stop = self._shutdown_frame(conn)
            conn.kick()

    def advise(self, retry_after_ms: int) -> int:
        """An advisory pacing frame (`error`, `code` 429) for every `/work` stream; a
        stream that has one pending keeps it (the new one is dropped, R4). Returns the
        number dropped."""
        dropped = 0
        message = "pacing advised under load"
        for conn in self.work:
            if conn.advisory is not None:
                dropped += 1
                continue
            conn.advisory = error_frame(
                429, message, retry_after_ms=retry_after_ms, topic=conn.topic.name
            )
            conn.kick()
        return dropped

    def slow(self, now: float, timeout_s: float) -> list[WorkConn]:
        """`/work` streams whose current socket write has been blocked too long."""
        return [
            c
            for c in self.work
            if c.write_started is not None and now - c.write_started > timeout_s
        ]

    def in_flight(self) -> int:
        """Active leases over every queue (after a sweep of each); of a queue another
        process runs, its owner's count as last heard (`counts`), as the queue's own
        series and `GET /v0/topics/:q` show it."""
        now = trio.current_time()
        total = 0
        for topic in self.engine.topics.values():
            q = topic.queue
            if q is None:
                continue
            if self._remote(topic.name) is not None:
                total += self.counts(topic).in_flight
                continue
            if q.sweep(now):
                self._schedule(q)
            total += len(q.leases)
        return total
