"""The delivery scheduler (scheduler spec A.1-A.5, B.1-B.4; architecture §6).

A committed write marks its topic **dirty**; each delivery shard (`scheduler.shards`,
`xxh3_64(topic_id) % shards`) keeps the dirty topics in a `ReadySet` and one task serves
it: wait for ripe work → pick by banded DWRR → **drain** the topic → requeue it if more was
published meanwhile → yield to the loop (the delivery quantum).

A drain serves one topic at a time from its shard's task, so per-topic order holds and no
topic is drained twice at once:

* a router destination first forwards the routers feeding it (a watch pass catches up
  its routers, one batch);
* it wakes the topic's `wait_ms` long-pollers (they re-read on their own);
* it runs the topic's `on_drain` hooks with the drained range;
* for each group of live watchers sharing frame options it builds the frames of the
  newly published range once (through the diff path: tombstones for anything cap/TTL
  removed before the drain got to it), encodes them once as shared batches
  (`live_batches`: the bytes a parked single-topic stream's socket gets, `id:` lines
  included) and hands each batch to every connection of the group without waiting
  (`Conn.push`: one non-blocking `send` of the shared bytes when the stream is parked at
  the batch's start, else a non-blocking offer of each frame); a `consistency:"strong"`
  group is bounded by the topic's durable head instead of its head;
* the fan-out yields to the loop every delivery quantum (`classes.quantum_base_us` × 4,
  or `classes.quantum_items` connections; R1.2; the clock is read once per
  `FANOUT_STEP` connections), so a drain to thousands of watchers does not hold up acks,
  probes and heartbeats. What is published meanwhile is past the drained range and
  requeues the topic; a stream that opens meanwhile catches up from the log and refuses
  a frame whose range does not start at its position (`Conn.offer`);
* a router source then forwards its feeds (router work runs in the source's band, as
  part of its drain, under the same delivery quantum). While the governor defers, the
  drain makes no copies: it enqueues each destination one band lower (B0 stays B0), and
  the destination's drain makes them. A router-triggered enqueue of a destination is
  demoted the same way.

A topic nobody waits on (no watcher, long-poller or router) is not queued at all: its
drained watermarks just follow the head. A drain handles at most
`scheduler.drain_max_records` new records; the rest requeues the topic at the tail of its
band. Time is Trio's clock (`MockClock` in tests); recency uses the engine's wall clock.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

import trio

from topicd.engine.watch import FrameRef, build_frames, caught_up_frame, live_batches
from topicd.model import shard_of
from topicd.sched.bands import ReadySet
from topicd.sched.classes import Budget
from topicd.sched.priority import Recency

if TYPE_CHECKING:
    from collections.abc import Callable

    from topicd.clock import WallClock
    from topicd.config import Config
    from topicd.engine.topic import Topic
    from topicd.engine.watch import WatchRegistry

log = logging.getLogger("topicd.sched")

SCHED_BUCKETS_MS: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0, 500.0, 1000.0)
# connections a fan-out serves between two looks at the clock (a look costs about as much
# Python as handing a batch to a parked stream)
FANOUT_STEP: Final = 16


@dataclass
class SchedStats:
    marked: int = 0  # mark_dirty calls that queued a topic
    drains: int = 0
    frames_built: int = 0
    frames_offered: int = 0
    requeued: int = 0
    sched_delay_s_total: float = 0.0  # enqueue → drain, summed
    sched_delay_s_max: float = 0.0
    ewma_sched_ms: float = 0.0  # drain start − ripe_at, EWMA per drain (governor s2)
    # the same latency as a histogram: counts per bucket of SCHED_BUCKETS_MS (+Inf last)
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(SCHED_BUCKETS_MS) + 1))
    latency_ms_total: float = 0.0
    drain_yields: int = 0  # fan-out yields inside drains (the delivery quantum, R1.2)


class Shard:
    """The ready set of one delivery shard and the event that wakes its task."""

    def __init__(self, index: int, cfg: Config) -> None:
        s = cfg.scheduler
        self.index = index
        self.ready: ReadySet[Topic] = ReadySet(
            thresholds=s.band_thresholds,
            weights=s.band_weights,
            aging_rate_per_s=s.aging_rate_per_s,
            aging_cap=s.aging_cap,
            deficit_cap_rounds=s.deficit_cap_rounds,
        )
        self.wakeup = trio.Event()
        self.next_age = 0.0


class RouterWork(Protocol):
    """What the router service offers the drain (`topicd.engine.router`)."""

    def interested(self, topic: Topic) -> bool: ...

    def feeds_out(self, topic: Topic) -> bool: ...

    def drain_dest(self, topic: Topic) -> bool: ...

    async def drain_source(self, topic: Topic, budget: Budget, defer: bool) -> bool: ...


class DeliveryScheduler:
    def __init__(
        self,
        cfg: Config,
        clock: WallClock,
        registry: WatchRegistry,
        enforce: Callable[[Topic], None],
    ) -> None:
        self.cfg = cfg
        sc = cfg.scheduler
        self.recency = Recency(sc.auto_max, sc.half_life_ms, sc.auto_floor_ms)
        self.enforce = enforce
        self.clock = clock
        self.registry = registry
        self.shards = [Shard(i, cfg) for i in range(cfg.scheduler.shards)]
        self.coalesce_s = 0.0  # ripeness delay of a newly dirty topic (the governor's)
        self.sched_alpha = cfg.governor.sched_latency_alpha
        self.max_scan = cfg.protocol.max_scan_per_read
        self.quantum_base_us = cfg.classes.quantum_base_us
        self.quantum_items = cfg.classes.quantum_items
        self.stats = SchedStats()
        self.running = False
        self.defer = False  # the governor's defer rung
        self.routers: RouterWork | None = None
        # a wake the storage holds back until what it must follow is in memory (several
        # fronts: a watch stream's other topics, written through other owners); True
        # when `hold` took the topic, which it marks again once released
        self.hold: Callable[[Topic], bool] | None = None

    # ---- priority ---------------------------------------------------------------------

    def base(self, topic: Topic, now_ms: int | None = None) -> int:
        s = self.cfg.scheduler
        cfg = topic.config
        if cfg.priority is not None:
            return min(max(cfg.priority, s.priority_min), s.priority_max)
        if not cfg.auto_priority or topic.last_read_ts is None:
            return 0
        return self.recency(
            (self.clock.now_ms() if now_ms is None else now_ms) - topic.last_read_ts
        )

    def effective(self, topic: Topic, now_ms: int) -> int:
        """`effective_priority` of the topic state: `base + age_boost` while queued."""
        slot = topic.slot
        if slot.queued and not slot.draining:
            shard = self.shard(topic)
            return slot.base + shard.ready.age_boost(slot, trio.current_time())
        return self.base(topic, now_ms)

    # ---- marking ----------------------------------------------------------------------

    def shard(self, topic: Topic) -> Shard:
        shards = self.shards
        return shards[0] if len(shards) == 1 else shards[shard_of(topic.topic_id, len(shards))]

    def interested(self, topic: Topic) -> bool:
        return (
            topic in self.registry.watchers
            or topic.has_waiters
            or bool(topic.on_drain)
            or (self.routers is not None and self.routers.interested(topic))
        )

    def mark_copied(self, topic: Topic, *, more: bool) -> None:
        """A router placed copies in `topic`. A drain of it is needed only when it has
        someone to deliver them to (watchers, long-pollers, drain hooks, routers out of
        it) or its feed has more to copy (the drain forwards the next batch); otherwise,
        as for a topic nobody is interested in, the drained watermarks follow the head
        (ten routers out of one source would otherwise cost ten idle drains a write)."""
        if (
            more
            or topic in self.registry.watchers
            or topic.has_waiters
            or topic.on_drain
            or (self.routers is not None and self.routers.feeds_out(topic))
        ):
            self.mark_dirty(topic, demote=True)
        elif not topic.slot.queued:
            topic.drained_to = topic.head_seq
            topic.drained_strong = topic.durable_head

    def demoted(self, base: int) -> int:
        """`base` moved one band down (B0 stays B0): where deferred router work goes."""
        bounds = self.cfg.scheduler.band_thresholds
        for i, bound in enumerate(bounds):
            if base >= bound:
                return bounds[i + 1] if i + 1 < len(bounds) else bound - 1
        return base

    def mark_dirty(self, topic: Topic, *, demote: bool = False) -> None:
        """A commit (or a durable-head advance) may have something to deliver.

        `demote`: a router-triggered enqueue; while the governor defers it goes one band
        lower than the topic's own priority."""
        slot = topic.slot
        if slot.queued or topic.deleted:
            return  # the membership bit: a burst is one unit of work
        if not self.running or not self.interested(topic):
            # nobody to serve: the drained watermarks follow the head at no cost
            topic.drained_to = topic.head_seq
            topic.drained_strong = topic.durable_head
            return
        if self.hold is not None and not demote and self.hold(topic):
            return
        shard = self.shard(topic)
        cfg = topic.config
        base = self.base(topic)
        if demote and self.defer:
            base = self.demoted(base)
        shard.ready.mark(
            slot,
            base,
            trio.current_time(),
            ripe_after=self.coalesce_s,
            manual_negative=cfg.priority is not None and cfg.priority < 0,
        )
        self.stats.marked += 1
        shard.wakeup.set()

    def rebase(self, topic: Topic) -> None:
        """The topic's priority config changed: re-band it if it is queued."""
        slot = topic.slot
        if slot.queued:
            cfg = topic.config
            self.shard(topic).ready.rebase(
                slot,
                self.base(topic),
                trio.current_time(),
                manual_negative=cfg.priority is not None and cfg.priority < 0,
            )

    def ripe_count(self) -> int:
        """Dirty topics ready to drain now, over every shard (governor signal s1)."""
        now = trio.current_time()
        return sum(shard.ready.ripe_count(now) for shard in self.shards)

    def queued(self) -> int:
        return sum(len(shard.ready) for shard in self.shards)

    def set_defer(self, on: bool) -> None:
        """The governor's defer rung: B0 and negative manual priorities get no credit;
        router work is demoted one band."""
        self.defer = on
        for shard in self.shards:
            shard.ready.defer = on
            if not on:
                shard.wakeup.set()  # deferred topics may be served again

    def forget(self, topic: Topic) -> None:
        """The topic was deleted."""
        self.shard(topic).ready.remove(topic.slot)

    # ---- the shard tasks ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for shard in self.shards:
                nursery.start_soon(self._serve, shard)
            self.running = True
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self.running = False

    async def _serve(self, shard: Shard) -> None:
        ready = shard.ready
        tick = self.cfg.scheduler.aging_tick_ms / 1000
        while True:
            now = trio.current_time()
            if now >= shard.next_age:
                ready.age(now)
                shard.next_age = now + tick
            slot = ready.pick(now)
            if slot is None:
                ripe = ready.next_ripe_at()
                shard.wakeup = trio.Event()
                if ripe is None:
                    await shard.wakeup.wait()
                else:
                    with trio.move_on_at(max(ripe, now)):
                        await shard.wakeup.wait()
                continue
            topic = slot.topic
            delay = now - slot.enqueued_at
            stats = self.stats
            late_ms = max(0.0, now - slot.ripe_at) * 1000
            stats.ewma_sched_ms += self.sched_alpha * (late_ms - stats.ewma_sched_ms)
            stats.latency_buckets[bisect.bisect_left(SCHED_BUCKETS_MS, late_ms)] += 1
            stats.latency_ms_total += late_ms
            stats.sched_delay_s_total += delay
            if delay > stats.sched_delay_s_max:
                stats.sched_delay_s_max = delay
            more = await self.drain(topic)
            if more:
                stats.requeued += 1
            ready.done(slot, more, self.base(topic), trio.current_time())
            await trio.lowlevel.checkpoint()  # the delivery quantum

    # ---- the drain ------------------------------------------------------------------------

    async def drain(self, topic: Topic) -> bool:
        """Serve everything the topic published since its last drain.

        Returns whether work is left (the `drain_max_records` bound, a strong group behind
        the durable head, or records published while the fan-out yielded)."""
        self.stats.drains += 1
        if topic.deleted:
            return False
        self.enforce(topic)  # TTL: what expired before the drain is a tombstone
        routers = self.routers
        fed_more = routers is not None and routers.drain_dest(topic)
        limit = self.cfg.scheduler.drain_max_records
        head = topic.head_seq
        start = topic.drained_to
        end = min(head, start + limit)
        more = end < head or fed_more
        topic.wake()  # long-pollers re-read by themselves
        if end > start:
            for hook in topic.on_drain:
                hook(topic, start, end)
        groups = self.registry.groups(topic)
        budget = Budget.for_class("delivery", self.quantum_base_us, self.quantum_items)
        strong_end = topic.durable_head
        strong_start = topic.drained_strong
        any_strong = False
        delivered = False
        for group in groups:
            opts = group.opts
            if opts.strong:
                any_strong = True
                s = strong_start
                e = min(topic.durable_head, s + limit)
                strong_end = e
                more = more or e < topic.durable_head
            else:
                s, e = start, end
            if e <= s:
                continue
            frames, _, missing = build_frames(topic, s, e, opts, self.max_scan)
            if frames and frames[0].tomb:
                # a tombstone reached the live watchers: announce the head again after it
                last = frames[-1].to_seq
                body = caught_up_frame(topic, ws=opts.ws)
                frames.append(FrameRef(topic.name, last, last, body, len(body)))
            self.stats.frames_built += len(frames)
            conns = group.conns  # a group is rebuilt, never changed, when streams come and go
            n = len(conns)
            now = trio.current_time()
            for batch in live_batches(topic.name, frames, ws=opts.ws):
                i = 0
                while i < n:
                    j = min(n, i + min(FANOUT_STEP, budget.left()))
                    for conn in conns[i:j]:
                        if not conn.push(batch, now):
                            self.registry.close(conn)
                    if budget.spend(j - i):
                        await budget.pause()
                        now = trio.current_time()
                    i = j
                self.stats.frames_offered += n * len(batch.frames)
            if missing is not None:
                # bytes only in a segment (a drain far behind): each stream catches up
                # from its own position, loading them off the loop
                for conn in conns:
                    conn.set_pull(topic.name, quiet=True)
            delivered = True
        if routers is not None and not topic.deleted:
            # router work, in this topic's band, under the same quantum
            more = await routers.drain_source(topic, budget, self.defer) or more
        self.stats.drain_yields += budget.yields
        if delivered:
            topic.last_read_ts = self.clock.now_ms()  # watch delivery is a read (recency)
            topic.mark_changed()
        topic.drained_to = end
        topic.drained_strong = strong_end if any_strong else topic.durable_head
        if budget.yields:  # published while the fan-out yielded (mark_dirty saw it queued)
            more = (
                more
                or topic.head_seq > end
                or (self.registry.has_strong(topic) and topic.durable_head > strong_end)
            )
        return more
