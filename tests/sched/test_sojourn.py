"""The write sojourn tracker behind the governor's s6 (`topicd.sched.sojourn`).

Method: pure arithmetic on scripted (in hand, answer) times: the median over the window,
its edges (a write answered exactly at the horizon stays, one just older goes), no
evidence when nothing was answered, the bound on what is kept, and which writes met
another (`begin`/`end`: only those are medianed).
"""

from __future__ import annotations

import pytest

from topicd.sched.sojourn import SAMPLES_MAX, Sojourns


def test_no_write_answered_is_no_evidence():
    s = Sojourns(0.3)
    assert s.median_ms(10.0) is None


def test_median_of_an_odd_and_an_even_count():
    s = Sojourns(0.3)
    for wait in (0.010, 0.200, 0.050):
        s.record(10.0 - wait, 10.0)
    assert s.median_ms(10.0) == pytest.approx(50.0)
    s.record(9.6, 10.0)  # 400 ms
    assert s.median_ms(10.0) == pytest.approx((50.0 + 200.0) / 2)


def test_writes_answered_before_the_window_are_forgotten_at_its_edge():
    s = Sojourns(0.3)
    s.record(0.5, 1.0)  # 500 ms, answered at 1.0
    s.record(1.19, 1.2)  # 10 ms, answered at 1.2
    assert s.median_ms(1.3) == pytest.approx(255.0)  # 1.0 is exactly at the horizon: kept
    assert s.median_ms(1.3 + 1e-9) == pytest.approx(10.0)
    assert s.median_ms(1.6) is None
    assert s.recorded == 2


def test_a_clock_step_back_never_makes_a_negative_sojourn():
    s = Sojourns(0.3)
    s.record(2.0, 1.0)
    assert s.median_ms(1.0) == 0.0


def test_only_the_newest_samples_max_are_kept():
    s = Sojourns(10.0)
    for _ in range(SAMPLES_MAX):
        s.record(0.0, 1.0)  # 1 s each
    assert s.median_ms(1.0) == pytest.approx(1000.0)
    for _ in range(SAMPLES_MAX // 2 + 1):
        s.record(1.0, 1.0)  # 0 ms: now the majority of what is kept
    assert s.median_ms(1.0) == 0.0
    assert s.recorded == SAMPLES_MAX + SAMPLES_MAX // 2 + 1


def test_writes_one_after_another_are_alone_and_not_medianed():
    s = Sojourns(0.3)
    for i in range(3):
        t = s.begin()
        s.end(t, 1.0 + i * 0.1, 1.05 + i * 0.1, served=True)  # 50 ms each, alone
    assert (s.recorded, s.alone) == (3, 3)
    assert s.median_ms(1.3) is None


def test_a_write_that_came_behind_another_and_the_one_it_met_are_medianed():
    s = Sojourns(0.3)
    a = s.begin()  # alone so far
    b = s.begin()  # another is in hand: it met one
    assert b == -1
    s.end(a, 1.0, 1.2, served=True)  # a met b, which came before its end
    c = s.begin()  # b still in hand
    s.end(b, 1.0, 1.3, served=True)
    s.end(c, 1.25, 1.3, served=True)
    assert (s.recorded, s.alone) == (3, 0)
    assert s.median_ms(1.3) == pytest.approx(200.0)  # of 200, 300 and 50 ms
    d = s.begin()  # nothing in hand any more: alone again
    s.end(d, 1.35, 1.55, served=True)  # 200 ms
    assert (s.recorded, s.alone) == (4, 1)
    # a is past the window; of b and c (300 and 50 ms) the median is 175: d (200 ms)
    # among them would make it 200
    assert s.median_ms(1.55) == pytest.approx(175.0)


def test_a_write_refused_on_its_way_in_is_not_recorded_but_leaves():
    s = Sojourns(0.3)
    a = s.begin()
    s.end(a, 1.0, 1.0, served=False)
    assert s.recorded == 0
    b = s.begin()  # a left: b is alone
    assert b >= 0
    s.end(b, 1.0, 1.4, served=True)
    assert (s.recorded, s.alone) == (1, 1)
