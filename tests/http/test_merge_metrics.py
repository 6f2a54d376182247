"""The merge of several processes' `/v0/metrics` figures (`topicd.http.merge_metrics`).

Method: pure functions on hand-made families and answers, as another front would send
them (`wire_family`): which families add up and which stay the scraped process's,
the per-topic cap over the whole deployment, the depth-level entries, and answers of
the wrong shape (left out whole, or a malformed sample skipped), with no server.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from topicd.http import merge_metrics as mm


def gauge(name: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, "doc", value=value)


def per_topic(name: str, values: dict[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, "doc", labels=["topic"])
    for topic, value in values.items():
        family.add_metric([topic], value)
    return family


def answer(*families) -> mm.Families:
    got = mm.text_answer({"families": [mm.wire_family(f) for f in families], "work": {}})
    assert got is not None
    return got[0]


def rows(family) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for s in family.samples]


def test_counters_and_summed_gauges_add_up_process_gauges_stay_the_scraped_ones():
    throttled = CounterMetricFamily("topicd_throttled_total", "doc", labels=["cause"])
    throttled.add_metric(["limit"], 2)
    theirs = CounterMetricFamily("topicd_throttled_total", "doc", labels=["cause"])
    theirs.add_metric(["limit"], 3)
    theirs.add_metric(["pressure"], 1)
    others = [answer(theirs, gauge("topics_sse_connections", 4), gauge("topicd_pressure", 0.9))]
    merged = mm.merge_family(throttled, others, set(), {}, 0)
    assert rows(merged) == [
        ("topicd_throttled_total", {"cause": "limit"}, 5),
        ("topicd_throttled_total", {"cause": "pressure"}, 1),
    ]
    sse = mm.merge_family(gauge("topics_sse_connections", 1), others, set(), {}, 0)
    assert rows(sse) == [("topics_sse_connections", {}, 5)]
    own = gauge("topicd_pressure", 0.2)
    assert mm.merge_family(own, others, set(), {}, 0) is own
    uptime = CounterMetricFamily("topics_uptime_ms", "doc", value=10)
    assert not mm.summed(uptime)


def test_per_topic_series_keep_the_deployments_first_1000_topics_in_name_order():
    mine = {f"a{i:04d}": float(i) for i in range(0, 1200, 2)}
    theirs = {f"a{i:04d}": float(i) for i in range(1, 1200, 2)}
    others = [answer(per_topic("topics_topic_head_seq", theirs), gauge("topics_topics", 600))]
    names = mm.topic_names(sorted(mine)[:1000], others)
    assert names == {f"a{i:04d}" for i in range(1000)}
    merged = mm.merge_family(per_topic("topics_topic_head_seq", mine), others, names, {}, 0)
    assert [labels["topic"] for _, labels, _ in rows(merged)] == sorted(names)
    topics = mm.topic_count(600, others)
    assert topics == 1200
    flag = mm.merge_family(gauge("topics_topic_metrics_truncated", 0), others, names, {}, topics)
    assert rows(flag) == [("topics_topic_metrics_truncated", {}, 1.0)]


def test_work_streams_add_the_streams_attached_elsewhere():
    own = per_topic("topicd_jobs_work_streams", {"q": 1, "r": 0})
    merged = mm.merge_family(own, [], {"q", "r"}, {"r": 2, "gone": 1}, 0)
    assert rows(merged) == [
        ("topicd_jobs_work_streams", {"topic": "q"}, 1),
        ("topicd_jobs_work_streams", {"topic": "r"}, 2),
    ]


def test_depth_levels_take_only_queue_topics_from_the_others():
    def depth(**entries: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily("topicd_queue_depth", "doc", labels=["queue"])
        for name, value in entries.items():
            family.add_metric([name.replace("__", ".")], value)
        return family

    others = [answer(depth(client_permits=7, jobs__q=3))]
    merged = mm.merge_family(depth(client_permits=1), others, set(), {}, 0)
    assert rows(merged) == [
        ("topicd_queue_depth", {"queue": "client_permits"}, 1),
        ("topicd_queue_depth", {"queue": "jobs.q"}, 3),
    ]


def test_answers_of_the_wrong_shape_are_left_out_and_bad_samples_skipped():
    assert mm.text_answer(None) is None
    assert mm.text_answer({"families": [], "work": {"q": "1"}}) is None
    assert mm.text_answer({"families": [["x", "not a list"]], "work": {}}) is None
    assert mm.json_answer({"json": [], "work": {}}) is None
    assert mm.json_answer({"json": {"queues": []}, "work": {}}) is None
    got = mm.text_answer(
        {
            "families": [
                [
                    "topics_sse_connections",
                    [["topics_sse_connections", {}, "3"], ["topics_sse_connections", {}, 2]],
                ]
            ],
            "work": {},
        }
    )
    assert got is not None
    merged = mm.merge_family(gauge("topics_sse_connections", 1), [got[0]], set(), {}, 0)
    assert rows(merged) == [("topics_sse_connections", {}, 3)]


def test_json_snapshots_sum_counts_and_union_queues_and_levels():
    own = {
        "topics": 2,
        "sse_connections": 1,
        "pressure": 0.1,
        "queues": {"q": {"work_streams": 0, "in_flight": 1}},
        "internal_queues": [{"name": "client_permits", "depth": 1}],
    }
    theirs = {
        "topics": 3,
        "sse_connections": 2,
        "pressure": 0.9,
        "queues": {"p": {"work_streams": 1, "in_flight": 0}},
        "internal_queues": [{"name": "client_permits", "depth": 5}, {"name": "jobs.p"}],
    }
    mm.merge_json(own, [theirs], {"q": 2})
    assert (own["topics"], own["sse_connections"], own["pressure"]) == (5, 3, 0.1)
    assert own["queues"] == {
        "p": {"work_streams": 1, "in_flight": 0},
        "q": {"work_streams": 2, "in_flight": 1},
    }
    assert [e["name"] for e in own["internal_queues"]] == ["client_permits", "jobs.p"]
