"""Contract tests for opening `GET /v0/watch/:wid` (api-routers-watch §2.3, §2.4, §2.8;
README §2.5, §6; api-ops §4.1): `Accept` negotiation, unknown/reclaimed `wid`, the key
binding, the SSE connection caps, response headers, one stream per session (`409`
takeover) and session lifetime.

Method: black-box. `topicd.testing.sse.open_stream` drives the stream over raw ASGI
against the full app (gate included); the status, headers and — for refusals — the
canonical error body (README §5) are compared with the spec. The establishment order
(`406` → `404` → `401` → `429`) is checked by requests that break two rules at once. Time
uses pytest-trio's `autojump_clock` (MockClock; the engine's clocks follow Trio's virtual
time), so a TTL is crossed with `autojump_clock.jump(...)`, and a frame that must not come
is waited for in virtual time.
"""

from __future__ import annotations

import pytest
import trio

from tests.watch.helpers import (
    bearer,
    close,
    ends,
    fail,
    open_fail,
    open_ok,
    read,
    read_until_event,
    wid_of,
    write_n,
)
from topicd.testing.harness import make_config, open_app
from topicd.testing.sse import open_stream

# ---- Accept --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "accept",
    [
        "application/json",
        "text/html",
        "text/*",
        "text/plain, application/json;q=0.9",
        "text/event-streams",
    ],
)
async def test_unacceptable_accept_is_406(harness, client, nursery, autojump_clock, accept):
    await write_n(client, "a", 1)
    wid = await wid_of(client, {"topics": {"a": {}}})
    await open_fail(harness, nursery, wid, 406, "not_acceptable", headers={"Accept": accept})


@pytest.mark.parametrize(
    "accept",
    [
        None,
        "*/*",
        "text/event-stream",
        "text/event-stream; charset=utf-8",
        "TEXT/EVENT-STREAM",
        "application/json, */*;q=0.1",
        "text/html, text/event-stream",
    ],
)
async def test_acceptable_accept(harness, client, nursery, autojump_clock, accept):
    await write_n(client, "a", 1)
    wid = await wid_of(client, {"topics": {"a": {}}})
    headers = {} if accept is None else {"Accept": accept}
    s = await open_ok(harness, nursery, wid, headers=headers)
    await close(s)


async def test_response_headers(harness, client, nursery, autojump_clock):
    await write_n(client, "a", 1)
    wid = await wid_of(client, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid, headers={"Accept": "text/event-stream"})
    assert s.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert s.headers["cache-control"] == "no-store"
    assert s.headers["x-accel-buffering"] == "no"
    assert s.headers["connection"] == "keep-alive"  # the helper speaks HTTP/1.1
    assert "content-encoding" not in s.headers
    await close(s)


# ---- unknown wid -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wid", ["wid_AAAAAAAAAAAAAAAAAAAAAA", "nope", "wid_", "wid_q9T2cKx0VbLmN3aPe8uYzg"]
)
async def test_unknown_wid_is_404(harness, nursery, autojump_clock, wid):
    await open_fail(harness, nursery, wid, 404, "not_found")


async def test_wid_prefix_or_extension_is_404(harness, client, nursery, autojump_clock):
    await write_n(client, "a", 1)
    wid = await wid_of(client, {"topics": {"a": {}}})
    await open_fail(harness, nursery, wid[:-1], 404, "not_found")
    await open_fail(harness, nursery, wid + "A", 404, "not_found")
    await open_fail(harness, nursery, wid.upper(), 404, "not_found")


async def test_406_before_404(harness, nursery, autojump_clock):
    await open_fail(
        harness,
        nursery,
        "wid_AAAAAAAAAAAAAAAAAAAAAA",
        406,
        "not_acceptable",
        headers={"Accept": "application/json"},
    )


# ---- key binding ---------------------------------------------------------------------------

KEYS = ("full", "other", "rd:r", "pre:r:tenant1.")


@pytest.fixture
async def authed():
    async with open_app(make_config(auth={"api_keys": KEYS})) as h:
        client = h.app.test_client()
        for topic in ("t", "tenant1.a"):
            r = await client.post(
                f"/v0/topics/{topic}", json={"records": [{"data": 1}]}, headers=bearer("full")
            )
            assert r.status_code == 201
        yield h


async def test_auth_stream_needs_the_creating_key(authed, nursery, autojump_clock):
    client = authed.app.test_client()
    wid = await wid_of(client, {"topics": {"t": {}}}, headers=bearer("rd"))
    await open_fail(authed, nursery, wid, 401, "unauthorized")  # no key
    for other in ("full", "other", "pre"):  # another valid key, even a stronger one
        await open_fail(authed, nursery, wid, 401, "unauthorized", headers=bearer(other))
    await open_fail(authed, nursery, wid, 401, "unauthorized", headers=bearer("nope"))
    await open_fail(authed, nursery, wid, 401, "unauthorized", query="token=nope")
    await open_fail(authed, nursery, wid, 401, "unauthorized", query="token=full")
    s = await open_ok(authed, nursery, wid, headers=bearer("rd"))
    assert (await read(s, 2))[1] == ("caught-up", {"t": 1}, {"topic": "t", "head_seq": 1})
    await close(s)
    s = await open_ok(authed, nursery, wid, query="token=rd")
    assert (await read(s, 1))[0] == ("caught-up", {"t": 1}, {"topic": "t", "head_seq": 1})
    await close(s)


async def test_auth_token_first_occurrence_wins(authed, nursery, autojump_clock):
    client = authed.app.test_client()
    wid = await wid_of(client, {"topics": {"t": {}}}, headers=bearer("rd"))
    s = await open_ok(authed, nursery, wid, query="token=rd&token=other")
    await close(s)
    await open_fail(authed, nursery, wid, 401, "unauthorized", query="token=other&token=rd")


async def test_auth_header_wins_over_token(authed, nursery, autojump_clock):
    client = authed.app.test_client()
    wid = await wid_of(client, {"topics": {"t": {}}}, headers=bearer("rd"))
    s = await open_ok(authed, nursery, wid, headers=bearer("rd"), query="token=other")
    await close(s)
    await open_fail(
        authed, nursery, wid, 401, "unauthorized", headers=bearer("other"), query="token=rd"
    )


async def test_auth_order_404_before_401(authed, nursery, autojump_clock):
    await open_fail(authed, nursery, "wid_AAAAAAAAAAAAAAAAAAAAAA", 404, "not_found")
    await open_fail(
        authed, nursery, "wid_AAAAAAAAAAAAAAAAAAAAAA", 404, "not_found", headers=bearer("nope")
    )
    await open_fail(
        authed,
        nursery,
        "wid_AAAAAAAAAAAAAAAAAAAAAA",
        406,
        "not_acceptable",
        headers={"Accept": "application/json"},
    )


async def test_auth_order_406_before_401(authed, nursery, autojump_clock):
    client = authed.app.test_client()
    wid = await wid_of(client, {"topics": {"t": {}}}, headers=bearer("rd"))
    await open_fail(
        authed, nursery, wid, 406, "not_acceptable", headers={"Accept": "application/json"}
    )


async def test_dev_mode_wid_alone_opens_the_stream(harness, client, nursery, autojump_clock):
    await write_n(client, "a", 1)
    wid = await wid_of(client, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid, headers=bearer("anything"))
    await close(s)


# ---- connection caps -------------------------------------------------------------------------


async def test_max_sse_connections_edge(nursery, autojump_clock):
    async with open_app(make_config(limits={"max_sse_connections": 2})) as h:
        client = h.app.test_client()
        await write_n(client, "a", 1)
        wids = [await wid_of(client, {"topics": {"a": {"tail": True}}}) for _ in range(3)]
        s1 = await open_ok(h, nursery, wids[0])
        s2 = await open_ok(h, nursery, wids[1])
        s = await open_stream(nursery, h.app.asgi_app, wids[2])
        await s.wait_done()
        assert s.status == 429
        assert s.headers["retry-after"] == "1"
        assert s.error_body["error"]["code"] == "throttled"
        assert s.error_body["error"]["detail"] == {"limit": "max_sse_connections", "max": 2}
        # the refused stream did not disturb the open ones
        await write_n(client, "a", 1)
        for st in (s1, s2):
            frames = await read(st, 2)
            assert frames[0] == ("caught-up", {"a": 1}, {"topic": "a", "head_seq": 1})
            assert frames[1][0] == "record" and frames[1][1] == {"a": 2}
        # a closed connection frees its slot
        await close(s1)
        s3 = await open_ok(h, nursery, wids[2])
        await close(s2)
        await close(s3)


async def test_max_sse_connections_order_401_before_429(nursery, autojump_clock):
    cfg = make_config(limits={"max_sse_connections": 1}, auth={"api_keys": ("k1", "k2")})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.post("/v0/topics/a", json={"records": [{"data": 1}]}, headers=bearer("k1"))
        w1 = await wid_of(client, {"topics": {"a": {}}}, headers=bearer("k1"))
        w2 = await wid_of(client, {"topics": {"a": {}}}, headers=bearer("k1"))
        s1 = await open_ok(h, nursery, w1, headers=bearer("k1"))
        await open_fail(h, nursery, w2, 401, "unauthorized", headers=bearer("k2"))
        await open_fail(h, nursery, w2, 429, "throttled", headers=bearer("k1"))
        await open_fail(
            h, nursery, "wid_AAAAAAAAAAAAAAAAAAAAAA", 404, "not_found", headers=bearer("k1")
        )
        await close(s1)


async def test_max_sse_connections_per_key_edge(nursery, autojump_clock):
    cfg = make_config(limits={"max_sse_connections_per_key": 2}, auth={"api_keys": ("k1", "k2")})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await client.post("/v0/topics/a", json={"records": [{"data": 1}]}, headers=bearer("k1"))
        w = [await wid_of(client, {"topics": {"a": {}}}, headers=bearer("k1")) for _ in range(3)]
        other = await wid_of(client, {"topics": {"a": {}}}, headers=bearer("k2"))
        s1 = await open_ok(h, nursery, w[0], headers=bearer("k1"))
        s2 = await open_ok(h, nursery, w[1], query="token=k1")
        err = await open_fail(h, nursery, w[2], 429, "throttled", headers=bearer("k1"))
        assert err["detail"] == {"limit": "max_sse_connections_per_key", "max": 2}
        s3 = await open_ok(h, nursery, other, headers=bearer("k2"))  # another key's budget
        await close(s2)
        s4 = await open_ok(h, nursery, w[2], headers=bearer("k1"))
        for s in (s1, s3, s4):
            await close(s)


async def test_per_key_cap_not_applied_in_dev_mode(nursery, autojump_clock):
    async with open_app(make_config(limits={"max_sse_connections_per_key": 1})) as h:
        client = h.app.test_client()
        await write_n(client, "a", 1)
        streams = [
            await open_ok(h, nursery, await wid_of(client, {"topics": {"a": {}}})) for _ in range(3)
        ]
        for s in streams:
            await close(s)


async def test_refused_stream_429_retry_after(nursery, autojump_clock):
    async with open_app(make_config(limits={"max_sse_connections": 1})) as h:
        client = h.app.test_client()
        await write_n(client, "a", 1)
        w1 = await wid_of(client, {"topics": {"a": {}}})
        w2 = await wid_of(client, {"topics": {"a": {}}})
        s1 = await open_ok(h, nursery, w1)
        s = await open_stream(nursery, h.app.asgi_app, w2)
        await s.wait_done()
        assert s.status == 429
        assert s.headers["retry-after"] == "1"
        await close(s1)


# ---- one stream per session ------------------------------------------------------------------


async def test_second_get_takes_over_with_409(harness, client, nursery, autojump_clock):
    await write_n(client, "a", 3)
    wid = await wid_of(client, {"topics": {"a": {}}})
    s1 = await open_ok(harness, nursery, wid)
    frames = await read(s1, 2)
    assert frames[1] == ("caught-up", {"a": 3}, {"topic": "a", "head_seq": 3})
    s2 = await open_ok(harness, nursery, wid)
    (event, id_, data) = (await read(s1, 1))[0]
    assert event == "error"
    assert id_ is None and s1.parser.frames[-1].id is None
    assert set(data) == {"code", "error", "message"}
    assert data["code"] == 409
    assert data["error"] == data["message"] and isinstance(data["message"], str)
    await ends(s1)
    # the newer stream resumes after what the first one wrote: no duplicate
    assert await read(s2, 1) == [("caught-up", {"a": 3}, {"topic": "a", "head_seq": 3})]
    await write_n(client, "a", 1)
    frames = await read(s2, 1)
    assert frames[0][0] == "record" and frames[0][1] == {"a": 4}
    assert frames[0][2]["from_seq"] == 3
    await close(s2)


async def test_takeover_at_the_connection_cap(nursery, autojump_clock):
    async with open_app(make_config(limits={"max_sse_connections": 1})) as h:
        client = h.app.test_client()
        await write_n(client, "a", 1)
        wid = await wid_of(client, {"topics": {"a": {}}})
        s1 = await open_ok(h, nursery, wid)
        s2 = await open_ok(h, nursery, wid)  # replaces s1: not a second connection
        assert (await read_until_event(s1, "error"))[-1][2]["code"] == 409
        await ends(s1)
        await close(s2)


# ---- session lifetime (§2.8) -----------------------------------------------------------------


async def test_idle_session_is_reclaimed_after_ttl(harness, client, nursery, autojump_clock):
    await write_n(client, "a", 1)
    wid = await wid_of(client, {"topics": {"a": {}}})
    autojump_clock.jump(299.99)
    s = await open_ok(harness, nursery, wid)  # still alive; the open is a use
    await close(s)
    autojump_clock.jump(299.99)
    s = await open_ok(harness, nursery, wid)  # the close was a use too
    await close(s)
    autojump_clock.jump(300.01)
    await open_fail(harness, nursery, wid, 404, "not_found")


async def test_reclaim_counts_from_stream_close(harness, client, nursery, autojump_clock):
    await write_n(client, "a", 1)
    wid = await wid_of(client, {"topics": {"a": {}}, "heartbeat_ms": 60000})
    autojump_clock.jump(200)
    s = await open_ok(harness, nursery, wid)
    await read(s, 2)  # record, caught-up
    # keep the stream open (reading its heartbeats) for 4 minutes of virtual time
    for _ in range(4):
        assert await read(s, 1, within=61) == [("hb", None, None)]
    await close(s)
    autojump_clock.jump(299.99)
    s = await open_ok(harness, nursery, wid)
    await close(s)
    autojump_clock.jump(300.01)
    await open_fail(harness, nursery, wid, 404, "not_found")


async def test_session_with_open_stream_is_never_reclaimed(nursery, autojump_clock):
    async with open_app(make_config(limits={"max_watch_sessions": 1})) as h:
        client = h.app.test_client()
        await write_n(client, "a", 1)
        wid = await wid_of(client, {"topics": {"a": {}}, "heartbeat_ms": 60000})
        s = await open_ok(h, nursery, wid)
        assert (await read(s, 2))[1] == ("caught-up", {"a": 1}, {"topic": "a", "head_seq": 1})
        for _ in range(11):  # 11 minutes of virtual time, the client reading heartbeats
            assert await read(s, 1, within=61) == [("hb", None, None)]
        # the POST reclaims idle sessions first: this one is not idle, so the cap holds
        r = await client.post("/v0/watch", json={"topics": {"a": {}}})
        assert r.status_code == 429, await r.get_data()
        await write_n(client, "a", 1)
        frames = await read(s, 1)
        assert frames[0][0] == "record" and frames[0][1] == {"a": 2}
        await close(s)
        s = await open_ok(h, nursery, wid)  # the session survived
        assert await read(s, 1) == [("caught-up", {"a": 2}, {"topic": "a", "head_seq": 2})]
        await close(s)


async def test_reclaimed_session_is_404_even_with_rewind(harness, client, nursery, autojump_clock):
    await write_n(client, "a", 1)
    wid = await wid_of(client, {"topics": {"a": {}}})
    autojump_clock.jump(301)
    await open_fail(
        harness, nursery, wid, 404, "not_found", headers={"Last-Event-ID": "eyJhIjowfQ"}
    )


async def test_session_exactly_ttl_old_is_not_reclaimed(harness, client, nursery, autojump_clock):
    # §2.8: reclaimed when the last use is *older than* the TTL; at exactly 300000 ms it
    # is not older yet. (Guarded so virtual-time float arithmetic is exact.)
    await write_n(client, "a", 1)
    before = trio.current_time()
    wid = await wid_of(client, {"topics": {"a": {}}})
    assert trio.current_time() == before
    assert (before + 300.0) - before == 300.0
    autojump_clock.jump(300.0)
    s = await open_ok(harness, nursery, wid)
    await close(s)


# ---- methods (README §1) -------------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
async def test_wrong_method_on_the_stream_path_is_405(client, method):
    await write_n(client, "a", 1)
    wid = await wid_of(client, {"topics": {"a": {}}})
    r = await client.open(f"/v0/watch/{wid}", method=method)
    await fail(r, 405, "method_not_allowed")
    assert "GET" in [m.strip() for m in r.headers["Allow"].split(",")]


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_wrong_method_on_the_create_path_is_405(client, method):
    r = await client.open("/v0/watch", method=method)
    await fail(r, 405, "method_not_allowed")
    assert "POST" in [m.strip() for m in r.headers["Allow"].split(",")]
