"""Slow WebSocket clients (api-routers-watch §3.2 with the watch's live path, §2.7).

Method: in-process on `MockClock` (autojump), as test_watch's lag tests. A stalled client
is a `/v0/ws` connection over a lockstep stream pair whose test stops reading: each
server write blocks until the client reads it, exactly as on a full socket. The outbound
queue (`watch.ws_outbound_queue`) is tiny, so the flood fills it at once. The tests
check that the drain never waits for the stalled client (a healthy subscriber gets every
record at the instant it was written), that the queue never holds more than its bound,
and that once the client reads again it receives every retained record in order, once,
plus an exact tombstone for what cap eviction removed meanwhile: never a silent gap.
"""

from __future__ import annotations

import trio
import trio.testing

from topicd.testing.fake_clock import advance
from topicd.testing.harness import make_config, open_app
from topicd.testing.ws import WsClient, open_ws_in_process


def delivered(msgs: list[dict], topic: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(record seqs in order, tombstone ranges) for one topic; checks the cursor chain."""
    seqs: list[int] = []
    gaps: list[tuple[int, int]] = []
    pos = None
    for m in msgs:
        if m.get("topic") != topic:
            continue
        if m["op"] == "record":
            if pos is not None:
                assert m["from_seq"] == pos, (m, pos)
            pos = m["to_seq"]
            seqs.extend(r["$seq"] for r in m["records"])
        elif m["op"] == "tombstone":
            if pos is not None:
                assert m["gap_from"] == pos + 1, (m, pos)
            gaps.append((m["gap_from"], m["gap_to"]))
            pos = m["gap_to"]
    return seqs, gaps


async def read_records(client: WsClient, times: dict[int, float]) -> None:
    while True:
        msg = await client.recv()
        if msg["op"] == "record":
            for r in msg["records"]:
                times[r["$seq"]] = trio.current_time()


async def subscribe(client: WsClient, topic: str) -> None:
    await client.send({"op": "subscribe", "topic": topic})
    await client.recv_until(lambda m: m["op"] == "caught_up")


async def test_a_stalled_client_lags_and_catches_up_with_an_exact_tombstone(
    autojump_clock, nursery
):
    queue = 2
    cfg = make_config(watch={"ws_outbound_queue": queue})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/t", json={"cap_records": 20})
        healthy = await open_ws_in_process(nursery, h.app)
        stalled = await open_ws_in_process(nursery, h.app, lockstep=True)
        await subscribe(healthy, "t")
        await subscribe(stalled, "t")  # ... then it stops reading
        conn = list(h.engine.watch.ws_conns)[1]  # (in opening order)
        times: dict[int, float] = {}
        nursery.start_soon(read_records, healthy, times)
        written: dict[int, float] = {}
        for i in range(1, 101):
            r = await client.post("/v0/topics/t", json={"records": [{"data": i}]})
            assert r.status_code == 200
            written[i] = trio.current_time()
            await trio.testing.wait_all_tasks_blocked()  # the drain and writers ran
            assert conn.recv_ch.statistics().current_buffer_used <= queue
            assert conn.buffered_bytes <= cfg.sse.channel_bytes
        assert conn.lagged
        assert h.engine.watch.stats.lagged == 1
        assert times == written  # the healthy one was never held up
        # the stalled client reads again: what was queued, one tombstone for what the cap
        # evicted while it lagged, the retained tail, caught_up; 1..100 exactly once
        got = await stalled.recv_until(lambda m: m["op"] == "caught_up")
        seqs, gaps = delivered(got, "t")
        assert len(gaps) == 1
        gap_from, gap_to = gaps[0]
        assert gap_to == 80
        assert seqs == list(range(1, gap_from)) + list(range(81, 101))
        tomb = next(m for m in got if m["op"] == "tombstone")
        assert tomb == {
            "op": "tombstone",
            "topic": "t",
            "reason": "cap",
            "gap_from": gap_from,
            "gap_to": 80,
            "earliest_seq": 81,
            "head_seq": 100,
        }
        assert got[-1] == {"op": "caught_up", "topic": "t", "head_seq": 100}
        assert not conn.lagged
        # back to live push
        await client.post("/v0/topics/t", json={"records": [{"data": "live"}]})
        msg = await stalled.recv()
        assert (msg["op"], msg["from_seq"], msg["to_seq"]) == ("record", 100, 101)


async def test_without_eviction_a_lagged_client_loses_nothing(autojump_clock, nursery):
    cfg = make_config(watch={"ws_outbound_queue": 1})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/t", json={})
        stalled = await open_ws_in_process(nursery, h.app, lockstep=True)
        await subscribe(stalled, "t")
        (conn,) = h.engine.watch.ws_conns
        for i in range(1, 61):
            await client.post("/v0/topics/t", json={"records": [{"data": i}]})
            await trio.testing.wait_all_tasks_blocked()
            assert conn.recv_ch.statistics().current_buffer_used <= 1
        assert conn.lagged
        # replies wait behind the stall too: the queue stays bounded, nothing is dropped
        await stalled.send({"op": "ping", "request_id": "p"})
        got = await stalled.recv_until(lambda m: m["op"] == "pong")
        got += await stalled.recv_until(lambda m: m["op"] == "caught_up")
        assert delivered(got, "t") == (list(range(1, 61)), [])


async def test_replies_to_a_client_that_does_not_read_wait_for_room(autojump_clock, nursery):
    cfg = make_config(watch={"ws_outbound_queue": 1})
    async with open_app(cfg) as h:
        stalled = await open_ws_in_process(nursery, h.app, lockstep=True)
        (conn,) = h.engine.watch.ws_conns
        # one pong is being written (blocked), one is queued, the third waits for room
        for i in range(3):
            await stalled.send({"op": "ping", "request_id": i})
        await trio.testing.wait_all_tasks_blocked()
        assert conn.recv_ch.statistics().current_buffer_used == 1
        assert conn.recv_ch.statistics().tasks_waiting_send == 1
        got = [await stalled.recv() for _ in range(3)]
        assert [m["request_id"] for m in got] == [0, 1, 2]


async def test_a_write_blocked_past_the_slow_consumer_timeout_closes_it(autojump_clock, nursery):
    cfg = make_config(watch={"slow_consumer_timeout_ms": 1000})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/t", json={})
        stalled = await open_ws_in_process(nursery, h.app, lockstep=True)
        await subscribe(stalled, "t")
        await client.post("/v0/topics/t", json={"records": [{"data": 1}]})
        await trio.testing.wait_all_tasks_blocked()
        (conn,) = h.engine.watch.ws_conns
        assert conn.write_started is not None  # blocked: the client does not read
        await advance(autojump_clock, 0.9)
        assert h.engine.watch.ws_conns  # not yet
        await advance(autojump_clock, 1.2)  # past the timeout plus the watchdog's period
        assert h.engine.watch.ws_conns == {}
        assert h.engine.watch.sse_connections() == 0
        assert h.engine.watch.stats.slow_closed == 1
        assert h.lifecycle.inflight == 0


async def test_catch_up_passes_are_byte_bounded_and_take_turns(
    autojump_clock, nursery, monkeypatch
):
    """Three subscriptions with 1 MiB of backlog each: no catch-up pass is much larger
    than its bound, and the subscriptions progress in turns (the last one's first record
    arrives long before the first one is done)."""
    import topicd.engine.ws as engine_ws

    async with open_app() as h:
        c = h.app.test_client()
        blob = "x" * 8192
        for name in ("a", "b", "z"):
            await c.put(f"/v0/topics/{name}", json={})
            for _ in range(4):
                await c.post(
                    f"/v0/topics/{name}", json={"records": [{"data": blob} for _ in range(32)]}
                )
        ws = await open_ws_in_process(nursery, h.app)
        sizes: list[int] = []
        real = engine_ws.catch_up

        def spy(*args, **kwargs):
            out, moved = real(*args, **kwargs)
            sizes.append(sum(len(b) for b in out))
            return out, moved

        monkeypatch.setattr(engine_ws, "catch_up", spy)
        await ws.send(
            {"op": "subscribe", "topics": {"a": {}, "b": {}, "z": {}}, "max_batch_bytes": 65536}
        )
        got = await ws.recv_until(lambda m: m["op"] == "caught_up" and m["topic"] == "a")
        assert max(sizes) <= engine_ws.CATCHUP_BYTES + 4 * (65536 + 8300)
        order = [m["topic"] for m in got if m["op"] == "record"]
        assert order.index("z") < len(order) - 1 - order[::-1].index("a")
