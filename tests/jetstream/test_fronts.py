"""Several fronts on one JetStream deployment: the owner lease, forwarding, following,
and a takeover when the owner front is killed.

Method: two or three fronts share one `storage.jetstream.prefix` of the session's
nats-server. Most tests open them in this process (each front its own engine, asyncio
bridge and NATS connection, as separate processes would have) and act through each
front's HTTP app; the payload cache is 0 bytes, so every read on a front goes back to the
stream. The takeover test runs `topicd serve` processes and kills the owner with SIGKILL
during writes: every write a client saw acknowledged (on any front) must be readable on
every front afterwards, at the seq it was given, once, with no seq reused.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from functools import partial

import httpx
import pytest
import trio
import trio.testing

from tests.crash.harness import Server
from tests.crash.harness import client as http_client
from tests.jetstream.conftest import (
    Deployment,
    jetstream_config,
    open_jetstream_app,
    require_binary,
    start_nats,
)
from tests.watch import helpers as watch_helpers
from topicd.engine import payloads
from topicd.storage.jetstream import (
    DELETES_KEPT,
    JetStreamBackend,
    JetStreamStore,
    JetStreamUnavailable,
)
from topicd.storage.jsfronts import ALONE_AFTER_TERMS, BALANCE_HOLD_TERMS, Fronts
from topicd.testing.fake_clock import FakeWallClock

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(payloads, "CHUNK_SHIFT", 0)


async def _json(r, status: int | None = None) -> dict:
    raw = await r.get_data()
    if status is not None:
        assert r.status_code == status, raw
    return json.loads(raw)


async def _write(c, topic: str, *records, headers=None, **fields) -> dict:
    r = await c.post(
        f"/v0/topics/{topic}", json={"records": list(records), **fields}, headers=headers
    )
    assert r.status_code in (200, 201), await r.get_data()
    return await _json(r)


async def _diff(c, topic: str, from_seq: int = 0, **req) -> dict:
    r = await c.post(
        f"/v0/topics/{topic}/diff",
        json={"from_seq": from_seq, "limit": 1000, "include_tags": True, **req},
    )
    return await _json(r, 200)


async def _data(c, topic: str) -> list:
    return [r["data"] for r in (await _diff(c, topic))["records"]]


def _fronts(h) -> Fronts:
    backend = h.engine.commit
    assert isinstance(backend, JetStreamBackend)
    assert backend.fronts is not None
    return backend.fronts


def _timeout(cfg, request_timeout_ms: int):
    """`cfg` with the fronts' request timeout set to `request_timeout_ms`."""
    js = dataclasses.replace(cfg.storage.jetstream, request_timeout_ms=request_timeout_ms)
    return dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, jetstream=js))


def _sharded(cluster: Deployment, shards: int):
    cfg = jetstream_config(cluster)
    # a long lease: the background checks stay out of the way; the test drives them
    js = dataclasses.replace(cfg.storage.jetstream, shards=shards, lease_ms=60_000)
    return dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, jetstream=js))


async def test_the_first_front_owns_and_the_others_forward_to_it(cluster):
    cfg = jetstream_config(cluster)
    async with (
        open_jetstream_app(cfg) as a,
        open_jetstream_app(cfg) as b,
        open_jetstream_app(cfg) as c,
    ):
        assert [_fronts(h).owner for h in (a, b, c)] == [True, False, False]
        ca, cb, cc = (h.app.test_client() for h in (a, b, c))
        r = await cb.put("/v0/topics/t", json={"cap_records": 100})
        assert (await _json(r, 201))["config"]["cap_records"] == 100
        for client in (ca, cc):  # created through a follower, known everywhere
            state = await _json(await client.get("/v0/topics/t"), 200)
            assert (state["head_seq"], state["config"]["cap_records"]) == (0, 100)
        w1 = await _write(cb, "t", {"data": 1}, {"data": 2, "tag": "x"})
        w2 = await _write(ca, "t", {"data": 3})
        w3 = await _write(cc, "t", {"data": 4})
        assert [w["first_seq"] for w in (w1, w2, w3)] == [1, 3, 4]
        for client in (ca, cb, cc):  # read-after-write on every front
            assert await _data(client, "t") == [1, 2, 3, 4]
            state = await _json(await client.get("/v0/topics/t"), 200)
            assert (state["head_seq"], state["count"]) == (4, 4)
        assert _fronts(b).forwarded >= 2 and _fronts(c).forwarded >= 1
        assert _fronts(a).served >= 3
        assert _fronts(a).forwarded == 0  # the owner runs its own


async def test_lazy_create_and_errors_travel_back_unchanged(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        w = await _write(cb, "lazy", {"data": "x"})
        assert (w["created"], w["first_seq"]) == (True, 1)
        r = await cb.post("/v0/topics/nope", json={"records": [{"data": 1}], "create": False})
        body = await _json(r, 404)
        assert body["error"]["code"] == "topic_not_found"
        r = await cb.post("/v0/topics/lazy", json={"records": [{"data": 0}] * 1001})
        assert (await _json(r, 400))["error"]["code"] == "batch_too_large"
        r = await cb.put("/v0/topics/full", json={"cap_records": 1, "discard": "reject"})
        await _json(r, 201)
        await _write(ca, "full", {"data": 1})
        r = await cb.post("/v0/topics/full", json={"records": [{"data": 2}]})
        assert (await _json(r, 422))["error"]["code"] == "topic_full"
        assert await _data(ca, "lazy") == ["x"]


async def test_idempotent_retries_on_another_front_are_not_duplicated(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        key = {"Idempotency-Key": "k-1"}
        first = await _write(cb, "i", {"data": 1}, {"data": 2}, headers=key)
        again = await _write(ca, "i", {"data": 1}, {"data": 2}, headers=key)
        third = await _write(cb, "i", {"data": 1}, {"data": 2}, headers=key)
        assert first["first_seq"] == again["first_seq"] == third["first_seq"] == 1
        assert (again["deduped"], third["deduped"]) == (True, True)
        assert await _data(cb, "i") == [1, 2]


async def test_config_record_deletes_and_topic_deletes_are_seen_by_every_front(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        await _write(
            ca, "d", *({"data": i, "tag": "even" if i % 2 == 0 else "odd"} for i in range(6))
        )
        assert await _data(cb, "d") == [0, 1, 2, 3, 4, 5]
        # a record delete on the owner: the follower's next read no longer has them
        r = await ca.post("/v0/topics/d/delete", json={"match": "even"})
        assert (await _json(r, 200))["deleted"] == 3
        assert await _data(cb, "d") == [1, 3, 5]
        # a record delete through the follower
        r = await cb.post("/v0/topics/d/delete", json={"before_seq": 4})
        body = await _json(r, 200)
        assert (body["deleted"], body["count"]) == (1, 2)
        assert await _data(ca, "d") == [3, 5]
        assert await _data(cb, "d") == [3, 5]
        # a config change on the owner: the follower's state shows it, and its caps
        r = await ca.put("/v0/topics/d", json={"cap_records": 1})
        await _json(r, 200)
        state = await _json(await cb.get("/v0/topics/d"), 200)
        assert (state["config"]["cap_records"], state["count"]) == (1, 1)
        assert await _data(cb, "d") == [5]
        # a topic delete through the follower: gone on both, and re-created fresh
        r = await cb.delete("/v0/topics/d")
        assert (await _json(r, 200))["deleted"] is True
        for client in (ca, cb):
            await _json(await client.get("/v0/topics/d"), 404)
        w = await _write(ca, "d", {"data": "new"})
        assert (w["created"], w["first_seq"]) == (True, 1)
        assert await _data(cb, "d") == ["new"]


async def test_a_follower_converges_after_more_record_deletes_than_the_entry_keeps(cluster):
    """More record deletes on the owner between two reads of a follower than the
    registry entry keeps (`DELETES_KEPT`): the follower reads which records the stream
    still holds and drops the rest, so its reads and counts match the owner's exactly,
    the `cap` tombstone included; the deletes after that apply from the entry again."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        await _json(await ca.put("/v0/topics/x", json={"cap_records": 290}), 201)
        await _write(ca, "x", *({"data": i, "tag": f"t{i}"} for i in range(300)))
        assert len(await _data(cb, "x")) == 290  # (the follower has loaded it)
        assert DELETES_KEPT < 100
        r = await ca.post("/v0/topics/x/delete", json={"before_seq": 15})
        assert (await _json(r, 200))["deleted"] == 4  # (1..10 were evicted by the cap)
        for i in range(20, 140):  # 120 deletes of one record each, then one of many
            r = await ca.post("/v0/topics/x/delete", json={"match": f"t{i}"})
            assert (await _json(r, 200))["deleted"] == 1
        r = await ca.post("/v0/topics/x/delete", json={"match": "t2*", "before_seq": 260})
        assert (await _json(r, 200))["deleted"] > 0
        want = await _diff(ca, "x")
        assert want["tombstone"]["reason"] == "cap"
        got = await _diff(cb, "x")
        assert got["records"] == want["records"]
        assert got["tombstone"] == want["tombstone"]
        sa = await _json(await ca.get("/v0/topics/x", query_string={"touch": "false"}), 200)
        sb = await _json(await cb.get("/v0/topics/x", query_string={"touch": "false"}), 200)
        keys = ("count", "bytes", "earliest_seq", "head_seq")
        assert {k: sb[k] for k in keys} == {k: sa[k] for k in keys}
        r = await ca.post("/v0/topics/x/delete", json={"match": "t299"})
        assert (await _json(r, 200))["deleted"] == 1
        assert await _data(cb, "x") == await _data(ca, "x")


async def test_a_long_poll_on_a_follower_wakes_on_a_write_through_the_owner(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        await _write(ca, "p", {"data": 0})
        assert await _data(cb, "p") == [0]
        topic_b = b.engine.topics["p"]
        got: list[dict] = []

        async def poll() -> None:
            got.append(await _diff(cb, "p", from_seq=1, wait_ms=20_000))

        async with trio.open_nursery() as n:
            n.start_soon(poll)
            with trio.fail_after(10):
                while not topic_b.has_waiters:  # parked (after its catch-up round trip)
                    await trio.testing.wait_all_tasks_blocked(0.01)
            assert got == []
            with trio.fail_after(10):
                await _write(ca, "p", {"data": 1})
        assert [r["data"] for r in got[0]["records"]] == [1]


async def test_an_sse_watch_on_a_follower_streams_writes_made_through_the_owner(cluster, nursery):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        await _write(ca, "w", *({"data": i} for i in range(3)))
        wid = await watch_helpers.wid_of(cb, {"topics": {"w": {"from_seq": 1}}})
        s = await watch_helpers.open_ok(b, nursery, wid)
        frames = await watch_helpers.read_until_event(s, "caught-up")
        backlog = [r["data"] for f in frames if f[0] == "record" for r in f[2]["records"]]
        assert backlog == [1, 2]
        with trio.fail_after(10):
            await _write(ca, "w", {"data": "live"})
            (event, cursors, data) = (await watch_helpers.read(s, 1))[0]
        assert (event, cursors, [r["data"] for r in data["records"]]) == (
            "record",
            {"w": 4},
            ["live"],
        )
        # the session lives on the front that created it
        r = await ca.get(f"/v0/watch/{wid}")
        assert r.status_code == 404
        await watch_helpers.close(s)


async def test_a_topic_created_on_the_owner_is_listed_by_a_follower(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        await _json(await ca.put("/v0/topics/listed"), 201)
        await _fronts(b).poll_once()  # (what its poll does every second, run now)
        body = await _json(await cb.get("/v0/topics"), 200)
        assert [t["topic"] for t in body["topics"]] == ["listed"]


async def test_read_times_and_the_topic_count_are_the_deployments(cluster):
    """A read on a follower reaches the owner before it answers, so every front shows it
    next (`last_read_ts`); a read time no request carried (a watch delivery) reaches the
    owner at the follower's poll; `/v0/ready` counts the topics of every front."""
    cfg = jetstream_config(cluster)
    clock = FakeWallClock()  # (one wall clock: the times compare across fronts)
    async with (
        open_jetstream_app(cfg, clock) as a,
        open_jetstream_app(cfg, clock) as b,
        open_jetstream_app(cfg, clock) as c,
    ):
        ca, cb, cc = (h.app.test_client() for h in (a, b, c))

        async def read_ts(client) -> int | None:
            r = await client.get("/v0/topics/t", query_string={"touch": "false"})
            return (await _json(r, 200))["last_read_ts"]

        await _json(await ca.put("/v0/topics/t"), 201)
        assert [await read_ts(x) for x in (ca, cb, cc)] == [None, None, None]
        await _diff(cb, "t")  # a read on a follower
        seen = [await read_ts(x) for x in (ca, cc, cb)]
        assert all(isinstance(ts, int) for ts in seen), seen
        # a delivery on `c` (a watch stream's read sets the time, no request carries it)
        later = max(seen) + 60_000
        c.engine.topics["t"].last_read_ts = later
        await _fronts(c).push_reads()  # (what its poll does every second, run now)
        assert [await read_ts(x) for x in (ca, cb)] == [later, later]
        # the topic count: created on `c` and `a`, counted on `b` before any poll of its
        await _json(await cc.put("/v0/topics/u"), 201)
        await _write(ca, "v", {"data": 1})
        for client in (ca, cb, cc):
            assert (await _json(await client.get("/v0/ready"), 200))["topics"] == 3
        await _json(await cb.delete("/v0/topics/u"), 200)
        for client in (ca, cb, cc):
            assert (await _json(await client.get("/v0/ready"), 200))["topics"] == 2


async def test_a_follower_takes_over_when_the_owner_stops_renewing(cluster):
    """The owner's engine closes (its lease is not renewed any more): the follower takes
    the lease once it expires, then runs writes itself at the next seqs."""
    cfg = jetstream_config(cluster)
    js = dataclasses.replace(cfg.storage.jetstream, lease_ms=600)
    cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, jetstream=js))
    a_up, stop_a = trio.Event(), trio.Event()

    async def run_a() -> None:
        async with open_jetstream_app(cfg) as a:
            assert _fronts(a).owner
            await _write(a.app.test_client(), "o", {"data": 1}, headers={"Idempotency-Key": "k"})
            a_up.set()
            await stop_a.wait()

    async with trio.open_nursery() as n:
        n.start_soon(run_a)
        await a_up.wait()
        async with open_jetstream_app(cfg) as b:
            assert not _fronts(b).owner
            cb = b.app.test_client()
            assert await _data(cb, "o") == [1]
            stop_a.set()  # the owner closes: nobody renews its lease
            with trio.fail_after(15):
                await _fronts(b).promoted.wait()
            assert _fronts(b).owner
            w = await _write(cb, "o", {"data": 1}, headers={"Idempotency-Key": "k"})
            assert (w["first_seq"], w["deduped"]) == (1, True)
            w = await _write(cb, "o", {"data": 2})
            assert w["first_seq"] == 2
            assert await _data(cb, "o") == [1, 2]


async def test_a_deposed_owner_is_fenced_off_the_registry_and_then_follows(cluster, caplog):
    """The lease moves to `b` while `a` still believes it owns (its renewal has not run
    yet): `a`'s next registry write fails by compare-and-set (`503`), nothing of it
    lands; once `a` finds its lease gone it forwards to `b` like any follower."""
    cfg = _sharded(cluster, 1)  # (a long lease: the test runs the checks)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        await _json(await ca.put("/v0/topics/f", json={"cap_records": 10}), 201)
        await _write(ca, "f", {"data": 1})
        fb = _fronts(b)
        store = fb.store
        _, rev = await fb.backend.bridge.call(store.lease)
        fb.lease_revs[0] = await fb.backend.bridge.call(
            partial(store.write_lease, fb._lease_value(), rev)
        )
        await fb._promote(0)
        assert fb.owner and _fronts(a).owner  # `a` has not noticed yet
        await _json(await cb.put("/v0/topics/f", json={"cap_records": 20}), 200)
        r = await ca.put("/v0/topics/f", json={"cap_records": 30})
        assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
        state = await _json(await cb.get("/v0/topics/f"), 200)
        assert state["config"]["cap_records"] == 20
        # topic ids come from the registry by compare-and-set: both may create, never
        # with the same id
        await _json(await ca.put("/v0/topics/n1"), 201)
        await _json(await cb.put("/v0/topics/n2"), 201)
        assert a.engine.topics["n1"].topic_id != b.engine.topics["n2"].topic_id
        # the new owner takes in what the deposed one did (its poll, run here at once)
        await _fronts(b).poll_once()
        await _json(await cb.get("/v0/topics/n1"), 200)
        # a name another front created is not created twice
        r = await ca.put("/v0/topics/n2", json={"cap_records": 7})
        assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
        # `a` changes a config `b` has not written since: its compare-and-set succeeds;
        # `b`'s next change of it adopts that entry, then writes its own on top
        await _json(await ca.put("/v0/topics/n1", json={"cap_records": 7}), 200)
        await _json(await cb.put("/v0/topics/n1", json={"cap_records": 8, "ttl_ms": 0}), 200)
        entry, _ = await fb.backend.bridge.call(
            partial(store.entry, b.engine.topics["n1"].topic_id)
        )
        assert entry["config"]["cap_records"] == 8
        assert "adopted a registry entry another front wrote" in caplog.text
        await _fronts(a)._tend_lease()  # its renewal: the lease is `b`'s now
        assert not _fronts(a).owner
        await _json(await ca.put("/v0/topics/f", json={"cap_records": 30}), 200)
        state = await _json(await cb.get("/v0/topics/f"), 200)
        assert state["config"]["cap_records"] == 30
        w = await _write(ca, "f", {"data": 2})
        assert w["first_seq"] == 2
        assert await _data(ca, "f") == [1, 2]


async def test_an_owner_whose_term_runs_out_unrenewed_steps_down_and_catches_up(cluster):
    """The owner's lease check is stuck (a slow round trip, a long takeover of another
    shard) past the end of its term: another front takes the lease by expiry and writes
    the topic. The owner's term watch steps it down, so its next read catches the topic
    up from the stream instead of answering from memory without the new owner's writes
    (issue: `test_kill9_of_an_owner_front_during_writes` saw a surviving front miss the
    last acknowledged writes this way)."""
    cfg = _sharded(cluster, 1)  # (a long lease: the test runs the checks)
    clock = FakeWallClock()  # (one wall clock: the terms compare across fronts)
    async with open_jetstream_app(cfg, clock) as a, open_jetstream_app(cfg, clock) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        fa, fb = _fronts(a), _fronts(b)
        await _write(ca, "f", {"data": 1})
        assert await _data(cb, "f") == [1]
        await fa._tend_lease()  # (`a` counts `b` among the members)
        assert fa.owner and fa.live == 2
        fa.check_terms()  # within its term: `a` stays the owner
        assert fa.owner
        fa._tend_lease = trio.lowlevel.checkpoint  # `a`'s lease check is stuck from now on
        clock.jump(cfg.storage.jetstream.lease_ms + 1)
        await fb._tend_lease()  # `a`'s term is over: `b` takes the lease
        assert fb.owner and fa.owner  # `a` has not renewed, so it has not noticed
        w = await _write(cb, "f", {"data": 2})
        assert w["first_seq"] == 2
        fa.check_terms()  # `a`'s term watch (its task, at its next tick)
        assert not fa.owner and 0 not in fa.owned
        assert await _data(ca, "f") == [1, 2]  # caught up as a follower
        w = await _write(ca, "f", {"data": 3})  # forwarded to `b`
        assert w["first_seq"] == 3
        assert await _data(cb, "f") == [1, 2, 3]


async def test_a_lone_owner_cut_off_from_nats_past_its_term_steps_down(tmp_path, monkeypatch):
    """A front alone among the members keeps its shards past an unrenewed term while
    it is connected (nobody else could have taken them: its renewals fail only for the
    cluster's want, or its wall clock stepped). Cut off from NATS for longer than its
    lease, it steps down: another front may have joined and taken the shards meanwhile,
    so it no longer answers reads from memory as their owner (503, not a stale read).
    Once it is connected again, its next lease check takes the shards back."""
    root = tmp_path / "nats"
    server = start_nats(require_binary(), root)
    port = server.url.rsplit(":", 1)[1]
    base = jetstream_config(server.url)
    js = dataclasses.replace(base.storage.jetstream, request_timeout_ms=500, lease_ms=60_000)
    cfg = dataclasses.replace(base, storage=dataclasses.replace(base.storage, jetstream=js))
    token = trio.lowlevel.current_trio_token()
    down = trio.Event()
    on_disconnected = JetStreamStore._on_disconnected

    async def noted(self: JetStreamStore) -> None:
        await on_disconnected(self)
        token.run_sync_soon(down.set)

    monkeypatch.setattr(JetStreamStore, "_on_disconnected", noted)
    clock = FakeWallClock()
    try:
        async with open_jetstream_app(cfg, clock) as h:
            c, f = h.app.test_client(), _fronts(h)
            await _write(c, "o", {"data": 1})
            assert f.owner and f.live == 1
            clock.jump(cfg.storage.jetstream.lease_ms + 1)
            f.check_terms()  # term over, but alone and connected: still the owner
            assert f.owner
            await f._tend_lease()  # (renewed)
            server.stop()
            with trio.fail_after(20):
                await down.wait()
            f.check_terms()  # disconnected within its term: still the owner
            assert f.owner
            state = await _json(await c.get("/v0/topics/o"), 200)  # (from its memory)
            assert state["head_seq"] == 1
            clock.jump(cfg.storage.jetstream.lease_ms + 1)
            f.check_terms()  # disconnected past its term: it steps down
            assert not f.owner and not f.owned
            r = await c.get("/v0/topics/o")  # (a follower's read catches up first)
            assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
            server = start_nats(require_binary(), root, listen=f"127.0.0.1:{port}")
            backend = f.backend
            with trio.fail_after(20):
                await backend.bridge.call(backend.store.wait_connected)
            await f._tend_lease()  # connected again: it takes its shards back
            assert f.owner
            assert await _data(c, "o") == [1]
            assert (await _write(c, "o", {"data": 2}))["first_seq"] == 2
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


async def test_a_lease_whose_holder_is_gone_is_taken_at_once(cluster):
    """The lease names a front nobody listens for (its connection closed) and runs for an
    hour yet: a starting front asks, gets *no responders*, and takes it at once."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as a:
        fa = _fronts(a)
        fa._tend_lease = trio.lowlevel.checkpoint  # `a` no longer looks after the lease
        _, rev = await fa.backend.bridge.call(fa.store.lease)
        ghost = {"front": "ghost", "subject": "nobody.listens", "until_ms": 2**53}
        got = await fa.backend.bridge.call(partial(fa.store.write_lease, ghost, rev))
        assert got is not None
        fa.owned.clear()  # (as if `a` had lost it: it would step down at its renewal)
        async with open_jetstream_app(cfg) as b:
            assert _fronts(b).owner
            await _write(b.app.test_client(), "g", {"data": 1})


async def test_a_follower_answers_503_while_the_owner_is_unreachable(cluster):
    cfg = _sharded(cluster, 1)  # (a long lease: the test runs the check)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        cb = b.app.test_client()
        await _write(cb, "u", {"data": 1})
        fb = _fronts(b)
        fb.owner_subjects[0] = f"{fb.store.prefix}.fwd.gone"
        r = await cb.post("/v0/topics/u", json={"records": [{"data": 2}]})
        body = await _json(r, 503)
        assert body["error"]["code"] == "storage_unavailable"
        assert r.headers["Retry-After"] == "1"
        await fb._tend_lease()  # its lease check finds the owner again
        assert fb.owner_subjects[0] == _fronts(a).subject
        w = await _write(cb, "u", {"data": 2})
        assert w["first_seq"] == 2


async def _balance(*hs) -> None:
    for _ in range(4):
        for h in hs:
            await _fronts(h)._tend_lease()


async def test_shards_spread_over_the_fronts_and_move_when_one_leaves(cluster):
    """`shards = 3`, three fronts: after their lease checks each owns one shard (the
    first front took all three, then gave two up as the others joined). Writes to topics
    of every shard through every front land once, in order, readable everywhere; when a
    front leaves, its shard moves to another and writes go on at the next seqs."""
    cfg = _sharded(cluster, 3)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        assert (_fronts(a).owned, _fronts(b).owned) == ({0, 1, 2}, set())
        names = {}
        for i in range(100):
            names.setdefault(_fronts(a).shard_of(f"s{i}"), f"s{i}")
        assert sorted(names) == [0, 1, 2]
        async with open_jetstream_app(cfg) as c:
            hs = (a, b, c)
            await _balance(*hs)
            owned = [_fronts(h).owned for h in hs]
            assert sorted(len(o) for o in owned) == [1, 1, 1]
            assert set().union(*owned) == {0, 1, 2}
            clients = [h.app.test_client() for h in hs]
            for j, client in enumerate(clients):
                for name in names.values():
                    w = await _write(client, name, {"data": j})
                    assert w["first_seq"] == j + 1
            for client in clients:
                for name in names.values():
                    assert await _data(client, name) == [0, 1, 2]
            # each front ran its own shard's writes and forwarded the others'
            for h in hs:
                assert _fronts(h).served > 0 and _fronts(h).forwarded > 0
            leaving = set(_fronts(c).owned)
        # `c` gave its shard up at shutdown: one of the two left takes it
        await _balance(a, b)
        assert _fronts(a).owned | _fronts(b).owned == {0, 1, 2}
        assert not _fronts(a).owned & _fronts(b).owned
        (k,) = leaving
        for client in (a.app.test_client(), b.app.test_client()):
            w = await _write(client, names[k], {"data": "after"})
            assert w["first_seq"] in (4, 5)
        assert await _data(a.app.test_client(), names[k]) == [0, 1, 2, "after", "after"]


async def test_a_front_refuses_another_shard_count(cluster):
    cfg = _sharded(cluster, 2)
    async with open_jetstream_app(cfg):
        other = dataclasses.replace(
            cfg,
            storage=dataclasses.replace(
                cfg.storage,
                jetstream=dataclasses.replace(cfg.storage.jetstream, shards=3),
            ),
        )
        with pytest.raises(JetStreamUnavailable, match="runs 2 owner shards"):
            async with open_jetstream_app(other):
                pass


@pytest.mark.parametrize("shards", [1, 3])
async def test_kill9_of_an_owner_front_during_writes(cluster, tmp_path, shards):
    """Three `topicd serve` fronts; writers on the second and third front (an idempotency
    key per write, retried on 503 or a lost connection) to one topic per shard, while the
    first front (the owner of every shard at start; of one or more when the shards have
    been shared out) is killed with SIGKILL. After the takeover every acknowledged write
    is on both surviving fronts, once, at its seq, and each topic's seqs are 1..n."""
    env = {
        **cluster.env(),
        # (a prefix per run: `pytest --count N` repeats it on one deployment)
        "TOPICD_JETSTREAM_PREFIX": f"fronts9s{shards}r{zlib.crc32(str(tmp_path).encode())}",
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": "1500",
        "TOPICD_STORAGE_JETSTREAM_SHARDS": str(shards),
    }
    shard_of = Fronts.shard_of_name
    topics: dict[int, str] = {}
    for i in range(200):
        topics.setdefault(shard_of(f"k{i}", shards), f"k{i}")
    assert len(topics) == shards
    names = list(topics.values())
    async with trio.open_nursery() as nursery:
        servers = []
        for i in range(3):
            (tmp_path / f"f{i}").mkdir()
            s = Server(nursery, tmp_path / f"f{i}")
            s.extra_env = dict(env)
            await s.start()
            servers.append(s)
        try:
            owner, others = servers[0], servers[1:]
            assert ": owner" in owner.run.text
            acked: dict[str, tuple[str, int]] = {}  # idempotency key -> (topic, first seq)
            enough = trio.Event()
            done = 0

            async def writer(server: Server, who: str) -> None:
                nonlocal done
                async with http_client(server) as hc:
                    for i in range(60):
                        key = f"{who}-{i}"
                        topic = names[i % len(names)]
                        with trio.fail_after(30):
                            while True:
                                try:
                                    r = await hc.post(
                                        f"/v0/topics/{topic}",
                                        json={"records": [{"data": key}]},
                                        headers={"Idempotency-Key": key},
                                    )
                                except httpx.HTTPError:
                                    continue
                                if r.status_code == 503:
                                    await trio.sleep(0.05)  # the retry's pace, not a wait
                                    continue
                                assert r.status_code in (200, 201), r.text
                                break
                        acked[key] = (topic, r.json()["first_seq"])
                        if len(acked) >= 30:
                            enough.set()
                done += 1

            async with trio.open_nursery() as n:
                for j, f in enumerate(others):
                    n.start_soon(writer, f, f"w{j}")
                await enough.wait()
                await owner.kill()
            assert done == 2
            assert len(acked) == 120
            for topic in names:  # no seq reused, none skipped, no duplicate
                seqs = sorted(seq for t, seq in acked.values() if t == topic)
                assert seqs == list(range(1, len(seqs) + 1)), topic
            for f in others:
                async with http_client(f) as hc:
                    for topic in names:
                        r = await hc.post(
                            f"/v0/topics/{topic}/diff", json={"from_seq": 0, "limit": 1000}
                        )
                        got = {x["data"]: x["$seq"] for x in r.json()["records"]}
                        assert got == {k: seq for k, (t, seq) in acked.items() if t == topic}
            if shards == 1:
                assert sum("took the owner lease" in f.run.text for f in others) == 1
            assert all(f.run.problems() == [] for f in others)
        finally:
            for s in servers:
                with trio.CancelScope(shield=True):
                    await s.close()


async def test_a_client_failure_in_a_followers_catch_up_is_a_503_not_its_end(cluster):
    """A read-back that fails inside a follower's catch-up (a timeout while a server is
    stopped) is a `503` to the read that needed it, and the follower's notice loop,
    which catches up topics someone waits on, goes on: the front stays up."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        await _write(ca, "f", {"data": 0})
        assert await _data(cb, "f") == [0]
        store = _fronts(b).store
        real = store.read

        async def timing_out(*args):
            raise TimeoutError  # (what nats-py raises: an OSError, empty message)

        store.read = timing_out  # type: ignore[method-assign]
        topic_b = b.engine.topics["f"]
        got: list[dict] = []

        async def poll() -> None:
            r = await cb.post("/v0/topics/f/diff", json={"from_seq": 1, "wait_ms": 20_000})
            got.append(await _json(r))

        async with trio.open_nursery() as n:
            n.start_soon(poll)
            with trio.fail_after(10):
                while not topic_b.has_waiters:  # parked: the notice loop catches it up
                    await trio.testing.wait_all_tasks_blocked(0.01)
            await _write(ca, "f", {"data": 1})  # the notice's catch-up fails to read
            r = await cb.post("/v0/topics/f/diff", json={"from_seq": 1})
            err = (await _json(r, 503))["error"]
            assert err["code"] == "storage_unavailable"
            store.read = real  # type: ignore[method-assign]
            await _write(ca, "f", {"data": 2})  # the next notice catches it up
        assert [x["data"] for x in got[0]["records"]] == [1, 2]
        assert await _data(cb, "f") == [0, 1, 2]


async def test_two_writes_through_two_fronts_lazily_create_one_topic_once(cluster, monkeypatch):
    """Two first writes of one absent topic sent at once through the two fronts that do
    not own it, the owner holding the first creation until the second write has asked
    to create the topic too: the second waits for that creation (it does not loop on
    it, nor create a second instance), and both records land in the one topic."""
    from tests.jetstream.conftest import fronts_of, open_fronts

    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        name = next(f"w{i}" for i in range(400) if fr[0].owns(f"w{i}"))
        owner = hs[0].engine
        asked = 0
        both_asked = trio.Event()
        real_lazy, real_control = owner._lazy_create, owner.commit.control

        async def lazy_create(topic, req):
            nonlocal asked
            if topic == name:
                asked += 1
                assert asked <= 2, "the owner loops on the topic's creation"
                if asked == 2:
                    both_asked.set()
            return await real_lazy(topic, req)

        async def control(topic, frame, apply, **kw):
            if topic.name == name and not both_asked.is_set():
                await both_asked.wait()  # (the first creation, held)
            return await real_control(topic, frame, apply, **kw)

        monkeypatch.setattr(owner, "_lazy_create", lazy_create)
        monkeypatch.setattr(owner.commit, "control", control)
        got: dict[int, dict] = {}

        async def write(i: int) -> None:
            got[i] = await _write(hs[i].app.test_client(), name, {"data": i})

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(write, 1)
                nursery.start_soon(write, 2)
        assert asked == 2
        assert sorted(w["created"] for w in got.values()) == [False, True]
        assert sorted(w["first_seq"] for w in got.values()) == [1, 2]
        for h in hs:
            assert sorted(await _data(h.app.test_client(), name)) == [1, 2]


async def test_a_call_the_owner_holds_past_the_request_timeout_is_answered(cluster):
    # a claim waits out its queue's coalescing window on the owner (as a bypassing
    # write waits out a full queue): a follower forwarding it waits that long on top of
    # `request_timeout_ms`, instead of answering `503` while the owner is still at it
    cfg = _timeout(_sharded(cluster, 1), 1500)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        assert (_fronts(a).owner, _fronts(b).owner) == (True, False)
        cb = b.app.test_client()
        r = await cb.put("/v0/topics/q", json={"type": "queue", "claim_jitter_ms": 3000})
        assert r.status_code == 201, await r.get_data()
        await _write(cb, "q", {"data": 1})
        t0 = trio.current_time()
        r = await cb.post("/v0/topics/q/claim", json={"node": "w"})
        body = await _json(r, 200)
        assert trio.current_time() - t0 >= 3.0  # the window ran out on the owner
        assert [j["$seq"] for j in body["claimed"]] == [1]


async def test_a_write_the_owner_is_stuck_on_answers_503_after_the_request_timeout(cluster):
    # an owner stuck on a write (its stream's leader gone: the publish, then the read
    # of its outcome, each wait out the request timeout) holds a follower's client no
    # longer than the follower's request timeout: only a call the owner holds on
    # purpose (a bypassing write, a claim's window) waits longer
    cfg = _timeout(_sharded(cluster, 1), 1500)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        assert (_fronts(a).owner, _fronts(b).owner) == (True, False)
        ca, cb = a.app.test_client(), b.app.test_client()
        await _write(ca, "t", {"data": 0})
        append = a.engine.append

        async def stuck(*args, **kwargs):
            await trio.sleep(4.0)  # (the owner's stuck publish, simulated)
            return await append(*args, **kwargs)

        a.engine.append = stuck  # type: ignore[method-assign]
        t0 = trio.current_time()
        r = await cb.post("/v0/topics/t", json={"records": [{"data": 1}]})
        assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
        assert trio.current_time() - t0 < 3.5
        t0 = trio.current_time()
        r = await cb.post(
            "/v0/topics/t", json={"records": [{"data": 2}], "disable_backpressure": True}
        )
        assert r.status_code == 200, await r.get_data()
        assert trio.current_time() - t0 >= 4.0
        a.engine.append = append  # type: ignore[method-assign]
        # the write answered 503 landed on the owner meanwhile (its outcome was unknown)
        assert sorted(await _data(ca, "t")) == [0, 1, 2]


async def test_a_shard_taken_over_after_a_failover_is_kept_a_while_before_balance(cluster):
    """A front whose term ran out (cut off from NATS) loses its shard to another; when it
    is back, the other gives no shard up for an even share until `BALANCE_HOLD_TERMS`
    terms after the takeover: a handover right after a failover costs the shard's
    topics the new owner's catch-up while the cluster recovers (the chaos runs' `stop`
    fault)."""
    cfg = _sharded(cluster, 2)
    lease_ms = cfg.storage.jetstream.lease_ms
    clock = FakeWallClock()
    async with open_jetstream_app(cfg, clock) as a, open_jetstream_app(cfg, clock) as b:
        fa, fb = _fronts(a), _fronts(b)
        await _balance(a, b)  # (`a` hands a shard over: no hold)
        assert len(fa.owned) == len(fb.owned) == 1
        fa._tend_lease = trio.lowlevel.checkpoint  # `a` is cut off: nothing renewed
        clock.jump(lease_ms + 1)
        await fb._tend_lease()  # `a`'s term and membership ran out: `b` takes its shard
        assert fb.owned == {0, 1}
        del fa._tend_lease  # `a` is back
        await fa._tend_lease()  # a member again; its renewal fails: it follows
        assert not fa.owned
        await fb._tend_lease()  # `b` counts `a` again: over its share, it keeps both
        assert fb.live == 2 and fb.owned == {0, 1}
        clock.jump(BALANCE_HOLD_TERMS * lease_ms)
        await fb._tend_lease()  # (renewed; `a`'s membership ran out meanwhile)
        await fa._tend_lease()
        await fb._tend_lease()  # the hold is over: `b` gives one shard up
        assert len(fb.owned) == 1
        await fa._tend_lease()  # `a` takes it
        assert len(fa.owned) == 1 and fa.owned | fb.owned == {0, 1}
        for j, h in enumerate((a, b)):
            w = await _write(h.app.test_client(), "after", {"data": j})
            assert w["first_seq"] == j + 1


async def test_an_owner_alone_only_lately_steps_down_at_its_term(cluster):
    """An owner that counts itself alone only lately (the others' memberships lapsed:
    cut off) and whose lease check is then stuck (a server that stopped answering) steps
    down when its term runs out: the others may be back and take the shard by expiry,
    and as an owner it would answer reads from memory without their writes (a chaos
    run's `stop` fault: two owners for 2.6 s). Alone for `ALONE_AFTER_TERMS` terms, it
    keeps the shard (a one-front deployment)."""
    cfg = _sharded(cluster, 1)
    lease_ms = cfg.storage.jetstream.lease_ms
    clock = FakeWallClock()
    async with open_jetstream_app(cfg, clock) as a, open_jetstream_app(cfg, clock) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        fa, fb = _fronts(a), _fronts(b)
        await _write(ca, "s", {"data": 1})
        await fa._tend_lease()  # (`a` counts `b` among the members)
        assert fa.live == 2
        fb._tend_lease = trio.lowlevel.checkpoint  # `b` is cut off: no renewals
        clock.jump(lease_ms + 1)
        await fa._tend_lease()  # `b`'s membership ran out: `a` counts itself alone
        assert fa.owner and fa.live == 1
        fa.check_terms()  # within its term
        assert fa.owner
        fa._tend_lease = trio.lowlevel.checkpoint  # `a`'s lease check is stuck from now on
        clock.jump(lease_ms + 1)
        fa.check_terms()  # term over, alone only lately: it steps down
        assert not fa.owner
        del fb._tend_lease  # `b` is back: it takes the lease by expiry and writes
        await fb._tend_lease()
        assert fb.owner
        w = await _write(cb, "s", {"data": 2})
        assert w["first_seq"] == 2
        assert await _data(ca, "s") == [1, 2]  # `a` catches up: no stale read
        # `a` stays cut off: ten terms on, `b` is alone and keeps its shard past a term
        clock.jump(ALONE_AFTER_TERMS * lease_ms)
        await fb._tend_lease()
        assert fb.live == 1
        fb._tend_lease = trio.lowlevel.checkpoint
        clock.jump(lease_ms + 1)
        fb.check_terms()
        assert fb.owner


async def test_a_read_on_a_deposed_owner_still_publishing_waits_for_its_writes(cluster):
    """A front that stepped down while a write it took as the owner is still being
    published answers a read only after that write settled, with the new owner's writes
    read in: not from memory while its lane is busy (a stale read, the chaos runs'
    short read after a `stop` fault)."""
    import asyncio

    cfg = _sharded(cluster, 1)
    lease_ms = cfg.storage.jetstream.lease_ms
    clock = FakeWallClock()
    async with open_jetstream_app(cfg, clock) as a, open_jetstream_app(cfg, clock) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        fa, fb = _fronts(a), _fronts(b)
        await _write(ca, "s", {"data": 1})
        store = fa.store
        publish = store.publish

        async def slow(*args, **kwargs):
            await asyncio.sleep(3.0)  # (a publish waiting on a stopped leader, simulated)
            return await publish(*args, **kwargs)

        store.publish = slow  # type: ignore[method-assign]
        statuses: list[int] = []

        async def late_write() -> None:
            r = await ca.post("/v0/topics/s", json={"records": [{"data": "late"}]})
            statuses.append(r.status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(late_write)
            await trio.sleep(0.5)  # (real time: the write reaches the publish)
            assert fa.backend.lane(a.engine.topics["s"]).busy
            await fa._tend_lease()  # (`a` counts `b` among the members)
            assert fa.live == 2
            fa._tend_lease = trio.lowlevel.checkpoint  # `a`'s lease check is stuck
            clock.jump(lease_ms + 1)
            fa.check_terms()  # `a`'s term ran out: it steps down
            assert not fa.owner
            await fb._tend_lease()  # `b` takes the lease by expiry and writes
            assert fb.owner
            w = await _write(cb, "s", {"data": 2})
            assert w["first_seq"] == 2
            # `a`'s late write is still in its lane: the read waits for it to settle
            assert await _data(ca, "s") == [1, 2]
        assert statuses == [503]  # (fenced out: `b` wrote seq 2 first)
        store.publish = publish  # type: ignore[method-assign]
