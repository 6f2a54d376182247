"""Cooperative quanta and maintenance permits (scheduler spec R1.2-R1.3).

Method: an in-process engine on Trio's `MockClock`. Virtual time does not move while code
runs, so only the count bound of a `Budget` (`classes.quantum_items`) makes a loop yield
here; a side task that checkpoints in a loop sees what the drain has done at each yield.
"""

from __future__ import annotations

import trio
import trio.testing

from tests.sched.helpers import live_conn, received, write_req
from tests.sched.test_scheduler import assert_contiguous, seqs_of
from topicd.sched.classes import Budget
from topicd.testing.harness import make_config, open_app

CONNS = 40


async def test_a_budget_yields_after_its_item_count_and_after_its_quantum():
    budget = Budget(quantum_s=3600.0, every=4)
    checkpoints = [budget.due() for _ in range(9)]
    assert checkpoints == [False, False, False, True, True, True, True, True, True]
    await budget.pause()
    assert [budget.due() for _ in range(4)] == [False, False, False, True]
    timed = Budget(quantum_s=0.0, every=1_000_000)
    assert timed.due()  # no time left in a zero quantum
    assert Budget.for_class("delivery", 250, 10).quantum_s == 0.001
    assert Budget.for_class("maintenance", 250, 10).quantum_s == 0.00025


async def test_a_fan_out_yields_to_the_loop_between_connections(autojump_clock):
    async with open_app(make_config(classes={"quantum_items": 4})) as h:
        engine = h.engine
        await engine.put_topic("t", None)
        conns = [await live_conn(engine, "t") for _ in range(CONNS)]
        seen: list[int] = []  # how many connections had the frame at each side-task step

        async def side() -> None:
            for _ in range(10_000):  # bounded: a busy task would never let the test block
                seen.append(sum(c.enqueued_to["t"] == 1 for c in conns))
                if seen[-1] == CONNS:
                    return
                await trio.lowlevel.checkpoint()

        yields = engine.sched.stats.drain_yields
        async with trio.open_nursery() as nursery:
            nursery.start_soon(side)
            await engine.append("t", write_req("x"))
        # the side task may see the last offer while the drain is still in its final
        # pause (it counts its yields when it ends): let it finish first
        await trio.testing.wait_all_tasks_blocked()
        assert engine.sched.stats.drain_yields - yields >= CONNS // 4 - 1
        mid = [n for n in seen if 0 < n < CONNS]
        assert mid, seen  # the side task ran while the drain was half done
        assert mid == sorted(mid)
        for conn in conns:
            assert seqs_of(received(conn)) == [1]


async def until(cond) -> None:
    """Checkpoint until `cond()` holds (bounded, so a regression fails instead of hanging)."""
    for _ in range(10_000):
        if cond():
            return
        await trio.lowlevel.checkpoint()
    raise AssertionError("condition never held")


async def test_a_record_published_while_the_fan_out_yields_is_delivered_next(autojump_clock):
    async with open_app(make_config(classes={"quantum_items": 1})) as h:
        engine = h.engine
        await engine.put_topic("t", None)
        conns = [await live_conn(engine, "t") for _ in range(CONNS)]
        first = conns[0]

        async def writer() -> None:
            await until(lambda: first.enqueued_to["t"] == 1)  # the fan-out has started
            assert conns[-1].enqueued_to["t"] == 0  # and has not finished it
            await engine.append("t", write_req("late"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await engine.append("t", write_req("early"))
        await trio.testing.wait_all_tasks_blocked()
        assert engine.topics["t"].drained_to == 2
        for conn in conns:
            refs = received(conn)
            assert_contiguous(refs, 0)
            assert seqs_of(refs) == [1, 2]


async def test_a_stream_that_opens_during_a_fan_out_gets_no_record_twice(autojump_clock):
    async with open_app(make_config(classes={"quantum_items": 1})) as h:
        engine = h.engine
        await engine.put_topic("t", None)
        conns = [await live_conn(engine, "t") for _ in range(CONNS)]
        late: list = []

        async def opener() -> None:
            await until(lambda: conns[0].enqueued_to["t"] == 1)
            # a stream already at the head (1) while the drain still offers 0..1
            late.append(await live_conn(engine, "t"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(opener)
            await engine.append("t", write_req("a"))
        await trio.testing.wait_all_tasks_blocked()
        await engine.append("t", write_req("b"))
        await trio.testing.wait_all_tasks_blocked()
        (newcomer,) = late
        assert newcomer.enqueued_to["t"] == 2
        assert seqs_of(received(newcomer)) == [2]
        for conn in conns:
            assert seqs_of(received(conn)) == [1, 2]


async def test_maintenance_waits_for_a_permit(autojump_clock):
    async with open_app(make_config(classes={"maintenance_permits": 1})) as h:
        engine = h.engine
        swept = trio.Event()

        async def sweep() -> None:
            await engine.housekeep()
            swept.set()

        async with trio.open_nursery() as nursery:
            async with engine.maintenance:
                nursery.start_soon(sweep)
                await trio.testing.wait_all_tasks_blocked()
                assert not swept.is_set()  # the one permit is held
                assert engine.maintenance.statistics().tasks_waiting == 1
            await swept.wait()
