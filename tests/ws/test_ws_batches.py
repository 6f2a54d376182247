"""WebSocket connections on the drain's shared batches (one `send` per parked connection).

Method: an engine on `MockClock`; each WebSocket connection has a scripted transport as
in tests/ws/test_ws_direct.py, plus `sock`, a fake non-blocking socket that records the
buffers it is handed and can take only part of one. Records are written through the
engine, so real drains build the batches. The bytes are parsed back by a wsproto client:
frames whole, in order, contiguous.
"""

from __future__ import annotations

import trio
import trio.testing

from tests.sched.helpers import write_req
from tests.ws.test_ws_direct import parse
from topicd.engine.watch import FrameRef, WatchOptions, ws_message
from topicd.engine.ws import open_ws, ws_pump
from topicd.testing.harness import open_app

OPTS = WatchOptions(None, 1000, 1 << 20, True, False, True, False, ws=True)


class Wire:
    def __init__(self) -> None:
        self.data = b""
        self.direct_calls = 0
        self.sent: list[bytes] = []
        self.accept: int | None = None  # bytes the next `send` takes (None: all)

    def direct(self, frame: bytes) -> bytes | None:
        self.direct_calls += 1
        self.data += frame
        return b""

    def send(self, data: bytes, /) -> int:
        self.sent.append(data)
        n = len(data) if self.accept is None else self.accept
        self.accept = None
        if n == 0:
            raise BlockingIOError
        self.data += data[:n]
        return n

    async def write(self, frames) -> None:
        await trio.lowlevel.checkpoint()
        self.data += b"".join(frames)


async def connect(engine, nursery, *names: str):
    conn = open_ws(engine.watch, None, 16, 1 << 20)
    wire = Wire()
    conn.direct, conn.sock = wire.direct, wire
    nursery.start_soon(
        lambda: ws_pump(
            conn,
            wire.write,
            catchup=engine.watch.catchup,
            max_scan=1000,
            now_ms=engine.clock.now_ms,
            enforce=engine.enforce,
            payloads=engine.payloads,
        )
    )
    for name in names:
        conn.subscribe(engine.topics[name], OPTS, engine.topics[name].head_seq)
    await trio.testing.wait_all_tasks_blocked()
    return conn, wire


def records(wire: Wire, topic: str = "t") -> list[int]:
    out: list[int] = []
    pos = None
    for m in parse(wire.data):
        if m["op"] == "record" and m["topic"] == topic:
            if pos is not None:
                assert m["from_seq"] == pos
            pos = m["to_seq"]
            out.extend(r["$seq"] for r in m["records"])
    return out


async def test_parked_connections_get_each_drain_in_one_send_of_one_buffer(autojump_clock, nursery):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        pairs = [await connect(engine, nursery, "t") for _ in range(4)]
        for i in range(3):
            await engine.append("t", write_req(i))
            await trio.testing.wait_all_tasks_blocked()
        for conn, wire in pairs:
            assert len(wire.sent) == 3
            assert wire.direct_calls == 0
            assert records(wire) == [1, 2, 3]
            assert conn.subs["t"].pos == 3
            assert conn.ready_at == 3
        for k in range(3):
            assert len({id(w.sent[k]) for _, w in pairs}) == 1
        for conn, _ in pairs:
            conn.detach()


async def test_a_reply_handed_over_before_a_partial_send_follows_the_batch(autojump_clock, nursery):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        conn, wire = await connect(engine, nursery, "t")
        reply = ws_message("pong", {"request_id": 1})
        conn.send_ch.send_nowait((None, FrameRef("", 0, 0, reply, len(reply))))
        wire.accept = 3  # the socket takes 3 bytes of the batch
        await engine.append("t", write_req("a", "b"))
        await trio.testing.wait_all_tasks_blocked()
        ops = [m["op"] for m in parse(wire.data)]
        # the drain may run before or after the writer picks up the reply; either way
        # every frame is whole, and a batch cut short is finished before the reply
        assert sorted(ops) == ["caught_up", "pong", "record"], ops
        assert records(wire) == [1, 2]
        assert not conn.remainder
        assert conn.subs["t"].pos == 2
        conn.detach()


async def test_an_unsubscribed_topic_gets_nothing_more(autojump_clock, nursery):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        conn, wire = await connect(engine, nursery, "t")
        assert conn.ready_at == 0
        assert conn.unsubscribe("t")
        assert conn.ready_at == -1
        await engine.append("t", write_req("a"))
        await trio.testing.wait_all_tasks_blocked()
        assert wire.sent == []
        assert records(wire) == []
        conn.detach()


async def test_two_subscriptions_go_frame_by_frame(autojump_clock, nursery):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        await engine.put_topic("u", None)
        conn, wire = await connect(engine, nursery, "t", "u")
        assert conn.ready_at == -1
        await engine.append("t", write_req("a"))
        await trio.testing.wait_all_tasks_blocked()
        await engine.append("u", write_req("b"))
        await trio.testing.wait_all_tasks_blocked()
        assert wire.sent == []
        assert wire.direct_calls == 2
        assert records(wire, "t") == [1]
        assert records(wire, "u") == [1]
        conn.detach()
