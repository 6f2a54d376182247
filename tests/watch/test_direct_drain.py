"""The drain writing to an idle stream's socket itself (architecture: the write path).

Method: an engine on `MockClock` with one stream whose transport is scripted: `direct`
records what the drain hands it and can refuse part of it (a full socket buffer); the
pump's own writes go to the same byte list, and can be held (a slow socket) until the
test lets them through. The stream's bytes are then parsed back: whatever took which
path, the frames are complete, in order, and contiguous. Time moves only where the test
moves it (`advance`), so the heartbeat is checked at exact virtual instants.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio.testing

from tests.sched.helpers import write_req
from tests.watch.helpers import start_pumped
from topicd.testing.fake_clock import advance
from topicd.testing.harness import open_app
from topicd.testing.sse import SseParser
from topicd.wire import WatchIn, WatchTopicIn


class Wire:
    def __init__(self) -> None:
        self.data = b""
        self.direct_calls = 0
        self.accept: int | None = None  # bytes the next direct write takes (None: all)
        self.partials = 0
        self.hold: trio.Event | None = None  # set: the pump's writes wait for it
        self._changed = trio.Event()

    def direct(self, payload: bytes) -> bytes | None:
        self.direct_calls += 1
        if self.accept is None:
            self.data += payload
            return b""
        n, self.accept = self.accept, None
        self.partials += 1
        self.data += payload[:n]
        return payload[n:]

    async def write(self, chunk: bytes) -> None:
        if self.hold is not None:
            await self.hold.wait()
        self.data += chunk
        self._changed.set()

    async def wait_for(self, cond: Callable[[], bool]) -> None:
        """Wait until `cond()` holds after one of the pump's writes."""
        with trio.fail_after(10):
            while not cond():
                self._changed = trio.Event()
                await self._changed.wait()


async def start(engine, nursery, wire: Wire):
    req = WatchIn(topics={"t": WatchTopicIn(tail=True)})
    return await start_pumped(
        engine, nursery, req, wire.write, direct=wire.direct, raw_write=wire.write
    )


def record_seqs(data: bytes) -> list[int]:
    out: list[int] = []
    pos = 0
    for f in SseParser().feed(data):
        if f.event == "record":
            assert f.data["from_seq"] == pos
            out.extend(r["$seq"] for r in f.data["records"])
            pos = f.data["to_seq"]
    return out


async def test_idle_streams_are_written_by_the_drain(autojump_clock):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wire = Wire()
        session, _conn = await start(engine, nursery, wire)
        for i in range(5):
            await engine.append("t", write_req(i))
            await trio.testing.wait_all_tasks_blocked()
        assert wire.direct_calls == 5  # no frame went through the channel
        assert record_seqs(wire.data) == [1, 2, 3, 4, 5]
        assert session.cursors["t"] == 5
        nursery.cancel_scope.cancel()


async def test_a_partial_direct_write_is_finished_by_the_pump_before_anything_else(
    autojump_clock,
):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wire = Wire()
        session, conn = await start(engine, nursery, wire)
        await engine.append("t", write_req("a"))
        await trio.testing.wait_all_tasks_blocked()
        wire.accept = 7  # the socket takes 7 bytes of the next frame
        wire.hold = trio.Event()  # and the pump's write of the rest is slow
        await engine.append("t", write_req("b"))
        await trio.testing.wait_all_tasks_blocked()  # the rest is being written
        assert wire.partials == 1
        await engine.append("t", write_req("c"))  # queued behind the rest: the pump's
        await trio.testing.wait_all_tasks_blocked()
        wire.hold.set()
        await wire.wait_for(lambda: len(record_seqs(wire.data)) == 3)
        assert wire.direct_calls == 2
        assert not conn.remainder
        assert record_seqs(wire.data) == [1, 2, 3]
        assert session.cursors["t"] == 3
        nursery.cancel_scope.cancel()


async def test_an_advisory_handed_to_the_parked_pump_waits_for_a_partial_direct_write(
    autojump_clock,
):
    """The advisory reaches the pump's pending receive; before the pump runs, the drain
    writes a frame directly and the socket takes only part of it: the rest goes out
    before the advisory, so the stream stays well-formed.

    Whether the pump or the drain runs first is Trio's (randomized) choice, so the
    scenario is repeated until the drain went first; every round must be well-formed."""
    advisory = b'event: error\ndata: {"code":429}\n\n'
    orders = set()
    for _ in range(30):
        async with open_app() as h, trio.open_nursery() as nursery:
            engine = h.engine
            await engine.put_topic("t", None)
            wire = Wire()
            _session, conn = await start(engine, nursery, wire)
            assert conn.idle
            assert conn.advise(advisory)  # handed to the parked receive
            wire.accept = 7
            await engine.append("t", write_req("a"))  # the drain writes it directly: 7 bytes
            await trio.testing.wait_all_tasks_blocked()
            frames = SseParser().feed(wire.data)
            last = [f.event for f in frames][-2:]
            assert sorted(last) == ["error", "record"]  # both whole: nothing interleaved
            assert record_seqs(wire.data) == [1]
            assert wire.data.count(advisory) == 1
            assert not conn.remainder
            orders.add((tuple(last), wire.partials))
            nursery.cancel_scope.cancel()
        if (("record", "error"), 1) in orders:
            break  # the partial direct write went first and the advisory waited for it
    assert (("record", "error"), 1) in orders, orders


async def test_the_heartbeat_counts_from_a_direct_write(autojump_clock):
    async with open_app() as h, trio.open_nursery() as nursery:
        engine = h.engine
        await engine.put_topic("t", None)
        wire = Wire()
        session, _conn = await start(engine, nursery, wire)
        period = session.heartbeat_ms / 1000
        t0 = trio.current_time()
        await advance(autojump_clock, period * 0.6)
        await engine.append("t", write_req(1))
        await trio.testing.wait_all_tasks_blocked()
        hb_before = wire.data.count(b": hb\n\n")
        await advance(
            autojump_clock, period * 0.6
        )  # 1.2 periods after the open, 0.6 after the write
        assert wire.data.count(b": hb\n\n") == hb_before  # no heartbeat yet
        await advance(autojump_clock, period * 0.5)
        assert wire.data.count(b": hb\n\n") == hb_before + 1
        assert trio.current_time() - t0 >= period * 1.6
        nursery.cancel_scope.cancel()
