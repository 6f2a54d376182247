"""The drain's shared batches: one encoding per drain, one `send` per parked stream.

Method: an engine on `MockClock` whose streams have a scripted transport that behaves
like the direct socket path's (`DirectExchange`): the pump's writes and the drain's
`direct` writes are framed as HTTP/1.1 chunks, `raw_write` sends bytes as they are, and
`sock` is a fake non-blocking socket that can take only part of what it is given, take
nothing (`BlockingIOError`) or fail (`ConnectionResetError`). Every stream's bytes are
de-chunked and parsed back, so each test checks the wire a client would read: frames
whole and in order, contiguous ranges, and an `id:` on every event that is exactly the
cursor map after it.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio.testing

from tests.sched.helpers import write_req
from tests.watch.helpers import start_pumped
from topicd.engine.watch import COALESCE_BYTES, decode_composite_id
from topicd.testing.fake_clock import advance
from topicd.testing.harness import make_config, open_app
from topicd.testing.sse import SseParser
from topicd.wire import WatchIn, WatchTopicIn


class FakeSock:
    """The drain's side of a non-blocking socket."""

    def __init__(self, wire: ChunkedWire) -> None:
        self.wire = wire
        self.sent: list[bytes] = []  # every buffer handed to `send`
        self.accept: int | None = None  # bytes the next send takes (None: all)
        self.fail = False
        self.after_send: Callable[[], None] | None = None  # runs once, after the next send

    def send(self, data: bytes, /) -> int:
        self.sent.append(data)
        if self.fail:
            raise ConnectionResetError
        n = len(data) if self.accept is None else self.accept
        self.accept = None
        if n == 0:
            raise BlockingIOError
        self.wire.data += data[:n]
        hook, self.after_send = self.after_send, None
        if hook is not None:
            hook()
        return n


class ChunkedWire:
    """One stream's transport, framed as the direct path frames a chunked body."""

    def __init__(self) -> None:
        self.data = b""  # the body as sent: chunks
        self.sock = FakeSock(self)
        self.direct_calls = 0
        self.raw_writes = 0
        self.hold: trio.Event | None = None  # set: the pump's writes wait for it

    def direct(self, payload: bytes) -> bytes | None:
        self.direct_calls += 1
        self.data += b"%x\r\n" % len(payload) + payload + b"\r\n"
        return b""

    async def write(self, chunk: bytes) -> None:
        if self.hold is not None:
            await self.hold.wait()
        self.data += b"%x\r\n" % len(chunk) + chunk + b"\r\n"

    async def raw_write(self, data: bytes | memoryview) -> None:
        if self.hold is not None:
            await self.hold.wait()
        self.raw_writes += 1
        self.data += bytes(data)

    def body(self) -> bytes:
        """The de-chunked body (asserts the chunk framing is intact)."""
        out = b""
        rest = self.data
        while rest:
            size_line, sep, rest = rest.partition(b"\r\n")
            assert sep, self.data
            size = int(size_line, 16)
            assert rest[size : size + 2] == b"\r\n", self.data
            out += rest[:size]
            rest = rest[size + 2 :]
        return out

    def events(self) -> list[tuple[str | None, dict[str, int] | None, object]]:
        """(event, decoded `id:`, data) of every non-heartbeat frame."""
        frames = SseParser().feed(self.body())
        return [
            (f.event, decode_composite_id(f.id) if f.id else None, f.data)
            for f in frames
            if f.event is not None
        ]


def record_seqs(wire: ChunkedWire, topics: tuple[str, ...] = ("t",)) -> list[int]:
    """The records' seqs in stream order; checks contiguity and every `id:` line."""
    out: list[int] = []
    pos: dict[str, int] = {}
    for event, cursor, data in wire.events():
        if event not in ("record", "caught-up", "tombstone"):
            continue
        assert isinstance(data, dict)
        name = data["topic"]
        if event == "record":
            assert data["from_seq"] == pos.get(name, 0), (pos, data)
            out.extend(r["$seq"] for r in data["records"])
            pos[name] = data["to_seq"]
        expected = {t: pos.get(t, 0) for t in topics}
        assert cursor == expected, (cursor, expected)
    return out


async def start(engine, nursery, wire: ChunkedWire, *names: str, **opts: object):
    req = WatchIn(
        topics={n: WatchTopicIn(tail=True) for n in names or ("t",)},
        **opts,  # type: ignore[arg-type]
    )
    return await start_pumped(
        engine,
        nursery,
        req,
        wire.write,
        direct=wire.direct,
        raw_write=wire.raw_write,
        sock=wire.sock,
    )


async def test_parked_streams_get_each_drain_in_one_send_of_one_shared_buffer(autojump_clock):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wires = [ChunkedWire() for _ in range(5)]
        streams = [await start(engine, nursery, w) for w in wires]
        for i in range(3):
            await engine.append("t", write_req(i))
            await trio.testing.wait_all_tasks_blocked()
        for wire in wires:
            assert len(wire.sock.sent) == 3  # one send per drain
            assert wire.direct_calls == 0  # nothing framed per connection
            assert record_seqs(wire) == [1, 2, 3]
        for k in range(3):  # the very same bytes object went to every socket
            assert len({id(w.sock.sent[k]) for w in wires}) == 1
        for session, conn in streams:
            assert session.cursors["t"] == 3
            assert conn.pos == {"t": 3}
            assert conn.ready_at == 3  # parked at the head again
        nursery.cancel_scope.cancel()


async def test_a_drain_of_several_frames_is_one_send_with_an_exact_id_on_each_event(
    autojump_clock,
):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wire = ChunkedWire()
        session, _conn = await start(engine, nursery, wire, limit=1)
        await engine.append("t", write_req("a", "b", "c"))  # three frames of one record
        await trio.testing.wait_all_tasks_blocked()
        assert len(wire.sock.sent) == 1
        assert [e for e, _, _ in wire.events()] == ["caught-up", "record", "record", "record"]
        assert record_seqs(wire) == [1, 2, 3]  # ids {"t":1}, {"t":2}, {"t":3}
        assert session.cursors["t"] == 3
        nursery.cancel_scope.cancel()


async def test_a_partial_send_is_finished_by_the_pump_before_anything_else(autojump_clock):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wire = ChunkedWire()
        session, conn = await start(engine, nursery, wire)
        await engine.append("t", write_req("a"))
        await trio.testing.wait_all_tasks_blocked()
        wire.sock.accept = 7  # the socket takes 7 bytes of the next batch
        wire.hold = trio.Event()  # and the pump's write of the rest is slow
        await engine.append("t", write_req("b"))
        await trio.testing.wait_all_tasks_blocked()
        assert conn.ready_at == -1
        assert session.cursors["t"] == 1  # not written yet: a reconnect resumes after 1
        assert conn.pos["t"] == 2
        await engine.append("t", write_req("c"))  # queued behind the rest: the pump's
        await trio.testing.wait_all_tasks_blocked()
        assert len(wire.sock.sent) == 2
        wire.hold.set()
        await trio.testing.wait_all_tasks_blocked()
        assert wire.raw_writes == 1
        assert not conn.remainder
        assert record_seqs(wire) == [1, 2, 3]
        assert session.cursors["t"] == 3
        assert conn.ready_at == 3  # parked again: the next batch is one send
        await engine.append("t", write_req("d"))
        await trio.testing.wait_all_tasks_blocked()
        assert len(wire.sock.sent) == 3
        assert record_seqs(wire) == [1, 2, 3, 4]
        nursery.cancel_scope.cancel()


async def test_a_full_socket_hands_the_whole_batch_to_the_pump(autojump_clock):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wire = ChunkedWire()
        session, conn = await start(engine, nursery, wire)
        writes = conn.frames_written
        wire.sock.accept = 0  # EAGAIN
        await engine.append("t", write_req("a", "b"))
        await trio.testing.wait_all_tasks_blocked()
        assert wire.raw_writes == 1
        assert record_seqs(wire) == [1, 2]
        assert session.cursors["t"] == 2
        assert conn.frames_written == writes + 1  # the batch, counted once
        nursery.cancel_scope.cancel()


async def test_a_broken_socket_ends_the_stream_and_keeps_the_cursor(autojump_clock):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wire = ChunkedWire()
        session, conn = await start(engine, nursery, wire)
        await engine.append("t", write_req("a"))
        await trio.testing.wait_all_tasks_blocked()
        wire.sock.fail = True
        await engine.append("t", write_req("b"))
        await trio.testing.wait_all_tasks_blocked()
        assert conn not in engine.watch.conns  # closed; the pump has ended
        assert session.conn is None
        assert session.cursors["t"] == 1  # a reconnect resumes after what was written
        assert record_seqs(wire) == [1]
        nursery.cancel_scope.cancel()


async def test_a_multi_topic_stream_gets_its_own_ids_frame_by_frame(autojump_clock):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        await engine.put_topic("u", None)
        single, multi = ChunkedWire(), ChunkedWire()
        await start(engine, nursery, single)
        session, conn = await start(engine, nursery, multi, "t", "u")
        assert conn.only is None
        await engine.append("u", write_req("x"))
        await trio.testing.wait_all_tasks_blocked()
        await engine.append("t", write_req("y"))
        await trio.testing.wait_all_tasks_blocked()
        assert multi.sock.sent == []  # never the single-topic bytes
        assert multi.direct_calls == 2
        assert record_seqs(multi, ("t", "u")) == [1, 1]  # ids carry both cursors
        assert session.cursors == {"t": 1, "u": 1}
        assert len(single.sock.sent) == 1
        assert record_seqs(single) == [1]
        nursery.cancel_scope.cancel()


async def test_a_superseded_stream_gets_nothing_from_a_drain_that_holds_its_group(
    autojump_clock,
):
    """With one connection per quantum, the drain yields between streams; a stream whose
    session is reopened meanwhile must not be written to by the rest of that drain. (The
    reopen runs right after the drain's send to the first stream, before the drain goes
    on: a task polling for that send would race the drain's own turn after its yield.)"""
    async with (
        open_app(make_config(classes={"quantum_items": 1})) as h,
        trio.open_nursery() as nursery,
    ):
        engine = h.engine
        await engine.put_topic("t", None)
        first, doomed = ChunkedWire(), ChunkedWire()
        await start(engine, nursery, first)
        session, old = await start(engine, nursery, doomed)
        sent_before = len(doomed.sock.sent)
        reopened: list[object] = []

        def reopen() -> None:  # supersedes `old` while the drain holds its group
            reopened.append(engine.watch.open_stream(session, None))

        first.sock.after_send = reopen
        await engine.append("t", write_req("a"))
        await trio.testing.wait_all_tasks_blocked()
        assert reopened  # the drain did serve the first stream first
        assert len(doomed.sock.sent) == sent_before  # nothing after it was superseded
        assert old.ready_at == -1
        assert [e for e, _, _ in doomed.events()][-1] == "error"  # its terminal 409
        assert record_seqs(first) == [1]
        nursery.cancel_scope.cancel()


async def test_the_heartbeat_counts_from_a_shared_send(autojump_clock):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wire = ChunkedWire()
        session, _conn = await start(engine, nursery, wire)
        period = session.heartbeat_ms / 1000
        await advance(autojump_clock, period * 0.6)
        await engine.append("t", write_req(1))
        await trio.testing.wait_all_tasks_blocked()
        assert len(wire.sock.sent) == 1
        hb_before = wire.body().count(b": hb\n\n")
        await advance(autojump_clock, period * 0.6)  # 0.6 periods after the send
        assert wire.body().count(b": hb\n\n") == hb_before
        await advance(autojump_clock, period * 0.5)
        assert wire.body().count(b": hb\n\n") == hb_before + 1
        nursery.cancel_scope.cancel()


async def test_a_large_drain_goes_out_in_bounded_batches(autojump_clock):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wire = ChunkedWire()
        session, _conn = await start(engine, nursery, wire, limit=1)
        big = "x" * 8192
        await engine.append("t", write_req(*[big] * 40))  # 40 frames, ≈ 330 KiB
        await trio.testing.wait_all_tasks_blocked()
        sizes = [len(b) for b in wire.sock.sent]
        assert len(sizes) == 2  # COALESCE_BYTES (256 KiB) per send at most
        assert max(sizes) <= COALESCE_BYTES + 4096  # + one frame's `id:` line and framing
        assert record_seqs(wire) == list(range(1, 41))
        assert session.cursors["t"] == 40
        nursery.cancel_scope.cancel()
