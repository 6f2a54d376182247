"""The banded DWRR ready set (scheduler spec A.2-A.5, B.1-B.4), driven without a clock.

Method: topics are `Slot`s with chosen base priorities; the test advances a virtual time
by hand, calls `pick`/`done` as a scheduler would (each drain costing a fixed virtual
time), runs the 50 ms aging tick, and counts who was served when.
"""

from __future__ import annotations

import pytest

from topicd.engine.engine import Engine
from topicd.engine.topic import Topic
from topicd.model import TopicConfig
from topicd.sched.bands import ReadySet, Slot
from topicd.sched.priority import Recency, auto, base_priority
from topicd.testing.fake_clock import FakeWallClock
from topicd.testing.harness import make_config

BASES = {0: 800, 1: 600, 2: 300, 3: 100, 4: -100}  # one base per band B4 .. B0


def test_band_boundaries():
    rs: ReadySet[str] = ReadySet()
    assert [rs.band_of(p) for p in (1000, 750, 749, 500, 499, 250, 249, 0, -1, -1000)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
    ]


def test_saturated_bands_share_service_by_weight():
    rs: ReadySet[str] = ReadySet()
    slots = {b: [Slot(f"b{b}-{i}") for i in range(5)] for b in BASES}
    for b, group in slots.items():
        for s in group:
            rs.mark(s, BASES[b], 0.0)
    served = [0] * 5
    for _ in range(16_000):
        s = rs.pick(0.0)
        assert s is not None
        band = next(b for b, g in slots.items() if s in g)
        served[band] += 1
        rs.done(s, True, BASES[band], 0.0)  # always more work: saturated
    total = sum(served)
    for band, weight in enumerate((8, 4, 2, 1, 1)):
        share = served[band] / total
        assert share == pytest.approx(weight / 16, rel=0.05), (band, served)


def test_a_burst_of_writes_is_one_unit_of_work():
    rs: ReadySet[str] = ReadySet()
    s = Slot("t")
    marks = [rs.mark(s, 0, 0.0) for _ in range(1000)]
    assert marks.count(True) == 1
    assert len(rs) == 1
    assert rs.pick(0.0) is s
    assert rs.pick(0.0) is None  # in flight: not handed out twice
    assert rs.mark(s, 0, 0.0) is False  # the bit stays set during the drain
    rs.done(s, False, 0, 0.0)
    assert rs.pick(0.0) is None
    assert rs.mark(s, 0, 0.0) is True


def test_a_waiting_b1_topic_reaches_the_top_band_within_10_s_under_b4_load():
    rs: ReadySet[str] = ReadySet()
    hot = [Slot(f"hot{i}") for i in range(50)]
    for s in hot:
        rs.mark(s, 900, 0.0)
    # a crowded B1: the watched topic is last in line
    crowd = [Slot(f"c{i}") for i in range(2000)]
    for s in crowd:
        rs.mark(s, 10, 0.0)
    watched = Slot("watched")
    rs.mark(watched, 10, 0.0)
    now = 0.0
    tick = 0.0
    served_at = None
    while now < 20:
        s = rs.pick(now)
        assert s is not None
        now += 0.002  # every drain costs 2 ms of virtual time
        if s is watched:
            served_at = now
            break
        base = 900 if s in hot else 10
        rs.done(s, s in hot, base, now)  # hot topics are rewritten continuously
        if now - tick >= 0.05:
            rs.age(now)
            tick = now
    assert served_at is not None
    assert served_at <= 10.0 + 0.05
    # it was promoted by aging (the crowd ahead of it alone would take longer at 1/16)
    assert watched.band == 0


def test_a_continuously_rewritten_topic_still_ages():
    rs: ReadySet[str] = ReadySet()
    s = Slot("t")
    rs.mark(s, 0, 0.0)
    for i in range(1, 60):
        rs.mark(s, 0, i * 0.1)  # re-dirtied: enqueued_at is not reset
        rs.age(i * 0.1)
    assert rs.effective(s, 5.9) == 590
    assert s.band == 1  # moved from B1 to B3 (≥ 500) by aging alone


def test_age_boost_is_capped():
    rs: ReadySet[str] = ReadySet()
    s = Slot("t")
    rs.mark(s, -1000, 0.0)
    assert rs.effective(s, 100.0) == 0  # -1000 + 1000 at most
    rs.age(100.0)
    assert s.band == 3


def test_fifo_within_a_band_and_ripeness():
    rs: ReadySet[str] = ReadySet()
    a, b, c = Slot("a"), Slot("b"), Slot("c")
    rs.mark(a, 0, 0.0)
    rs.mark(b, 0, 0.1)
    rs.mark(c, 0, 0.2, ripe_after=1.0)
    assert rs.pick(0.5) is a
    assert rs.pick(0.5) is b
    assert rs.pick(0.5) is None  # c is not ripe yet
    assert rs.next_ripe_at() == pytest.approx(1.2)
    assert rs.pick(1.2) is c


def test_defer_withholds_credit_from_b0_and_negative_manual_priorities():
    rs: ReadySet[str] = ReadySet()
    low = Slot("low")
    neg_aged = Slot("neg-aged")
    top = Slot("top")
    rs.mark(low, -10, 0.0, manual_negative=True)
    rs.mark(neg_aged, -10, 0.0, manual_negative=True)
    rs.age(30.0)  # aging lifts neg_aged (and low) out of B0
    rs.mark(top, 900, 30.0)
    rs.defer = True
    picked = []
    while (s := rs.pick(30.0)) is not None:
        picked.append(s.topic)
        rs.done(s, False, 0, 30.0)
    assert picked == ["top"]
    rs.defer = False
    assert {rs.pick(30.0).topic, rs.pick(30.0).topic} == {"low", "neg-aged"}


def test_rebase_moves_a_queued_topic():
    rs: ReadySet[str] = ReadySet()
    s = Slot("t")
    rs.mark(s, 0, 0.0)
    assert s.band == 3
    rs.rebase(s, 1000, 0.0)
    assert s.band == 0


@pytest.mark.parametrize(
    ("seconds", "value"), [(0, 500), (15, 354), (30, 250), (60, 125), (120, 31), (300, 0)]
)
def test_recency_decay_table(seconds, value):
    assert auto(seconds * 1000) == value


def test_recency_curve_within_two_percent():
    for dt in range(0, 300_000, 97):
        exact = 500 * 2 ** (-dt / 30000)
        got = auto(dt)
        if exact >= 50:
            assert abs(got - exact) / exact <= 0.02, dt
        else:
            assert abs(got - exact) <= 1.5, dt


def test_base_priority_rules():
    assert base_priority(5000, True, None, 0) == 1000  # manual, clamped
    assert base_priority(-5000, True, 0, 0) == -1000
    assert base_priority(None, True, None, 0) == 0  # never read
    assert base_priority(None, True, 1000, 1000) == 500
    assert base_priority(None, False, 1000, 1000) == 0
    assert base_priority(None, True, 0, 300_000) == 0  # the 5-minute floor


async def test_the_recency_settings_shape_the_curve():
    """`scheduler.auto_max`, `half_life_ms` and `auto_floor_ms` do what they say, and the
    scheduler uses the configured curve."""
    curve = Recency(auto_max=100, half_life_ms=1000, floor_ms=5000)
    assert [curve(ms) for ms in (0, 1000, 2000, 4999, 5000)] == [100, 50, 25, 3, 0]
    cfg = make_config(scheduler={"auto_max": 100, "half_life_ms": 1000, "auto_floor_ms": 5000})
    engine = Engine(cfg, FakeWallClock())
    topic = Topic("t", 1, TopicConfig(), name_json=b'"t"')
    topic.last_read_ts = 10_000
    assert engine.sched.base(topic, now_ms=11_000) == 50
    assert engine.sched.base(topic, now_ms=15_000) == 0
