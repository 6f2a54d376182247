"""Routers on the jetstream backend: definitions, cursors and copies across a restart.

Method: a router is created and fed through the HTTP API on one front; the front is then
closed (in process) or killed with `SIGKILL` (`topicd serve`), and a new front rebuilds
from JetStream alone (an empty data directory). The copies are stored records of the
destination's stream (materialized), so the destination must come back exactly as it
was, and copying must go on from where it stopped: every source record copied once, none
twice, none skipped. The kill test logs cursors to the registry only once a minute, so a
new front can only learn where copying stopped from the cursors the copy batches carry.
With several owner fronts, a router runs on its destination's owner: a router created
through a front that owns neither topic, and the destination's owner killed among three
`topicd serve` fronts while the source is flooded through the others.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import httpx
import pytest
import trio

from tests.crash.harness import client as http_client
from tests.crash.harness import serving
from tests.jetstream.conftest import jetstream_config, open_jetstream_app
from topicd.engine import payloads

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(payloads, "CHUNK_SHIFT", 0)


async def _json(r, status: int) -> dict:
    raw = await r.get_data()
    assert r.status_code == status, raw
    return json.loads(raw)


async def _write(c, topic: str, *records) -> dict:
    r = await c.post(f"/v0/topics/{topic}", json={"records": list(records)})
    assert r.status_code in (200, 201), await r.get_data()
    return json.loads(await r.get_data())


async def _records(c, topic: str) -> list[tuple[int, object, str | None]]:
    r = await c.post(
        f"/v0/topics/{topic}/diff", json={"from_seq": 0, "limit": 1000, "include_tags": True}
    )
    return [(x["$seq"], x["data"], x.get("$tag")) for x in (await _json(r, 200))["records"]]


async def test_routers_and_their_copies_survive_a_restart(cluster):
    """Definitions, cursors, copies, holes (a filter), a direct write between copies and
    a deleted router all come back from JetStream; nothing is copied again, and copying
    goes on at the next destination seqs."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        r = await c.put("/v0/routers/eu", json={"source": "a", "dest": "b", "filter": "eu:*"})
        await _json(r, 201)
        r = await c.put("/v0/routers/gone", json={"source": "a", "dest": "g"})
        await _json(r, 201)
        await _write(c, "a", {"data": 1, "tag": "eu:x"}, {"data": 2, "tag": "us"})
        await _write(c, "b", {"data": "direct"})
        await _write(c, "a", {"data": 3, "tag": "eu:y"})
        before = await _records(c, "b")
        assert before == [(1, 1, "eu:x"), (3, "direct", None), (4, 3, "eu:y")]
        await _json(await c.delete("/v0/routers/gone"), 200)
        state = await _json(await c.get("/v0/routers/eu"), 200)
        assert (state["forwarded_total"], state["cursor_lag"]) == (3, 0)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        assert await _records(c, "b") == before
        assert (await _json(await c.get("/v0/topics/b"), 200))["head_seq"] == 4
        again = await _json(await c.get("/v0/routers/eu"), 200)
        assert {k: again[k] for k in ("source", "dest", "filter", "forwarded_total")} == {
            "source": "a",
            "dest": "b",
            "filter": ["tag", "Glob", "eu:*"],
            "forwarded_total": 3,
        }
        r = await c.get("/v0/routers/gone")
        assert (await _json(r, 404))["error"]["code"] == "router_not_found"
        await _write(c, "a", {"data": 4, "tag": "eu:z"})
        assert (await _records(c, "b"))[len(before) :] == [(5, 4, "eu:z")]
        # deleting the source removes the router, and a rebuild does not bring it back
        await _json(await c.delete("/v0/topics/a"), 200)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        r = await c.get("/v0/routers/eu")
        assert (await _json(r, 404))["error"]["code"] == "router_not_found"
        assert [s for s, _, _ in await _records(c, "b")] == [1, 3, 4, 5]


async def test_topicd_serve_killed_while_copying_copies_each_record_once(cluster, tmp_path):
    """`topicd serve` killed with SIGKILL while a writer floods a router's source: a new
    front on an empty data directory copies every source record the old one had not,
    and none it had (the destination holds each source record once, in order, at the
    source's seqs: both topics started empty)."""
    env = {
        **cluster.env(),
        "TOPICD_JETSTREAM_PREFIX": "routers9",
        "TOPICD_ROUTER_CURSOR_LOG_MS": "60000",  # the copy batches' cursors must do
    }
    async with serving(tmp_path, env=env) as server:
        async with http_client(server) as hc:
            r = await hc.put("/v0/routers/s->d", json={"source": "s", "dest": "d"})
            assert r.status_code == 201, r.text
            enough = trio.Event()
            acked = []

            async def flood() -> None:
                async with http_client(server) as hc2:
                    for i in range(100_000):
                        try:
                            r = await hc2.post(
                                "/v0/topics/s", json={"records": [{"data": i}, {"data": -i}]}
                            )
                        except httpx.HTTPError:
                            return  # the front is gone
                        acked.append(r.json()["first_seq"])
                        if len(acked) >= 150:
                            enough.set()

            async with trio.open_nursery() as n:
                n.start_soon(flood)
                await enough.wait()
                await server.kill()
        server.data_dir = tmp_path / "empty-data-dir"
        await server.start()
        async with http_client(server) as hc:
            r = await hc.post("/v0/topics/s/diff", json={"from_seq": 0, "limit": 100000})
            source = [(x["$seq"], x["data"]) for x in r.json()["records"]]
            assert len(source) >= 2 * len(acked)
            r = await hc.post("/v0/topics/d/diff", json={"from_seq": 0, "limit": 100000})
            copies = [(x["$seq"], x["data"]) for x in r.json()["records"]]
            assert copies == source
            state = (await hc.get("/v0/routers/s->d")).json()
            assert (state["forwarded_total"], state["cursor_lag"]) == (len(source), 0)
        assert server.run.problems() == []


def _names_by_shard(shards: int) -> dict[int, str]:
    """A topic name for each of `shards` shards."""
    from topicd.storage.jsfronts import Fronts

    names: dict[int, str] = {}
    for i in range(200):
        names.setdefault(Fronts.shard_of_name(f"k{i}", shards), f"k{i}")
    assert len(names) == shards
    return names


async def test_a_router_created_on_a_follower_runs_on_the_destinations_owner(cluster):
    """Three fronts, one shard each; source and destination on two of them. The router
    is created through the third front: it runs on the destination's owner only (the
    source caught up there as a follower), every front answers `GET` and the listing
    alike, writes through every front are copied once at their seqs, and a delete
    through a follower stops it everywhere."""
    from tests.jetstream.conftest import fronts_of, open_fronts

    src, dst = _names_by_shard(3)[1], _names_by_shard(3)[2]
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        runner = next(i for i, f in enumerate(fr) if f.owns(dst))
        third = next(i for i, f in enumerate(fr) if not f.owns(dst) and not f.owns(src))
        cs = [h.app.test_client() for h in hs]
        r = await cs[third].put("/v0/routers/r", json={"source": src, "dest": dst})
        assert (await _json(r, 201))["router"] == "r"
        assert [list(h.engine.routers.routers) for h in hs] == [
            ["r"] if i == runner else [] for i in range(3)
        ]
        for i, c in enumerate(cs):
            await _write(c, src, {"data": i, "tag": f"t{i}"})
        await _write(cs[third], dst, {"data": "direct"})
        await _write(cs[0], src, {"data": 3})
        want = [(1, 0, "t0"), (2, 1, "t1"), (3, 2, "t2"), (4, "direct", None), (5, 3, None)]
        for c in cs:
            assert await _records(c, dst) == want
            state = await _json(await c.get("/v0/routers/r"), 200)
            assert (state["forwarded_total"], state["cursor_lag"]) == (4, 0)
            listed = (await _json(await c.get("/v0/routers"), 200))["routers"]
            assert [(x["router"], x["forwarded_total"]) for x in listed] == [("r", 4)]
        # the repoint and fan-in refusals see the router from every front
        r = await cs[third].put("/v0/routers/r", json={"source": src, "dest": "elsewhere"})
        assert (await _json(r, 409))["error"]["detail"]["reason"] == "router_repoint_forbidden"
        r = await cs[third].put("/v0/routers/r2", json={"source": "other", "dest": dst})
        assert (await _json(r, 409))["error"]["detail"]["reason"] == "router_dest_fan_in"
        assert (await _json(await cs[third].delete("/v0/routers/r"), 200))["deleted"] is True
        await _write(cs[0], src, {"data": 4})
        for c in cs:
            assert await _records(c, dst) == want
            r = await c.get("/v0/routers/r")
            assert (await _json(r, 404))["error"]["code"] == "router_not_found"
        assert all(not h.engine.routers.routers for h in hs)


async def test_a_cycle_across_fronts_stops_at_the_hop_cap_and_is_known_everywhere(cluster):
    """Two routers closing a cycle between topics of two fronts, each created through the
    third: both runners mark their router as on a cycle before the second `PUT` is
    answered, a record loops to the hop cap (the hop counts travel with the copies
    between fronts) and a read through any front sees all of it; deleting one router
    takes the other off the cycle on its runner before the `DELETE` is answered, so a
    later record is copied once, with no hop count."""
    from tests.jetstream.conftest import fronts_of, open_fronts

    names = _names_by_shard(3)
    p, q = names[1], names[2]
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        run_q = next(i for i, f in enumerate(fr) if f.owns(q))
        run_p = next(i for i, f in enumerate(fr) if f.owns(p))
        third = 3 - run_p - run_q
        cs = [h.app.test_client() for h in hs]
        await _json(await cs[third].put("/v0/routers/pq", json={"source": p, "dest": q}), 201)
        assert hs[run_q].engine.routers.routers["pq"].cyclic is False
        r = await cs[third].put(
            "/v0/routers/qp", json={"source": q, "dest": p, "allow_cycle": True}
        )
        await _json(r, 201)
        assert hs[run_q].engine.routers.routers["pq"].cyclic is True
        assert hs[run_p].engine.routers.routers["qp"].cyclic is True
        await _write(cs[third], p, {"data": 1})
        # p(0) q(1) p(2) q(3) p(4) q(5) p(6) q(7) p(8): the hop cap is 8
        assert [x[1] for x in await _records(cs[third], p)] == [1] * 5
        for c in cs:
            assert len(await _records(c, p)) == 5
            assert len(await _records(c, q)) == 4
        await _json(await cs[third].delete("/v0/routers/qp"), 200)
        assert hs[run_q].engine.routers.routers["pq"].cyclic is False
        await _write(cs[run_p], p, {"data": 2})
        for c in cs:
            assert [x[1] for x in await _records(c, q)] == [1, 1, 1, 1, 2]
            assert [x[1] for x in await _records(c, p)] == [1] * 5 + [2]


async def test_a_takeover_attaches_the_routers_and_copies_each_record_once(cluster):
    """Two fronts, one shard: the owner runs a router fed through both fronts, then
    closes with source records not copied yet (the router's registry cursor is never
    logged: only the copy batches carry it). The follower takes the lease, attaches the
    router at the cursor the destination's stream holds, and copies the rest: every
    source record once, at the source's seqs."""
    from tests.jetstream.test_fronts import _fronts

    cfg = jetstream_config(cluster)
    js = dataclasses.replace(cfg.storage.jetstream, lease_ms=600)
    routers = dataclasses.replace(cfg.routers, cursor_log_ms=600_000)
    cfg = dataclasses.replace(
        cfg, routers=routers, storage=dataclasses.replace(cfg.storage, jetstream=js)
    )
    a_up, b_up, a_copied, stop_a = trio.Event(), trio.Event(), trio.Event(), trio.Event()

    async def run_a() -> None:
        async with open_jetstream_app(cfg) as a:
            assert _fronts(a).owner
            ca = a.app.test_client()
            r = await ca.put("/v0/routers/s->d", json={"source": "s", "dest": "d"})
            await _json(r, 201)
            await _write(ca, "s", {"data": 1}, {"data": 2})
            assert [x[1] for x in await _records(ca, "d")] == [1, 2]
            a_up.set()
            await b_up.wait()
            assert [x[1] for x in await _records(ca, "d")] == [1, 2, 3, 4]
            a.engine.routers.forward = lambda *args, **kw: 0  # `a` copies nothing more
            await _write(ca, "s", {"data": 5})
            assert a.engine.routers.routers["s->d"].cursor == 4
            a_copied.set()
            await stop_a.wait()

    async with trio.open_nursery() as n:
        n.start_soon(run_a)
        await a_up.wait()
        async with open_jetstream_app(cfg) as b:
            assert not _fronts(b).owner
            cb = b.app.test_client()
            await _write(cb, "s", {"data": 3}, {"data": 4})  # (forwarded to the owner)
            b_up.set()
            await a_copied.wait()
            stop_a.set()
            with trio.fail_after(15):
                await _fronts(b).promoted.wait()
            assert _fronts(b).owner
            await _write(cb, "s", {"data": 6})
            source = [(s, x) for s, x, _ in await _records(cb, "s")]
            assert [x for _, x in source] == [1, 2, 3, 4, 5, 6]
            assert [(s, x) for s, x, _ in await _records(cb, "d")] == source
            state = await _json(await cb.get("/v0/routers/s->d"), 200)
            assert (state["forwarded_total"], state["cursor_lag"]) == (6, 0)


def _hold_copying(h) -> None:
    """The runner on front `h` copies only while a read has it catch a destination up
    (`freshen`: its own read, a follower's, a forwarded `GET`), never in the background:
    until a read asks, the destination's stream lacks the copies of source records
    acknowledged since."""
    routers = h.engine.routers
    real_forward, real_freshen = routers.forward, routers.freshen
    reading = 0

    def forward(dst, limit: int, now: int | None = None) -> int:
        return real_forward(dst, limit, now) if reading else 0

    async def freshen(dest, depth: int = 0) -> None:
        nonlocal reading
        reading += 1
        try:
            await real_freshen(dest, depth)
        finally:
            reading -= 1

    routers.forward = forward
    routers.freshen = freshen


async def test_a_followers_read_after_a_takeover_asks_the_runner_the_lease_names(cluster):
    """The race of the `SIGKILL` test below, made deterministic. Three fronts, one shard
    each; a router between two of them, created through the third, whose runner copies
    only when a read asks (`_hold_copying`). Both followers still name a gone front as
    the destination's owner (nobody listens on its subject: the owner was killed and its
    shard taken over before their next lease check). A read of the destination through
    either (one that knows the router, one that does not) finds the runner through the
    lease, and answers after the runner's copies are stored; `GET` agrees. With the
    lease naming the gone front too (no front owns the shard yet), both answer `503
    storage_unavailable`, never fewer records than the router has copied; once the
    destination is deleted, a `404`."""
    from tests.jetstream.conftest import fronts_of, open_fronts

    names = _names_by_shard(3)
    src, dst = names[1], names[2]
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        runner = next(i for i, f in enumerate(fr) if f.owns(dst))
        feeder = next(i for i, f in enumerate(fr) if f.owns(src))
        third = 3 - runner - feeder
        cs = [h.app.test_client() for h in hs]
        r = await cs[third].put("/v0/routers/r", json={"source": src, "dest": dst})
        await _json(r, 201)
        _hold_copying(hs[runner])
        for i in range(3):
            await _write(cs[feeder], src, {"data": i})
        k = fr[runner].shard_of(dst)
        gone = f"{fr[runner].store.prefix}.fwd.gone"
        tid = hs[runner].engine.topics[dst].topic_id
        known = [{b.get("dest_id") for b in h.engine.routers.known.values()} for h in hs]
        assert tid in known[third] and tid not in known[feeder]

        fr[third].owner_subjects[k] = fr[feeder].owner_subjects[k] = gone
        assert [x[1] for x in await _records(cs[third], dst)] == [0, 1, 2]
        await _write(cs[feeder], src, {"data": 3})
        assert [x[1] for x in await _records(cs[feeder], dst)] == [0, 1, 2, 3]
        assert fr[third].owner_subjects[k] == fr[feeder].owner_subjects[k] == fr[runner].subject
        fr[third].owner_subjects[k] = fr[feeder].owner_subjects[k] = gone
        for i in (third, feeder):
            state = await _json(await cs[i].get("/v0/routers/r"), 200)
            assert (state["forwarded_total"], state["cursor_lag"]) == (4, 0)

        # the lease names the gone front as well: no front runs the router now
        store, bridge = fr[runner].store, fr[runner].backend.bridge
        _, rev = await bridge.call(partial(store.lease, k))
        ghost = {"front": "gone", "subject": gone, "until_ms": 2**53}
        assert await bridge.call(partial(store.write_lease, ghost, rev, k)) is not None
        fr[third].owner_subjects[k] = fr[feeder].owner_subjects[k] = gone
        await _write(cs[feeder], src, {"data": 4})
        for i in (third, feeder):
            r = await cs[i].post(f"/v0/topics/{dst}/diff", json={"from_seq": 0})
            assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
            assert r.headers["Retry-After"] == "1"
            r = await cs[i].get("/v0/routers/r")
            assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
        del hs[runner].engine.routers.forward  # (copying let go: the runner's own read)
        assert [x[1] for x in await _records(cs[runner], dst)] == [0, 1, 2, 3, 4]
        # a destination deleted meanwhile (`third` still lists the router): a 404
        for i in (third, feeder):
            fr[i].store.ignore_notices = True  # (they still hold the topic)
        await _json(await cs[runner].delete(f"/v0/topics/{dst}"), 200)
        assert tid in {b.get("dest_id") for b in hs[third].engine.routers.known.values()}
        for i in (third, feeder):
            r = await cs[i].post(f"/v0/topics/{dst}/diff", json={"from_seq": 0})
            assert (await _json(r, 404))["error"]["code"] == "topic_not_found"


async def test_a_front_taking_a_shard_over_answers_reads_once_its_routers_run(cluster):
    """A front taking over the shard of a router's destination attaches the router
    before it owns the shard: held between its catch-up and the router's attach, it
    does not answer a follower's read of the destination as the owner, so the read
    answers `503 storage_unavailable` rather than the records the stream holds before
    the copies; once it owns the shard, the read answers every copy."""
    from tests.jetstream.conftest import fronts_of, open_fronts

    names = _names_by_shard(3)
    src, dst = names[1], names[2]
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        old = next(i for i, f in enumerate(fr) if f.owns(dst))
        feeder = next(i for i, f in enumerate(fr) if f.owns(src))
        third = 3 - old - feeder
        cs = [h.app.test_client() for h in hs]
        r = await cs[third].put("/v0/routers/r", json={"source": src, "dest": dst})
        await _json(r, 201)
        await _write(cs[feeder], src, {"data": 0})
        assert [x[1] for x in await _records(cs[third], dst)] == [0]
        k = fr[old].shard_of(dst)
        await fr[old]._give_up(k, "the test hands it over")
        await _write(cs[feeder], src, {"data": 1}, {"data": 2})  # (nobody copies them)

        # the feeder takes the shard over, held just before its routers are attached
        taker = hs[feeder].engine.routers
        _hold_copying(hs[feeder])
        real_rebuild, held, go = taker.rebuild, trio.Event(), trio.Event()

        async def rebuild(**kw) -> int:
            held.set()
            await go.wait()
            return await real_rebuild(**kw)

        taker.rebuild = rebuild
        async with trio.open_nursery() as n:

            async def take() -> None:
                assert await fr[feeder]._check_shard(k, may_take=True)
                await fr[feeder]._promote(k)

            n.start_soon(take)
            await held.wait()
            r = await cs[third].post(f"/v0/topics/{dst}/diff", json={"from_seq": 0})
            assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
            go.set()
        assert fr[feeder].owns(dst) and "r" in taker.routers
        assert [x[1] for x in await _records(cs[third], dst)] == [0, 1, 2]
        state = await _json(await cs[third].get("/v0/routers/r"), 200)
        assert (state["forwarded_total"], state["cursor_lag"]) == (3, 0)


async def test_kill9_of_the_destinations_owner_among_three_fronts(cluster, tmp_path):
    """Three `topicd serve` fronts, three shards: the first front keeps the
    destination's shard (the others take the rest as they join), the source is another
    front's. The router is created through a follower; writers on the two other fronts
    flood the source (idempotency keys, retried on 503 or a lost connection) while the
    destination's owner is killed with SIGKILL. A survivor takes the shard, attaches
    the router at the cursor the destination's stream holds and copies the rest: on
    both survivors each acknowledged source record is in the destination once, at its
    source seq (both topics started empty), and nothing else."""
    from tests.crash.harness import Server

    names = _names_by_shard(3)
    src, dst = names[1], names[0]  # (the first front gives up the highest shards first)
    env = {
        **cluster.env(),
        "TOPICD_JETSTREAM_PREFIX": "routers9x3",
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": "1500",
        "TOPICD_STORAGE_JETSTREAM_SHARDS": "3",
        "TOPICD_ROUTER_CURSOR_LOG_MS": "60000",
    }
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
            with trio.fail_after(30):  # (the lease checks of other processes)
                for f in others:
                    # a shard the first front gave up before this one started is taken
                    # at start ("owner of shards [2] of 3"), else at a lease check
                    if f.run.has_line("owner of shards [] of"):
                        assert await f.run.wait_line("took the owner lease")
            async with http_client(others[0]) as hc:
                r = await hc.put("/v0/routers/s->d", json={"source": src, "dest": dst})
                assert r.status_code == 201, r.text
            acked: dict[str, int] = {}
            enough = trio.Event()

            async def writer(server: Server, who: str) -> None:
                async with http_client(server) as hc:
                    for i in range(40):
                        key = f"{who}-{i}"
                        with trio.fail_after(30):
                            while True:
                                try:
                                    r = await hc.post(
                                        f"/v0/topics/{src}",
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
                        acked[key] = r.json()["first_seq"]
                        if len(acked) >= 30:
                            enough.set()

            async with trio.open_nursery() as n:
                for j, f in enumerate(others):
                    n.start_soon(writer, f, f"w{j}")
                await enough.wait()
                await owner.kill()
            assert len(acked) == 80
            with trio.fail_after(30):  # (the survivors' lease checks: a third of lease_ms)
                async with trio.open_nursery() as n:  # (whichever survivor takes it)

                    async def took(f: Server) -> None:
                        if await f.run.wait_line("took the owner lease of shard 0"):
                            n.cancel_scope.cancel()

                    for f in others:
                        n.start_soon(took, f)
            assert any(f.run.has_line("took the owner lease of shard 0") for f in others)
            want = sorted((seq, key) for key, seq in acked.items())
            assert [s for s, _ in want] == list(range(1, 81))
            for f in others:
                async with http_client(f) as hc:
                    r = await hc.post(f"/v0/topics/{src}/diff", json={"limit": 1000})
                    assert [(x["$seq"], x["data"]) for x in r.json()["records"]] == want
                    r = await hc.post(f"/v0/topics/{dst}/diff", json={"limit": 1000})
                    assert [(x["$seq"], x["data"]) for x in r.json()["records"]] == want
                    state = (await hc.get("/v0/routers/s->d")).json()
                    assert (state["forwarded_total"], state["cursor_lag"]) == (80, 0)
            assert sum("took the owner lease of shard 0" in f.run.text for f in others) == 1
            assert all(f.run.problems() == [] for f in others)
        finally:
            for s in servers:
                with trio.CancelScope(shield=True):
                    await s.close()


async def test_kill9_of_the_owner_front_while_copying_then_a_takeover(cluster, tmp_path):
    """Two `topicd serve` fronts, one shard: the owner runs a router whose source a writer
    on the other front floods (idempotency keys, retried on 503 or a lost connection);
    the owner is killed with SIGKILL. The survivor takes the lease, attaches the router
    at the cursor the destination's stream holds (the registry cursor is logged once a
    minute), and copies the rest: each acknowledged source record once in the
    destination, at its source seq (both topics started empty), nothing else."""
    from tests.crash.harness import Server

    env = {
        **cluster.env(),
        "TOPICD_JETSTREAM_PREFIX": "routers9t",
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": "1500",
        "TOPICD_ROUTER_CURSOR_LOG_MS": "60000",
    }
    async with trio.open_nursery() as nursery:
        servers = []
        for i in range(2):
            (tmp_path / f"f{i}").mkdir()
            s = Server(nursery, tmp_path / f"f{i}")
            s.extra_env = dict(env)
            await s.start()
            servers.append(s)
        try:
            owner, other = servers
            assert ": owner" in owner.run.text
            async with http_client(owner) as hc:
                r = await hc.put("/v0/routers/s->d", json={"source": "s", "dest": "d"})
                assert r.status_code == 201, r.text
            acked: dict[str, int] = {}
            enough = trio.Event()
            async with http_client(other) as hc:
                for i in range(80):
                    key = f"w{i}"
                    with trio.fail_after(30):
                        while True:
                            try:
                                r = await hc.post(
                                    "/v0/topics/s",
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
                    acked[key] = r.json()["first_seq"]
                    if len(acked) == 30:
                        await owner.kill()
                        enough.set()
                assert enough.is_set()
                assert "took the owner lease" in other.run.text
                r = await hc.post("/v0/topics/s/diff", json={"from_seq": 0, "limit": 1000})
                source = [(x["$seq"], x["data"]) for x in r.json()["records"]]
                assert source == sorted((seq, key) for key, seq in acked.items())
                r = await hc.post("/v0/topics/d/diff", json={"from_seq": 0, "limit": 1000})
                assert [(x["$seq"], x["data"]) for x in r.json()["records"]] == source
                state = (await hc.get("/v0/routers/s->d")).json()
                assert (state["forwarded_total"], state["cursor_lag"]) == (len(source), 0)
            assert other.run.problems() == []
        finally:
            for s in servers:
                with trio.CancelScope(shield=True):
                    await s.close()


def _barrier(n: int):
    """A `graph_hook`: the first `n` calls wait until all `n` have come (two `PUT`s
    checked, neither written yet); later calls (a loser's second try) go on."""
    arrived = 0
    all_in = trio.Event()

    async def hook() -> None:
        nonlocal arrived
        arrived += 1
        if arrived <= n:
            if arrived == n:
                all_in.set()
            await all_in.wait()

    return hook


async def _race(puts) -> list[tuple[int, dict]]:
    """Send the `PUT`s at once; their answers (status, body), in order."""
    out: list[tuple[int, dict]] = [(0, {})] * len(puts)

    async def one(i, c, name, body) -> None:
        r = await c.put(f"/v0/routers/{name}", json=body)
        out[i] = (r.status_code, json.loads(await r.get_data()))

    async with trio.open_nursery() as nursery:
        for i, (c, name, body) in enumerate(puts):
            nursery.start_soon(one, i, c, name, body)
    return out


async def test_racing_puts_on_two_runners_one_wins_as_on_one_process(cluster):
    """Conflicting `PUT`s sent at once to the runners of two destinations, held between
    their checks and their writes until both have checked (the graph fault point): the
    same new name with two destinations, two routers that together close a cycle, and
    two routers for the last place under `limits.max_routers`. Each time exactly one
    is created and the other gets the refusal one process gives the later of the two;
    every front then shows the same single router."""
    from tests.jetstream.conftest import fronts_of, open_fronts
    from topicd.storage.jsfronts import Fronts

    by_shard: dict[int, list[str]] = {}
    for i in range(400):
        by_shard.setdefault(Fronts.shard_of_name(f"k{i}", 3), []).append(f"k{i}")
    src, (d1, p, x), (d2, q, y) = by_shard[0][0], by_shard[1][:3], by_shard[2][:3]
    base = jetstream_config(cluster)
    cfg = dataclasses.replace(base, limits=dataclasses.replace(base.limits, max_routers=3))
    async with open_fronts(cfg) as hs:
        fr = [fronts_of(h) for h in hs]
        cs = [h.app.test_client() for h in hs]
        at = {t: next(i for i, f in enumerate(fr) if f.owns(t)) for t in (d1, d2)}
        # (the endpoints exist: the auto-create race has its own test below)

        def hold() -> None:
            hook = _barrier(2)
            for h in hs:
                h.engine.routers.graph_hook = hook

        for t in (src, d1, d2, p, q, x, y):
            await _write(cs[0], t, {"data": t})
        # one name, two destinations
        hold()
        got = await _race(
            [
                (cs[at[d1]], "r", {"source": src, "dest": d1}),
                (cs[at[d2]], "r", {"source": src, "dest": d2}),
            ]
        )
        assert sorted(s for s, _ in got) == [201, 409], got
        lost = next(b for s, b in got if s == 409)["error"]
        assert lost["detail"]["reason"] == "router_repoint_forbidden"
        won = d1 if got[0][0] == 201 else d2
        assert lost["detail"]["existing_dest"] == won
        for c in cs:
            assert (await _json(await c.get("/v0/routers/r"), 200))["dest"] == won
        assert sum("r" in h.engine.routers.routers for h in hs) == 1

        # two routers closing a cycle (neither allows one)
        hold()
        got = await _race(
            [
                (cs[at[d1]], "up", {"source": q, "dest": p}),
                (cs[at[d2]], "down", {"source": p, "dest": q}),
            ]
        )
        assert sorted(s for s, _ in got) == [201, 409], got
        lost = next(b for s, b in got if s == 409)["error"]
        assert lost["code"] == "router_cycle"
        listed = (await _json(await cs[0].get("/v0/routers"), 200))["routers"]
        assert len(listed) == 2  # r and the winner

        # the last place under max_routers (3)
        hold()
        got = await _race(
            [
                (cs[at[d1]], "x", {"source": src, "dest": x}),
                (cs[at[d2]], "y", {"source": src, "dest": y}),
            ]
        )
        statuses = sorted(s for s, _ in got)
        assert statuses[0] in (200, 201) and statuses[1] == 429, got
        lost = next(b for s, b in got if s == 429)["error"]
        assert lost["detail"]["limit"] == "max_routers"
        for c in cs:
            assert len((await _json(await c.get("/v0/routers"), 200))["routers"]) == 3


async def test_a_source_deleted_through_its_owner_is_drained_by_the_runner_first(cluster):
    """The router's source on one front, its destination (and the router) on another
    that has not caught the source up (its notices and its poll held back): deleting the
    source through its owner first has the runner copy every source record acknowledged
    before the delete, as one process does; then the router is gone everywhere."""
    from tests.jetstream.conftest import fronts_of, open_fronts

    names = _names_by_shard(3)
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        src, dst = names[1], names[2]
        own = next(i for i, f in enumerate(fr) if f.owns(src))
        run = next(i for i, f in enumerate(fr) if f.owns(dst))
        cs = [h.app.test_client() for h in hs]
        await _json(await cs[run].put("/v0/routers/r", json={"source": src, "dest": dst}), 201)
        await _write(cs[own], src, {"data": 0})
        assert [x[1] for x in await _records(cs[run], dst)] == [0]
        routers = hs[run].engine.routers
        held = fr[run]

        async def no_poll() -> None:
            await trio.lowlevel.checkpoint()

        feeds_out, poll_once = routers.feeds_out, held.poll_once
        routers.feeds_out = lambda topic: False  # (its notices: nobody waits on src here)
        held.poll_once = no_poll
        try:
            for i in (1, 2, 3):
                await _write(cs[own], src, {"data": i})
            assert hs[run].engine.topics[src].head_seq == 1  # (not caught up)
            r = await cs[own].delete(f"/v0/topics/{src}")
            assert (await _json(r, 200))["routers_removed"] == ["r"]
        finally:
            routers.feeds_out, held.poll_once = feeds_out, poll_once
        await held.poll_once()  # (the runner learns of the delete: the router stops)
        assert not routers.routers
        for c in cs:
            assert [x[1] for x in await _records(c, dst)] == [0, 1, 2, 3]
            assert (await _json(await c.get("/v0/routers/r"), 404))["error"]["code"] == (
                "router_not_found"
            )


async def test_a_lost_cycle_notice_on_delete_converges_at_the_next_poll(cluster):
    """A router delete that takes its partner off a cycle: the notice to the partner's
    runner fails (a fault injected), the delete answers all the same, and the
    partner's runner re-reads the router graph at its next poll (its revision moved), so
    its router is off the cycle there too and a later record is copied once."""
    from tests.jetstream.conftest import fronts_of, open_fronts
    from topicd.errors import StorageUnavailable

    names = _names_by_shard(3)
    p, q = names[1], names[2]
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        run_q = next(i for i, f in enumerate(fr) if f.owns(q))
        run_p = next(i for i, f in enumerate(fr) if f.owns(p))
        cs = [h.app.test_client() for h in hs]
        await _json(await cs[run_q].put("/v0/routers/pq", json={"source": p, "dest": q}), 201)
        r = await cs[run_p].put(
            "/v0/routers/qp", json={"source": q, "dest": p, "allow_cycle": True}
        )
        await _json(r, 201)
        assert hs[run_q].engine.routers.routers["pq"].cyclic is True
        call = fr[run_p].router_call

        async def lossy(op: str, topic: str, router: str, body: bytes) -> dict[str, object]:
            if op == "router_reload":
                raise StorageUnavailable("injected", {})
            return await call(op, topic, router, body)

        fr[run_p].router_call = lossy
        try:
            await _json(await cs[run_p].delete("/v0/routers/qp"), 200)
        finally:
            fr[run_p].router_call = call
        assert hs[run_q].engine.routers.routers["pq"].cyclic is True  # (not told)
        await fr[run_q].poll_once()
        assert hs[run_q].engine.routers.routers["pq"].cyclic is False
        await _write(cs[run_p], p, {"data": 2})
        for c in cs:
            assert [x[1] for x in await _records(c, q)] == [2]


async def test_racing_puts_through_two_fronts_auto_create_one_absent_source(cluster, monkeypatch):
    """Two `PUT`s sent at once through the owners of two destinations, both naming one
    source that does not exist yet: each front asks the source's owner (a third front) to
    create it, and the owner holds the first creation until the second has asked too.
    The second waits for the first (it once looped on it without yielding, which blocked
    the owner's event loop — every front's, here, on one loop — for good); the source is
    created once, both routers are created, and both copy what is written to it."""
    from tests.jetstream.conftest import fronts_of, open_fronts
    from topicd.storage.jsfronts import Fronts

    by_shard: dict[int, list[str]] = {}
    for i in range(400):
        by_shard.setdefault(Fronts.shard_of_name(f"a{i}", 3), []).append(f"a{i}")
    src, d1, d2 = by_shard[0][0], by_shard[1][0], by_shard[2][0]
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        cs = [h.app.test_client() for h in hs]
        at = {t: next(i for i, f in enumerate(fr) if f.owns(t)) for t in (src, d1, d2)}
        assert len(set(at.values())) == 3
        for t in (d1, d2):
            await _write(cs[0], t, {"data": t})
        owner = hs[at[src]].engine
        asked = 0
        both_asked = trio.Event()
        real_default, real_control = owner.create_default, owner.commit.control

        async def create_default(name: str):
            nonlocal asked
            if name == src:
                asked += 1
                assert asked <= 2, "the owner spins on the source's creation"
                if asked == 2:
                    both_asked.set()
            return await real_default(name)

        async def control(topic, frame, apply, **kw):
            if topic.name == src and not both_asked.is_set():
                await both_asked.wait()  # (the first creation of the source, held)
            return await real_control(topic, frame, apply, **kw)

        monkeypatch.setattr(owner, "create_default", create_default)
        monkeypatch.setattr(owner.commit, "control", control)
        with trio.fail_after(60):
            got = await _race(
                [
                    (cs[at[d1]], "r1", {"source": src, "dest": d1}),
                    (cs[at[d2]], "r2", {"source": src, "dest": d2}),
                ]
            )
        assert [s for s, _ in got] == [201, 201], got
        assert asked == 2
        await _write(cs[at[src]], src, {"data": "x"})
        for c in cs:
            assert (await _json(await c.get(f"/v0/topics/{src}"), 200))["head_seq"] == 1
            for d in (d1, d2):
                assert [x[1] for x in await _records(c, d)] == [d, "x"]


async def test_a_router_put_and_a_first_write_through_two_fronts_create_one_source(
    cluster, monkeypatch
):
    """A first write of an absent topic and a router `PUT` naming it as its source, sent
    at once through the two fronts that do not own it, the owner holding the write's
    creation of the topic until the router's runner has asked for it too: the runner
    waits for that creation, and the router starts at the head the write left (no
    backfill) and copies the next write."""
    from tests.jetstream.conftest import fronts_of, open_fronts
    from topicd.storage.jsfronts import Fronts

    by_shard: dict[int, list[str]] = {}
    for i in range(400):
        by_shard.setdefault(Fronts.shard_of_name(f"b{i}", 3), []).append(f"b{i}")
    src, dest = by_shard[0][0], by_shard[1][0]
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        cs = [h.app.test_client() for h in hs]
        at_src, at_dest = (next(i for i, f in enumerate(fr) if f.owns(t)) for t in (src, dest))
        writer = ({0, 1, 2} - {at_src, at_dest}).pop()
        await _write(cs[0], dest, {"data": "d"})
        owner = hs[at_src].engine
        asked: list[str] = []
        both_asked, write_asked = trio.Event(), trio.Event()
        real_lazy, real_default = owner._lazy_create, owner.create_default
        real_control = owner.commit.control

        def ask(how: str) -> None:
            asked.append(how)
            assert len(asked) <= 2, f"the owner loops on the topic's creation: {asked}"
            if {"write", "ensure"} <= set(asked):
                both_asked.set()

        async def lazy_create(topic, req):
            if topic == src:
                ask("write")
                write_asked.set()
            return await real_lazy(topic, req)

        async def create_default(topic):
            if topic == src:
                with trio.fail_after(30):
                    await write_asked.wait()  # (the write's creation first)
                ask("ensure")
            return await real_default(topic)

        async def control(topic, frame, apply, **kw):
            if topic.name == src and not both_asked.is_set():
                await both_asked.wait()  # (the first creation, held)
            return await real_control(topic, frame, apply, **kw)

        monkeypatch.setattr(owner, "_lazy_create", lazy_create)
        monkeypatch.setattr(owner, "create_default", create_default)
        monkeypatch.setattr(owner.commit, "control", control)
        got: dict[str, object] = {}

        async def write() -> None:
            got["write"] = await _write(cs[writer], src, {"data": "first"})

        async def put() -> None:
            r = await cs[at_dest].put("/v0/routers/r", json={"source": src, "dest": dest})
            got["put"] = r.status_code

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(write)
                nursery.start_soon(put)
        assert asked == ["write", "ensure"]
        assert got["put"] == 201
        await _write(cs[writer], src, {"data": "next"})
        for c in cs:
            assert [x[1] for x in await _records(c, src)] == ["first", "next"]
            copied = [x[1] for x in await _records(c, dest)]
            # the router starts at the source's head when it was created: the first
            # write is copied only if the router came first
            assert copied in (["d", "next"], ["d", "first", "next"]), copied


async def test_a_router_delete_racing_its_topics_delete_leaves_no_registry_entry(cluster):
    """A router's `DELETE` and its source's (or its destination's) `DELETE` sent at
    once, through different fronts (the router's runner or a third front; the topic's
    owner), in both orders of sending: whichever wins, afterwards neither the router's
    entry nor its member of the router graph (`meta.routers`) nor the deleted topic's
    entry is left in the registry, the other topic's entry and records stay, and every
    front answers 404 for both."""
    from tests.jetstream.conftest import fronts_of, open_fronts
    from topicd.storage.jsfronts import Fronts
    from topicd.storage.jsrouters import ROUTER_PREFIX, router_graph, router_key

    by_shard: dict[int, list[str]] = {}
    for i in range(400):
        by_shard.setdefault(Fronts.shard_of_name(f"k{i}", 3), []).append(f"k{i}")
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        cs = [h.app.test_client() for h in hs]
        store = fr[0].store
        call = fr[0].backend.bridge.call
        for rnd in range(8):
            src, dst, name = by_shard[1][rnd], by_shard[2][rnd], f"r{rnd}"
            gone, kept = (src, dst) if rnd < 6 else (dst, src)  # (the last two: its dest)
            own = next(i for i, f in enumerate(fr) if f.owns(gone))
            run = next(i for i, f in enumerate(fr) if f.owns(dst))
            third = 3 - fr.index(next(f for f in fr if f.owns(src))) - run
            via = run if rnd % 2 else third  # (the router's DELETE: run there, or forwarded)
            r = await cs[run].put(f"/v0/routers/{name}", json={"source": src, "dest": dst})
            await _json(r, 201)
            await _write(cs[own], src, {"data": rnd})
            assert [x[1] for x in await _records(cs[run], dst)] == [rnd]
            gone_id = hs[own].engine.topics[gone].topic_id
            kept_id = hs[0].engine.topics[kept].topic_id
            answers: dict[str, tuple[int, dict]] = {}

            async def delete(key: str, c, path: str, into: dict = answers) -> None:
                r = await c.delete(path)
                into[key] = (r.status_code, json.loads(await r.get_data()))

            sends = [
                ("router", cs[via], f"/v0/routers/{name}"),
                ("topic", cs[own], f"/v0/topics/{gone}"),
            ]
            if rnd % 4 >= 2:
                sends.reverse()
            async with trio.open_nursery() as nursery:
                for key, c, path in sends:
                    nursery.start_soon(delete, key, c, path)
            assert answers["router"][0] == 200, answers
            assert answers["topic"][0] == 200 and answers["topic"][1]["deleted"], answers
            removed = answers["topic"][1]["routers_removed"]
            # the router went: by its own DELETE, or with its source (or both say so)
            assert answers["router"][1]["deleted"] or removed == [name], answers
            keys = await call(partial(store.keys_under, ROUTER_PREFIX))
            assert router_key(name)[len(ROUTER_PREFIX) :] not in keys, rnd
            graph, _ = await call(partial(router_graph, store))
            assert name not in graph, (rnd, graph)
            assert (await call(partial(store.entry, gone_id)))[0] is None, rnd
            assert (await call(partial(store.entry, kept_id)))[0] is not None, rnd
            for h, c in zip(hs, cs, strict=True):
                await h.engine.sync_listing()
                r = await c.get(f"/v0/routers/{name}")
                assert (await _json(r, 404))["error"]["code"] == "router_not_found"
                r = await c.get(f"/v0/topics/{gone}")
                assert (await _json(r, 404))["error"]["code"] == "topic_not_found"
                assert [x[1] for x in await _records(c, kept)] == [rnd]
                assert name not in h.engine.routers.routers


async def test_a_router_left_by_its_deleted_source_is_removed_from_the_graph_too(cluster):
    """The source's owner deleted the topic and stopped before removing its routers
    (its `deleted_with` never ran): the router's entry and its member of the router
    graph are left. A `DELETE` of the router through its runner removes both, so the
    destination takes a router from another source (the fan-in check no longer sees
    the deleted one)."""
    from tests.jetstream.conftest import fronts_of, open_fronts
    from topicd.storage.jsrouters import ROUTER_PREFIX, router_graph, router_key

    names = _names_by_shard(3)
    async with open_fronts(jetstream_config(cluster)) as hs:
        fr = [fronts_of(h) for h in hs]
        cs = [h.app.test_client() for h in hs]
        src, dst, other = names[1], names[2], names[0]
        own = next(i for i, f in enumerate(fr) if f.owns(src))
        run = next(i for i, f in enumerate(fr) if f.owns(dst))
        store, call = fr[run].store, fr[run].backend.bridge.call
        await _json(await cs[run].put("/v0/routers/r", json={"source": src, "dest": dst}), 201)
        await _write(cs[own], src, {"data": 1})

        async def stopped(topic, names) -> None:  # (the owner stops right after the delete)
            await trio.lowlevel.checkpoint()

        hs[own].engine.routers.deleted_with = stopped
        r = await cs[own].delete(f"/v0/topics/{src}")
        assert (await _json(r, 200))["routers_removed"] == ["r"]
        await fr[run].poll_once()  # (the runner learns of the delete: the router stops)
        assert "r" not in hs[run].engine.routers.routers
        key = router_key("r")[len(ROUTER_PREFIX) :]
        assert key in await call(partial(store.keys_under, ROUTER_PREFIX))  # (left over)
        assert "r" in (await call(partial(router_graph, store)))[0]
        r = await cs[run].delete("/v0/routers/r")
        assert (await _json(r, 200))["deleted"] is True
        assert key not in await call(partial(store.keys_under, ROUTER_PREFIX))
        assert "r" not in (await call(partial(router_graph, store)))[0]
        for c in cs:
            r = await c.put("/v0/routers/r2", json={"source": other, "dest": dst})
            assert r.status_code in (200, 201), await r.get_data()
