"""Slow consumers (api-routers-watch §2.7; architecture §7.3-§7.5; scheduler spec A.8).

Method: in-process app on `MockClock` (autojump). A stalled client is an `AsgiStream`
whose test stops reading: its body channel has capacity 0, so the server's `send` blocks
exactly as on a full socket. The tests check that the drain never waits for it (a healthy
watcher gets every record at the virtual instant it was written), that its server-side
queue never exceeds the channel bounds, and that once it reads again it receives every
retained record in order, exactly once, plus exact tombstones for what cap eviction
removed meanwhile — never a silent gap.
"""

from __future__ import annotations

import trio
import trio.testing

from topicd.testing.harness import make_config, open_app
from topicd.testing.sse import AsgiStream, Frame, open_stream


async def watch(h, topics: dict, **body: object) -> str:
    r = await h.app.test_client().post("/v0/watch", json={"topics": topics, **body})
    assert r.status_code == 200, await r.get_data()
    return (await r.get_json())["wid"]


def delivered(frames: list[Frame], topic: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(record seqs in order, tombstone ranges) for one topic; checks the cursor chain."""
    seqs: list[int] = []
    gaps: list[tuple[int, int]] = []
    pos = None
    for f in frames:
        if f.event == "record" and f.data["topic"] == topic:
            if pos is not None:
                assert f.data["from_seq"] == pos, (f.data, pos)
            pos = f.data["to_seq"]
            seqs.extend(r["$seq"] for r in f.data["records"])
        elif f.event == "tombstone" and f.data["topic"] == topic:
            gaps.append((f.data["gap_from"], f.data["gap_to"]))
            pos = f.data["gap_to"]
    return seqs, gaps


async def reader(stream: AsgiStream, times: dict[int, float]) -> None:
    while not stream.ended:
        for f in await stream.read_frames(1):
            if f.event == "record":
                for r in f.data["records"]:
                    times[r["$seq"]] = trio.current_time()


async def test_stalled_watcher_never_delays_others_and_loses_nothing(autojump_clock, nursery):
    cfg = make_config(sse={"channel_frames": 8})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/t", json={})
        healthy = await open_stream(nursery, h.app.asgi_app, await watch(h, {"t": {}}))
        stalled_wid = await watch(h, {"t": {}})
        stalled = await open_stream(nursery, h.app.asgi_app, stalled_wid)
        await stalled.read_frames(3)  # retry, heartbeat, caught-up; then it stops reading
        times: dict[int, float] = {}
        nursery.start_soon(reader, healthy, times)
        conn = h.engine.watch.sessions[stalled_wid].conn
        assert conn is not None
        written: dict[int, float] = {}
        max_queued = 0
        for i in range(1, 201):
            r = await client.post("/v0/topics/t", json={"records": [{"data": {"i": i}}]})
            assert r.status_code in (200, 201)
            written[i] = trio.current_time()
            await trio.testing.wait_all_tasks_blocked()  # the drain and pumps ran
            max_queued = max(max_queued, conn.recv_ch.statistics().current_buffer_used)
            assert conn.buffered_bytes <= cfg.sse.channel_bytes
        assert max_queued <= 8
        assert conn.lagged
        assert h.engine.watch.stats.lagged == 1
        # the healthy watcher got every record at the instant it was written
        assert times == written
        # the stalled one now reads: everything, in order, once, then caught-up
        got = await stalled.read_until(lambda f: f.event == "caught-up", timeout=5)
        seqs, gaps = delivered(got, "t")
        assert seqs == list(range(1, 201))
        assert gaps == []
        assert got[-1].data == {"topic": "t", "head_seq": 200}
        assert not conn.lagged
        # back to live push
        await client.post("/v0/topics/t", json={"records": [{"data": "live"}]})
        (f,) = await stalled.read_frames(1, timeout=1)
        assert f.event == "record" and f.data["from_seq"] == 200 and f.data["to_seq"] == 201


async def test_eviction_while_lagged_arrives_as_an_exact_tombstone(autojump_clock, nursery):
    cfg = make_config(sse={"channel_frames": 4})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/t", json={"cap_records": 20})
        wid = await watch(h, {"t": {}})
        stalled = await open_stream(nursery, h.app.asgi_app, wid)
        await stalled.read_frames(3)
        for i in range(1, 101):
            await client.post("/v0/topics/t", json={"records": [{"data": i}]})
            await trio.testing.wait_all_tasks_blocked()  # the drain and pumps ran
        got = await stalled.read_until(lambda f: f.event == "caught-up", timeout=5)
        seqs, gaps = delivered(got, "t")
        # what was queued before the lag is delivered, the evicted rest is one tombstone,
        # then the retained tail; together they cover 1..100 exactly once, in order
        assert len(gaps) == 1
        (gap_from, gap_to) = gaps[0]
        assert seqs == list(range(1, gap_from)) + list(range(81, 101))
        assert gap_to == 80
        tomb = next(f for f in got if f.event == "tombstone")
        assert tomb.data == {
            "topic": "t",
            "reason": "cap",
            "gap_from": gap_from,
            "gap_to": 80,
            "earliest_seq": 81,
            "head_seq": 100,
        }


async def test_byte_bound_marks_lagged(autojump_clock, nursery):
    cfg = make_config(sse={"channel_frames": 1000, "channel_bytes": 8192})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/t", json={})
        wid = await watch(h, {"t": {}})
        stalled = await open_stream(nursery, h.app.asgi_app, wid)
        await stalled.read_frames(3)
        conn = h.engine.watch.sessions[wid].conn
        assert conn is not None
        blob = "x" * 1000
        for i in range(1, 41):
            await client.post("/v0/topics/t", json={"records": [{"data": [i, blob]}]})
            await trio.testing.wait_all_tasks_blocked()  # the drain and pumps ran
            assert conn.buffered_bytes <= 8192
        assert conn.lagged
        assert conn.recv_ch.statistics().current_buffer_used < 10
        got = await stalled.read_until(lambda f: f.event == "caught-up", timeout=5)
        assert delivered(got, "t") == (list(range(1, 41)), [])


async def test_slow_consumer_timeout_closes_the_stream_and_the_session_resumes(
    autojump_clock, nursery
):
    cfg = make_config(watch={"slow_consumer_timeout_ms": 2000}, sse={"channel_frames": 2})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/t", json={})
        wid = await watch(h, {"t": {}})
        stalled = await open_stream(nursery, h.app.asgi_app, wid)
        await stalled.read_frames(3)
        for i in range(1, 11):
            await client.post("/v0/topics/t", json={"records": [{"data": i}]})
        t0 = trio.current_time()
        await stalled.wait_done()
        assert 2.0 <= trio.current_time() - t0 <= 3.0
        assert h.engine.watch.stats.slow_closed == 1
        session = h.engine.watch.sessions[wid]
        assert session.conn is None
        # nothing was written, so the session resumes from the start
        again = await open_stream(nursery, h.app.asgi_app, wid)
        got = await again.read_until(lambda f: f.event == "caught-up", timeout=5)
        assert delivered(got, "t") == (list(range(1, 11)), [])


async def test_memory_per_connection_is_bounded_with_many_stalled(autojump_clock, nursery):
    cfg = make_config(sse={"channel_frames": 16, "channel_bytes": 65536})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/t", json={})
        conns = []
        for _ in range(20):
            wid = await watch(h, {"t": {}})
            s = await open_stream(nursery, h.app.asgi_app, wid)
            await s.read_frames(3)
            conns.append(h.engine.watch.sessions[wid].conn)
        for i in range(300):
            await client.post("/v0/topics/t", json={"records": [{"data": i}] * 10})
            await trio.testing.wait_all_tasks_blocked()  # the drain and pumps ran
        for conn in conns:
            assert conn.lagged
            assert conn.recv_ch.statistics().current_buffer_used <= 16
            assert conn.buffered_bytes <= 65536
