"""`/v0/ws` over real sockets, on every server path.

Method: the daemon's server (`topicd.http.server.serve`) in-process on port 0, with real
TCP clients speaking WebSocket through wsproto (`topicd.testing.ws.WsClient`). Three
paths: `direct` (the default: the upgrade is served on topicd's own socket path and the
drains write shared frames straight to idle sockets), `sniffed` (`server.direct_http1`
off: only streams, probes and `/v0/ws` take the direct path) and `hypercorn` (the direct
path off: Hypercorn does the handshake and the framing, the gate hands the ASGI
websocket to the same endpoint). Real clock: the tests assert behaviour, never timing.
"""

from __future__ import annotations

import orjson
import pytest
import trio

from tests.server.helpers import Reader, served
from topicd.http.app import gate_of
from topicd.testing.harness import make_config
from topicd.testing.ws import WsClient, WsClosed

H = b"Host: x\r\n"

PATHS = {
    "direct": {"server": {"port": 0}},
    "sniffed": {"server": {"port": 0, "direct_http1": False}},
    "hypercorn": {"server": {"port": 0, "direct_http1": False}, "sse": {"direct_write": False}},
}


@pytest.fixture(params=list(PATHS))
async def server(request):
    async with served(make_config(**PATHS[request.param])) as (engine, app, host, port):
        yield request.param, engine, app, host, port


async def put_topic(host: str, port: int, name: str, config: bytes = b"") -> None:
    stream = await trio.open_tcp_stream(host, port)
    head = b"PUT /v0/topics/%s HTTP/1.1\r\n%sContent-Length: %d\r\n" % (
        name.encode(),
        H,
        len(config),
    )
    if config:
        head += b"Content-Type: application/json\r\n"
    await stream.send_all(head + b"\r\n" + config)
    status, _, _ = await Reader(stream).raw()
    assert status == 201
    await stream.aclose()


async def test_subscribe_publish_and_live_fan_out(server):
    mode, engine, app, host, port = server
    await put_topic(host, port, "t")
    subs = [await WsClient.connect(host, port) for _ in range(3)]
    assert [c.status for c in subs] == [101] * 3
    with trio.fail_after(10):
        for c in subs:
            await c.send({"op": "subscribe", "request_id": "s", "topic": "t"})
            got = await c.recv_until(lambda m: m["op"] == "caught_up")
            assert got[0]["op"] == "subscribed"
        pub = await WsClient.connect(host, port)
        for i in range(1, 51):
            ack = await pub.request_reply(
                {"op": "publish", "request_id": i, "topic": "t", "records": [{"data": i}]}
            )
            assert (ack["op"], ack["first_seq"]) == ("ack", i)
        for c in subs:
            seqs: list[int] = []
            pos = 0
            while len(seqs) < 50:
                m = await c.recv()
                assert m["op"] == "record"
                assert m["from_seq"] == pos
                pos = m["to_seq"]
                seqs.extend(r["$seq"] for r in m["records"])
            assert seqs == list(range(1, 51))
    assert engine.watch.sse_connections() == 4
    # on the direct socket path, parked subscribers got the drains' batches in one send
    whole = sum(c.batches_sent for c in engine.watch.ws_conns)
    assert (whole > 0) == (mode != "hypercorn")
    for c in [*subs, pub]:
        await c.close()
        with pytest.raises(WsClosed), trio.fail_after(10):
            await c.recv()
        await c.aclose()
    with trio.fail_after(10):
        await engine.watch.wait_streams_below(1)
    counts = gate_of(app).requests_by_path
    if mode == "hypercorn":
        assert counts["direct"] == 0


async def test_upgrade_after_a_plain_request_on_the_same_connection(server):
    _mode, _engine, _app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    r = Reader(stream)
    await stream.send_all(b"GET /v0/topics HTTP/1.1\r\n" + H + b"\r\n")
    status, _, _ = await r.raw()
    assert status == 200
    assert r.buf == b""
    client = WsClient(stream)
    await stream.send_all(client.request())
    with trio.fail_after(10):
        assert await client.read_handshake() == 101
        assert await client.request_reply({"op": "ping", "request_id": 1}) == {
            "op": "pong",
            "request_id": 1,
        }
    await client.aclose()


async def test_a_refused_upgrade_is_the_canonical_error_answer(server):
    _mode, _engine, _app, host, port = server
    with trio.fail_after(10):
        client = await WsClient.connect(host, port, path="/v0/topics/t")
    assert client.status == 404
    assert orjson.loads(client.reject_body)["error"]["code"] == "not_found"
    await client.aclose()


async def test_plain_get_without_upgrade_is_400(server):
    _mode, _engine, _app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(b"GET /v0/ws HTTP/1.1\r\n" + H + b"\r\n")
    status, _, body = await Reader(stream).raw()
    assert status == 400
    assert orjson.loads(body)["error"]["code"] == "invalid_request"
    await stream.aclose()


@pytest.mark.parametrize("path", list(PATHS))
async def test_auth_and_caps_at_the_upgrade(path):
    cfg = make_config(**PATHS[path], auth={"api_keys": ["rd:r"]}, limits={"max_sse_connections": 1})
    async with served(cfg) as (_engine, _app, host, port):
        with trio.fail_after(10):
            anon = await WsClient.connect(host, port)
            assert anon.status == 401
            assert orjson.loads(anon.reject_body)["error"]["code"] == "unauthorized"
            ok = await WsClient.connect(host, port, {"Authorization": "Bearer rd"})
            assert ok.status == 101
            full = await WsClient.connect(host, port, {"Authorization": "Bearer rd"})
            assert full.status == 429
            detail = orjson.loads(full.reject_body)["error"]["detail"]
            assert detail["limit"] == "max_sse_connections"
            err = await ok.request_reply(
                {"op": "publish", "request_id": 1, "topic": "t", "records": [{"data": 1}]}
            )
            assert err["code"] == "forbidden"
        for c in (anon, ok, full):
            await c.aclose()


async def test_drain_ends_every_connection_with_shutting_down_then_close(server):
    _mode, engine, _app, host, port = server
    clients = [await WsClient.connect(host, port) for _ in range(2)]
    with trio.fail_after(10):
        for c in clients:
            assert (await c.request_reply({"op": "ping", "request_id": 0}))["op"] == "pong"
        engine.begin_drain()
        for c in clients:
            msg = await c.recv()
            assert (msg["op"], msg["code"]) == ("error", "server_shutting_down")
            with pytest.raises(WsClosed):
                await c.recv()
            assert c.close_code == 1001
            await c.close()
        await engine.watch.wait_streams_below(1)
    for c in clients:
        await c.aclose()


async def test_a_stalled_socket_lags_and_catches_up_losslessly(server):
    """A client that stops reading on a real socket (small receive buffer): the server's
    direct writes run into a full socket mid-frame, the queue fills, the connection lags;
    a healthy subscriber keeps up meanwhile; then every seq arrives once — as a record or
    inside an exact cap tombstone — in well-formed frames (wsproto parses them all)."""
    _mode, engine, _app, host, port = server
    await put_topic(host, port, "s", b'{"cap_records": 400}')
    with trio.fail_after(30):
        pub = await WsClient.connect(host, port)
        first = await pub.request_reply(
            {"op": "publish", "request_id": 0, "topic": "s", "records": [{"data": 0}]}
        )
        assert first["op"] == "ack"
        healthy = await WsClient.connect(host, port)
        stalled = await WsClient.connect(host, port, rcvbuf=4096)
        for c in (healthy, stalled):
            await c.send({"op": "subscribe", "topic": "s", "from_seq": 1})
            await c.recv_until(lambda m: m["op"] == "caught_up")
        conn = list(engine.watch.ws_conns)[2]
        blob = "x" * 1024
        n = 1500
        got: list[int] = []
        peak = 0
        for i in range(2, n + 1):
            ack = await pub.request_reply(
                {
                    "op": "publish",
                    "request_id": i,
                    "topic": "s",
                    "records": [{"data": [i, blob]}],
                    "return_seqs": False,
                }
            )
            assert ack["first_seq"] == i
            peak = max(peak, conn.recv_ch.statistics().current_buffer_used)
            if i % 50 == 0:
                while not got or got[-1] < i:
                    m = await healthy.recv()
                    if m["op"] == "record":
                        got.extend(r["$seq"] for r in m["records"])
        assert got == list(range(2, n + 1))
        assert conn.lagged
        assert peak <= 4
        late = await stalled.recv_until(lambda m: m["op"] == "caught_up" and m["head_seq"] == n)
    covered: list[int] = []
    pos = 1
    for m in late:
        if m["op"] == "record":
            assert m["from_seq"] == pos
            covered.extend(r["$seq"] for r in m["records"])
            pos = m["to_seq"]
        elif m["op"] == "tombstone":
            assert m["reason"] == "cap"
            assert m["gap_from"] == pos + 1
            covered.extend(range(m["gap_from"], m["gap_to"] + 1))
            pos = m["gap_to"]
    assert any(m["op"] == "tombstone" for m in late)
    assert covered == list(range(2, n + 1))
    for c in (pub, healthy, stalled):
        await c.aclose()


@pytest.mark.parametrize("size", [10, 200, 70000])
async def test_messages_of_every_frame_length_arrive_intact(server, size):
    """Frames whose payload length takes 7, 16 and 64 bits (the ASGI path unwraps the
    shared frames: every header size must come out right)."""
    _mode, _engine, _app, host, port = server
    await put_topic(host, port, "big")
    text = "é" * size  # multi-byte UTF-8 too
    with trio.fail_after(10):
        sub = await WsClient.connect(host, port)
        await sub.send({"op": "subscribe", "topic": "big"})
        await sub.recv_until(lambda m: m["op"] == "caught_up")
        pub = await WsClient.connect(host, port)
        ack = await pub.request_reply(
            {"op": "publish", "request_id": 1, "topic": "big", "records": [{"data": text}]}
        )
        assert ack["op"] == "ack"
        msg = await sub.recv()
        assert msg["records"][0]["data"] == text
        # and through catch-up (built for this connection alone)
        late = await WsClient.connect(host, port)
        await late.send({"op": "subscribe", "topic": "big"})
        got = await late.recv_until(lambda m: m["op"] == "caught_up")
        assert got[1]["records"][0]["data"] == text
    for c in (sub, pub, late):
        await c.aclose()
