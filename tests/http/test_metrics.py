"""`GET /v0/metrics`: the Prometheus series of api-ops §3.1 and the JSON snapshot.

Method: drive the app (in-memory, then durable on a `FakeDisk`), scrape, and parse the
text exposition line by line: every listed family has exactly its `# TYPE` line and
sample names, no `*_created` series appear, and values follow what the test did.
"""

from __future__ import annotations

import re

import trio

from topicd.testing.fake_clock import advance
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, make_config, open_app, open_durable_app


def families(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def sample(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, (name, labels)
    return float(m.group(1))


EXPECTED = {
    "topics_topics": "gauge",
    "topics_topics_by_class": "gauge",
    "topics_routers": "gauge",
    "topics_records_live": "gauge",
    "topics_bytes_live": "gauge",
    "topics_topic_head_seq": "gauge",
    "topics_topic_earliest_seq": "gauge",
    "topics_topic_records_live": "gauge",
    "topics_topic_bytes_live": "gauge",
    "topics_topic_metrics_truncated": "gauge",
    "topics_queue_topics": "gauge",
    "topics_queue_leases_in_flight": "gauge",
    "topics_sse_connections": "gauge",
    "topics_watch_sessions": "gauge",
    "topics_ready": "gauge",
    "topics_recovery_progress": "gauge",
    "topics_uptime_ms": "counter",
    "topicd_build_info": "gauge",
    "topicd_pressure": "gauge",
    "topicd_throttled_total": "counter",
}
WAL = {
    "topics_wal_frames_total": "counter",
    "topics_wal_batches_total": "counter",
    "topics_wal_fsyncs_total": "counter",
    "topics_wal_bytes_written_total": "counter",
    "topics_wal_rotations_total": "counter",
    "topics_wal_queue_depth": "gauge",
    "topics_wal_queue_depth_peak": "gauge",
    "topics_wal_submit_full_total": "counter",
    "topics_wal_read_only": "gauge",
    "topics_wal_fsync_latency_us": "histogram",
    "topicd_breaker_state": "gauge",
}


async def test_in_memory_series():
    async with open_app(make_config(limits={"max_topics": 1})) as h:
        c = h.app.test_client()
        await c.post("/v0/topics/a", json={"records": [{"data": 1}, {"data": 2}]})
        r = await c.post("/v0/topics/b", json={"records": [{"data": 1}]})
        assert r.status_code == 429
        r = await c.get("/v0/metrics")
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = (await r.get_data()).decode()
        fam = families(text)
        for name, typ in EXPECTED.items():
            assert fam.get(name) == typ, name
        assert not any(name.startswith("topics_wal") for name in fam)
        assert "_created" not in text
        assert sample(text, "topics_topics") == 1
        assert sample(text, "topics_records_live") == 2
        assert sample(text, "topics_topic_head_seq", '{topic="a"}') == 2
        assert sample(text, "topics_topics_by_class", '{class="disk"}') == 1
        assert sample(text, "topics_topics_by_class", '{class="fsync"}') == 0
        assert sample(text, "topicd_throttled_total", '{cause="limit"}') == 1
        assert sample(text, "topics_uptime_ms") >= 0
        r = await c.get("/v0/metrics", headers={"Accept": "application/json"})
        body = await r.get_json()
        assert body["topics"] == 1
        assert body["records_live"] == 2
        assert "wal" not in body


async def test_wal_series_when_durable():
    async with open_durable_app(FakeDisk(), durable_config()) as h:
        c = h.app.test_client()
        await c.put("/v0/topics/f", json={"durability": "fsync"})
        for i in range(3):
            await c.post("/v0/topics/f", json={"records": [{"data": i}]})
        text = (await (await c.get("/v0/metrics")).get_data()).decode()
        fam = families(text)
        for name, typ in WAL.items():
            assert fam.get(name) == typ, name
        assert sample(text, "topics_wal_fsyncs_total") >= 3
        assert sample(text, "topics_wal_fsync_latency_us_count") >= 3
        assert sample(text, "topics_wal_fsync_latency_us_bucket", '{le="+Inf"}') >= 3
        assert sample(text, "topicd_breaker_state", '{shard="0"}') == 0
        assert sample(text, "topicd_wal_records_synced_total") >= 3
        body = await (await c.get("/v0/metrics", headers={"Accept": "application/json"})).get_json()
        assert body["wal"]["fsyncs"] >= 3


async def test_watch_and_scheduler_series(autojump_clock, nursery):

    from topicd.testing.sse import open_stream

    cfg = make_config(sse={"channel_frames": 2})
    async with open_app(cfg) as h:
        c = h.app.test_client()
        await c.put("/v0/topics/w", json={})
        wids = []
        for _ in range(2):
            r = await c.post("/v0/watch", json={"topics": {"w": {}}})
            wids.append((await r.get_json())["wid"])
        s = await open_stream(nursery, h.app.asgi_app, wids[0])
        await s.read_frames(3)  # then never reads: it lags
        for i in range(10):
            await c.post("/v0/topics/w", json={"records": [{"data": i}]})
            await advance(autojump_clock, 0.001)  # (virtual time: the drain runs)
        text = (await (await c.get("/v0/metrics")).get_data()).decode()
        fam = families(text)
        assert fam["topicd_sse_lagged_total"] == "counter"
        assert fam["topicd_sched_ready"] == "gauge"
        assert sample(text, "topics_sse_connections") == 1
        assert sample(text, "topics_watch_sessions") == 2
        assert sample(text, "topicd_sse_lagged_total") == 1
        assert sample(text, "topicd_sse_lagged") == 1
        assert sample(text, "topicd_sched_drains_total") >= 2
        assert sample(text, "topicd_sched_latency_seconds_count") == sample(
            text, "topicd_sched_drains_total"
        )
        assert sample(text, "topicd_sched_ready", '{band="B1",shard="0"}') == 0
        assert sample(text, "topicd_sched_served_total", '{band="B3"}') >= 2  # read recency
        body = await (await c.get("/v0/metrics", headers={"Accept": "application/json"})).get_json()
        assert (body["sse_connections"], body["watch_sessions"]) == (1, 2)


async def test_governor_series(autojump_clock):
    async with open_app() as h:
        c = h.app.test_client()
        engine = h.engine
        engine._govern(0.7, 12.5, 5.25)
        engine.governor.signals["pool"] = 0.7
        text = (await (await c.get("/v0/metrics")).get_data()).decode()
        fam = families(text)
        for name in (
            "topicd_pressure_signal",
            "topicd_coalesce_window_ms",
            "topicd_commit_window_ms",
            "topicd_defer_active",
            "topicd_sched_latency_ms",
            "topicd_loop_lag_ms",
        ):
            assert fam[name] == "gauge", name
        assert fam["topicd_dropped_total"] == "counter"
        assert fam["topicd_sched_latency_seconds"] == "histogram"
        assert 'topicd_sched_latency_seconds_bucket{le="+Inf"}' in text
        assert fam["topicd_defer_episodes_total"] == "counter"
        assert sample(text, "topicd_pressure") == 0.7
        assert sample(text, "topicd_pressure_signal", '{signal="pool"}') == 0.7
        assert sample(text, "topicd_dropped_total", '{kind="sse_advisory"}') == 0
        body = await (await c.get("/v0/metrics", headers={"Accept": "application/json"})).get_json()
        assert body["pressure"] == 0.7
        assert set(body["governor"]) >= {"signals", "commit_window_ms", "defer_active"}


async def test_json_snapshot_rounds_tiny_floats(autojump_clock):
    """Decayed EWMAs print as 0.0, never as `3.8e-35`; other floats keep 4 decimals."""
    async with open_app() as h:
        c = h.app.test_client()
        engine = h.engine
        engine._govern(3.8e-35, 0.0, 0.5)
        engine.governor.signals["latency"] = 1.2345678e-7
        engine.governor.signals["pool"] = 0.123456789
        engine.governor.signals["depth"] = -0.0
        engine.governor.loop_lag_ms = 0.00004999
        r = await c.get("/v0/metrics", headers={"Accept": "application/json"})
        raw = (await r.get_data()).decode()
        assert not re.search(r"\d[eE][-+]?\d", raw), raw
        body = await r.get_json()
        assert body["pressure"] == 0.0
        signals = body["governor"]["signals"]
        assert signals["latency"] == 0.0
        assert signals["pool"] == 0.1235
        assert '"depth":0.0' in raw  # -0.0 is written as 0.0
        assert body["governor"]["loop_lag_ms"] == 0.0
        assert body["governor"]["commit_window_ms"] == 0.5
        assert body["ready"] is True  # bools and ints are left alone
        assert isinstance(body["uptime_ms"], int)


def test_tidy_floats_recurses_and_keeps_non_floats():
    from topicd.http.metrics import tidy_floats

    value = {"a": [1.00004, 2, True, None, "x"], "b": {"c": 1e-9, "d": 12345.678912}}
    assert tidy_floats(value) == {"a": [1.0, 2, True, None, "x"], "b": {"c": 0.0, "d": 12345.6789}}


async def test_queue_ready_by_priority_covers_the_top_8_levels(autojump_clock):
    async with open_app() as h:
        c = h.app.test_client()
        await c.put("/v0/topics/q", json={"type": "queue"})
        # priorities 0..9, two jobs each, plus three more at priority 9
        recs = [{"data": i, "priority": i % 10} for i in range(20)]
        recs += [{"data": 100 + i, "priority": 9} for i in range(3)]
        assert (await c.post("/v0/topics/q", json={"records": recs})).status_code == 200
        r = await c.post("/v0/topics/q/claim", json={"node": "w", "max": 4})
        claimed = (await r.get_json())["claimed"]  # all four at priority 9
        assert [j["$priority"] for j in claimed] == [9, 9, 9, 9]
        nack = {"node": "w", "seqs": [claimed[0]["$seq"]], "lease_ids": [claimed[0]["lease_id"]]}
        assert (
            await c.post("/v0/topics/q/nack", json={**nack, "delay_ms": 60_000})
        ).status_code == 200
        ack = {"node": "w", "seqs": [claimed[1]["$seq"]], "lease_ids": [claimed[1]["lease_id"]]}
        assert (await c.post("/v0/topics/q/ack", json=ack)).status_code == 200
        text = (await (await c.get("/v0/metrics")).get_data()).decode()
        got = {
            int(p): float(v)
            for p, v in re.findall(
                r'^topicd_queue_ready_by_priority\{priority="(\d+)",topic="q"\} (\S+)$', text, re.M
            )
        }
        # 9: five jobs, one acked, two leased, one delayed -> 1 claimable; 2..8: two each;
        # priorities 0 and 1 are below the top eight levels
        assert got == {9: 1.0, 8: 2.0, 7: 2.0, 6: 2.0, 5: 2.0, 4: 2.0, 3: 2.0, 2: 2.0}
        # the per-queue total agrees with the levels it covers plus the two below
        assert sample(text, "topics_topic_queue_ready", '{topic="q"}') == 1 + 7 * 2 + 2 * 2


async def test_the_text_is_written_a_family_a_step_and_equals_one_pass(nursery):
    # with many topics the per-topic families are thousands of samples: written in one
    # step they stalled the loop; a family a step, the text must be the same bytes
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from topicd.http import metrics
    from topicd.http.app import EngineRef

    async with open_app(make_config()) as h:
        c = h.app.test_client()
        for i in range(30):
            await c.post(f"/v0/topics/t{i}", json={"records": [{"data": i}]})
        ref, lifecycle = EngineRef(h.engine), h.lifecycle
        registry = CollectorRegistry(auto_describe=False)
        registry.register(metrics._Collector(ref, lifecycle))
        families = len(list(metrics._Collector(ref, lifecycle).collect()))
        ran = 0
        done = False

        async def other() -> None:
            nonlocal ran
            while not done:
                ran += 1
                await trio.lowlevel.checkpoint()

        nursery.start_soon(other)
        await trio.lowlevel.checkpoint()
        ran = 0
        text = await metrics.prometheus_text(ref, lifecycle)
        done = True
        assert ran >= families - 1  # the other task ran between the families
        one_pass = (
            generate_latest(registry)
            .replace(b"# HELP topics_uptime_ms_total ", b"# HELP topics_uptime_ms ")
            .replace(b"# TYPE topics_uptime_ms_total counter", b"# TYPE topics_uptime_ms counter")
        )
        # (uptime and the process's own series move between the two passes)
        strip = re.compile(rb"^(topics_uptime_ms|process_\w+|topicd_\w*_seconds\w*) .*$", re.M)
        assert strip.sub(b"", text) == strip.sub(b"", one_pass)


async def test_topics_deleted_during_a_scrape_are_left_out_not_an_error(nursery, monkeypatch):
    # the sums over every topic are taken a slice a step, then the families written a
    # step each: topics deleted in between must not fail the scrape
    from topicd.http import metrics

    monkeypatch.setattr(metrics, "_AGGREGATE_SLICE", 4)
    async with open_app(make_config()) as h:
        c = h.app.test_client()
        for i in range(20):
            await c.put(f"/v0/topics/q{i:02d}", json={"type": "queue"})
            await c.post(f"/v0/topics/q{i:02d}", json={"records": [{"data": i}]})

        async def deleter() -> None:
            for i in range(0, 20, 2):
                await h.engine.delete_topic(f"q{i:02d}", False)

        nursery.start_soon(deleter)
        r = await c.get("/v0/metrics")
        assert r.status_code == 200
        text = (await r.get_data()).decode()
        assert sample(text, "topics_topic_head_seq", '{topic="q01"}') == 1
        assert 'topic="q00"' not in text or sample(text, "topics_topics") == 20


async def test_scope_front_on_one_process_is_the_same_answer(autojump_clock):
    """On one process its own figures are the deployment's: `?scope=front` answers the
    same text and snapshot as the default (`scope=deployment`), with no figures about
    fronts; any other scope is `400 invalid_request` naming the parameter."""
    async with open_app() as h:
        c = h.app.test_client()
        await c.put("/v0/topics/q", json={"type": "queue"})
        await c.post("/v0/topics/t", json={"records": [{"data": 1}, {"data": 2}]})

        async def text(**query) -> str:
            raw = (await (await c.get("/v0/metrics", query_string=query)).get_data()).decode()
            # (the scrape itself is a request: the request counter moves between two)
            return "\n".join(x for x in raw.splitlines() if "topicd_http_requests" not in x)

        plain = await text()
        assert "topicd_fronts" not in plain
        assert await text(scope="front") == plain == await text(scope="deployment")
        json_headers = {"Accept": "application/json"}
        snaps = [
            await (await c.get("/v0/metrics", headers=json_headers, query_string=query)).get_json()
            for query in ({}, {"scope": "front"}, {"scope": "deployment"})
        ]
        assert snaps[0] == snaps[1] == snaps[2] and "fronts" not in snaps[0]
        r = await c.get("/v0/metrics", query_string={"scope": "Front"})
        assert r.status_code == 400
        err = (await r.get_json())["error"]
        assert (err["code"], err["detail"]) == ("invalid_request", {"parameter": "scope"})
