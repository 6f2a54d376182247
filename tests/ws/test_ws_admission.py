"""`/v0/ws` admission and lifetime: auth at the upgrade and per command, the SSE connection
caps, and the graceful drain.

Method: in-process, as test_ws_contract.py (wsproto client on an in-memory stream pair,
the server side behind the real gate, `MockClock`). An app is opened with bearer keys of
different scopes and prefixes; a refused handshake must be the canonical error answer
with its status; command errors are `error` messages with the HTTP codes. The drain is
`Engine.begin_drain`, as the daemon calls it on SIGTERM.
"""

from __future__ import annotations

import orjson
import pytest
import trio

from topicd.http.app import gate_of
from topicd.testing.fake_clock import advance
from topicd.testing.harness import make_config, open_app
from topicd.testing.sse import open_stream
from topicd.testing.ws import WsClosed, open_ws_in_process

KEYS = ["full", "rd:r", "wr:w", "rw:rw", "pre:rw:tenant1.", "rwa:rw+admin"]


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
async def authed(autojump_clock):
    async with open_app(make_config(auth={"api_keys": KEYS})) as h:
        c = h.app.test_client()
        for name in ("t", "tenant1.a", "other"):
            r = await c.put(f"/v0/topics/{name}", json={}, headers=bearer("full"))
            assert r.status_code == 201
        yield h


@pytest.mark.parametrize("headers", [{}, bearer("nope"), {"Authorization": "Basic full"}])
async def test_upgrade_without_a_valid_key_is_401(authed, nursery, headers):
    ws = await open_ws_in_process(nursery, authed.app, headers)
    assert ws.status == 401
    body = orjson.loads(ws.reject_body)
    assert body["error"]["code"] == "unauthorized"
    assert authed.engine.watch.sse_connections() == 0


async def test_any_valid_key_connects_and_scopes_are_checked_per_command(authed, nursery):
    rd = await open_ws_in_process(nursery, authed.app, bearer("rd"))
    wr = await open_ws_in_process(nursery, authed.app, bearer("wr"))
    assert (rd.status, wr.status) == (101, 101)
    ok = await rd.request_reply({"op": "subscribe", "request_id": 1, "topic": "t"})
    assert ok["op"] == "subscribed"
    err = await rd.request_reply(
        {"op": "publish", "request_id": 2, "topic": "t", "records": [{"data": 1}]}
    )
    assert (err["op"], err["code"], err["detail"]) == ("error", "forbidden", {"scope": "write"})
    ack = await wr.request_reply(
        {"op": "publish", "request_id": 3, "topic": "t", "records": [{"data": 1}]}
    )
    assert ack["op"] == "ack"
    err = await wr.request_reply({"op": "subscribe", "request_id": 4, "topic": "t"})
    assert (err["code"], err["detail"]) == ("forbidden", {"scope": "read"})
    # unsubscribe and ping need no scope
    assert (await wr.request_reply({"op": "unsubscribe", "request_id": 5, "topic": "t"}))[
        "op"
    ] == "unsubscribed"
    assert (await wr.request_reply({"op": "ping", "request_id": 6}))["op"] == "pong"
    # the read-only subscriber got the write
    msgs = await rd.recv_until(lambda m: m["op"] == "record")
    assert [r["data"] for r in msgs[-1]["records"]] == [1]


async def test_publish_with_config_needs_admin(authed, nursery):
    rw = await open_ws_in_process(nursery, authed.app, bearer("rw"))
    body = {"op": "publish", "topic": "t", "records": [{"data": 1}], "config": {}}
    err = await rw.request_reply({**body, "request_id": 1})
    assert (err["code"], err["detail"]) == ("forbidden", {"scope": "admin"})
    adm = await open_ws_in_process(nursery, authed.app, bearer("rwa"))
    assert (await adm.request_reply({**body, "request_id": 2}))["op"] == "ack"
    # without config, write alone is enough (and `config: null` is no config)
    plain = {"op": "publish", "topic": "t", "records": [{"data": 1}]}
    assert (await rw.request_reply({**plain, "request_id": 3}))["op"] == "ack"
    assert (await rw.request_reply({**plain, "request_id": 4, "config": None}))["op"] == "ack"


async def test_prefix_allowlist_applies_to_every_named_topic(authed, nursery):
    pre = await open_ws_in_process(nursery, authed.app, bearer("pre"))
    ok = await pre.request_reply({"op": "subscribe", "request_id": 1, "topic": "tenant1.a"})
    assert ok["op"] == "subscribed"
    err = await pre.request_reply(
        {"op": "subscribe", "request_id": 2, "topics": {"tenant1.a": {}, "other": {}}}
    )
    assert (err["code"], err["detail"]) == ("forbidden", {"topic": "other"})
    err = await pre.request_reply(
        {"op": "publish", "request_id": 3, "topic": "other", "records": [{"data": 1}]}
    )
    assert (err["code"], err["detail"]) == ("forbidden", {"topic": "other"})
    # an unknown topic outside the prefixes is forbidden, not reported missing
    err = await pre.request_reply({"op": "subscribe", "request_id": 4, "topic": "zzz"})
    assert err["code"] == "forbidden"


async def test_connections_count_against_the_sse_caps(autojump_clock, nursery):
    cfg = make_config(limits={"max_sse_connections": 2})
    async with open_app(cfg) as h:
        c = h.app.test_client()
        await c.put("/v0/topics/t", json={})
        r = await c.post("/v0/watch", json={"topics": {"t": {}}})
        sse = await open_stream(nursery, h.app.asgi_app, (await r.get_json())["wid"])
        await sse.read_frames(2)
        first = await open_ws_in_process(nursery, h.app)
        assert first.status == 101
        refused = await open_ws_in_process(nursery, h.app)
        assert refused.status == 429
        err = orjson.loads(refused.reject_body)["error"]
        assert (err["code"], err["detail"]["limit"]) == ("throttled", "max_sse_connections")
        # the WebSocket's slot also keeps an SSE stream out
        r = await c.post("/v0/watch", json={"topics": {"t": {}}})
        out = await open_stream(nursery, h.app.asgi_app, (await r.get_json())["wid"])
        assert out.status == 429
        # closing frees the slot
        await first.close()
        with pytest.raises(WsClosed):
            await first.recv()
        await trio.testing.wait_all_tasks_blocked()
        assert (await open_ws_in_process(nursery, h.app)).status == 101


async def test_per_key_cap_with_auth(autojump_clock, nursery):
    cfg = make_config(auth={"api_keys": KEYS}, limits={"max_sse_connections_per_key": 1})
    async with open_app(cfg) as h:
        assert (await open_ws_in_process(nursery, h.app, bearer("rd"))).status == 101
        again = await open_ws_in_process(nursery, h.app, bearer("rd"))
        assert again.status == 429
        detail = orjson.loads(again.reject_body)["error"]["detail"]
        assert detail["limit"] == "max_sse_connections_per_key"
        assert (await open_ws_in_process(nursery, h.app, bearer("wr"))).status == 101


async def test_upgrade_while_not_serving_is_503(autojump_clock, nursery):
    async with open_app(serving=False) as h:
        ws = await open_ws_in_process(nursery, h.app)
        assert ws.status == 503
        assert orjson.loads(ws.reject_body)["error"]["code"] == "not_ready"


async def test_drain_sends_server_shutting_down_then_closes(autojump_clock, nursery):
    async with open_app() as h:
        await h.app.test_client().put("/v0/topics/t", json={})
        ws = await open_ws_in_process(nursery, h.app)
        await ws.send({"op": "subscribe", "topic": "t"})
        await ws.recv_until(lambda m: m["op"] == "caught_up")
        assert h.lifecycle.inflight == 1  # the drain waits for it
        t0 = trio.current_time()
        h.lifecycle.begin_drain()
        h.engine.begin_drain()
        msg = await ws.recv()
        assert msg == {
            "op": "error",
            "request_id": None,
            "code": "server_shutting_down",
            "message": "the server is shutting down",
        }
        with pytest.raises(WsClosed) as closed:
            await ws.recv()
        assert closed.value.code == 1001
        await ws.close()  # the client answers the close: the server ends at once
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == t0
        assert h.lifecycle.inflight == 0
        assert h.engine.watch.sse_connections() == 0


async def test_drain_closes_even_when_the_client_never_answers(autojump_clock, nursery):
    async with open_app() as h:
        ws = await open_ws_in_process(nursery, h.app)
        h.engine.begin_drain()
        assert (await ws.recv())["code"] == "server_shutting_down"
        with pytest.raises(WsClosed):
            await ws.recv()
        t0 = trio.current_time()
        await advance(autojump_clock, 1.0)  # the close wait, then the connection ends
        assert trio.current_time() - t0 == 1.0
        assert h.lifecycle.inflight == 0


async def test_publish_is_client_work_under_the_permits(autojump_clock, nursery):
    cfg = make_config(classes={"client_permits": 1, "client_waiters": 0})
    async with open_app(cfg) as h:
        await h.app.test_client().put("/v0/topics/t", json={})
        ws = await open_ws_in_process(nursery, h.app)
        pool = gate_of(h.app).permits
        held = await pool.admit()  # every permit taken, no waiter slot
        body = {"op": "publish", "topic": "t", "records": [{"data": 1}]}
        err = await ws.request_reply({**body, "request_id": 1})
        assert (err["code"], err["detail"]["cause"]) == ("throttled", "client_waiters")
        assert "retry_after_ms" in err["detail"]
        # reads and pings are not refused
        assert (await ws.request_reply({"op": "ping", "request_id": 2}))["op"] == "pong"
        held.release()
        assert (await ws.request_reply({**body, "request_id": 3}))["op"] == "ack"
        assert pool.stats.in_use == 0
