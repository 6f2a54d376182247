"""`GET /v0/metrics` (api-ops §3): Prometheus text, or a JSON snapshot.

The Prometheus exposition is produced by `prometheus-client` from a custom collector that
reads the engine, the WAL and the lifecycle at scrape time (metric families, no
instruments, so nothing is renamed and no `*_created` series appear). One wrinkle: the
client library names a counter family's `# HELP`/`# TYPE` lines `<name>_total`, which is
right for every `*_total` series but not for `topics_uptime_ms`, a counter whose sample
keeps its plain name (api-ops §3.1 lists it so); its two header lines are renamed back.

Control class: the handler reads published values only and never waits on the engine.
Per-topic series are capped at the first 1000 topics by name
(`topics_topic_metrics_truncated` says when).

On a process that shares its storage with others (`Engine.peers`: the jetstream
backend's fronts), a scrape answers for the whole deployment unless it asks
`scope=front`: it gathers the others' figures (`front_figures` there, each counting the
topics of the shards it was assigned) and merges them into its own (`merge_metrics`).
One process alone answers as it always did, whatever the scope.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Final, Generic, TypeVar, cast

import orjson
import trio
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from quart import Response, request

from topicd import __version__
from topicd.engine.queues import LEVEL_PREFIX
from topicd.errors import InvalidRequest
from topicd.http import merge_metrics
from topicd.http.app import principal
from topicd.lifecycle import Phase
from topicd.sched.saturation import LEVELS
from topicd.sched.scheduler import SCHED_BUCKETS_MS
from topicd.storage.wal import FSYNC_BUCKETS_US, WalCommitPath

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from quart_trio import QuartTrio

    from topicd.config import Config
    from topicd.engine.engine import Engine
    from topicd.engine.forward import Peers
    from topicd.engine.topic import Topic
    from topicd.errors import JsonValue
    from topicd.http.app import EngineRef
    from topicd.lifecycle import Lifecycle

    # which topics a process's figures count (on a deployment of several: those of the
    # shards it answers for); None: every topic it holds
    Counted = Callable[[str], bool]
    Work = dict[str, int]  # queue topic -> `/work` streams attached to it

_T = TypeVar("_T")

PER_TOPIC_MAX: Final = merge_metrics.PER_TOPIC_MAX
READY_PRIORITIES_MAX: Final = 8  # priority levels per queue in topicd_queue_ready_by_priority
CLASSES: Final = ("ephemeral", "memory", "disk", "fsync")
PROMETHEUS_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


_AGGREGATE_SLICE: Final = 5000  # topics a loop step when a scrape walks every topic


def _in_flight(engine: Engine, counted: Counted | None) -> int:
    """Active leases over every queue (`QueueService.in_flight`), or over those counted."""
    if counted is None:
        return engine.queues.in_flight()
    queues = engine.queues
    return sum(queues.counts(t).in_flight for n, t in list(queues.topics.items()) if counted(n))


@dataclass(slots=True)
class _Totals:
    """What a scrape sums over every topic."""

    topics: int
    by_class: dict[str, int]
    queues: int
    records_live: int
    names: list[str]  # the first `PER_TOPIC_MAX` topic names, sorted
    # live bytes of the topics counted, when not every topic is (`counted`); else None:
    # the engine's running total
    bytes_live: int | None = None


def _totals_of(topics: Iterable[Topic]) -> _Totals:
    totals = _Totals(0, dict.fromkeys(CLASSES, 0), 0, 0, [])
    _add(totals, list(topics))
    return totals


def _add(totals: _Totals, part: list[Topic]) -> None:
    counts = totals.by_class
    for t in part:
        counts[t.config.durability] += 1
        totals.queues += t.config.type == "queue"
        totals.records_live += t.count
    totals.topics += len(part)
    names = totals.names
    names.extend(t.name for t in part)
    names.sort()  # (a slice at a time: one sort of 100,000 names was a 30 ms step)
    del names[PER_TOPIC_MAX:]


async def _totals(engine: Engine, counted: Counted | None = None) -> _Totals:
    """`_totals_of` every topic (or those `counted`), `_AGGREGATE_SLICE` topics a step
    (with 100,000 topics one pass was a 30-40 ms step), over the topics as they were
    when it began."""
    every = list(engine.topics.values())
    totals = _Totals(0, dict.fromkeys(CLASSES, 0), 0, 0, [])
    if counted is not None:
        totals.bytes_live = 0
    for i in range(0, len(every), _AGGREGATE_SLICE):
        await trio.lowlevel.checkpoint()
        part = every[i : i + _AGGREGATE_SLICE]
        if counted is not None:
            part = [t for t in part if counted(t.name)]
            totals.bytes_live = (totals.bytes_live or 0) + sum(t.bytes for t in part)
        _add(totals, part)
    return totals


class _Collector:
    """Every family, in the exposition's order. With `counted` (a process of several
    sharing one storage, answering for the topics of its assigned shards), the topic
    figures count only those topics."""

    def __init__(
        self,
        ref: EngineRef,
        lifecycle: Lifecycle,
        totals: _Totals | None = None,
        counted: Counted | None = None,
    ) -> None:
        self.ref = ref
        self.lifecycle = lifecycle
        self.totals = totals
        self.counted = counted

    def collect(self) -> Iterator[Metric]:
        engine = self.ref.engine
        topics = engine.topics
        totals = self.totals if self.totals is not None else _totals_of(topics.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("topics_topics", "Topics existing.", totals.topics)
        by_class = GaugeMetricFamily(
            "topics_topics_by_class", "Topics per durability class.", labels=["class"]
        )
        counts = totals.by_class
        queues = totals.queues
        for cls in CLASSES:
            by_class.add_metric([cls], counts[cls])
        yield by_class
        routers = engine.routers
        yield gauge("topics_routers", "Routers existing.", len(routers.routers))
        yield CounterMetricFamily(
            "topicd_router_copies",
            "Records routers appended to destinations.",
            value=routers.stats.copies,
        )
        yield CounterMetricFamily(
            "topicd_router_source_trim",
            "Source seqs evicted before a router copied them (source_trim gaps).",
            value=routers.stats.trimmed,
        )
        yield CounterMetricFamily(
            "topicd_router_blocked",
            "Forwarding passes held back by a full destination (the cursor waits).",
            value=routers.stats.blocked,
        )
        lag = GaugeMetricFamily(
            "topicd_router_cursor_lag",
            "Per-router source head minus cursor (records not yet forwarded).",
            labels=["router"],
        )
        handled = CounterMetricFamily(
            "topicd_router_forwarded",
            "Per-router source records handled since creation.",
            labels=["router"],
        )
        for rname in sorted(routers.routers)[:PER_TOPIC_MAX]:
            r = routers.routers[rname]
            lag.add_metric([rname], r.lag)
            handled.add_metric([rname], r.forwarded_total)
        yield lag
        yield handled
        yield gauge("topics_records_live", "Live records across topics.", totals.records_live)
        yield gauge(
            "topics_bytes_live",
            "Live payload bytes across topics.",
            engine.total_bytes if totals.bytes_live is None else totals.bytes_live,
        )
        per = {
            "head_seq": ("topics_topic_head_seq", "Per-topic head."),
            "earliest_seq": ("topics_topic_earliest_seq", "Per-topic first live seq."),
            "count": ("topics_topic_records_live", "Per-topic live records."),
            "bytes": ("topics_topic_bytes_live", "Per-topic live bytes."),
        }
        families = {k: GaugeMetricFamily(n, d, labels=["topic"]) for k, (n, d) in per.items()}
        q_ready = GaugeMetricFamily(
            "topics_topic_queue_ready", "Queue topics only: claimable jobs.", labels=["topic"]
        )
        q_in_flight = GaugeMetricFamily(
            "topics_topic_queue_in_flight", "Queue topics only: active leases.", labels=["topic"]
        )
        q_by_prio = GaugeMetricFamily(
            "topicd_queue_ready_by_priority",
            f"Queue topics only: claimable jobs per priority, for the {READY_PRIORITIES_MAX} "
            "highest priorities holding jobs.",
            labels=["topic", "priority"],
        )
        names = totals.names
        for name in names[:PER_TOPIC_MAX]:
            t = topics.get(name)
            if t is None:
                continue  # (deleted since the totals were taken)
            for attr, family in families.items():
                family.add_metric([name], getattr(t, attr))
            if t.queue is not None:
                qc = engine.queues.counts(t)
                q_ready.add_metric([name], qc.ready)
                q_in_flight.add_metric([name], qc.in_flight)
                for prio, ready in t.queue.ready_by_priority(READY_PRIORITIES_MAX):
                    q_by_prio.add_metric([name, str(prio)], ready)
        yield from families.values()
        yield q_ready
        yield q_in_flight
        yield q_by_prio
        yield gauge(
            "topics_topic_metrics_truncated",
            "1 if per-topic series were capped at 1000 topics.",
            1 if totals.topics > PER_TOPIC_MAX else 0,
        )
        yield gauge("topics_queue_topics", "Queue topics.", queues)
        yield gauge(
            "topics_queue_leases_in_flight",
            "Active leases, all queues.",
            _in_flight(engine, self.counted),
        )
        watch = engine.watch
        yield gauge(
            "topics_sse_connections",
            "Open SSE and WebSocket connections.",
            watch.sse_connections(),
        )
        yield gauge("topics_watch_sessions", "Live watch sessions.", len(watch.sessions))
        ready = self.lifecycle.phase.value is Phase.SERVING
        yield gauge("topics_ready", "1 once recovery completed.", 1 if ready else 0)
        yield gauge(
            "topics_recovery_progress", "0.0-1.0; 1 when ready.", self.lifecycle.replay_progress
        )
        uptime = Metric("topics_uptime_ms", "Process uptime (ms).", "counter")
        uptime.add_sample("topics_uptime_ms", {}, self.lifecycle.uptime_ms())
        yield uptime
        wal = engine.commit
        if isinstance(wal, WalCommitPath):
            yield from self._wal(wal)
        info = GaugeMetricFamily("topicd_build_info", "Always 1.", labels=["version", "python"])
        info.add_metric([__version__, platform.python_version()], 1)
        yield info
        yield gauge("topicd_pressure", "Governor pressure 0.0-1.0.", engine.pressure)
        yield from self._governor(engine)
        yield from self._classes()
        yield from self._saturation(engine)
        throttled = CounterMetricFamily(
            "topicd_throttled_total", "429 responses issued, by cause.", labels=["cause"]
        )
        for cause in sorted(
            {
                "pressure",
                "limit",
                "wal_ingest",
                "client_waiters",
                "loop_lag",
                "wal_backlog",
                "write_delay",
                "queue_depth",
                *engine.throttled,
            }
        ):
            throttled.add_metric([cause], engine.throttled.get(cause, 0))
        yield throttled
        yield from self._delivery(engine)
        yield from self._jobs(engine, names[:PER_TOPIC_MAX])
        yield CounterMetricFamily(
            "topicd_records_appended",
            "Records appended to topics since start (writes, router copies, dead-letter moves).",
            value=_appended(engine, self.counted),
        )

    def _jobs(self, engine: Engine, names: list[str]) -> Iterator[Metric]:
        """Queue topics (of the first 1000 topics by name): nack-delayed or backing-off
        jobs, attached `/work` streams and the wall time of the last claim, extend, ack
        and nack (0: none since the queue was created or the server started)."""
        delayed = GaugeMetricFamily(
            "topicd_jobs_delayed",
            "Jobs waiting out a nack delay or a retry backoff.",
            labels=["topic"],
        )
        streams = GaugeMetricFamily(
            "topicd_jobs_work_streams", "Attached /work streams.", labels=["topic"]
        )
        last = GaugeMetricFamily(
            "topicd_jobs_last_op_ms",
            "Wall time (ms since the epoch) of the last claim, extend, ack or nack; 0: none.",
            labels=["topic", "op"],
        )
        for name in names:
            t = engine.topics.get(name)
            q = None if t is None else t.queue
            if t is None or q is None:
                continue  # (not a queue, or deleted since the totals were taken)
            delayed.add_metric([name], engine.queues.counts(t).delayed)
            streams.add_metric([name], len(q.workers))
            for op, ms in q.last_ms.items():
                last.add_metric([name, op], ms)
        yield delayed
        yield streams
        yield last

    def _saturation(self, engine: Engine) -> Iterator[Metric]:
        """Every registered bounded queue (scheduler spec R4, R5); with `counted`, a
        queue topic's level only if its topic is counted."""
        queues = [
            q
            for q in engine.saturation.queues.values()
            if self.counted is None or _level_counted(q.name, self.counted)
        ]
        fams = {
            "depth": GaugeMetricFamily("topicd_queue_depth", "Items queued.", labels=["queue"]),
            "capacity": GaugeMetricFamily(
                "topicd_queue_capacity", "Queue bound (0 = bounded elsewhere).", labels=["queue"]
            ),
            "saturation": GaugeMetricFamily(
                "topicd_queue_saturation", "Depth / capacity (alert above 0.8).", labels=["queue"]
            ),
            "peak": GaugeMetricFamily("topicd_queue_peak", "Highest depth seen.", labels=["queue"]),
            "level": GaugeMetricFamily(
                "topicd_queue_level",
                "0 normal, 1 warning, 2 critical, 3 overflow.",
                labels=["queue"],
            ),
        }
        full = CounterMetricFamily(
            "topicd_queue_full_total", "Times the queue was found full.", labels=["queue"]
        )
        changes = CounterMetricFamily(
            "topicd_queue_level_changes_total",
            "Level changes, by the level entered.",
            labels=["queue", "level"],
        )
        for q in queues:
            depth = q.depth()
            fams["depth"].add_metric([q.name], depth)
            fams["capacity"].add_metric([q.name], q.capacity())
            fams["saturation"].add_metric([q.name], q.saturation())
            fams["peak"].add_metric([q.name], max(q.peak, depth))
            fams["level"].add_metric([q.name], q.level)
            full.add_metric([q.name], q.full() if q.full is not None else 0)
            for level, n in sorted(q.changes.items()):
                changes.add_metric([q.name, LEVELS[level]], n)
        yield from fams.values()
        yield full
        yield changes

    def _classes(self) -> Iterator[Metric]:
        """Client permits (scheduler spec R1)."""
        permits = self.ref.permits
        if permits is None:
            return
        st = permits.stats
        yield gauge_of("topicd_client_permits", "Client permits (capacity).", st.capacity)
        yield gauge_of("topicd_client_permits_in_use", "Client permits held now.", st.in_use)
        yield gauge_of("topicd_client_waiters", "Client requests waiting for a permit.", st.waiting)
        admitted = st.waited or 1
        wait = GaugeMetricFamily(
            "topicd_class_wait_ms",
            "Mean wait for a permit of the requests that waited (ms), by work class.",
            labels=["class"],
        )
        wait.add_metric(["client"], st.wait_s_total * 1000 / admitted)
        yield wait

    def _governor(self, engine: Engine) -> Iterator[Metric]:
        """The governor's signals and the ladder's controls (scheduler spec B.5)."""
        gov = engine.governor
        signals = GaugeMetricFamily(
            "topicd_pressure_signal",
            "Governor input signals 0.0-1.0 (depth, latency, pool, admission, backlog, "
            "sojourn); "
            "pressure follows the max.",
            labels=["signal"],
        )
        for name, value in gov.signals.items():
            signals.add_metric([name], value)
        yield signals
        yield gauge_of(
            "topicd_coalesce_window_ms", "Delivery coalescing window (ms).", gov.coalesce_ms
        )
        yield gauge_of(
            "topicd_commit_window_ms", "WAL group-commit window (ms).", gov.commit_window_ms
        )
        yield gauge_of(
            "topicd_defer_active",
            "1 while low-priority push is deferred.",
            1 if gov.defer_active else 0,
        )
        yield CounterMetricFamily(
            "topicd_defer_episodes_total",
            "Times deferral started.",
            value=gov.stats.defer_episodes,
        )
        yield gauge_of(
            "topicd_sched_latency_ms",
            "Scheduling latency EWMA: drain start minus ripe time (ms).",
            engine.sched.stats.ewma_sched_ms,
        )
        stats = engine.sched.stats
        yield histogram(
            "topicd_sched_latency_seconds",
            "Scheduling latency per drain: drain start minus the topic's ripe time.",
            [b / 1000 for b in SCHED_BUCKETS_MS],
            stats.latency_buckets,
            stats.latency_ms_total / 1000,
        )
        yield gauge_of(
            "topicd_loop_lag_ms", "Event-loop lag EWMA: one scheduling batch (ms).", gov.loop_lag_ms
        )
        yield gauge_of(
            "topicd_write_sojourn_ms",
            "Median time from a client write's whole request read to its answer, over the "
            "writes answered in the last governor.sojourn_window_ms that met another write "
            "in the server (ms; 0 when none did).",
            gov.sojourn_ms,
        )
        dropped = CounterMetricFamily(
            "topicd_dropped_total",
            "Non-critical items dropped at a full queue, by kind (never data).",
            labels=["kind"],
        )
        dropped.add_metric(["sse_advisory"], engine.watch.stats.advisories_dropped)
        hub = self.ref.dashboard
        dropped.add_metric(["dashboard"], 0 if hub is None else hub.dropped)
        yield dropped

    def _delivery(self, engine: Engine) -> Iterator[Metric]:
        """The watch and the delivery scheduler (scheduler spec B, R4)."""
        watch = engine.watch
        sched = engine.sched
        stats = sched.stats

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        served = CounterMetricFamily(
            "topicd_http_requests_total",
            "HTTP requests, by server path (topicd's direct socket loop or Hypercorn).",
            labels=["path"],
        )
        for server_path, n in sorted(self.ref.requests_by_path.items()):
            served.add_metric([server_path], n)
        yield served
        opened = CounterMetricFamily(
            "topicd_sse_streams_opened_total",
            "SSE streams opened, by write path (direct socket or Hypercorn's ASGI send).",
            labels=["path"],
        )
        opened.add_metric(["direct"], watch.stats.streams_direct)
        opened.add_metric(["asgi"], watch.stats.streams_opened - watch.stats.streams_direct)
        yield opened
        yield counter(
            "topicd_sse_lagged_total",
            "SSE and WebSocket connections marked lagged (queue full: they re-read from the log).",
            watch.stats.lagged,
        )
        yield counter(
            "topicd_sse_slow_closed_total",
            "SSE streams closed by the slow-consumer timeout.",
            watch.stats.slow_closed,
        )
        yield gauge_of(
            "topicd_sse_lagged",
            "SSE and WebSocket connections lagged now.",
            sum(1 for c in watch.conns if c.lagged) + sum(1 for c in watch.ws_conns if c.lagged),
        )
        ready = GaugeMetricFamily(
            "topicd_sched_ready", "Dirty topics queued per band.", labels=["shard", "band"]
        )
        for shard in sched.shards:
            for i, depth in enumerate(shard.ready.stats.depth):
                ready.add_metric([str(shard.index), f"B{4 - i}"], depth)
        yield ready
        served = CounterMetricFamily(
            "topicd_sched_served_total", "Drains picked per band.", labels=["band"]
        )
        totals = [0] * 5
        for shard in sched.shards:
            for i, n in enumerate(shard.ready.stats.served):
                totals[i] += n
        for i, n in enumerate(totals):
            served.add_metric([f"B{4 - i}"], n)
        yield served
        yield counter("topicd_sched_drains_total", "Topic drains run.", stats.drains)
        yield counter(
            "topicd_sched_frames_offered_total",
            "Frames offered to live SSE connections (one per connection per frame).",
            stats.frames_offered,
        )
        yield counter(
            "topicd_sched_delay_seconds_total",
            "Summed wait from marked dirty to drained (divide by drains for the mean).",
            stats.sched_delay_s_total,
        )
        yield gauge_of(
            "topicd_sched_delay_max_ms",
            "Longest wait from marked dirty to drained since start (ms).",
            stats.sched_delay_s_max * 1000,
        )

    def _wal(self, wal: WalCommitPath) -> Iterator[Metric]:
        shards = wal.shards

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield counter(
            "topics_wal_frames_total", "WAL frames written.", sum(s.frames_written for s in shards)
        )
        yield counter(
            "topics_wal_batches_total", "Group-commit batches.", sum(s.batches for s in shards)
        )
        yield counter(
            "topics_wal_fsyncs_total", "Group-commit fsyncs.", sum(s.fsyncs for s in shards)
        )
        yield counter(
            "topics_wal_bytes_written_total",
            "Bytes appended to the WAL.",
            sum(s.bytes_written for s in shards),
        )
        yield counter(
            "topics_wal_rotations_total", "WAL file rotations.", sum(s.rotations for s in shards)
        )
        yield GaugeMetricFamily(
            "topics_wal_queue_depth",
            "Submissions accepted but not yet committed.",
            value=sum(s.pending for s in shards),
        )
        yield GaugeMetricFamily(
            "topics_wal_queue_depth_peak",
            "High-water mark of the queue depth.",
            value=sum(s.pending_peak for s in shards),
        )
        yield counter(
            "topics_wal_submit_full_total",
            "Submissions refused because the ingest queue was full.",
            sum(s.submit_full for s in shards),
        )
        states = [s.breaker.poll() for s in shards]
        yield GaugeMetricFamily(
            "topics_wal_read_only",
            "1 if any WAL shard's breaker is open.",
            value=1 if any(st.value == 2 for st in states) else 0,
        )
        buckets = [0] * (len(FSYNC_BUCKETS_US) + 1)
        for s in shards:
            for i, n in enumerate(s.fsync_buckets):
                buckets[i] += n
        yield histogram(
            "topics_wal_fsync_latency_us",
            "Fsync latency in microseconds.",
            list(FSYNC_BUCKETS_US),
            buckets,
            sum(s.fsync_us_total for s in shards),
        )
        breaker = GaugeMetricFamily(
            "topicd_breaker_state",
            "Storage breaker per shard: 0 closed, 1 half-open, 2 open.",
            labels=["shard"],
        )
        trips = CounterMetricFamily(
            "topicd_breaker_trips_total", "Breaker trips per shard.", labels=["shard"]
        )
        pending = GaugeMetricFamily(
            "topicd_wal_pending", "Accepted, uncommitted submissions per shard.", labels=["shard"]
        )
        for s, st in zip(shards, states, strict=True):
            breaker.add_metric([str(s.index)], int(st))
            trips.add_metric([str(s.index)], s.breaker.trips)
            pending.add_metric([str(s.index)], s.pending)
        yield breaker
        yield trips
        yield pending
        yield counter(
            "topicd_wal_records_synced_total",
            "Records made durable by group-commit fsyncs (÷ fsyncs = records per fsync).",
            sum(s.records_synced for s in shards),
        )
        cp = self.ref.engine.checkpointer
        count = getattr(cp, "count", 0)
        yield counter("topicd_checkpoints_total", "Checkpoints taken.", count)
        yield counter(
            "topicd_checkpoint_failures_total",
            "Checkpoints that failed.",
            getattr(cp, "failures", 0),
        )
        yield GaugeMetricFamily(
            "topicd_checkpoint_duration_ms",
            "Duration of the last checkpoint.",
            value=getattr(cp, "last_duration_ms", 0.0),
        )
        yield GaugeMetricFamily(
            "topicd_checkpoint_loop_stall_ms",
            "Longest single event-loop step of the last checkpoint's own work.",
            value=getattr(cp, "last_stall_ms", 0.0),
        )
        yield GaugeMetricFamily(
            "topicd_checkpoint_other_stall_ms",
            "Longest single event-loop step of any other task while the last checkpoint ran.",
            value=getattr(cp, "last_other_stall_ms", 0.0),
        )
        yield GaugeMetricFamily(
            "topicd_snapshot_bytes",
            "Size of the last snapshot.",
            value=getattr(cp, "last_bytes", 0),
        )
        seg: dict[str, int] = getattr(getattr(cp, "segments", None), "stats", dict)()
        yield counter(
            "topicd_segment_corruption_total",
            "Segment reads that failed their checksum (never served).",
            seg.get("corruptions", 0),
        )
        yield GaugeMetricFamily(
            "topicd_segments", "Segment files registered.", value=seg.get("segments", 0)
        )
        yield GaugeMetricFamily(
            "topicd_segment_bytes", "Bytes in registered segments.", value=seg.get("bytes", 0)
        )
        yield GaugeMetricFamily(
            "topicd_cold_segments",
            "Registered segments in the cold tier (storage.cold_dir).",
            value=seg.get("cold_segments", 0),
        )
        yield GaugeMetricFamily(
            "topicd_cold_segment_bytes",
            "Bytes in registered segments in the cold tier.",
            value=seg.get("cold_bytes", 0),
        )
        yield counter(
            "topicd_segments_relocated_total",
            "Sealed segments relocated to the cold tier.",
            seg.get("relocated", 0),
        )
        yield counter(
            "topicd_cold_segments_read_total",
            "Segment reads served from the cold tier.",
            seg.get("cold_reads", 0),
        )
        pc = self.ref.engine.payloads.stats()
        yield GaugeMetricFamily(
            "topicd_payload_cache_bytes",
            "Payload bytes of absorbed records held in memory (bound: "
            "storage.payload_cache_bytes).",
            value=pc.bytes,
        )
        yield counter(
            "topicd_payload_cache_misses_total",
            "Reads that loaded evicted records from the segments.",
            pc.misses,
        )
        yield counter(
            "topicd_payload_cache_loaded_bytes_total",
            "Payload bytes loaded from the segments on a miss.",
            pc.loaded_bytes,
        )
        yield counter(
            "topicd_payload_cache_evictions_total",
            "Chunks of absorbed records whose payloads left memory.",
            pc.evicted_chunks,
        )
        rec = self.ref.engine.recovery
        yield GaugeMetricFamily(
            "topicd_recovery_duration_ms",
            "Time recovery took at start.",
            value=float(rec.get("duration_ms", 0.0)),
        )
        yield counter(
            "topicd_recovery_lost_tail_seqs_total",
            "Seqs recorded as possibly lost in a machine crash (lost ranges).",
            float(rec.get("lost_tail_seqs", 0)),
        )


class _One:
    """A registry of one metric family (what `generate_latest` reads)."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        yield self.family


async def prometheus_text(ref: EngineRef, lifecycle: Lifecycle) -> bytes:
    """The Prometheus text, a family a step: with a thousand topics the per-topic families
    are thousands of samples, and writing them all at once was a 20-40 ms step of the
    loop (one of 50-90 ms at 100,000 topics); the sums over every topic are taken first,
    `_AGGREGATE_SLICE` topics a step. Each family is consistent; two may be a few steps
    apart."""
    totals = await _totals(ref.engine)
    parts: list[bytes] = []
    for family in _Collector(ref, lifecycle, totals).collect():
        await trio.lowlevel.checkpoint()
        parts.append(generate_latest(cast("CollectorRegistry", _One(family))))
    return _uptime_header(b"".join(parts))


def _uptime_header(text: bytes) -> bytes:
    return text.replace(b"# HELP topics_uptime_ms_total ", b"# HELP topics_uptime_ms ").replace(
        b"# TYPE topics_uptime_ms_total counter", b"# TYPE topics_uptime_ms counter"
    )


def _appended(engine: Engine, counted: Counted | None) -> int:
    """Records appended since start; on a deployment of several processes (`counted`),
    only those this one published (each record once: by the process that wrote it)."""
    if counted is None:
        return engine.records_appended
    return engine.records_appended - engine.records_followed


def _work_elsewhere(engine: Engine, counted: Counted) -> dict[str, int]:
    """`/work` streams attached here to queues whose figures this process does not count
    (the process counting them adds these to its own)."""
    out: dict[str, int] = {}
    for name, t in list(engine.queues.topics.items()):
        q = t.queue
        if q is not None and q.workers and not counted(name):
            out[name] = len(q.workers)
    return out


async def front_figures(
    ref: EngineRef, lifecycle: Lifecycle, head: dict[str, JsonValue], counted: Counted
) -> JsonValue:
    """This process's figures, as another process of the deployment asked for them
    (`Engine.figures`): the families it merges (`merge_metrics.carried`), or with
    `form` = `json` the JSON snapshot, the topic figures counting the topics `counted`."""
    engine = ref.engine
    work: dict[str, JsonValue] = dict(_work_elsewhere(engine, counted))
    if head.get("form") == "json":
        await trio.lowlevel.checkpoint()
        return {"json": json_snapshot(ref, lifecycle, counted), "work": work}
    totals = await _totals(engine, counted)
    families: list[JsonValue] = []
    for family in _Collector(ref, lifecycle, totals, counted).collect():
        if merge_metrics.carried(family):
            await trio.lowlevel.checkpoint()
            families.append(merge_metrics.wire_family(family))
    return {"families": families, "work": work}


@dataclass(slots=True)
class _Gathered(Generic[_T]):
    """The other processes' figures for one scrape, checked (`merge_metrics`)."""

    live: int  # processes of the deployment, this one included
    answers: list[_T]  # the figures of those that answered in the expected shape
    missing: list[str]  # the ids of the others
    work: dict[str, int]  # `/work` streams of queues each did not count, summed
    covered: set[int]  # shards whose topics the answers count

    def answered(self) -> int:
        return self.live - len(self.missing)


async def _gather(
    engine: Engine, peers: Peers, form: str, check: Callable[[JsonValue], tuple[_T, Work] | None]
) -> tuple[_Gathered[_T], Counted]:
    """Ask the other processes (`Peers.gather_figures`); also which topics this one
    counts: those of the shards no answer covers (its own, and those of a process that
    did not answer, from what this one knows of them)."""
    gathered = await peers.gather_figures({"form": form})
    out = _Gathered[_T](gathered.live, [], list(gathered.missing), {}, set())
    for answer in gathered.answers:
        checked = check(answer.figures)
        if checked is None:
            out.missing.append(answer.front)
            continue
        out.answers.append(checked[0])
        merge_metrics.add_work(out.work, checked[1])
        out.covered |= answer.shards
    covered = out.covered

    def counted(name: str) -> bool:
        return peers.shard_of(name) not in covered

    merge_metrics.add_work(out.work, _work_elsewhere(engine, counted))
    return out, counted


async def deployment_text(ref: EngineRef, lifecycle: Lifecycle, peers: Peers) -> bytes:
    """`prometheus_text` for the whole deployment: the other processes' figures merged
    into this one's (`merge_metrics`), then `topicd_fronts_live`/`_answered`."""
    engine = ref.engine
    got, counted = await _gather(engine, peers, "text", merge_metrics.text_answer)
    totals = await _totals(engine, counted)
    names = merge_metrics.topic_names(totals.names, got.answers)
    topics = merge_metrics.topic_count(totals.topics, got.answers)
    parts: list[bytes] = []
    families = [
        *_Collector(ref, lifecycle, totals, counted).collect(),
        *merge_metrics.fronts_families(got.live, got.answered()),
    ]
    for family in families:
        await trio.lowlevel.checkpoint()
        merged = merge_metrics.merge_family(family, got.answers, names, got.work, topics)
        parts.append(generate_latest(cast("CollectorRegistry", _One(merged))))
    return _uptime_header(b"".join(parts))


async def deployment_json(ref: EngineRef, lifecycle: Lifecycle, peers: Peers) -> JsonValue:
    """`json_snapshot` for the whole deployment (`merge_metrics.merge_json`), with
    `fronts`: how many are live, answered, and the ids of those that did not."""
    got, counted = await _gather(ref.engine, peers, "json", merge_metrics.json_answer)
    own = json_snapshot(ref, lifecycle, counted)
    merge_metrics.merge_json(own, got.answers, got.work)
    missing: list[JsonValue] = [*sorted(got.missing)]
    own["fronts"] = {"live": got.live, "answered": got.answered(), "missing": missing}
    return own


def json_snapshot(
    ref: EngineRef, lifecycle: Lifecycle, counted: Counted | None = None
) -> dict[str, JsonValue]:
    """The JSON form of the metrics (floats rounded by `tidy_floats`); with `counted`,
    its topic figures count only those topics (see `_Collector`)."""
    engine = ref.engine
    topics = (
        engine.topics if counted is None else {n: t for n, t in engine.topics.items() if counted(n)}
    )
    counts = dict.fromkeys(CLASSES, 0)
    for t in topics.values():
        counts[t.config.durability] += 1
    out: dict[str, JsonValue] = {
        "topics": len(topics),
        **{f"topics_{c}": counts[c] for c in CLASSES},
        "routers": len(engine.routers.routers),
        "records_live": sum(t.count for t in topics.values()),
        "bytes_live": (
            engine.total_bytes if counted is None else sum(t.bytes for t in topics.values())
        ),
        "queue_topics": sum(1 for t in topics.values() if t.config.type == "queue"),
        "queue_leases_in_flight": _in_flight(engine, counted),
        "sse_connections": engine.watch.sse_connections(),
        "watch_sessions": len(engine.watch.sessions),
        "ready": lifecycle.phase.value is Phase.SERVING,
        "replay_progress": lifecycle.replay_progress,
        "uptime_ms": lifecycle.uptime_ms(),
        "pressure": engine.pressure,
        "governor": governor_snapshot(engine),
        "records_appended": _appended(engine, counted),
    }
    out["queues"] = queues_snapshot(engine, counted)
    out["internal_queues"] = saturation_snapshot(engine, counted)
    out["breakers"] = breakers_snapshot(engine)
    wal = engine.commit
    if isinstance(wal, WalCommitPath):
        shards = wal.shards
        fsyncs = sum(s.fsyncs for s in shards)
        out["wal"] = {
            "fsyncs": fsyncs,
            "frames": sum(s.frames_written for s in shards),
            "batches": sum(s.batches for s in shards),
            "bytes_written": sum(s.bytes_written for s in shards),
            "rotations": sum(s.rotations for s in shards),
            "queue_depth": sum(s.pending for s in shards),
            "queue_depth_peak": sum(s.pending_peak for s in shards),
            "submit_full_total": sum(s.submit_full for s in shards),
            "read_only": 1 if any(s.breaker.poll().value == 2 for s in shards) else 0,
            "fsync_count": fsyncs,
            "fsync_micros_total": int(sum(s.fsync_us_total for s in shards)),
            "records_synced": sum(s.records_synced for s in shards),
        }
    tidy = tidy_floats(out)
    assert isinstance(tidy, dict)
    return tidy


def governor_snapshot(engine: Engine) -> dict[str, JsonValue]:
    """The governor's signals and the ladder's controls (scheduler spec B.5)."""
    gov = engine.governor
    return {
        "signals": dict(gov.signals),
        "coalesce_window_ms": gov.coalesce_ms,
        "commit_window_ms": gov.commit_window_ms,
        "defer_active": gov.defer_active,
        "loop_lag_ms": gov.loop_lag_ms,
        "sched_latency_ms": engine.sched.stats.ewma_sched_ms,
    }


def _level_counted(name: str, counted: Counted) -> bool:
    """Whether a saturation registry entry is counted: a queue topic's depth level when
    its topic is; every other (this process's own queues) always."""
    return not name.startswith(LEVEL_PREFIX) or counted(name[len(LEVEL_PREFIX) :])


def saturation_snapshot(engine: Engine, counted: Counted | None = None) -> list[JsonValue]:
    """Every registered bounded queue (the `topicd_queue_*{queue}` series), by name;
    with `counted`, a queue topic's level only if its topic is counted."""
    out: list[JsonValue] = []
    for name in sorted(engine.saturation.queues):
        if counted is not None and not _level_counted(name, counted):
            continue
        q = engine.saturation.queues[name]
        depth = q.depth()
        out.append(
            {
                "name": name,
                "depth": depth,
                "capacity": q.capacity(),
                "saturation": q.saturation(),
                "peak": max(q.peak, depth),
                "level": LEVELS[q.level],
                "full_total": q.full() if q.full is not None else 0,
            }
        )
    return out


def breakers_snapshot(engine: Engine) -> list[JsonValue]:
    """The storage breaker of every WAL shard (empty without a WAL)."""
    wal = engine.commit
    if not isinstance(wal, WalCommitPath):
        return []
    return [
        {
            "shard": s.index,
            "state": s.breaker.poll().name.lower(),
            "trips": s.breaker.trips,
            "pending": s.pending,
        }
        for s in wal.shards
    ]


def routers_snapshot(engine: Engine, top: int) -> list[JsonValue]:
    """The `top` routers with the largest cursor lag (then by name)."""
    routers = engine.routers.routers
    ranked = sorted(routers.values(), key=lambda r: (-r.lag, r.d.name))[:top]
    return [
        {
            "router": r.d.name,
            "source": r.d.source,
            "dest": r.d.dest,
            "cursor": r.cursor,
            "lag": r.lag,
            "blocked": r.blocked,
            "forwarded_total": r.forwarded_total,
        }
        for r in ranked
    ]


def queues_snapshot(engine: Engine, counted: Counted | None = None) -> JsonValue:
    """Per queue topic (the first 1000 by name; of those `counted`): counts, the depth
    level, attached `/work` streams and the wall time of the last claim, extend, ack
    and nack."""
    out: dict[str, JsonValue] = {}
    queues = engine.queues
    saturation = engine.saturation.queues
    # (the queue topics only, not every topic: the dashboard calls this every second)
    for name in sorted(queues.topics):
        if counted is not None and not counted(name):
            continue
        t = queues.topics[name]
        q = t.queue
        assert q is not None
        if len(out) >= PER_TOPIC_MAX:
            break
        counts = queues.counts(t)
        entry = saturation.get(queues.level_name(t))
        level = entry.level if entry is not None and entry.owner is q else 0
        out[name] = {
            "ready": counts.ready,
            "in_flight": counts.in_flight,
            "delayed": counts.delayed,
            "dead_lettered": q.dead_lettered,
            "depth": q.depth(),
            "level": LEVELS[level],
            "work_streams": len(q.workers),
            **{f"last_{op}_ms": ms for op, ms in q.last_ms.items()},
        }
    return out


JSON_DECIMALS: Final = 4  # 0.0001 is the smallest non-zero value the snapshot shows


def tidy_floats(value: JsonValue) -> JsonValue:
    """`value` with every float rounded to `JSON_DECIMALS` decimals, recursively.

    Decaying EWMAs (pressure, loop lag, the governor's signals) approach zero without
    reaching it; unrounded they print as `3.8e-35`. Rounded, anything below half of
    0.0001 is `0.0`, and every non-zero value prints in plain decimal notation (orjson
    switches to an exponent only below 1e-5). `-0.0` becomes `0.0`. Ints and bools
    are kept as they are.
    """
    if isinstance(value, float):
        return round(value, JSON_DECIMALS) + 0.0
    if isinstance(value, dict):
        return {k: tidy_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [tidy_floats(v) for v in value]
    return value


SCOPES: Final = ("deployment", "front")


def register(app: QuartTrio, ref: EngineRef, config: Config, lifecycle: Lifecycle) -> None:
    def attach(engine: Engine) -> None:
        # (asked by the other processes of a deployment: `Engine.peers`)
        engine.figures = partial(front_figures, ref, lifecycle)

    attach(ref.engine)
    ref.on_engine.append(attach)

    async def metrics() -> Response:
        principal().require("read")
        scope = request.args.get("scope", "deployment")
        if scope not in SCOPES:
            raise InvalidRequest(
                f"query parameter 'scope' must be deployment or front, got {scope[:100]!r}",
                {"parameter": "scope"},
            )
        accept = request.headers.get("Accept", "")
        # one process, or its own figures only: its own; else the deployment's
        peers = None if scope == "front" else ref.engine.peers
        if "application/json" in accept:
            snap = (
                json_snapshot(ref, lifecycle)
                if peers is None
                else await deployment_json(ref, lifecycle, peers)
            )
            return Response(orjson.dumps(snap), content_type="application/json")
        text = (
            await prometheus_text(ref, lifecycle)
            if peers is None
            else await deployment_text(ref, lifecycle, peers)
        )
        return Response(text, content_type=PROMETHEUS_TYPE)

    app.add_url_rule("/v0/metrics", "metrics", metrics, methods=["GET"])


def histogram(
    name: str, doc: str, bounds: list[float], counts: list[int], total: float
) -> HistogramMetricFamily:
    """A histogram from per-bucket counts (`counts` has one more entry than `bounds`:
    the +Inf bucket)."""
    cumulative: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        running += n
        cumulative.append((bound, running))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)


def gauge_of(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
