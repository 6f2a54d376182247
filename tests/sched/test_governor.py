"""The pressure governor and its ladder (scheduler spec A.6-A.7, B.5).

Method: the governor's arithmetic against scripted signals (`FakeSources`: every number
below follows from the spec's formulas and the default `[governor]` keys), then each rung
inside a running engine on Trio's `MockClock`: coalescing packs a burst into one frame,
the commit window reaches the WAL shards, deferral pauses negative-priority push with one
advisory frame per episode, and a saturated WAL (a virtual 100 ms sync) drives pressure
to the `429` rung through the real signals.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest
import trio
import trio.lowlevel
import trio.testing

from tests.sched.helpers import live_conn, received, write_req
from topicd.client.backpressure import BackpressurePolicy, delay_ms
from topicd.errors import Throttled
from topicd.http.app import gate_of
from topicd.offload import InlineOffload
from topicd.sched.governor import (
    Governor,
    Sources,
    admission_signal,
    coalesce_ms,
    commit_window_ms,
    soft_point,
    sojourn_signal,
)
from topicd.testing.fake_clock import advance
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, make_config, open_app, open_durable
from topicd.wire import DiffIn, TopicConfigIn, WriteIn

CFG = make_config().governor


class FakeSources:
    def __init__(self, workers: int = 1) -> None:
        self.ripe = 0
        self.queued = 0
        self.sched_ms = 0.0
        self.pools: list[tuple[str, float, int]] = []
        self.applied: list[tuple[float, float, float]] = []
        self.published: list[float] = []
        self.defers: list[bool] = []
        self.workers = workers
        self.wait_area = 0.0  # request-seconds spent waiting for a client permit
        self.refused = 0
        self.permits = 32
        self.slots = 4096  # waiter slots

    def sources(self) -> Sources:
        def decay(alpha: float) -> None:
            self.sched_ms *= 1 - alpha

        return Sources(
            workers=self.workers,
            ripe=lambda: self.ripe,
            queued=lambda: self.queued,
            sched_latency_ms=lambda: self.sched_ms,
            decay_sched_latency=decay,
            pool_loads=lambda now: list(self.pools),
            admission=lambda now: (self.wait_area, self.refused, self.permits, self.slots),
            apply=lambda p, c, w: self.applied.append((p, c, w)),
            set_defer=self.defers.append,
            publish=self.published.append,
        )


def governor(fake: FakeSources, **cfg: object) -> Governor:
    return Governor(make_config(governor=cfg).governor if cfg else CFG, fake.sources())


# ---- the derived controls ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pressure", "expected"),
    [(0.0, 0.0), (0.2, 0.0), (0.3, 2.5), (0.6, 10.0), (1.0, 20.0)],
)
def test_coalescing_window_grows_from_0_to_20_ms_above_0_2(pressure, expected):
    assert coalesce_ms(pressure, CFG) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("pressure", "expected"),
    [(0.0, 0.5), (0.4, 0.5), (0.4000001, 0.5), (0.7, 5.25), (1.0, 10.0)],
)
def test_commit_window_widens_from_0_5_to_10_ms_above_0_4(pressure, expected):
    assert commit_window_ms(pressure, CFG) == pytest.approx(expected, abs=1e-4)


# ---- signals and smoothing -----------------------------------------------------------------


def test_pressure_moves_30_percent_toward_the_raw_signal_per_sample():
    fake = FakeSources()
    g = governor(fake)
    fake.ripe = 64  # s1 = 64 / (1 worker x 64) = 1
    seen = []
    for i in range(1, 6):
        g.sample(i * 0.1)
        seen.append(g.pressure)
    assert seen == pytest.approx([1 - 0.7**n for n in range(1, 6)])
    assert fake.applied[-1] == (
        pytest.approx(seen[-1]),
        pytest.approx(coalesce_ms(seen[-1], CFG)),
        pytest.approx(commit_window_ms(seen[-1], CFG)),
    )


def test_the_published_pressure_rises_smoothed_and_falls_with_the_signals():
    """Producers read the published pressure: smoothed on the way up (as the ladder's),
    but never above the signal of the same sample, so it falls as soon as the queue
    behind it drains, while the ladder's pressure decays at its own pace."""
    fake = FakeSources()
    g = governor(fake)
    fake.ripe = 64  # s1 = 1
    for i in range(1, 4):
        g.sample(i * 0.1)
    assert fake.published == pytest.approx([0.3, 0.51, 0.657])  # the smoothed rise
    fake.ripe = 16  # s1 = 0.25: the queue drained
    g.sample(0.4)
    assert g.pressure == pytest.approx(0.657 + 0.3 * (0.25 - 0.657))  # the ladder's
    assert fake.published[-1] == pytest.approx(0.25)  # what producers read
    assert fake.applied[-1][0] == pytest.approx(g.pressure)
    fake.ripe = 64
    g.sample(0.5)
    assert fake.published[-1] == pytest.approx(g.pressure)  # smoothed again
    assert g.pressure < 1.0


async def test_answers_read_the_published_pressure(autojump_clock):
    async with open_app() as h:
        gov = h.engine.governor
        gov.pressure, gov.raw = 0.8, 0.8
        h.engine._publish(gov.published)
        r = await h.app.test_client().get("/v0/health")
        assert r.headers["X-Topicd-Pressure"] == "0.800"
        gov.raw = 0.35  # the next sample's signals, the ladder's pressure still high
        h.engine._publish(gov.published)
        r = await h.app.test_client().get("/v0/health")
        assert r.headers["X-Topicd-Pressure"] == "0.350"


def test_depth_counts_ripe_topics_per_worker():
    fake = FakeSources(workers=2)
    g = governor(fake)
    fake.ripe = 64  # 64 / (2 x 64)
    g.sample(0.1)
    assert g.signals["depth"] == pytest.approx(0.5)
    fake.ripe = 1000
    g.sample(0.2)
    assert g.signals["depth"] == 1.0  # capped


def test_latency_is_the_larger_of_sched_latency_and_loop_lag_over_5_ms():
    fake = FakeSources()
    g = governor(fake)
    fake.queued = 1
    fake.sched_ms = 2.5
    g.sample(0.1)
    assert g.signals["latency"] == pytest.approx(0.5)
    g.sample(0.2, lag_ms=20.0)  # loop-lag EWMA: 0.3 x 20 = 6 ms > 5 ms ceiling
    assert g.loop_lag_ms == pytest.approx(6.0)
    assert g.signals["latency"] == 0.6  # capped at latency_signal_max


def test_latency_signal_is_capped_at_0_6_at_its_edge():
    fake = FakeSources()
    g = governor(fake)
    fake.queued = 1
    for sched_ms, expected in ((2.95, 0.59), (3.0, 0.6), (3.05, 0.6), (500.0, 0.6)):
        fake.sched_ms = sched_ms
        g.sample(0.1)
        assert g.signals["latency"] == pytest.approx(expected)
    g = governor(fake, latency_signal_max=1.0)  # 1 = the uncapped signal
    fake.sched_ms = 3.05
    g.sample(0.1)
    assert g.signals["latency"] == pytest.approx(0.61)
    fake.sched_ms = 500.0
    g.sample(0.2)
    assert g.signals["latency"] == 1.0


def test_a_saturated_loop_alone_stays_at_the_client_soft_threshold():
    """Loop lag 4x past the ceiling (but short of `loop_overload_ms`) for 10 s: pressure
    climbs to the cap (0.6), where frames coalesce and commits widen but nothing is
    deferred and a client following the delay law is not slowed; clients filling the
    permits' waiting room (s4) then take it on, through the defer rung, and a refusal
    past the client's pause (0.9) and the throttle (0.98)."""
    fake = FakeSources()
    g = governor(fake)
    t = 0.0
    for _ in range(100):
        t += 0.1
        g.sample(t, lag_ms=20.0)
        assert g.pressure <= 0.6
    assert g.pressure == pytest.approx(0.6, abs=1e-6)
    assert not g.defer_active
    assert g.coalesce_ms == pytest.approx(10.0) and g.commit_window_ms > 0.5
    fake.slots = 480  # the room's 0.6 is 288 waiting: 0.875 at 208 (past one per permit)
    for _ in range(30):  # 208 waiting throughout: s4 = 0.6 + 0.4 × 176 / 256 = 0.875
        fake.wait_area += 208 * 0.1
        t += 0.1
        g.sample(t, lag_ms=20.0)
    assert g.signals["admission"] == pytest.approx(0.875)
    assert 0.8 < g.pressure < 0.9 and g.defer_active
    for _ in range(10):
        fake.refused += 1  # a request refused in each interval
        t += 0.1
        g.sample(t, lag_ms=20.0)
    assert g.pressure > 0.98


def test_sched_latency_decays_while_nothing_is_queued():
    fake = FakeSources()
    g = governor(fake)
    fake.sched_ms = 5.0
    g.sample(0.1)
    assert fake.sched_ms == pytest.approx(4.0)  # x (1 - 0.2)
    fake.queued = 3
    g.sample(0.2)
    assert fake.sched_ms == pytest.approx(4.0)  # work is waiting: the EWMA holds


def test_admission_is_the_mean_wait_queue_per_permit_or_1_after_a_refusal():
    fake = FakeSources()
    g = governor(fake, admission_refuse_fill=0.0)  # the saturation scale alone
    g.sample(0.1)  # first sample: a baseline only
    assert g.signals["admission"] == 0.0
    fake.wait_area += 16 * 0.1  # 16 requests waited through the 0.1 s interval
    g.sample(0.2)
    assert g.signals["admission"] == pytest.approx(16 / 32)
    assert g.pressure == pytest.approx(0.3 * 0.5)  # the max of the signals drives it
    fake.wait_area += 500 * 0.1
    g.sample(0.3)
    assert g.signals["admission"] == 1.0  # capped
    g.sample(0.4)
    assert g.signals["admission"] == 0.0  # nobody waited in that interval
    fake.refused += 1  # the waiters were full once: saturated, however short the queue
    g.sample(0.5)
    assert g.signals["admission"] == 1.0
    half = governor(fake, admission_waiters_per_permit=2.0, admission_refuse_fill=0.0)
    half.sample(1.0)
    fake.wait_area += 32 * 0.1
    half.sample(1.1)
    assert half.signals["admission"] == pytest.approx(0.5)
    off = governor(fake, admission_waiters_per_permit=0.0)
    off.sample(1.0)
    fake.refused += 1
    off.sample(1.1)
    assert off.signals["admission"] == 0.0


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [
        (0, 0.0),
        (16, 0.3),  # half the saturation point: proportional up to the cap
        (32, 0.6),  # one per permit: saturated, the client's soft threshold
        (32 + 1520, 0.8),  # halfway from saturation to the refuse fill (0.75 × 4096)
        (3072, 1.0),
        (4000, 1.0),
    ],
)
def test_with_a_refuse_fill_admission_reads_soft_at_saturation_and_1_at_the_fill(
    waiting: int, expected: float
) -> None:
    cfg = make_config(governor={"admission_refuse_fill": 0.75}).governor
    assert admission_signal(waiting, 32, 4096, cfg) == pytest.approx(expected)
    # without the fill, saturation alone reads 1.0
    off = make_config(governor={"admission_refuse_fill": 0.0}).governor
    assert admission_signal(waiting, 32, 4096, off) == pytest.approx(min(1.0, waiting / 32))


def test_a_refuse_fill_at_or_below_saturation_falls_back_to_the_saturation_scale() -> None:
    cfg = make_config(governor={"admission_refuse_fill": 0.5}).governor
    # 1 waiter slot: its half is below the one-per-permit saturation point
    assert admission_signal(1, 1, 1, cfg) == 1.0
    assert admission_signal(0.5, 1, 1, cfg) == 0.5


@pytest.mark.parametrize(
    ("slots", "soft", "points"),
    [
        # a room whose fill (12) is short of twice four per permit: the soft point is
        # half of it
        (20, 6.0, {3: 0.3, 6: 0.6, 9: 0.8, 12: 1.0}),
        # half the fill (2.4) below one per permit (4): the saturation point
        (8, 4.0, {2: 0.3, 4: 0.6, 4.4: 0.8, 4.8: 1.0}),
        # room enough: four per permit
        (100, 16.0, {8: 0.3, 16: 0.6, 38: 0.8, 60: 1.0}),
    ],
)
def test_the_soft_point_is_four_per_permit_within_half_the_fill(
    slots: int, soft: float, points: dict[float, float]
) -> None:
    four = {"admission_refuse_fill": 0.6, "admission_soft_per_permit": 4.0}
    cfg = make_config(governor=four).governor
    assert soft_point(4, 0.6 * slots, cfg) == pytest.approx(soft)
    for waiting, expected in points.items():
        assert admission_signal(waiting, 4, slots, cfg) == pytest.approx(expected), waiting
    # the default, one per permit, is the saturation point, whatever the room
    assert soft_point(4, 0.6 * slots, CFG) == 4.0


def test_the_governor_samples_admission_on_the_refuse_fill_scale() -> None:
    fake = FakeSources()
    g = governor(fake, admission_refuse_fill=0.75)
    g.sample(0.1)
    fake.wait_area += 1552 * 0.1  # 1552 requests waited through the interval
    g.sample(0.2)
    assert g.signals["admission"] == pytest.approx(0.8)
    fake.refused += 1  # a refusal still reads 1.0 whatever the queue
    g.sample(0.3)
    assert g.signals["admission"] == 1.0


def on_every_sample(gov: Governor, fn: Callable[[float], None]) -> None:
    """Run `fn(now)` after each governor sample (chained to the sources' own hook), so a
    test observes every step instead of polling on a timer of its own."""
    prev = gov.src.on_sample

    def hook(now: float) -> None:
        if prev is not None:
            prev(now)
        fn(now)

    gov.src.on_sample = hook


async def ten_samples(clock: trio.testing.MockClock) -> None:
    """One second of virtual time in governor-sample steps (100 ms), settling after each,
    so every sample sees the state as it stands (no sleeping)."""
    for _ in range(10):
        await advance(clock, 0.1)


async def test_clients_queued_at_admission_raise_pressure_in_a_running_app(autojump_clock):
    # 2 permits, 8 waiter slots: s4 reads 0.6 at 2 waiting (one per permit), 1.0 at 4.8
    # (`admission_refuse_fill` 0.6 of the slots)
    cfg = make_config(classes={"client_permits": 2, "client_waiters": 8})
    async with open_app(cfg) as h:
        permits = gate_of(h.app).permits
        held = [await permits.admit() for _ in range(2)]
        async with trio.open_nursery() as nursery:
            for _ in range(5):  # 5 waiting: past the fill, s4 = 1.0
                nursery.start_soon(permits.admit)
            await ten_samples(autojump_clock)
            assert h.engine.governor.signals["admission"] == 1.0
            assert h.engine.pressure > 0.9
            for p in held:
                p.release()  # two of the five waiters are admitted (and keep their permits)
            await ten_samples(autojump_clock)
            # 3 waiting: 0.6 + 0.4 x (3 - 2) / (4.8 - 2)
            assert h.engine.governor.signals["admission"] == pytest.approx(0.6 + 0.4 / 2.8)
            nursery.cancel_scope.cancel()
        assert permits.stats.waiting == 0
        await ten_samples(autojump_clock)
        assert h.engine.governor.signals["admission"] == 0.0


async def test_a_saturated_loop_does_not_slow_clients_a_queue_at_the_permits_does(
    autojump_clock,
):
    """A running app whose scheduling latency reads 50 ms (ten times the ceiling) for ten
    virtual seconds: the header sits at the latency cap, the client's soft threshold, so
    its law adds no delay; requests queueing for a permit then move it into the
    proportional band."""
    policy = BackpressurePolicy()

    def law(header: str) -> object:
        x = float(header)
        return delay_ms(x, policy.pressure_soft, policy.pressure_hard, policy.soft_delay_max_ms)

    cfg = make_config(classes={"client_permits": 4, "client_waiters": 40})
    async with open_app(cfg) as h:
        src = h.engine.governor.src
        src.queued = lambda: 1
        src.sched_latency_ms = lambda: 50.0
        for _ in range(10):
            await ten_samples(autojump_clock)
        assert not h.engine.governor.defer_active
        client = h.app.test_client()
        r = await client.get("/v0/health")
        assert r.headers["X-Topicd-Pressure"] == "0.600"
        assert law(r.headers["X-Topicd-Pressure"]) == 0
        permits = gate_of(h.app).permits
        held = [await permits.admit() for _ in range(4)]
        async with trio.open_nursery() as nursery:
            # 14 waiting for 4 permits, 40 slots (s4: 0.6 at 4 waiting, 1.0 at 24):
            # 0.6 + 0.4 x 10 / 20 = 0.8
            for _ in range(14):
                nursery.start_soon(permits.admit)
            for _ in range(3):
                await ten_samples(autojump_clock)
            r = await client.get("/v0/health")
            assert r.headers["X-Topicd-Pressure"] == "0.800"
            assert law(r.headers["X-Topicd-Pressure"]) == pytest.approx(500 * 0.2 / 0.3)
            nursery.cancel_scope.cancel()
        for p in held:
            p.release()


def test_pool_signal_is_the_busiest_group_over_the_interval():
    fake = FakeSources()
    g = governor(fake)
    fake.pools = [("wal", 0.0, 2), ("misc", 0.0, 4)]
    g.sample(1.0)  # first sample: a baseline only
    assert g.signals["pool"] == 0.0
    fake.pools = [("wal", 0.1, 2), ("misc", 0.3, 4)]  # over 0.1 s: 0.5 and 0.75 busy
    g.sample(1.1)
    assert g.signals["pool"] == pytest.approx(0.75)
    fake.pools = [("wal", 0.5, 2), ("misc", 0.3, 4)]  # 0.4 token-s over 0.1 s x 2 tokens
    g.sample(1.2)
    assert g.signals["pool"] == 1.0  # capped


def test_raw_signal_is_the_maximum_of_the_three():
    fake = FakeSources()
    g = governor(fake)
    fake.ripe = 16  # 0.25
    fake.queued = 1
    fake.sched_ms = 3.0  # 0.6
    g.sample(0.1)
    assert g.pressure == pytest.approx(0.3 * 0.6)


# ---- deferral and its hysteresis -------------------------------------------------------------


def drive_to(g: Governor, fake: FakeSources, target: float, t: list[float]) -> None:
    """Set the raw signal to `target` (through depth) and take one sample."""
    fake.ripe = round(target * 64)
    t[0] += 0.1
    g.sample(t[0])


def test_defer_needs_3_consecutive_samples_above_0_8_and_releases_below_0_6():
    fake = FakeSources()
    g = governor(fake)
    t = [0.0]
    g.pressure = 0.79
    drive_to(g, fake, 1.0, t)  # 0.853
    drive_to(g, fake, 1.0, t)  # 0.897
    assert not g.defer_active
    drive_to(g, fake, 0.5, t)  # 0.778: the streak breaks
    drive_to(g, fake, 1.0, t)  # 0.845
    drive_to(g, fake, 1.0, t)  # 0.891
    assert not g.defer_active and fake.defers == []
    drive_to(g, fake, 1.0, t)  # 0.924: third in a row
    assert g.defer_active and fake.defers == [True]
    # between 0.6 and 0.8 it stays on (hysteresis)
    for _ in range(4):
        drive_to(g, fake, 0.7, t)
        assert g.defer_active
    assert 0.6 < g.pressure < 0.8
    drive_to(g, fake, 0.0, t)  # 0.7 x p < 0.6
    assert g.pressure < 0.6
    assert not g.defer_active and fake.defers == [True, False]
    assert g.stats.defer_episodes == 1


# ---- the rungs inside the engine ----------------------------------------------------------------


async def test_coalescing_packs_a_burst_into_one_frame(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        conn = await live_conn(engine, "t")
        engine._govern(0.6, coalesce_ms(0.6, CFG), commit_window_ms(0.6, CFG))  # 10 ms
        assert engine.sched.coalesce_s == pytest.approx(0.010)
        t0 = trio.current_time()
        for i in range(3):
            await engine.append("t", write_req(i))
            await advance(autojump_clock, 0.002)
        assert received(conn) == []  # held for the window
        await advance(autojump_clock, 0.01)
        refs = received(conn)
        assert len(refs) == 1
        assert (refs[0].from_seq, refs[0].to_seq) == (0, 3)
        assert trio.current_time() - t0 >= 0.010
        # pressure falls: frames are per write again
        engine._govern(0.1, 0.0, 0.5)
        assert engine.sched.coalesce_s == 0.0
        await engine.append("t", write_req("x"))
        await trio.lowlevel.checkpoint()
        await trio.testing.wait_all_tasks_blocked()
        assert [(r.from_seq, r.to_seq) for r in received(conn)] == [(3, 4)]


async def test_pressure_reaches_the_header(autojump_clock):
    async with open_app() as h:
        h.engine._govern(0.456, 0.0, 0.5)
        r = await h.app.test_client().get("/v0/health")
        assert r.headers["X-Topicd-Pressure"] == "0.456"


async def test_defer_pauses_negative_priority_push_with_one_advisory_frame(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("low", TopicConfigIn(priority=-10))
        await engine.put_topic("high", TopicConfigIn(priority=100))
        low = await live_conn(engine, "low")
        high = await live_conn(engine, "high")
        engine._govern(0.9, coalesce_ms(0.9, CFG), commit_window_ms(0.9, CFG))
        engine._set_defer(True)
        advisories = [r for r in received(low, advisories=True) if not r.topic]
        assert len(advisories) == 1
        body = advisories[0].body
        assert body is not None and body.startswith(b"event: error\ndata: ")
        data = orjson.loads(body.split(b"data: ", 1)[1])
        assert data["code"] == 429
        assert data["topics"] == ["low"]
        assert data["error"] == data["message"]
        assert data["retry_after_ms"] == round(250 + 1750 * 0.9)
        assert received(high, advisories=True) == []  # nothing paused there: no advisory
        await engine.append("low", write_req(1))
        await engine.append("high", write_req(1))
        await advance(autojump_clock, 1.0)
        assert [r.to_seq for r in received(high)] == [1]
        assert received(low, advisories=True) == []  # paused: stored, not pushed
        _, res = await engine.diff("low", DiffIn())
        assert len(res.records) == 1  # still readable
        # a long-poll on the paused topic is not woken by the append (no drain); at its
        # deadline it returns its first result (api-topics §7.2 step 9) and the next
        # poll reads the record at once
        t0 = trio.current_time()
        async with trio.open_nursery() as n:

            async def later() -> None:
                await advance(autojump_clock, 0.1)
                await engine.append("low", write_req(2))

            n.start_soon(later)
            _, res = await engine.diff("low", DiffIn(from_seq=1, wait_ms=500))
        assert res.records == []
        assert trio.current_time() - t0 == pytest.approx(0.5)
        _, res = await engine.diff("low", DiffIn(from_seq=1, wait_ms=500))
        assert len(res.records) == 1 and trio.current_time() - t0 == pytest.approx(0.5)
        engine._set_defer(False)
        await advance(autojump_clock, 0.1)
        assert [r.to_seq for r in received(low)] == [2]


async def test_a_saturated_wal_drives_the_ladder_to_429(autojump_clock):
    # one WAL shard whose every sync takes a virtual 100 ms, with writes bound to wait at
    # most 80 ms: the backlog signal saturates
    slow = InlineOffload(lambda group: 0.1 if group == "wal" else 0.0)
    cfg = durable_config(shards=1, wal={"max_pending_per_shard": 40, "max_pending_ms": 80})
    async with open_durable(FakeDisk(), cfg, offload=slow) as engine:
        await engine.put_topic("t", TopicConfigIn(durability="fsync"))
        wal = engine.commit
        seen = {"ok": 0, "pressure": 0, "wal_ingest": 0}
        firsts: dict[str, float] = {}
        hints: list[int] = []
        gov = engine.governor
        stop = trio.Event()

        async def writer() -> None:
            while not stop.is_set():
                try:
                    await engine.append("t", write_req(1))
                    seen["ok"] += 1
                except Throttled as exc:
                    cause = exc.detail.get("cause", "pressure")
                    seen[str(cause)] += 1
                    hints.append(exc.retry_after_s())
                    await trio.sleep(0.01)  # the simulated client backs off (load, not a wait)

        climbed = trio.Event()  # every rung seen, the commit window at its widest

        def watch(now: float) -> None:  # at every governor sample
            if gov.coalesce_ms > 0:
                firsts.setdefault("coalesce", now)
            if wal.shards[0].commit_window_ms > CFG.commit_window_min_ms:
                firsts.setdefault("widen", now)
            if gov.defer_active:
                firsts.setdefault("defer", now)
            if seen["pressure"]:
                firsts.setdefault("throttle", now)
            at_max = wal.shards[0].commit_window_ms >= CFG.commit_window_max_ms * 0.95
            if len(firsts) == 4 and at_max and gov.pressure > 0.98:
                climbed.set()

        on_every_sample(gov, watch)
        async with trio.open_nursery() as n:
            for _ in range(60):
                n.start_soon(writer)
            with trio.fail_after(30):  # virtual seconds: the ladder climbs within ~2
                await climbed.wait()
            stop.set()
        assert gov.signals["backlog"] > 0.9
        assert gov.pressure > 0.98
        assert seen["ok"] > 0 and seen["pressure"] > 0
        assert hints and min(hints) >= 1
        # the rungs appear in the ladder's order
        order = [firsts[k] for k in ("coalesce", "widen", "defer", "throttle")]
        assert order == sorted(order)
        assert wal.shards[0].commit_window_ms == pytest.approx(CFG.commit_window_max_ms, rel=0.05)
        # a disable_backpressure write skips pressure admission
        res = await engine.append(
            "t", WriteIn(records=write_req(2).records, disable_backpressure=True)
        )
        assert res.count == 1


async def test_a_long_checkpoint_does_not_read_as_pool_pressure(autojump_clock):
    """The checkpoint's thread (the `snapshot` group) is maintenance: a checkpoint that
    holds it for seconds leaves the pool signal and pressure at rest. A busy WAL thread
    is not a pool signal either: the wait of the writes it holds (s5) is."""
    slow = {"snapshot": 0.0, "wal": 0.0}
    offload = InlineOffload(lambda group: slow.get(group, 0.0))
    async with open_durable(FakeDisk(), durable_config(), offload=offload) as engine:
        await engine.append("t", write_req(*range(100)))
        gov = engine.governor
        slow["snapshot"] = 3.0  # every checkpoint step on that thread: 3 virtual seconds
        peak = {"pool": 0.0, "pressure": 0.0}

        def watch(_now: float) -> None:  # at every governor sample
            peak["pool"] = max(peak["pool"], gov.signals["pool"])
            peak["pressure"] = max(peak["pressure"], gov.pressure)

        on_every_sample(gov, watch)
        samples = gov.stats.samples
        t0 = trio.current_time()
        assert await engine.commit.checkpoint()
        assert trio.current_time() - t0 >= 3.0
        assert gov.stats.samples - samples >= 20  # the governor sampled throughout
        assert peak == {"pool": 0.0, "pressure": 0.0}
        # nor are the WAL's threads: a slow sync is read as the wait of the writes it
        # holds (s5: 1 s of the 500 ms bound, with the sync under way for about 1 s)
        slow["wal"] = 2.0
        async with trio.open_nursery() as n:
            n.start_soon(engine.append, "t", write_req(1))
            await ten_samples(autojump_clock)  # the sync is under way
            assert gov.signals["pool"] == 0.0
            assert gov.signals["backlog"] == 1.0


# ---- the loop's own queue (s2 past loop_overload_ms) and the WAL's (s5) ---------------------


def test_loop_lag_past_the_overload_bound_rises_from_the_cap_to_1_at_the_refusal_bound():
    """A loop batch past `loop_overload_ms` (25) is a queue on the loop: s2 goes from 0.6
    to 1.0 at `loop_refuse_ms` (100). The gate's `overloaded` names it only once pressure
    has held the client's pause (0.9) for 3 samples, and only while s2 is at 0.9 too (a
    lag of 81.25 ms)."""
    fake = FakeSources()
    g = governor(fake, loop_lag_alpha=1.0)  # the EWMA is the last sample's lag
    for lag, expected in ((25.0, 0.6), (62.5, 0.8), (81.25, 0.9), (100.0, 1.0), (400.0, 1.0)):
        g.sample(0.1, lag_ms=lag)
        assert g.signals["latency"] == pytest.approx(expected)
    assert g.overloaded is None  # pressure (0.3 per sample toward the raw) is below 0.9
    t, held = 0.1, 0
    while held < 3:
        t += 0.1
        g.sample(t, lag_ms=150.0)
        held = held + 1 if g.pressure >= 0.9 else 0
        assert g.overloaded == ("loop_lag" if held >= 3 else None)
    g.sample(t + 0.1, lag_ms=80.0)  # s2 0.893: pressure still ~1, no refusal
    assert g.pressure > 0.9 and g.overloaded is None
    g.sample(t + 0.2, lag_ms=150.0)  # at it again, pressure held throughout
    assert g.overloaded == "loop_lag"


def test_loop_refuse_ms_0_keeps_the_latency_signal_at_its_cap_and_never_refuses():
    fake = FakeSources()
    g = governor(fake, loop_lag_alpha=1.0, loop_refuse_ms=0)
    for i in range(60):
        g.sample(0.1 * (i + 1), lag_ms=500.0)
    assert g.signals["latency"] == 0.6 and g.overloaded is None


def test_backlog_signal_is_the_wal_drain_time_share_clamped_to_1():
    fake = FakeSources()
    ratio = [0.0]
    src = fake.sources()
    src.backlog = lambda: ratio[0]
    g = Governor(CFG, src)
    for value, expected in ((0.0, 0.0), (0.45, 0.45), (3.0, 1.0)):
        ratio[0] = value
        g.sample(0.1)
        assert g.signals["backlog"] == pytest.approx(expected)
    for i in range(20):  # held at its bound: the overload refusal names the WAL backlog
        g.sample(0.2 + 0.1 * i)
    assert g.pressure > 0.9 and g.overloaded == "wal_backlog"
    ratio[0] = 0.89
    g.sample(2.3)
    assert g.overloaded is None


@pytest.mark.parametrize(
    ("median_ms", "expected"),
    [
        (0.0, 0.0),
        (25.0, 0.3),  # proportional below sojourn_overload_ms (50)
        (50.0, 0.6),  # the client's soft threshold at the overload bound
        (50.001, 0.6),  # continuous there
        (162.5, 0.9),  # the client's pause
        (200.0, 1.0),  # sojourn_refuse_ms
        (5000.0, 1.0),
    ],
)
def test_sojourn_signal_is_proportional_to_the_overload_bound_then_rises_to_1(median_ms, expected):
    assert sojourn_signal(median_ms, CFG) == pytest.approx(expected, abs=1e-5)


def test_sojourn_signal_with_the_bounds_0_or_inverted():
    off = make_config(governor={"sojourn_refuse_ms": 0}).governor
    assert sojourn_signal(10_000.0, off) == 0.0
    flat = make_config(governor={"sojourn_overload_ms": 0}).governor  # no soft part
    assert sojourn_signal(100.0, flat) == pytest.approx(0.3)
    assert sojourn_signal(200.0, flat) == 1.0


def test_write_sojourns_held_past_the_pause_refuse_with_write_delay():
    """s6 is the median sojourn of the writes answered lately. No write answered is no
    evidence (0). Held at 0.9 or more with pressure at the pause for 3 samples, the gate's
    `overloaded` names it `write_delay`, and a sample below 0.9 (a median of 160 ms) ends
    the refusal."""
    fake = FakeSources()
    median: list[float | None] = [None]
    src = fake.sources()
    src.sojourn = lambda now: median[0]
    g = Governor(CFG, src)
    g.sample(0.1)
    assert g.signals["sojourn"] == 0.0 and g.sojourn_ms == 0.0
    median[0] = 20.0  # a busy server keeping up (group commits, a full loop)
    for i in range(50):
        g.sample(0.2 + 0.1 * i)
    assert g.signals["sojourn"] == pytest.approx(0.24)
    assert g.pressure < 0.3 and g.overloaded is None
    median[0] = 250.0  # a standing queue: every other write waits a quarter second
    t, held = 5.2, 0
    while held < 3:
        t += 0.1
        g.sample(t)
        held = held + 1 if g.pressure >= 0.9 else 0
        assert g.overloaded == ("write_delay" if held >= 3 else None)
    assert g.sojourn_ms == 250.0
    median[0] = 160.0  # s6 0.89: pressure still above 0.9, but the queue is not at it
    g.sample(t + 0.1)
    assert g.pressure > 0.9 and g.overloaded is None
    median[0] = None  # nothing answered since: no refusal on no evidence
    g.sample(t + 0.2)
    assert g.signals["sojourn"] == 0.0 and g.overloaded is None


async def test_a_wal_backlog_read_in_time_refuses_writes_and_group_commit_does_not(
    autojump_clock,
):
    """`storage.wal.max_pending_ms` (500): writes that have waited that long for their
    commit read as a full ingest, whatever their count: s5 reaches 1.0, pressure climbs,
    and at `throttle_at` writes get the pressure `429` (the client's pause at 0.9 comes
    first); many writes sharing one quick commit do not (their wait is one commit)."""
    slow = {"wal": 0.002}  # every WAL write + sync: 2 virtual ms
    offload = InlineOffload(lambda group: slow.get(group, 0.0))
    async with open_durable(FakeDisk(), durable_config(shards=1), offload=offload) as engine:
        await engine.put_topic("t", TopicConfigIn(durability="fsync"))
        gov = engine.governor
        peak = {"backlog": 0.0}

        def watch(_now: float) -> None:
            peak["backlog"] = max(peak["backlog"], gov.signals["backlog"])

        on_every_sample(gov, watch)

        async def writes(n: int) -> None:
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(engine.append, "t", write_req(i))

        for _ in range(20):  # 200 concurrent writers per round, over 2 virtual seconds
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writes, 200)
                await advance(autojump_clock, 0.1)
        assert peak["backlog"] < 0.1  # a group commit's wait: a few ms of 500
        assert gov.pressure < 0.6
        slow["wal"] = 5.0  # the disk stalls: one write waits in the batch being written
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.append, "t", write_req(1))
            await ten_samples(autojump_clock)  # 1 s into its sync
            assert gov.signals["backlog"] == 1.0
            assert engine.commit.shards[0].delay_ms >= 500
            assert 0.9 <= gov.pressure < CFG.throttle_at  # the client pauses; no refusal yet
            assert gov.overloaded is None  # not held at 0.9 for 3 samples yet
            for _ in range(3):
                await advance(autojump_clock, 0.1)
            assert gov.overloaded == "wal_backlog"  # held: the HTTP gate refuses now
            nursery.start_soon(engine.append, "t", write_req(2))  # queued behind the stall
            while gov.pressure < CFG.throttle_at:
                await advance(autojump_clock, 0.1)
            with pytest.raises(Throttled) as refused:
                await engine.append("t", write_req(3))
            assert "cause" not in refused.value.detail  # pressure admission
            # a disable_backpressure write skips that check, and commits
            nursery.start_soon(
                engine.append, "t", WriteIn(records=write_req(4).records, disable_backpressure=True)
            )
        slow["wal"] = 0.0
        await ten_samples(autojump_clock)
        assert gov.signals["backlog"] == 0.0 and engine.commit.shards[0].delay_ms == 0.0
        res = await engine.append("t", write_req(5))
        assert res.count == 1
