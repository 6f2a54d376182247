"""Router work inside the delivery scheduler (router work in the source's band, deferral,
isolation from a busy destination).

Method: in-process engines on Trio's `MockClock` (autojump). The sweep is pushed out to
an hour (`routers.tick_ms`), so every copy seen was made by a drain, a commit or a read;
`trio.current_time()` staying put proves no timer was waited for. A write "in flight"
is a real one on the WAL commit path of a `FakeDisk` engine whose WAL calls take a
virtual second (its seqs are reserved, not yet published); the test checkpoints until
a condition holds and never sleeps.
"""

from __future__ import annotations

import trio
import trio.testing

from tests.sched.helpers import live_conn, received, write_req
from topicd.offload import InlineOffload
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, make_config, open_app, open_durable
from topicd.wire import RouterIn, TopicConfigIn

NO_SWEEP = {"tick_ms": 3_600_000}


async def until(cond) -> None:
    """Checkpoint until `cond()` holds (bounded: a test fails rather than spins)."""
    for _ in range(10_000):
        if cond():
            return
        await trio.lowlevel.checkpoint()
    raise AssertionError("condition never held")


def datas(topic) -> list[bytes]:
    out = []
    seq = topic.earliest_seq
    while seq <= topic.head_seq:
        enc = topic.enc(seq)
        if enc is not None:
            out.append(enc.split(b'"data":', 1)[1][:-1])
        seq += 1
    return out


async def test_the_source_drain_copies_without_the_sweep(autojump_clock):
    async with open_app(make_config(routers=NO_SWEEP)) as h:
        engine = h.engine
        await engine.routers.put("s->d", RouterIn(source="s", dest="d"))
        t0 = trio.current_time()
        await engine.append("s", write_req(1, 2))
        await trio.testing.wait_all_tasks_blocked()
        assert datas(engine.topics["d"]) == [b"1", b"2"]
        assert trio.current_time() == t0


async def test_a_long_feed_requeues_the_source_batch_by_batch(autojump_clock):
    cfg = make_config(routers={**NO_SWEEP, "batch": 10})
    async with open_app(cfg) as h:
        engine = h.engine
        await engine.routers.put("s->d", RouterIn(source="s", dest="d"))
        requeued = engine.sched.stats.requeued
        t0 = trio.current_time()
        await engine.append("s", write_req(*range(35)))
        await trio.testing.wait_all_tasks_blocked()
        assert len(datas(engine.topics["d"])) == 35
        assert engine.sched.stats.requeued - requeued >= 3  # 10 + 10 + 10 + 5
        assert trio.current_time() == t0


async def test_under_defer_copies_move_to_the_dest_drain_one_band_lower(autojump_clock):
    async with open_app(make_config(routers=NO_SWEEP)) as h:
        engine = h.engine
        await engine.put_topic("s", TopicConfigIn(priority=600))  # B3
        await engine.put_topic("d", TopicConfigIn(priority=600))
        await engine.routers.put("s->d", RouterIn(source="s", dest="d"))
        d = engine.topics["d"]
        routers = engine.routers
        drains: list[tuple[str, int, int]] = []
        dest_pass = routers.drain_dest

        def spy(topic):
            drains.append((topic.name, topic.slot.band, topic.head_seq))
            return dest_pass(topic)

        routers.drain_dest = spy  # type: ignore[method-assign]
        engine.sched.set_defer(True)
        await engine.append("s", write_req(1))
        await trio.testing.wait_all_tasks_blocked()
        # s drained in B3; then d in B2 (one band below its own B3), still without the
        # copy: the source's drain made none, the destination's drain made it
        assert drains == [("s", 1, 1), ("d", 2, 0)]
        assert datas(d) == [b"1"]  # the destination's drain made it
        engine.sched.set_defer(False)
        await engine.append("s", write_req(2))
        await trio.testing.wait_all_tasks_blocked()
        assert datas(d) == [b"1", b"2"]


async def test_demotion_is_one_band_and_b0_stays_b0():
    async with open_app() as h:
        sched = h.engine.sched
        assert [sched.demoted(b) for b in (900, 600, 300, 100, -5)] == [500, 250, 0, -1, -5]


async def test_a_dest_with_a_write_in_flight_holds_only_its_own_feed(autojump_clock):
    cfg = durable_config(routers=NO_SWEEP)
    slow = [0.0]
    offload = InlineOffload(lambda group: slow[0])
    async with open_durable(FakeDisk(), cfg, offload=offload) as engine:
        await engine.put_topic("s", TopicConfigIn(durability="ephemeral"))
        await engine.put_topic("o", TopicConfigIn(durability="ephemeral"))
        await engine.put_topic("d", TopicConfigIn(durability="disk"))
        await engine.routers.put("s->d", RouterIn(source="s", dest="d"))
        other = await live_conn(engine, "o")
        d = engine.topics["d"]
        for name in ("s", "o", "d"):  # the first writes log their seq reservations
            await engine.append(name, write_req("w"))
        await trio.testing.wait_all_tasks_blocked()
        slow[0] = 1.0  # every WAL call now takes a virtual second
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.append, "d", write_req("x"))
            await until(lambda: d.next_seq != d.head_seq + 1)  # the write is in flight
            await engine.append("s", write_req("a"))  # ephemeral: published at once
            await engine.append("o", write_req("o1"))
            await until(lambda: d in engine.routers.held)
            assert d.head_seq == 2  # "w" and the copy of "w"
            # the held feed delays nobody else: o's watcher gets its record
            got: list = []
            await until(lambda: bool(got.extend(received(other)) or got))
            assert trio.current_time() == t0  # delivered while d's write is still in flight
            # a direct write arriving now waits at the gate, behind the held copy
            nursery.start_soon(engine.append, "d", write_req("y"))
        await trio.testing.wait_all_tasks_blocked()
        assert datas(d) == [b'"w"', b'"w"', b'"x"', b'"a"', b'"y"']
        assert not engine.routers.held


async def test_a_dest_nobody_reads_live_costs_no_drain_of_its_own(autojump_clock):
    """Ten routers out of one source: each write is one drain (the source's), not eleven.
    A destination gets its own drain only when something consumes its deliveries."""
    async with open_app(make_config(routers=NO_SWEEP)) as h:
        engine = h.engine
        for i in range(10):
            await engine.routers.put(f"s->d{i}", RouterIn(source="s", dest=f"d{i}"))
        drains = engine.sched.stats.drains
        await engine.append("s", write_req(1))
        await trio.testing.wait_all_tasks_blocked()
        assert engine.sched.stats.drains - drains == 1
        for i in range(10):
            d = engine.topics[f"d{i}"]
            assert datas(d) == [b"1"]
            assert d.drained_to == d.head_seq == 1  # nothing left for a later drain
            assert not d.slot.queued


async def test_a_watched_dest_is_drained_and_its_watcher_gets_the_copies(autojump_clock):
    async with open_app(make_config(routers=NO_SWEEP)) as h:
        engine = h.engine
        await engine.routers.put("s->d0", RouterIn(source="s", dest="d0"))
        await engine.routers.put("s->d1", RouterIn(source="s", dest="d1"))
        conn = await live_conn(engine, "d1")
        drains = engine.sched.stats.drains
        await engine.append("s", write_req(1, 2))
        await trio.testing.wait_all_tasks_blocked()
        assert engine.sched.stats.drains - drains == 2  # the source's, and d1's
        got = [ref.body for ref in received(conn)]
        assert len(got) == 1 and got[0] is not None
        assert b'"data":1' in got[0] and b'"data":2' in got[0]


async def test_a_copy_into_a_dest_that_feeds_another_is_drained_on(autojump_clock):
    async with open_app(make_config(routers=NO_SWEEP)) as h:
        engine = h.engine
        await engine.routers.put("a->b", RouterIn(source="a", dest="b"))
        await engine.routers.put("b->c", RouterIn(source="b", dest="c"))
        await engine.append("a", write_req(7))
        await trio.testing.wait_all_tasks_blocked()
        assert datas(engine.topics["c"]) == [b"7"]
