"""A durability change across `ephemeral` on the jetstream backend: the records move to a
new stream (docs/jetstream.md, "Durability changes").

Method: fronts in this process on the session's cluster, as in `test_fronts.py`, acting
through the HTTP API and then looking at the streams and the registry entry directly;
a restart opens a new front on an empty engine, which rebuilds from JetStream. The crash
tests run `topicd serve` with a fault point (`TOPICD_JETSTREAM_FAULT`): the process kills
itself (SIGKILL) at that exact step of the move, and the next start (or the surviving
front's takeover) must leave one stream authoritative, with every record at its seq.
"""

from __future__ import annotations

import uuid
from functools import partial

import httpx
import pytest
import trio

from tests.crash.harness import Server
from tests.crash.harness import client as http_client
from tests.jetstream.conftest import balance, jetstream_config, open_jetstream_app
from tests.jetstream.test_fronts import _fronts, _json, _sharded, _write
from topicd.storage.jetstream import FAULT_ENV, JetStreamBackend

pytestmark = pytest.mark.slow


async def _diff(c, topic: str, from_seq: int = 0) -> dict:
    r = await c.post(
        f"/v0/topics/{topic}/diff",
        json={"from_seq": from_seq, "limit": 1000, "include_tags": True},
    )
    return await _json(r, 200)


def _view(diff: dict) -> list:
    """What a reader sees: records (seq, data, tag) and tombstones."""
    out: list = [(r["$seq"], r["data"], r.get("$tag")) for r in diff["records"]]
    if diff.get("tombstone"):
        t = diff["tombstone"]
        out.insert(0, ("tombstone", t["gap_from"], t["gap_to"], t["reason"]))
    return out


async def _streams(backend: JetStreamBackend) -> dict[int, tuple[str, int]]:
    """{stream id: (storage, replicas)} of this deployment's topic streams."""
    store = backend.store
    heads = await backend.bridge.call(store.stream_heads)
    out = {}
    for sid in heads:
        info = await backend.bridge.call(partial(store.js.stream_info, store.stream_name(sid)))
        out[sid] = (str(info.config.storage), info.config.num_replicas)
    return out


async def test_a_durability_change_across_ephemeral_moves_the_records(cluster):
    """`disk` -> `ephemeral` -> `disk`: each change moves the records to a new stream
    (R1 memory, then file with the deployment's replicas) at their seqs, with the gaps
    record deletes left, the `cap` tombstone, tags and an idempotency key; the old
    stream is gone, later writes continue above the head, and a restart rebuilds the
    same from the new stream."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        backend = _fronts(h).backend
        r = await c.put("/v0/topics/m", json={"cap_records": 8, "discard": "old"})
        await _json(r, 201)
        for i in range(1, 11):  # seqs 1..10; 1 and 2 evicted by the cap
            await _write(c, "m", {"data": i, "tag": "odd" if i % 2 else f"even{i}"})
        keyed = await _write(c, "m", {"data": "k1"}, {"data": "k2"}, idempotency_key="key")
        assert (keyed["first_seq"], keyed["last_seq"]) == (11, 12)
        # 3 and 4 evicted too now; delete 5 (before_seq), every `odd` below 9, `even8`
        await _json(await c.post("/v0/topics/m/delete", json={"before_seq": 6}), 200)
        await _json(
            await c.post("/v0/topics/m/delete", json={"match": "odd", "before_seq": 9}), 200
        )
        await _json(await c.post("/v0/topics/m/delete", json={"match": "even8*"}), 200)
        before = _view(await _diff(c, "m"))
        assert before[0] == ("tombstone", 1, 4, "cap")
        assert [x[0] for x in before[1:]] == [6, 9, 10, 11, 12]
        tid = h.engine.topics["m"].topic_id
        assert await _streams(backend) == {tid: ("file", cluster.replicas)}

        r = await c.put("/v0/topics/m", json={"cap_records": 8, "durability": "ephemeral"})
        assert (await _json(r, 200))["config"]["durability"] == "ephemeral"
        streams = await _streams(backend)
        assert list(streams.values()) == [("memory", 1)]
        (sid,) = streams
        assert sid != tid
        entry, _ = await backend.bridge.call(partial(backend.store.entry, tid))
        assert (entry["stream"], entry["storage"], "move" in entry) == (sid, "memory", False)
        assert _view(await _diff(c, "m")) == before
        first, last, gone = await backend.bridge.call(partial(backend.store.state, tid))
        assert (first, last, gone) == (6, 12, [7, 8])  # the same seqs, the same gaps
        r = await c.post(
            "/v0/topics/m",
            json={"records": [{"data": "k1"}, {"data": "k2"}], "idempotency_key": "key"},
        )
        assert (await _json(r, 200))["deduped"] is True
        assert (await _json(r))["first_seq"] == 11
        assert (await _write(c, "m", {"data": 13}))["first_seq"] == 13

        r = await c.put("/v0/topics/m", json={"cap_records": 8, "durability": "disk"})
        assert (await _json(r, 200))["config"]["durability"] == "disk"
        streams = await _streams(backend)
        assert list(streams.values()) == [("file", cluster.replicas)]
        assert sid not in streams
        after = _view(await _diff(c, "m"))
        assert after == [*before, (13, 13, None)]
    async with open_jetstream_app(cfg) as h:  # rebuilt from the new stream
        c = h.app.test_client()
        assert _view(await _diff(c, "m")) == after
        state = await _json(await c.get("/v0/topics/m"), 200)
        assert (state["head_seq"], state["config"]["durability"]) == (13, "disk")
        r = await c.post(
            "/v0/topics/m",
            json={"records": [{"data": "k1"}, {"data": "k2"}], "idempotency_key": "key"},
        )
        assert (await _json(r, 200))["first_seq"] == 11
        assert (await _write(c, "m", {"data": 14}))["first_seq"] == 14


async def test_a_move_of_an_empty_topic_and_of_a_queue_with_leases(cluster):
    """An empty topic (its head above 0, every record deleted) moves to a stream that
    ends at the head; a queue with durable leases keeps its leases, acks and counts."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(c, "z", {"data": 1}, {"data": 2})
        await _json(await c.post("/v0/topics/z/delete", json={"before_seq": 3}), 200)
        r = await c.put("/v0/topics/z", json={"durability": "ephemeral"})
        await _json(r, 200)
        assert (await _write(c, "z", {"data": 3}))["first_seq"] == 3
        r = await c.put("/v0/topics/q", json={"type": "queue", "leases_durable": True})
        await _json(r, 201)
        await _write(c, "q", *({"data": i} for i in range(1, 6)))
        r = await c.post("/v0/topics/q/claim", json={"node": "w", "max": 3, "lease_ms": 600_000})
        held = (await _json(r, 200))["claimed"]
        r = await c.post(
            "/v0/topics/q/ack", json={"node": "w", "seqs": [1], "lease_ids": [held[0]["lease_id"]]}
        )
        assert (await _json(r, 200))["acked"] == 1
        body = {"type": "queue", "leases_durable": True, "durability": "ephemeral"}
        await _json(await c.put("/v0/topics/q", json=body), 200)
        body["durability"] = "fsync"
        await _json(await c.put("/v0/topics/q", json=body), 200)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        assert [x["$seq"] for x in (await _diff(c, "z"))["records"]] == [3]
        q = await _json(await c.get("/v0/topics/q", query_string={"touch": "false"}), 200)
        assert q["queue"] == {"ready": 2, "in_flight": 2, "dead_lettered": 0}
        r = await c.post("/v0/topics/q/claim", json={"node": "v", "max": 5})
        assert [j["$seq"] for j in (await _json(r, 200))["claimed"]] == [4, 5]
        ack = {"node": "w", "seqs": [2, 3], "lease_ids": [j["lease_id"] for j in held[1:]]}
        assert (await _json(await c.post("/v0/topics/q/ack", json=ack), 200))["acked"] == 2


async def test_the_owner_moves_and_followers_read_the_new_stream(cluster):
    """Three fronts, three shards: a durability change through a follower is run by the
    owner; every front then reads the records from the new stream (the old one is gone),
    and writes through any front continue at the next seq."""
    cfg = _sharded(cluster, 3)
    async with (
        open_jetstream_app(cfg) as a,
        open_jetstream_app(cfg) as b,
        open_jetstream_app(cfg) as c3,
    ):
        if True:
            hs = [a, b, c3]
            await balance(hs)
            clients = [h.app.test_client() for h in hs]
            for i in range(5):
                await _write(clients[i % 3], "fm", {"data": i, "tag": f"t{i}"})
            await _json(await clients[1].post("/v0/topics/fm/delete", json={"match": "t1"}), 200)
            views = [_view(await _diff(cl, "fm")) for cl in clients]
            assert views[0] == views[1] == views[2]
            owner = next(i for i, h in enumerate(hs) if _fronts(h).owns("fm"))
            via = (owner + 1) % 3
            r = await clients[via].put("/v0/topics/fm", json={"durability": "ephemeral"})
            assert (await _json(r, 200))["config"]["durability"] == "ephemeral"
            for cl in clients:
                assert _view(await _diff(cl, "fm")) == views[0]
                state = await _json(await cl.get("/v0/topics/fm"), 200)
                assert state["config"]["durability"] == "ephemeral"
            sids = {_fronts(h).store.sid(h.engine.topics["fm"].topic_id) for h in hs}
            assert len(sids) == 1 and sids != {hs[0].engine.topics["fm"].topic_id}
            for i in range(3):
                got = await _write(clients[i], "fm", {"data": f"after{i}"})
                assert got["first_seq"] == 6 + i
            for cl in clients:
                assert [x[0] for x in _view(await _diff(cl, "fm"))] == [1, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize(
    ("point", "moved"),
    [("move.after_intent", False), ("move.after_copy", False), ("move.after_switch", True)],
)
async def test_topicd_serve_killed_mid_move_restarts_on_one_stream(cluster, tmp_path, point, moved):
    """`topicd serve` kills itself (SIGKILL) at a step of a move to `ephemeral`; the next
    start keeps the stream the registry entry names (the old one before the switch, the
    new one after) with every record at its seq, deletes the other, and serves writes."""
    env = {
        **cluster.env(),
        "TOPICD_JETSTREAM_PREFIX": "mv9" + uuid.uuid4().hex[:8],
        FAULT_ENV: point,
    }
    async with trio.open_nursery() as nursery:
        s = Server(nursery, tmp_path)
        s.extra_env = dict(env)
        await s.start()
        try:
            async with http_client(s) as hc:
                r = await hc.post(
                    "/v0/topics/k", json={"records": [{"data": i} for i in range(1, 6)]}
                )
                assert r.status_code == 201
                r = await hc.post("/v0/topics/k/delete", json={"before_seq": 2})
                assert r.status_code == 200
                with pytest.raises(httpx.HTTPError):
                    await hc.put("/v0/topics/k", json={"durability": "ephemeral"})
            with trio.fail_after(10):
                assert await s.run.proc.wait() == -9
            assert f"fault point {point}" in s.run.text
            s.extra_env.pop(FAULT_ENV)
            await s.start()
            async with http_client(s) as hc:
                r = await hc.get("/v0/topics/k")
                want = "ephemeral" if moved else "disk"
                assert r.json()["config"]["durability"] == want
                r = await hc.post("/v0/topics/k/diff", json={"from_seq": 0})
                assert [x["$seq"] for x in r.json()["records"]] == [2, 3, 4, 5]
                r = await hc.post("/v0/topics/k", json={"records": [{"data": 6}]})
                assert r.json()["first_seq"] == 6
            assert "stream move" in s.run.text
            assert s.run.problems() == []
        finally:
            with trio.CancelScope(shield=True):
                await s.close()
    cfg = jetstream_config(cluster, prefix=env["TOPICD_JETSTREAM_PREFIX"])
    async with open_jetstream_app(cfg) as h:  # one stream left, no move recorded
        backend = _fronts(h).backend
        tid = h.engine.topics["k"].topic_id
        assert len(await backend.bridge.call(backend.store.stream_heads)) == 1
        entry, _ = await backend.bridge.call(partial(backend.store.entry, tid))
        assert "move" not in entry


async def test_a_takeover_settles_a_move_the_killed_owner_left(cluster, tmp_path):
    """Two `topicd serve` fronts (one shard); the owner kills itself right after the
    switch of a move; the survivor takes the lease over, keeps the new stream, removes
    the old one and serves the records at their seqs."""
    env = {
        **cluster.env(),
        "TOPICD_JETSTREAM_PREFIX": "mvt" + uuid.uuid4().hex[:8],
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": "1500",
        FAULT_ENV: "move.after_switch",
    }
    async with trio.open_nursery() as nursery:
        servers = []
        for i in range(2):
            (tmp_path / f"f{i}").mkdir()
            s = Server(nursery, tmp_path / f"f{i}")
            s.extra_env = dict(env)
            await s.start()
            servers.append(s)
        owner, other = servers
        try:
            assert ": owner" in owner.run.text
            async with http_client(other) as hc:
                r = await hc.post(
                    "/v0/topics/t", json={"records": [{"data": i} for i in range(1, 4)]}
                )
                assert r.status_code == 201, r.text
                r = await hc.put("/v0/topics/t", json={"durability": "ephemeral"})
                assert r.status_code == 503  # the owner died with the request
                with trio.fail_after(10):
                    assert await owner.run.proc.wait() == -9
                with trio.fail_after(30):
                    while True:  # (503 until the survivor took the lease over)
                        r = await hc.post("/v0/topics/t", json={"records": [{"data": 4}]})
                        if r.status_code != 503:
                            break
                        await trio.sleep(0.05)  # the retry's pace, not a wait
                assert r.json()["first_seq"] == 4, r.text
                r = await hc.get("/v0/topics/t")
                assert r.json()["config"]["durability"] == "ephemeral"
                r = await hc.post("/v0/topics/t/diff", json={"from_seq": 0})
                assert [x["data"] for x in r.json()["records"]] == [1, 2, 3, 4]
            assert "stream move finished" in other.run.text
            assert other.run.problems() == []
        finally:
            for s in servers:
                with trio.CancelScope(shield=True):
                    await s.close()


async def test_writes_and_deletes_during_a_move_land_on_the_new_stream(cluster):
    """Writers (through the owner and a follower) and a record delete run while the
    topic moves to `ephemeral` and back: every acknowledged write is on both fronts
    once, at its seq, the seqs are 1..n, and the delete's gaps are the same everywhere."""
    cfg = _sharded(cluster, 1)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        await _write(ca, "w", *({"data": f"pre{i}", "tag": "old"} for i in range(50)))
        acked: dict[str, int] = {}
        moved = trio.Event()

        async def writer(c, who: str) -> None:
            i = 0
            while not moved.is_set() or i < 5:
                key = f"{who}{i}"
                got = await _write(c, "w", {"data": key}, idempotency_key=key)
                acked[key] = got["first_seq"]
                i += 1

        async with trio.open_nursery() as n:
            n.start_soon(writer, ca, "a")
            n.start_soon(writer, cb, "b")
            for durability in ("ephemeral", "disk"):
                r = await cb.put("/v0/topics/w", json={"durability": durability})
                assert (await _json(r, 200))["config"]["durability"] == durability
                r = await ca.post("/v0/topics/w/delete", json={"match": "old", "before_seq": 10})
                await _json(r, 200)
            moved.set()
        seqs = sorted(acked.values())
        assert seqs == list(range(51, 51 + len(seqs)))
        for c in (ca, cb):
            d = await _diff(c, "w")
            got = {x["data"]: x["$seq"] for x in d["records"] if not x["data"].startswith("pre")}
            assert got == acked
            pre = [x["$seq"] for x in d["records"] if x["data"].startswith("pre")]
            assert pre == list(range(10, 51))
