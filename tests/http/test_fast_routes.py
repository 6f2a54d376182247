"""The gate's fast path and the framework route answer identically.

Method: the hot endpoints (`POST /v0/topics/:topic` and `/diff`, and a queue's `claim`,
`ack`, `nack`, `extend`) are served by the gate without Quart when the request has no query
string, and by the Quart route otherwise; both call one shared implementation. Each call
is made both ways (a query string the route ignores sends it through Quart) on twin
topics, and the answers must match in status and JSON shape, value for value except the
timings. A stub on the Quart side proves which path served what.
"""

from __future__ import annotations

import orjson

from topicd.testing.harness import open_app


def _strip(body: bytes) -> object:
    """The answer without what differs between twin topics: timings, the topic's name,
    times, lease ids (kept: every key, in order, and every other value)."""
    obj = orjson.loads(body)
    if isinstance(obj, dict):
        obj.pop("performance", None)
        obj.pop("topic", None)
        if "claimed" in obj:
            obj["claimed"] = [
                (list(job), job["$seq"], job["deliveries"], job["data"]) for job in obj["claimed"]
            ]
        if "records" in obj:
            obj["records"] = [
                {k: v for k, v in rec.items() if k != "$ts"} for rec in obj["records"]
            ]
        if "deadlines" in obj:
            obj["deadlines"] = list(obj["deadlines"])
        if "error" in obj:
            obj = obj["error"]["code"]
    return obj


async def test_fast_path_and_framework_route_answer_alike():
    async with open_app() as h:
        c = h.app.test_client()
        framework_calls: list[str] = []
        inner = h.app.asgi_app.app  # the gate's wrapped app: Quart's own ASGI entry

        async def spy(scope, receive, send):
            framework_calls.append(scope["path"])
            await inner(scope, receive, send)

        h.app.asgi_app.app = spy
        answers: dict[str, list[tuple[int, object]]] = {"fast": [], "framework": []}
        for way, q in (("fast", ""), ("framework", "?via=framework")):
            t = f"jobs-{way}"
            r = await c.put(f"/v0/topics/{t}", json={"type": "queue", "lease_ms": 60000})
            assert r.status_code == 201
            calls = [
                (f"/v0/topics/{t}{q}", {"records": [{"data": i} for i in range(4)]}),
                (f"/v0/topics/{t}/claim{q}", {"node": "w", "max": 3}),
                (f"/v0/topics/{t}/extend{q}", {"node": "w", "seqs": [1], "lease_ms": 5000}),
                (f"/v0/topics/{t}/nack{q}", {"node": "w", "seqs": [2]}),
                (f"/v0/topics/{t}/ack{q}", {"node": "w", "seqs": [1, 3, 9]}),
                (f"/v0/topics/{t}/ack{q}", {"node": "w"}),  # 400: seqs missing
                (f"/v0/topics/{t}/claim{q}", {"node": 5}),  # 400: a wrong type
                (f"/v0/topics/{t}/diff{q}", {"from_seq": 0, "limit": 2}),
                (f"/v0/topics/{t}/diff{q}", {"from_seq": 3}),
                (f"/v0/topics/{t}/diff{q}", {"from_seq": "x"}),  # 400: a wrong type
                (f"/v0/topics/nope-{way}/diff{q}", {}),  # 404
            ]
            before = len(framework_calls)
            for path, body in calls:
                r = await c.post(path, json=body)
                answers[way].append((r.status_code, _strip(await r.get_data())))
            served_by_framework = len(framework_calls) - before
            assert served_by_framework == (0 if way == "fast" else len(calls)), way
        fast, framework = answers["fast"], answers["framework"]
        assert fast == framework
        assert [s for s, _ in fast] == [200, 200, 200, 200, 200, 400, 400, 200, 200, 400, 404]
