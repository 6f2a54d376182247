"""Contract tests for the operator dashboard: `GET /_topicd/dashboard` and its feed.

Method: black-box on an in-process app. The feed is driven over raw ASGI by
`topicd.testing.sse.open_sse` (a body channel of capacity 0: a test that stops reading is
a viewer that stops reading); writes, claims and watch sessions go through Quart's test
client. Every test takes `autojump_clock`, so the feed's cadence is asserted at exact
virtual times. Each test is named for the rule it proves.
"""

from __future__ import annotations

import re

import trio

from tests.http.test_contract_queues import make_queue, produce
from topicd.config import Config
from topicd.http.dashboard import DashboardHub, Slot, zone
from topicd.testing.fake_clock import advance
from topicd.testing.harness import make_config, open_app
from topicd.testing.sse import AsgiStream, open_sse

FEED = "/_topicd/dashboard/events"
PAGE = "/_topicd/dashboard"


def dash(**fields) -> Config:
    return make_config(dashboard=fields)


async def open_feed(h, nursery, path: str = FEED, **kw) -> AsgiStream:
    return await open_sse(nursery, h.app.asgi_app, path, **kw)


async def open_ok(h, nursery, **kw) -> tuple[AsgiStream, dict]:
    """Open the feed: `200`, SSE headers, then `retry:` and the `hello` frame."""
    s = await open_feed(h, nursery, **kw)
    assert s.status == 200, s.body
    assert s.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert s.headers["cache-control"] == "no-store"
    (hello,) = await s.read_frames(1)
    assert hello.event == "hello" and hello.retry == 2000, hello
    return s, hello.data


async def snapshot(s: AsgiStream) -> dict:
    (f,) = await s.read_frames(1)
    assert f.event == "snapshot", f
    return f.data


async def refused(h, nursery, status: int, code: str, **kw) -> dict:
    s = await open_feed(h, nursery, **kw)
    await s.wait_done()
    assert s.status == status, (s.status, s.body)
    err = s.error_body["error"]
    assert err["code"] == code, err
    return err


def hub_of(h) -> DashboardHub:
    gate = h.app.asgi_app
    assert gate.dashboard is not None
    return gate.dashboard


# --------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------


async def test_page_is_one_self_contained_html_document(autojump_clock):
    async with open_app() as h:
        r = await h.app.test_client().get(PAGE)
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/html; charset=utf-8"
        assert "connect-src 'self'" in r.headers["content-security-policy"]
        html = (await r.get_data()).decode()
        assert html.startswith("<!doctype html>")
        # no external asset: no URL with a scheme, no <link>, no script or image source
        assert not re.search(r"\b(https?:)?//[a-z]", html, re.I), "an external URL"
        refs = re.findall(r"""\b(?:src|href)\s*=\s*["']([^"']*)""", html)
        assert refs == ["data:,"], refs  # the icon only: no browser request for one
        assert "@import" not in html and "url(" not in html
        assert "<script>" in html and "<style>" in html and "<canvas" in html
        # no threshold is written into the page: the feed carries them
        assert "0.4" not in html and "0.8" not in html and "10000" not in html


async def test_page_head_and_other_methods(autojump_clock):
    async with open_app() as h:
        c = h.app.test_client()
        assert (await c.head(PAGE)).status_code == 200
        r = await c.post(PAGE, json={})
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
        r = await c.post(FEED, json={})
        assert r.status_code == 405
        assert (await r.get_json())["error"]["code"] == "method_not_allowed"
        assert "GET" in r.headers["allow"]


# --------------------------------------------------------------------------------------
# The feed: live, at the configured interval
# --------------------------------------------------------------------------------------


async def test_first_viewer_gets_a_snapshot_at_once_then_one_per_interval(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        t0 = trio.current_time()
        s, hello = await open_ok(h, n)
        assert hello["history"] == []
        assert hello["history_span_ms"] == 300000
        assert hello["thresholds"]["interval_ms"] == 1000
        assert hello["thresholds"]["stale_after_ms"] == 3000
        first = await snapshot(s)
        assert trio.current_time() == t0
        second = await snapshot(s)
        assert trio.current_time() - t0 == 1.0
        assert second["server_time_ms"] - first["server_time_ms"] == 1000
        await snapshot(s)
        assert trio.current_time() - t0 == 2.0
        s.disconnect()


async def test_interval_ms_sets_the_cadence(autojump_clock):
    async with open_app(dash(interval_ms=250)) as h, trio.open_nursery() as n:
        s, hello = await open_ok(h, n)
        assert hello["thresholds"]["stale_after_ms"] == 750
        t0 = trio.current_time()
        await snapshot(s)
        for i in range(1, 4):
            await snapshot(s)
            assert trio.current_time() - t0 == 0.25 * i
        s.disconnect()


async def test_numbers_are_live_not_page_load(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        c = h.app.test_client()
        s, _ = await open_ok(h, n)
        before = await snapshot(s)
        await produce(c, "t", 1, 2, 3)
        after = await snapshot(s)
        appended = after["throughput"]["records_appended"]
        assert appended - before["throughput"]["records_appended"] == 3
        assert after["throughput"]["records_per_s"] == 3.0  # 3 records in the 1 s interval
        assert after["point"][2] == 3.0
        s.disconnect()


async def test_snapshot_fields(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        c = h.app.test_client()
        await make_queue(c, "jobs")
        await produce(c, "jobs", 1)
        s, _ = await open_ok(h, n)
        snap = await snapshot(s)
        assert snap["status"] in ("green", "amber", "red")
        assert snap["server_time_ms"] == h.clock.now_ms()
        assert snap["phase"] == "serving"
        p = snap["pressure"]
        assert p["value"] == 0.0 and p["zone"] == "green"
        assert set(p["signals"]) >= {"depth", "latency", "pool"}
        assert p["throttle_at"] == 0.98
        assert set(snap["ladder"]) == {
            "coalesce_ms",
            "commit_window_ms",
            "defer_active",
            "loop_lag_ms",
            "sched_latency_ms",
        }
        assert snap["ladder"]["defer_active"] is False
        assert snap["breakers"] == []  # in-memory engine: no WAL shards
        names = {q["name"] for q in snap["internal_queues"]}
        assert {"client_permits", "client_waiters", "sse_channel", "dashboard_viewers"} <= names
        viewers = next(q for q in snap["internal_queues"] if q["name"] == "dashboard_viewers")
        assert (viewers["depth"], viewers["capacity"], viewers["zone"]) == (1, 16, "green")
        (q,) = snap["queues"]["top"]
        assert q["topic"] == "jobs"
        assert (q["ready"], q["in_flight"], q["delayed"], q["dead_lettered"]) == (1, 0, 0, 0)
        assert q["worker"] == "idle" and q["zone"] == "green"
        assert snap["topics"] == {"count": 1, "top": []}  # nobody reads `jobs` by cursor
        assert snap["routers"] == {"count": 0, "top": []}
        assert snap["connections"]["dashboard_viewers"] == 1
        assert snap["connections"]["sse"] == 1
        assert snap["thresholds"] == {
            "pressure": {"warn": 0.4, "pause": 0.8},
            "lag": {"warn": 1000, "pause": 10000},
            "inflight": {"warn": 50, "pause": 200},
            "worker_stale_ms": 10000,
            "interval_ms": 1000,
            "stale_after_ms": 3000,
        }
        s.disconnect()


async def test_thresholds_come_from_config(autojump_clock):
    cfg = dash(
        pressure_warn=0.1,
        pressure_pause=0.2,
        lag_warn=3,
        lag_pause=4,
        inflight_warn=5,
        inflight_pause=6,
        worker_stale_ms=700,
        stale_after_intervals=5,
    )
    async with open_app(cfg) as h, trio.open_nursery() as n:
        s, hello = await open_ok(h, n)
        assert hello["thresholds"] == {
            "pressure": {"warn": 0.1, "pause": 0.2},
            "lag": {"warn": 3, "pause": 4},
            "inflight": {"warn": 5, "pause": 6},
            "worker_stale_ms": 700,
            "interval_ms": 1000,
            "stale_after_ms": 5000,
        }
        s.disconnect()


def test_zone_edges():
    assert zone(0.39, 0.4, 0.8) == "green"
    assert zone(0.4, 0.4, 0.8) == "amber"
    assert zone(0.79, 0.4, 0.8) == "amber"
    assert zone(0.8, 0.4, 0.8) == "red"


async def test_pressure_zone_follows_the_governor(autojump_clock):
    async with open_app() as h:
        hub = hub_of(h)
        for value, expect in ((0.39, "green"), (0.4, "amber"), (0.8, "red")):
            h.engine.pressure = value  # what the governor publishes (no checkpoint between)
            snap = hub.snapshot()
            assert snap["pressure"]["value"] == value
            assert snap["pressure"]["zone"] == expect
            assert snap["status"] == expect


async def test_topic_lag_is_head_minus_the_slowest_cursor(autojump_clock):
    async with open_app(dash(lag_warn=5, lag_pause=20)) as h, trio.open_nursery() as n:
        c = h.app.test_client()
        await produce(c, "t", 0)
        r = await c.post("/v0/watch", json={"topics": {"t": {"from_seq": 1}}})
        assert r.status_code == 200, await r.get_data()
        r = await c.post("/v0/watch", json={"topics": {"t": {"from_seq": 0}}})
        assert r.status_code == 200
        s, _ = await open_ok(h, n)
        (row,) = (await snapshot(s))["topics"]["top"]
        assert row == {
            "topic": "t",
            "head_seq": 1,
            "lag": 1,
            "readers": 2,
            "lagged_connections": 0,
            "zone": "green",
        }
        await produce(c, "t", *range(4))  # head 5: lag 5 = warn
        (row,) = (await snapshot(s))["topics"]["top"]
        assert (row["lag"], row["zone"]) == (5, "amber")
        await produce(c, "t", *range(15))  # head 20: lag 20 = pause
        snap = await snapshot(s)
        (row,) = snap["topics"]["top"]
        assert (row["lag"], row["zone"], snap["status"]) == (20, "red", "red")
        s.disconnect()


async def test_top_n_ranks_topics_by_lag(autojump_clock):
    async with open_app(dash(top_n=2)) as h, trio.open_nursery() as n:
        c = h.app.test_client()
        for name, count in (("a", 1), ("b", 3), ("c", 2)):
            await produce(c, name, 0)
            await c.post("/v0/watch", json={"topics": {name: {"from_seq": 1}}})
            await produce(c, name, *range(count))
        s, _ = await open_ok(h, n)
        top = (await snapshot(s))["topics"]["top"]
        assert [(t["topic"], t["lag"]) for t in top] == [("b", 3), ("c", 2)]
        s.disconnect()


async def test_router_lag_counts_and_is_listed(autojump_clock):
    async with open_app(dash(lag_warn=2, lag_pause=5)) as h, trio.open_nursery() as n:
        c = h.app.test_client()
        await produce(c, "src", 0)
        r = await c.put("/v0/topics/dst", json={"cap_records": 1, "discard": "reject"})
        assert r.status_code == 201
        r = await c.put("/v0/routers/src->dst", json={"source": "src", "dest": "dst"})
        assert r.status_code == 201, await r.get_data()
        s, _ = await open_ok(h, n)
        await snapshot(s)
        appended = h.engine.records_appended
        await produce(c, "src", 1, 2, 3)  # dst takes one copy, then is full: the router waits
        await snapshot(s)
        snap = await snapshot(s)
        (router,) = snap["routers"]["top"]
        assert {k: router[k] for k in ("router", "source", "dest", "lag", "blocked", "zone")} == {
            "router": "src->dst",
            "source": "src",
            "dest": "dst",
            "lag": 2,
            "blocked": True,
            "zone": "amber",
        }
        assert router["cursor"] == 2
        # the router reads `src` by cursor: its lag is the topic's
        (topic,) = snap["topics"]["top"]
        assert (topic["topic"], topic["lag"], topic["readers"]) == ("src", 2, 1)
        # writes and router copies both count: 3 written, 1 copied
        assert snap["throughput"]["records_appended"] - appended == 4
        s.disconnect()


async def test_worker_state_streaming_active_off_idle(autojump_clock):
    async with open_app(dash(worker_stale_ms=1500)) as h, trio.open_nursery() as n:
        c = h.app.test_client()
        await make_queue(c, "q")
        s, _ = await open_ok(h, n)

        async def state() -> str:
            (q,) = (await snapshot(s))["queues"]["top"]
            return q["worker"]

        assert await state() == "idle"  # t=0: empty, nothing to do
        await produce(c, "q", 1)
        assert await state() == "idle"  # t=1: a job, but the queue began 1 s ago: too soon
        assert await state() == "off"  # t=2: a job and no claim for 1.5 s
        r = await c.post("/v0/topics/q/claim", json={"node": "w1"})
        assert r.status_code == 200
        assert await state() == "active"  # t=3: the claim was 1 s ago
        assert await state() == "off"  # t=4: leased, but no claim/extend/ack/nack for 2 s
        w = await open_sse(n, h.app.asgi_app, "/v0/topics/q/work", query="node=w2")
        assert w.status == 200
        (q,) = (await snapshot(s))["queues"]["top"]
        assert (q["worker"], q["work_streams"]) == ("streaming", 1)
        w.disconnect()
        s.disconnect()


async def test_queue_in_flight_zones(autojump_clock):
    async with open_app(dash(inflight_warn=2, inflight_pause=3)) as h, trio.open_nursery() as n:
        c = h.app.test_client()
        await make_queue(c, "q")
        await produce(c, "q", 1, 2, 3, 4)
        s, _ = await open_ok(h, n)
        await snapshot(s)
        zones = []
        for _ in range(3):
            r = await c.post("/v0/topics/q/claim", json={"node": "w1"})
            assert r.status_code == 200
            (q,) = (await snapshot(s))["queues"]["top"]
            zones.append((q["in_flight"], q["zone"]))
        assert zones == [(1, "green"), (2, "amber"), (3, "red")]
        s.disconnect()


# --------------------------------------------------------------------------------------
# One publisher, latest-wins slots, viewer caps
# --------------------------------------------------------------------------------------


async def test_one_snapshot_serves_every_viewer(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        hub = hub_of(h)
        viewers = [(await open_ok(h, n))[0] for _ in range(3)]
        t0 = trio.current_time()
        for i in range(3):
            got = [await snapshot(v) for v in viewers]
            assert got[0] == got[1] == got[2]
            assert trio.current_time() - t0 == i
        assert hub.published == 3  # one build per interval, not one per viewer
        assert hub.dropped == 0
        for v in viewers:
            v.disconnect()


async def test_nothing_is_built_without_a_viewer(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        hub = hub_of(h)
        await advance(autojump_clock, 10)
        assert hub.published == 0
        s, _ = await open_ok(h, n)
        await snapshot(s)
        s.disconnect()
        await s.wait_done()
        published = hub.published
        await advance(autojump_clock, 10)
        assert hub.published == published
        assert hub.viewers == {}
        assert h.engine.watch.sse_connections() == 0


async def test_a_new_viewer_gets_the_chart_history(autojump_clock):
    async with open_app(dash(history_points=10)) as h, trio.open_nursery() as n:
        a, _ = await open_ok(h, n)
        points = [(await snapshot(a))["point"] for _ in range(12)]
        b, hello = await open_ok(h, n)
        assert hello["history"] == points[-10:]  # bounded by history_points
        assert hello["history_span_ms"] == 10 * 1000
        a.disconnect()
        b.disconnect()


async def test_the_cadence_survives_the_publishing_viewer_leaving(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        a, _ = await open_ok(h, n)  # a's task holds the publisher seat
        t0 = trio.current_time()
        await snapshot(a)
        b, _ = await open_ok(h, n)
        assert (await snapshot(b))["server_time_ms"] == h.clock.now_ms()  # the latest, at once
        a.disconnect()
        await a.wait_done()
        await snapshot(b)
        assert trio.current_time() - t0 == 1.0
        await snapshot(b)
        assert trio.current_time() - t0 == 2.0
        b.disconnect()


async def test_a_slow_viewer_gets_the_latest_snapshot_and_drops_are_counted(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        hub = hub_of(h)
        s, _ = await open_ok(h, n)
        await snapshot(s)
        t0 = trio.current_time()
        for step in (1, 1, 1, 1, 1, 0.5):  # s reads nothing meanwhile
            await advance(autojump_clock, step)
        # the pump holds the t0 + 1 snapshot in its blocked write; the slot kept only the
        # newest of the four built after it
        assert (await snapshot(s))["server_time_ms"] == h.clock.now_ms() - 4500
        assert (await snapshot(s))["server_time_ms"] == h.clock.now_ms() - 500
        assert trio.current_time() - t0 == 5.5
        assert hub.dropped == 3
        r = await h.app.test_client().get("/v0/metrics")
        text = (await r.get_data()).decode()
        assert 'topicd_dropped_total{kind="dashboard"} 3.0' in text
        s.disconnect()


def test_slot_is_latest_wins():
    slot = Slot()
    assert slot.put(b"1") is False
    assert slot.put(b"2") is True  # overwrote one never taken
    assert slot.item == b"2"


async def test_max_viewers_refuses_with_429_limit(autojump_clock):
    async with open_app(dash(max_viewers=2)) as h, trio.open_nursery() as n:
        a, _ = await open_ok(h, n)
        b, _ = await open_ok(h, n)
        err = await refused(h, n, 429, "throttled")
        assert err["detail"] == {"limit": "dashboard.max_viewers", "max": 2}
        a.disconnect()
        await a.wait_done()
        c, _ = await open_ok(h, n)
        b.disconnect()
        c.disconnect()


async def test_viewers_count_in_the_sse_caps(autojump_clock):
    async with open_app(make_config(limits={"max_sse_connections": 1})) as h:
        async with trio.open_nursery() as n:
            a, _ = await open_ok(h, n)
            assert h.engine.watch.sse_connections() == 1
            err = await refused(h, n, 429, "throttled")
            assert err["detail"] == {"limit": "max_sse_connections", "max": 1}
            a.disconnect()
        assert h.engine.watch.sse_connections() == 0


async def test_feed_refuses_other_media_types(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        await refused(h, n, 406, "not_acceptable", headers={"accept": "application/json"})


async def test_drain_ends_the_feed(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        s, _ = await open_ok(h, n)
        await snapshot(s)
        h.lifecycle.begin_drain()
        await s.wait_done()
        assert hub_of(h).viewers == {}
        await refused(h, n, 503, "shutting_down")


# --------------------------------------------------------------------------------------
# Auth, config
# --------------------------------------------------------------------------------------

KEYS = ("full", "reader:read", "writer:write")


async def test_page_needs_read_and_never_takes_a_token_query(autojump_clock):
    async with open_app(make_config(auth={"api_keys": KEYS})) as h:
        c = h.app.test_client()
        assert (await c.get(PAGE)).status_code == 401
        assert (await c.get(PAGE, query_string={"token": "reader"})).status_code == 401
        r = await c.get(PAGE, headers={"authorization": "Bearer writer"})
        assert r.status_code == 403
        assert (await r.get_json())["error"]["code"] == "forbidden"
        r = await c.get(PAGE, headers={"authorization": "Bearer reader"})
        assert r.status_code == 200


async def test_feed_needs_read_by_header_or_token_query(autojump_clock):
    async with open_app(make_config(auth={"api_keys": KEYS})) as h, trio.open_nursery() as n:
        await refused(h, n, 401, "unauthorized")
        await refused(h, n, 401, "unauthorized", query="token=nope")
        await refused(h, n, 403, "forbidden", query="token=writer")
        await refused(h, n, 403, "forbidden", headers={"authorization": "Bearer writer"})
        # the header wins over the query
        await refused(
            h, n, 403, "forbidden", headers={"authorization": "Bearer writer"}, query="token=full"
        )
        a, _ = await open_ok(h, n, query="token=reader")
        b, _ = await open_ok(h, n, headers={"authorization": "Bearer reader"})
        assert h.engine.watch.per_key  # counted against the key's SSE cap
        a.disconnect()
        b.disconnect()


async def test_disabled_dashboard_is_404(autojump_clock):
    async with open_app(dash(enabled=False)) as h, trio.open_nursery() as n:
        r = await h.app.test_client().get(PAGE)
        assert r.status_code == 404
        assert (await r.get_json())["error"]["code"] == "not_found"
        await refused(h, n, 404, "not_found")
        names = set(h.engine.saturation.queues)
        assert "dashboard_viewers" not in names


async def test_path_is_configurable(autojump_clock):
    async with open_app(dash(path="/ops/dash")) as h, trio.open_nursery() as n:
        c = h.app.test_client()
        assert (await c.get("/ops/dash")).status_code == 200
        assert (await c.get(PAGE)).status_code == 404
        s, _ = await open_ok(h, n, path="/ops/dash/events")
        await snapshot(s)
        s.disconnect()
        await refused(h, n, 404, "not_found")


async def test_dashboard_takes_no_client_permit(autojump_clock):
    cfg = make_config(classes={"client_permits": 1, "client_waiters": 0})
    async with open_app(cfg) as h, trio.open_nursery() as n:
        pool = h.app.asgi_app.permits
        held = await pool.admit()  # every permit taken, no waiter slot
        try:
            c = h.app.test_client()
            assert (await c.get("/v0/topics")).status_code == 429
            assert (await c.get(PAGE)).status_code == 200
            s, _ = await open_ok(h, n)
            await snapshot(s)
            s.disconnect()
        finally:
            held.release()


async def test_a_viewer_that_never_reads_is_closed_after_the_slow_consumer_timeout(autojump_clock):
    cfg = make_config(watch={"slow_consumer_timeout_ms": 5000})
    async with open_app(cfg) as h, trio.open_nursery() as n:
        s, _ = await open_ok(h, n)  # then stops reading: the next write blocks
        t0 = trio.current_time()
        await s.wait_done()
        assert trio.current_time() - t0 == 5.0  # the blocked write gave up at the timeout
        assert hub_of(h).viewers == {}
        assert h.engine.watch.sse_connections() == 0


async def test_head_of_the_feed_is_405(autojump_clock):
    async with open_app() as h:
        r = await h.app.test_client().head(FEED)
        assert r.status_code == 405


async def test_a_deleted_queue_leaves_and_a_recreated_one_is_new(autojump_clock):
    async with open_app() as h, trio.open_nursery() as n:
        c = h.app.test_client()
        await make_queue(c, "q")
        await produce(c, "q", 1, 2)
        s, _ = await open_ok(h, n)
        (q,) = (await snapshot(s))["queues"]["top"]
        assert q["ready"] == 2
        assert (await c.delete("/v0/topics/q")).status_code == 200
        assert (await snapshot(s))["queues"] == {"count": 0, "top": []}
        await produce(c, "q", 1)  # lazily created again: a log topic now
        assert (await snapshot(s))["queues"] == {"count": 0, "top": []}
        assert (await c.delete("/v0/topics/q")).status_code == 200
        await make_queue(c, "q")
        (q,) = (await snapshot(s))["queues"]["top"]
        assert (q["topic"], q["ready"]) == ("q", 0)
        s.disconnect()
