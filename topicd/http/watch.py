"""The multiplexed watch (api-routers-watch §2): `POST /v0/watch` and the SSE stream.

`POST /v0/watch` is an ordinary Quart route. The stream, `GET /v0/watch/:wid`, is served
by `WatchStreams` at the ASGI layer (the gate dispatches to it): it runs the
establishment checks in the spec's order (`406` → `404` → `401` → `429`), sends the
response head, then runs the connection's pump (`topicd.engine.watch.pump`) inside the
connection's cancel scope, writing pre-encoded frames straight to the ASGI `send`. A
second task watches `receive` for the client's disconnect. Streams are exempt from the
per-key in-flight cap (they have their own caps) but do count for the graceful drain,
which ends them with the terminal `server_shutting_down` frame. When several processes
serve one deployment (jetstream fronts), the `429` is the deployment's count: the stream
takes a slot from `WatchRegistry.slots` as its last check and gives it back when its
task ends (`topicd.engine.slots`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final, cast
from urllib.parse import parse_qs

import orjson
import trio

from topicd.engine.watch import decode_composite_id, pump
from topicd.errors import InvalidRequest, MethodNotAllowed, NotAcceptable, TopicdError
from topicd.http.app import (
    decode,
    performance,
    principal,
    query_bool,
    raw_json_response,
    read_body,
    send_error,
)
from topicd.http.auth import stream_principal
from topicd.wire import WATCH_DECODER, check_topic_name

if TYPE_CHECKING:
    import socket

    from quart import Response
    from quart_trio import QuartTrio

    from topicd.config import Config
    from topicd.engine.watch import Conn
    from topicd.http.app import EngineRef, Message, Receive, Scope, Send
    from topicd.http.auth import KeyStore, Principal

log = logging.getLogger("topicd.watch")

DirectWriters = tuple[
    Callable[[bytes], bytes | None],
    Callable[[bytes | memoryview], Awaitable[None]],
    Callable[[], "socket.socket | None"],
]

STREAM_PREFIX: Final = "/v0/watch/"
_HEAD: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),
]


def register(app: QuartTrio, ref: EngineRef, config: Config, keys: KeyStore) -> None:
    max_body = config.limits.max_body_bytes
    max_topics = config.watch.max_watch_topics

    @app.route("/v0/watch", methods=["POST"])
    async def create_watch() -> Response:
        who = principal()
        body = await read_body(empty_ok=False, max_bytes=max_body)
        assert body is not None
        req = decode(WATCH_DECODER, body)
        n = len(req.topics)
        if n == 0 or n > max_topics:
            raise InvalidRequest(
                f"topics must name 1..{max_topics} topics, got {n}",
                {"field": "topics", "max": max_topics},
            )
        for name in req.topics:
            check_topic_name(name)
        req.check()
        who.require("read", *req.topics)
        lenient = query_bool("lenient", False)
        engine = ref.engine
        for name in req.topics:
            await engine.sync_topic(name)
        session, topics = engine.create_watch(who.key_id if keys.enabled else None, req, lenient)
        if engine.watch.slots is not None:
            # (several processes serve the deployment: the session cap is theirs together)
            await engine.watch.count_session(session)
        out = {
            t.name: {
                "from_seq": session.cursors[t.name],
                "head_seq": t.head_seq,
                "earliest_seq": t.earliest_seq,
            }
            for t in topics
        }
        return raw_json_response(
            orjson.dumps(
                {
                    "wid": session.wid,
                    "stream_url": STREAM_PREFIX + session.wid,
                    "session_ttl_ms": config.watch.session_ttl_ms,
                    "heartbeat_ms": session.heartbeat_ms,
                    "topics": out,
                    "performance": performance(),
                }
            )
        )

    @app.route("/v0/watch/<wid>", methods=["GET"])
    async def stream_placeholder(wid: str) -> Response:
        # GET is served by WatchStreams before Quart; this route only makes other
        # methods on the stream path answer 405 with `Allow: GET`
        raise MethodNotAllowed("open the stream with GET", ["GET"])


def _headers(scope: Scope) -> dict[bytes, str]:
    out: dict[bytes, str] = {}
    for key, value in cast("list[tuple[bytes, bytes]]", scope.get("headers", [])):
        out.setdefault(key, value.decode("latin-1"))
    return out


_MAX_FIELDS: Final = 64  # query fields read before the query counts as malformed


def stream_request(
    scope: Scope, keys: KeyStore, what: str
) -> tuple[dict[str, list[str]], Principal]:
    """The first checks of a stream that authenticates itself (`/work`, the dashboard
    feed), in order: `406` without an `Accept` that takes an event stream, `400` for a
    query of more than `_MAX_FIELDS` fields, `401`. Returns (query, principal);
    `what` names the stream in the `406`."""
    headers = _headers(scope)
    if not _acceptable(headers.get(b"accept")):
        raise NotAcceptable(f"the {what} is text/event-stream; send Accept accordingly")
    raw = cast("bytes", scope.get("query_string", b"")).decode("latin-1")
    try:
        query = parse_qs(raw, keep_blank_values=True, max_num_fields=_MAX_FIELDS)
    except ValueError:
        raise InvalidRequest(f"more than {_MAX_FIELDS} query parameters") from None
    return query, stream_principal(keys, headers, query)


def _acceptable(accept: str | None) -> bool:
    if accept is None or not accept.strip():
        return True
    for part in accept.split(","):
        media = part.split(";", 1)[0].strip().lower()
        if media in ("text/event-stream", "*/*"):
            return True
    return False


class WatchStreams:
    """`GET /v0/watch/:wid` at the ASGI layer (see module docstring)."""

    def __init__(self, ref: EngineRef, config: Config, keys: KeyStore) -> None:
        self.ref = ref
        self.cfg = config
        self.keys = keys

    @staticmethod
    def wid_of(scope: Scope) -> str | None:
        """The `wid` if this request is a stream open, else None (not ours)."""
        if scope.get("method") != "GET":
            return None
        path = cast("str", scope["path"])
        if not path.startswith(STREAM_PREFIX):
            return None
        wid = path[len(STREAM_PREFIX) :]
        return wid if wid and "/" not in wid else None

    async def establish(self, scope: Scope, wid: str) -> Conn:
        """The checks of api-routers-watch §2.3, in order; registers the connection.
        The connection caps come last: with deployment-wide slots (several fronts) one
        is taken there, unless the stream supersedes the session's open one (it takes
        that one's over)."""
        headers = _headers(scope)
        if not _acceptable(headers.get(b"accept")):
            raise NotAcceptable("the watch stream is text/event-stream; send Accept accordingly")
        query = parse_qs(cast("bytes", scope.get("query_string", b"")).decode("latin-1"))
        registry = self.ref.engine.watch
        session = registry.lookup(wid)
        if self.keys.enabled:
            auth = headers.get(b"authorization")
            p = self.keys.authenticate(auth) if auth is not None else None
            if p is None and auth is None and "token" in query:
                p = self.keys.authenticate_token(query["token"][0])
            registry.check_key(session, None if p is None else p.key_id)
        last_id = headers.get(b"last-event-id")
        if last_id is None and "cursor" in query:
            last_id = query["cursor"][0]
        rewind = decode_composite_id(last_id) if last_id else None
        slots = registry.slots
        if slots is None or session.conn is not None:
            return registry.open_stream(session, rewind)
        slot = await slots.acquire(session.key_id)
        try:
            return registry.open_stream(session, rewind, slot)
        except TopicdError:
            await slots.release(slot)
            raise

    async def __call__(self, scope: Scope, receive: Receive, send: Send, wid: str) -> None:
        try:
            conn = await self.establish(scope, wid)
        except TopicdError as err:
            await send_error(send, err)
            return
        engine = self.ref.engine
        try:
            await self._serve(conn, scope, receive, send)
        finally:
            engine.watch.close(conn)
            slot, conn.slot = conn.slot, None
            if slot is not None and engine.watch.slots is not None:
                await engine.watch.slots.release(slot)

    async def _serve(self, conn: Conn, scope: Scope, receive: Receive, send: Send) -> None:
        """The stream, until it ends (the caller unregisters it, however it ends)."""
        engine = self.ref.engine
        for name in conn.session.topics:
            # (a process that follows the topic catches it up now that it is watched;
            # on failure the stream starts from what memory holds and catches up later)
            with contextlib.suppress(TopicdError):
                await engine.sync_topic(name)
        chunk_socket: Callable[[], socket.socket | None] | None = None
        if scope.get("topicd.direct"):
            engine.watch.stats.streams_direct += 1
            writers = scope.get("topicd.direct_write")
            if writers is not None:
                # the drain may write to this stream's socket itself while the pump waits
                conn.direct, conn.raw_write, chunk_socket = cast("DirectWriters", writers)
        headers = list(_HEAD)
        if scope.get("http_version") in ("1.0", "1.1"):
            headers.append((b"connection", b"keep-alive"))
        ended = False
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if chunk_socket is not None:
            # the drain's shared batches are HTTP/1.1 chunks: only for a chunked body
            conn.sock = chunk_socket()

        async def write(chunk: bytes) -> None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        with conn.cancel_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
                await pump(
                    conn,
                    engine.watch,
                    write,
                    retry_ms=self.cfg.watch.sse_retry_ms,
                    max_scan=self.cfg.protocol.max_scan_per_read,
                    now_ms=engine.clock.now_ms,
                    enforce=engine.enforce,
                    payloads=engine.payloads,
                )
                ended = True  # the stream ended by itself (terminal frame)
                nursery.cancel_scope.cancel()
        if ended:
            with trio.move_on_after(1.0):
                await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message: Message = await receive()
        if message.get("type") == "http.disconnect":
            scope.cancel()
            return
