"""Watch resume exactness: no gap and no duplicate across dropped connections, a silent
peer and server restarts.

Method: the client reads through a TCP proxy that the test controls (`Proxy`): `cut()`
closes every open connection at once (a dropped connection, seen by the client mid-frame
or between frames), `freeze()` stops forwarding without closing (a silent peer, which
only the client's heartbeat watchdog can detect). Server restarts use real `topicd serve`
children on one data directory and a fixed port: a `kill -9` (the session is forgotten,
so the client must create a new one from its cursors) and a graceful `SIGTERM` (the
stream's last frame says `server_shutting_down`). Topics are `fsync` class, so every
acknowledged record survives the kill. Every test writes seqs 1..N, some of them while
the client is disconnected, and asserts the client handed out exactly 1..N in order.
"""

from __future__ import annotations

import socket
import subprocess
from contextlib import asynccontextmanager

import pytest
import trio

from tests.crash.harness import TOPICD, Server
from tests.server.helpers import served
from topicd.client import BackpressurePolicy, Client, Record, Tombstone
from topicd.testing.harness import make_config

pytestmark = pytest.mark.slow


class Proxy:
    """A TCP relay to `target` whose connections the test can cut or freeze."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.streams: list[trio.SocketStream] = []
        self.conns: list[dict[str, bool]] = []
        self.accepted = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, downstream: trio.SocketStream) -> None:
        self.accepted += 1
        upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        self.streams += [downstream, upstream]
        conn = {"frozen": False}
        self.conns.append(conn)

        async def pump(src, dst):
            try:
                while data := await src.receive_some(65536):
                    if conn["frozen"]:
                        await trio.sleep_forever()  # a silent peer: open, saying nothing
                    await dst.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                await dst.aclose()

        async with trio.open_nursery() as n:
            n.start_soon(pump, downstream, upstream)
            n.start_soon(pump, upstream, downstream)

    def freeze(self) -> None:
        """Stop relaying on every open connection, without closing any."""
        for conn in self.conns:
            conn["frozen"] = True

    async def cut(self) -> None:
        streams, self.streams = self.streams, []
        for s in streams:
            await s.aclose()


@asynccontextmanager
async def proxied_server():
    cfg = make_config(server={"port": 0})
    async with served(cfg) as (_engine, _app, host, port), trio.open_nursery() as n:
        proxy = Proxy(port)
        await n.start(proxy.run)
        yield proxy, f"http://{host}:{port}", f"http://127.0.0.1:{proxy.port}"
        n.cancel_scope.cancel()


async def consume(stream, until_seq, got, on_record=None):
    """Hand out events until `until_seq` of topic `r` arrived; returns the records."""
    async for e in stream:
        assert not isinstance(e, Tombstone), e
        if isinstance(e, Record):
            got.append((e.topic, e.seq, e.data))
            if on_record is not None:
                await on_record(e)
            if e.topic == "r" and e.seq >= until_seq:
                return got
    raise AssertionError("the stream ended")


def assert_exact(got, topic, n):
    seqs = [s for t, s, _ in got if t == topic]
    assert seqs == list(range(1, n + 1)), seqs
    assert all(d == s for t, s, d in got if t == topic)


async def test_dropped_connections_mid_stream_resume_exactly():
    async with (
        proxied_server() as (proxy, direct, via),
        Client(direct) as writer,
        Client(via) as c,
    ):
        await writer.write_batch("r", [{"data": i} for i in range(1, 41)])
        await writer.write_batch("s", [{"data": i} for i in range(1, 11)])
        got = []

        async def chaos(e):
            if e.topic == "r" and e.seq in (7, 23, 38):
                # the server wrote frames past this record; the client has not
                # handed them out yet: a rewind must bring exactly those back
                await proxy.cut()
            if e.topic == "r" and e.seq == 23:
                await writer.write_batch("r", [{"data": i} for i in range(41, 61)])

        with trio.fail_after(30):
            async with c.watch({"r": 0, "s": 0}, limit=5) as w:
                await consume(w, 60, got, chaos)
                # (a cut landing while the client still hands out what it read before the
                # previous cut finds no connection to cut: how many reconnects three cuts
                # cause depends on how much the socket carried at once)
                assert w.reconnects >= 1 and w.sessions == 1
                assert w.cursors["r"] == 60
        assert_exact(got, "r", 60)
        assert_exact(got, "s", 10)
        assert proxy.accepted >= 1 + w.reconnects  # one connection per reconnect


async def test_a_silent_peer_is_detected_by_the_watchdog_and_resumed():
    async with (
        proxied_server() as (proxy, direct, via),
        Client(direct) as writer,
        Client(via) as c,
    ):
        await writer.write_batch("r", [{"data": i} for i in range(1, 6)])
        got = []

        async def on_record(e):
            if e.seq == 5:
                proxy.freeze()
                await writer.write_batch("r", [{"data": i} for i in range(6, 11)])

        with trio.fail_after(30):
            async with c.watch({"r": 0}, heartbeat_ms=1000) as w:
                t0 = trio.current_time()
                await consume(w, 10, got, on_record)
                assert w.reconnects == 1
        assert_exact(got, "r", 10)
        # nothing for 2 × heartbeat_ms + 2 s, then the watchdog reopened the stream
        assert trio.current_time() - t0 >= 4


class FixedPortServer(Server):
    """A crash-harness server that always binds the same port (the client's URL)."""

    fixed_port = 0

    async def spawn(self):
        assert not self.runs or self.run.proc.returncode is not None
        self.port_file.unlink(missing_ok=True)
        args = [*TOPICD, "serve", "--port", str(self.fixed_port), "--data-dir", str(self.data_dir)]
        proc = await trio.lowlevel.open_process(
            [*args, "--log-level", "info"],
            cwd=self.workdir,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        from tests.crash.harness import _Run

        run = _Run(proc)
        self.runs.append(run)
        self.nursery.start_soon(run.pump)
        return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def fixed_server(tmp_path):
    async with trio.open_nursery() as nursery:
        server = FixedPortServer(nursery, tmp_path)
        server.fixed_port = free_port()
        try:
            await server.start()
            yield server
        finally:
            with trio.CancelScope(shield=True):
                await server.close()


@pytest.mark.parametrize("how", ["kill", "term"])
async def test_a_server_restart_resumes_exactly(tmp_path, how):
    async with fixed_server(tmp_path) as server:
        policy = BackpressurePolicy(max_retries=20)
        async with Client(server.url, policy=policy) as c:
            await c.put_topic("r", {"durability": "fsync"})
            await c.put_topic("s", {"durability": "fsync"})
            await c.write_batch("r", [{"data": i} for i in range(1, 31)])
            await c.write_batch("s", [{"data": i} for i in range(1, 4)])
            got = []

            async def restart(e):
                if e.topic == "r" and e.seq == 12:
                    if how == "kill":
                        await server.kill()
                    else:
                        assert await server.term_then_kill(20) == 0
                    await server.start()
                    await c.write_batch("r", [{"data": i} for i in range(31, 51)])
                    await c.write("s", 4)

            with trio.fail_after(60):
                async with c.watch({"r": 0, "s": 0}, limit=4) as w:
                    await consume(w, 50, got, restart)
                    # `s` got its fourth record after the restart too
                    while len([1 for t, *_ in got if t == "s"]) < 4:
                        e = await w.__anext__()
                        if isinstance(e, Record):
                            got.append((e.topic, e.seq, e.data))
                    assert w.sessions == 2  # the restart forgot the first session
            assert_exact(got, "r", 50)
            assert_exact(got, "s", 4)
