"""Silent HTTP/1.1 connections wait in `IdleConnections`, without a task each.

A task per idle connection costs about 40 objects the garbage collector tracks (its
coroutines, cancel scope, read registration); with 10,000 idle connections every full
collection walked them all and stopped the event loop for hundreds of milliseconds, and
their memory stayed fragmented after they closed. These tests pin down that a silent
connection ends its task after `PARK_AFTER_S`, comes back to a task as soon as it sends,
keeps its header deadline, and leaves nothing behind once closed. Time is virtual
(`mock_clock`, moved by `advance`).
"""

from __future__ import annotations

import gc
import socket

import trio
import trio.testing
from hypercorn.config import Config as HyperConfig

from tests.server.helpers import Reader, served
from topicd.http.app import gate_of
from topicd.http.idle import BATCH, PARK_AFTER_S, STALE_SLACK, IdleConnections
from topicd.http.server import ACCEPT_BATCH, Listener
from topicd.testing.fake_clock import advance
from topicd.testing.harness import make_config

H = b"Host: x\r\n"
TIMEOUT_S = 60.0


def config():
    return make_config(server={"port": 0, "header_read_timeout_ms": int(TIMEOUT_S * 1000)})


async def settle() -> None:
    """Every task blocked and no socket event for a moment: the server has taken what
    the clients sent."""
    await trio.testing.wait_all_tasks_blocked(cushion=0.05)


def tasks() -> int:
    return trio.lowlevel.current_statistics().tasks_living


def silent_and_open(stream: trio.SocketStream) -> bool:
    """Nothing to read and no EOF yet, asked without blocking."""
    with socket.fromfd(stream.socket.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
        try:
            dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
    return False


async def test_silent_connections_wait_without_a_task_and_wake_on_their_bytes(mock_clock):
    async with served(config()) as (_engine, app, host, port):
        idle = gate_of(app).idle
        assert isinstance(idle, IdleConnections)
        await settle()
        tasks0 = tasks()
        silent, partial, served_once = [], [], []
        for _ in range(10):
            silent.append(await trio.open_tcp_stream(host, port))
            stream = await trio.open_tcp_stream(host, port)
            await stream.send_all(b"GET /v0/topics HTTP/1.1\r\nHo")
            partial.append(stream)
            stream = await trio.open_tcp_stream(host, port)
            await stream.send_all(b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
            assert (await Reader(stream).response())[0] == 200
            served_once.append(stream)
        everyone = silent + partial + served_once
        await settle()
        assert tasks() == tasks0 + 30 and len(idle) == 0  # each still waits in its task
        await advance(mock_clock, PARK_AFTER_S - 0.01)
        await settle()
        assert tasks() == tasks0 + 30 and len(idle) == 0
        await advance(mock_clock, 0.02)
        await settle()
        assert tasks() == tasks0 and len(idle) == 30  # parked: no task, still open
        assert all(silent_and_open(s) for s in everyone)

        # bytes wake a parked connection: the rest of a head, a new request
        for stream in partial:
            await stream.send_all(b"st: x\r\n\r\n")
        for stream in silent + served_once:
            await stream.send_all(b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
        for stream in everyone:
            status, _head, _doc = await Reader(stream).response()
            assert status == 200
        await settle()
        assert len(idle) == 0 and tasks() == tasks0 + 30
        await advance(mock_clock, PARK_AFTER_S + 0.01)
        await settle()
        assert len(idle) == 30 and tasks() == tasks0

        # a parked connection closes at its header deadline (counted from the end of its
        # last answer), with no answer, and leaves nothing behind
        await advance(mock_clock, TIMEOUT_S - PARK_AFTER_S - 0.1)
        assert all(silent_and_open(s) for s in everyone)
        await advance(mock_clock, 0.2)
        for stream in everyone:
            assert await stream.receive_some(100) == b""
            await stream.aclose()
        await settle()
        assert len(idle) == 0 and idle.heap_size() == 0 and tasks() == tasks0


async def test_a_slow_head_keeps_its_deadline_across_parking(mock_clock):
    async with served(config()) as (engine, app, host, port):
        idle = gate_of(app).idle
        assert idle is not None
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(b"PUT /v0/topics/slow HTTP/1.1\r\nHo")
        await settle()
        for _ in range(5):  # a byte every 10 s: woken, read, parked again each time
            await advance(mock_clock, 10.0)
            assert len(idle) == 1 and silent_and_open(stream)
            await stream.send_all(b"s")
            await settle()
        await advance(mock_clock, TIMEOUT_S - 50.0 - 0.1)
        assert silent_and_open(stream)
        await advance(mock_clock, 0.2)
        assert await stream.receive_some(100) == b""
        await stream.aclose()
        await settle()
        assert len(idle) == 0 and idle.heap_size() == 0
        assert "slow" not in engine.topics


async def test_parked_connections_close_when_the_server_stops(mock_clock):
    streams = []
    async with served(config()) as (_engine, app, host, port):
        for _ in range(3):
            streams.append(await trio.open_tcp_stream(host, port))
        await settle()
        await advance(mock_clock, PARK_AFTER_S + 0.01)
        await settle()
        assert len(gate_of(app).idle or ()) == 3
    for stream in streams:
        with trio.fail_after(10):
            assert await stream.receive_some(100) == b""
        await stream.aclose()


async def test_an_idle_connection_costs_the_collector_a_handful_of_objects(mock_clock):
    """What a full garbage collection walks per idle connection, both ends counted here
    (the client's stream is 4 objects): about 45 with a task per connection."""
    n = 200
    async with served(config()) as (_engine, _app, host, port):
        await settle()
        gc.collect()
        before = len(gc.get_objects())
        streams = [await trio.open_tcp_stream(host, port) for _ in range(n)]
        await settle()
        await advance(mock_clock, PARK_AFTER_S + 0.01)
        await settle()
        gc.collect()
        per_connection = (len(gc.get_objects()) - before) / n
        for stream in streams:
            await stream.aclose()
    assert per_connection < 12, per_connection


async def test_a_wave_of_timeouts_is_closed_in_bounded_batches():
    """Connections parked together expire together: closed `BATCH` per turn of the event
    loop, not all in one."""

    async def resume(stream: trio.SocketStream, head: bytes, deadline: float) -> None:
        raise AssertionError("nothing was sent")

    idle = IdleConnections(resume)
    pairs = [socket.socketpair() for _ in range(BATCH * 2 + 10)]
    try:
        deadline = trio.current_time() + 5.0
        for server_end, _client_end in pairs:
            assert idle.park(
                trio.SocketStream(trio.socket.from_stdlib_socket(server_end)), b"", deadline
            )
        assert len(idle) == len(pairs)
        assert idle._expire(deadline - 0.001) == 0
        assert [idle._expire(deadline) for _ in range(4)] == [BATCH, BATCH, 10, 0]
        assert len(idle) == 0 and idle.heap_size() == 0
        for _server_end, client_end in pairs:
            assert client_end.recv(10) == b""  # closed, no answer
    finally:
        idle.close_all()
        for a, b in pairs:
            a.close()
            b.close()


async def test_deadline_entries_of_woken_connections_stay_bounded():
    """A slow drip parks again after each byte, leaving an entry for every park: they
    are compacted once they outnumber the parked connections."""

    async def resume(stream: trio.SocketStream, head: bytes, deadline: float) -> None:
        raise AssertionError("not woken here")

    idle = IdleConnections(resume)
    server_end, client_end = socket.socketpair()
    try:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(server_end))
        deadline = trio.current_time() + 60.0
        for _ in range(5000):  # park, wake (by hand), park again...
            assert idle.park(stream, b"", deadline)
            fd = stream.socket.fileno()
            idle._unpark(fd)
            assert idle.heap_size() <= 2 * (len(idle) + 1) + STALE_SLACK + 1
        assert idle.park(stream, b"", deadline)
        assert len(idle) == 1 and idle.heap_size() <= 2 + STALE_SLACK + 1
        while idle._expire(deadline):  # (BATCH entries a turn, stale ones first)
            pass
        assert len(idle) == 0 and idle.heap_size() == 0
    finally:
        idle.close_all()
        server_end.close()
        client_end.close()


async def test_connections_that_come_and_go_leave_every_registry_as_it_was(mock_clock):
    async with served(config()) as (_engine, app, host, port):
        idle = gate_of(app).idle
        assert idle is not None
        await settle()
        tasks0 = tasks()
        reading0 = trio.lowlevel.current_statistics().io_statistics.tasks_waiting_read
        for round_ in range(3):
            streams = []
            for i in range(60):
                stream = await trio.open_tcp_stream(host, port)
                if i % 3 == 1:
                    await stream.send_all(b"GET /v0/topics HTTP/1.1\r\nHo")
                elif i % 3 == 2:
                    await stream.send_all(b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
                    assert (await Reader(stream).response())[0] == 200
                streams.append(stream)
            await settle()
            if round_ != 1:  # closed by their clients while parked, or while in a task
                await advance(mock_clock, PARK_AFTER_S + 0.01)
                await settle()
                assert len(idle) == 60
            for stream in streams:
                await stream.aclose()
            await settle()
            assert len(idle) == 0 and tasks() == tasks0
            stats = trio.lowlevel.current_statistics()
            assert stats.io_statistics.tasks_waiting_read == reading0
        await advance(mock_clock, TIMEOUT_S)  # the woken ones' deadline entries lapse
        await settle()
        assert idle.heap_size() == 0


async def test_connections_waiting_to_be_accepted_are_taken_a_batch_per_turn():
    """A wave of reconnects (10,000 idle connections timing out together) fills the
    accept queue: each turn of the loop takes up to `ACCEPT_BATCH` of them, not one."""
    listener = Listener(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        lambda scope: False,
        HyperConfig(),
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        direct=True,
    )

    class Recorder:
        def __init__(self) -> None:
            self.started: list[trio.SocketStream] = []

        def start_soon(self, fn, stream) -> None:
            self.started.append(stream)

    server = socket.create_server(("127.0.0.1", 0), backlog=256)
    clients = []
    try:
        trio_listener = trio.SocketListener(trio.socket.from_stdlib_socket(server))
        for _ in range(ACCEPT_BATCH + 37):
            clients.append(socket.create_connection(server.getsockname()))
        nursery = Recorder()
        listener._accept_ready(trio_listener, nursery)  # type: ignore[arg-type]
        assert len(nursery.started) == ACCEPT_BATCH - 1  # (the awaited accept is the 1st)
        listener._accept_ready(trio_listener, nursery)  # type: ignore[arg-type]
        assert len(nursery.started) == ACCEPT_BATCH + 37
        listener._accept_ready(trio_listener, nursery)  # type: ignore[arg-type]
        assert len(nursery.started) == ACCEPT_BATCH + 37  # nothing left: no wait either
        for stream in nursery.started:
            stream.socket.close()
    finally:
        for c in clients:
            c.close()
        server.close()
