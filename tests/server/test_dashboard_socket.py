"""The dashboard over real sockets: the daemon's server in-process on port 0, a raw TCP
client (`RawSseClient`, HTTP/1.1 chunked) for the feed and raw requests for the page.

Method: three server set-ups, as for the other streams — the direct socket path for every
plain request (the default), the direct path for streams and probes only
(`server.direct_http1 = false`: the feed then goes through Hypercorn), and every request
through Hypercorn (`sse.direct_write = false`). The hub is in the same process, so the
tests wait for a viewer to go on the hub's own change signal, never on time. Real clock:
the tests assert behaviour, never timing.
"""

from __future__ import annotations

import pytest
import trio

from tests.server.helpers import Reader, permits_taken, served
from topicd.http.app import gate_of
from topicd.testing.harness import make_config
from topicd.testing.sse import RawSseClient

SETUPS = {
    "direct": {},
    "direct-streams-only": {"server": {"port": 0, "direct_http1": False}},
    "hypercorn": {"sse": {"direct_write": False}},
}
FEED = "/_topicd/dashboard/events"


@pytest.fixture(params=list(SETUPS))
async def server(request):
    sections = {"server": {"port": 0}, "dashboard": {"interval_ms": 100}, **SETUPS[request.param]}
    async with served(make_config(**sections)) as (engine, app, host, port):
        yield request.param, engine, gate_of(app).dashboard, host, port


async def test_feed_streams_snapshots_and_a_closed_socket_detaches(server):
    _setup, engine, hub, host, port = server
    with trio.fail_after(30):
        c = await RawSseClient.connect(host, port, FEED)
        await c.read_head()
        assert c.status == 200
        assert c.headers["content-type"] == "text/event-stream; charset=utf-8"
        (hello,) = await c.read_frames(1)
        assert (hello.event, hello.retry) == ("hello", 2000)
        a, b = await c.read_frames(2)
        assert a.event == b.event == "snapshot"
        assert b.data["server_time_ms"] > a.data["server_time_ms"]
        assert engine.watch.sse_connections() == 1
        await c.aclose()
        await hub.wait_viewers(0)
        assert engine.watch.sse_connections() == 0


async def test_page_over_a_socket(server):
    _setup, _engine, _hub, host, port = server
    with trio.fail_after(30):
        stream = await trio.open_tcp_stream(host, port)
        r = Reader(stream)
        await stream.send_all(b"GET /_topicd/dashboard HTTP/1.1\r\nHost: x\r\n\r\n")
        status, head, body = await r.raw()
        assert status == 200
        assert b"content-type: text/html; charset=utf-8" in head
        assert body.startswith(b"<!doctype html>")
        await stream.aclose()


async def test_dashboard_is_served_while_every_client_permit_is_taken():
    """Control work: the quick refusal of a full server (`429 client_waiters`, decided from
    the request line) passes the dashboard's page and feed by."""
    cfg = make_config(server={"port": 0}, classes={"client_permits": 1, "client_waiters": 0})
    async with served(cfg) as (_engine, app, host, port), permits_taken(app):
        with trio.fail_after(30):
            stream = await trio.open_tcp_stream(host, port)
            r = Reader(stream)
            await stream.send_all(b"GET /v0/topics HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, _ = await r.raw()
            assert status == 429
            await stream.send_all(b"GET /_topicd/dashboard HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = await r.raw()
            assert status == 200 and body.startswith(b"<!doctype html>")
            await stream.aclose()
            c = await RawSseClient.connect(host, port, FEED)
            await c.read_head()
            assert c.status == 200
            (hello, snap) = await c.read_frames(2)
            assert (hello.event, snap.event) == ("hello", "snapshot")
            assert snap.data["connections"]["client_permits_in_use"] == 1
            await c.aclose()
