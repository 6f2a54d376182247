"""The pressure governor (scheduler spec A.6, B.5).

One task samples every `governor.sample_interval_ms` (100 ms) and folds six cheap
signals into `pressure ∈ [0, 1]`:

* **s1 depth** — ripe dirty topics ÷ (delivery shards × `depth_per_worker`). Topics
  held back on purpose by the coalescing window are not ripe, so coalescing does not feed
  back into pressure;
* **s2 latency** — the larger of the scheduling-latency EWMA (drain start − `ripe_at`,
  kept by the scheduler per drain) and the loop-lag EWMA (how long a checkpoint of this
  task takes to come back: one scheduling batch, in a single-threaded loop the direct
  symptom of CPU saturation), ÷
  `latency_ceiling_ms`. When nothing is queued the scheduling EWMA decays by its own
  weight each sample (topicd decision: otherwise the last burst's latency would hold
  pressure up forever on an idle server). Capped at `latency_signal_max` (0.6, topicd
  decision): a loop at capacity is what saturation looks like, not overload, and its
  excess waits outside the loop, for a client permit, where s4 reads it. Past
  `loop_overload_ms` (25) the loop-lag EWMA is no longer one busy batch but a queue of
  requests on the loop (a request that finds a free permit runs in the batch it is read
  in, so the permits do not hold it back): s2 rises from the cap to 1.0 at
  `loop_refuse_ms` (100), where the HTTP gate refuses client requests once pressure has
  held the client's pause (`overloaded`, below; `429` cause `loop_lag`). A busy loop
  alone coalesces frames and widens commits, and reads as the client library's soft
  threshold, where its producers are not slowed yet; a backlog (s1, s3, s4, s5) takes
  pressure on to deferral, to the client's proportional delay and pause, and to the
  write throttle;
* **s3 pool** — the busiest offload group client work waits on (misc, read; not the
  checkpoints' `snapshot` group nor the WAL committers, see `WalCommitPath.pool_loads`):
  busy token-seconds over the interval ÷ (interval × tokens);
* **s4 admission** (topicd) — the mean number of client requests that waited for a
  permit over the interval (`admission_signal`), or 1.0 if any request was refused
  because the waiters were full. `admission_waiters_per_permit` (1) per permit is a
  saturated server and reads `latency_signal_max` (0.6, the client's soft threshold;
  proportional below); from there the signal rises to 1.0 when `admission_refuse_fill`
  (0.6) of the waiter slots are taken, ahead of the `429 client_waiters` (with the fill
  at 0, or at or below the saturation point, 1.0 at saturation). The permits keep each
  loop batch short, which is what keeps probes fast under a flood, but it also keeps CPU
  saturation out of s2: the excess waits outside the loop. This signal reads that queue,
  so the ladder still climbs when the server is saturated with more clients than
  permits, and producers pacing on the header slow down as the waiting room fills, not
  as soon as the server is merely busy (topicd decision, docs/decisions.md). Each answer's
  header also reads the room as it is when the answer is made
  (`Engine.pressure`, `Engine.admission_now`): a sample every 100 ms is too slow for a burst;
* **s5 backlog** (topicd) — the WAL's queue in time: the longest a shard's oldest
  accepted, uncommitted write has waited (queued or in the batch being written) ÷
  `storage.wal.max_pending_ms` (part of the shard's ingest fill, so pressure admission
  refuses writes to it once pressure reaches `throttle_at`). Writers sharing one group
  commit wait for the same `fdatasync` however many they are, so the concurrency a group
  commit absorbs reads as about one commit's time; a queue of batches behind the disk
  reads as the time it holds them, and rises before the refusal;
* **s6 sojourn** (topicd) — the median time from a client write's whole request in hand
  (head and body: a client slow to send its body is not the server's pressure) to its
  answer ready, over the writes answered in the last `sojourn_window_ms` (300;
  `topicd.sched.sojourn`): proportional up to `latency_signal_max` at
  `sojourn_overload_ms` (50), then linear to 1.0 at `sojourn_refuse_ms` (200). What each
  write actually waited, whichever queue held it: a permit, its parse, its commit. s2 and
  s5 read one queue each at the instant of a sample; a flood of large writes spreads its
  wait over both and swings from one sample to the next, while its writes wait a steady
  few hundred ms. Writers sharing a group commit (four times the peak concurrency of
  one-record writes) wait about 15 ms.

`raw = max(s1, s2, s3, s4, s5, s6)`; `pressure += ewma_alpha · (raw − pressure)`. From it, each
sample, the ladder's controls (all lossless: latency, never correctness):

* `coalesce_ms` = 0 up to `coalesce_above`, then linear to `coalesce_max_ms` at 1.0: a
  newly dirty topic waits that long before its drain, so a burst becomes one
  multi-record frame (the scheduler's ripeness delay);
* `commit_window_ms` = `commit_window_min_ms` up to `widen_above`, then linear to
  `commit_window_max_ms` at 1.0 (continuous at the threshold): WAL batches that sync
  wait longer for company, so fewer fsyncs carry more records;
* **defer** starts after `defer_sustain_samples` consecutive samples above
  `defer_above` and ends at the first sample below `defer_release_below`: B0 and
  negative-manual-priority topics get no scheduler credit (their data stays readable by
  diff), and each stream watching such a topic gets one advisory `error` 429 frame per
  episode;
* **pressure admission**: the WAL refuses writes with `429` when pressure reaches
  `throttle_at` and the target shard's ingest is at `levels.critical` (the WAL reads the
  pressure the governor hands it);
* **overload refusal** (topicd): once pressure has been at or above `refuse_above` (0.9,
  the client library's pause) for `refuse_sustain_samples` (3) samples in a row, and the
  loop's, the WAL's or the writes' own signal is at `refuse_above` too — a loop-lag EWMA
  of 81 ms of `loop_refuse_ms` (100), a WAL write's wait of 450 ms of
  `storage.wal.max_pending_ms` (500), a median write sojourn of 162.5 ms of
  `sojourn_refuse_ms` (200) — `overloaded` names that queue (`loop_lag`, `wal_backlog`,
  `write_delay`) and the HTTP gate
  refuses client requests with that `429` cause, from a glance at their head, until a
  sample finds otherwise. Producers that follow the header paused at the first of those
  samples and sent nothing since; the refusals are for those that did not.

`pressure` is published as a float attribute (atomic under the GIL): the WAL's, for its
admission and retry hints, and through it the ladder; and the engine's `pressure`
(`topicd_pressure`, and the `X-Topicd-Pressure` header with the waiting room read at the
answer, above), which is `Governor.published`: the smoothed pressure, never above the raw
maximum of the same sample, so producers see it rise smoothed and fall with the signals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Callable

    from topicd.config import BackpressureConfig, GovernorConfig

log = logging.getLogger("topicd.governor")


def coalesce_ms(pressure: float, cfg: GovernorConfig) -> float:
    """The coalescing window for `pressure` (0 at or below `coalesce_above`)."""
    lo = cfg.coalesce_above
    if pressure <= lo or lo >= 1:
        return 0.0
    return cfg.coalesce_max_ms * min(1.0, (pressure - lo) / (1 - lo))


def commit_window_ms(pressure: float, cfg: GovernorConfig) -> float:
    """The group-commit window for `pressure` (the minimum at or below `widen_above`)."""
    lo = cfg.widen_above
    if pressure <= lo or lo >= 1:
        return cfg.commit_window_min_ms
    span = cfg.commit_window_max_ms - cfg.commit_window_min_ms
    return cfg.commit_window_min_ms + span * min(1.0, (pressure - lo) / (1 - lo))


def sojourn_signal(median_ms: float, cfg: GovernorConfig) -> float:
    """s6 for a median write sojourn of `median_ms`: proportional up to
    `latency_signal_max` at `sojourn_overload_ms`, then linear to 1.0 at
    `sojourn_refuse_ms` (0 when that is 0: the signal is off)."""
    lo, hi, cap = cfg.sojourn_overload_ms, cfg.sojourn_refuse_ms, cfg.latency_signal_max
    if hi <= 0 or median_ms <= 0:
        return 0.0
    if lo <= 0 or lo >= hi:
        return 1.0 if median_ms >= hi else cap * min(1.0, median_ms / hi)
    if median_ms <= lo:
        return cap * median_ms / lo
    return cap + (1 - cap) * min(1.0, (median_ms - lo) / (hi - lo))


def admission_signal(waiting: float, permits: int, slots: int, cfg: GovernorConfig) -> float:
    """s4 for `waiting` client requests (mean over the interval) held for one of
    `permits`, with `slots` waiter slots before the `429 client_waiters`.

    The saturation scale (`admission_refuse_fill` 0, or a room whose refuse fill is at
    or below `admission_waiters_per_permit` per permit): 1.0 at that many per permit,
    proportional below. Otherwise two points: the soft point (`soft_point`) reads
    `latency_signal_max` (the client's soft threshold), proportional below it, and the
    signal rises from there to 1.0 when `admission_refuse_fill` of the slots are taken,
    ahead of the refusal."""
    p = max(permits, 1)
    sat = p * cfg.admission_waiters_per_permit
    refuse = cfg.admission_refuse_fill * slots
    if refuse <= sat:
        return min(1.0, waiting / sat)
    soft = soft_point(p, refuse, cfg)
    cap = cfg.latency_signal_max
    if waiting <= soft:
        return cap * waiting / soft
    return min(1.0, cap + (1 - cap) * (waiting - soft) / (refuse - soft))


def soft_point(permits: int, refuse: float, cfg: GovernorConfig) -> float:
    """The requests waiting at which s4 reads the client's soft threshold:
    `admission_soft_per_permit` per permit, at most half of the refuse fill (so the
    rise to 1.0 keeps room), never below `admission_waiters_per_permit` per permit."""
    sat = permits * cfg.admission_waiters_per_permit
    return max(sat, min(permits * cfg.admission_soft_per_permit, refuse / 2))


def retry_after_ms(pressure: float, cfg: BackpressureConfig, drain_ms: float = 0.0) -> float:
    """Scheduler spec B.5 before jitter: `clamp(max(min + span·pressure, drain_ms), min,
    max)`, `drain_ms` being how long the queue in question needs to drain."""
    ms = max(cfg.retry_after_min_ms + cfg.retry_after_pressure_span_ms * pressure, drain_ms)
    return min(max(ms, cfg.retry_after_min_ms), cfg.retry_after_max_ms)


class Sources:
    """What the governor reads and drives (the engine wires its parts in)."""

    def __init__(
        self,
        *,
        workers: int,
        ripe: Callable[[], int],
        queued: Callable[[], int],
        sched_latency_ms: Callable[[], float],
        decay_sched_latency: Callable[[float], None],
        pool_loads: Callable[[float], list[tuple[str, float, int]]],
        admission: Callable[[float], tuple[float, int, int, int]] | None = None,
        backlog: Callable[[], float] | None = None,
        sojourn: Callable[[float], float | None] | None = None,
        apply: Callable[[float, float, float], None],
        set_defer: Callable[[bool], None],
        on_sample: Callable[[float], None] | None = None,
        publish: Callable[[float], None] | None = None,
    ) -> None:
        self.workers = workers
        self.ripe = ripe
        self.queued = queued
        self.sched_latency_ms = sched_latency_ms
        self.decay_sched_latency = decay_sched_latency
        self.pool_loads = pool_loads
        # at a time: (request-seconds spent waiting for a client permit so far,
        # requests refused so far because the waiters were full, permits, waiter slots)
        self.admission = admission
        # the WAL's queue in time: the fullest shard's drain time ÷ its time bound
        self.backlog = backlog
        # at a time: the median sojourn (ms) of the client writes answered lately, or
        # None when none was (`topicd.sched.sojourn.Sojourns.median_ms`)
        self.sojourn = sojourn
        self.apply = apply  # (pressure, coalesce_ms, commit_window_ms)
        # the pressure producers read (`Governor.published`), after `apply`
        self.publish = publish
        self.set_defer = set_defer
        self.on_sample = on_sample  # e.g. the saturation registry's peaks and levels


@dataclass
class GovernorStats:
    samples: int = 0
    defer_episodes: int = 0
    pressure_max: float = 0.0


class Governor:
    def __init__(self, cfg: GovernorConfig, sources: Sources) -> None:
        self.cfg = cfg
        self.src = sources
        self.pressure = 0.0
        self.raw = 0.0  # the largest signal at the last sample, before smoothing
        self.signals = {
            "depth": 0.0,
            "latency": 0.0,
            "pool": 0.0,
            "admission": 0.0,
            "backlog": 0.0,
            "sojourn": 0.0,
        }
        self.sojourn_ms = 0.0  # the median write sojourn at the last sample (0: none)
        self.loop_lag_ms = 0.0  # EWMA
        self.coalesce_ms = 0.0
        self.commit_window_ms = cfg.commit_window_min_ms
        self.defer_active = False
        # the queue at its time bound while pressure held the client's pause ("loop_lag",
        # "wal_backlog"), or None: the HTTP gate refuses client requests with that cause
        self.overloaded: str | None = None
        self._held = 0  # consecutive samples at or above refuse_above
        self._above = 0  # consecutive samples above defer_above
        self._pools: dict[str, tuple[float, float]] = {}  # group -> (integral, at)
        self._admission: tuple[float, int, float] | None = None  # (area, refused, at)
        self.stats = GovernorStats()

    @property
    def published(self) -> float:
        """The pressure producers pace on: the smoothed pressure, never above the raw
        signal of the same sample. Smoothing suits the ladder (a burst must not swing
        the commit window), and for a producer it delays a rise, which the live waiting
        room covers (`Engine.pressure`); but a fall delayed by it tells producers to
        wait for hundreds of ms after the queue behind the reading has drained, and the
        server idles (docs/decisions.md)."""
        return min(self.pressure, self.raw)

    def sample(self, now: float, lag_ms: float = 0.0) -> None:
        """One governor step at Trio time `now`; `lag_ms`: how late this tick fired."""
        cfg = self.cfg
        src = self.src
        self.loop_lag_ms += cfg.loop_lag_alpha * (lag_ms - self.loop_lag_ms)
        if src.queued() == 0:
            src.decay_sched_latency(cfg.sched_latency_alpha)
        depth = min(1.0, src.ripe() / (max(src.workers, 1) * cfg.depth_per_worker))
        latency = min(
            cfg.latency_signal_max,
            max(src.sched_latency_ms(), self.loop_lag_ms) / cfg.latency_ceiling_ms,
        )
        lo, hi = cfg.loop_overload_ms, cfg.loop_refuse_ms
        if hi > lo and self.loop_lag_ms > lo:
            # a loop batch this long is a queue of requests on the loop: it rises from
            # the cap to 1.0 at the refusal bound
            cap = cfg.latency_signal_max
            latency = max(latency, cap + (1 - cap) * min(1.0, (self.loop_lag_ms - lo) / (hi - lo)))
        pool = 0.0
        for group, integral, tokens in src.pool_loads(now):
            prev = self._pools.get(group)
            self._pools[group] = (integral, now)
            if prev is not None and now > prev[1]:
                busy = (integral - prev[0]) / ((now - prev[1]) * tokens)
                pool = max(pool, min(1.0, max(0.0, busy)))
        admission = 0.0
        if src.admission is not None and cfg.admission_waiters_per_permit > 0:
            area, refused, permits, slots = src.admission(now)
            last = self._admission
            self._admission = (area, refused, now)
            if last is not None and now > last[2]:
                mean_waiting = (area - last[0]) / (now - last[2])
                admission = (
                    1.0
                    if refused > last[1]
                    else admission_signal(mean_waiting, permits, slots, cfg)
                )
        self.signals["depth"] = depth
        self.signals["latency"] = latency
        self.signals["pool"] = pool
        backlog = min(1.0, max(0.0, src.backlog())) if src.backlog is not None else 0.0
        self.signals["admission"] = admission
        self.signals["backlog"] = backlog
        median = src.sojourn(now) if src.sojourn is not None else None
        self.sojourn_ms = median or 0.0
        sojourn = sojourn_signal(self.sojourn_ms, cfg)
        self.signals["sojourn"] = sojourn
        self.raw = raw = max(depth, latency, pool, admission, backlog, sojourn)
        p = self.pressure + cfg.ewma_alpha * (raw - self.pressure)
        self.pressure = p = min(1.0, max(0.0, p))
        self._held = self._held + 1 if p >= cfg.refuse_above else 0
        over: str | None = None
        if self._held >= cfg.refuse_sustain_samples:
            # the queue whose own signal is at the pause too
            if hi > lo and self.loop_lag_ms > lo and latency >= cfg.refuse_above:
                over = "loop_lag"
            elif backlog >= cfg.refuse_above:
                over = "wal_backlog"
            elif sojourn >= cfg.refuse_above:
                over = "write_delay"
        self.overloaded = over
        self.coalesce_ms = coalesce_ms(p, cfg)
        self.commit_window_ms = commit_window_ms(p, cfg)
        src.apply(p, self.coalesce_ms, self.commit_window_ms)
        if src.publish is not None:
            src.publish(self.published)
        self._above = self._above + 1 if p > cfg.defer_above else 0
        if not self.defer_active and self._above >= cfg.defer_sustain_samples:
            self.defer_active = True
            self.stats.defer_episodes += 1
            log.warning("pressure %.2f: deferring low-priority push", p)
            src.set_defer(True)
        elif self.defer_active and p < cfg.defer_release_below:
            self.defer_active = False
            log.info("pressure %.2f: low-priority push resumed", p)
            src.set_defer(False)
        if src.on_sample is not None:
            src.on_sample(now)
        self.stats.samples += 1
        self.stats.pressure_max = max(self.stats.pressure_max, p)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sample every `sample_interval_ms`.

        Loop lag is measured as the time one checkpoint takes to come back to this task:
        the length of one scheduling batch, i.e. how long any runnable task waits for
        the loop. (How late the timer fired measures the same on a real clock, but a test
        clock that jumps would read as lag.)"""
        interval = self.cfg.sample_interval_ms / 1000
        task_status.started()
        while True:
            await trio.sleep(interval)
            t0 = trio.current_time()
            await trio.lowlevel.checkpoint()
            now = trio.current_time()
            self.sample(now, (now - t0) * 1000)
