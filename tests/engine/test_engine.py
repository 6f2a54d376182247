"""Engine unit tests: cursor rules, tombstone math, deletes, TTL, idempotency, long-polls.

Method: drive `Engine` directly (no HTTP) on the test's Trio loop. Time-dependent tests
take `autojump_clock`; the engine's `FakeWallClock` follows Trio's virtual clock, so the
assertions pin exact virtual times (`trio.current_time() - t0 == ...`).
"""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing

from topicd.config import Config
from topicd.engine.engine import Engine, open_engine, parse_match
from topicd.engine.topic import EvictionRuns
from topicd.errors import (
    BatchTooLarge,
    Forbidden,
    InvalidRequest,
    RecordTooLarge,
    Throttled,
    TopicExistsIncompatible,
    TopicFull,
    TopicNotEmpty,
    TopicNotFound,
)
from topicd.testing.fake_clock import FakeWallClock, advance
from topicd.testing.harness import make_config
from topicd.wire import DeleteIn, DiffIn, RecordIn, TopicConfigIn, WriteIn


def recs(*datas: bytes, tag: str | None = None, node: str | None = None) -> list[RecordIn]:
    return [RecordIn(data=msgspec.Raw(d), tag=tag, node=node) for d in datas]


async def write(engine: Engine, name: str, n: int = 1, **kw):
    tag = kw.pop("tag", None)
    node = kw.pop("node", None)
    return await engine.append(
        name, WriteIn(records=recs(*[b"%d" % i for i in range(n)], tag=tag, node=node), **kw)
    )


async def read(engine: Engine, name: str, **kw):
    _, res = await engine.diff(name, DiffIn(**kw))
    return res


def seqs_of(res) -> list[int]:
    return [int(r.split(b",", 1)[0][len(b'{"$seq":') :]) for r in res.records]


@pytest.fixture
async def engine():
    async with open_engine(Config(), FakeWallClock()) as e:
        yield e


async def put(engine: Engine, name: str, **cfg):
    topic, _ = await engine.put_topic(name, TopicConfigIn(**cfg))
    return topic


# ---- cursors ------------------------------------------------------------------------


async def test_cursor_rules(engine):
    await write(engine, "t", 5)
    res = await read(engine, "t")
    assert seqs_of(res) == [1, 2, 3, 4, 5]
    assert (res.next_from_seq, res.caught_up, res.lag, res.tombstone) == (5, True, 0, None)
    res = await read(engine, "t", from_seq=2, limit=2)
    assert seqs_of(res) == [3, 4]
    assert (res.next_from_seq, res.caught_up, res.lag) == (4, False, 1)
    res = await read(engine, "t", from_seq=5)
    assert seqs_of(res) == [] and res.next_from_seq == 5 and res.caught_up


async def test_limit_zero_means_default_and_clamps(engine):
    await write(engine, "t", 1200)
    assert len((await read(engine, "t", limit=0)).records) == 256
    assert len((await read(engine, "t", limit=5000)).records) == 1000


async def test_cursor_from_the_future_is_a_recreated_tombstone(engine):
    await write(engine, "t", 3)
    await engine.delete_topic("t", False)
    await write(engine, "t", 2)
    res = await read(engine, "t", from_seq=3)
    t = res.tombstone
    assert t is not None
    assert (t.gap_from, t.gap_to, t.reason, t.earliest_seq, t.head_seq) == (1, 2, "recreated", 1, 2)
    assert t.to_wire()["missed_estimate"] == 2
    assert seqs_of(res) == [1, 2]


async def test_recreated_empty_topic_gives_inverted_range(engine):
    await write(engine, "t", 3)
    await engine.delete_topic("t", False)
    await engine.put_topic("t", None)
    res = await read(engine, "t", from_seq=3)
    assert res.tombstone is not None
    assert (res.tombstone.gap_from, res.tombstone.gap_to) == (1, 0)
    assert res.next_from_seq == 0 and res.caught_up


async def test_byte_budget_always_delivers_one_record(engine):
    await write(engine, "t", 3)
    res = await read(engine, "t", max_batch_bytes=1)
    assert seqs_of(res) == [1]
    assert res.next_from_seq == 1


async def test_max_scan_per_read_returns_early():
    cfg = make_config(protocol={"max_scan_per_read": 10})
    async with open_engine(cfg, FakeWallClock()) as engine:
        await write(engine, "t", 30, node="a")
        res = await read(engine, "t", node="a")
        assert res.records == [] and res.next_from_seq == 10 and not res.caught_up
        assert res.scanned == 10


# ---- tombstones -----------------------------------------------------------------------


async def test_cap_records_tombstone_math(engine):
    await put(engine, "t", cap_records=3)
    await write(engine, "t", 10)
    topic = engine.get("t")
    assert (topic.earliest_seq, topic.evict_floor, topic.count) == (8, 8, 3)
    res = await read(engine, "t", from_seq=2)
    t = res.tombstone
    assert t is not None
    assert (t.gap_from, t.gap_to, t.reason, t.earliest_seq, t.head_seq) == (3, 7, "cap", 8, 10)
    assert t.to_wire()["missed_estimate"] == 5
    assert seqs_of(res) == [8, 9, 10]
    # a cursor at the floor reads normally
    res = await read(engine, "t", from_seq=7)
    assert res.tombstone is None and seqs_of(res) == [8, 9, 10]


async def test_cap_bytes_evicts_oldest(engine):
    await put(engine, "t", cap_bytes=10)
    for _ in range(4):
        await engine.append("t", WriteIn(records=recs(b'"abc"')))  # 5 bytes each
    topic = engine.get("t")
    assert (topic.count, topic.bytes, topic.evict_floor) == (2, 10, 3)


async def test_deleted_gap_below_earliest_is_silent(engine):
    await write(engine, "t", 10)
    await engine.delete_records("t", DeleteIn(before_seq=6))
    topic = engine.get("t")
    assert (topic.earliest_seq, topic.evict_floor) == (6, 1)
    res = await read(engine, "t", from_seq=0)
    assert res.tombstone is None
    assert seqs_of(res) == [6, 7, 8, 9, 10]


async def test_tombstone_range_covers_deleted_seqs_between_evictions(engine):
    await write(engine, "t", 10)
    await engine.delete_records("t", DeleteIn(before_seq=4))  # 1..3 deleted
    await put(engine, "t", cap_records=2)  # evicts 4..8
    res = await read(engine, "t", from_seq=0)
    t = res.tombstone
    assert t is not None
    assert (t.gap_from, t.gap_to, t.earliest_seq) == (1, 8, 9)
    assert seqs_of(res) == [9, 10]


async def test_ttl_expiry_is_strictly_greater_and_driven_by_the_clock(autojump_clock):
    clock = FakeWallClock()
    async with open_engine(Config(), clock) as engine:
        await put(engine, "t", ttl_ms=1000)
        t0 = trio.current_time()
        await write(engine, "t", 2)
        await advance(autojump_clock, 1.0)  # now - ts == ttl: not yet expired
        assert engine.get("t").count == 2
        assert trio.current_time() - t0 == 1.0
        await advance(autojump_clock, 0.001)
        res = await read(engine, "t", from_seq=0)
        assert res.tombstone is not None and res.tombstone.reason == "ttl"
        assert (res.tombstone.gap_from, res.tombstone.gap_to) == (1, 2)
        assert res.records == []


async def test_housekeeper_expires_idle_topics_without_reads(autojump_clock):
    async with open_engine(Config(), FakeWallClock()) as engine:
        await put(engine, "t", ttl_ms=500)
        await write(engine, "t", 3)
        before = engine.total_bytes
        assert before == 3
        await advance(autojump_clock, 2.0)  # no reads: the housekeeper's sweep expires them
        topic = engine.topics["t"]
        assert topic.count == 0 and topic.evict_floor == 4 and topic.earliest_seq == 4
        assert engine.total_bytes == 0


async def test_mixed_reason(autojump_clock):
    async with open_engine(Config(), FakeWallClock()) as engine:
        await put(engine, "t", ttl_ms=1000, cap_records=2)
        await write(engine, "t", 4)  # cap evicts 1, 2
        await advance(autojump_clock, 2)
        res = await read(engine, "t", from_seq=0)  # ttl expires 3, 4
        assert res.tombstone is not None
        assert (res.tombstone.gap_from, res.tombstone.gap_to) == (1, 4)
        assert res.tombstone.reason == "mixed"
        res = await read(engine, "t", from_seq=2)
        assert res.tombstone is not None and res.tombstone.reason == "ttl"


def test_eviction_runs_stay_bounded_and_exact_in_range():
    runs = EvictionRuns()
    for i in range(1000):
        runs.add(i * 2 + 1, i * 2 + 2, "cap" if i % 2 else "ttl")
    assert len(runs._runs) <= 64
    assert runs.reason_for(1999, 2000) == "cap"
    assert runs.reason_for(1, 2) == "mixed"  # the oldest runs merged


async def test_tighter_config_evicts_immediately(engine):
    await write(engine, "t", 5)
    await put(engine, "t", cap_records=1)
    topic = engine.get("t")
    assert (topic.count, topic.earliest_seq, topic.evict_floor) == (1, 5, 5)


async def test_reject_topic_caps(engine):
    await put(engine, "t", cap_records=3, discard="reject")
    with pytest.raises(RecordTooLarge):
        await write(engine, "t", 4)
    await write(engine, "t", 2)
    with pytest.raises(TopicFull) as exc:
        await write(engine, "t", 2)
    assert exc.value.detail == {
        "topic": "t",
        "cap_records": 3,
        "cap_bytes": 0,
        "head_seq": 2,
        "earliest_seq": 1,
    }
    await write(engine, "t", 1)
    topic = engine.get("t")
    assert (topic.count, topic.head_seq, topic.evict_floor) == (3, 3, 1)
    # a tighter cap evicts at once, reject topic or not (README §10)
    await put(engine, "t", cap_records=1, discard="reject")
    assert (topic.count, topic.evict_floor) == (1, 3)
    with pytest.raises(TopicFull):
        await write(engine, "t", 1)


# ---- deletes ------------------------------------------------------------------------


async def test_delete_by_tag_and_bound(engine):
    await write(engine, "t", 2, tag="lab-1:x")
    await write(engine, "t", 2, tag="lab-2:x")
    await write(engine, "t", 1)
    await write(engine, "t", 1, tag="lab-2:y")
    res = await engine.delete_records("t", DeleteIn(match=["tag", "Glob", "lab-2:*"], before_seq=6))
    assert res.deleted == 2
    topic = engine.get("t")
    assert [s for s in range(1, 7) if topic.live(s)] == [1, 2, 5, 6]
    res = await engine.delete_records("t", DeleteIn(match="lab-1:x"))
    assert res.deleted == 2
    assert topic.earliest_seq == 5  # a dead prefix advances earliest_seq ...
    assert topic.evict_floor == 1  # ... never evict_floor
    res = await engine.delete_records("t", DeleteIn(match="*"))
    assert res.deleted == 1  # untagged records never match
    assert topic.count == 1 and topic.live(5)


async def test_delete_requires_a_selector(engine):
    await write(engine, "t", 1)
    with pytest.raises(InvalidRequest):
        await engine.delete_records("t", DeleteIn())


def test_match_parsing():
    assert parse_match("a*") == ("Glob", "a")
    assert parse_match("a") == ("Eq", "a")
    assert parse_match(["tag", "Glob", "x*y*"]) == ("Glob", "x*y")
    assert parse_match(["tag", "Eq", "a*"]) == ("Eq", "a*")
    for bad in (["tag", "Glob", "x"], ["tag", "eq", "x"], ["tags", "Eq", "x"], ["tag", "Eq"]):
        with pytest.raises(InvalidRequest):
            parse_match(bad)


async def test_tag_index_rebuild_keeps_deletes_exact(engine):
    for i in range(3000):
        await engine.append("t", WriteIn(records=recs(b"1", tag=f"k{i % 7}")))
    await engine.delete_records("t", DeleteIn(before_seq=2500))
    res = await engine.delete_records("t", DeleteIn(match="k3"))
    topic = engine.get("t")
    expected = len([s for s in range(2500, 3001) if (s - 1) % 7 == 3])
    assert res.deleted == expected
    assert topic.count == 501 - expected


# ---- topics -------------------------------------------------------------------------


async def test_lazy_creation_rules(engine):
    with pytest.raises(TopicNotFound):
        await write(engine, "a", create=False)
    with pytest.raises(TopicNotFound):
        await write(engine, "a", config=TopicConfigIn(auto_create=False))
    res = await write(engine, "a", create=True, config=TopicConfigIn(auto_create=False))
    assert res.created
    res = await write(engine, "a", create=False)
    assert not res.created


async def test_inline_config_needs_admin_only_when_creating(engine):
    with pytest.raises(Forbidden):
        await engine.append(
            "x", WriteIn(records=recs(b"1"), config=TopicConfigIn()), can_admin=False
        )
    await write(engine, "x")
    res = await engine.append(
        "x", WriteIn(records=recs(b"1"), config=TopicConfigIn()), can_admin=False
    )
    assert res.first_seq == 2


async def test_put_semantics(engine):
    topic, created = await engine.put_topic("t", TopicConfigIn(cap_records=5, lease_ms=1))
    assert created and topic.config.lease_ms == 100 and topic.config.cap_records == 5
    same, created = await engine.put_topic("t", TopicConfigIn(cap_records=5, lease_ms=50))
    assert not created and same is topic
    _, created = await engine.put_topic("t", TopicConfigIn())
    assert topic.config.cap_records == 0  # not a merge
    with pytest.raises(TopicExistsIncompatible) as exc:
        await engine.put_topic("t", TopicConfigIn(type="queue"))
    assert exc.value.detail["existing_type"] == "log"


async def test_delete_topic_if_empty(engine):
    await write(engine, "t", 2)
    with pytest.raises(TopicNotEmpty):
        await engine.delete_topic("t", True)
    assert await engine.delete_topic("t", False)
    assert not await engine.delete_topic("t", False)


async def test_max_topics_and_total_bytes():
    cfg = make_config(limits={"max_topics": 2, "max_total_bytes": 10})
    async with open_engine(cfg, FakeWallClock()) as engine:
        await write(engine, "a")
        await write(engine, "b")
        with pytest.raises(Throttled) as exc:
            await write(engine, "c")
        assert exc.value.detail == {"limit": "max_topics", "max": 2}
        await engine.put_topic("a", TopicConfigIn(cap_records=3))  # updates always work
        await engine.append("a", WriteIn(records=recs(b'"12345"')))
        with pytest.raises(Throttled) as exc:
            await engine.append("a", WriteIn(records=recs(b'"12"')))
        assert exc.value.detail == {"limit": "max_total_bytes", "max": 10}
        await engine.delete_topic("a", False)  # frees its bytes
        await engine.append("b", WriteIn(records=recs(b'"12"')))


async def test_batch_limits(engine):
    with pytest.raises(BatchTooLarge):
        await write(engine, "t", 10001)
    with pytest.raises(InvalidRequest):
        await engine.append("t", WriteIn(records=[]))


# ---- idempotency --------------------------------------------------------------------


async def test_idempotent_replay_and_window(autojump_clock):
    async with open_engine(Config(), FakeWallClock()) as engine:
        await put(engine, "t", idempotency_window_ms=1000)
        r1 = await write(engine, "t", 3, idempotency_key="k")
        await write(engine, "t", 1)
        r2 = await write(engine, "t", 3, idempotency_key="k")
        assert r2.deduped and not r1.deduped
        assert (r2.first_seq, r2.count, r2.head_seq) == (1, 3, 3)
        assert engine.get("t").head_seq == 4
        r3 = await engine.append("t", WriteIn(records=recs(b"1")), header_key="k")
        assert r3.deduped  # the header is the same key
        await advance(autojump_clock, 1.0)
        r4 = await write(engine, "t", 1, idempotency_key="k")
        assert not r4.deduped and r4.first_seq == 5


async def test_concurrent_same_key_writes_append_once(engine):
    results = []

    async def one():
        results.append(await write(engine, "t", 2, idempotency_key="same"))

    async with trio.open_nursery() as n:
        for _ in range(5):
            n.start_soon(one)
    assert sum(not r.deduped for r in results) == 1
    assert {(r.first_seq, r.count) for r in results} == {(1, 2)}
    assert engine.get("t").head_seq == 2


async def test_idempotency_entry_cap(autojump_clock):
    cfg = make_config(limits={"max_idempotency_entries": 2})
    async with open_engine(cfg, FakeWallClock()) as engine:
        await put(engine, "t", idempotency_window_ms=1000)
        await write(engine, "t", idempotency_key="a")
        await write(engine, "t", idempotency_key="b")
        with pytest.raises(Throttled) as exc:
            await write(engine, "t", idempotency_key="c")
        assert exc.value.detail == {"limit": "max_idempotency_entries", "max": 2}
        await write(engine, "t")  # unkeyed writes are not affected
        await advance(autojump_clock, 1.0)  # entries expire, pruned first
        await write(engine, "t", idempotency_key="c")


async def test_recreated_topic_does_not_dedupe_against_its_previous_life(engine):
    await write(engine, "t", 1, idempotency_key="k")
    await engine.delete_topic("t", False)
    res = await write(engine, "t", 1, idempotency_key="k")
    assert not res.deduped and res.created


# ---- long-poll ----------------------------------------------------------------------


async def test_long_poll_is_woken_by_the_append(autojump_clock):
    async with open_engine(Config(), FakeWallClock()) as engine:
        await write(engine, "t", 1)
        got = []

        async def poll():
            t0 = trio.current_time()
            got.append(await read(engine, "t", from_seq=1, wait_ms=5000))
            got.append(trio.current_time() - t0)

        async with trio.open_nursery() as n:
            n.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()  # the poll waits
            await advance(autojump_clock, 2)
            await write(engine, "t", 1)
        assert seqs_of(got[0]) == [2]
        assert got[1] == 2


async def test_long_poll_times_out_with_the_first_result(autojump_clock):
    async with open_engine(Config(), FakeWallClock()) as engine:
        await write(engine, "t", 1)
        t0 = trio.current_time()
        res = await read(engine, "t", from_seq=1, wait_ms=999999)
        assert trio.current_time() - t0 == 30.0  # clamped to max_wait_ms
        assert res.records == [] and res.caught_up


async def test_long_poll_topic_deleted_is_404(autojump_clock):
    async with open_engine(Config(), FakeWallClock()) as engine:
        await write(engine, "t", 1)

        async def poll():
            with pytest.raises(TopicNotFound):
                await read(engine, "t", from_seq=1, wait_ms=5000)

        async with trio.open_nursery() as n:
            n.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            await engine.delete_topic("t", False)


async def test_drain_releases_long_polls(autojump_clock):
    async with open_engine(Config(), FakeWallClock()) as engine:
        await write(engine, "t", 1)
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(read, engine, "t")
            n.start_soon(lambda: read(engine, "t", from_seq=1, wait_ms=5000))
            await trio.testing.wait_all_tasks_blocked()
            engine.begin_drain()
        assert trio.current_time() - t0 == 0
        res = await read(engine, "t", from_seq=1, wait_ms=5000)  # no parking while draining
        assert trio.current_time() - t0 == 0 and res.records == []
