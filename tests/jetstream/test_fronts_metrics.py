"""`/v0/metrics` across several fronts: a scrape of any front answers for the deployment.

Method: three fronts of one deployment (three owner shards, one each) run in this
process, each with its own engine, asyncio bridge and NATS connection, and each is
scraped through its own HTTP app. Streams are opened on different fronts, topics of
every shard are written through different fronts, and every front's scrape (Prometheus
text and JSON) must count all of them, as one process would; `?scope=front` must give
each front's own figures, whose sums are the deployment's. A front stopped, one that
answers an error and one that does not answer in time are left out of the scrape, which
says so (`topicd_fronts_answered`, `fronts.missing`) and still answers `200`.
No test waits for time to pass: streams are read until their frames arrive, and the
only wait is the scrape's own bound on a front that never answers, shortened to 0.2 s.
"""

from __future__ import annotations

import re
from contextlib import AsyncExitStack

import pytest
import trio

from tests.http.test_contract_work import jobs
from tests.http.test_contract_work import open_ok as open_work
from tests.jetstream.conftest import open_jetstream_app
from tests.jetstream.test_fronts import _balance, _diff, _fronts, _json, _sharded, _write
from tests.watch import helpers as watch_helpers
from topicd.storage import jsfronts
from topicd.testing.fake_clock import FakeWallClock

pytestmark = pytest.mark.slow

JSON = {"Accept": "application/json"}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


async def _text(client, **query) -> dict[str, float]:
    """A Prometheus scrape as {series: value}."""
    r = await client.get("/v0/metrics", query_string=query)
    raw = (await r.get_data()).decode()
    assert r.status_code == 200, raw
    out = {}
    for line in raw.splitlines():
        if line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m is not None, line
            out[m.group(1)] = float(m.group(2))
    return out


async def _snap(client, **query) -> dict:
    return await _json(await client.get("/v0/metrics", headers=JSON, query_string=query), 200)


def _one_per_shard(front, prefix: str) -> list[str]:
    """A topic name of each shard, by shard."""
    names: dict[int, str] = {}
    for i in range(1000):
        names.setdefault(front.shard_of(f"{prefix}{i}"), f"{prefix}{i}")
        if len(names) == front.shards:
            break
    return [names[k] for k in sorted(names)]


async def _open(stack: AsyncExitStack, cfg, clock, n: int) -> list:
    hs = [await stack.enter_async_context(open_jetstream_app(cfg, clock)) for _ in range(n)]
    await _balance(*hs)
    return hs


async def test_a_scrape_on_any_front_counts_every_fronts_streams_topics_and_records(
    cluster, nursery
):
    """Topics of every shard, written through every front; a `/work` stream on one
    front and watch streams on the two others: every front's scrape counts the three
    streams, every topic, record and lease, with each topic's series from its owner,
    and its counters are the sums of the fronts' own (`scope=front`)."""
    cfg = _sharded(cluster, 3)
    async with AsyncExitStack() as stack:
        hs = await _open(stack, cfg, FakeWallClock(), 3)
        clients = [h.app.test_client() for h in hs]
        fronts = [_fronts(h) for h in hs]
        assert sorted(len(f.owned) for f in fronts) == [1, 1, 1]
        logs = _one_per_shard(fronts[0], "log")
        for j, client in enumerate(clients):  # each topic written through each front
            for name in logs:
                await _write(client, name, {"data": j}, {"data": j, "tag": "x"})
        queue = _one_per_shard(fronts[0], "q")[0]
        body = {"type": "queue", "depth_soft_limit": 100}
        await _json(await clients[1].put(f"/v0/topics/{queue}", json=body), 201)
        await _write(clients[2], queue, {"data": "job1"}, {"data": "job2"})
        # a `/work` stream on a front, watch streams on the two others
        work_on = next(i for i, f in enumerate(fronts) if not f.owns(queue))
        work = await open_work(hs[work_on], nursery, queue, node="w1")
        await jobs(work, 1)
        watches = []
        for i in (i for i in range(3) if i != work_on):
            wid = await watch_helpers.wid_of(clients[i], {"topics": {logs[i]: {}}})
            s = await watch_helpers.open_ok(hs[i], nursery, wid)
            await watch_helpers.read_until_event(s, "caught-up")
            watches.append(s)
        topics = [*logs, queue]
        own = [await _text(c, scope="front") for c in clients]
        assert [o["topics_sse_connections"] for o in own] == [1, 1, 1]
        assert all("topicd_fronts_live" not in o for o in own)
        for client in clients:
            text = await _text(client)
            assert text["topics_sse_connections"] == 3
            assert text["topics_watch_sessions"] == 2
            assert text["topics_topics"] == 4
            assert text['topics_topics_by_class{class="disk"}'] == 4
            assert text["topics_queue_topics"] == 1
            assert text["topics_records_live"] == 3 * 2 * 3 + 2
            assert text["topics_queue_leases_in_flight"] == 1
            for name in logs:
                assert text[f'topics_topic_head_seq{{topic="{name}"}}'] == 6
                assert text[f'topics_topic_records_live{{topic="{name}"}}'] == 6
            assert text[f'topics_topic_queue_in_flight{{topic="{queue}"}}'] == 1
            assert text[f'topics_topic_queue_ready{{topic="{queue}"}}'] == 1
            assert text[f'topicd_jobs_work_streams{{topic="{queue}"}}'] == 1
            assert text["topics_topic_metrics_truncated"] == 0
            # the queue's depth level: its owner's (one job leased, one ready)
            level = f'{{queue="jobs.{queue}"}}'
            assert text[f"topicd_queue_capacity{level}"] == 100
            assert text[f"topicd_queue_depth{level}"] == 1
            # every topic once, in name order, as one process lists them
            heads = [k for k in text if k.startswith("topics_topic_head_seq{")]
            assert heads == [f'topics_topic_head_seq{{topic="{n}"}}' for n in sorted(topics)]
            # records appended: each by its owner; summed, the deployment's
            assert text["topicd_records_appended_total"] == 3 * 2 * 3 + 2
            assert (text["topicd_fronts_live"], text["topicd_fronts_answered"]) == (3, 3)
            snap = await _snap(client)
            assert (snap["sse_connections"], snap["watch_sessions"]) == (3, 2)
            assert (snap["topics"], snap["topics_disk"], snap["queue_topics"]) == (4, 4, 1)
            assert snap["records_live"] == 20 and snap["queue_leases_in_flight"] == 1
            assert snap["records_appended"] == 20
            q = snap["queues"][queue]
            assert (q["ready"], q["in_flight"], q["work_streams"]) == (1, 1, 1)
            assert snap["fronts"] == {"live": 3, "answered": 3, "missing": []}
            levels = [e for e in snap["internal_queues"] if e["name"] == f"jobs.{queue}"]
            assert [(e["depth"], e["capacity"]) for e in levels] == [(1, 100)]
        # the bytes: the sum of each topic's, as its owner has them
        text = await _text(clients[0])
        assert text["topics_bytes_live"] == sum(
            text[f'topics_topic_bytes_live{{topic="{n}"}}'] for n in topics
        )
        # a process figure stays the scraped front's own (not the sum of three)
        own0 = await _text(clients[0], scope="front")
        assert text["topics_ready"] == own0["topics_ready"] == 1
        assert text["topicd_client_permits"] == own0["topicd_client_permits"] > 0
        # requests: the deployment's counter is the sum of the fronts' own (this
        # front's own scrape counted once more)
        key = 'topicd_http_requests_total{path="hypercorn"}'
        own = [(await _text(c, scope="front"))[key] for c in clients]
        assert (await _text(clients[0]))[key] == sum(own) + 1
        for s in [work, *watches]:
            s.disconnect()
            await s.wait_done()
        for client in clients:
            snap = await _snap(client)
            assert (snap["sse_connections"], snap["queues"][queue]["work_streams"]) == (0, 0)


async def test_a_front_that_is_stopped_or_silent_is_left_out_and_the_scrape_says_so(
    cluster, nursery, monkeypatch
):
    """A stopped front (no responders), one answering an error (not serving yet) and
    one that does not answer within the bound: each scrape answers `200` with the others'
    figures, names the fronts missing, and counts the topics of a missing front's shard
    from what the scraped front knows."""
    cfg = _sharded(cluster, 3)
    async with AsyncExitStack() as outer:
        a, b = await _open(outer, cfg, FakeWallClock(), 2)
        async with AsyncExitStack() as inner:
            c = await inner.enter_async_context(open_jetstream_app(cfg, a.clock))
            await _balance(a, b, c)
            ca, cb = a.app.test_client(), b.app.test_client()
            names = _one_per_shard(_fronts(a), "t")
            for name in names:
                await _write(ca, name, {"data": 1})
                await _diff(ca, name)  # (`a` caught up: what it counts `c`'s topic from)
            wid = await watch_helpers.wid_of(cb, {"topics": {names[0]: {}}})
            s = await watch_helpers.open_ok(b, nursery, wid)
            await watch_helpers.read_until_event(s, "caught-up")
            gone = _fronts(c).front_id
        # `c` stopped (its lease given up, its connection closed); `a` still lists it
        assert gone in _fronts(a).store.member_ids
        text = await _text(ca)
        assert (text["topicd_fronts_live"], text["topicd_fronts_answered"]) == (3, 2)
        assert text["topics_sse_connections"] == 1  # (`b`'s stream)
        assert text["topics_topics"] == 3  # (`c`'s shard counted by `a`)
        assert text["topics_records_live"] == 3
        snap = await _snap(ca)
        assert snap["fronts"] == {"live": 3, "answered": 2, "missing": [gone]}
        assert (snap["topics"], snap["sse_connections"]) == (3, 1)
        # `b` answers an error (as a front does before it serves): left out too
        figures = b.engine.figures
        b.engine.figures = None
        snap = await _snap(ca)
        assert snap["fronts"] == {
            "live": 3,
            "answered": 1,
            "missing": sorted([gone, _fronts(b).front_id]),
        }
        assert (snap["topics"], snap["sse_connections"]) == (3, 0)

        # `b` never answers: the scrape goes on without it after its bound
        async def silent(head, counted):
            await trio.sleep_forever()

        b.engine.figures = silent
        with monkeypatch.context() as m:
            m.setattr(jsfronts, "METRICS_WAIT_S", 0.2)  # (the bound, shortened)
            text = await _text(ca)
        assert (text["topicd_fronts_live"], text["topicd_fronts_answered"]) == (3, 1)
        assert text["topics_topics"] == 3
        b.engine.figures = figures
        text = await _text(ca)
        assert (text["topicd_fronts_answered"], text["topics_sse_connections"]) == (2, 1)
        # once `a`'s lease check has seen `c` leave, it is no longer live
        await _fronts(a)._tend_lease()
        text = await _text(ca)
        assert (text["topicd_fronts_live"], text["topicd_fronts_answered"]) == (2, 2)
        await watch_helpers.close(s)


async def test_scope_front_is_the_fronts_own_figures_and_a_bad_scope_is_400(cluster, nursery):
    """`?scope=front` answers what the front itself holds and did (no other front
    asked: no `topicd_fronts_*`, no `fronts`); `scope=deployment` is the default;
    any other scope is `400 invalid_request`."""
    cfg = _sharded(cluster, 3)
    async with AsyncExitStack() as stack:
        hs = await _open(stack, cfg, FakeWallClock(), 3)
        clients = [h.app.test_client() for h in hs]
        await _write(clients[0], "x", {"data": 1})
        wid = await watch_helpers.wid_of(clients[1], {"topics": {"x": {}}})
        s = await watch_helpers.open_ok(hs[1], nursery, wid)
        await watch_helpers.read_until_event(s, "caught-up")
        snaps = [await _snap(c, scope="front") for c in clients]
        assert [x["sse_connections"] for x in snaps] == [0, 1, 0]
        assert [x["watch_sessions"] for x in snaps] == [0, 1, 0]
        assert all("fronts" not in x for x in snaps)
        texts = [await _text(c, scope="front") for c in clients]
        assert [t["topics_sse_connections"] for t in texts] == [0, 1, 0]
        assert not any(k.startswith("topicd_fronts_") for t in texts for k in t)
        for c in clients:
            assert (await _snap(c, scope="deployment"))["sse_connections"] == 1
            assert (await _snap(c))["fronts"]["answered"] == 3
            r = await c.get("/v0/metrics", query_string={"scope": "all"})
            body = await _json(r, 400)
            assert body["error"]["code"] == "invalid_request"
            assert body["error"]["detail"] == {"parameter": "scope"}
        await watch_helpers.close(s)
