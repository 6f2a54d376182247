"""The jetstream backend on a real nats-server: what survives a front restart, the
sequence fence, the refusals, and `topicd serve` as a front (kill -9, empty data dir).

Method: each test opens the app on a fresh prefix of the session's nats-server, acts
through the HTTP API, closes the engine (or kills the daemon) and opens a new one on the
same prefix: everything it then serves was rebuilt from JetStream. The payload cache is
0 bytes with one-seq chunks, so diff reads load every record back from its stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from functools import partial

import httpx
import pytest
import trio
import trio.testing

from tests.crash.harness import client as http_client
from tests.crash.harness import serving
from tests.jetstream.conftest import (
    jetstream_config,
    open_jetstream_app,
    require_binary,
    start_cluster,
    start_nats,
)
from tests.watch import helpers as watch_helpers
from topicd.engine import payloads
from topicd.errors import StorageUnavailable
from topicd.storage import frame as frames
from topicd.storage.jetstream import (
    BATCH_MAX,
    JetStreamBackend,
    JetStreamUnavailable,
    open_jetstream_engine,
)
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


async def _write(c, topic: str, *records, **fields) -> dict:
    r = await c.post(f"/v0/topics/{topic}", json={"records": list(records), **fields})
    assert r.status_code in (200, 201), await r.get_data()
    return await _json(r)


async def _diff(c, topic: str, from_seq: int = 0, **req) -> dict:
    r = await c.post(
        f"/v0/topics/{topic}/diff",
        json={"from_seq": from_seq, "limit": 1000, "include_tags": True, **req},
    )
    return await _json(r, 200)


def _backend(h) -> JetStreamBackend:
    backend = h.engine.commit
    assert isinstance(backend, JetStreamBackend)
    return backend


async def test_records_and_extras_survive_a_restart(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        one = await _write(c, "a", {"data": {"x": [1, 2.50, "é"]}, "meta": {"m": 1}, "tag": "t1"})
        assert one["first_seq"] == 1
        two = await _write(
            c,
            "a",
            {"data": 2, "node": "n1", "priority": 7},
            {"data": None, "tag": "t2"},
            {"data": "s"},
        )
        assert (two["first_seq"], two["last_seq"]) == (2, 4)
        before = await _diff(c, "a", include_meta=True)
        assert h.engine.payloads.stats().loaded_records >= 4  # read back from the stream
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        after = await _diff(c, "a", include_meta=True)
        assert after["records"] == before["records"]
        assert after["records"][0]["data"] == {"x": [1, 2.50, "é"]}
        assert [r.get("$tag") for r in after["records"]] == ["t1", None, "t2", None]
        state = await _json(await c.get("/v0/topics/a"), 200)
        assert (state["head_seq"], state["count"], state["earliest_seq"]) == (4, 4, 1)
        # the node filter still knows the records' nodes
        echo = await _diff(c, "a", node="n1")
        assert [r["$seq"] for r in echo["records"]] == [1, 3, 4]
        # seqs continue at the stream's head
        assert (await _write(c, "a", {"data": 5}))["first_seq"] == 5


async def test_caps_tombstones_and_floor_purge_survive_a_restart(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        r = await c.put("/v0/topics/capped", json={"cap_records": 5})
        assert r.status_code == 201
        for i in range(12):
            await _write(c, "capped", {"data": i})
        first = await _diff(c, "capped")
        assert first["tombstone"]["reason"] == "cap"
        backend = _backend(h)
        await backend.write_floors()  # the floor task's pass, without waiting for it
        lo, hi = await backend.bridge.call(partial(backend.store.bounds, 1))
        assert (lo, hi) == (8, 12)  # purged below the floor
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        again = await _diff(c, "capped")
        assert again["tombstone"] == first["tombstone"]
        assert [r["data"] for r in again["records"]] == [7, 8, 9, 10, 11]
        await _write(c, "capped", {"data": 12})
        state = await _json(await c.get("/v0/topics/capped"), 200)
        assert (state["head_seq"], state["earliest_seq"], state["count"]) == (13, 9, 5)


async def test_a_floor_not_yet_stored_is_redone_by_the_rebuild(cluster):
    """Evictions reach the registry in the background: a restart before that re-applies
    the caps to the stream's records and finds the same floor."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await c.put("/v0/topics/capped", json={"cap_records": 3})
        for i in range(6):
            await _write(c, "capped", {"data": i})
        first = await _diff(c, "capped")
        _backend(h).write_floors = _nothing  # type: ignore[method-assign]
    async with open_jetstream_app(cfg) as h:
        again = await _diff(h.app.test_client(), "capped")
        assert again["tombstone"] == first["tombstone"]
        assert again["records"] == first["records"]


async def test_a_stored_floor_holds_even_if_its_purge_never_ran(cluster):
    """The floor reached the registry but the purge did not happen, then the cap was
    loosened: a restart must not bring the evicted records back (the stream still holds
    them), and finishes the purge."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await c.put("/v0/topics/capped", json={"cap_records": 5})
        for i in range(12):
            await _write(c, "capped", {"data": i})
        first = await _diff(c, "capped")
        backend = _backend(h)
        backend.store.purge = _no_purge  # type: ignore[method-assign]
        await backend.write_floors()
        r = await c.put("/v0/topics/capped", json={"cap_records": 100})
        assert r.status_code == 200
        lo, _ = await backend.bridge.call(partial(backend.store.bounds, 1))
        assert lo == 1  # nothing was purged
    async with open_jetstream_app(cfg) as h:
        again = await _diff(h.app.test_client(), "capped")
        assert again["tombstone"] == first["tombstone"]
        assert [x["data"] for x in again["records"]] == [7, 8, 9, 10, 11]
        backend = _backend(h)
        lo, _ = await backend.bridge.call(partial(backend.store.bounds, 1))
        assert lo == 8  # the start finished the purge


async def _no_purge(*args) -> None:
    await asyncio.sleep(0)


async def _nothing() -> None:
    await trio.lowlevel.checkpoint()


async def test_record_deletes_survive_a_restart(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(
            c,
            "d",
            *(
                {"data": i, "tag": tag}
                for i, tag in enumerate(["a", "b", "ab", "a", "c", "b", "a", "x"])
            ),
        )
        r = await c.post("/v0/topics/d/delete", json={"before_seq": 2})
        assert (await _json(r, 200))["deleted"] == 1
        r = await c.post("/v0/topics/d/delete", json={"match": ["tag", "Eq", "b"]})
        assert (await _json(r, 200))["deleted"] == 2
        r = await c.post("/v0/topics/d/delete", json={"match": "a*", "before_seq": 5})
        assert (await _json(r, 200))["deleted"] == 2  # seqs 3 (ab) and 4 (a)
        before = await _diff(c, "d")
        assert [x["$seq"] for x in before["records"]] == [5, 7, 8]
        assert before["tombstone"] is None
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        after = await _diff(c, "d")
        assert after["records"] == before["records"]
        assert after["tombstone"] is None
        state = await _json(await c.get("/v0/topics/d"), 200)
        assert (state["head_seq"], state["count"]) == (8, 3)


async def test_idempotency_survives_a_restart(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(c, "i", {"data": 0})
        first = await _write(c, "i", {"data": 1}, {"data": 2}, idempotency_key="k1")
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        r = await c.post(
            "/v0/topics/i", json={"records": [{"data": 1}, {"data": 2}], "idempotency_key": "k1"}
        )
        replay = await _json(r, 200)
        assert replay["deduped"] is True
        assert (replay["first_seq"], replay["last_seq"]) == (first["first_seq"], 3)
        assert (await _json(await c.get("/v0/topics/i"), 200))["head_seq"] == 3


async def test_idempotency_of_writes_read_back_in_several_pages(cluster):
    """A rebuild reads a stream 1000 records at a time: a keyed write straddling two
    pages is still remembered whole."""
    cfg = jetstream_config(cluster)
    big = [{"data": i} for i in range(700)]
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        one = await _write(c, "pages", *big, idempotency_key="one")
        two = await _write(c, "pages", *big, idempotency_key="two")
        assert (two["first_seq"], two["last_seq"]) == (701, 1400)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        for key, first in (("one", one), ("two", two)):
            r = await c.post("/v0/topics/pages", json={"records": big, "idempotency_key": key})
            replay = await _json(r, 200)
            assert replay["deduped"] is True
            assert {k: replay[k] for k in ("first_seq", "last_seq", "head_seq")} == {
                k: first[k] for k in ("first_seq", "last_seq", "head_seq")
            }


async def test_topic_config_delete_and_recreate_survive_a_restart(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(c, "keep", {"data": 1})
        r = await c.put("/v0/topics/keep", json={"cap_records": 100, "priority": 3})
        assert r.status_code == 200
        await _write(c, "gone", {"data": 1})
        r = await c.delete("/v0/topics/gone")
        assert (await _json(r, 200))["deleted"] is True
        await _write(c, "again", {"data": 1})
        await c.delete("/v0/topics/again")
        await _write(c, "again", {"data": 2})
        ids = {t.name: t.topic_id for t in h.engine.topics.values()}
        await _write(c, "last", {"data": 1})  # the highest id so far, then deleted
        await c.delete("/v0/topics/last")
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        listed = await _json(await c.get("/v0/topics"), 200)
        assert [t["topic"] for t in listed["topics"]] == ["again", "keep"]
        state = await _json(await c.get("/v0/topics/keep"), 200)
        assert (state["config"]["cap_records"], state["config"]["priority"]) == (100, 3)
        again = await _diff(c, "again")
        assert [x["data"] for x in again["records"]] == [2]
        assert {t.name: t.topic_id for t in h.engine.topics.values()} == ids
        # ids are never reused, and the deleted instances' streams are gone
        new = await _write(c, "fresh", {"data": 1})
        assert new["first_seq"] == 1
        assert h.engine.topics["fresh"].topic_id == max(ids.values()) + 2
        backend = _backend(h)
        streams = await backend.bridge.call(backend.store.stream_ids)
        assert sorted(streams) == sorted([*ids.values(), h.engine.topics["fresh"].topic_id])


async def test_orphan_streams_are_removed_at_start(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        backend = _backend(h)
        await backend.bridge.call(partial(backend.store.create_stream, 77))  # no entry
        assert 77 in await backend.bridge.call(backend.store.stream_ids)
    async with open_jetstream_app(cfg) as h:
        backend = _backend(h)
        assert 77 not in await backend.bridge.call(backend.store.stream_ids)


async def test_a_foreign_publish_fences_the_front_off(cluster):
    """A message the front did not write moves the stream's head: the next write's
    expected-last-sequence fails, the write is refused (503), memory never holds a seq
    the stream gave to someone else, and writes resume once the front has read the
    stream back (which a refused write starts)."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(c, "f", {"data": 1})
        backend = _backend(h)
        store = backend.store
        stranger = [(store.subject(1, None), b'{"$seq":2,"$ts":1,"data":"x"}', {})]
        assert await backend.bridge.call(partial(store.publish, 1, 1, stranger)) == 2
        r = await c.post("/v0/topics/f", json={"records": [{"data": 2}]})
        err = (await _json(r, 503))["error"]
        assert err["code"] == "storage_unavailable"
        assert (await _json(await c.get("/v0/topics/f"), 200))["head_seq"] == 1
        r = await c.post("/v0/topics/f", json={"records": [{"data": 3}]})
        assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
        assert await backend.resync(h.engine.topics["f"])
        assert (await _write(c, "f", {"data": 3}))["first_seq"] == 3
        assert [x["data"] for x in (await _diff(c, "f"))["records"]] == [1, "x", 3]
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        assert [x["data"] for x in (await _diff(c, "f"))["records"]] == [1, "x", 3]


async def test_a_write_whose_answer_is_lost_is_settled_from_the_stream(cluster):
    """The publish lands but its answer never arrives (here: the call raises after
    the publish): the front reads the target seq back, finds its own bytes and
    acknowledges the write; no seq is skipped or reused."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(c, "l", {"data": 1})
        store = _backend(h).store
        real = store.publish

        async def lost_answer(*args):
            await real(*args)
            raise TimeoutError("the answer was lost")

        store.publish = lost_answer  # type: ignore[method-assign]
        landed = await _write(c, "l", {"data": 2}, {"data": 3})
        assert (landed["first_seq"], landed["last_seq"]) == (2, 3)

        async def never_lands(*args):
            raise TimeoutError("the request was lost")

        store.publish = never_lands  # type: ignore[method-assign]
        r = await c.post("/v0/topics/l", json={"records": [{"data": 4}]})
        assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
        store.publish = real  # type: ignore[method-assign]
        assert (await _write(c, "l", {"data": 4}))["first_seq"] == 4
        assert [x["data"] for x in (await _diff(c, "l"))["records"]] == [1, 2, 3, 4]


async def test_concurrent_writes_keep_seq_order(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        results: list[dict] = []

        async def writer(k: int) -> None:
            for i in range(10):
                results.append(await _write(c, "cc", {"data": [k, i]}, {"data": [k, i, 1]}))

        async with trio.open_nursery() as n:
            for k in range(8):
                n.start_soon(writer, k)
        seqs = sorted(s for r in results for s in (r["first_seq"], r["last_seq"]))
        assert seqs == list(range(1, 161))
        published = _backend(h).published_batches
        assert published <= 80  # writes waiting behind one another share a batch
        before = await _diff(c, "cc")
    async with open_jetstream_app(cfg) as h:
        assert (await _diff(h.app.test_client(), "cc"))["records"] == before["records"]


async def test_refusals_are_canonical_errors(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(c, "plain", {"data": 1})
        # the batch ceiling: 1000 records pass, 1001 are refused with the ceiling
        ok = await _write(c, "big", *({"data": i} for i in range(BATCH_MAX)))
        assert (ok["first_seq"], ok["last_seq"]) == (1, BATCH_MAX)
        r = await c.post("/v0/topics/big", json={"records": [{"data": 0}] * (BATCH_MAX + 1)})
        err = (await _json(r, 400))["error"]
        assert err["code"] == "batch_too_large"
        assert err["detail"]["max"] == BATCH_MAX
        assert {t.name for t in h.engine.topics.values()} == {"plain", "big"}


async def test_an_unreachable_cluster_refuses_the_start():
    cfg = jetstream_config("nats://127.0.0.1:1")
    js = dataclasses.replace(cfg.storage.jetstream, request_timeout_ms=200)
    cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, jetstream=js))
    with pytest.raises(JetStreamUnavailable, match=r"nats://127\.0\.0\.1:1"):
        async with open_jetstream_engine(cfg, FakeWallClock()):
            pass


async def test_topicd_serve_as_a_front_kill9_and_an_empty_data_dir(cluster, tmp_path):
    """`topicd serve` on the jetstream backend, killed with SIGKILL while writes are in
    flight, then started on a new, empty data directory: every acknowledged write is
    there, and seqs continue (none reused)."""
    env = {
        **cluster.env(),
        "TOPICD_JETSTREAM_PREFIX": "serve1",
    }
    acked: dict[int, int] = {}
    async with serving(tmp_path, env=env) as server:
        async with http_client(server) as hc:
            for i in range(20):
                r = await hc.post("/v0/topics/s", json={"records": [{"data": i}, {"data": -i}]})
                assert r.status_code in (200, 201), r.text
                acked[r.json()["first_seq"]] = i

            enough = trio.Event()

            async def flood() -> None:
                async with http_client(server) as hc2:
                    for i in range(20, 10_000):
                        try:
                            r = await hc2.post("/v0/topics/s", json={"records": [{"data": i}]})
                        except httpx.HTTPError:
                            return  # the front is gone
                        acked[r.json()["first_seq"]] = i
                        if len(acked) >= 60:
                            enough.set()

            async with trio.open_nursery() as n:
                n.start_soon(flood)
                await enough.wait()
                await server.kill()
        server.data_dir = tmp_path / "empty-data-dir"
        await server.start()
        assert "rebuilt 1 topics" in server.run.text
        async with http_client(server) as hc:
            r = await hc.post("/v0/topics/s/diff", json={"from_seq": 0, "limit": 100000})
            records = r.json()["records"]
            by_seq = {x["$seq"]: x["data"] for x in records}
            for seq, i in acked.items():
                assert by_seq[seq] == i
            assert sorted(by_seq) == list(range(1, len(records) + 1))
            r = await hc.post("/v0/topics/s", json={"records": [{"data": "after"}]})
            assert r.json()["first_seq"] == len(records) + 1
            r = await hc.post("/v0/topics/s", json={"records": [{"data": 0}] * (BATCH_MAX + 1)})
            assert r.status_code == 400
            assert r.json()["error"]["detail"] == {"count": BATCH_MAX + 1, "max": BATCH_MAX}
        assert server.run.problems() == []


async def test_sse_watch_backlog_from_the_stream_then_live(cluster, nursery):
    """A watch stream's backlog is loaded back from the stream (nothing is in memory),
    then live records follow, as on the embedded backend."""
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(c, "w", *({"data": i} for i in range(5)))
        loaded = h.engine.payloads.stats().loaded_records
        wid = await watch_helpers.wid_of(c, {"topics": {"w": {"from_seq": 1}}})
        s = await watch_helpers.open_ok(h, nursery, wid)
        frames = await watch_helpers.read_until_event(s, "caught-up")
        backlog = [r["data"] for f in frames if f[0] == "record" for r in f[2]["records"]]
        assert backlog == [1, 2, 3, 4]
        assert h.engine.payloads.stats().loaded_records >= loaded + 4
        await _write(c, "w", {"data": "live"})
        (event, cursors, data) = (await watch_helpers.read(s, 1))[0]
        assert (event, cursors, [r["data"] for r in data["records"]]) == (
            "record",
            {"w": 6},
            ["live"],
        )
        await watch_helpers.close(s)


async def test_long_poll_wakes_on_a_write(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(c, "p", {"data": 0})
        got: list[dict] = []

        async def poll() -> None:
            got.append(await _diff(c, "p", from_seq=1, wait_ms=20_000))

        async with trio.open_nursery() as n:
            n.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            with trio.fail_after(10):
                await _write(c, "p", {"data": 1})
        assert [r["data"] for r in got[0]["records"]] == [1]


async def test_ready_metrics_and_dashboard_feed_on_the_backend(cluster):
    async with open_jetstream_app(jetstream_config(cluster)) as h:
        c = h.app.test_client()
        await _write(c, "m", {"data": 1})
        await _diff(c, "m")
        body = await _json(await c.get("/v0/ready"), 200)
        assert body.get("storage") is None, body
        r = await c.get("/v0/metrics")
        text = (await r.get_data()).decode()
        assert r.status_code == 200, text
        assert "topicd_records_appended_total 1.0" in text
        r = await c.get("/v0/metrics", headers={"Accept": "application/json"})
        assert r.status_code == 200


async def test_the_topic_ingest_bound_at_its_edge(cluster):
    """`storage.wal.max_pending_per_topic` bounds a topic's accepted, unpublished writes
    on this backend too: at the bound a write is `429 wal_ingest` (scope `topic`), a
    `disable_backpressure` write waits for room instead, and nothing is lost."""
    base = jetstream_config(cluster)
    wal = dataclasses.replace(base.storage.wal, max_pending_per_topic=2)
    cfg = dataclasses.replace(base, storage=dataclasses.replace(base.storage, wal=wal))
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        await _write(c, "g", {"data": 0})
        backend = _backend(h)
        store = backend.store
        real = store.publish

        async def make_gate() -> asyncio.Event:
            return asyncio.Event()

        gate = await backend.bridge.call(make_gate)

        async def held(*args):
            await gate.wait()
            return await real(*args)

        store.publish = held  # type: ignore[method-assign]
        answers: dict[str, dict] = {}

        async def post(name: str, **extra) -> None:
            r = await c.post("/v0/topics/g", json={"records": [{"data": name}], **extra})
            answers[name] = await _json(r)

        async with trio.open_nursery() as n:
            n.start_soon(post, "one")  # in flight
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(post, "two")  # queued behind it: the bound (2) is reached
            await trio.testing.wait_all_tasks_blocked()
            r = await c.post("/v0/topics/g", json={"records": [{"data": "three"}]})
            err = (await _json(r, 429))["error"]
            assert err["code"] == "throttled"
            assert (err["detail"]["cause"], err["detail"]["scope"]) == ("wal_ingest", "topic")
            n.start_soon(partial(post, "bypass", disable_backpressure=True))
            await trio.testing.wait_all_tasks_blocked()
            assert "bypass" not in answers  # waiting for room, not refused

            async def open_gate() -> None:
                gate.set()

            await backend.bridge.call(open_gate)
        assert [answers[k]["first_seq"] for k in ("one", "two", "bypass")] == [2, 3, 4]
        store.publish = real  # type: ignore[method-assign]
        assert [x["data"] for x in (await _diff(c, "g"))["records"]] == [
            0,
            "one",
            "two",
            "bypass",
        ]


async def test_a_failing_cluster_is_503_and_changes_nothing(cluster):
    cfg = jetstream_config(cluster)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        store = _backend(h).store

        async def broken(*args):
            raise ConnectionError("no route to the cluster")

        real = store.create_stream
        store.create_stream = broken  # type: ignore[method-assign]
        r = await c.put("/v0/topics/x", json={})
        err = (await _json(r, 503))["error"]
        assert (err["code"], err["detail"]) == ("storage_unavailable", {"backend": "jetstream"})
        assert "x" not in h.engine.topics
        store.create_stream = real  # type: ignore[method-assign]
        await _write(c, "x", *({"data": i, "tag": "t"} for i in range(3)))
        store.purge = broken  # type: ignore[method-assign]
        r = await c.post("/v0/topics/x/delete", json={"match": "t"})
        assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
        assert (await _json(await c.get("/v0/topics/x"), 200))["count"] == 3
        # the seam's `abandoned` runs when the mutation will never be applied
        store.put_entry = broken  # type: ignore[method-assign]
        topic = h.engine.topics["x"]
        frame = frames.encode_control(
            frames.TOPIC_CONFIG, topic.topic_id, 0, {"config": topic.config.to_wire()}
        )
        calls: list[str] = []
        with pytest.raises(StorageUnavailable):
            await _backend(h).control(
                topic,
                frame,
                lambda: calls.append("applied"),
                abandoned=lambda: calls.append("abandoned"),
            )
        assert calls == ["abandoned"]


async def test_ttl_evictions_and_their_reason_survive_a_restart(cluster):
    """Records past their TTL are evicted (a `ttl` tombstone); once the floor reached the
    registry, a restart at an earlier wall-clock time still serves the same tombstone and
    none of the expired records."""
    cfg = jetstream_config(cluster)
    clock = FakeWallClock()
    async with open_jetstream_app(cfg, clock) as h:
        c = h.app.test_client()
        await c.put("/v0/topics/ttl", json={"ttl_ms": 60_000})
        await _write(c, "ttl", {"data": "old1"}, {"data": "old2"})
        clock.jump(61_000)
        await _write(c, "ttl", {"data": "new"})
        first = await _diff(c, "ttl")
        assert first["tombstone"]["reason"] == "ttl"
        assert [x["data"] for x in first["records"]] == ["new"]
        await _backend(h).write_floors()
    async with open_jetstream_app(cfg, FakeWallClock()) as h:  # the clock starts over
        again = await _diff(h.app.test_client(), "ttl")
        assert again["tombstone"] == first["tombstone"]
        assert [x["data"] for x in again["records"]] == ["new"]


async def test_the_cluster_restarting_under_a_front(tmp_path):
    """The server stops while the front runs: writes answer `503 storage_unavailable`,
    reads keep working from memory; once the server is back and the client reconnected,
    the front reads its stream back and writes continue at the next seq. The write
    answered 503 may still land (the client flushes what it buffered when it reconnects,
    fenced by its expected last sequence): then it is read back and served at its seq,
    never duplicated or overwritten. A front closing while the server is down exits in
    bounded time."""
    root = tmp_path / "nats"
    server = start_nats(require_binary(), root)
    port = server.url.rsplit(":", 1)[1]
    base = jetstream_config(server.url)
    js = dataclasses.replace(base.storage.jetstream, request_timeout_ms=500)
    cfg = dataclasses.replace(base, storage=dataclasses.replace(base.storage, jetstream=js))
    try:
        async with open_jetstream_app(cfg) as h:
            c = h.app.test_client()
            await _write(c, "o", {"data": 1}, {"data": 2})
            backend = _backend(h)
            server.stop()
            r = await c.post("/v0/topics/o", json={"records": [{"data": "lost?"}]})
            assert (await _json(r, 503))["error"]["code"] == "storage_unavailable"
            state = await _json(await c.get("/v0/topics/o"), 200)
            assert state["head_seq"] == 2
            server = start_nats(require_binary(), root, listen=f"127.0.0.1:{port}")
            with trio.fail_after(20):
                await backend.bridge.call(backend.store.wait_connected)
            assert await backend.resync(h.engine.topics["o"])
            head = (await _json(await c.get("/v0/topics/o"), 200))["head_seq"]
            assert head in (2, 3)  # 3: the 503'd write landed after the reconnect
            third = await _write(c, "o", {"data": 3})
            assert third["first_seq"] == head + 1
            expected = [1, 2, "lost?", 3] if head == 3 else [1, 2, 3]
            assert [x["data"] for x in (await _diff(c, "o"))["records"]] == expected
            server.stop()
            t0 = trio.current_time()
        assert trio.current_time() - t0 < 5  # the close did not hang on the dead server
        server = start_nats(require_binary(), root, listen=f"127.0.0.1:{port}")
        async with open_jetstream_app(cfg) as h:
            records = (await _diff(h.app.test_client(), "o"))["records"]
            assert [x["data"] for x in records] == expected
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


async def test_ephemeral_topics_on_an_in_memory_stream(tmp_path):
    """`ephemeral` on its own server (restarted here): the topic's stream is R1 in the
    server's memory. A front restart loses nothing (the server still holds the records);
    a server restart loses them, as the class allows: the topic comes back empty and its
    seqs are never handed out again (it resumes above the reservation in its registry
    entry), after a restart of the front and under a running one alike. Record deletes
    reach the stream (durability changes, which move the records to another stream:
    `test_moves.py`)."""
    root = tmp_path / "nats"
    server = start_nats(require_binary(), root)
    port = server.url.rsplit(":", 1)[1]
    base = jetstream_config(server.url)
    js = dataclasses.replace(base.storage.jetstream, request_timeout_ms=1000)
    cfg = dataclasses.replace(base, storage=dataclasses.replace(base.storage, jetstream=js))
    reserve = cfg.storage.wal.ephemeral_head_reserve_ahead

    def restart_server():
        nonlocal server
        server.stop()
        server = start_nats(require_binary(), root, listen=f"127.0.0.1:{port}")

    try:
        async with open_jetstream_app(cfg) as h:
            c = h.app.test_client()
            r = await c.put("/v0/topics/e", json={"durability": "ephemeral"})
            assert (await _json(r, 201))["config"]["durability"] == "ephemeral"
            await _write(c, "e", {"data": 1})
            two = await _write(c, "e", {"data": 2}, {"data": 3}, idempotency_key="k")
            assert (two["first_seq"], two["last_seq"]) == (2, 3)
            await _write(c, "d", {"data": "kept"})
            backend = _backend(h)
            info = await backend.bridge.call(
                partial(backend.store.js.stream_info, backend.store.stream(1))
            )
            assert (str(info.config.storage), info.config.num_replicas) == ("memory", 1)
            r = await c.post("/v0/topics/e/delete", json={"before_seq": 2})
            assert (await _json(r, 200))["deleted"] == 1
        async with open_jetstream_app(cfg) as h:  # the front restarts, the server does not
            c = h.app.test_client()
            assert [x["data"] for x in (await _diff(c, "e"))["records"]] == [2, 3]
            r = await c.post(
                "/v0/topics/e", json={"records": [{"data": 2}, {"data": 3}], "idempotency_key": "k"}
            )
            assert ((await _json(r, 200))["deduped"], r.status_code) == (True, 200)
        restart_server()
        async with open_jetstream_app(cfg) as h:  # the records were in the server's memory
            c = h.app.test_client()
            state = await _json(await c.get("/v0/topics/e"), 200)
            head = 1 + reserve  # (reserved by the first write)
            assert (state["head_seq"], state["count"], state["earliest_seq"]) == (
                head,
                0,
                head + 1,
            )
            assert (await _diff(c, "e"))["records"] == []
            assert [x["data"] for x in (await _diff(c, "d"))["records"]] == ["kept"]
            assert (await _write(c, "e", {"data": "after"}))["first_seq"] == head + 1
            # the server restarts under the running front: the write in flight may fail,
            # then the stream is found emptied and the topic resumes above the reservation
            backend = _backend(h)
            restart_server()
            with trio.fail_after(20):
                await backend.bridge.call(backend.store.wait_connected)
            assert await backend.resync(h.engine.topics["e"])
            later = await _write(c, "e", {"data": "later"})
            assert later["first_seq"] > head + 1 + reserve
            assert [x["data"] for x in (await _diff(c, "e"))["records"]] == ["later"]
        async with open_jetstream_app(cfg) as h:
            c = h.app.test_client()
            assert [x["$seq"] for x in (await _diff(c, "e"))["records"]] == [later["first_seq"]]
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


async def test_r3_streams_on_a_three_node_cluster_survive_a_node_stopping(tmp_path):
    """`replicas = 3` on a three-server loopback cluster: each topic's stream and the
    registry are replicated; with one follower stopped, writes are still acknowledged
    (a quorum of 2) and a restarted front rebuilds everything from the two left."""
    servers = start_cluster(require_binary(), tmp_path)
    try:
        base = jetstream_config(servers[0].url)
        js = dataclasses.replace(
            base.storage.jetstream,
            servers=tuple(s.url for s in servers),
            replicas=3,
            request_timeout_ms=3000,
        )
        cfg = dataclasses.replace(base, storage=dataclasses.replace(base.storage, jetstream=js))
        async with open_jetstream_app(cfg) as h:
            c = h.app.test_client()
            await _write(c, "r3", *({"data": i} for i in range(3)))
            backend = _backend(h)

            async def leader() -> str:
                assert backend.store.js is not None
                info = await backend.store.js.stream_info(backend.store.stream(1))
                assert info.config.num_replicas == 3
                assert info.cluster is not None
                return str(info.cluster.leader)

            lead = await backend.bridge.call(leader)
            follower = next(s for i, s in enumerate(servers) if f"n{i}" != lead)
            follower.stop()
            more = await _write(c, "r3", {"data": 3}, {"data": 4})
            assert (more["first_seq"], more["last_seq"]) == (4, 5)
        async with open_jetstream_app(cfg) as h:
            records = (await _diff(h.app.test_client(), "r3"))["records"]
            assert [x["data"] for x in records] == [0, 1, 2, 3, 4]
    finally:
        for s in servers:
            if s.proc is not None and s.proc.poll() is None:
                s.stop()


async def test_a_direct_get_answered_short_is_checked_with_the_leader(cluster):
    """A direct get may be answered by a replica that lags behind the leader: an answer
    that ends below the seq asked for, its server reporting nothing after it, is checked
    with the leader and retried while the leader holds more; a short answer the leader
    confirms (records deleted at the tail) is taken as it is."""
    async with open_jetstream_app(jetstream_config(cluster)) as h:
        c = h.app.test_client()
        await _write(c, "lag", *({"data": i} for i in range(4)))
        backend = _backend(h)
        store = backend.store
        tid = h.engine.topics["lag"].topic_id
        real = store._read_once
        answers: list[int] = []

        async def lagging_once(topic_id, lo, hi, max_bytes):
            out, more = await real(topic_id, lo, hi, max_bytes)
            if not answers:  # the first answer: a replica two records behind
                out, more = [m for m in out if m.seq <= 2], False
            answers.append(len(out))
            return out, more

        store._read_once = lagging_once  # type: ignore[method-assign]
        got = await backend.bridge.call(partial(store.read, tid, 1, 4, 1 << 20))
        assert [m.seq for m in got] == [1, 2, 3, 4]
        assert answers == [2, 4]
        # the tail deleted: the leader has nothing there either, one answer is enough
        store._read_once = real  # type: ignore[method-assign]
        await backend.bridge.call(partial(store.delete_msgs, tid, [3, 4]))
        leader_checks: list[int] = []
        real_leader = store._leader_has

        async def counted(topic_id, lo, hi):
            leader_checks.append(lo)
            return await real_leader(topic_id, lo, hi)

        store._leader_has = counted  # type: ignore[method-assign]
        got = await backend.bridge.call(partial(store.read, tid, 1, 4, 1 << 20))
        assert [m.seq for m in got] == [1, 2]
        assert leader_checks == [3]
