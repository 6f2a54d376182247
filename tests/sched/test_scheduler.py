"""The delivery scheduler inside a running engine (scheduler spec A.2, A.5, B.1-B.3).

Method: an in-process engine on Trio's `MockClock` (autojump); watch connections are
registered through the engine's registry and their bounded channels are read directly,
so the tests see exactly which `FrameRef`s each drain offered, without the SSE pump.
"""

from __future__ import annotations

import itertools

import orjson
import pytest
import trio
import trio.testing

from tests.sched.helpers import live_conn, received, write_req
from topicd.engine.watch import FrameRef
from topicd.testing.fake_clock import advance
from topicd.testing.harness import make_config, open_app
from topicd.wire import DiffIn, TopicConfigIn


def seqs_of(refs: list[FrameRef]) -> list[int]:
    out: list[int] = []
    for ref in refs:
        if ref.body and ref.body.startswith(b"event: record"):
            data = orjson.loads(ref.body.split(b"data: ", 1)[1])
            out.extend(r["$seq"] for r in data["records"])
    return out


def assert_contiguous(refs: list[FrameRef], start: int) -> None:
    pos = start
    for ref in refs:
        assert ref.from_seq == pos, (ref.from_seq, pos)
        pos = ref.to_seq


async def test_a_burst_of_1000_writes_is_one_unit_of_work(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        conn = await live_conn(engine, "t", limit=1000)
        drains = engine.sched.stats.drains
        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(engine.append, "t", write_req(i))
        await trio.testing.wait_all_tasks_blocked()  # every drain done
        assert engine.sched.stats.drains - drains == 1
        refs = received(conn)
        assert_contiguous(refs, 0)
        assert seqs_of(refs) == list(range(1, 1001))


async def test_drain_bound_requeues_the_rest(autojump_clock):
    cfg = make_config(scheduler={"drain_max_records": 100})
    async with open_app(cfg) as h:
        engine = h.engine
        await engine.put_topic("t", None)
        conn = await live_conn(engine, "t")
        async with trio.open_nursery() as nursery:
            for i in range(250):
                nursery.start_soon(engine.append, "t", write_req(i))
        await trio.testing.wait_all_tasks_blocked()  # every drain done
        assert engine.sched.stats.requeued >= 2
        refs = received(conn)
        assert_contiguous(refs, 0)
        assert seqs_of(refs) == list(range(1, 251))
        assert max(r.to_seq - r.from_seq for r in refs) <= 100


async def test_per_topic_order_with_many_topics_and_priorities(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        names = [f"t{i}" for i in range(12)]
        conns = {}
        for i, name in enumerate(names):
            await engine.put_topic(name, TopicConfigIn(priority=i * 150 - 600))
            conns[name] = await live_conn(engine, name)
        for round_ in range(20):
            async with trio.open_nursery() as nursery:
                for name in names:
                    nursery.start_soon(engine.append, name, write_req(round_))
            await advance(autojump_clock, 0.001)
        await advance(autojump_clock, 0.05)  # past any coalescing delay: every drain done
        for name in names:
            refs = received(conns[name])
            assert_contiguous(refs, 0)
            assert seqs_of(refs) == list(range(1, 21))


async def test_topic_without_interest_is_not_queued(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        marked = engine.sched.stats.marked
        for i in range(5):
            await engine.append("t", write_req(i))
        assert engine.sched.stats.marked == marked
        topic = engine.topics["t"]
        assert topic.drained_to == topic.head_seq == 5
        # a watcher joining later starts cleanly from the head
        conn = await live_conn(engine, "t")
        await engine.append("t", write_req("x"))
        await trio.testing.wait_all_tasks_blocked()  # every drain done
        refs = received(conn)
        assert [(r.from_seq, r.to_seq) for r in refs] == [(5, 6)]


async def test_on_drain_hook_sees_every_range_once_in_order(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        topic = engine.topics["t"]
        ranges: list[tuple[int, int]] = []
        topic.on_drain += (lambda t, a, b: ranges.append((a, b)),)
        for i in range(7):
            await engine.append("t", write_req(i))
            if i % 3 == 0:
                await trio.testing.wait_all_tasks_blocked()  # every drain done
        await trio.testing.wait_all_tasks_blocked()  # every drain done
        assert ranges[0][0] == 0
        for (_, b), (a, _) in itertools.pairwise(ranges):
            assert a == b
        assert ranges[-1][1] == 7


async def test_long_poll_is_released_by_the_drain(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        got = []

        async def poll() -> None:
            _, res = await engine.diff("t", DiffIn(from_seq=0, wait_ms=10000))
            got.append((trio.current_time(), len(res.records)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await advance(autojump_clock, 1)  # the poll is parked, a second has passed
            t0 = trio.current_time()
            await engine.append("t", write_req(1))
        assert got == [(t0, 1)]


@pytest.mark.parametrize(
    ("priority", "expected"), [(None, 0), (5000, 1000), (-5000, -1000), (321, 321)]
)
async def test_effective_priority_manual_and_clamped(client, priority, expected):
    body = {} if priority is None else {"priority": priority}
    r = await client.put("/v0/topics/p", json=body)
    assert r.status_code in (200, 201), await r.get_data()
    state = await (await client.get("/v0/topics/p?touch=false")).get_json()
    assert state["effective_priority"] == expected


async def test_effective_priority_recency_decays_by_the_table(autojump_clock):
    async with open_app() as h:
        client = h.app.test_client()
        await client.post("/v0/topics/r", json={"records": [{"data": 1}]})
        await client.post("/v0/topics/r/diff", json={})  # a read: recency = now
        seen = {}
        elapsed = 0
        for at in (0, 15, 30, 60, 120, 299, 300):
            await advance(autojump_clock, at - elapsed)
            elapsed = at
            state = await (await client.get("/v0/topics/r?touch=false")).get_json()
            seen[at] = state["effective_priority"]
        # the decay table of scheduler spec A.5; at 299 s the curve is ≈ 0.5 (±1 below 50)
        assert seen.pop(299) in (0, 1)
        assert seen == {0: 500, 15: 354, 30: 250, 60: 125, 120: 31, 300: 0}
        state = await (await client.get("/v0/topics/r")).get_json()  # touch=true bumps it
        assert state["effective_priority"] == 500


async def test_effective_priority_includes_aging_while_queued(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        client = h.app.test_client()
        await client.put("/v0/topics/q", json={"priority": 100})
        await live_conn(engine, "q")
        engine.sched.coalesce_s = 30.0  # keep it queued (unripe) for a while
        await engine.append("q", write_req(1))
        await advance(autojump_clock, 2.5)
        state = await (await client.get("/v0/topics/q")).get_json()
        assert state["effective_priority"] == 100 + 250
        await advance(autojump_clock, 30)
        state = await (await client.get("/v0/topics/q")).get_json()
        assert state["effective_priority"] == 100  # drained: base only


async def test_config_change_rebands_a_queued_topic(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        client = h.app.test_client()
        await client.put("/v0/topics/q", json={"priority": 0})
        await live_conn(engine, "q")
        engine.sched.coalesce_s = 30.0
        await engine.append("q", write_req(1))
        slot = engine.topics["q"].slot
        assert slot.queued and slot.band == 3  # B1
        r = await client.put("/v0/topics/q", json={"priority": 900})
        assert r.status_code == 200, await r.get_data()
        assert slot.queued and slot.band == 0  # B4


async def test_deleted_topic_leaves_the_ready_set(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("d", None)
        await live_conn(engine, "d")
        engine.sched.coalesce_s = 30.0
        await engine.append("d", write_req(1))
        shard = engine.sched.shard(engine.topics["d"])
        assert len(shard.ready) == 1
        await engine.delete_topic("d", False)
        assert len(shard.ready) == 0
