"""The payload cache: absorbed records' bytes leave memory, reads bring them back exactly.

Method: a durable engine on `FakeDisk` (inline offload and recovery) with 4-seq chunks
(`payloads.CHUNK_SHIFT` 2) so a few dozen records span many chunks. The bound is set
from the bytes the chunks really hold, then exactly at and one byte below an edge, and
the test checks which chunks stayed resident and that the cache's count equals the bytes
really held. Every read path is run once with everything in memory and again after the
cache evicted everything it may (bound 0) — diff with each projection option, a node
filter, the long-poll, an SSE catch-up from 0, queue claims, a router that resumes over
evicted source records, recovery — and must return the same bytes. Corruption: a byte
of a sealed segment is changed under an evicted record; the miss must be a `500
internal`, counted in `topicd_segment_corruption_total`, never served.
"""

from __future__ import annotations

import dataclasses
import itertools
import posixpath

import msgspec
import orjson
import pytest
import trio

from tests.storage.test_checkpoint import cp, state
from tests.storage.test_segments import _flip
from topicd.config import Config
from topicd.engine import payloads
from topicd.engine.engine import Engine
from topicd.engine.topic import EVICTED, Topic
from topicd.sched.classes import Budget
from topicd.storage import checkpoint
from topicd.storage import segments as segs
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, open_durable, open_durable_app
from topicd.testing.sse import open_stream
from topicd.testing.ws import open_ws_in_process
from topicd.wire import DiffIn, RecordIn, RouterIn, TopicConfigIn, WriteIn


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(payloads, "CHUNK_SHIFT", 2)


def config(cache_bytes: int = 1 << 28, max_events: int = 8) -> Config:
    cfg = durable_config(segments={"inline_max_bytes": 0})
    seg = dataclasses.replace(cfg.storage.segments, max_events=max_events)
    storage = dataclasses.replace(cfg.storage, segments=seg, payload_cache_bytes=cache_bytes)
    return dataclasses.replace(cfg, storage=storage)


async def fill(engine: Engine, name: str, n: int, **extras: object) -> None:
    for i in range(n):
        rec = RecordIn(data=msgspec.Raw(b'"%d-%s"' % (i, b"x" * (i % 7))), **extras)  # type: ignore[arg-type]
        await engine.append(name, WriteIn(records=[rec]))


def resident_absorbed(engine: Engine) -> int:
    """Bytes held in memory of the records in released (whole, absorbed) chunks, counted
    from the slots themselves."""
    shift = engine.payloads.shift
    return sum(t.resident_bytes(1, (t.released << shift) - 1) for t in engine.by_id.values())


def chunk_bytes(t: Topic, k: int) -> int:
    return t.resident_bytes(k << 2, (k << 2) + 3)


@pytest.mark.parametrize("below", [0, 1])
async def test_the_cache_keeps_the_newest_chunks_that_fit_its_bound_exactly(below):
    disk = FakeDisk()
    async with open_durable(disk, config()) as engine:
        await fill(engine, "t", 40)
        t = engine.get("t")
        sizes = {k: chunk_bytes(t, k) for k in range(11)}
        # exactly the three newest whole chunks (7, 8, 9), or one byte less
        engine.payloads.bound = sizes[7] + sizes[8] + sizes[9] - below
        assert await cp(engine).checkpoint()
        keep = [8, 9] if below else [7, 8, 9]
        for seq in range(1, 41):
            resident = seq == 40 or seq >> 2 in keep  # 40: its chunk is not whole yet
            assert (t.enc(seq) is not EVICTED) == resident, seq
        stats = engine.payloads.stats()
        assert stats.bytes == sum(sizes[k] for k in keep) == resident_absorbed(engine)
        assert stats.bytes <= engine.payloads.bound
        assert stats.evicted_chunks == 10 - len(keep)


async def test_records_not_yet_absorbed_stay_pinned_whatever_the_bound():
    disk = FakeDisk()
    async with open_durable(disk, config(cache_bytes=0)) as engine:
        await fill(engine, "t", 10)
        t = engine.get("t")
        assert all(isinstance(t.enc(s), bytes) for s in range(1, 11))
        assert await cp(engine).checkpoint()
        assert [t.enc(s) is EVICTED for s in range(1, 11)] == [True] * 7 + [False] * 3
        assert engine.payloads.stats().bytes == 0 == resident_absorbed(engine)
        await fill(engine, "t", 5)
        assert all(isinstance(t.enc(s), bytes) for s in range(8, 16))
        # ephemeral topics are never absorbed: all their records stay
        await engine.put_topic("eph", TopicConfigIn(durability="ephemeral"))
        await fill(engine, "eph", 9)
        assert await cp(engine).checkpoint()
        eph = engine.get("eph")
        assert all(isinstance(eph.enc(s), bytes) for s in range(1, 10))


async def test_a_checkpoint_evicts_a_few_chunks_per_loop_turn(monkeypatch):
    # evicting is a list write and a free per record: a checkpoint that absorbed much
    # evicts `TRIM_CHUNKS` chunks a turn, yielding between, not all in one turn
    monkeypatch.setattr(checkpoint, "TRIM_CHUNKS", 3)
    turns: list[int] = []
    disk = FakeDisk()
    async with open_durable(disk, config(cache_bytes=0)) as engine:
        await fill(engine, "t", 80)
        await fill(engine, "u", 41)
        real_pause = Budget.pause

        async def pause(self: Budget) -> None:
            turns.append(engine.payloads.evicted_chunks)
            await real_pause(self)

        monkeypatch.setattr(Budget, "pause", pause)
        turns.append(engine.payloads.evicted_chunks)
        assert await cp(engine).checkpoint()
        turns.append(engine.payloads.evicted_chunks)
        # every whole chunk of both topics left (20 + 10), at most 3 between two yields
        assert engine.payloads.evicted_chunks == 30
        steps = [b - a for a, b in itertools.pairwise(turns)]
        assert max(steps) == 3
        assert sum(steps) == 30
        assert engine.payloads.stats().bytes == 0 == resident_absorbed(engine)
        t = engine.get("t")
        assert all(t.enc(seq) is EVICTED for seq in range(1, 80))


async def test_trim_stops_after_its_chunks_and_says_whether_more_remain():
    disk = FakeDisk()
    async with open_durable(disk, config()) as engine:
        await fill(engine, "t", 41)
        assert await cp(engine).checkpoint()  # 10 whole chunks released, all resident
        cache = engine.payloads
        assert cache.stats().chunks == 10 and cache.evicted_chunks == 0
        cache.bound = 0
        assert cache.trim(4) is True
        assert cache.evicted_chunks == 4
        assert cache.trim(4) is True
        assert cache.trim(4) is False  # the last two: the bound holds
        assert cache.evicted_chunks == 10 and cache.bytes == 0 == resident_absorbed(engine)
        assert cache.trim(4) is False  # nothing left to do
        with cache.hold() as hold:  # a held chunk over the bound: no endless "more"
            assert await cache.load(engine.get("t"), 1, 4, 1 << 20, hold) == 4
            assert cache.trim(4) is False
            assert cache.bytes > cache.bound


async def diffs(engine: Engine, name: str) -> list[object]:
    out: list[object] = []
    for opts in (
        {"include_tags": True},
        {"include_meta": False},
        {"include_meta": False, "include_tags": True},
        {"node": "n1"},
        {"limit": 3},
        {"max_batch_bytes": 40},
    ):
        cursor = 0
        pages = []
        while True:
            _, res = await engine.diff(name, DiffIn(from_seq=cursor, **opts))  # type: ignore[arg-type]
            pages.append((res.records, res.next_from_seq, res.tombstone))
            cursor = res.next_from_seq
            if res.caught_up:
                break
        out.append(pages)
    return out


async def test_every_diff_reads_the_same_bytes_after_eviction():
    disk = FakeDisk()
    async with open_durable(disk, config(cache_bytes=0)) as engine:
        await engine.put_topic("t", TopicConfigIn(dedupe_node=True))
        for i in range(30):
            rec = RecordIn(data=msgspec.Raw(b'{"i":%d}' % i), tag=f"g{i % 3}", node=f"n{i % 2}")
            if i % 4:
                rec.meta = msgspec.Raw(b'{"m":%d}' % i)
            await engine.append("t", WriteIn(records=[rec]))
        before = await diffs(engine, "t")
        assert await cp(engine).checkpoint()
        t = engine.get("t")
        assert sum(t.enc(s) is EVICTED for s in range(1, 31)) == 27  # chunks 0-6: seqs 1-27
        after = await diffs(engine, "t")
        assert after == before
        stats = engine.payloads.stats()
        assert stats.misses > 0 and stats.loaded_records >= 27
        assert stats.bytes == 0 == resident_absorbed(engine)  # loads leave with their hold
        # and after a restart (the bytes stay in the segments until a read needs them)
        expected = await state(engine)
    async with open_durable(disk, config(cache_bytes=0)) as engine:
        t = engine.get("t")
        assert t.enc(1) is EVICTED
        assert await state(engine) == expected
        assert await diffs(engine, "t") == before


async def test_a_long_poll_woken_by_a_write_reads_evicted_records_too(autojump_clock):
    disk = FakeDisk()
    async with open_durable(disk, config(cache_bytes=0)) as engine:
        await fill(engine, "t", 12)
        assert await cp(engine).checkpoint()
        _, res = await engine.diff("t", DiffIn(from_seq=0, limit=100))
        assert len(res.records) == 12
        got: list[bytes] = []

        async def poll() -> None:
            _, r = await engine.diff("t", DiffIn(from_seq=12, wait_ms=5000))
            got.extend(r.records)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            await fill(engine, "t", 1)
        assert len(got) == 1 and orjson.loads(got[0])["$seq"] == 13


async def test_an_sse_catch_up_from_zero_streams_evicted_records(nursery):
    disk = FakeDisk()
    async with open_durable_app(disk, config(cache_bytes=0)) as h:
        engine = h.engine
        await fill(engine, "t", 50, tag="x")
        _, expected = await engine.diff("t", DiffIn(from_seq=0, limit=1000, include_tags=True))
        assert await cp(engine).checkpoint()
        assert engine.get("t").enc(1) is EVICTED
        client = h.app.test_client()
        r = await client.post(
            "/v0/watch",
            json={"topics": {"t": {"from_seq": 0}}, "limit": 7, "include_tags": True},
        )
        wid = (await r.get_json())["wid"]
        stream = await open_stream(nursery, h.app.asgi_app, wid)
        frames = await stream.read_until(lambda f: f.event == "caught-up", timeout=10)
        records = [rec for f in frames if f.event == "record" for rec in f.data["records"]]
        assert records == [orjson.loads(e) for e in expected.records]
        assert engine.payloads.stats().misses >= 7  # 50 records, 7 per frame
        stream.disconnect()


async def test_a_websocket_catch_up_from_zero_streams_evicted_records(nursery):
    async with open_durable_app(FakeDisk(), config(cache_bytes=0)) as h:
        engine = h.engine
        await fill(engine, "t", 50, tag="x")
        _, expected = await engine.diff("t", DiffIn(from_seq=0, limit=1000, include_tags=True))
        assert await cp(engine).checkpoint()
        assert engine.get("t").enc(1) is EVICTED
        misses = engine.payloads.stats().misses
        ws = await open_ws_in_process(nursery, h.app)
        await ws.send(
            {"op": "subscribe", "topics": {"t": {"from_seq": 0}}, "limit": 7, "include_tags": True}
        )
        got = await ws.recv_until(lambda m: m["op"] == "caught_up")
        records = [rec for m in got if m["op"] == "record" for rec in m["records"]]
        assert records == [orjson.loads(e) for e in expected.records]
        assert engine.payloads.stats().misses - misses >= 7  # 50 records, 7 per message


async def evicted_queue(engine: Engine) -> list[bytes]:
    """Queue `q` of 20 jobs, checkpointed (with a 0-byte cache: all evicted); returns
    their stored records."""
    await engine.put_topic("q", TopicConfigIn(type="queue"))
    await fill(engine, "q", 20)
    _, res = await engine.diff("q", DiffIn(from_seq=0, limit=100))
    assert await cp(engine).checkpoint()
    assert engine.get("q").enc(1) is EVICTED
    return res.records


async def test_queue_claims_return_evicted_jobs_intact():
    disk = FakeDisk()
    async with open_durable(disk, config(cache_bytes=0)) as engine:
        want = [orjson.loads(e)["data"] for e in await evicted_queue(engine)]
        got = await engine.queues.claim("q", "w1", 20, None)
        assert [orjson.loads(item)["data"] for item in got.items] == want
        assert engine.payloads.stats().bytes == 0


async def test_a_claim_whose_load_evicts_a_resident_job_loads_it_again():
    # jobs 1-4 resident (the youngest chunk), 5-20 evicted: loading 5.. makes the cache
    # evict chunk 0, which is not held yet; the claim must load it back, not fail
    disk = FakeDisk()
    async with open_durable(disk, config(cache_bytes=0)) as engine:
        records = await evicted_queue(engine)
        want = [orjson.loads(e)["data"] for e in records]
        q = engine.get("q")
        engine.payloads.bound = sum(len(r) for r in records[:4]) + 8
        await engine.diff("q", DiffIn(from_seq=0, limit=4))
        assert isinstance(q.enc(1), bytes) and q.enc(5) is EVICTED
        got = await engine.queues.claim("q", "w1", 20, None)
        assert [orjson.loads(item)["data"] for item in got.items] == want


async def test_a_router_resumes_over_evicted_source_records(autojump_clock):
    disk = FakeDisk()
    async with open_durable(disk, config(cache_bytes=0)) as engine:
        await engine.put_topic("d", TopicConfigIn(cap_records=2, discard="reject"))
        await engine.routers.put("s->d", RouterIn(source="s", dest="d", create_dest=False))
        await fill(engine, "s", 30)
        assert engine.get("d").count == 2  # the rest waits: the destination is full
        assert await cp(engine).checkpoint()
        s = engine.get("s")
        assert s.enc(5) is EVICTED
        await engine.put_topic("d", TopicConfigIn(cap_records=0))
        for _ in range(20):  # the sweep loads the records the feed stopped at
            await trio.sleep(engine.cfg.routers.tick_ms / 1000)
            if engine.get("d").head_seq == 30:
                break
        _, src = await engine.diff("s", DiffIn(from_seq=0, limit=100))
        _, dst = await engine.diff("d", DiffIn(from_seq=0, limit=100))
        assert [orjson.loads(e)["data"] for e in dst.records] == [
            orjson.loads(e)["data"] for e in src.records
        ]


async def test_a_corrupt_segment_on_a_cache_miss_is_a_500_and_counted(caplog):
    disk = FakeDisk()
    async with open_durable_app(disk, config(cache_bytes=0, max_events=4)) as h:
        engine = h.engine
        await fill(engine, "t", 12)
        assert await cp(engine).checkpoint()
        t = engine.get("t")
        assert t.enc(2) is EVICTED
        seg = cp(engine).segments.topics[t.topic_id].find(2)
        assert seg is not None and seg.sealed
        path = segs.data_path("/data", t.topic_id, seg.first)
        at = seg.offsets[1] + 40
        _flip(disk, path, at)
        client = h.app.test_client()
        r = await client.post("/v0/topics/t/diff", json={"from_seq": 0})
        assert r.status_code == 500
        assert (await r.get_json())["error"]["code"] == "internal"
        assert t.enc(2) is EVICTED  # never served, never cached
        metrics = (await (await client.get("/v0/metrics")).get_data()).decode()
        assert "topicd_segment_corruption_total 1" in metrics
        assert "segment corruption" in caplog.text
        assert posixpath.basename(path) in caplog.text
        _flip(disk, path, at)  # repaired for the shutdown
