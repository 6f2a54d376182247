"""The producer delay law at its boundaries, under `MockClock`.

Method: the law itself is a pure function, checked at and around each threshold. The
waiting side (`Backpressure.wait`) runs with Trio's `MockClock` (autojump), fed signals
through a `Signals` object directly (no sockets), and every assertion is on exact virtual
time: the proportional delay, a pause that ends when the signal drops or goes stale, the
`max_pause_ms` give-up, cancellation at once, and the zone reports.
"""

from __future__ import annotations

import pytest
import trio

from topicd.client.backpressure import (
    PAUSE,
    Backpressure,
    BackpressurePolicy,
    LoopClock,
    Signals,
    delay_ms,
)
from topicd.client.errors import BackpressureTimeout

P = BackpressurePolicy()


def test_defaults_are_the_documented_ones():
    assert (P.pressure_soft, P.pressure_hard) == (0.6, 0.9)
    assert (P.inflight_soft, P.inflight_hard) == (50, 200)
    assert (P.soft_delay_max_ms, P.hard_poll_ms, P.signal_ttl_ms) == (500, 100, 10000)
    assert (P.inflight_poll_ms, P.max_pause_ms, P.max_retries, P.retry_jitter) == (
        1000,
        60000,
        8,
        0.2,
    )


def test_delay_law_is_zero_up_to_and_at_soft():
    assert delay_ms(None, 0.6, 0.9, 500) == 0
    assert delay_ms(0.0, 0.6, 0.9, 500) == 0
    assert delay_ms(0.6, 0.6, 0.9, 500) == 0


def test_delay_law_is_continuous_just_above_soft():
    d = delay_ms(0.6 + 1e-9, 0.6, 0.9, 500)
    assert isinstance(d, float)
    assert 0 < d < 1e-5


def test_delay_law_is_proportional_between_soft_and_hard():
    assert delay_ms(0.75, 0.6, 0.9, 500) == pytest.approx(250)
    assert delay_ms(125, 50, 200, 500) == pytest.approx(250)
    assert delay_ms(199, 50, 200, 500) == pytest.approx(500 * 149 / 150)


def test_delay_law_pauses_at_and_above_hard():
    assert delay_ms(0.9, 0.6, 0.9, 500) is PAUSE
    assert delay_ms(1.0, 0.6, 0.9, 500) is PAUSE
    assert delay_ms(200, 50, 200, 500) is PAUSE


def test_policy_refuses_inverted_thresholds():
    with pytest.raises(ValueError, match="pressure_soft"):
        BackpressurePolicy(pressure_soft=0.9, pressure_hard=0.9)
    with pytest.raises(ValueError, match="inflight_soft"):
        BackpressurePolicy(inflight_soft=300)


def _gate(policy=P, refresh=None, reports=None):
    signals = Signals(LoopClock(), policy.signal_ttl_ms)

    async def no_refresh(topic):
        await trio.lowlevel.checkpoint()

    bp = Backpressure(
        policy, signals, refresh or no_refresh, reports.append if reports is not None else None
    )
    return signals, bp


async def test_no_signal_means_no_delay(autojump_clock):
    reports = []
    _, bp = _gate(reports=reports)
    t0 = trio.current_time()
    assert await bp.wait("t") == 0
    assert trio.current_time() == t0
    assert reports[-1].zone == "green"
    assert (reports[-1].pressure, reports[-1].in_flight) == (None, None)


async def test_proportional_delay_is_slept_exactly(autojump_clock):
    reports = []
    signals, bp = _gate(reports=reports)
    signals.observe_pressure("0.750")
    t0 = trio.current_time()
    await bp.wait("t")
    assert trio.current_time() - t0 == pytest.approx(0.25)
    assert reports[-1].zone == "amber"
    assert reports[-1].delay_ms == pytest.approx(250)


async def test_the_larger_of_the_two_signals_applies(autojump_clock):
    signals, bp = _gate()
    signals.observe_pressure("0.66")  # 100 ms
    signals.observe_in_flight("q", 140)  # 300 ms
    t0 = trio.current_time()
    await bp.wait("q")
    assert trio.current_time() - t0 == pytest.approx(0.3)
    t0 = trio.current_time()
    await bp.wait("other")  # in-flight is per queue: only the pressure counts here
    assert trio.current_time() - t0 == pytest.approx(0.1)


async def test_stale_signal_counts_as_absent(autojump_clock):
    signals, bp = _gate()
    signals.observe_pressure("0.85")
    await trio.sleep(9.0)
    t0 = trio.current_time()
    await bp.wait("t")
    assert trio.current_time() - t0 == pytest.approx(500 * 0.25 / 0.3 / 1000)
    await trio.sleep(10.0 - (trio.current_time() - t0) - 9.0)  # exactly the TTL old
    assert bp.decide("t")[0] == pytest.approx(500 * 0.25 / 0.3)  # still a signal
    # going stale while a batch waits on it ends the wait at the next re-read
    t0 = trio.current_time()
    assert await bp.wait("t") == pytest.approx(100)
    t1 = trio.current_time()
    assert await bp.wait("t") == 0
    assert trio.current_time() == t1


async def test_pause_rereads_every_hard_poll_until_the_signal_drops(autojump_clock):
    reports = []
    polls = []
    signals = None

    async def refresh(topic):
        polls.append(trio.current_time())
        # the server answers 0.95 for three polls, then 0.5
        signals.observe_pressure("0.95" if len(polls) < 3 else "0.5")
        await trio.lowlevel.checkpoint()

    signals, bp = _gate(refresh=refresh, reports=reports)
    signals.observe_pressure("0.9")  # exactly hard: a pause
    t0 = trio.current_time()
    waited = await bp.wait("t")
    assert [round(p - t0, 6) for p in polls] == [0.1, 0.2, 0.3]
    assert trio.current_time() - t0 == pytest.approx(0.3)
    assert waited == pytest.approx(300)
    assert [r.zone for r in reports] == ["red", "red", "red", "green"]


async def test_a_pause_that_ends_in_the_amber_band_still_waits_its_delay(autojump_clock):
    """Paused producers read the drop below hard at the same poll; the law's delay for
    the value they read still applies (the time paused counts toward it), so they do
    not all send at once."""
    reports = []
    polls = []
    signals = None

    async def refresh(topic):
        polls.append(trio.current_time())
        signals.observe_pressure("0.95" if len(polls) < 2 else "0.84")  # 400 ms
        await trio.lowlevel.checkpoint()

    signals, bp = _gate(refresh=refresh, reports=reports)
    signals.observe_pressure("1.0")
    t0 = trio.current_time()
    waited = await bp.wait("t")
    # paused 200 ms, then the rest of the 400 ms
    assert [round(p - t0, 6) for p in polls] == [0.1, 0.2]
    assert trio.current_time() - t0 == pytest.approx(0.4)
    assert waited == pytest.approx(400)
    assert [r.zone for r in reports] == ["red", "red", "amber"]
    assert reports[-1].delay_ms == pytest.approx(400)


async def test_pause_ends_when_the_signal_goes_stale(autojump_clock):
    """A dead server stops answering: its last pressure must not freeze the producer."""
    signals, bp = _gate()
    signals.observe_pressure("1.0")
    t0 = trio.current_time()
    await bp.wait("t")
    # stale once strictly older than 10 s: the first poll after that is at 10.1 s
    assert trio.current_time() - t0 == pytest.approx(10.1)


async def test_pause_gives_up_after_max_pause_ms(autojump_clock):
    policy = BackpressurePolicy(max_pause_ms=1000, signal_ttl_ms=60000)
    signals = None

    async def refresh(topic):
        signals.observe_in_flight(topic, 500)
        await trio.lowlevel.checkpoint()

    signals, bp = _gate(policy, refresh=refresh)
    signals.observe_in_flight("q", 200)  # exactly hard
    t0 = trio.current_time()
    with pytest.raises(BackpressureTimeout):
        await bp.wait("q")
    assert trio.current_time() - t0 == pytest.approx(1.0)


async def test_cancelling_a_paused_producer_stops_it_at_once(autojump_clock):
    signals, bp = _gate()
    signals.observe_pressure("0.99")
    t0 = trio.current_time()
    with trio.move_on_after(0.25):
        await bp.wait("t")
    assert trio.current_time() - t0 == pytest.approx(0.25)


async def test_disabled_policy_never_waits(autojump_clock):
    signals, bp = _gate(BackpressurePolicy(enabled=False))
    signals.observe_pressure("1.0")
    t0 = trio.current_time()
    assert await bp.wait("t") == 0
    assert trio.current_time() == t0


async def test_warning_is_logged_at_most_once_per_ten_seconds(autojump_clock, caplog):
    signals, bp = _gate()
    for _ in range(30):  # 30 batches at 250 ms each: 7.5 s
        signals.observe_pressure("0.75")
        await bp.wait("t")
    await trio.sleep(2.5)
    signals.observe_pressure("0.75")
    await bp.wait("t")
    warnings = [r for r in caplog.records if r.name == "topicd.client"]
    assert len(warnings) == 2


async def test_concurrent_batches_of_one_client_take_their_delays_in_turn(autojump_clock):
    """Three writes in flight at once in the amber band are sent one delay apart (at 250,
    500 and 750 ms), not all three at 250 ms: the law spaces a producer's sends however
    many it keeps in flight. A green batch arriving while the others wait its turn too."""
    signals, bp = _gate()
    signals.observe_pressure("0.750")  # 250 ms
    t0 = trio.current_time()
    sent = []

    async def batch(i):
        waited = await bp.wait("t")
        sent.append((i, round(trio.current_time() - t0, 6), round(waited, 3)))

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(batch, i)
        await trio.testing.wait_all_tasks_blocked()
        signals.observe_pressure("0.5")  # green now: the queued batches need no delay
        nursery.start_soon(batch, 3)
    times = sorted(t for _, t, _ in sent)
    assert times == [0, 0, 0, 0]  # the green reading ends the first's wait too
    signals.observe_pressure("0.750")
    t0 = trio.current_time()
    sent.clear()
    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(batch, i)
    assert sorted(t for _, t, _ in sent) == [0.25, 0.5, 0.75]
    # each reports the ms from its own start (its turn included)
    assert sorted(w for _, _, w in sent) == [250.0, 500.0, 750.0]


async def test_green_batches_do_not_queue_when_nobody_waits(autojump_clock):
    _, bp = _gate()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(bp.wait, "t")
    assert trio.current_time() == t0


async def test_max_pause_counts_from_the_batch_start_not_its_turn(autojump_clock):
    """A batch queued behind a paused one gives up `max_pause_ms` after it began waiting,
    not after its own turn came."""
    policy = BackpressurePolicy(max_pause_ms=1000, signal_ttl_ms=60000)
    signals, bp = _gate(policy)
    signals.observe_pressure("0.95")
    t0 = trio.current_time()
    gave_up = []

    async def batch():
        with pytest.raises(BackpressureTimeout):
            await bp.wait("t")
        gave_up.append(round(trio.current_time() - t0, 6))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch)
        nursery.start_soon(batch)
    assert gave_up == [1.0, 1.0]


def _probed_gate(answers, reports=None):
    """A gate whose pressure probe answers from `answers` in turn; returns the probe
    times too."""
    probes = []
    signals = Signals(LoopClock(), P.signal_ttl_ms)

    async def probe():
        probes.append(trio.current_time())
        signals.observe_pressure(answers[min(len(probes), len(answers)) - 1])
        await trio.lowlevel.checkpoint()

    async def refresh(topic):  # a pause polls with the same probe
        await probe()

    bp = Backpressure(
        P,
        signals,
        refresh,
        reports.append if reports is not None else None,
        refresh_pressure=probe,
    )
    return signals, bp, probes


async def test_an_amber_reading_hard_poll_old_is_re_read_before_deciding(autojump_clock):
    """The gate filled since the last answer: the probe reads it and the batch pauses
    instead of being sent on a 200 ms old amber reading."""
    reports = []
    signals, bp, probes = _probed_gate(["0.95", "0.70"], reports)
    signals.observe_pressure("0.750")
    await trio.sleep(0.2)
    t0 = trio.current_time()
    await bp.wait("t")
    assert [round(p - t0, 6) for p in probes] == [0.0, 0.1]  # the re-read, one pause poll
    assert [r.zone for r in reports] == ["red", "amber"]
    # (the 100 ms paused count toward the 167 ms delay of the reading it ended on)
    assert trio.current_time() - t0 == pytest.approx(500 * 0.1 / 0.3 / 1000)


async def test_fresh_amber_and_old_green_readings_are_not_re_read(autojump_clock):
    """A fresh amber reading is decided on as it is; while the batch waits its delay,
    the reading is re-read each time it gets `hard_poll_ms` old."""
    signals, bp, probes = _probed_gate(["0.750"])
    signals.observe_pressure("0.750")
    await trio.sleep(0.099)  # younger than hard_poll_ms
    t0 = trio.current_time()
    await bp.wait("t")
    assert [round(p - t0, 6) for p in probes] == [0.1, 0.2]
    assert trio.current_time() - t0 == pytest.approx(0.25)
    probes.clear()
    signals.observe_pressure("0.600")  # at soft: green
    await trio.sleep(5)
    t0 = trio.current_time()
    assert await bp.wait("t") == 0 and probes == [] and trio.current_time() == t0
    signals.observe_pressure("0.750")
    await trio.sleep(10.001)  # stale: no signal, so nothing to re-read
    assert await bp.wait("t") == 0 and probes == []


async def test_an_old_green_reading_is_re_read_while_a_write_is_unanswered(autojump_clock):
    """A green reading `hard_poll_ms` old while one of the client's writes waits for
    its answer is the server's silence: it is re-read before the batch decides."""
    reports = []
    signals, bp, probes = _probed_gate(["0.95", "0.70"], reports)
    signals.observe_pressure("0.300")
    signals.writes_unanswered = 1
    await trio.sleep(0.099)  # younger than hard_poll_ms: decided on as it is
    t0 = trio.current_time()
    assert await bp.wait("t") == 0 and probes == []
    await trio.sleep(0.001)  # now hard_poll_ms old
    t0 = trio.current_time()
    await bp.wait("t")
    assert [round(p - t0, 6) for p in probes] == [0.0, 0.1]  # the re-read, one pause poll
    assert [r.zone for r in reports] == ["green", "red", "amber"]
    assert trio.current_time() - t0 == pytest.approx(500 * 0.1 / 0.3 / 1000)


async def test_an_old_green_reading_with_no_write_unanswered_is_not_re_read(autojump_clock):
    signals, bp, probes = _probed_gate(["0.95"])
    signals.observe_pressure("0.300")
    signals.writes_unanswered = 1
    signals.writes_unanswered -= 1  # answered
    await trio.sleep(5)
    t0 = trio.current_time()
    assert await bp.wait("t") == 0 and probes == [] and trio.current_time() == t0
    signals.writes_unanswered = 1
    await trio.sleep(10.001)  # stale: no signal, so nothing to re-read
    assert await bp.wait("t") == 0 and probes == []


async def test_a_delay_ends_early_when_the_pressure_falls_while_it_is_waited(autojump_clock):
    """A 417 ms delay decided at 0.85 is not slept whole when an answer 50 ms later
    reads 0.66 (100 ms): the batch goes at 100 ms. The server's queue drains in tens of
    ms; a delay kept on the old reading would leave it idle."""
    reports = []
    signals, bp = _gate(reports=reports)
    signals.observe_pressure("0.85")
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def batch():
            assert await bp.wait("t") == pytest.approx(100)

        nursery.start_soon(batch)
        await trio.sleep(0.05)
        signals.observe_pressure("0.66")  # another write's answer
    assert trio.current_time() - t0 == pytest.approx(0.1)
    assert [(r.zone, round(r.delay_ms)) for r in reports] == [("amber", 417)]


async def test_a_delay_turns_into_a_pause_when_the_pressure_reaches_hard(autojump_clock):
    """The law follows the signal up too: an answer reading 0.95 during a 100 ms delay
    pauses the batch until a re-read is below hard, then the delay for that reading
    (from the batch's turn) applies."""
    reports = []
    polls = []
    signals = None

    async def refresh(topic):
        polls.append(round(trio.current_time() - t0, 6))
        signals.observe_pressure("0.7")  # 167 ms
        await trio.lowlevel.checkpoint()

    signals, bp = _gate(refresh=refresh, reports=reports)
    signals.observe_pressure("0.66")  # 100 ms
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bp.wait, "t")
        await trio.sleep(0.05)
        signals.observe_pressure("0.95")
    assert polls == [0.15]
    assert trio.current_time() - t0 == pytest.approx(500 * 0.1 / 0.3 / 1000)
    assert [r.zone for r in reports] == ["amber", "red", "amber"]
