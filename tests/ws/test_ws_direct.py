"""The drain writing WebSocket frames to an idle connection's socket itself.

Method: an engine on `MockClock` with one WebSocket connection whose transport is
scripted, as tests/watch/test_direct_drain.py does for SSE: `direct` records what the
drain hands it and can refuse part of it (a full socket buffer); the writer's own writes
go to the same byte list. The bytes are then parsed back by a wsproto client: whatever
took which path, the frames must be complete and in order — in particular when a reply
was handed to the parked writer just before the drain's direct write stopped mid-frame.
"""

from __future__ import annotations

import orjson
import trio
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from topicd.engine.watch import FrameRef, WatchOptions, ws_frame, ws_message
from topicd.engine.ws import open_ws, ws_pump
from topicd.testing.harness import open_app


class Wire:
    def __init__(self) -> None:
        self.data = b""
        self.accept: int | None = None  # bytes the next direct write takes (None: all)
        self.direct_calls = 0

    def direct(self, frame: bytes) -> bytes | None:
        self.direct_calls += 1
        if self.accept is None:
            self.data += frame
            return b""
        n, self.accept = self.accept, None
        self.data += frame[:n]
        return frame[n:]

    async def write(self, frames: list[bytes]) -> None:
        await trio.lowlevel.checkpoint()
        self.data += b"".join(frames)


def parse(data: bytes) -> list[dict]:
    """The messages of a server byte stream, decoded by a wsproto client."""
    server = WSConnection(ConnectionType.SERVER)
    client = WSConnection(ConnectionType.CLIENT)
    server.receive_data(client.send(Request(host="x", target="/v0/ws")))
    list(server.events())
    client.receive_data(server.send(AcceptConnection()))
    list(client.events())
    client.receive_data(data)
    out: list[dict] = []
    text = ""
    for event in client.events():
        assert isinstance(event, TextMessage), event
        text += event.data
        if event.message_finished:
            out.append(orjson.loads(text))
            text = ""
    return out


OPTS = WatchOptions(None, 1000, 1 << 20, True, False, True, False, ws=True)


async def test_a_reply_handed_over_before_a_partial_direct_write_follows_it(
    autojump_clock, nursery
):
    async with open_app() as h:
        engine = h.engine
        await h.app.test_client().put("/v0/topics/t", json={})
        topic = engine.topics["t"]
        conn = open_ws(engine.watch, None, 4, 1 << 20)
        wire = Wire()
        conn.direct = wire.direct
        nursery.start_soon(
            lambda: ws_pump(
                conn,
                wire.write,
                catchup=engine.watch.catchup,
                max_scan=1000,
                now_ms=engine.clock.now_ms,
                enforce=engine.enforce,
            )
        )
        conn.subscribe(topic, OPTS, 0)
        await trio.testing.wait_all_tasks_blocked()
        assert parse(wire.data) == [{"op": "caught_up", "topic": "t", "head_seq": 0}]
        assert conn.idle
        # a reply reaches the parked writer (not yet run), then the drain writes a live
        # frame directly and the socket takes only 3 bytes of it
        reply = ws_message("pong", {"request_id": 1})
        conn.send_ch.send_nowait((None, FrameRef("", 0, 0, reply, len(reply))))
        body = b'{"op":"record","topic":"t","records":[],"from_seq":0,"to_seq":1,"head_seq":1}'
        frame = ws_frame(body)
        wire.accept = 3
        assert conn.offer(FrameRef("t", 0, 1, frame, len(frame)))
        assert wire.direct_calls == 1
        assert conn.remainder
        await trio.testing.wait_all_tasks_blocked()
        msgs = parse(wire.data)
        assert [m["op"] for m in msgs] == ["caught_up", "record", "pong"]
        assert conn.subs["t"].pos == 1
        assert not conn.remainder
        # with the writer parked again, a whole direct write needs no task switch
        await trio.testing.wait_all_tasks_blocked()
        assert conn.idle
        frame2 = ws_frame(body.replace(b'"from_seq":0,"to_seq":1', b'"from_seq":1,"to_seq":2'))
        assert conn.offer(FrameRef("t", 1, 2, frame2, len(frame2)))
        assert wire.direct_calls == 2
        assert [m["op"] for m in parse(wire.data)][-1] == "record"
        conn.detach()


def test_ws_payload_inverts_ws_frame_for_every_length_field():
    from topicd.engine.watch import ws_payload

    for n in (0, 1, 125, 126, 127, 65535, 65536, 70000):
        payload = b"x" * n
        frame = ws_frame(payload)
        assert frame[0] == 0x81  # FIN, text
        assert ws_payload(frame) == payload
        assert len(frame) - n == (2 if n < 126 else 4 if n < 65536 else 10)
