"""`GET /v0/ws`: the WebSocket data plane (api-routers-watch §3), on the direct socket path.

The direct HTTP/1.1 path (`topicd.http.server.Listener`) hands a complete head that
asks to upgrade `GET /v0/ws` to `WsEndpoint.upgrade` together with the socket. The
handshake is wsproto's (the library Hypercorn uses; no frame parsing here), then:

1. admission as the gate admits any request (`503` while not serving, `401` without a
   valid bearer key when auth is on; no scope is needed to connect), then the SSE
   connection caps (`429`, `limit` `max_sse_connections[_per_key]`; the deployment's
   with several fronts, `topicd.engine.slots`). A refusal is the canonical error answer
   to the handshake, and the connection closes;
2. `101`, without extensions: no per-message compression, so the frames the drains
   encode once are written as they are to every connection;
3. two tasks in the connection's cancel scope: the **reader** decodes client frames
   (wsproto), answers protocol pings, runs one command at a time — `subscribe` (scope
   `read`), `unsubscribe`, `publish` (scope `write`, plus `admin` with `config`; the
   one write implementation, `topicd.http.topics.write_records`), `ping` — and queues
   each reply; the **writer** (`topicd.engine.ws.ws_pump`) writes replies and frames
   in order. Live frames come from the topics' drains (`topicd.engine.ws`).

Errors become `error` messages and never close the socket; only the graceful drain
does (`server_shutting_down`, then a close frame `1001`). A client close is answered
with a close frame. The connection holds no per-key in-flight slot; it counts for the
drain like a request, and against the SSE caps.

A handshake that reaches Hypercorn instead (the direct path off, or a connection
Hypercorn already parses) is served through ASGI (`WsEndpoint.asgi`, dispatched by the
gate): the same admission, commands and delivery, with Hypercorn framing each message
(per connection, so no frame is shared there).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final, TypeVar, cast

import msgspec
import orjson
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

from topicd.clock import perf_ms
from topicd.engine.watch import WatchOptions, ws_frame, ws_payload
from topicd.engine.ws import open_ws, ws_pump
from topicd.errors import (
    Internal,
    InvalidRequest,
    JsonValue,
    PayloadTooLarge,
    TopicdError,
    TopicNotFound,
)
from topicd.http.app import WS_PATH, error_parts
from topicd.http.server import RECV_BYTES, close_quietly, linger, raw_socket, refusal_bytes
from topicd.http.topics import write_records
from topicd.sched.classes import ClientPermits
from topicd.wire import (
    WS_ENVELOPE_DECODER,
    WS_PUBLISH_DECODER,
    WS_REQUEST_ID_DECODER,
    WS_SUBSCRIBE_DECODER,
    WS_UNSUBSCRIBE_DECODER,
    check_topic_name,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from quart import Response
    from quart_trio import QuartTrio

    from topicd.config import Config
    from topicd.engine.engine import Engine
    from topicd.engine.slots import Slot
    from topicd.engine.topic import Topic
    from topicd.engine.ws import WsConn
    from topicd.http.app import EngineRef, Receive, Scope, Send
    from topicd.http.auth import KeyStore, Principal
    from topicd.lifecycle import Lifecycle

_T = TypeVar("_T")
log = logging.getLogger("topicd.ws")
access_log = logging.getLogger("topicd.access")

_LINE: Final = (b"GET /v0/ws ", b"GET /v0/ws?")
CLOSE_WAIT_S: Final = 1.0  # after our close frame: how long the client's close is awaited


def is_upgrade(head: bytes) -> bool:
    """Whether a complete request head asks to upgrade `GET /v0/ws` (the handshake
    itself is wsproto's to judge)."""
    return head.startswith(_LINE) and b"\r\nupgrade:" in head.lower()


def register(app: QuartTrio) -> None:
    @app.route(WS_PATH, methods=["GET"])
    async def ws_without_upgrade() -> Response:
        # an upgrade never reaches the framework on the direct path; a plain GET does
        raise InvalidRequest(
            "GET /v0/ws opens a WebSocket: send the upgrade handshake "
            "(Connection: Upgrade, Upgrade: websocket)"
        )


def message(op: str, request_id: bytes, fields: dict[str, JsonValue] | None = None) -> bytes:
    """A reply frame: `{"op", "request_id", ...fields}`; `request_id` is the client's
    JSON text, echoed verbatim."""
    body = b'{"op":' + orjson.dumps(op) + b',"request_id":' + request_id
    body += b"," + orjson.dumps(fields)[1:] if fields else b"}"
    return ws_frame(body)


def error_message(request_id: bytes, code: str, text: str, detail: JsonValue = None) -> bytes:
    fields: dict[str, JsonValue] = {"code": code, "message": text}
    if detail:
        fields["detail"] = detail
    return message("error", request_id, fields)


UNSUPPORTED: Final = error_message(
    b"null", "unsupported_message", "binary messages are not supported: send JSON text"
)


async def _deny(scope: Scope, send: Send, err: TopicdError, pressure: bytes) -> None:
    """Refuse an ASGI websocket handshake with the canonical error answer (the websocket
    HTTP response extension; without it, a plain close, which the server turns into a
    `403`)."""
    extensions = cast("dict[str, object]", scope.get("extensions") or {})
    if "websocket.http.response" not in extensions:
        await send({"type": "websocket.close", "code": 1008})
        return
    status, headers, body = error_parts(err)
    headers.append((b"content-length", b"%d" % len(body)))
    headers.append((b"x-topicd-pressure", pressure))
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


class WsEndpoint:
    """`/v0/ws` connections (see module docstring)."""

    def __init__(
        self,
        ref: EngineRef,
        config: Config,
        keys: KeyStore,
        lifecycle: Lifecycle,
        *,
        admit: Callable[[Scope, str], TopicdError | None],
        pressure: Callable[[], bytes],
        on_error: Callable[[TopicdError], None],
    ) -> None:
        self.ref = ref
        self.cfg = config
        self.keys = keys
        self.lifecycle = lifecycle
        self.admit = admit
        self.pressure = pressure
        self.on_error = on_error
        self.max_body = config.limits.max_body_bytes
        self.max_subs = config.watch.max_watch_topics
        self.access = config.logging.access_log

    # ---- admission (both transports) --------------------------------------------------

    async def _open(
        self, headers: list[tuple[bytes, bytes]], held: list[Slot]
    ) -> tuple[WsConn, Principal]:
        """Admit a handshake as the gate admits a request (`503`, `401`), then take an
        SSE connection slot (`429`; with deployment-wide slots, one taken there, put in
        `held`: the connection's task gives it back once the request is finished).
        Raises the refusal."""
        scope: Scope = {"type": "http", "method": "GET", "path": WS_PATH, "headers": headers}
        err = self.admit(scope, WS_PATH)
        if err is not None:
            raise err
        p = cast("Principal", scope["topicd.principal"])
        key = p.key_id if self.keys.enabled else None
        registry = self.ref.engine.watch
        if registry.slots is not None:
            held.append(await registry.slots.acquire(key))
        conn = open_ws(registry, key, self.cfg.watch.ws_outbound_queue, self.cfg.sse.channel_bytes)
        return conn, p

    async def _give_back(self, held: list[Slot]) -> None:
        """The deployment-wide slot of a connection that ended (after the request is
        finished: the drain does not wait on the count's round trip)."""
        slots = self.ref.engine.watch.slots
        if held and slots is not None:
            await slots.release(held.pop())

    async def _run(
        self,
        conn: WsConn,
        write: Callable[[Sequence[bytes | memoryview]], Awaitable[None]],
        read: Callable[[trio.CancelScope], Awaitable[None]],
    ) -> bool:
        """The reader and the writer, until the writer ends (a terminal message, the
        answer to the client's close) or the reader does (the client left). Returns
        whether the graceful drain ended it (the caller then sends the close frame)."""
        engine = self.ref.engine
        with conn.cancel_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, nursery.cancel_scope)
                await ws_pump(
                    conn,
                    write,
                    catchup=engine.watch.catchup,
                    max_scan=self.cfg.protocol.max_scan_per_read,
                    now_ms=engine.clock.now_ms,
                    enforce=engine.enforce,
                    payloads=engine.payloads,
                )
                nursery.cancel_scope.cancel()  # written: a terminal message or the close
            return conn.draining
        return False  # cancelled: the client is gone or too slow

    async def _on_message(self, conn: WsConn, p: Principal, data: bytes, size: int) -> None:
        """One complete text message of `size` bytes (`data` is empty past the bound)."""
        if size > self.max_body:
            await conn.reply(self._too_large())
            return
        answer = await self.command(conn, p, data)
        if answer is not None:
            await conn.reply(answer)

    # ---- the direct socket path (wsproto) -----------------------------------------------

    async def upgrade(self, stream: trio.abc.Stream, head: bytes, rest: bytes) -> bool:
        """Serve the connection if `head` asks to upgrade `/v0/ws` (then True: the
        connection is done when this returns); False: not ours, `head` is untouched."""
        if not is_upgrade(head):
            return False
        t0 = perf_ms()
        status = 101
        self.lifecycle.request_started()
        held: list[Slot] = []
        try:
            status = await self._serve(stream, head, rest, held)
        except Exception:
            log.exception("unhandled error on a /v0/ws connection")  # it ends; the server stays
        finally:
            self.lifecycle.request_finished()
            await self._give_back(held)
            await close_quietly(cast("trio.SocketStream", stream))
            if self.access:
                access_log.info("GET %s %d %.2fms", WS_PATH, status, perf_ms() - t0)
        return True

    async def _serve(
        self, stream: trio.abc.Stream, head: bytes, rest: bytes, held: list[Slot]
    ) -> int:
        ws = WSConnection(ConnectionType.SERVER)
        try:
            try:
                ws.receive_data(head)
                request = next((e for e in ws.events() if isinstance(e, Request)), None)
            except RemoteProtocolError as exc:
                raise InvalidRequest(f"not a valid WebSocket handshake: {exc}") from None
            if request is None:
                raise InvalidRequest("not a valid WebSocket handshake")
            conn, p = await self._open(list(request.extra_headers), held)
        except TopicdError as err:
            self.on_error(err)
            try:
                await stream.send_all(refusal_bytes(err, self.pressure()))
                if isinstance(stream, trio.SocketStream):
                    await stream.send_eof()
                    await linger(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            return err.http_status
        try:
            await stream.send_all(ws.send(AcceptConnection()))
            if rest:
                # frames the client sent right behind its handshake (wsproto's accept
                # starts the connection without the handshake parser's leftovers)
                ws.receive_data(rest)
            if isinstance(stream, trio.SocketStream):
                conn.direct = _direct_writer(stream)
                conn.sock = raw_socket(stream)

            async def write(frames: Sequence[bytes | memoryview]) -> None:
                try:
                    await stream.send_all(frames[0] if len(frames) == 1 else b"".join(frames))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    conn.cancel_scope.cancel()  # the client is gone
                    await trio.lowlevel.checkpoint()

            async def read(done: trio.CancelScope) -> None:
                await self._read(stream, ws, conn, p, done)

            if await self._run(conn, write, read) and ws.state is ConnectionState.OPEN:
                # the graceful drain: the error message went out, now the close frame
                await stream.send_all(ws.send(CloseConnection(code=1001, reason="shutting down")))
                with trio.move_on_after(CLOSE_WAIT_S):
                    await self._await_close(stream, ws)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            conn.detach()
        return 101

    @staticmethod
    async def _await_close(stream: trio.abc.Stream, ws: WSConnection) -> None:
        """Read until the client answers our close frame (or leaves)."""
        while ws.state is not ConnectionState.CLOSED:
            data = await stream.receive_some(RECV_BYTES)
            if not data:
                return
            ws.receive_data(bytes(data))
            for _ in ws.events():
                pass

    async def _read(
        self,
        stream: trio.abc.Stream,
        ws: WSConnection,
        conn: WsConn,
        p: Principal,
        done: trio.CancelScope,
    ) -> None:
        """Decode client frames and run their commands, one at a time, until the client
        closes (answered with a close frame) or leaves."""
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                for event in ws.events():
                    if isinstance(event, TextMessage):
                        piece = event.data.encode()
                        size += len(piece)
                        if size <= self.max_body:
                            parts.append(piece)
                        if event.message_finished:
                            data, parts = b"".join(parts), []
                            await self._on_message(conn, p, data, size)
                            size = 0
                    elif isinstance(event, BytesMessage):
                        if event.message_finished:
                            await conn.reply(UNSUPPORTED)
                    elif isinstance(event, Ping):
                        await conn.reply(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        if ws.state is not ConnectionState.CLOSED:
                            conn.stop = ws.send(event.response())
                            conn.poke()
                        else:
                            done.cancel()
                        return
                got = await stream.receive_some(RECV_BYTES)
                if not got:
                    done.cancel()  # gone without a close frame
                    return
                ws.receive_data(bytes(got))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            done.cancel()

    # ---- the Hypercorn path (ASGI websocket) --------------------------------------------

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A `/v0/ws` handshake that reached Hypercorn (the direct path is off, or
        Hypercorn already parses the connection): the same admission, commands and
        delivery, with Hypercorn framing the messages (it also answers pings)."""
        t0 = perf_ms()
        status = 101
        self.lifecycle.request_started()
        held: list[Slot] = []
        try:
            first = await receive()
            if first["type"] != "websocket.connect":
                return  # the client left
            try:
                conn, p = await self._open(
                    cast("list[tuple[bytes, bytes]]", scope.get("headers", [])), held
                )
            except TopicdError as err:
                self.on_error(err)
                status = err.http_status
                await _deny(scope, send, err, self.pressure())
                return
            try:
                await send({"type": "websocket.accept"})

                async def write(frames: Sequence[bytes | memoryview]) -> None:
                    for frame in frames:
                        text = ws_payload(bytes(frame)).decode("utf-8")
                        await send({"type": "websocket.send", "text": text})

                async def read(done: trio.CancelScope) -> None:
                    while True:
                        msg = await receive()
                        kind = msg["type"]
                        if kind == "websocket.disconnect":
                            done.cancel()
                            return
                        if kind != "websocket.receive":
                            continue
                        text = msg.get("text")
                        if isinstance(text, str):
                            data = text.encode()
                            await self._on_message(conn, p, data, len(data))
                        else:
                            await conn.reply(UNSUPPORTED)

                if await self._run(conn, write, read):
                    await send({"type": "websocket.close", "code": 1001})
            finally:
                conn.detach()
        except Exception:
            log.exception("unhandled error on a /v0/ws connection")  # it ends; the server stays
        finally:
            self.lifecycle.request_finished()
            await self._give_back(held)
            if self.access:
                access_log.info("GET %s %d %.2fms", WS_PATH, status, perf_ms() - t0)

    def _too_large(self) -> bytes:
        err = PayloadTooLarge(f"message exceeds max_body_bytes {self.max_body}")
        return error_message(b"null", err.code, err.message, {"max": self.max_body})

    # ---- commands ---------------------------------------------------------------------

    async def command(self, conn: WsConn, p: Principal, data: bytes) -> bytes | None:
        """Run one command message; returns its reply (an `error` message for any
        failure), or None when the command queued its reply itself."""
        try:
            env = WS_ENVELOPE_DECODER.decode(data)
        except msgspec.ValidationError as exc:  # (a DecodeError: first)
            return error_message(_request_id(data), "invalid_json", f"not a command: {exc}")
        except msgspec.DecodeError as exc:
            return error_message(b"null", "invalid_json", f"not JSON: {exc}")
        rid = bytes(env.request_id)
        if env.op is None:
            return error_message(rid, "invalid_json", "a command needs an `op`")
        try:
            if env.op == "subscribe":
                await self.subscribe(conn, p, rid, data)
                return None
            if env.op == "unsubscribe":
                return self.unsubscribe(conn, rid, data)
            if env.op == "publish":
                return await self.publish(p, rid, data)
            if env.op == "ping":
                return message("pong", rid)
        except TopicdError as err:
            self.on_error(err)
            return error_message(rid, err.code, err.message, dict(err.detail) or None)
        except Exception:
            # a bug: the connection and the server stay up, the client learns of it
            log.exception("unhandled error in a /v0/ws %s command", env.op[:32])
            bug = Internal("internal error (a bug; see the server log)")
            return error_message(rid, bug.code, bug.message)
        return error_message(
            rid,
            "invalid_json",
            f"unknown op {env.op[:100]!r}: subscribe, unsubscribe, publish or ping",
        )

    async def subscribe(self, conn: WsConn, p: Principal, rid: bytes, data: bytes) -> None:
        """Resolve, reply `subscribed`, then start the subscriptions: each one's frames
        (pulled from its position first) follow the reply."""
        req = _decode(WS_SUBSCRIBE_DECODER, data)
        req.check()
        wanted: dict[str, int | None] = {}  # name -> from_seq (None: tail)
        if req.topic is not None:
            wanted[req.topic] = None if req.tail else req.from_seq
        for name, spec in (req.topics or {}).items():
            wanted[name] = None if spec.tail else spec.from_seq
        if not wanted:
            raise InvalidRequest("subscribe names no topic: give topic or topics")
        for name in wanted:
            check_topic_name(name)
        p.require("read", *wanted)
        total = len(conn.subs.keys() | wanted.keys())
        if total > self.max_subs:
            raise InvalidRequest(
                f"at most {self.max_subs} subscriptions per connection",
                {"field": "topics", "max": self.max_subs},
            )
        engine = self.ref.engine
        for name in wanted:
            await engine.sync_topic(name)
        chosen = _resolve(engine, wanted, req.lenient)
        proto = self.cfg.protocol
        node = req.node
        opts = WatchOptions(
            None if node is None else frozenset([node] if isinstance(node, str) else node),
            min(req.limit or proto.max_limit, proto.max_limit),
            min(req.max_batch_bytes or proto.default_max_batch_bytes, proto.max_batch_bytes),
            req.include_meta,
            req.include_tags,
            req.include_data,
            False,
            ws=True,
        )
        out: dict[str, JsonValue] = {}
        for topic, start in chosen:
            conn.unsubscribe(topic.name)  # nothing of a replaced subscription after the reply
            out[topic.name] = {
                "from_seq": start,
                "head_seq": topic.head_seq,
                "earliest_seq": topic.earliest_seq,
            }
        await conn.reply(message("subscribed", rid, {"topics": out}))
        if not conn.closed:
            for topic, start in chosen:
                conn.subscribe(topic, opts, start)

    def unsubscribe(self, conn: WsConn, rid: bytes, data: bytes) -> bytes:
        req = _decode(WS_UNSUBSCRIBE_DECODER, data)
        names = ([] if req.topic is None else [req.topic]) + (req.topics or [])
        if not names:
            raise InvalidRequest("unsubscribe names no topic: give topic or topics")
        names = list(dict.fromkeys(names))
        for name in names:
            conn.unsubscribe(name)  # unknown names are ignored
        return message("unsubscribed", rid, {"topics": cast("list[JsonValue]", names)})

    async def publish(self, p: Principal, rid: bytes, data: bytes) -> bytes:
        req = _decode(WS_PUBLISH_DECODER, data)
        topic = req.topic
        check_topic_name(topic)
        p.require("write", topic)
        if bytes(req.config) != b"null":
            p.require("admin", topic)  # any publish carrying config (README §2.3)
        scope: Scope = {"topicd.principal": p, "topicd.t0": perf_ms()}

        async def read() -> bytes:
            return data  # the command is the write body (its other keys are skipped)

        def header(name: str) -> str | None:
            return "application/json" if name.lower() == "content-type" else None

        def query(name: str, default: bool) -> bool:
            return req.return_seqs if name == "return_seqs" else default

        # client work, admitted like an HTTP write: a permit, or `429 client_waiters`
        permits = self.ref.permits
        permit = None
        if permits is not None:
            if permits.full():
                raise permits.refusal()
            permit = await permits.admit()
        token = ClientPermits.hold(permit)
        try:
            _, body = await write_records(
                self.ref, topic, scope, read, header, query, self.max_body
            )
        finally:
            ClientPermits.unhold(token)
            if permit is not None:
                permit.release()
        res = cast("dict[str, JsonValue]", orjson.loads(body))
        res.setdefault("seqs", None)  # `null` when return_seqs is false
        fields: dict[str, JsonValue] = {
            k: res[k]
            for k in (
                "topic",
                "first_seq",
                "last_seq",
                "seqs",
                "head_seq",
                "count",
                "created",
                "deduped",
                "performance",
            )
        }
        return message("ack", rid, fields)


def _request_id(data: bytes) -> bytes:
    """The message's `request_id` JSON text, or `null` (not an object, or none)."""
    try:
        return bytes(WS_REQUEST_ID_DECODER.decode(data).request_id)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return b"null"


def _decode(decoder: msgspec.json.Decoder[_T], data: bytes) -> _T:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidRequest(f"invalid command: {exc}") from None


def _resolve(
    engine: Engine, wanted: dict[str, int | None], lenient: bool
) -> list[tuple[Topic, int]]:
    """(topic, start position) per wanted name, in order, as `POST /v0/watch` resolves
    them: unknown ⇒ `topic_not_found` unless `lenient` (then left out); `None` ⇒ the
    head (`tail`)."""
    out: list[tuple[Topic, int]] = []
    for name, start in wanted.items():
        topic = engine.topics.get(name)
        if topic is None or topic.deleting is not None:
            if lenient:
                continue
            raise TopicNotFound(name)
        engine.routers.catch_up(topic)
        engine.enforce(topic)
        out.append((topic, topic.head_seq if start is None else start))
    return out


def _direct_writer(stream: trio.SocketStream) -> Callable[[bytes], bytes | None]:
    """A non-blocking write of a complete frame to the socket (for the drain, which is
    synchronous): returns what the socket did not take, None when it is broken."""
    sock = raw_socket(stream)

    def try_send(data: bytes) -> bytes | None:
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            return None
        return data[sent:]

    return try_send
