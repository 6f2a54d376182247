"""The engine: topic registry and every topic operation of the `/v0` surface.

Handlers validate the wire shape, call one method here and render its result; all rules
(validation order, lazy creation, idempotency, retention, caps, deletes, the diff walk and
long-polls) live here. Mutations go through the `CommitPath` (see `engine.commit`), which
publishes them; nothing else changes visible state.

Concurrency: everything runs on the Trio loop thread. Every synchronous block between
awaits is atomic, which is what makes seq reservation and publication race-free without
locks. Waiting (long-polls, idempotency joins, commits) happens only at the marked awaits.
"""

from __future__ import annotations

import bisect
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import orjson
import trio

from topicd.engine.commit import AppendBatch, InMemoryCommitPath, StorageBackend
from topicd.engine.idempotency import IdemEntry, IdempotencyStore
from topicd.engine.payloads import PayloadCache
from topicd.engine.queues import QueueService
from topicd.engine.router import RouterService
from topicd.engine.topic import ReadResult, Topic
from topicd.engine.watch import Session, WatchOptions, WatchRegistry
from topicd.engine.writes import PreparedWrite, encode_batch, prepare_write
from topicd.errors import (
    Forbidden,
    InvalidRequest,
    JsonValue,
    RecordTooLarge,
    ShuttingDown,
    Throttled,
    TopicdError,
    TopicExistsIncompatible,
    TopicFull,
    TopicNotEmpty,
    TopicNotFound,
)
from topicd.model import Shape, TopicConfig, shared_config
from topicd.sched.classes import Budget, give_back
from topicd.sched.governor import Governor, Sources, retry_after_ms
from topicd.sched.saturation import SaturationRegistry
from topicd.sched.scheduler import DeliveryScheduler
from topicd.sched.sojourn import Sojourns
from topicd.storage import frame as frames
from topicd.wire import (
    DeleteIn,
    DiffIn,
    PlainWriteIn,
    TopicConfigIn,
    WatchIn,
    WriteIn,
    check_topic_name,
    valid_topic_name,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from topicd.clock import WallClock
    from topicd.config import Config
    from topicd.engine.forward import Figures, Forwarder, Peers
    from topicd.engine.slots import ShareBudget

log = logging.getLogger("topicd.engine")


def _push_paused(topic: Topic) -> bool:
    """Under defer, push pauses for negative manual priorities (B0; scheduler spec B.5)."""
    p = topic.config.priority
    return p is not None and p < 0


@dataclass(frozen=True, slots=True)
class WriteResult:
    topic: str
    first_seq: int
    count: int
    head_seq: int
    created: bool
    deduped: bool
    fsync_ms: float
    wal_append_ms: float | None = None

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.count - 1


@dataclass(frozen=True, slots=True)
class DeleteResult:
    topic: Topic
    deleted: int


class Engine:
    """Owns every topic. Construct with `open_engine()` in production."""

    def __init__(
        self,
        config: Config,
        clock: WallClock,
        commit: StorageBackend | None = None,
    ) -> None:
        self.cfg = config
        self.clock = clock
        self.topics: dict[str, Topic] = {}
        self.by_id: dict[int, Topic] = {}
        self._names: list[str] = []  # sorted (bytewise == code point order for ASCII names)
        self.next_topic_id = 1
        self._creating: dict[str, trio.Event] = {}
        self._ttl_topics: set[Topic] = set()
        self.total_bytes = 0
        self.pending_bytes = 0
        # `limits.max_total_bytes` counted across processes (None: `total_bytes` decides)
        self.bytes_budget: ShareBudget | None = None
        # `limits.max_idempotency_entries` counted across processes (None: `idem` decides)
        self.entry_budget: ShareBudget | None = None
        self.idem = IdempotencyStore(config.limits.max_idempotency_entries)
        self.payloads = PayloadCache(config.storage.payload_cache_bytes)
        # topics whose snapshot entry changed since the last checkpoint captured them, and
        # the queues (re-captured every time): an incremental checkpoint's work list
        self.changed_topics: set[Topic] = set()
        self.queue_topics: set[Topic] = set()
        # ids of the topics deleted since a checkpoint's capture last took this list: its
        # entries to drop without comparing every id (`topicd.storage.snapshot`)
        self.deleted_ids: list[int] = []
        self.payloads.loader = self._load_stored
        self.commit: StorageBackend = commit or InMemoryCommitPath()
        self.commit.attach(self)
        self.checkpointer: object = None  # storage's, when durable (metrics, tests)
        self.recovery: dict[str, float] = {}  # what recovery found (metrics)
        self.throttled: dict[str, int] = {}  # 429s answered, by cause (metrics)
        self.records_appended = 0  # records published since start, replay excluded (metrics)
        # of those, records another process published, which this one loaded from the
        # shared storage (a follower's catch-up): a deployment counts each record once
        self.records_followed = 0
        self.draining = False
        self.replaying = False  # recovery: names are registered by finish_replay()
        # the backend stores `ephemeral` records too (jetstream: an in-memory stream), so
        # their record deletes go to it like any other class's
        self.ephemeral_stored = False
        self.closed = False  # no new mutations (shutdown, after the HTTP drain)
        self._pressure = 0.0  # the governor's, as its last sample published it
        # the HTTP layer's client permits at a time, for the governor's s4 (see Sources)
        self.admission: Callable[[float], tuple[float, int, int, int]] = lambda now: (
            0.0,
            0,
            1,
            0,
        )
        # s4 of the client requests waiting for a permit now (the HTTP layer wires it in)
        self.admission_now: Callable[[], float] = lambda: 0.0
        # maintenance work (checkpoints, retention sweeps) runs under these permits (R1.3)
        self.maintenance = trio.CapacityLimiter(config.classes.maintenance_permits)
        self.watch = WatchRegistry(config)
        self.sched = DeliveryScheduler(config, clock, self.watch, self.enforce)
        self._applied = (0.0, config.governor.commit_window_min_ms)  # coalesce, window
        # client writes' head-to-answer times, recorded by the HTTP gate (s6)
        self.sojourns = Sojourns(config.governor.sojourn_window_ms / 1000)
        self.governor = Governor(
            config.governor,
            Sources(
                workers=len(self.sched.shards),
                ripe=self.sched.ripe_count,
                queued=self.sched.queued,
                sched_latency_ms=lambda: self.sched.stats.ewma_sched_ms,
                decay_sched_latency=self._decay_sched_latency,
                pool_loads=lambda now: self.commit.pool_loads(now),
                backlog=lambda: self.commit.backlog_ratio(),
                sojourn=self.sojourns.median_ms,
                admission=lambda now: self.admission(now),
                apply=self._govern,
                publish=self._publish,
                set_defer=self._set_defer,
                on_sample=self._on_sample,
            ),
        )
        self.saturation = SaturationRegistry(config.levels)
        self._register_queues()
        self.queues = QueueService(self)
        self.routers = RouterService(self)
        # set on a process that hands its mutations to another (`topicd.engine.forward`)
        self.forward: Forwarder | None = None
        # set on a process that shares its storage with others, owner or not, and the
        # figures it answers them with (the HTTP layer's: `/v0/metrics` of a deployment)
        self.peers: Peers | None = None
        self.figures: Figures | None = None

    # ------------------------------------------------------------------------------------
    # lifecycle
    # ------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The engine's tasks: the delivery scheduler's shard tasks, the governor, the
        queues' lease-expiry timer, the slow-consumer watchdog and the housekeeping loop
        (TTL expiry of idle topics, idempotency pruning, idle watch sessions)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.sched.run)
            await nursery.start(self.governor.run)
            await nursery.start(self.queues.run)
            await nursery.start(self.routers.run)
            nursery.start_soon(self._watchdog)
            task_status.started()
            interval = self.cfg.engine.housekeeping_interval_ms / 1000
            while True:
                await trio.sleep(interval)
                await self.housekeep()

    def _register_queues(self) -> None:
        """The engine's bounded queues in the saturation registry (scheduler spec R4)."""
        reg = self.saturation
        max_topics = self.cfg.limits.max_topics
        for shard in self.sched.shards:
            ready = shard.ready
            reg.register(
                f"sched_ready.{shard.index}",
                partial(len, ready),
                lambda: max_topics,
            )
        watch = self.watch
        frames = self.cfg.sse.channel_frames

        def fullest_channel() -> int:
            # an idle stream's channel is empty (its pump is parked on it): only the
            # others are asked (statistics() per stream, every governor sample, was a
            # quarter of the loop's work during a 1000-watcher fan-out)
            return max(
                (c.recv_ch.statistics().current_buffer_used for c in watch.conns if not c.idle),
                default=0,
            )

        reg.register(
            "sse_channel", fullest_channel, lambda: frames, full=lambda: watch.stats.lagged
        )

    # ---- the governor's controls (topicd.sched.governor) ----------------------------------

    def _on_sample(self, now: float) -> None:
        """Each governor sample: queue peaks and levels, WAL stall detection."""
        self.saturation.sample(now)
        self.commit.check_stalls(now)

    def _decay_sched_latency(self, alpha: float) -> None:
        stats = self.sched.stats
        stats.ewma_sched_ms *= 1 - alpha

    @property
    def pressure(self) -> float:
        """The server's pressure (`X-Topicd-Pressure`, `topicd_pressure`): the governor's,
        or s4 of the client waiting room as it is now when that reads higher.

        The governor samples every 100 ms and smooths, which suits its own ladder but
        lags a burst: producers that read green together can fill the waiting room
        between two samples. So every reading also looks at the room itself
        (`governor.admission_refuse_fill`): a client pacing on it slows as the room fills
        and pauses before it is full. The ladder's controls and the WAL's pressure
        admission keep the sampled value."""
        return max(self._pressure, self.admission_now())

    @pressure.setter
    def pressure(self, value: float) -> None:
        self._pressure = value

    def _govern(self, pressure: float, coalesce_ms: float, window_ms: float) -> None:
        """Publish pressure; move the coalescing and commit windows when they change.
        (The governor then publishes the pressure producers read: `_publish`.)"""
        self.pressure = pressure
        coalesce, window = self._applied
        if coalesce_ms != coalesce:
            self.sched.coalesce_s = coalesce_ms / 1000
        self._applied = (coalesce_ms, window_ms)
        self.commit.govern(pressure, window_ms if window_ms != window else None)

    def _publish(self, pressure: float) -> None:
        """The pressure answers and metrics read: `Governor.published`, the smoothed
        pressure held no higher than the signals read now."""
        self.pressure = pressure

    def retry_hint_ms(self) -> int:
        """`retry_after_ms` from pressure alone (scheduler spec B.5, no jitter)."""
        return round(retry_after_ms(self.pressure, self.cfg.backpressure))

    def _set_defer(self, on: bool) -> None:
        self.sched.set_defer(on)
        if on:
            self.watch.advise_paused(_push_paused, self.retry_hint_ms())
            self.watch.stats.advisories_dropped += self.queues.advise(self.retry_hint_ms())

    async def _watchdog(self) -> None:
        """Close SSE streams whose socket write has been blocked too long (§2.7)."""
        timeout = self.cfg.watch.slow_consumer_timeout_ms / 1000
        while True:
            await trio.sleep(min(timeout / 4, 1.0))
            for conn in self.watch.slow(trio.current_time(), timeout):
                log.info("closing a watch stream: one write blocked over %.0f s", timeout)
                self.watch.stats.slow_closed += 1
                conn.cancel_scope.cancel()
                self.watch.close(conn)
            for work in self.queues.slow(trio.current_time(), timeout):
                log.info("closing a /work stream: one write blocked over %.0f s", timeout)
                self.watch.stats.slow_closed += 1
                work.cancel_scope.cancel()

    async def housekeep(self) -> None:
        now = self.clock.now_ms()
        self.idem.prune(now)
        self.watch.reclaim_idle()
        classes = self.cfg.classes
        budget = Budget.for_class("maintenance", classes.quantum_base_us, classes.quantum_items)
        async with self.maintenance:
            for topic in list(self._ttl_topics):
                if not topic.deleted:
                    self._enforce(topic, now)
                await budget.tick()

    def begin_drain(self) -> None:
        """Shutdown started: parked long-polls return at once with what is readable."""
        self.draining = True
        for topic in self.topics.values():
            topic.wake()
        self.watch.shutdown()
        self.queues.shutdown()

    # ------------------------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------------------------

    def get(self, name: str) -> Topic:
        """The live topic `name`; `400` for an invalid name, `404` if absent."""
        topic = self.topics.get(name)
        if topic is None:
            check_topic_name(name)
            raise TopicNotFound(name)
        return topic

    def enforce(self, topic: Topic, now_ms: int | None = None) -> None:
        """Apply TTL and caps now (before a delivery reads the topic); `now_ms`: the wall
        clock as the caller just read it (default: read here)."""
        self._enforce(topic, self.clock.now_ms() if now_ms is None else now_ms)

    def apply_floor(self, topic: Topic, floor: int, runs: list[tuple[int, int, str]]) -> None:
        """Another process's eviction floor for `topic` (`Topic.raise_floor`)."""
        freed = topic.raise_floor(floor, runs)
        if freed:
            self.total_bytes -= freed

    def _enforce(self, topic: Topic, now_ms: int) -> None:
        freed = topic.enforce(now_ms)
        if freed:
            self.total_bytes -= freed

    def resolve_config(self, name: str, cin: TopicConfigIn | None) -> TopicConfig:
        """Resolve a config object (README §10) in the order of api-topics §2."""
        c = cin if cin is not None else TopicConfigIn()
        c.check()
        q = self.cfg.queue
        lease_ms = min(max(c.lease_ms, q.min_lease_ms), q.max_lease_ms)
        jitter = min(c.claim_jitter_ms, q.max_claim_jitter_ms)
        if c.dead_letter is not None and not valid_topic_name(c.dead_letter):
            raise InvalidRequest(
                f"dead_letter {c.dead_letter[:300]!r} is not a valid topic name",
                {"dead_letter": c.dead_letter[:300]},
            )
        if isinstance(c.durability, str):
            durability = c.durability
        elif isinstance(c.durable, bool):
            durability = "fsync" if c.durable else "disk"
        else:
            durability = "disk"
        if c.type == "queue" and c.dead_letter == name:
            raise InvalidRequest(
                "dead_letter must differ from the queue itself", {"dead_letter": c.dead_letter}
            )
        s = self.cfg.scheduler
        priority = (
            None if c.priority is None else min(max(c.priority, s.priority_min), s.priority_max)
        )
        return TopicConfig(
            type=c.type,
            ttl_ms=c.ttl_ms,
            cap_records=c.cap_records,
            cap_bytes=c.cap_bytes,
            discard=c.discard,
            durability=durability,
            priority=priority,
            auto_priority=c.auto_priority,
            auto_create=c.auto_create,
            idempotency_window_ms=c.idempotency_window_ms,
            dedupe_node=c.dedupe_node,
            lease_ms=lease_ms,
            claim_jitter_ms=jitter,
            max_deliveries=c.max_deliveries,
            dead_letter=c.dead_letter,
            leases_durable=c.leases_durable,
            depth_soft_limit=c.depth_soft_limit,
            retry_backoff_ms=c.retry_backoff_ms,
            retry_backoff_max_ms=c.retry_backoff_max_ms,
        )

    async def _create(self, name: str, config: TopicConfig) -> Topic | None:
        """Create `name` (control mutation). Returns None if someone else created it first."""
        if name in self._creating or name in self.topics:
            # (a checkpoint all the same: a caller's retry loop always yields)
            await trio.lowlevel.checkpoint()
            return None
        cap = self.cfg.limits.max_topics
        # (with a forwarder, other processes create and delete topics too: the shared
        # storage counts them, when the mutation is made durable)
        if cap and self.forward is None and len(self.topics) + len(self._creating) >= cap:
            raise Throttled.limit("max_topics", cap)
        self.check_open()
        done = self._creating[name] = trio.Event()
        topic_id = self.next_topic_id
        self.next_topic_id += 1
        topic = Topic(name, topic_id, config, name_json=orjson.dumps(name))
        frame = frames.encode_control(
            frames.TOPIC_CREATE,
            topic_id,
            self.clock.now_ms(),
            {"name": name, "config": config.to_wire()},
        )
        try:
            return await self.commit.control(topic, frame, lambda: self.apply_create(topic))
        finally:
            del self._creating[name]
            done.set()

    def check_open(self) -> None:
        if self.closed:
            raise ShuttingDown("the server is shutting down")

    # ------------------------------------------------------------------------------------
    # apply: the state changes of committed mutations (live, and replayed by recovery)
    # ------------------------------------------------------------------------------------

    def apply_create(self, topic: Topic) -> Topic:
        topic.cache = self.payloads
        topic.tracker = self.changed_topics
        if topic.changed:
            self.changed_topics.add(topic)
        self.queues.attach(topic)
        if topic.queue is not None:
            self.queue_topics.add(topic)
        self.by_id[topic.topic_id] = topic
        self.next_topic_id = max(self.next_topic_id, topic.topic_id + 1)
        if topic.config.ttl_ms > 0:
            self._ttl_topics.add(topic)
        if not self.replaying:
            assert topic.name not in self.topics, topic.name
            self.topics[topic.name] = topic
            bisect.insort(self._names, topic.name)
        return topic

    def finish_replay(self, now_ms: int) -> None:
        """Recovery is done: register the live instances by name, settle retention and
        idempotency against the real clock. (Shards replay independently, so a name's
        deleted and current instances may have been replayed in any order.)"""
        assert self.replaying
        self.replaying = False
        for topic in self.by_id.values():
            other = self.topics.get(topic.name)
            if other is not None:
                raise AssertionError(
                    f"two live instances of topic {topic.name!r}: ids {other.topic_id} "
                    f"and {topic.topic_id}"
                )
            self.topics[topic.name] = topic
            self._enforce(topic, now_ms)
            self.queues.recovered(topic)
            # everything replayed was read back from disk
            topic.durable_head = topic.drained_to = topic.drained_strong = topic.head_seq
        self._names = sorted(self.topics)
        self.idem.prune(now_ms)

    def apply_config(self, topic: Topic, config: TopicConfig, now_ms: int) -> None:
        if topic.deleted:
            raise TopicNotFound(topic.name)
        topic.config = shared_config(config)
        topic.mark_changed()
        if config.ttl_ms > 0:
            self._ttl_topics.add(topic)
        else:
            self._ttl_topics.discard(topic)
        self._enforce(topic, now_ms)
        self.sched.rebase(topic)
        self.queues.levels_changed(topic)

    def apply_delete_topic(self, topic: Topic, if_empty: bool, now_ms: int) -> bool:
        if topic.deleted:
            return False
        if if_empty:
            self._enforce(topic, now_ms)
            if topic.count:
                raise TopicNotEmpty(
                    f"topic {topic.name!r} still holds {topic.count} live records",
                    {"topic": topic.name, "count": topic.count},
                )
        del self.by_id[topic.topic_id]
        if self.checkpointer is not None:  # (nothing else consumes the list)
            self.deleted_ids.append(topic.topic_id)
        if not self.replaying:
            del self.topics[topic.name]
            del self._names[bisect.bisect_left(self._names, topic.name)]
        self._ttl_topics.discard(topic)
        self.total_bytes -= topic.bytes
        self.idem.drop_topic(topic.topic_id)
        self.payloads.forget(topic)
        self.changed_topics.discard(topic)
        self.queue_topics.discard(topic)
        topic.tracker = None
        topic.deleted = True
        self.routers.topic_deleted(topic)  # cascade
        if topic.queue is not None:
            topic.queue.close()  # its leases go with it
            self.queues.forget(topic)
            self.queues.levels_changed(topic)
        topic.wake()
        self.sched.forget(topic)
        self.watch.topic_deleted(topic)
        return True

    def apply_records_delete(
        self,
        topic: Topic,
        before_seq: int | None,
        match: tuple[str, str] | None,
        bound: int,
        now_ms: int,
    ) -> int:
        if topic.deleted:
            raise TopicNotFound(topic.name)
        self._enforce(topic, now_ms)
        deleted, freed = topic.delete_records(before_seq, match, bound)
        self.total_bytes -= freed
        return deleted

    def apply_seqs_delete(self, topic: Topic, seqs: list[int]) -> int:
        """Delete the listed records (queue acks, dead-letter moves); those already gone
        are passed over."""
        if topic.deleted:
            raise TopicNotFound(topic.name)
        deleted, freed = topic.delete_seqs(seqs)
        self.total_bytes -= freed
        return deleted

    def apply_append(self, batch: AppendBatch, now_ms: int) -> None:
        """Publish a committed batch's records (the visible half of a write)."""
        p = batch.prepared
        self.apply_records(
            batch.topic,
            batch.first_seq,
            batch.ts,
            batch.encs,
            p.sizes,
            p.nbytes,
            p.tags,
            p.nodes,
            p.prios,
            p.shapes,
            now_ms,
        )
        batch.head_after = batch.topic.head_seq
        if batch.idem_key is not None:
            assert batch.idem is not None
            self._remember(
                batch.topic,
                batch.idem_key,
                batch.idem,
                batch.first_seq,
                batch.count,
                batch.ts,
                now_ms,
            )

    def apply_records(
        self,
        topic: Topic,
        first_seq: int,
        ts: int,
        encs: list[bytes],
        sizes: list[int],
        nbytes: int,
        tags: dict[int, str],
        nodes: dict[int, str],
        prios: dict[int, int],
        shapes: dict[int, Shape],
        now_ms: int,
        idem_key: str | None = None,
    ) -> None:
        """Append committed records to a topic (live publish, and replay: `idem_key` then
        rebuilds the idempotency entry while its window is open)."""
        topic.publish(first_seq, ts, encs, sizes, nbytes, tags, nodes, prios, shapes)
        if ts > topic.last_ts:
            topic.last_ts = ts
        self.total_bytes += nbytes
        topic.last_write_ts = ts
        self._enforce(topic, now_ms)
        if not self.replaying:
            self.records_appended += len(encs)
            self.sched.mark_dirty(topic)
        if idem_key is not None and ts + topic.config.idempotency_window_ms > now_ms:
            try:
                entry = self.idem.begin(topic.topic_id, idem_key, now_ms)
            except Throttled:
                return  # the store is full of live entries: this one is not remembered
            self._remember(topic, idem_key, entry, first_seq, len(encs), ts, now_ms)

    def _remember(
        self,
        topic: Topic,
        key: str,
        entry: IdemEntry,
        first_seq: int,
        count: int,
        ts: int,
        now_ms: int,
    ) -> None:
        self.idem.resolve(
            topic.topic_id,
            key,
            entry,
            first_seq=first_seq,
            count=count,
            head_seq=topic.head_seq,
            expires_ms=ts + topic.config.idempotency_window_ms,
            now_ms=now_ms,
        )

    # ------------------------------------------------------------------------------------
    # CommitHooks
    # ------------------------------------------------------------------------------------

    def publish_append(self, batch: AppendBatch) -> None:
        topic = batch.topic
        topic.pending_records -= batch.count
        topic.pending_bytes -= batch.nbytes
        self.pending_bytes -= batch.nbytes
        if topic.deleted:  # the write raced the topic's deletion, which committed first
            self.fail_append(batch, TopicNotFound(topic.name), pending_released=True)
            return
        self.apply_append(batch, self.clock.now_ms())
        if batch.synced:
            self.durable(topic, topic.head_seq)
        batch.completion.set_ok()
        if topic in self.routers.held:
            self.routers.release(topic)  # held router copies go in once nothing is in flight

    def durable(self, topic: Topic, seq: int) -> None:
        """Every record of `topic` up to `seq` is on disk (strong watchers may see it)."""
        if seq > topic.durable_head and not topic.deleted:
            topic.durable_head = seq
            if self.watch.has_strong(topic):
                if seq > topic.drained_strong:
                    self.sched.mark_dirty(topic)
            elif not topic.slot.queued:
                topic.drained_strong = seq  # nobody waits for it: follow the durable head

    def fail_append(
        self, batch: AppendBatch, error: TopicdError, *, pending_released: bool = False
    ) -> None:
        topic = batch.topic
        if not pending_released:
            topic.pending_records -= batch.count
            topic.pending_bytes -= batch.nbytes
            self.pending_bytes -= batch.nbytes
        if batch.idem is not None and batch.idem_key is not None:
            self.idem.fail(topic.topic_id, batch.idem_key, batch.idem)
        batch.completion.set_failed(error)

    def rewind(self, topic: Topic) -> None:
        assert topic.pending_records == 0, topic.pending_records
        topic.next_seq = topic.head_seq + 1
        if topic in self.routers.held:
            self.routers.release(topic)

    async def _wait_creating(self, name: str) -> None:
        ev = self._creating.get(name)
        if ev is not None:
            await ev.wait()

    # ------------------------------------------------------------------------------------
    # PUT / GET / DELETE /v0/topics/:topic, GET /v0/topics
    # ------------------------------------------------------------------------------------

    async def put_topic(self, name: str, cin: TopicConfigIn | None) -> tuple[Topic, bool]:
        """Create or reconfigure (api-topics §2). Returns (topic, created)."""
        check_topic_name(name)
        config = self.resolve_config(name, cin)
        forward = self._forwarder(name)
        if forward is not None:
            return await forward.put_topic(name, cin)
        while True:
            await self._wait_creating(name)
            existing = self.topics.get(name)
            if existing is not None and existing.deleting is not None:
                await existing.deleting.wait()
                continue
            if existing is None:
                created = await self._create(name, config)
                if created is None:
                    continue
                return created, True
            if existing.config.type != config.type:
                raise TopicExistsIncompatible(
                    f"topic {name!r} is a {existing.config.type}; its type cannot change",
                    {
                        "topic": name,
                        "reason": "type_immutable",
                        "existing_type": existing.config.type,
                        "requested_type": config.type,
                    },
                )
            if existing.config == config:
                await trio.lowlevel.checkpoint()
                return existing, False
            topic = existing
            if topic.deleting is not None:
                await topic.deleting.wait()
                continue
            self.check_open()
            frame = frames.encode_control(
                frames.TOPIC_CONFIG,
                topic.topic_id,
                self.clock.now_ms(),
                {"config": config.to_wire()},
            )

            def apply(topic: Topic = topic) -> None:
                self.apply_config(topic, config, self.clock.now_ms())

            try:
                await self.commit.control(topic, frame, apply)
            except TopicNotFound:
                continue  # deleted meanwhile: create it
            return topic, False

    def topic_state(self, name: str, touch: bool) -> dict[str, JsonValue]:
        topic = self.get(name)
        now = self.clock.now_ms()
        self._enforce(topic, now)
        if touch:
            topic.last_read_ts = now
            topic.mark_changed()
        cfg = topic.config
        state: dict[str, JsonValue] = {
            "topic": topic.name,
            "type": cfg.type,
            "head_seq": topic.head_seq,
            "earliest_seq": topic.earliest_seq,
            "next_seq": topic.head_seq + 1,
            "count": topic.count,
            "bytes": topic.bytes,
            "config": cfg.to_wire(),
            "effective_priority": self.effective_priority(topic, now),
            "last_write_ts": topic.last_write_ts,
            "last_read_ts": topic.last_read_ts,
        }
        if topic.queue is not None:
            counts = self.queues.counts(topic)
            state["queue"] = {
                "ready": counts.ready,
                "in_flight": counts.in_flight,
                "dead_lettered": topic.queue.dead_lettered,
            }
        return state

    def effective_priority(self, topic: Topic, now_ms: int) -> int:
        """Scheduler spec A.5: `base + age_boost` while queued for delivery, else `base`."""
        return self.sched.effective(topic, now_ms)

    def list_topics(
        self,
        prefix: str,
        after: str | None,
        page_size: int,
        touch: bool,
        allowed: Callable[[str], bool] | None = None,
    ) -> tuple[list[dict[str, JsonValue]], str | None]:
        """One page of topics by name (api-topics §4). Returns (items, last name if more)."""
        names = self._names
        start = bisect.bisect_left(names, prefix)
        if after is not None and after >= prefix:
            start = max(start, bisect.bisect_right(names, after))
        now = self.clock.now_ms()
        items: list[dict[str, JsonValue]] = []
        last: str | None = None
        i = start
        while i < len(names):
            name = names[i]
            i += 1
            if not name.startswith(prefix):
                break
            if allowed is not None and not allowed(name):
                continue
            if len(items) == page_size:
                return items, last
            topic = self.topics[name]
            self._enforce(topic, now)
            if touch:
                topic.last_read_ts = now
                topic.mark_changed()
            items.append(
                {
                    "topic": name,
                    "head_seq": topic.head_seq,
                    "earliest_seq": topic.earliest_seq,
                    "count": topic.count,
                    "bytes": topic.bytes,
                    "durable": topic.config.durable,
                    "effective_priority": self.effective_priority(topic, now),
                }
            )
            last = name
        return items, None

    async def delete_topic(self, name: str, if_empty: bool) -> bool:
        """Delete a topic instance (api-topics §5). Returns whether one was deleted."""
        deleted, _ = await self.delete_topic_cascade(name, if_empty)
        return deleted

    async def create_default(self, name: str) -> Topic | None:
        """Create `name` with the default config (router auto-create); None if it exists
        (after waiting out a creation of it already under way: a caller that loops until
        the topic exists must not spin without yielding while another task creates it)."""
        await self._wait_creating(name)
        return await self._create(name, self.resolve_config(name, None))

    async def delete_topic_cascade(self, name: str, if_empty: bool) -> tuple[bool, list[str]]:
        """Delete a topic instance and every router of it. Returns (deleted, the names of
        the routers removed with it)."""
        check_topic_name(name)
        forward = self._forwarder(name)
        if forward is not None:
            return await forward.delete_topic(name, if_empty)
        await self._wait_creating(name)
        topic = self.topics.get(name)
        if topic is None:
            await trio.lowlevel.checkpoint()
            return False, []
        if topic.deleting is not None:
            await topic.deleting.wait()
            return False, []
        now = self.clock.now_ms()
        if if_empty:
            self._enforce(topic, now)
            if topic.count:
                raise TopicNotEmpty(
                    f"topic {topic.name!r} still holds {topic.count} live records",
                    {"topic": topic.name, "count": topic.count},
                )
        self.check_open()
        routers = await self.routers.touching_all(topic)
        elsewhere = sorted(set(routers) - set(self.routers.touching(topic)))
        frame = frames.encode_control(
            frames.TOPIC_DELETE, topic.topic_id, now, {"if_empty": if_empty, "routers": routers}
        )
        topic.deleting = done = trio.Event()

        def apply() -> tuple[bool, list[str]]:
            removed = sorted({*self.routers.touching(topic), *elsewhere})
            return self.apply_delete_topic(topic, if_empty, self.clock.now_ms()), removed

        try:
            result = await self.commit.control(topic, frame, apply)
        finally:
            topic.deleting = None
            done.set()
        if result[0] and result[1]:
            await self.routers.deleted_with(topic, result[1])
        return result

    # ------------------------------------------------------------------------------------
    # POST /v0/topics/:topic
    # ------------------------------------------------------------------------------------

    async def append(
        self,
        name: str,
        req: WriteIn | PlainWriteIn,
        *,
        header_key: str | None = None,
        can_admin: bool = True,
    ) -> WriteResult:
        """Append a batch (api-topics §6), following the validation order of §6.2."""
        forward = self._forwarder(name)
        if forward is not None:
            return await forward.append(name, req, header_key, can_admin)
        if self.routers.syncs_sources and name in self.topics:
            # a router destination whose source another process writes: the source
            # records acknowledged before this write are copied first (arrival order)
            await self.routers.sync_sources(self.topics[name])
        if req.config is not None and not can_admin and name not in self.topics:
            raise Forbidden(
                "creating a topic with an inline config needs the admin scope", {"topic": name}
            )
        prepared = prepare_write(req, header_key, self.cfg.protocol)
        key = prepared.idempotency_key
        created = False
        while True:
            topic = self.topics.get(name)
            if topic is None:
                topic = await self._lazy_create(name, req)
                if topic is None:
                    continue
                created = True
            elif topic.deleting is not None:
                await topic.deleting.wait()
                continue
            now = self.clock.now_ms()
            if key is not None:
                entry = self.idem.lookup(topic.topic_id, key, now)
                if entry is not None:
                    if entry.pending:
                        await entry.wait()
                        continue
                    await trio.lowlevel.checkpoint()
                    return WriteResult(
                        name, entry.first_seq, entry.count, entry.head_seq, False, True, 0.0
                    )
            if self._admit(topic, prepared, now):
                assert self.bytes_budget is not None
                await self.bytes_budget.grow(prepared.nbytes)  # (its 429 at the limit)
                continue  # state may have changed while waiting: run every check again
            bypass = req.disable_backpressure and self.cfg.backpressure.allow_bypass
            if topic.queue is not None and self.queues.check_depth(topic, bypass):
                give_back()
                await self.queues.wait_depth(topic)  # its 429 once the wait is over
                continue  # the level dropped: run every check again
            if not bypass and self.commit.backlog_full(topic):
                await self._wait_backlog(topic, prepared.nbytes)
                continue  # state may have changed while waiting: run every check again
            try:
                self.commit.admit(topic, prepared.nbytes, bypass=bypass)
            except Throttled:
                if not bypass:
                    raise
                await self._wait_for_room(topic, prepared.nbytes)
                continue  # state may have changed while waiting: run every check again
            gate = self.routers.gate(topic)
            if gate is not None:
                # router copies into this topic wait for its in-flight writes; they are
                # placed when those publish, then the writes behind the gate go on
                await gate.wait()
                continue
            budget = self.entry_budget
            if key is not None and budget is not None and not budget.fits(1):
                await budget.grow(1)  # (its 429 at the limit)
                continue  # state may have changed while waiting: run every check again
            batch = self._stage(topic, prepared, now)
            break
        if not batch.completion.resolved:
            give_back()  # only waits for the WAL from here (scheduler spec R1)
        await batch.completion.wait()
        return WriteResult(
            name,
            batch.first_seq,
            batch.count,
            batch.head_after,
            created,
            False,
            batch.fsync_ms,
            batch.wal_append_ms,
        )

    async def _wait_backlog(self, topic: Topic, nbytes: int) -> None:
        """A durable write while the records awaiting a checkpoint are at their bound
        (storage.md): wait for one to commit, at most bypass_wait_ms, then its 429."""
        give_back()
        with trio.move_on_after(self.cfg.backpressure.bypass_wait_ms / 1000):
            await self.commit.wait_backlog()
            return
        self.commit.admit(topic, nbytes)  # still full: raises its 429

    async def _wait_for_room(self, topic: Topic, nbytes: int) -> None:
        """A `disable_backpressure` write at a full ingest: wait, at most bypass_wait_ms."""
        give_back()
        with trio.move_on_after(self.cfg.backpressure.bypass_wait_ms / 1000):
            await self.commit.wait_for_room(topic, nbytes)
            return
        self.commit.admit(topic, nbytes, bypass=True)  # still full: raises its 429

    async def _lazy_create(self, name: str, req: WriteIn | PlainWriteIn) -> Topic | None:
        """api-topics §6.3. Returns None when a concurrent creation won (caller retries)."""
        if name in self._creating:
            await self._wait_creating(name)
            return None
        check_topic_name(name)
        if req.create is False:
            raise TopicNotFound(name)
        if req.create is None:
            auto = req.config.auto_create if req.config is not None else True
            if not auto:
                raise TopicNotFound(name)
        if req.config is not None:
            try:
                config = self.resolve_config(name, req.config)
            except InvalidRequest as exc:
                raise InvalidRequest(f"inline config: {exc.message}", exc.detail) from None
        else:
            config = self.resolve_config(name, None)
        return await self._create(name, config)

    def _admit(self, topic: Topic, prepared: PreparedWrite, now: int) -> bool:
        """Steps 7-8 of api-topics §6.2 (synchronous). True: every check passed but
        `max_total_bytes` needs a larger share of this process (`bytes_budget.grow`)."""
        self._enforce(topic, now)
        cfg = topic.config
        n = prepared.count
        nbytes = prepared.nbytes
        if cfg.discard == "reject" and (cfg.cap_records or cfg.cap_bytes):
            if (cfg.cap_records and n > cfg.cap_records) or (
                cfg.cap_bytes and nbytes > cfg.cap_bytes
            ):
                raise RecordTooLarge(
                    f"this write alone ({n} records, {nbytes} bytes) exceeds the caps of "
                    f'discard:"reject" topic {topic.name!r}',
                    {
                        "topic": topic.name,
                        "cap_records": cfg.cap_records,
                        "cap_bytes": cfg.cap_bytes,
                    },
                )
            if (cfg.cap_records and topic.count + topic.pending_records + n > cfg.cap_records) or (
                cfg.cap_bytes and topic.bytes + topic.pending_bytes + nbytes > cfg.cap_bytes
            ):
                raise TopicFull(
                    f'topic {topic.name!r} is full (discard:"reject"); nothing was appended',
                    {
                        "topic": topic.name,
                        "cap_records": cfg.cap_records,
                        "cap_bytes": cfg.cap_bytes,
                        "head_seq": topic.head_seq,
                        "earliest_seq": topic.earliest_seq,
                    },
                )
        quota = self.cfg.limits.max_total_bytes
        if quota:
            if self.bytes_budget is not None:
                return not self.bytes_budget.fits(nbytes)
            if self.total_bytes + self.pending_bytes + nbytes > quota:
                raise Throttled.limit("max_total_bytes", quota)
        return False

    def _stage(self, topic: Topic, prepared: PreparedWrite, now: int) -> AppendBatch:
        """Step 11's synchronous part: reserve seqs, encode, hand to the commit path."""
        self.check_open()
        key = prepared.idempotency_key
        entry = self.idem.begin(topic.topic_id, key, now) if key is not None else None
        first = topic.next_seq
        n = prepared.count
        ts = topic.stamp(now)
        topic.next_seq = first + n
        topic.pending_records += n
        topic.pending_bytes += prepared.nbytes
        self.pending_bytes += prepared.nbytes
        encs, joined = encode_batch(prepared, first, ts)
        batch = AppendBatch(
            topic,
            first,
            ts,
            encs,
            prepared,
            key,
            entry,
            durability=topic.config.durability,
            joined=joined,
        )
        self.commit.submit(batch)
        return batch

    # ------------------------------------------------------------------------------------
    # POST /v0/topics/:topic/diff
    # ------------------------------------------------------------------------------------

    async def diff(self, name: str, req: DiffIn) -> tuple[Topic, ReadResult]:
        """Read from a cursor (api-topics §7.2), with the `wait_ms` long-poll."""
        req.check()
        forward = self._forwarder(name)
        if forward is not None:
            await forward.catch_up(name, touch=True)  # (a diff is a read: `_read`)
        topic = self.get(name)
        wait_ms = min(req.wait_ms, self.cfg.protocol.max_wait_ms)
        if self.routers.syncs_sources:  # (a source another process writes)
            await self.routers.sync_sources(topic)
        self.routers.catch_up(topic)  # read-your-writes through routers
        if self.routers.in_flight or self.routers.wants:
            await self.routers.settle(topic)
        res = await self._read_loaded(topic, req)
        if (
            wait_ms > 0
            and not res.records
            and res.tombstone is None
            and res.caught_up
            and not self.draining
        ):
            woken = topic.waiter()
            give_back()  # a parked long-poll holds no client permit
            with trio.move_on_after(wait_ms / 1000):
                await woken.wait()
            if not woken.is_set():
                return topic, res
            if topic.deleted:
                raise TopicNotFound(name)
            self.routers.catch_up(topic)
            if self.routers.in_flight:
                await self.routers.settle(topic)
            res = await self._read_loaded(topic, req)  # once, with the same request (step 9)
        else:
            await trio.lowlevel.checkpoint()
        return topic, res

    def _forwarder(self, name: str) -> Forwarder | None:
        """Where `name`'s mutations go when this process does not run them (else None)."""
        forward = self.forward
        if forward is None or forward.owns(name):
            return None
        return forward

    async def sync_topic(self, name: str, *, touch: bool = False, reads: bool = False) -> None:
        """Before a read: on a process that forwards its mutations, bring `name` up to
        date with the shared storage (read-after-write across processes), with `reads`
        its read time with the owner's too (`touch`: the read counts as one there); else
        nothing."""
        forward = self._forwarder(name)
        if forward is not None:
            check_topic_name(name)
            await forward.catch_up(name, touch=touch, reads=reads)
        else:
            await trio.lowlevel.checkpoint()

    async def share_reads(self, names: list[str]) -> None:
        """After a listing with `touch`: on a process that forwards its mutations, the
        owners of the listed topics get their read times; else nothing."""
        forward = self.forward
        topics = [self.topics[n] for n in names if n in self.topics]
        if forward is not None and topics:
            await forward.share_reads(topics)
        else:
            await trio.lowlevel.checkpoint()

    async def topic_count(self) -> int:
        """The topics served: this process's, or on a process that forwards its
        mutations, the shared storage's (every process's)."""
        if self.forward is None:
            await trio.lowlevel.checkpoint()
            return len(self.topics)
        return await self.forward.topic_count()

    async def sync_listing(self) -> None:
        """Before a listing: on a process that forwards its mutations, learn the topics
        created and deleted through the others and catch up those whose records moved;
        else nothing."""
        if self.forward is not None:
            await self.forward.catch_up_all()
        else:
            await trio.lowlevel.checkpoint()

    async def _read_loaded(self, topic: Topic, req: DiffIn) -> ReadResult:
        """`_read`, loading the payloads it finds evicted (`topicd.engine.payloads`) from
        the segments, offloaded: the walk restarts with them held in memory, so it never
        returns early for want of bytes (each round loads at least one record)."""
        res = self._read(topic, req)
        if res.missing is None:
            return res
        p = self.cfg.protocol
        limit = min(req.limit or p.default_limit, p.max_limit)
        max_bytes = min(req.max_batch_bytes or p.default_max_batch_bytes, p.max_batch_bytes)
        missing: int | None = res.missing
        with self.payloads.hold() as hold:
            while missing is not None:
                got = sum(len(r) for r in res.records)
                await self.payloads.load(
                    topic, missing, limit - len(res.records), max_bytes - got, hold
                )
                if topic.deleted:
                    raise TopicNotFound(topic.name)
                res = self._read(topic, req)
                missing = res.missing
            res.cold_segments = hold.cold
        return res

    async def _load_stored(
        self, topic: Topic, lo: int, hi: int, max_bytes: int
    ) -> dict[int, bytes]:
        """The payload cache's loader: the storage seam's verified, offloaded read."""
        return await self.commit.read_stored_range(topic, lo, hi, max_bytes)

    def _read(self, topic: Topic, req: DiffIn) -> ReadResult:
        """Steps 3-8 of api-topics §7.2 against the topic's current state."""
        p = self.cfg.protocol
        now = self.clock.now_ms()
        self._enforce(topic, now)
        topic.last_read_ts = now
        topic.mark_changed()
        node_filter: frozenset[str] | None = None
        if req.node is not None and topic.config.dedupe_node:
            node_filter = frozenset([req.node] if isinstance(req.node, str) else req.node)
        return topic.read(
            req.from_seq,
            min(req.limit or p.default_limit, p.max_limit),
            min(req.max_batch_bytes or p.default_max_batch_bytes, p.max_batch_bytes),
            node_filter,
            req.include_tags,
            req.include_meta,
            p.max_scan_per_read,
        )

    # ------------------------------------------------------------------------------------
    # POST /v0/watch
    # ------------------------------------------------------------------------------------

    def create_watch(
        self, key_id: str | None, req: WatchIn, lenient: bool
    ) -> tuple[Session, list[Topic]]:
        """Store a watch session (api-routers-watch §2.2, after the allowlist check).

        Returns the session and the topics it watches, in order (`lenient` drops unknown
        topics silently; otherwise the first unknown one is `404 topic_not_found`)."""
        watch_cfg = self.cfg.watch
        p = self.cfg.protocol
        self.watch.reclaim_idle()
        hb = watch_cfg.default_heartbeat_ms if req.heartbeat_ms is None else req.heartbeat_ms
        hb = min(max(hb, watch_cfg.min_heartbeat_ms), watch_cfg.max_heartbeat_ms)
        chosen: list[tuple[Topic, int]] = []
        now = self.clock.now_ms()
        for name, spec in req.topics.items():
            topic = self.topics.get(name)
            if topic is None or topic.deleting is not None:
                if lenient:
                    continue
                raise TopicNotFound(name)
            self.routers.catch_up(topic)
            self._enforce(topic, now)
            chosen.append((topic, topic.head_seq if spec.tail else spec.from_seq))
        if not chosen:
            # lenient dropped every topic: there is nothing to watch
            raise TopicNotFound(next(iter(req.topics)))
        node = req.node
        opts = WatchOptions(
            None if node is None else frozenset([node] if isinstance(node, str) else node),
            min(req.limit or p.default_limit, p.max_limit),
            min(req.max_batch_bytes or p.default_max_batch_bytes, p.max_batch_bytes),
            req.include_meta,
            req.include_tags,
            req.include_data,
            req.consistency == "strong",
        )
        session = self.watch.create(key_id, chosen, opts, hb)
        return session, [t for t, _ in chosen]

    # ------------------------------------------------------------------------------------
    # POST /v0/topics/:topic/delete
    # ------------------------------------------------------------------------------------

    async def delete_records(self, name: str, req: DeleteIn) -> DeleteResult:
        """Point-in-time record delete by seq bound and/or tag (api-topics §10)."""
        req.check()
        forward = self._forwarder(name)
        if forward is not None:
            return await forward.delete_records(name, req)
        topic = self.get(name)
        match = parse_match(req.match)
        if req.before_seq is None and match is None:
            raise InvalidRequest("give before_seq, match, or both", {"field": "before_seq"})
        now = self.clock.now_ms()
        self._enforce(topic, now)
        bound = topic.head_seq  # point in time: records existing now
        self.check_open()
        frame = None
        # ephemeral: applied in memory only, unless the backend stores those records
        if topic.config.durability != "ephemeral" or self.ephemeral_stored:
            frame = frames.encode_control(
                frames.RECORDS_DELETE,
                topic.topic_id,
                now,
                {
                    "before_seq": req.before_seq,
                    "match": None if match is None else list(match),
                    "bound": bound,
                },
            )
        deleted = await self.commit.control(
            topic,
            frame,
            lambda: self.apply_records_delete(
                topic, req.before_seq, match, bound, self.clock.now_ms()
            ),
        )
        return DeleteResult(topic, deleted)


def parse_match(match: str | list[str] | None) -> tuple[str, str] | None:
    """The tag predicate of api-topics §10.1 → (op, value) with op `Eq` or `Glob`.

    For `Glob` the value is the prefix (the trailing `*` removed).
    """
    if match is None:
        return None
    if isinstance(match, str):
        if match.endswith("*"):
            return "Glob", match[:-1]
        return "Eq", match
    if len(match) != 3 or match[0] != "tag" or match[1] not in ("Eq", "Glob"):
        raise InvalidRequest(
            'match must be ["tag", "Eq"|"Glob", "<value>"] or a bare string',
            {"field": "match"},
        )
    if match[1] == "Glob":
        if not match[2].endswith("*"):
            raise InvalidRequest("a Glob value must end in '*'", {"field": "match"})
        return "Glob", match[2][:-1]
    return "Eq", match[2]


def canonical_match(match: tuple[str, str]) -> list[str]:
    op, value = match
    return ["tag", op, value + "*" if op == "Glob" else value]


@asynccontextmanager
async def open_engine(
    config: Config, clock: WallClock, commit: StorageBackend | None = None
) -> AsyncIterator[Engine]:
    """Run an engine with its housekeeping task; cancelled when the block exits."""
    engine = Engine(config, clock, commit)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel("engine closed")
