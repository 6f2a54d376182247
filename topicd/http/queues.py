"""Routes of queue topics: claim, ack, nack, extend (validate, call the engine, render).

The `/work` stream is served before Quart (`topicd.http.work`); its route here only
makes other methods on the path answer `405` with `Allow: GET`."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias, cast

import orjson
from quart import request

from topicd.errors import InvalidRequest, JsonValue, MethodNotAllowed
from topicd.http.app import (
    check_body,
    decode,
    performance,
    performance_json,
    principal,
    quart_body,
    raw_json_response,
    scope_header,
    topic_post,
)
from topicd.wire import CLAIM_DECODER, LEASE_OP_DECODER, LeaseOpIn

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from quart import Response
    from quart_trio import QuartTrio

    from topicd.config import Config
    from topicd.engine.queues import SeqsResult
    from topicd.http.app import EngineRef, FastHandler, FastRoutes, ReadBody, Scope

    # one queue endpoint: (topic, ASGI scope, body reader) -> (status, JSON body)
    QueueOp: TypeAlias = Callable[[str, Scope, ReadBody], Awaitable[tuple[int, bytes]]]


class QueueOps:
    """claim, ack, nack and extend (api-queues §4, §6-§8): each `(topic, scope, read)` ->
    (status, JSON body). The one implementation, called by the Quart routes and by the
    gate's fast path (`fast_routes`); `read` returns the raw request body."""

    def __init__(self, ref: EngineRef, config: Config) -> None:
        self.ref = ref
        self.max_body = config.limits.max_body_bytes
        self.max_node = config.protocol.max_node_bytes
        self.max_claim = config.queue.max_claim

    def _body(self, body: bytes, scope: Scope) -> bytes:
        checked = check_body(body, scope_header(scope), empty_ok=False, max_bytes=self.max_body)
        assert checked is not None
        return checked

    async def _lease_op(self, topic: str, scope: Scope, read: ReadBody) -> LeaseOpIn:
        principal(scope).require("write", topic)
        req = decode(LEASE_OP_DECODER, self._body(await read(), scope))
        req.check(self.max_node, self.max_claim)
        return req

    @staticmethod
    def _counted(res: SeqsResult, key: bytes, scope: Scope, perf: bytes) -> bytes:
        """The answer of an ack or nack, one format (keys in the order of the contract);
        `perf` is the `performance` block's extra keys (`performance_json`)."""
        counts = res.counts
        return b'{"topic":%b,"%b":%d,"skipped":%b,"ready":%d,"in_flight":%d,"performance":%b}' % (
            res.topic.name_json,
            key,
            res.done,
            orjson.dumps(res.skipped) if res.skipped else b"[]",
            counts.ready,
            counts.in_flight,
            performance_json(scope, perf),
        )

    async def claim(self, topic: str, scope: Scope, read: ReadBody) -> tuple[int, bytes]:
        p = principal(scope)
        p.require("read", topic)
        p.require("write", topic)
        req = decode(CLAIM_DECODER, self._body(await read(), scope))
        req.check(self.max_node)
        want = min(max(req.max, 1), self.max_claim)
        res = await self.ref.engine.queues.claim(topic, req.node, want, req.lease_ms)
        perf = performance_json(scope, b',"throttle_wait_ms":0.0')
        return 200, b"".join(
            (
                b'{"topic":',
                res.topic.name_json,
                b',"claimed":[',
                b",".join(res.items),
                b'],"count":%d,"ready":%d,"performance":' % (len(res.items), res.ready),
                perf,
                b"}",
            )
        )

    async def ack(self, topic: str, scope: Scope, read: ReadBody) -> tuple[int, bytes]:
        req = await self._lease_op(topic, scope, read)
        res = await self.ref.engine.queues.ack(topic, req.node, req.seqs, req.lease_ids or [])
        fsync = b',"fsync_ms":%b' % orjson.dumps(round(res.fsync_ms, 3))
        return 200, self._counted(res, b"acked", scope, fsync)

    async def nack(self, topic: str, scope: Scope, read: ReadBody) -> tuple[int, bytes]:
        req = await self._lease_op(topic, scope, read)
        res = await self.ref.engine.queues.nack(
            topic, req.node, req.seqs, req.lease_ids or [], req.delay_ms
        )
        return 200, self._counted(res, b"nacked", scope, b"")

    async def extend(self, topic: str, scope: Scope, read: ReadBody) -> tuple[int, bytes]:
        req = await self._lease_op(topic, scope, read)
        if req.lease_ms is None:
            raise InvalidRequest("extend needs lease_ms", {"field": "lease_ms"})
        res = await self.ref.engine.queues.extend(
            topic, req.node, req.seqs, req.lease_ids or [], req.lease_ms
        )
        deadlines: dict[str, JsonValue] = {str(s): d for s, d in res.deadlines.items()}
        payload: dict[str, JsonValue] = {
            "topic": res.topic.name,
            "extended": res.done,
            "skipped": cast("JsonValue", res.skipped),
            "deadlines": deadlines,
            "performance": performance(None, scope),
        }
        return 200, orjson.dumps(payload)

    def by_name(self) -> dict[str, QueueOp]:
        return {"claim": self.claim, "ack": self.ack, "nack": self.nack, "extend": self.extend}


def fast_routes(ref: EngineRef, config: Config) -> FastRoutes:
    """`POST /v0/topics/:q/{claim,ack,nack,extend}` served by the gate without the
    framework (no query string: these routes take none)."""
    ops = QueueOps(ref, config).by_name()

    def route(scope: Scope) -> FastHandler | None:
        target = topic_post(scope)
        if target is None:
            return None
        topic, verb = target
        op = ops.get(verb)
        if op is None:
            return None

        async def serve(scope: Scope, read: ReadBody) -> tuple[int, bytes]:
            return await op(topic, scope, read)

        return serve

    return route


def register(app: QuartTrio, ref: EngineRef, config: Config) -> None:
    ops = QueueOps(ref, config)

    def route(verb: str, op: QueueOp) -> None:
        async def view(topic: str) -> Response:
            status, out = await op(topic, cast("Scope", request.scope), quart_body)
            return raw_json_response(out, status)

        app.add_url_rule(f"/v0/topics/<topic>/{verb}", verb, view, methods=["POST"])

    for verb, op in ops.by_name().items():
        route(verb, op)

    @app.route("/v0/topics/<topic>/work", methods=["GET"])
    async def work_placeholder(topic: str) -> Response:
        raise MethodNotAllowed("open the stream with GET", ["GET"])
