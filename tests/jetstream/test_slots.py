"""The connection caps of a deployment of fronts (`topicd.storage.jsslots`).

Method: three fronts in this process on the session's cluster (`open_fronts`: one
deployment prefix, a shared wall clock, a 60 s lease), each reached through its own app,
so every stream's front is chosen by the test: `/work` and SSE watch streams, dashboard
feeds and WebSockets, over the raw ASGI or socket seams the contract tests use. Each
test fills a cap with streams on several fronts and checks the next open on any front:
`429` with the embedded backend's `detail`, until a stream on any front ends. The count
itself is read back from the registry (`front.slots`) where the test is about it.

Races are made exact rather than likely: two fronts are handed the same revision of
the entry before both take the last slot, so both writes go to JetStream against it.
A dead front is one whose record nobody renews or removes: in process, a front whose
writer never runs again while its streams stay open, then the wall clock moved past its
term; as a process, `topicd serve` killed with SIGKILL while it holds streams, the
surviving front polled (bounded) until it admits. A NATS failure is a failing client
call at the registry (`read_table`/`write_table`). The in-flight cap's request slots are
tested the same way: long-polls of one key on two fronts fill it for the third; a
request ended on a front whose writer is held up (its record still counts it) leaves
the others admitting exactly what one process admits. The session cap: a create at it
on one front has the front holding an idle-expired session reclaim it (its last use
moved back past the TTL), never a session with its stream open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from functools import partial

import httpx
import orjson
import pytest
import trio

from tests.crash.harness import Server
from tests.http.test_contract_queues import make_queue
from tests.jetstream.conftest import fronts_of, jetstream_config, open_fronts, open_jetstream_app
from topicd.clock import SystemWallClock
from topicd.config import Config
from topicd.errors import Throttled
from topicd.storage import jsslots
from topicd.storage.jsslots import JsSlots, read_table
from topicd.testing.harness import AppHarness, make_config
from topicd.testing.sse import AsgiStream, open_sse, open_stream
from topicd.testing.ws import WsClient, WsClosed, open_ws_in_process

pytestmark = pytest.mark.slow

FEED = "/_topicd/dashboard/events"


def config(cluster, **sections: dict[str, object]) -> Config:
    return jetstream_config(cluster, make_config(**sections))


def desk(h: AppHarness) -> JsSlots:
    slots = fronts_of(h).backend.slots
    assert slots is not None
    return slots


async def entry(h: AppHarness) -> dict[str, int]:
    """The registry's count: front id -> its slots (records whatever their term)."""
    d = desk(h)
    table, _ = await d.backend.bridge.call(partial(read_table, d.store))
    return {front: tally.n for front, (tally, _) in table.items()}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def work(h: AppHarness, nursery, node: str = "w1", **kw) -> AsgiStream:
    return await open_sse(nursery, h.app.asgi_app, "/v0/topics/q/work", query=f"node={node}", **kw)


async def watch(h: AppHarness, nursery, headers=None) -> AsgiStream:
    r = await h.app.test_client().post("/v0/watch", json={"topics": {"q": {}}}, headers=headers)
    assert r.status_code == 200, await r.get_data()
    return await open_stream(nursery, h.app.asgi_app, (await r.get_json())["wid"], headers=headers)


async def refused_sse(s: AsgiStream) -> dict:
    await s.wait_done()
    assert s.status == 429, (s.status, s.body)
    assert s.headers["retry-after"] == "1"
    err = s.error_body["error"]
    assert err["code"] == "throttled"
    return err["detail"]


def refused_ws(ws: WsClient) -> dict:
    assert ws.status == 429, ws.status
    err = orjson.loads(ws.reject_body)["error"]
    assert err["code"] == "throttled"
    return err["detail"]


CAP = {"limit": "max_sse_connections", "max": 3}


async def test_streams_of_every_kind_on_three_fronts_fill_one_cap(cluster, nursery):
    """`max_sse_connections = 3`: a `/work` stream on the first front, a watch stream on
    the second, a WebSocket on the third fill it; then every front refuses every kind
    (a dashboard feed, a WebSocket, a `/work` stream) with the embedded `429`, and a
    stream that ends on one front lets one open on another."""
    async with open_fronts(config(cluster, limits={"max_sse_connections": 3})) as (a, b, c):
        await make_queue(a.app.test_client())
        w = await work(a, nursery)
        assert w.status == 200, w.body
        s = await watch(b, nursery)
        assert s.status == 200, s.body
        ws = await open_ws_in_process(nursery, c.app)
        assert ws.status == 101
        assert [desk(h).held() for h in (a, b, c)] == [1, 1, 1]
        assert sorted((await entry(a)).values()) == [1, 1, 1]
        assert await refused_sse(await open_sse(nursery, a.app.asgi_app, FEED)) == CAP
        assert refused_ws(await open_ws_in_process(nursery, b.app)) == CAP
        assert await refused_sse(await work(c, nursery, "w2")) == CAP
        assert await refused_sse(await watch(c, nursery)) == CAP
        # the `/work` stream on the first front ends: its slot is the deployment's again
        w.disconnect()
        await w.wait_done()
        assert await entry(a) == {desk(b).front_id: 1, desk(c).front_id: 1}
        w2 = await work(b, nursery, "w2")
        assert w2.status == 200, w2.body
        assert await refused_sse(await work(a, nursery, "w3")) == CAP
        for stream in (w2, s):
            stream.disconnect()
            await stream.wait_done()
        await ws.close(1000)
        with pytest.raises(WsClosed):
            await ws.recv()


async def test_the_per_key_and_viewer_caps_are_the_deployments(cluster, nursery):
    """`max_sse_connections_per_key = 2` and `dashboard.max_viewers = 2` with keys on:
    a key's streams on two fronts fill its cap on the third, another key's do not; two
    dashboard feeds on two fronts fill the viewer cap on the third (checked before the
    key's cap, as on one process)."""
    cfg = config(
        cluster,
        auth={"api_keys": ("k1", "k2")},
        limits={"max_sse_connections_per_key": 2},
        dashboard={"max_viewers": 2},
    )
    async with open_fronts(cfg) as (a, b, c):
        r = await a.app.test_client().put("/v0/topics/q", json={}, headers=bearer("k1"))
        assert r.status_code == 201
        f1 = await open_sse(nursery, a.app.asgi_app, FEED, headers=bearer("k1"))
        assert f1.status == 200, f1.body
        assert (await open_ws_in_process(nursery, b.app, bearer("k1"))).status == 101
        per_key = {"limit": "max_sse_connections_per_key", "max": 2}
        assert await refused_sse(await watch(c, nursery, bearer("k1"))) == per_key
        assert refused_ws(await open_ws_in_process(nursery, a.app, bearer("k1"))) == per_key
        f2 = await open_sse(nursery, c.app.asgi_app, FEED, headers=bearer("k2"))
        assert f2.status == 200, f2.body
        viewers = {"limit": "dashboard.max_viewers", "max": 2}
        for h, key in ((b, "k2"), (a, "k1")):
            feed = await open_sse(nursery, h.app.asgi_app, FEED, headers=bearer(key))
            assert await refused_sse(feed) == viewers
        assert (await open_ws_in_process(nursery, b.app, bearer("k2"))).status == 101
        f1.disconnect()
        await f1.wait_done()
        f3 = await open_sse(nursery, b.app.asgi_app, FEED, headers=bearer("k1"))
        assert f3.status == 200, f3.body
        for f in (f2, f3):
            f.disconnect()


async def test_racing_opens_on_three_fronts_admit_exactly_the_cap(cluster, nursery):
    """Twelve WebSockets opened at once, four on each front, under a cap of 5: exactly
    five are admitted, the other seven get the cap's `429`, and the registry counts five."""
    async with open_fronts(config(cluster, limits={"max_sse_connections": 5})) as hs:
        got: list[WsClient] = []

        async def connect(h: AppHarness) -> None:
            got.append(await open_ws_in_process(nursery, h.app))

        async with trio.open_nursery() as race:
            for i in range(12):
                race.start_soon(connect, hs[i % 3])
        assert sorted(ws.status for ws in got) == [101] * 5 + [429] * 7
        for ws in got:
            if ws.status == 429:
                assert refused_ws(ws) == {"limit": "max_sse_connections", "max": 5}
        assert sum(desk(h).held() for h in hs) == 5
        assert sum((await entry(hs[0])).values()) == 5


async def test_two_fronts_taking_the_last_slot_from_one_revision_admit_one(cluster, nursery):
    """Cap 2, one slot held on the first front. The other two fronts are handed the same
    revision of the entry, and both take the last slot at once: both decide on that
    revision that it is free and both write against it; JetStream takes one write, the
    other front's fails on the revision, it reads the entry again and refuses."""
    async with open_fronts(config(cluster, limits={"max_sse_connections": 2})) as (a, b, c):
        assert (await open_ws_in_process(nursery, a.app)).status == 101
        seen = await desk(b).backend.bridge.call(partial(read_table, desk(b).store))
        assert {f: t.n for f, (t, _) in seen[0].items()} == {desk(a).front_id: 1}
        desk(b)._cache = desk(c)._cache = seen
        results: dict[str, object] = {}

        async def take(name: str, d: JsSlots) -> None:
            try:
                results[name] = await d.acquire(None)
            except Throttled as exc:
                results[name] = exc

        async with trio.open_nursery() as race:
            race.start_soon(take, "b", desk(b))
            race.start_soon(take, "c", desk(c))
        won = [n for n, r in results.items() if not isinstance(r, Throttled)]
        lost = [r for r in results.values() if isinstance(r, Throttled)]
        assert len(won) == 1
        assert len(lost) == 1
        assert lost[0].detail == {"limit": "max_sse_connections", "max": 2}
        assert desk(b).conflicts + desk(c).conflicts == 1  # the loser's write, refused by JetStream
        assert sorted((await entry(a)).values()) == [1, 1]
        winner = desk(b) if won == ["b"] else desk(c)
        slot = results[won[0]]
        await winner.release(slot)  # type: ignore[arg-type]
        assert (await entry(a)) == {desk(a).front_id: 1}


async def test_a_dead_fronts_slots_stop_counting_when_its_term_ends(cluster, nursery):
    """The third front holds both slots of a cap of 2, then dies as a kill -9 leaves it:
    its streams never end and its record is never renewed nor removed. Until its term
    ends, the others refuse; once the wall clock passes it (the term is the lease's,
    60 s here), they admit, and the next write takes the dead front's record out."""
    async with open_fronts(config(cluster, limits={"max_sse_connections": 2})) as (a, b, c):
        for _ in range(2):
            assert (await open_ws_in_process(nursery, c.app)).status == 101
        cap = {"limit": "max_sse_connections", "max": 2}
        assert refused_ws(await open_ws_in_process(nursery, a.app)) == cap
        dead = desk(c)
        dead._renew_at = math.inf  # its writer never renews nor removes its record again
        dead._wake.set()  # (it parks again, with that deadline, writing nothing)
        a.clock.jump(c.engine.cfg.storage.jetstream.lease_ms - 10_000)
        assert refused_ws(await open_ws_in_process(nursery, b.app)) == cap  # still in its term
        a.clock.jump(10_001)
        assert (await open_ws_in_process(nursery, a.app)).status == 101
        assert await entry(a) == {desk(a).front_id: 1}
        assert (await open_ws_in_process(nursery, b.app)).status == 101
        assert refused_ws(await open_ws_in_process(nursery, a.app)) == cap


async def test_a_front_found_gone_stops_counting_at_once(cluster, nursery):
    """The third front's connection to NATS closes with its two streams open (as when its
    process is killed): the first front's next lease check finds no responders on its
    subject, and from then on its slots no longer count, long before its term (60 s)
    would end; the first front's next write takes its record out."""
    async with open_fronts(config(cluster, limits={"max_sse_connections": 2})) as (a, b, c):
        for _ in range(2):
            assert (await open_ws_in_process(nursery, c.app)).status == 101
        cap = {"limit": "max_sse_connections", "max": 2}
        assert refused_ws(await open_ws_in_process(nursery, a.app)) == cap
        gone = fronts_of(c)
        nc = gone.store.nc
        assert nc is not None
        await gone.backend.bridge.call(nc.close)
        await fronts_of(a)._tend_lease()  # (what it runs every third of `lease_ms`)
        assert (await open_ws_in_process(nursery, a.app)).status == 101
        assert await entry(a) == {desk(a).front_id: 1}
        assert (await open_ws_in_process(nursery, b.app)).status == 101
        assert refused_ws(await open_ws_in_process(nursery, b.app)) == cap
        # a front forgotten that holds no record is settled too (nothing left to retry)
        desk(b).forget("ghost")
        await desk(b).round()
        assert desk(b)._forget == set()


async def test_a_front_shutting_down_takes_its_slots_out(cluster, nursery):
    """A front that shuts down with a stream open removes its record as its engine
    closes: the other front admits at once, with no term to wait for."""
    cfg = config(cluster, limits={"max_sse_connections": 1})
    async with open_jetstream_app(cfg) as a:
        async with open_jetstream_app(cfg) as b:
            assert (await open_ws_in_process(nursery, b.app)).status == 101
            cap = {"limit": "max_sse_connections", "max": 1}
            assert refused_ws(await open_ws_in_process(nursery, a.app)) == cap
            gone = desk(b).front_id
            assert await entry(a) == {gone: 1}
        assert await entry(a) == {}
        assert (await open_ws_in_process(nursery, a.app)).status == 101


async def test_an_open_that_cannot_reach_the_count_is_a_503(cluster, nursery, monkeypatch):
    """The registry cannot be read when a stream opens: `503 storage_unavailable` with
    the canonical body and `Retry-After`, nothing counted; the next open after NATS is
    back is admitted."""

    async def unreachable(*_args: object) -> object:
        raise ConnectionError("nats: connection closed")

    async with open_fronts(config(cluster, limits={"max_sse_connections": 2}), 2) as (a, b):
        await make_queue(a.app.test_client())
        monkeypatch.setattr(jsslots, "read_table", unreachable)
        s = await work(b, nursery)
        await s.wait_done()
        assert s.status == 503, s.body
        assert s.headers["retry-after"] == "1"
        err = s.error_body["error"]
        assert err["code"] == "storage_unavailable"
        assert err["detail"] == {"backend": "jetstream"}
        ws = await open_ws_in_process(nursery, a.app)
        assert ws.status == 503
        assert orjson.loads(ws.reject_body)["error"]["code"] == "storage_unavailable"
        assert [desk(h).held() for h in (a, b)] == [0, 0]
        monkeypatch.undo()
        s = await work(b, nursery)
        assert s.status == 200, s.body
        s.disconnect()


async def test_a_close_that_cannot_reach_the_count_comes_back_at_the_next_write(
    cluster, nursery, monkeypatch
):
    """A stream ends while the registry cannot be written: its slot leaves the front's
    own count at once and the close does not hang; the entry still counts it (the other
    front refuses) until the front's writer writes its record again (its next round: the
    retry a third of `lease_ms` later, run here), after which the other front admits."""

    async def unwritable(*_args: object) -> object:
        raise ConnectionError("nats: connection closed")

    async with open_fronts(config(cluster, limits={"max_sse_connections": 1}), 2) as (a, b):
        await make_queue(a.app.test_client())
        s = await work(a, nursery)
        assert s.status == 200
        monkeypatch.setattr(jsslots, "write_table", unwritable)
        s.disconnect()
        with trio.fail_after(desk(a).release_wait_s / 2):  # (it gave up at the failed write)
            await s.wait_done()
        assert desk(a).held() == 0
        assert await entry(a) == {desk(a).front_id: 1}
        assert await refused_sse(await work(b, nursery)) == {
            "limit": "max_sse_connections",
            "max": 1,
        }
        monkeypatch.undo()
        await desk(a).round()
        assert await entry(a) == {}
        s = await work(b, nursery)
        assert s.status == 200, s.body
        s.disconnect()


async def test_a_cancelled_open_takes_no_slot(cluster):
    """An open cancelled while it waits for the count (the client left) holds nothing
    afterwards, whether the count had granted it or not."""
    async with open_fronts(config(cluster, limits={"max_sse_connections": 1}), 2) as (a, b):
        for delay in (0.0, 0.001, 0.002, 0.005, 0.01, 0.02):
            with trio.move_on_after(delay):
                slot = await desk(a).acquire(None)
                await desk(a).release(slot)  # (answered before the cancel: a stream's end)
            with trio.fail_after(10):
                while desk(a).held() or await entry(a):
                    await trio.sleep(0.01)  # (the give-back's round trip, bounded)
        slot = await desk(b).acquire(None)
        await desk(b).release(slot)


async def test_kill9_of_a_front_holding_streams_frees_its_slots(cluster, tmp_path, nursery):
    """`topicd serve` holds both slots of a cap of 2 (two dashboard feeds) and is killed
    with SIGKILL. A front in this process refuses while it lives, and admits once it has
    found the process gone (its lease check: no responders on the killed front's
    subject) or the killed front's term ended, within a few lease checks; its record is
    gone from the registry then."""
    prefix = f"slots9{zlib.crc32(str(tmp_path).encode())}"
    env = {
        **cluster.env(),
        "TOPICD_JETSTREAM_PREFIX": prefix,
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": "1500",
        "TOPICD_MAX_SSE_CONNECTIONS": "2",
    }
    (tmp_path / "f").mkdir()
    server = Server(nursery, tmp_path / "f")
    server.extra_env = env
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as hc:
            feeds = []
            for _ in range(2):
                feed = hc.stream("GET", FEED)
                r = await feed.__aenter__()
                assert r.status_code == 200
                feeds.append(feed)
            cfg = config(cluster, limits={"max_sse_connections": 2})
            js = dataclasses.replace(cfg.storage.jetstream, prefix=prefix, lease_ms=1500)
            cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, jetstream=js))
            async with open_jetstream_app(cfg, SystemWallClock()) as a:  # type: ignore[arg-type]
                cap = {"limit": "max_sse_connections", "max": 2}
                assert refused_ws(await open_ws_in_process(nursery, a.app)) == cap
                await server.kill()
                t0 = trio.current_time()
                with trio.fail_after(15):
                    while (ws := await open_ws_in_process(nursery, a.app)).status != 101:
                        assert refused_ws(ws) == cap
                        await trio.sleep(0.1)  # (the next try's pace, bounded above)
                assert trio.current_time() - t0 < 15
                assert await entry(a) == {desk(a).front_id: 1}
                await ws.close(1000)
            for feed in feeds:
                with trio.move_on_after(1), contextlib.suppress(httpx.HTTPError):
                    await feed.__aexit__(None, None, None)
    finally:
        with trio.CancelScope(shield=True):
            await server.close()


INFLIGHT = {"limit": "max_inflight_per_key", "max": 2}


async def test_a_keys_requests_on_three_fronts_fill_its_inflight_cap(cluster, nursery):
    """`limits.max_inflight_per_key = 2` with keys on: two long-polls of one key, on two
    fronts, fill its cap; a request of that key on the third front gets the embedded
    `429`, another key's is served; once a long-poll ends, the key's next request on
    the third front is served, and the registry counts the requests running."""
    cfg = config(cluster, auth={"api_keys": ("k1", "k2")}, limits={"max_inflight_per_key": 2})
    async with open_fronts(cfg) as (a, b, c):
        r = await a.app.test_client().put("/v0/topics/q", json={}, headers=bearer("k1"))
        assert r.status_code == 201
        polls: dict[str, int] = {}

        async def poll(h: AppHarness, name: str) -> None:
            got = await h.app.test_client().post(
                "/v0/topics/q/diff", json={"wait_ms": 30_000}, headers=bearer("k1")
            )
            polls[name] = got.status_code

        nursery.start_soon(poll, a, "a")
        nursery.start_soon(poll, b, "b")
        with trio.fail_after(10):
            while not (desk(a).mine.reqs and desk(b).mine.reqs):
                await trio.sleep(0.01)  # (the polls' admission round trips, bounded)
        key = next(iter(desk(a).mine.reqs))
        table, _ = await desk(c).backend.bridge.call(partial(read_table, desk(c).store))
        assert sorted(t.reqs.get(key, 0) for t, _ in table.values()) == [1, 1]
        r = await c.app.test_client().get("/v0/topics", headers=bearer("k1"))
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "1"
        assert (await r.get_json())["error"]["detail"] == INFLIGHT
        assert (
            await c.app.test_client().get("/v0/topics", headers=bearer("k2"))
        ).status_code == 200
        # a write (by the other key) ends both long-polls
        w = await c.app.test_client().post(
            "/v0/topics/q", json={"records": [{"data": 1}]}, headers=bearer("k2")
        )
        assert w.status_code == 200
        with trio.fail_after(10):
            while len(polls) < 2:
                await trio.sleep(0.01)
        assert polls == {"a": 200, "b": 200}
        assert (
            await c.app.test_client().get("/v0/topics", headers=bearer("k1"))
        ).status_code == 200
        assert [desk(h).mine.reqs for h in (a, b, c)] == [{}, {}, {}]


async def test_a_request_ended_on_a_front_whose_write_lags_is_not_counted_elsewhere(
    cluster, monkeypatch
):
    """A request's end does not wait for its front's write. Cap 2: the first front holds
    two requests of a key, and its writer is held up, so its record still counts both
    after one ends. The third front, refused on that record, asks the first what it
    holds now (one), and admits; the second front, refused on the records (the first's
    two and the third's one), asks both (one and one) and refuses. A request ended on
    the third front frees its slot for the second at once, though its record still
    counts it."""
    cfg = config(cluster, limits={"max_inflight_per_key": 2})
    async with open_fronts(cfg) as (a, b, c):
        held = [await desk(a).acquire_request("key") for _ in range(2)]
        stuck = trio.Event()

        async def no_round() -> None:
            await stuck.wait()

        monkeypatch.setattr(desk(a), "round", no_round)
        desk(a).release_request(held[0])
        desk(a).release_request(held[0])  # (idempotent)
        assert desk(a).live(["key"], False) == {"r": {"key": 1}, "w": 0, "b": 0, "e": 0}
        table, _ = await desk(a).backend.bridge.call(partial(read_table, desk(a).store))
        assert table[desk(a).front_id][0].reqs == {"key": 2}  # (its record lags)
        mine = await desk(c).acquire_request("key")
        assert desk(c).live_asks == 1
        with pytest.raises(Throttled) as refused:
            await desk(b).acquire_request("key")
        assert refused.value.detail == INFLIGHT
        assert desk(b).live_asks == 1
        monkeypatch.setattr(desk(c), "round", no_round)
        desk(c).release_request(mine)
        again = await desk(b).acquire_request("key")
        assert desk(b).live_asks == 2
        desk(b).release_request(again)
        # a front's own requests at the cap refuse at once, with no round trip
        own = [await desk(b).acquire_request("other") for _ in range(2)]
        writes = desk(b).writes
        with pytest.raises(Throttled):
            await desk(b).acquire_request("other")
        assert desk(b).writes == writes
        for slot in own:
            desk(b).release_request(slot)
        monkeypatch.undo()
        stuck.set()


async def test_a_create_at_the_session_cap_reclaims_idle_sessions_on_other_fronts(cluster, nursery):
    """`limits.max_watch_sessions = 2`, one session created on each of two fronts: a
    create on the third is refused with the embedded `429`. Once the first front's
    session has been idle past `watch.session_ttl_ms` (its last use moved back), a create
    on the third front has the first reclaim it (as one process reclaims idle sessions
    on a create) and is served; the second front's session, idle as long but with its
    stream open, is never reclaimed: the next create is refused."""
    async with open_fronts(config(cluster, limits={"max_watch_sessions": 2})) as (a, b, c):
        await a.app.test_client().put("/v0/topics/q", json={})
        body = {"topics": {"q": {}}}
        for h in (a, b):
            assert (await h.app.test_client().post("/v0/watch", json=body)).status_code == 200
        assert [desk(h).mine.w for h in (a, b, c)] == [1, 1, 0]
        r = await c.app.test_client().post("/v0/watch", json=body)
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "1"
        cap = {"limit": "max_watch_sessions", "max": 2}
        assert (await r.get_json())["error"]["detail"] == cap
        assert desk(c).live_asks == 1
        assert len(c.engine.watch.sessions) == 0  # (the refused session is not kept)
        ttl = a.engine.cfg.watch.session_ttl_ms / 1000
        (idle,) = a.engine.watch.sessions.values()
        idle.last_used -= ttl + 0.001
        (kept,) = b.engine.watch.sessions.values()
        s = await open_stream(nursery, b.app.asgi_app, kept.wid)
        assert s.status == 200, s.body
        kept.last_used -= ttl + 0.001
        r = await c.app.test_client().post("/v0/watch", json=body)
        assert r.status_code == 200, await r.get_data()
        assert a.engine.watch.sessions == {}
        assert a.engine.watch.stats.sessions_reclaimed == 1
        assert [desk(h).mine.w for h in (a, b, c)] == [0, 1, 1]
        r = await a.app.test_client().post("/v0/watch", json=body)
        assert r.status_code == 429
        assert kept.wid in b.engine.watch.sessions
        s.disconnect()
