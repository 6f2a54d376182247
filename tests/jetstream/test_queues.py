"""Queue topics on the jetstream backend beyond the contract tests: what a restart and a
takeover keep (docs/jetstream.md, "Queues").

Method: fronts in this process on the session's nats-server, as in `test_fronts.py`; a
restart closes a front and opens a new one on an empty engine, which rebuilds from
JetStream. A takeover moves the owner lease by hand while the old owner still believes
it owns (its renewal has not run), so the fence is what stops it.
"""

from __future__ import annotations

import time
import uuid
from functools import partial

import httpx
import orjson
import pytest
import trio

from tests.crash.harness import Server
from tests.crash.harness import client as http_client
from tests.jetstream.conftest import jetstream_config, open_jetstream_app
from tests.jetstream.test_fronts import _data, _fronts, _json, _sharded, _write
from topicd.errors import StorageUnavailable
from topicd.storage import jsqueues
from topicd.storage.jetstream import FAULT_ENV
from topicd.testing.fake_clock import FakeWallClock
from topicd.testing.sse import open_sse

pytestmark = pytest.mark.slow


async def _ok(r) -> dict:
    return await _json(r, 200)


async def _claim(c, q: str, node: str, n: int, **kw) -> list[dict]:
    body = await _ok(await c.post(f"/v0/topics/{q}/claim", json={"node": node, "max": n, **kw}))
    return body["claimed"]


async def _op(c, verb: str, q: str, node: str, seqs: list[int], **kw) -> dict:
    return await _ok(
        await c.post(f"/v0/topics/{q}/{verb}", json={"node": node, "seqs": seqs, **kw})
    )


async def _queue(c, q: str) -> dict:
    return (await _ok(await c.get(f"/v0/topics/{q}", query_string={"touch": "false"})))["queue"]


async def test_leases_and_acks_survive_a_front_restart(cluster):
    """Durable leases come back from the journal with their ids, deadlines and delivery
    counts; an acked job never comes back; a queue without durable leases comes back
    with every unacked job claimable (as a restart of the embedded backend)."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        for q, durable in (("dq", True), ("vq", False)):
            r = await c.put(f"/v0/topics/{q}", json={"type": "queue", "leases_durable": durable})
            await _json(r, 201)
            await _write(c, q, *({"data": i} for i in range(1, 6)))
            got = await _claim(c, q, "w1", 3, lease_ms=600_000)
            assert [j["$seq"] for j in got] == [1, 2, 3]
            await _op(c, "ack", q, "w1", [1])
            await _op(c, "nack", q, "w1", [2], delay_ms=600_000)
        leases = {j["$seq"]: j for j in got}  # (the last queue's; `dq`'s below)
        dq_lease = (await _claim(c, "dq", "w2", 1, lease_ms=600_000))[0]
        assert dq_lease["$seq"] == 4
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        # dq: 3 and 4 still leased, 2 in its nack delay, 5 ready; 1 acked for good
        assert await _queue(c, "dq") == {"ready": 1, "in_flight": 2, "dead_lettered": 0}
        assert await _data(c, "dq") == [2, 3, 4, 5]
        assert [j["$seq"] for j in await _claim(c, "dq", "w3", 5)] == [5]
        body = await _op(c, "ack", "dq", "w2", [4], lease_ids=[dq_lease["lease_id"]])
        assert (body["acked"], body["skipped"]) == (1, [])
        body = await _op(c, "extend", "dq", "w1", [3], lease_ms=1000)
        assert body["extended"] == 1
        # vq: every unacked job is claimable again, delivery counts from 0
        assert await _queue(c, "vq") == {"ready": 4, "in_flight": 0, "dead_lettered": 0}
        again = await _claim(c, "vq", "w3", 5)
        assert [(j["$seq"], j["deliveries"]) for j in again] == [(2, 1), (3, 1), (4, 1), (5, 1)]
        body = await _op(c, "ack", "vq", "w1", [3], lease_ids=[leases[3]["lease_id"]])
        assert body["skipped"] == [3]  # a fence from before the restart never matches
    async with open_jetstream_app(cfg) as h:
        assert await _data(h.app.test_client(), "dq") == [2, 3, 5]


async def test_an_ephemeral_queues_acked_jobs_stay_acked_after_a_front_restart(cluster):
    """An `ephemeral` queue's records live in the servers (an R1 memory stream), so they
    outlive a front restart; its acks reach the journal and the stream as any other
    class's do, so an acked job never comes back."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        r = await c.put("/v0/topics/eq", json={"type": "queue", "durability": "ephemeral"})
        await _json(r, 201)
        await _write(c, "eq", *({"data": i} for i in range(1, 4)))
        got = await _claim(c, "eq", "w1", 2)
        await _op(c, "ack", "eq", "w1", [j["$seq"] for j in got])
        assert await _data(c, "eq") == [3]
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        assert await _data(c, "eq") == [3]
        assert await _queue(c, "eq") == {"ready": 1, "in_flight": 0, "dead_lettered": 0}
        assert [j["$seq"] for j in await _claim(c, "eq", "w2", 5)] == [3]


async def test_a_takeover_keeps_leased_jobs_and_fences_the_deposed_owner(cluster):
    """Jobs leased through the old owner stay leased under the new one (no job held by
    two live leases); the old owner, deposed but not aware yet, can no longer ack or
    lease (its journal append fails its fence: `503`), then forwards like any follower."""
    cfg = _sharded(cluster, 1)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        assert _fronts(a).owner and not _fronts(b).owner
        r = await cb.put("/v0/topics/tq", json={"type": "queue", "leases_durable": True})
        await _json(r, 201)
        await _write(cb, "tq", *({"data": i} for i in range(1, 5)))
        held = await _claim(cb, "tq", "w1", 2, lease_ms=600_000)  # forwarded to `a`
        assert [j["$seq"] for j in held] == [1, 2]
        assert await _queue(cb, "tq") == {"ready": 2, "in_flight": 2, "dead_lettered": 0}
        # `b` takes the lease over; `a` has not noticed yet
        fb = _fronts(b)
        _, rev = await fb.backend.bridge.call(fb.store.lease)
        fb.lease_revs[0] = await fb.backend.bridge.call(
            partial(fb.store.write_lease, fb._lease_value(), rev)
        )
        await fb._promote(0)
        assert fb.owner and _fronts(a).owner
        assert await _queue(cb, "tq") == {"ready": 2, "in_flight": 2, "dead_lettered": 0}
        # the leased jobs are not handed out again
        assert [j["$seq"] for j in await _claim(cb, "tq", "w2", 5, lease_ms=600_000)] == [3, 4]
        # the deposed owner can neither ack nor lease
        r = await ca.post("/v0/topics/tq/ack", json={"node": "w1", "seqs": [1]})
        assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
        await _write(cb, "tq", {"data": 5})
        await _fronts(a).catch_up("tq")  # (`a` serves its own reads as an owner would)
        r = await ca.post("/v0/topics/tq/claim", json={"node": "w9", "max": 5})
        assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
        # the new owner honours the old leases, with their ids
        lid = held[0]["lease_id"]
        body = await _op(cb, "ack", "tq", "w1", [1], lease_ids=[lid])
        assert (body["acked"], body["skipped"]) == (1, [])
        await _fronts(a)._tend_lease()  # `a` finds the lease gone: it follows
        assert not _fronts(a).owner
        body = await _op(ca, "ack", "tq", "w1", [2], lease_ids=[held[1]["lease_id"]])
        assert body["acked"] == 1
        assert await _data(ca, "tq") == [3, 4, 5]
        assert await _data(cb, "tq") == [3, 4, 5]
        assert await _queue(ca, "tq") == {"ready": 1, "in_flight": 2, "dead_lettered": 0}


async def test_a_followers_metrics_count_the_owners_leases(cluster):
    """`/v0/metrics` on a front that does not run the queue, its own figures
    (`scope=front`) and the deployment's alike: the leases-in-flight total and the
    queue's own series both show the owner's counts (its own, as last heard)."""
    cfg = _sharded(cluster, 1)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        assert _fronts(a).owner and not _fronts(b).owner
        await _json(await ca.put("/v0/topics/mq", json={"type": "queue"}), 201)
        await _write(ca, "mq", {"data": 1}, {"data": 2})
        await _claim(cb, "mq", "w1", 2, lease_ms=600_000)
        for c in (ca, cb):
            for query in ({}, {"scope": "front"}):
                r = await c.get("/v0/metrics", query_string=query)
                text = (await r.get_data()).decode()
                assert "topics_queue_leases_in_flight 2.0" in text
                assert 'topics_topic_queue_in_flight{topic="mq"} 2.0' in text
                json_headers = {"Accept": "application/json"}
                snap = await _ok(
                    await c.get("/v0/metrics", headers=json_headers, query_string=query)
                )
                assert snap["queue_leases_in_flight"] == 2


async def test_a_work_stream_on_a_follower_claims_through_the_owner(cluster, nursery):
    """A `/work` stream opened on a front that does not own the queue: the owner leases
    its jobs (up to `max` held), refills it as its jobs are acked anywhere, and releases
    what it still holds when the connection ends."""
    cfg = _sharded(cluster, 1)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca = a.app.test_client()
        assert _fronts(a).owner and not _fronts(b).owner
        await _json(await ca.put("/v0/topics/wq", json={"type": "queue"}), 201)
        await _write(ca, "wq", *({"data": i} for i in range(1, 5)))
        s = await open_sse(nursery, b.app.asgi_app, "/v0/topics/wq/work", query="node=w1&max=2")
        assert s.status == 200, s.body
        frames = await s.read_frames(4, timeout=30)  # retry, heartbeat, two jobs
        jobs = [f.data for f in frames if f.event == "job"]
        assert [j["$seq"] for j in jobs] == [1, 2]
        assert await _queue(ca, "wq") == {"ready": 2, "in_flight": 2, "dead_lettered": 0}
        body = await _op(ca, "ack", "wq", "w1", [1], lease_ids=[jobs[0]["lease_id"]])
        assert body["acked"] == 1
        more = [f for f in await s.read_frames(1, timeout=30) if f.event == "job"]
        assert [f.data["$seq"] for f in more] == [3]  # (refilled at the next poll)
        assert await _queue(ca, "wq") == {"ready": 1, "in_flight": 2, "dead_lettered": 0}
        s.disconnect()
        await s.wait_done()
        # the owner released the stream's leases: claimable at once, counts kept
        assert await _queue(ca, "wq") == {"ready": 3, "in_flight": 0, "dead_lettered": 0}
        again = await _claim(ca, "wq", "w2", 5)
        assert [(j["$seq"], j["deliveries"]) for j in again] == [(2, 2), (3, 2), (4, 1)]


async def test_kill9_of_the_owner_front_with_leased_jobs(cluster, tmp_path):
    """Two `topicd serve` fronts (one shard: the first owns); jobs of a queue with
    durable leases are claimed through the follower, one acked, then the owner is killed
    with SIGKILL. The survivor takes over: the acked job stays gone, the leased ones stay
    leased to their holder (a claim gets only the others), and the holder acks them with
    its lease ids."""
    env = {
        **cluster.env(),
        "TOPICD_JETSTREAM_PREFIX": "queues9",
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": "1500",
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

                async def call(path: str, body: dict) -> dict:
                    with trio.fail_after(30):
                        while True:  # (503 until the survivor took the lease over)
                            try:
                                r = await hc.post(path, json=body)
                            except httpx.HTTPError:
                                continue
                            if r.status_code != 503:
                                assert r.status_code in (200, 201), r.text
                                return r.json()
                            await trio.sleep(0.05)  # the retry's pace, not a wait

                r = await hc.put("/v0/topics/kq", json={"type": "queue", "leases_durable": True})
                assert r.status_code == 201, r.text
                await call("/v0/topics/kq", {"records": [{"data": i} for i in range(1, 6)]})
                claim = {"node": "w1", "max": 3, "lease_ms": 600_000}
                held = (await call("/v0/topics/kq/claim", claim))["claimed"]
                assert [j["$seq"] for j in held] == [1, 2, 3]
                ack = {"node": "w1", "seqs": [1], "lease_ids": [held[0]["lease_id"]]}
                assert (await call("/v0/topics/kq/ack", ack))["acked"] == 1
                await owner.kill()
                got = await call("/v0/topics/kq/claim", {"node": "w2", "max": 5})
                assert [j["$seq"] for j in got["claimed"]] == [4, 5]
                ack = {"node": "w1", "seqs": [2, 3], "lease_ids": [j["lease_id"] for j in held[1:]]}
                body = await call("/v0/topics/kq/ack", ack)
                assert (body["acked"], body["skipped"]) == (2, [])
                diff = await call("/v0/topics/kq/diff", {"from_seq": 0})
                assert [x["$seq"] for x in diff["records"]] == [4, 5]
            assert "took the owner lease" in other.run.text
            assert other.run.problems() == []
        finally:
            for s in servers:
                with trio.CancelScope(shield=True):
                    await s.close()


async def test_a_journal_without_its_queue_is_removed_at_start(cluster):
    """A journal left behind (its queue deleted, the front stopped before the journal
    went) is deleted by the next front that starts alone; live queues keep theirs."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _json(await c.put("/v0/topics/jq", json={"type": "queue"}), 201)
        backend = _fronts(h).backend
        store = backend.store
        await backend.bridge.call(partial(jsqueues.create, store, 987654))
        ids = await backend.bridge.call(partial(jsqueues.journal_ids, store))
        live = h.engine.topics["jq"].topic_id
        assert {live, 987654} <= set(ids)
    async with open_jetstream_app(cfg) as h:
        backend = _fronts(h).backend
        ids = await backend.bridge.call(partial(jsqueues.journal_ids, backend.store))
        assert live in ids
        assert 987654 not in ids


async def _journal_state(backend, tid: int) -> tuple[int, int]:
    """(first seq, messages) of a queue's journal."""
    info = await backend.bridge.call(
        partial(backend.store.js.stream_info, jsqueues.stream(backend.store, tid))
    )
    return int(info.state.first_seq), int(info.state.messages)


async def test_a_takeover_after_compaction_recovers_the_same_leases(cluster, monkeypatch):
    """The owner compacts a busy queue's journal (a snapshot of its lease state, then a
    purge below it); a follower that had not read the queue since the acks drops the
    acked jobs (their acks are purged; the stream says they are gone); a takeover then
    reads only the snapshot and what came after it, and keeps every lease (holder, id,
    deadline), nack delay and delivery count the old owner had."""
    # (the owners' background compaction waits until the test compacts below)
    monkeypatch.setattr(jsqueues, "COMPACT_MIN", 1 << 62)
    cfg = _sharded(cluster, 1)
    async with open_jetstream_app(cfg) as a, open_jetstream_app(cfg) as b:
        ca, cb = a.app.test_client(), b.app.test_client()
        r = await ca.put("/v0/topics/cq", json={"type": "queue", "leases_durable": True})
        await _json(r, 201)
        await _write(ca, "cq", *({"data": i} for i in range(1, 61)))
        assert len(await _data(cb, "cq")) == 60  # (`b` follows the queue from here)
        for _ in range(40):  # 80 journal messages: a lease and an ack per job
            (job,) = await _claim(ca, "cq", "w1", 1)
            await _op(ca, "ack", "cq", "w1", [job["$seq"]], lease_ids=[job["lease_id"]])
        held = await _claim(ca, "cq", "holder", 3, lease_ms=600_000)
        assert [j["$seq"] for j in held] == [41, 42, 43]
        await _op(ca, "nack", "cq", "holder", [43], delay_ms=600_000)
        again = (await _claim(ca, "cq", "w3", 1, lease_ms=600_000))[0]
        assert again["$seq"] == 44
        backend = _fronts(a).backend
        topic = a.engine.topics["cq"]
        assert not backend.journals.compact_due(topic)
        monkeypatch.setattr(jsqueues, "COMPACT_MIN", 32)
        assert backend.journals.compact_due(topic)
        await backend.compact_journals()  # (no checkpoint in between: nothing else ran)
        monkeypatch.setattr(jsqueues, "COMPACT_MIN", 1 << 62)
        first, count = await _journal_state(backend, topic.topic_id)
        assert (first > 80, count) == (True, 1)  # the snapshot alone
        assert not backend.journals.compact_due(topic)
        want = (await _queue(ca, "cq"), await _data(ca, "cq"))
        assert want[0] == {"ready": 16, "in_flight": 3, "dead_lettered": 0}
        # the follower behind the compaction converges
        assert (await _queue(cb, "cq"), await _data(cb, "cq")) == want
        # the new owner reads the snapshot and the messages after it
        fb = _fronts(b)
        _, rev = await fb.backend.bridge.call(fb.store.lease)
        fb.lease_revs[0] = await fb.backend.bridge.call(
            partial(fb.store.write_lease, fb._lease_value(), rev)
        )
        await fb._promote(0)
        # the deposed owner, not aware yet, cannot compact: its snapshot fails its fence
        with pytest.raises(StorageUnavailable):
            await backend.journals.compact(topic)
        assert (await _journal_state(backend, topic.topic_id))[0] == first
        assert (await _queue(cb, "cq"), await _data(cb, "cq")) == want
        got = await _claim(cb, "cq", "w2", 20, lease_ms=600_000)  # none of the leased
        assert [j["$seq"] for j in got] == list(range(45, 61))
        lids = [j["lease_id"] for j in held[:2]]
        body = await _op(cb, "ack", "cq", "holder", [41, 42], lease_ids=lids)
        assert (body["acked"], body["skipped"]) == (2, [])
        body = await _op(cb, "extend", "cq", "w3", [44], lease_ms=1000)
        assert body["extended"] == 1
        # 43 is in its nack delay, claimed once before: not handed out
        assert await _claim(cb, "cq", "w4", 5) == []
        q = b.engine.topics["cq"].queue
        assert q.deliveries[43] == 1 and 43 in q.delayed


async def test_a_restart_after_compaction_reads_the_snapshot(cluster, monkeypatch):
    """A front restart after a compaction (and acks after it) rebuilds the same queue:
    the acked jobs stay gone, the leases stay with their holders."""
    monkeypatch.setattr(jsqueues, "COMPACT_MIN", 1 << 62)  # (compacted by hand below)
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _json(
            await c.put("/v0/topics/rq", json={"type": "queue", "leases_durable": True}), 201
        )
        await _write(c, "rq", *({"data": i} for i in range(1, 21)))
        for seq in range(1, 11):
            (job,) = await _claim(c, "rq", "w", 1)
            assert job["$seq"] == seq
            await _op(c, "ack", "rq", "w", [seq], lease_ids=[job["lease_id"]])
        held = await _claim(c, "rq", "holder", 2, lease_ms=600_000)
        assert await _fronts(h).backend.journals.compact(h.engine.topics["rq"])
        (job,) = await _claim(c, "rq", "w", 1)
        await _op(c, "ack", "rq", "w", [13], lease_ids=[job["lease_id"]])
        want = (await _queue(c, "rq"), await _data(c, "rq"))
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        assert (await _queue(c, "rq"), await _data(c, "rq")) == want
        assert [j["$seq"] for j in await _claim(c, "rq", "w", 20)] == list(range(14, 21))
        lids = [j["lease_id"] for j in held]
        body = await _op(c, "ack", "rq", "holder", [11, 12], lease_ids=lids)
        assert (body["acked"], body["skipped"]) == (2, [])


def _lease_state(h, name: str) -> tuple:
    """A queue's exact lease state on a front: its leases (seq, holder, id, deadline),
    delivery counters and the jobs in a nack delay."""
    q = h.engine.topics[name].queue
    snap = q.export(trio.current_time(), h.engine.clock.now_ms())
    return snap.leases, snap.deliveries, [s for s, _ in snap.delays]


async def test_topicd_serve_killed_between_snapshot_and_purge(cluster, tmp_path, monkeypatch):
    """`topicd serve` owns a queue with durable leases whose journal has grown past the
    compaction threshold; it kills itself (SIGKILL) right after writing the snapshot,
    before the purge (`journal.after_snapshot`). The journal then holds the snapshot on
    top of everything it stands for; the next start reads it and keeps the same leases
    (holder, id, deadline), nack delay, delivery counts and acked jobs gone, and a later
    compaction purges below a new snapshot and keeps them again."""
    prefix = "jc9" + uuid.uuid4().hex[:8]
    cfg = jetstream_config(cluster, prefix=prefix)
    # (the journal is filled by a front in this process, which must not compact it; the
    # fronts here run on the real wall clock, as `topicd serve` does, so the leases'
    # deadlines mean the same to both)
    monkeypatch.setattr(jsqueues, "COMPACT_MIN", 1 << 62)

    def wall() -> FakeWallClock:
        return FakeWallClock(epoch0_ms=round(time.time() * 1000))

    async with open_jetstream_app(cfg, wall()) as h:
        c = h.app.test_client()
        r = await c.put("/v0/topics/kq", json={"type": "queue", "leases_durable": True})
        await _json(r, 201)
        await _write(c, "kq", *({"data": i} for i in range(1, 11)))
        for seq in (1, 2, 3):  # acked: gone for good
            (job,) = await _claim(c, "kq", "w1", 1)
            assert job["$seq"] == seq
            await _op(c, "ack", "kq", "w1", [seq], lease_ids=[job["lease_id"]])
        (job,) = await _claim(c, "kq", "w1", 1)  # 4: nacked, then leased again
        await _op(c, "nack", "kq", "w1", [4])
        held = await _claim(c, "kq", "holder", 2, lease_ms=600_000)
        assert [j["$seq"] for j in held] == [4, 5]
        await _op(c, "nack", "kq", "holder", [5], delay_ms=600_000)  # 5: in its delay
        (six,) = await _claim(c, "kq", "w6", 1, lease_ms=600_000)
        assert six["$seq"] == 6
        # past the threshold: each extend is one journal message
        for _ in range(1024):
            await _op(c, "extend", "kq", "w6", [6], lease_ms=600_000)
        want = (await _queue(c, "kq"), await _data(c, "kq"), _lease_state(h, "kq"))
        assert want[0] == {"ready": 4, "in_flight": 2, "dead_lettered": 0}
        assert want[1] == [4, 5, 6, 7, 8, 9, 10]
        assert [s for s, *_ in want[2][0]] == [4, 6]
        assert want[2][1:] == ([(4, 2), (5, 1), (6, 1)], [5])
        tid = h.engine.topics["kq"].topic_id
        last = _fronts(h).backend.journals.heads[tid]
        assert last > 1024
    env = {**cluster.env(), "TOPICD_JETSTREAM_PREFIX": prefix, FAULT_ENV: "journal.after_snapshot"}
    async with trio.open_nursery() as nursery:
        s = Server(nursery, tmp_path)
        s.extra_env = dict(env)
        try:
            await s.start()
            with trio.fail_after(10):  # (its first compaction pass, a second after start)
                assert await s.run.proc.wait() == -9
            assert "fault point journal.after_snapshot" in s.run.text
            s.extra_env.pop(FAULT_ENV)
            await s.start()
            async with http_client(s) as hc:
                r = await hc.get("/v0/topics/kq", params={"touch": "false"})
                assert r.json()["queue"] == want[0]
                r = await hc.post("/v0/topics/kq/diff", json={"from_seq": 0})
                assert [x["data"] for x in r.json()["records"]] == want[1]
            assert s.run.problems() == []
        finally:
            with trio.CancelScope(shield=True):
                await s.close()
    async with open_jetstream_app(cfg, wall()) as h:
        c = h.app.test_client()
        backend = _fronts(h).backend
        # the snapshot was written, the purge was not: the whole journal is still there
        msgs, _, skipped = await backend.bridge.call(partial(jsqueues.read, backend.store, tid, 0))
        kinds = [orjson.loads(m)["k"] for _, m in msgs]
        assert (msgs[0][0], skipped, kinds.count("snap")) == (1, False, 1)
        assert kinds.index("snap") == last + 1  # (after the killed front's `own` marker)
        assert (await _queue(c, "kq"), await _data(c, "kq"), _lease_state(h, "kq")) == want
        # a later compaction works: the journal is purged below a new snapshot
        topic = h.engine.topics["kq"]
        monkeypatch.setattr(jsqueues, "COMPACT_MIN", 2)
        assert backend.journals.compact_due(topic)
        assert await backend.journals.compact(topic)
        monkeypatch.setattr(jsqueues, "COMPACT_MIN", 1 << 62)
        first, count = await _journal_state(backend, tid)
        assert (first > len(msgs), count) == (True, 1)
    async with open_jetstream_app(cfg, wall()) as h:
        c = h.app.test_client()
        assert (await _queue(c, "kq"), await _data(c, "kq"), _lease_state(h, "kq")) == want
        again = await _claim(c, "kq", "w7", 10)
        assert [(j["$seq"], j["deliveries"]) for j in again] == [(7, 1), (8, 1), (9, 1), (10, 1)]
        body = await _op(c, "ack", "kq", "holder", [4], lease_ids=[held[0]["lease_id"]])
        assert (body["acked"], body["skipped"]) == (1, [])
        body = await _op(c, "ack", "kq", "w6", [6], lease_ids=[six["lease_id"]])
        assert (body["acked"], body["skipped"]) == (1, [])
