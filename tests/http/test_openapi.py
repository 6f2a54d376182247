"""docs/openapi.yaml is true: it is valid OpenAPI 3.1, it documents exactly the routes the
app serves, and every status it documents for an operation (except `500`) is provoked
here and the real answer checked against it: the status, the documented headers, and the
JSON body against the operation's schema, read strictly (a field the server sends but
the document lacks is a failure; `topicd.testing.openapi`).

Method: black-box through the in-process app (Quart's test client, and the ASGI stream
client of `topicd.testing.sse` for the SSE streams). The statuses every operation shares
are provoked the same way for all of them: `401` and `403` with authentication on and a
key that lacks the scope, `413` with a small `limits.max_body_bytes`, `415` with a
non-JSON content type, `429` with every client permit held (`429 client_waiters`; the
streams with their connection cap reached), `503 not_ready` before the app is serving.
The `503 storage_unavailable` answers go through the fake file system: a `FaultFs` whose
syncs fail opens the WAL shard's circuit breaker, and every operation that logs something
is then refused. The rest (`404`, `409`, `422`, ...) each get a request made for them.
Every checked answer is recorded, and the last step asserts that every documented
(operation, status) pair was seen.
"""

from __future__ import annotations

import errno
import gzip
from typing import TYPE_CHECKING

import orjson
import trio
import yaml

from topicd.http.app import gate_of
from topicd.testing.fake_fs import FakeDisk, FaultFs
from topicd.testing.harness import durable_config, make_config, open_app, open_durable_app
from topicd.testing.openapi import DOC_PATH, Contract
from topicd.testing.sse import open_sse

if TYPE_CHECKING:
    from topicd.testing.harness import AppHarness

CONTRACT = Contract()
VARY = "Accept-Encoding"
GZ = {"Accept-Encoding": "gzip"}

# Operations the document describes ahead of the server: allowed to be missing from the
# app's routes while tests/test_docs.py lists them as not served yet.
AHEAD = {("GET", "/v0/ws")}
# Routes served but deliberately outside the document: the operator dashboard (an HTML
# page and its feed, outside `/v0`; docs/dashboard.md and its own tests cover them).
OUTSIDE = {("GET", "/_topicd/dashboard"), ("GET", "/_topicd/dashboard/events")}
WID = "wid_" + "A" * 22  # well-formed, never issued


def _not_served() -> set[tuple[str, str]]:
    from tests.test_docs import NOT_SERVED

    return set(NOT_SERVED)


def test_document_is_valid_openapi_3_1():
    from openapi_spec_validator import validate

    doc = yaml.safe_load(DOC_PATH.read_text("utf-8"))
    assert doc["openapi"].startswith("3.1")
    validate(doc)


async def test_document_and_app_serve_the_same_routes():
    async with open_app() as h:
        served = CONTRACT.served(h.app)
    documented = {op.key for op in CONTRACT.operations}
    assert served >= OUTSIDE
    assert served - OUTSIDE - documented == set(), "served but not in docs/openapi.yaml"
    missing = documented - served
    for key in missing:
        assert key in AHEAD and key in _not_served(), f"documented but not served: {key}"


def test_the_checker_rejects_what_the_document_does_not_say():
    """The checks can fail: an undocumented field, a wrong code, a missing header, an
    undocumented status."""
    hdrs = {"content-type": "application/json", "x-topicd-pressure": "0.000"}
    good = {"status": "ok", "version": "1", "uptime_ms": 1, "performance": {"server_total_ms": 0}}
    assert CONTRACT.problems("GET", "/v0/health", 200, hdrs, orjson.dumps(good)) == []
    extra = orjson.dumps(good | {"surprise": 1})
    assert CONTRACT.problems("GET", "/v0/health", 200, hdrs, extra)
    gz = gzip.compress(orjson.dumps(good | {"surprise": 1}))
    assert CONTRACT.problems("GET", "/v0/health", 200, hdrs | {"content-encoding": "gzip"}, gz)
    wrong = orjson.dumps({"error": {"code": "forbidden", "message": "m"}})
    assert CONTRACT.problems("GET", "/v0/topics/t", 404, hdrs, wrong)
    assert CONTRACT.problems("GET", "/v0/topics/t", 200, {}, orjson.dumps(good))
    assert CONTRACT.problems("GET", "/v0/health", 418, hdrs, b"{}")
    throttled = orjson.dumps({"error": {"code": "throttled", "message": "m"}})
    assert CONTRACT.problems("GET", "/v0/topics", 429, hdrs, throttled)  # no Retry-After
    # compressed where the document says answers are never compressed (a probe)
    zipped = gzip.compress(orjson.dumps(good))
    assert CONTRACT.problems("GET", "/v0/health", 200, hdrs, orjson.dumps(good)) == []
    assert CONTRACT.problems(
        "GET", "/v0/health", 200, hdrs | {"content-encoding": "gzip", "vary": VARY}, zipped
    )


# --------------------------------------------------------------------------------------
# The checker every scenario reports to
# --------------------------------------------------------------------------------------


class Seen:
    def __init__(self) -> None:
        self.pairs: set[tuple[str, str, str]] = set()
        self.codes: set[tuple[str, str, str]] = set()

    def record(self, method: str, path: str, status: int, body: bytes) -> None:
        op = CONTRACT.operation(method, path)
        self.pairs.add((op.method, op.path, str(status)))
        if status >= 400:
            raw = gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body
            self.codes.add((op.method, op.path, orjson.loads(raw)["error"]["code"]))

    async def check(self, r, method: str, path: str, status: int, code: str | None = None):
        body = await r.get_data()
        assert r.status_code == status, (method, path, r.status_code, body[:300])
        headers = dict(r.headers.items())
        problems = CONTRACT.problems(method, path, status, headers, body)
        assert problems == [], problems
        self.record(method, path, status, body)
        if r.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if code is not None:
            assert orjson.loads(body)["error"]["code"] == code, body
        ctype = r.headers.get("Content-Type", "")
        return orjson.loads(body) if ctype.startswith("application/json") else body

    def check_stream(self, stream, path: str, status: int, code: str | None = None) -> None:
        assert stream.status == status, (path, stream.status, stream.body[:300])
        problems = CONTRACT.problems(
            "GET", path, status, stream.headers, stream.body, streaming=status == 200
        )
        assert problems == [], problems
        self.record("GET", path, status, stream.body)
        if code is not None:
            assert orjson.loads(stream.body)["error"]["code"] == code


async def call(client, method: str, path: str, body: object = None, **kw):
    if body is not None:
        kw["json"] = body
    return await client.open(path, method=method, **kw)


async def sse(h: AppHarness, path: str, *, query: str = "", headers: dict | None = None):
    """Open an SSE stream, keep its head, close it."""
    async with trio.open_nursery() as nursery:
        stream = await open_sse(nursery, h.app.asgi_app, path, query=query, headers=headers)
        stream.disconnect()
    return stream


async def ws_handshake(app, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    """A WebSocket handshake on `/v0/ws` through the ASGI entry: (101, {}, b"") when
    accepted (then closed at once), else the HTTP answer the server denied it with."""
    scope = {
        "type": "websocket",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "scheme": "ws",
        "path": "/v0/ws",
        "raw_path": b"/v0/ws",
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 4000),
        "subprotocols": [],
        "extensions": {"websocket.http.response": {}},
    }
    got: dict = {"status": 0, "headers": {}, "body": b""}
    connected = [False]
    done = trio.Event()

    async def receive():
        if not connected[0]:
            connected[0] = True
            return {"type": "websocket.connect"}
        await done.wait()
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(message):
        kind = message["type"]
        if kind == "websocket.accept":
            got["status"] = 101
            done.set()
        elif kind == "websocket.http.response.start":
            got["status"] = message["status"]
            got["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        elif kind == "websocket.http.response.body":
            got["body"] += message.get("body", b"")
            if not message.get("more_body"):
                done.set()
        elif kind == "websocket.close":
            done.set()

    with trio.move_on_after(5):
        await app.asgi_app(scope, receive, send)
    return got["status"], got["headers"], got["body"]


# One acceptable request per operation, for the statuses they all share. The names exist
# in `populate`'s state: a log topic `t`, a queue `q` holding leased jobs, a router.
def requests(wid: str = WID) -> dict[tuple[str, str], tuple[str, str, object]]:
    # ack the first leased job, nack and extend the second (a refused ack releases its job)
    lease = {"node": "w", "seqs": [2]}
    return {
        ("PUT", "/v0/topics/{topic}"): ("PUT", "/v0/topics/t", {"cap_records": 7}),
        ("GET", "/v0/topics/{topic}"): ("GET", "/v0/topics/t", None),
        ("DELETE", "/v0/topics/{topic}"): ("DELETE", "/v0/topics/t", None),
        ("POST", "/v0/topics/{topic}"): ("POST", "/v0/topics/t", {"records": [{"data": 1}]}),
        ("GET", "/v0/topics"): ("GET", "/v0/topics", None),
        ("POST", "/v0/topics/{topic}/diff"): ("POST", "/v0/topics/t/diff", {"from_seq": 0}),
        ("POST", "/v0/topics/{topic}/delete"): ("POST", "/v0/topics/t/delete", {"before_seq": 2}),
        ("POST", "/v0/topics/{topic}/claim"): ("POST", "/v0/topics/q/claim", {"node": "w"}),
        ("POST", "/v0/topics/{topic}/ack"): (
            "POST",
            "/v0/topics/q/ack",
            {"node": "w", "seqs": [1]},
        ),
        ("POST", "/v0/topics/{topic}/nack"): ("POST", "/v0/topics/q/nack", lease),
        ("POST", "/v0/topics/{topic}/extend"): (
            "POST",
            "/v0/topics/q/extend",
            lease | {"lease_ms": 60_000},
        ),
        ("PUT", "/v0/routers/{router}"): ("PUT", "/v0/routers/t->d", {"source": "t", "dest": "d"}),
        ("GET", "/v0/routers/{router}"): ("GET", "/v0/routers/t->d", None),
        ("DELETE", "/v0/routers/{router}"): ("DELETE", "/v0/routers/t->d", None),
        ("GET", "/v0/routers"): ("GET", "/v0/routers", None),
        ("POST", "/v0/watch"): ("POST", "/v0/watch", {"topics": {"t": {}}}),
        ("GET", "/v0/health"): ("GET", "/v0/health", None),
        ("GET", "/healthz"): ("GET", "/healthz", None),
        ("GET", "/v0/ready"): ("GET", "/v0/ready", None),
        ("GET", "/readyz"): ("GET", "/readyz", None),
        ("GET", "/v0/metrics"): ("GET", "/v0/metrics", None),
    }


STREAMS = {("GET", "/v0/topics/{topic}/work"), ("GET", "/v0/watch/{wid}")}
PROBES = {("GET", p) for p in ("/v0/health", "/healthz", "/v0/ready", "/readyz")}
CONTROL = PROBES | {("GET", "/v0/metrics")}
BODY_OPS = {k for k, (_, _, body) in requests().items() if body is not None}


async def populate(client) -> None:
    """The state `requests()` expects (every call must succeed)."""
    for method, path, body in (
        ("POST", "/v0/topics/t", {"records": [{"data": i} for i in range(3)]}),
        ("PUT", "/v0/topics/q", {"type": "queue", "leases_durable": True}),
        ("POST", "/v0/topics/q", {"records": [{"data": "job"}] * 3}),
        ("POST", "/v0/topics/q/claim", {"node": "w", "max": 2, "lease_ms": 3_600_000}),
        ("PUT", "/v0/routers/t->d", {"source": "t", "dest": "d"}),
    ):
        r = await call(client, method, path, body)
        assert r.status_code in (200, 201), (path, await r.get_data())


# --------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------


async def dev_mode(ck: Seen) -> None:
    """Successes and the operation-specific errors, in dev mode (no keys)."""
    async with open_app() as h:
        c = h.app.test_client()
        await populate(c)
        # topics
        await ck.check(await call(c, "PUT", "/v0/topics/p", {}), "PUT", "/v0/topics/p", 201)
        await ck.check(await call(c, "PUT", "/v0/topics/p", {}), "PUT", "/v0/topics/p", 200)
        r = await call(c, "PUT", "/v0/topics/p", {"type": "queue"})
        await ck.check(r, "PUT", "/v0/topics/p", 409, "topic_exists_incompatible")
        r = await call(c, "PUT", "/v0/topics/-p", {})
        await ck.check(r, "PUT", "/v0/topics/-p", 400, "invalid_request")
        r = await c.put("/v0/topics/p", data="{}", headers={"Content-Type": "text/plain"})
        await ck.check(r, "PUT", "/v0/topics/p", 415, "unsupported_media_type")

        records = [{"data": {"n": i, "pad": "x" * 40}, "tag": f"k{i}"} for i in range(40)]
        records[0] |= {"meta": {"m": 1}, "node": "n1", "priority": 3}
        body = {"records": records, "idempotency_key": "k"}
        r = await call(c, "POST", "/v0/topics/big", body)
        await ck.check(r, "POST", "/v0/topics/big", 201)
        r = await call(c, "POST", "/v0/topics/big", body)
        assert (await ck.check(r, "POST", "/v0/topics/big", 200))["deduped"] is True
        r = await c.post("/v0/topics/big?return_seqs=false", json={"records": [{"data": 1}]})
        await ck.check(r, "POST", "/v0/topics/big", 200)
        r = await call(c, "POST", "/v0/topics/big", {"records": []})
        await ck.check(r, "POST", "/v0/topics/big", 400, "invalid_request")
        r = await call(c, "POST", "/v0/topics/big", {"records": [{"data": 1}] * 10001})
        await ck.check(r, "POST", "/v0/topics/big", 400, "batch_too_large")
        r = await call(c, "POST", "/v0/topics/nope", {"records": [{"data": 1}], "create": False})
        await ck.check(r, "POST", "/v0/topics/nope", 404, "topic_not_found")
        await call(c, "PUT", "/v0/topics/full", {"cap_records": 1, "discard": "reject"})
        await call(c, "POST", "/v0/topics/full", {"records": [{"data": 1}]})
        r = await call(c, "POST", "/v0/topics/full", {"records": [{"data": 2}]})
        await ck.check(r, "POST", "/v0/topics/full", 422, "topic_full")
        r = await c.post("/v0/topics/big", data='{"records":[]}')
        await ck.check(r, "POST", "/v0/topics/big", 415)

        await ck.check(await c.get("/v0/topics/big"), "GET", "/v0/topics/big", 200)
        await ck.check(await c.get("/v0/topics/q"), "GET", "/v0/topics/q", 200)
        await ck.check(await c.get("/v0/topics/-x"), "GET", "/v0/topics/-x", 400)
        await ck.check(await c.get("/v0/topics/nope"), "GET", "/v0/topics/nope", 404)
        r = await c.get("/v0/topics?touch=false")
        await ck.check(r, "GET", "/v0/topics", 200)
        r = await call(c, "POST", "/v0/topics/many", {"records": [{"data": 1}] * 500}, headers=GZ)
        assert r.headers["Content-Encoding"] == "gzip"  # the fast path's answer
        await ck.check(r, "POST", "/v0/topics/many", 201)
        r = await c.get("/v0/topics?page_size=1")
        assert "next_cursor" in await ck.check(r, "GET", "/v0/topics", 200)
        await ck.check(await c.get("/v0/topics?cursor=%25%25"), "GET", "/v0/topics", 400)

        # diff: records with every optional field, then a tombstone
        diff = "/v0/topics/big/diff"
        r = await call(c, "POST", diff, {"include_tags": True, "limit": 1000})
        assert len((await ck.check(r, "POST", diff, 200))["records"]) == 41
        # the same answer gzipped (the checker undoes the encoding before validating)
        r = await call(c, "POST", diff, {"include_tags": True}, headers=GZ)
        assert r.headers["Content-Encoding"] == "gzip"
        await ck.check(r, "POST", diff, 200)
        await ck.check(await c.post(diff), "POST", diff, 200)  # empty body: defaults
        await call(c, "PUT", "/v0/topics/capped", {"cap_records": 2})
        await call(c, "POST", "/v0/topics/capped", {"records": [{"data": i} for i in range(5)]})
        r = await call(c, "POST", "/v0/topics/capped/diff", {})
        assert (await ck.check(r, "POST", diff, 200))["tombstone"]["reason"] == "cap"
        await ck.check(await call(c, "POST", diff, {"limit": -1}), "POST", diff, 400)
        await ck.check(await call(c, "POST", "/v0/topics/nope/diff", {}), "POST", diff, 404)
        r = await c.post(diff, data="{}", headers={"Content-Type": "text/plain"})
        await ck.check(r, "POST", diff, 415)

        dele = "/v0/topics/big/delete"
        await ck.check(await call(c, "POST", dele, {"before_seq": 2}), "POST", dele, 200)
        r = await call(c, "POST", dele, {"match": "k3*", "before_seq": 10})
        await ck.check(r, "POST", dele, 200)
        await ck.check(await call(c, "POST", dele, {}), "POST", dele, 400)
        r = await call(c, "POST", "/v0/topics/nope/delete", {"before_seq": 1})
        await ck.check(r, "POST", dele, 404, "topic_not_found")

        # queues
        await call(c, "POST", "/v0/topics/q", {"records": [{"data": 1, "tag": "j", "priority": 5}]})
        claim = "/v0/topics/q/claim"
        r = await call(c, "POST", claim, {"node": "w", "max": 5, "lease_ms": 60_000})
        got = await ck.check(r, "POST", claim, 200)
        await call(c, "PUT", "/v0/topics/jobs", {"type": "queue"})
        await call(c, "POST", "/v0/topics/jobs", {"records": [{"data": "x" * 30}] * 50})
        r = await call(c, "POST", "/v0/topics/jobs/claim", {"node": "w", "max": 50}, headers=GZ)
        assert r.headers["Content-Encoding"] == "gzip"
        await ck.check(r, "POST", claim, 200)
        seqs = [j["$seq"] for j in got["claimed"]]
        assert len(seqs) >= 2
        await ck.check(await call(c, "POST", claim, {"node": ""}), "POST", claim, 400)
        r = await call(c, "POST", "/v0/topics/nope/claim", {"node": "w"})
        await ck.check(r, "POST", claim, 404)
        r = await call(c, "POST", "/v0/topics/t/claim", {"node": "w"})
        await ck.check(r, "POST", claim, 409, "not_a_queue")
        for verb, extra in (("extend", {"lease_ms": 1000}), ("nack", {}), ("ack", {})):
            path = f"/v0/topics/q/{verb}"
            r = await call(c, "POST", path, {"node": "w", "seqs": seqs, **extra})
            await ck.check(r, "POST", path, 200)
            await ck.check(await call(c, "POST", path, {"node": "w"}), "POST", path, 400)
            r = await call(c, "POST", path, {"node": "w", "seqs": [1] * 1001, **extra})
            await ck.check(r, "POST", path, 400, "batch_too_large")
            r = await call(
                c, "POST", f"/v0/topics/nope/{verb}", {"node": "w", "seqs": [1], **extra}
            )
            await ck.check(r, "POST", path, 404)
            r = await call(c, "POST", f"/v0/topics/t/{verb}", {"node": "w", "seqs": [1], **extra})
            await ck.check(r, "POST", path, 409, "not_a_queue")
        r = await call(c, "POST", "/v0/topics/q/extend", {"node": "w", "seqs": [1]})
        await ck.check(r, "POST", "/v0/topics/q/extend", 400)

        work = "/v0/topics/{topic}/work"
        ck.check_stream(await sse(h, "/v0/topics/q/work", query="node=w2"), work, 200)
        ck.check_stream(await sse(h, "/v0/topics/q/work"), work, 400)
        ck.check_stream(await sse(h, "/v0/topics/nope/work", query="node=w"), work, 404)
        s = await sse(h, "/v0/topics/q/work", query="node=w", headers={"Accept": "text/html"})
        ck.check_stream(s, work, 406, "not_acceptable")
        ck.check_stream(await sse(h, "/v0/topics/t/work", query="node=w"), work, 409)

        # routers
        rp = "/v0/routers/a->b"
        r = await call(c, "PUT", rp, {"source": "a", "dest": "b", "filter": ["tag", "Eq", "x"]})
        await ck.check(r, "PUT", rp, 201)
        r = await call(c, "PUT", rp, {"source": "a", "dest": "b", "filter": "x*"})
        await ck.check(r, "PUT", rp, 200)
        await ck.check(await call(c, "PUT", rp, {"source": "a", "dest": "a"}), "PUT", rp, 400)
        r = await call(
            c, "PUT", "/v0/routers/a->z", {"source": "a", "dest": "z", "create_dest": False}
        )
        await ck.check(r, "PUT", rp, 404, "topic_not_found")
        r = await call(c, "PUT", "/v0/routers/b->a", {"source": "b", "dest": "a"})
        await ck.check(r, "PUT", rp, 409, "router_cycle")
        r = await c.put(rp, data="{}", headers={"Content-Type": "text/plain"})
        await ck.check(r, "PUT", rp, 415)
        await ck.check(await c.get(rp), "GET", rp, 200)
        await ck.check(await c.get("/v0/routers/-r"), "GET", rp, 400)
        await ck.check(await c.get("/v0/routers/x->y"), "GET", rp, 404, "router_not_found")
        await ck.check(await c.get("/v0/routers?page_size=1"), "GET", "/v0/routers", 200)
        await ck.check(await c.get("/v0/routers?cursor=%25"), "GET", "/v0/routers", 400)
        await ck.check(await c.delete(rp), "DELETE", rp, 200)
        await ck.check(await c.delete(rp), "DELETE", rp, 200)  # absent: deleted false
        await ck.check(await c.delete("/v0/routers/-r"), "DELETE", rp, 400)

        # watch
        r = await call(c, "POST", "/v0/watch", {"topics": {"t": {}, "capped": {"tail": True}}})
        wid = (await ck.check(r, "POST", "/v0/watch", 200))["wid"]
        await ck.check(await call(c, "POST", "/v0/watch", {"topics": {}}), "POST", "/v0/watch", 400)
        r = await call(c, "POST", "/v0/watch", {"topics": {"nope": {}}})
        await ck.check(r, "POST", "/v0/watch", 404, "topic_not_found")
        r = await c.post("/v0/watch", data="{}", headers={"Content-Type": "text/plain"})
        await ck.check(r, "POST", "/v0/watch", 415)
        ck.check_stream(await sse(h, f"/v0/watch/{wid}"), "/v0/watch/{wid}", 200)
        ck.check_stream(await sse(h, f"/v0/watch/{WID}"), "/v0/watch/{wid}", 404, "not_found")
        s = await sse(h, f"/v0/watch/{wid}", headers={"Accept": "application/json"})
        ck.check_stream(s, "/v0/watch/{wid}", 406)

        # topic deletes last (they cascade)
        tp = "/v0/topics/big"
        await ck.check(await c.delete(tp + "?if_empty=true"), "DELETE", tp, 409, "topic_not_empty")
        await ck.check(await c.delete("/v0/topics/-x"), "DELETE", tp, 400)
        await ck.check(await c.delete(tp), "DELETE", tp, 200)
        await ck.check(await c.delete(tp), "DELETE", tp, 200)  # absent: deleted false

        # probes and metrics
        for path in ("/v0/health", "/healthz", "/v0/ready", "/readyz"):
            await ck.check(await c.get(path), "GET", path, 200)
        await ck.check(await c.get("/v0/metrics"), "GET", "/v0/metrics", 200)
        r = await c.get("/v0/metrics", headers={"Accept": "application/json"})
        await ck.check(r, "GET", "/v0/metrics", 200)
        r = await c.get("/v0/metrics", query_string={"scope": "front"})
        await ck.check(r, "GET", "/v0/metrics", 200)
        r = await c.get("/v0/metrics", query_string={"scope": "everything"})
        await ck.check(r, "GET", "/v0/metrics", 400, "invalid_request")
        r = await c.get("/v0/metrics", headers=GZ)
        assert r.headers["Content-Encoding"] == "gzip"
        await ck.check(r, "GET", "/v0/metrics", 200)


KEYS = ("adm", "ro:read", "wo:write")


async def auth_on(ck: Seen) -> None:
    """`401` without a key (probes too, with `probe_auth`), `403` with a key that lacks
    the scope: `ro` (read only) for what needs more, `wo` (write only) for reads."""
    cfg = make_config(auth={"api_keys": KEYS, "probe_auth": True})
    async with open_app(cfg) as h:
        c = h.app.test_client()
        adm = {"Authorization": "Bearer adm"}
        await populate(_Authed(c, adm))
        reads = {
            ("GET", "/v0/topics/{topic}"),
            ("GET", "/v0/topics"),
            ("POST", "/v0/topics/{topic}/diff"),
            ("GET", "/v0/routers/{router}"),
            ("GET", "/v0/routers"),
            ("POST", "/v0/watch"),
            ("GET", "/v0/metrics"),
        }
        for key, (method, path, body) in requests().items():
            await ck.check(await call(c, method, path, body), *key, 401, "unauthorized")
            if key in PROBES:
                continue
            lacking = "wo" if key in reads else "ro"
            hdr = {"Authorization": f"Bearer {lacking}"}
            r = await call(c, method, path, body, headers=hdr)
            await ck.check(r, *key, 403, "forbidden")
        work = "/v0/topics/{topic}/work"
        ck.check_stream(await sse(h, "/v0/topics/q/work", query="node=w"), work, 401)
        s = await sse(
            h, "/v0/topics/q/work", query="node=w", headers={"Authorization": "Bearer ro"}
        )
        ck.check_stream(s, work, 403, "forbidden")
        r = await call(c, "POST", "/v0/watch", {"topics": {"t": {}}}, headers=adm)
        wid = (await r.get_json())["wid"]
        s = await sse(h, f"/v0/watch/{wid}", headers={"Authorization": "Bearer ro"})
        ck.check_stream(s, "/v0/watch/{wid}", 401, "unauthorized")


class _Authed:
    """A test client that sends one `Authorization` header with every request."""

    def __init__(self, client, headers: dict[str, str]) -> None:
        self.client, self.headers = client, headers

    async def open(self, path: str, **kw):
        kw["headers"] = {**self.headers, **kw.get("headers", {})}
        return await self.client.open(path, **kw)


async def small_bodies(ck: Seen) -> None:
    """`413` for every operation with a body, over a 64-byte `limits.max_body_bytes`."""
    async with open_app(make_config(limits={"max_body_bytes": 64})) as h:
        c = h.app.test_client()
        pad = {"pad": "x" * 100}
        for key in BODY_OPS:
            method, path, body = requests()[key]
            assert isinstance(body, dict)
            r = await call(c, method, path, body | pad)
            await ck.check(r, *key, 413, "payload_too_large")


async def unsupported_media(ck: Seen) -> None:
    """`415` for every operation with a body: JSON sent as text/plain."""
    async with open_app() as h:
        c = h.app.test_client()
        for key in BODY_OPS:
            method, path, body = requests()[key]
            r = await c.open(
                path, method=method, data=orjson.dumps(body), headers={"Content-Type": "text/plain"}
            )
            await ck.check(r, *key, 415, "unsupported_media_type")


async def throttled(ck: Seen) -> None:
    """`429` for every client request while the only client permit is held and no
    request may wait; for the streams, with the one allowed SSE connection open."""
    cfg = make_config(classes={"client_permits": 1, "client_waiters": 0})
    async with open_app(cfg) as h:
        c = h.app.test_client()
        await populate(c)
        permits = gate_of(h.app).permits
        assert permits is not None
        permit = await permits.admit()
        try:
            for key, (method, path, body) in requests().items():
                if key in CONTROL:
                    continue
                await ck.check(await call(c, method, path, body), *key, 429, "throttled")
        finally:
            permit.release()
    async with open_app(make_config(limits={"max_sse_connections": 1})) as h:
        c = h.app.test_client()
        await populate(c)
        wids = []
        for _ in range(2):
            r = await call(c, "POST", "/v0/watch", {"topics": {"t": {}}})
            wids.append((await r.get_json())["wid"])
        async with trio.open_nursery() as nursery:
            first = await open_sse(nursery, h.app.asgi_app, f"/v0/watch/{wids[0]}")
            assert first.status == 200
            ck.check_stream(await sse(h, f"/v0/watch/{wids[1]}"), "/v0/watch/{wid}", 429)
            s = await sse(h, "/v0/topics/q/work", query="node=w")
            ck.check_stream(s, "/v0/topics/{topic}/work", 429, "throttled")
            first.disconnect()


async def not_ready(ck: Seen) -> None:
    """`503 not_ready` for every route but the probes and metrics before serving; the
    readiness probe says the same."""
    async with open_app(serving=False) as h:
        c = h.app.test_client()
        for key, (method, path, body) in requests().items():
            if key in CONTROL - {("GET", "/v0/ready"), ("GET", "/readyz")}:
                continue
            await ck.check(await call(c, method, path, body), *key, 503, "not_ready")
        for path in ("/v0/topics/q/work", f"/v0/watch/{WID}"):
            s = await sse(h, path, query="node=w")
            ck.check_stream(s, CONTRACT.operation("GET", path).path, 503, "not_ready")


# Operations that log to the WAL, and so are refused while the shard's breaker is open.
STORAGE_OPS = {
    ("PUT", "/v0/topics/{topic}"),
    ("DELETE", "/v0/topics/{topic}"),
    ("POST", "/v0/topics/{topic}"),
    ("POST", "/v0/topics/{topic}/delete"),
    ("POST", "/v0/topics/{topic}/claim"),
    ("POST", "/v0/topics/{topic}/ack"),
    ("POST", "/v0/topics/{topic}/nack"),
    ("POST", "/v0/topics/{topic}/extend"),
    ("PUT", "/v0/routers/{router}"),
    ("DELETE", "/v0/routers/{router}"),
    ("GET", "/v0/ready"),
    ("GET", "/readyz"),
}


async def storage_failure(ck: Seen) -> None:
    """`503 storage_unavailable` through the fake file system: a failed sync opens the
    (single) WAL shard's breaker; every operation that logs is then refused."""
    fs = FaultFs(FakeDisk())
    cfg = durable_config(shards=1, breaker={"unready_when_open": True})
    async with open_durable_app(fs, cfg) as h:
        c = h.app.test_client()
        await populate(c)
        # answers only a server with a WAL gives: the storage block of ready, the wal
        # block of the metrics, a write's wal_append_ms
        body = await ck.check(await c.get("/v0/ready"), "GET", "/v0/ready", 200)
        assert body["storage"]["breakers"] == {"0": "closed"}
        r = await c.get("/v0/metrics", headers={"Accept": "application/json"})
        assert "wal" in await ck.check(r, "GET", "/v0/metrics", 200)
        r = await call(c, "POST", "/v0/topics/t", {"records": [{"data": 9}]})
        assert "wal_append_ms" in (await ck.check(r, "POST", "/v0/topics/t", 200))["performance"]
        fs.fail("fdatasync", always=True, errno=errno.EIO)
        r = await call(c, "PUT", "/v0/topics/f", {"durability": "fsync"})
        assert r.status_code == 503, await r.get_data()
        reqs = requests()
        # an identical re-PUT changes nothing and logs nothing: change a field
        reqs[("PUT", "/v0/routers/{router}")] = (
            "PUT",
            "/v0/routers/t->d",
            {"source": "t", "dest": "d", "preserve_tag": False},
        )
        try:
            for key in sorted(STORAGE_OPS):
                method, path, body = reqs[key]
                r = await call(c, method, path, body)
                await ck.check(r, *key, 503, "storage_unavailable")
        finally:
            fs.clear()  # let the shutdown drain finish


async def websocket_upgrade(ck: Seen) -> None:
    """`GET /v0/ws`, once served: accepted (`101`), `400` for a plain `GET`, `401`
    without a key, `429` with the connection cap reached, `503` before serving."""
    ws = ("GET", "/v0/ws")

    def record(status: int, headers: dict, body: bytes) -> None:
        problems = CONTRACT.problems(*ws, status, headers, body, streaming=status == 101)
        assert problems == [], problems
        ck.record(*ws, status, body)

    async with open_app() as h:
        record(*await ws_handshake(h.app))
        r = await h.app.test_client().get("/v0/ws")  # a plain GET: no upgrade
        await ck.check(r, *ws, 400, "invalid_request")
    async with open_app(make_config(auth={"api_keys": KEYS})) as h:
        status, headers, body = await ws_handshake(h.app)
        assert status == 401
        record(status, headers, body)
    async with open_app(make_config(limits={"max_sse_connections": 1})) as h:
        c = h.app.test_client()
        await populate(c)
        r = await call(c, "POST", "/v0/watch", {"topics": {"t": {}}})
        wid = (await r.get_json())["wid"]
        async with trio.open_nursery() as nursery:
            first = await open_sse(nursery, h.app.asgi_app, f"/v0/watch/{wid}")
            status, headers, body = await ws_handshake(h.app)
            assert status == 429
            record(status, headers, body)
            first.disconnect()
    async with open_app(serving=False) as h:
        status, headers, body = await ws_handshake(h.app)
        assert status == 503
        record(status, headers, body)


async def test_a_websocket_handshake_is_answered_over_asgi():
    """The handshake helper the `/v0/ws` scenario uses works today: before the route is
    served a handshake is denied with the canonical `404 not_found`."""
    async with open_app() as h:
        served = ("GET", "/v0/ws") in CONTRACT.served(h.app)
        status, headers, body = await ws_handshake(h.app)
    if served:
        assert status == 101
    else:
        assert status == 404
        assert orjson.loads(body)["error"]["code"] == "not_found"
        assert headers["x-topicd-pressure"]


async def test_every_documented_status_is_answered_as_documented(autojump_clock):
    ck = Seen()
    async with open_app() as h:
        served = CONTRACT.served(h.app)
    for scenario in (
        dev_mode,
        auth_on,
        small_bodies,
        unsupported_media,
        throttled,
        not_ready,
        storage_failure,
    ):
        await scenario(ck)
    ahead = AHEAD - served  # documented ahead of the server, and still not served
    if ("GET", "/v0/ws") in served:
        await websocket_upgrade(ck)
    documented = {
        (op.method, op.path, status)
        for op in CONTRACT.operations
        for status in op.statuses
        if status != "500" and op.key not in ahead
    }
    assert documented - ck.pairs == set(), "documented statuses never provoked"
    undocumented = ck.pairs - documented
    assert undocumented == set()
    storage = {(m, p, "storage_unavailable") for m, p in STORAGE_OPS}
    assert storage <= ck.codes
