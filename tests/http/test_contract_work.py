"""Contract tests for `GET /v0/topics/:q/work`, the push-worker stream.

Method: black-box on an in-process app. The stream is driven over raw ASGI by
`topicd.testing.sse.open_sse` (a body channel of capacity 0: a test that stops reading is
a client that stops reading); acks, nacks and state go through Quart's test client.
Every test takes `autojump_clock`, so waits are virtual: a frame that must come from an
event (an append, an ack, a disconnect) is asserted to arrive with no virtual time
passing, and timed rules (heartbeat, lease expiry) at their exact virtual times. Each
test is named for the rule it proves.
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

import pytest
import trio

from tests.http.test_contract_queues import make_queue, produce
from topicd.testing.harness import make_config, open_app
from topicd.testing.sse import AsgiStream, open_sse

ITEM_KEYS = ["topic", "$seq", "lease_id", "deadline", "$ts", "$tag", "$priority", "deliveries"]


async def op(client, verb: str, name: str = "q", node: str = "w1", **kw) -> dict:
    r = await client.post(f"/v0/topics/{name}/{verb}", json={"node": node, **kw})
    raw = await r.get_data()
    assert r.status_code == 200, raw
    return json.loads(raw)


async def state(client, name: str = "q") -> dict:
    r = await client.get(f"/v0/topics/{name}")
    return (await r.get_json())["queue"]


async def open_work(h, nursery, name: str = "q", *, headers=None, **params) -> AsgiStream:
    query = urlencode({k: v for k, v in params.items() if v is not None})
    return await open_sse(
        nursery, h.app.asgi_app, f"/v0/topics/{name}/work", headers=headers, query=query
    )


async def open_ok(h, nursery, name: str = "q", **params) -> AsgiStream:
    """Open the stream: `200`, SSE headers, then `retry: 2000` and the first `: hb`."""
    s = await open_work(h, nursery, name, **params)
    assert s.status == 200, s.body
    assert s.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert s.headers["cache-control"] == "no-store"
    assert s.headers["x-accel-buffering"] == "no"
    first = await s.read_frames(2)
    assert first[0].retry == 2000 and first[1].heartbeat, first
    return s


async def open_fail(h, nursery, status: int, code: str, name: str = "q", **kw) -> dict:
    s = await open_work(h, nursery, name, **kw)
    await s.wait_done()
    assert s.status == status, (s.status, s.body)
    err = s.error_body["error"]
    assert err["code"] == code, err
    return err


async def jobs(s: AsgiStream, n: int) -> list[dict]:
    """The next `n` frames, each asserted to be a `job` frame."""
    with trio.fail_after(60):
        frames = await s.read_frames(n)
    assert len(frames) == n, frames
    for f in frames:
        assert f.event == "job", f
        assert f.id == str(f.data["$seq"])
    return [f.data for f in frames]


async def silent(s: AsgiStream, seconds: float) -> None:
    frames = await s.read_frames(1, timeout=seconds)
    assert frames == [], frames


@pytest.fixture
async def h():
    async with open_app() as harness:
        await make_queue(harness.app.test_client())
        yield harness


# ---- the stream ---------------------------------------------------------------------------


async def test_jobs_are_pushed_up_to_max_in_claim_order(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "q", {"data": {"n": 1}, "tag": "a"}, 2, {"data": 3, "priority": 5}, 4)
    t0 = trio.current_time()
    s = await open_ok(h, nursery, node="w1", max=2)
    got = await jobs(s, 2)
    assert [j["$seq"] for j in got] == [3, 1]
    assert list(got[0]) == [k for k in ITEM_KEYS if k != "$tag"] + ["data"]
    assert list(got[1]) == [k for k in ITEM_KEYS if k != "$priority"] + ["data"]
    assert got[0]["topic"] == "q" and got[0]["$priority"] == 5 and got[0]["deliveries"] == 1
    assert got[1]["$tag"] == "a" and got[1]["data"] == {"n": 1}
    await silent(s, 1.0)  # depth 2 reached: nothing more while both are held
    assert await state(c) == {"ready": 2, "in_flight": 2, "dead_lettered": 0}
    t1 = trio.current_time()
    await op(c, "ack", seqs=[3], lease_ids=[got[0]["lease_id"]])
    (nxt,) = await jobs(s, 1)
    assert nxt["$seq"] == 2
    assert trio.current_time() == t1  # the ack freed depth: pushed at once, no poll
    assert t1 - t0 == 1.0


async def test_an_append_wakes_an_idle_stream_at_once(h, nursery, autojump_clock):
    c = h.app.test_client()
    s = await open_ok(h, nursery, node="w1", max=4)
    await silent(s, 3.0)
    t0 = trio.current_time()
    await produce(c, "q", "a", "b")
    got = await jobs(s, 2)
    assert [j["data"] for j in got] == ["a", "b"]
    assert trio.current_time() == t0


async def test_nack_frees_depth_and_the_job_comes_back(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "q", "a")
    s = await open_ok(h, nursery, node="w1")
    (job,) = await jobs(s, 1)
    t0 = trio.current_time()
    await op(c, "nack", seqs=[job["$seq"]])
    (again,) = await jobs(s, 1)
    assert (again["$seq"], again["deliveries"]) == (job["$seq"], 2)
    assert again["lease_id"] != job["lease_id"]
    assert trio.current_time() == t0


async def test_an_expired_lease_frees_depth_at_its_deadline(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "q", "a", "b")
    t0 = trio.current_time()
    s = await open_ok(h, nursery, node="w1", max=1, lease_ms=1000)
    (job,) = await jobs(s, 1)
    assert job["deadline"] == job["$ts"] + 1000
    frames = await s.read_frames(1, timeout=5)
    assert frames[0].event == "job" and frames[0].data["$seq"] == 1
    assert frames[0].data["deliveries"] == 2  # the expired job first (lower seq), again
    assert trio.current_time() - t0 == pytest.approx(1.001)
    s.disconnect()


async def test_heartbeat_after_work_heartbeat_ms_of_silence(nursery, autojump_clock):
    async with open_app(make_config(queue={"work_heartbeat_ms": 4000})) as h:
        await make_queue(h.app.test_client())
        t0 = trio.current_time()
        s = await open_ok(h, nursery, node="w1")
        (hb,) = await s.read_frames(1)
        assert hb.heartbeat
        assert trio.current_time() - t0 == pytest.approx(4.0)
        await produce(h.app.test_client(), "q", "a")
        await jobs(s, 1)
        t1 = trio.current_time()
        (hb,) = await s.read_frames(1)
        assert hb.heartbeat
        assert trio.current_time() - t1 == pytest.approx(4.0)  # counted from the last write
        s.disconnect()


async def test_disconnect_releases_the_streams_leases_at_once(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "q", "a", "b", "c", "d")
    claimed = await op(c, "claim", node="w1", max=1)  # the same node, through /claim
    s = await open_ok(h, nursery, node="w1", max=2)
    await jobs(s, 2)
    assert await state(c) == {"ready": 1, "in_flight": 3, "dead_lettered": 0}
    t0 = trio.current_time()
    s.disconnect()
    await s.wait_done()
    assert trio.current_time() == t0
    # claimable at once, delivery counts kept; the /claim lease is untouched
    assert await state(c) == {"ready": 3, "in_flight": 1, "dead_lettered": 0}
    again = await op(c, "claim", node="w2", max=3)
    assert [(j["$seq"], j["deliveries"]) for j in again["claimed"]] == [(2, 2), (3, 2), (4, 1)]
    seq = claimed["claimed"][0]["$seq"]
    acked = await op(c, "ack", seqs=[seq], lease_ids=[claimed["claimed"][0]["lease_id"]])
    assert acked["acked"] == 1


async def test_a_pushed_job_is_acked_with_its_lease_id(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "q", "a")
    s = await open_ok(h, nursery, node="w1")
    (job,) = await jobs(s, 1)
    res = await op(c, "ack", node="w2", seqs=[job["$seq"]])
    assert res["skipped"] == [job["$seq"]]  # held by w1, not w2
    res = await op(c, "ack", seqs=[job["$seq"]], lease_ids=[job["lease_id"]])
    assert (res["acked"], res["ready"], res["in_flight"]) == (1, 0, 0)
    s.disconnect()


async def test_topic_deleted_ends_the_stream_with_a_409_error_frame(h, nursery, autojump_clock):
    c = h.app.test_client()
    s = await open_ok(h, nursery, node="w1")
    r = await c.delete("/v0/topics/q")
    assert r.status_code == 200
    (f,) = await s.read_frames(1)
    assert f.event == "error" and f.id is None
    assert f.data["code"] == 409 and f.data["topic"] == "q"
    assert f.data["error"] == "topic is no longer a queue"
    await s.read_frames(1)
    assert s.ended


async def test_shutdown_ends_the_stream_and_releases_its_leases(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "q", "a")
    s = await open_ok(h, nursery, node="w1")
    await jobs(s, 1)
    h.engine.begin_drain()
    (f,) = await s.read_frames(1)
    assert f.event == "error"
    assert f.data["code"] == "server_shutting_down" and f.data["topic"] == "q"
    await s.wait_done()
    topic = h.engine.topics["q"]
    assert h.engine.queues.counts(topic).ready == 1


async def test_max_is_clamped_and_unparsable_max_is_one(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "q", *range(5))
    s = await open_ok(h, nursery, node="w1", max="many")
    await jobs(s, 1)
    await silent(s, 1.0)
    s.disconnect()
    await s.wait_done()
    s = await open_ok(h, nursery, node="w1", max="0")
    await jobs(s, 1)
    await silent(s, 1.0)
    s.disconnect()
    await s.wait_done()
    s = await open_ok(h, nursery, node="w1", max="5000")
    await jobs(s, 5)
    s.disconnect()


async def test_lease_ms_is_clamped_like_a_claims(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "q", "a", "b")
    s = await open_ok(h, nursery, node="w1", max=2, lease_ms=5)
    got = await jobs(s, 2)
    assert [j["deadline"] - j["$ts"] for j in got] == [100, 100]  # queue.min_lease_ms
    s.disconnect()


async def test_work_streams_count_in_state_and_metrics(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "q", "a")
    s = await open_ok(h, nursery, node="w1")
    await jobs(s, 1)
    r = await c.get("/v0/metrics")
    text = (await r.get_data()).decode()
    assert "topics_sse_connections 1.0" in text
    assert "topics_queue_leases_in_flight 1.0" in text
    assert 'topics_topic_queue_in_flight{topic="q"} 1.0' in text
    assert 'topicd_jobs_work_streams{topic="q"} 1.0' in text
    r = await c.get("/v0/metrics", headers={"Accept": "application/json"})
    snap = await r.get_json()
    assert snap["sse_connections"] == 1 and snap["queue_leases_in_flight"] == 1
    q = snap["queues"]["q"]
    assert (q["in_flight"], q["work_streams"]) == (1, 1)
    assert q["last_claim_ms"] == h.clock.now_ms()
    s.disconnect()
    await s.wait_done()
    snap = await (await c.get("/v0/metrics", headers={"Accept": "application/json"})).get_json()
    assert (snap["sse_connections"], snap["queues"]["q"]["work_streams"]) == (0, 0)


# ---- establishment ------------------------------------------------------------------------


async def test_establishment_errors_in_order(h, nursery, autojump_clock):
    c = h.app.test_client()
    await produce(c, "log", "x")
    json_only = {"Accept": "application/json"}
    await open_fail(h, nursery, 406, "not_acceptable", "nope", headers=json_only)  # 406 first
    await open_fail(h, nursery, 400, "invalid_request", "nope")  # no node: before the 404
    await open_fail(h, nursery, 400, "invalid_request", node="")
    await open_fail(h, nursery, 400, "invalid_request", node="n" * 129)
    s = await open_ok(h, nursery, node="n" * 128)
    s.disconnect()
    await open_fail(h, nursery, 404, "topic_not_found", "nope", node="w1")
    err = await open_fail(h, nursery, 409, "not_a_queue", "log", node="w1")
    assert err["detail"] == {"topic": "log"}


async def test_accept_event_stream_absent_or_any_is_accepted(h, nursery, autojump_clock):
    for accept in ("text/event-stream", "*/*", None):
        s = await open_work(h, nursery, node="w1", headers={"Accept": accept} if accept else None)
        assert s.status == 200
        s.disconnect()
        await s.wait_done()


async def test_the_sse_caps_count_work_streams(nursery, autojump_clock):
    async with open_app(make_config(limits={"max_sse_connections": 1})) as h:
        c = h.app.test_client()
        await make_queue(c)
        s = await open_ok(h, nursery, node="w1")
        err = await open_fail(h, nursery, 429, "throttled", node="w2")
        assert err["detail"] == {"limit": "max_sse_connections", "max": 1}
        r = await c.post("/v0/watch", json={"topics": {"q": {}}})
        wid = (await r.get_json())["wid"]
        w = await open_sse(nursery, h.app.asgi_app, f"/v0/watch/{wid}")
        await w.wait_done()
        assert w.status == 429
        s.disconnect()
        await s.wait_done()
        s = await open_ok(h, nursery, node="w2")  # the slot came back
        s.disconnect()


async def test_other_methods_are_405_allow_get(h):
    c = h.app.test_client()
    r = await c.post("/v0/topics/q/work", json={})
    assert r.status_code == 405
    assert "GET" in r.headers["Allow"].split(", ")


KEYS = ("full", "rd:r", "rw:rw", "pre:rw:tenant.")


async def test_auth_header_or_token_and_read_plus_write(nursery, autojump_clock):
    async with open_app(make_config(auth={"api_keys": KEYS})) as h:
        c = h.app.test_client()
        r = await c.put(
            "/v0/topics/q", json={"type": "queue"}, headers={"Authorization": "Bearer full"}
        )
        assert r.status_code == 201
        await open_fail(h, nursery, 401, "unauthorized", node="w1")
        await open_fail(h, nursery, 401, "unauthorized", node="w1", token="nope")
        bad = {"Authorization": "Bearer nope"}
        # the header wins over the token
        await open_fail(h, nursery, 401, "unauthorized", node="w1", token="full", headers=bad)
        await open_fail(h, nursery, 403, "forbidden", node="w1", token="rd")
        await open_fail(h, nursery, 403, "forbidden", node="w1", token="pre")
        for kw in ({"token": "rw"}, {"headers": {"Authorization": "Bearer full"}}):
            s = await open_work(h, nursery, node="w1", **kw)
            assert s.status == 200, s.body
            s.disconnect()
            await s.wait_done()


async def test_pacing_advice_is_an_error_frame_and_the_stream_stays(h, nursery, autojump_clock):
    c = h.app.test_client()
    s = await open_ok(h, nursery, node="w1")
    dropped = h.engine.queues.advise(1500)
    assert dropped == 0
    assert h.engine.queues.advise(1500) == 1  # one pending per stream: the next is dropped
    (f,) = await s.read_frames(1)
    assert f.event == "error"
    assert (f.data["code"], f.data["retry_after_ms"], f.data["topic"]) == (429, 1500, "q")
    await produce(c, "q", "a")
    await jobs(s, 1)  # still open
    s.disconnect()
