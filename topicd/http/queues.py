"""Routes of queue topics: claim, ack, nack, extend (validate, call the engine, render).

The `/work` stream is served before Quart (`topicd.http.work`); its route here only
makes other methods on the path answer `405` with `Allow: GET`."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import orjson

from topicd.errors import InvalidRequest, JsonValue, MethodNotAllowed
from topicd.http.app import (
    decode,
    json_response,
    performance,
    principal,
    raw_json_response,
    read_body,
)
from topicd.wire import CLAIM_DECODER, LEASE_OP_DECODER, LeaseOpIn

if TYPE_CHECKING:
    from quart import Response
    from quart_trio import QuartTrio

    from topicd.config import Config
    from topicd.engine.queues import SeqsResult
    from topicd.http.app import EngineRef


def register(app: QuartTrio, ref: EngineRef, config: Config) -> None:
    max_body = config.limits.max_body_bytes
    max_node = config.protocol.max_node_bytes
    max_claim = config.queue.max_claim

    async def lease_op(topic: str) -> LeaseOpIn:
        principal().require("write", topic)
        body = await read_body(empty_ok=False, max_bytes=max_body)
        assert body is not None
        req = decode(LEASE_OP_DECODER, body)
        req.check(max_node, max_claim)
        return req

    def counted(res: SeqsResult, key: str) -> dict[str, JsonValue]:
        return {
            "topic": res.topic.name,
            key: res.done,
            "skipped": cast("JsonValue", res.skipped),
            "ready": res.counts.ready,
            "in_flight": res.counts.in_flight,
        }

    @app.route("/v0/topics/<topic>/claim", methods=["POST"])
    async def claim(topic: str) -> Response:
        p = principal()
        p.require("read", topic)
        p.require("write", topic)
        body = await read_body(empty_ok=False, max_bytes=max_body)
        assert body is not None
        req = decode(CLAIM_DECODER, body)
        req.check(max_node)
        want = min(max(req.max, 1), max_claim)
        res = await ref.engine.queues.claim(topic, req.node, want, req.lease_ms)
        perf = orjson.dumps(performance({"throttle_wait_ms": 0.0}))
        out = b"".join(
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
        return raw_json_response(out)

    @app.route("/v0/topics/<topic>/ack", methods=["POST"])
    async def ack(topic: str) -> Response:
        req = await lease_op(topic)
        res = await ref.engine.queues.ack(topic, req.node, req.seqs, req.lease_ids or [])
        return json_response(counted(res, "acked"), perf={"fsync_ms": round(res.fsync_ms, 3)})

    @app.route("/v0/topics/<topic>/nack", methods=["POST"])
    async def nack(topic: str) -> Response:
        req = await lease_op(topic)
        res = await ref.engine.queues.nack(
            topic, req.node, req.seqs, req.lease_ids or [], req.delay_ms
        )
        return json_response(counted(res, "nacked"))

    @app.route("/v0/topics/<topic>/extend", methods=["POST"])
    async def extend(topic: str) -> Response:
        req = await lease_op(topic)
        if req.lease_ms is None:
            raise InvalidRequest("extend needs lease_ms", {"field": "lease_ms"})
        res = await ref.engine.queues.extend(
            topic, req.node, req.seqs, req.lease_ids or [], req.lease_ms
        )
        deadlines: dict[str, JsonValue] = {str(s): d for s, d in res.deadlines.items()}
        return json_response(
            {
                "topic": res.topic.name,
                "extended": res.done,
                "skipped": cast("JsonValue", res.skipped),
                "deadlines": deadlines,
            }
        )

    @app.route("/v0/topics/<topic>/work", methods=["GET"])
    async def work_placeholder(topic: str) -> Response:
        raise MethodNotAllowed("open the stream with GET", ["GET"])
