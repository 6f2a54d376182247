"""Routes of `/v0/topics` (api-topics §2-§10): validate, call the engine, render."""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Final, cast

import msgspec
import orjson
from quart import Response, request

from topicd.engine.engine import canonical_match, parse_match
from topicd.errors import InvalidRequest, JsonValue
from topicd.http.app import (
    check_body,
    decode,
    json_response,
    performance,
    principal,
    quart_body,
    query_bool,
    raw_json_response,
    read_body,
    scope_header,
    topic_post,
)
from topicd.wire import (
    CONFIG_DECODER,
    DELETE_DECODER,
    DIFF_DECODER,
    DiffIn,
    check_topic_name,
    decode_write,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from quart_trio import QuartTrio

    from topicd.config import Config
    from topicd.http.app import EngineRef, FastHandler, FastRoutes, ReadBody, Scope


def _has_whitespace(body: bytes) -> bool:
    """Whether minifying could change the body (any JSON whitespace byte anywhere)."""
    return b" " in body or b"\n" in body or b"\r" in body or b"\t" in body


def encode_list_cursor(after: str) -> str:
    raw = orjson.dumps({"after": after})
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_list_cursor(cursor: str) -> str:
    """Accepts base64url or standard base64, padded or not (README §7)."""
    text = cursor.strip().replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        obj = orjson.loads(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        raise InvalidRequest("cursor does not decode", {"cursor": cursor[:200]}) from None
    after = obj.get("after") if isinstance(obj, dict) else None
    if not isinstance(after, str):
        raise InvalidRequest("cursor does not decode", {"cursor": cursor[:200]})
    return after


def _page_size(default: int, maximum: int) -> int:
    raw = request.args.get("page_size")
    try:
        value = int(raw) if raw is not None else default
    except ValueError:
        value = default
    return min(max(value, 1), maximum)


async def write_records(
    ref: EngineRef,
    topic: str,
    scope: Scope,
    read: ReadBody,
    header: Callable[[str], str | None],
    query: Callable[[str, bool], bool],
    max_body: int,
) -> tuple[int, bytes]:
    """`POST /v0/topics/:topic` (api-topics §5): (status, JSON body). The one
    implementation, called by the Quart route and by the gate's fast path; `read`
    returns the raw request body, `header` looks up a request header, `query` a boolean
    query parameter (`query_bool`'s contract)."""
    p = principal(scope)
    p.require("write", topic)
    return_seqs = query("return_seqs", True)  # (a bad value appends nothing)
    body = check_body(await read(), header, empty_ok=False, max_bytes=max_body)
    assert body is not None
    if _has_whitespace(body):
        try:
            # minify once: every msgspec.Raw slice is then the stored, minified text
            body = msgspec.json.format(body, indent=-1)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"malformed JSON: {exc}") from None
    try:
        req = decode_write(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"malformed JSON: {exc}") from None
    res = await ref.engine.append(
        topic,
        req,
        header_key=header("Idempotency-Key"),
        can_admin=p.has("admin"),
    )
    payload: dict[str, JsonValue] = {
        "topic": res.topic,
        "first_seq": res.first_seq,
        "last_seq": res.last_seq,
    }
    if return_seqs:
        payload["seqs"] = list(range(res.first_seq, res.last_seq + 1))
    payload["head_seq"] = res.head_seq
    payload["count"] = res.count
    payload["created"] = res.created
    payload["deduped"] = res.deduped
    perf: dict[str, JsonValue] = {"fsync_ms": round(res.fsync_ms, 3)}
    if res.wal_append_ms is not None:
        perf["wal_append_ms"] = round(res.wal_append_ms, 3)
    payload["performance"] = performance(perf, scope)
    return (201 if res.created else 200), orjson.dumps(payload)


async def read_diff(
    ref: EngineRef,
    topic: str,
    scope: Scope,
    read: ReadBody,
    header: Callable[[str], str | None],
    max_body: int,
) -> tuple[int, bytes]:
    """`POST /v0/topics/:topic/diff` (api-topics §7), long-polls included: (status, JSON
    body). The one implementation, called by the Quart route and the gate's fast path."""
    principal(scope).require("read", topic)
    body = check_body(await read(), header, empty_ok=True, max_bytes=max_body)
    req = DiffIn() if body is None else decode(DIFF_DECODER, body)
    t, res = await ref.engine.diff(topic, req)
    tomb = b"null" if res.tombstone is None else orjson.dumps(res.tombstone.to_wire())
    extra: dict[str, JsonValue] = {"records_scanned": res.scanned}
    if res.cold_segments:
        extra["cold_segments_read"] = res.cold_segments
    perf = orjson.dumps(performance(extra, scope))
    return 200, b"".join(
        (
            b'{"topic":',
            t.name_json,
            b',"records":[',
            b",".join(res.records),
            b'],"next_from_seq":%d,"head_seq":%d,"earliest_seq":%d,"caught_up":%s,'
            % (
                res.next_from_seq,
                res.head_seq,
                res.earliest_seq,
                b"true" if res.caught_up else b"false",
            ),
            b'"tombstone":',
            tomb,
            b',"lag":%d,"performance":' % res.lag,
            perf,
            b"}",
        )
    )


def _no_query(name: str, default: bool) -> bool:
    return default


def _seqs_query(returned: bool) -> Callable[[str, bool], bool]:
    def query(name: str, default: bool) -> bool:
        return returned if name == "return_seqs" else default

    return query


# the query strings a write may carry on the fast path, each with its `query` reader:
# `return_seqs` alone, as the client library sends it (`?return_seqs=false`); any other
# goes through Quart
_WRITE_QUERIES: Final = {
    **{b"return_seqs=" + v: _seqs_query(True) for v in (b"true", b"1")},
    **{b"return_seqs=" + v: _seqs_query(False) for v in (b"false", b"0")},
}


def fast_routes(ref: EngineRef, config: Config) -> FastRoutes:
    """The `/v0/topics` endpoints the gate serves without the framework: `POST
    /v0/topics/:topic` without a query string or with `return_seqs` alone (what the
    client library sends), and `POST /v0/topics/:topic/diff` without a query string.
    Any other query goes through Quart, whose query parsing is the contract."""
    max_body = config.limits.max_body_bytes

    def route(scope: Scope) -> FastHandler | None:
        target = topic_post(scope, _WRITE_QUERIES)
        if target is None or target[1] not in ("", "diff"):
            return None
        topic, verb = target
        qs = cast("bytes", scope.get("query_string") or b"")
        if verb:
            if qs:
                return None

            async def diff(scope: Scope, read: ReadBody) -> tuple[int, bytes]:
                return await read_diff(ref, topic, scope, read, scope_header(scope), max_body)

            return diff

        # a write: the gate records its sojourn (governor s6; diffs may long-poll)
        scope["topicd.sojourn"] = True

        query = _WRITE_QUERIES[qs] if qs else _no_query

        async def write(scope: Scope, read: ReadBody) -> tuple[int, bytes]:
            header = scope_header(scope)
            return await write_records(ref, topic, scope, read, header, query, max_body)

        return write

    return route


def register(app: QuartTrio, ref: EngineRef, config: Config) -> None:
    max_body = config.limits.max_body_bytes
    proto = config.protocol

    @app.route("/v0/topics/<topic>", methods=["PUT"])
    async def put_topic(topic: str) -> Response:
        principal().require("admin", topic)
        body = await read_body(empty_ok=True, max_bytes=max_body)
        cin = None if body is None else decode(CONFIG_DECODER, body)
        t, created = await ref.engine.put_topic(topic, cin)
        return json_response(
            {"topic": t.name, "created": created, "config": t.config.to_wire()},
            201 if created else 200,
        )

    @app.route("/v0/topics/<topic>", methods=["GET"])
    async def get_topic(topic: str) -> Response:
        principal().require("read", topic)
        touch = query_bool("touch", True)
        await ref.engine.sync_topic(topic, touch=touch, reads=True)
        return json_response(ref.engine.topic_state(topic, touch))

    @app.route("/v0/topics", methods=["GET"])
    async def list_topics() -> Response:
        p = principal()
        p.require("read")
        cursor = request.args.get("cursor") or None
        after = decode_list_cursor(cursor) if cursor is not None else None
        await ref.engine.sync_listing()
        touch = query_bool("touch", False)
        items, last = ref.engine.list_topics(
            request.args.get("prefix", ""),
            after,
            _page_size(proto.default_page_size, proto.max_page_size),
            touch,
            p.allows_name if p.prefixes else None,
        )
        if touch:
            await ref.engine.share_reads([str(item["topic"]) for item in items])
        payload: dict[str, JsonValue] = {"topics": cast("JsonValue", items)}
        if last is not None:
            payload["next_cursor"] = encode_list_cursor(last)
        return json_response(payload)

    @app.route("/v0/topics/<topic>", methods=["DELETE"])
    async def delete_topic(topic: str) -> Response:
        principal().require("delete", topic)
        deleted, removed = await ref.engine.delete_topic_cascade(
            topic, query_bool("if_empty", False)
        )
        payload: dict[str, JsonValue] = {"topic": topic, "deleted": deleted}
        payload["routers_removed"] = cast("JsonValue", removed)
        return json_response(payload)

    @app.route("/v0/topics/<topic>", methods=["POST"])
    async def write(topic: str) -> Response:
        status, out = await write_records(
            ref,
            topic,
            cast("Scope", request.scope),
            quart_body,
            request.headers.get,
            query_bool,
            max_body,
        )
        return raw_json_response(out, status)

    @app.route("/v0/topics/<topic>/diff", methods=["POST"])
    async def diff(topic: str) -> Response:
        scope = cast("Scope", request.scope)
        status, out = await read_diff(ref, topic, scope, quart_body, request.headers.get, max_body)
        return raw_json_response(out, status)

    @app.route("/v0/topics/<topic>/delete", methods=["POST"])
    async def delete_records(topic: str) -> Response:
        principal().require("delete", topic)
        body = await read_body(empty_ok=False, max_bytes=max_body)
        assert body is not None
        req = decode(DELETE_DECODER, body)
        check_topic_name(topic)
        res = await ref.engine.delete_records(topic, req)
        t = res.topic
        payload: dict[str, JsonValue] = {
            "topic": t.name,
            "deleted": res.deleted,
            "earliest_seq": t.earliest_seq,
            "head_seq": t.head_seq,
            "count": t.count,
            "bytes": t.bytes,
        }
        match = parse_match(req.match)
        if match is not None:
            payload["match"] = cast("JsonValue", canonical_match(match))
        if req.before_seq is not None:
            payload["before_seq"] = req.before_seq
        return json_response(payload)
