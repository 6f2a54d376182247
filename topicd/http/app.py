"""The Quart-Trio application and the ASGI gate in front of it.

`create_app()` builds the app: routes from `http.topics` and `http.ops`, one error handler
that renders every `TopicdError` (and Quart/Werkzeug's own 404/405/413) as the canonical
error body, and `Gate`, a small ASGI middleware that runs before Quart for every request:

1. lifecycle: while starting every route but the probes and metrics answers
   `503 not_ready`; while draining, `503 shutting_down` (api-ops §2, §6.2);
2. authentication: resolves the bearer key to a `Principal` (`401` when auth is on and
   the key is missing or unknown; probes are exempt unless `probe_auth`);
3. per-key in-flight cap (`429 {limit:"max_inflight_per_key"}`, auth on only; with
   several jetstream fronts, the deployment's count: `request_slots`, `topicd.engine.slots`);
4. stamps `X-Topicd-Pressure` on every response (README §6);
5. counts in-flight requests for the graceful drain and writes the optional access log.

Hot endpoints (`FastRoutes`, today `POST /v0/topics/:topic` without a query string) are
then served by the gate itself, without the framework's per-request machinery; their one
implementation is shared with the Quart route (`topics.write_records`).

Handlers only validate the wire shape, call the engine and render (STYLE §1).
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Final, TypeVar, cast
from urllib.parse import unquote

import msgspec
import orjson
import trio
from quart import Response, has_request_context, has_websocket_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.exceptions import MethodNotAllowed as WzMethodNotAllowed

from topicd.clock import perf_ms
from topicd.errors import (
    Internal,
    InvalidRequest,
    JsonValue,
    MethodNotAllowed,
    NotFound,
    NotReady,
    PayloadTooLarge,
    ShuttingDown,
    Throttled,
    TopicdError,
    Unauthorized,
    UnsupportedMediaType,
)
from topicd.http.auth import DEV_PRINCIPAL, KeyStore, Principal
from topicd.http.compress import Compressor
from topicd.lifecycle import Lifecycle, Phase
from topicd.sched.classes import ClientPermits, Permit
from topicd.sched.governor import admission_signal
from topicd.wire import check_topic_name

if TYPE_CHECKING:
    from topicd.config import Config
    from topicd.engine.engine import Engine
    from topicd.engine.slots import ConnectionSlots, Slot
    from topicd.http.dashboard import DashboardHub
    from topicd.http.idle import IdleConnections
    from topicd.http.watch import WatchStreams
    from topicd.http.work import WorkStreams
    from topicd.sched.sojourn import Sojourns

_T = TypeVar("_T")

log = logging.getLogger("topicd.http")
access_log = logging.getLogger("topicd.access")

Scope = MutableMapping[str, object]
Message = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# a WebSocket upgrade on the direct path: (socket stream, head, bytes after it) -> served?
Upgrade = Callable[[trio.abc.Stream, bytes, bytes], Awaitable[bool]]
ReadBody = Callable[[], Awaitable[bytes]]
# a hot endpoint served by the gate without the framework: (scope, its body) ->
# (status, JSON body); raises `TopicdError` for the canonical error answer
FastHandler = Callable[[Scope, ReadBody], Awaitable[tuple[int, bytes]]]
FastRoutes = Callable[[Scope], FastHandler | None]
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]  # (status, headers, body)
# a hot endpoint's whole answer from the request's scope and the body that came with its
# head, or None when the request is not one (`Gate.serve_direct`)
DirectAnswer = Callable[[Scope, bytes], Awaitable[Answer | None]]

PROBE_PATHS: Final = frozenset({"/v0/health", "/healthz", "/v0/ready", "/readyz"})
METRICS_PATH: Final = "/v0/metrics"
WS_PATH: Final = "/v0/ws"
CONTROL_PATHS: Final = PROBE_PATHS | {METRICS_PATH}  # control work: no client permit (R1)
JSON: Final = "application/json"


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------


def error_parts(err: TopicdError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) of the canonical error body for `err`."""
    body = orjson.dumps(err.body())
    headers = [(b"content-type", b"application/json")]
    retry = err.retry_after_s()
    if retry is not None:
        headers.append((b"retry-after", str(retry).encode()))
    for name, value in err.extra_headers().items():
        headers.append((name.lower().encode(), value.encode()))
    return err.http_status, headers, body


def _server_total_ms(scope: Scope) -> float:
    t0 = scope.get("topicd.t0")
    return round(perf_ms() - t0, 3) if isinstance(t0, float) else 0.0


def performance(
    extra: dict[str, JsonValue] | None = None, scope: Scope | None = None
) -> dict[str, JsonValue]:
    """The `performance` block (README §9) for `scope` (default: the Quart request's)."""
    current = cast("Scope", request.scope) if scope is None else scope
    block: dict[str, JsonValue] = {"server_total_ms": _server_total_ms(current)}
    if extra:
        block.update(extra)
    return block


def performance_json(scope: Scope, tail: bytes = b"") -> bytes:
    """`orjson.dumps(performance(extra, scope))` formatted directly, without the dict:
    `tail` is the JSON of the extra keys, each as `,"key":value` (the queue answers,
    made for every claim and ack)."""
    return b'{"server_total_ms":%b%b}' % (orjson.dumps(_server_total_ms(scope)), tail)


def json_response(
    payload: dict[str, JsonValue], status: int = 200, perf: dict[str, JsonValue] | None = None
) -> Response:
    payload["performance"] = performance(perf)
    return Response(orjson.dumps(payload), status=status, content_type=JSON)


def raw_json_response(body: bytes, status: int = 200) -> Response:
    return Response(body, status=status, content_type=JSON)


def scope_header(scope: Scope) -> Callable[[str], str | None]:
    """A case-insensitive request-header lookup over an ASGI scope's raw headers."""
    headers = cast("list[tuple[bytes, bytes]]", scope["headers"])

    def header(name: str) -> str | None:
        key = name.lower().encode("latin-1")
        for k, v in headers:
            if k == key:
                return v.decode("latin-1")
        return None

    return header


async def quart_body() -> bytes:
    """The Quart request's raw body (a `ReadBody` for the shared handlers)."""
    data = await request.get_data(cache=False)
    assert isinstance(data, bytes)
    return data


_NO_QUERIES: Final[Mapping[bytes, object]] = {}


def topic_post(
    scope: Scope, queries: Mapping[bytes, object] = _NO_QUERIES
) -> tuple[str, str] | None:
    """(topic, verb) of a `POST /v0/topics/:topic[/verb]` without a query string, or
    with one of `queries` exactly (`verb` "" for the topic itself), the shape every fast
    route has; None for anything else (another query goes through Quart, whose query
    parsing is the contract)."""
    if scope.get("method") != "POST":
        return None
    qs = scope.get("query_string")
    if qs and qs not in queries:
        return None
    path = cast("str", scope["path"])
    if not path.startswith("/v0/topics/"):
        return None
    topic, _, verb = path[len("/v0/topics/") :].partition("/")
    if not topic or "/" in verb:
        return None  # (an encoded slash in the name: Quart's 400)
    return topic, verb


def any_route(*tables: FastRoutes) -> FastRoutes:
    """The first table's handler for a scope, trying each in order."""

    def route(scope: Scope) -> FastHandler | None:
        for table in tables:
            handler = table(scope)
            if handler is not None:
                return handler
        return None

    return route


def principal(scope: Scope | None = None) -> Principal:
    """The request's principal (set by the gate); `scope` default: the Quart request's."""
    p = (request.scope if scope is None else scope).get("topicd.principal")
    return p if isinstance(p, Principal) else DEV_PRINCIPAL


# --------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------

_JSON_CT: Final = re.compile(r"\s*application/json\s*(;.*)?$", re.IGNORECASE)


def _is_json(content_type: str | None) -> bool:
    if content_type == JSON:  # (what nearly every client sends: no pattern match)
        return True
    return content_type is not None and _JSON_CT.match(content_type) is not None


async def read_body(*, empty_ok: bool, max_bytes: int) -> bytes | None:
    """The Quart request's body, checked by `check_body`."""
    body = await request.get_data(cache=False)
    assert isinstance(body, bytes)
    return check_body(body, request.headers.get, empty_ok=empty_ok, max_bytes=max_bytes)


def check_body(
    body: bytes, header: Callable[[str], str | None], *, empty_ok: bool, max_bytes: int
) -> bytes | None:
    """The request body as validated UTF-8 JSON bytes (README §3); `header` looks up a
    request header by name (case-insensitive).

    Returns None for an empty body when `empty_ok`. Raises `415` for a missing or wrong
    content type, `413` beyond `max_bytes` (also after gzip decoding) and `400` for an
    empty body where one is required or for bytes that are not UTF-8.
    """
    ctype = header("Content-Type")
    encoding = (header("Content-Encoding") or "").strip().lower()
    if encoding and encoding != "identity":
        if encoding not in ("gzip", "x-gzip"):
            raise UnsupportedMediaType(
                f"Content-Encoding {encoding!r} is not supported (use gzip or none)"
            )
        body = _gunzip(body, max_bytes)
    if not body:
        if empty_ok:
            return None
        if not _is_json(ctype):
            raise UnsupportedMediaType(
                "this endpoint needs a JSON body (Content-Type: application/json)"
            )
        raise InvalidRequest("the request body is empty")
    if not _is_json(ctype):
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {ctype!r}"
            if ctype
            else "Content-Type: application/json is required"
        )
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"body is not valid UTF-8 (byte {exc.start})") from None
    return body


def _gunzip(body: bytes, max_bytes: int) -> bytes:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, max_bytes + 1)
    except zlib.error:
        raise InvalidRequest("body is not valid gzip") from None
    if len(out) > max_bytes or d.unconsumed_tail:
        raise PayloadTooLarge(f"decoded body exceeds max_body_bytes {max_bytes}")
    if not d.eof:
        raise InvalidRequest("body is truncated gzip")
    return out


def decode(decoder: msgspec.json.Decoder[_T], body: bytes) -> _T:
    """Decode with a typed decoder; malformed JSON and type errors become `400`."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"malformed JSON: {exc}") from None
    except UnicodeDecodeError:
        raise InvalidRequest("body is not valid UTF-8") from None


_TRUE: Final = frozenset({"true", "1"})
_FALSE: Final = frozenset({"false", "0"})


def query_bool(name: str, default: bool) -> bool:
    """A boolean query parameter: `true`/`1` or `false`/`0`, case-insensitive; absent
    means `default`. Any other value (the empty one included) raises `400
    invalid_request` naming the parameter, so a typo never silently picks the default
    (`if_empty=yes` must not delete a non-empty topic)."""
    if not request.query_string:  # skip parsing an empty query string (hot write path)
        return default
    value = request.args.get(name)
    if value is None:
        return default
    folded = value.lower()
    if folded in _TRUE:
        return True
    if folded in _FALSE:
        return False
    raise InvalidRequest(
        f"query parameter {name!r} must be true, false, 1 or 0, got {value[:100]!r}",
        {"parameter": name},
    )


# --------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------

_TOPIC_PATH: Final = re.compile(r"^/v0/topics/([^/]+)(?:/|$)")
_TOPIC_ACTIONS: Final = frozenset({b"diff", b"delete"})  # /v0/topics/:topic/<action>
_TEMPLATES: Final = (
    (re.compile(r"^/v0/topics/[^/]+/(diff|delete)$"), "/v0/topics/:topic/{}"),
    (re.compile(r"^/v0/topics/[^/]+/(claim|ack|nack|extend|work)$"), "/v0/topics/:q/{}"),
    (re.compile(r"^/v0/topics/[^/]+$"), "/v0/topics/:topic"),
    (re.compile(r"^/v0/watch/[^/]+$"), "/v0/watch/:wid"),
)


def path_template(path: str) -> str:
    """The path with names replaced by placeholders (access logs never carry names)."""
    for pattern, template in _TEMPLATES:
        m = pattern.match(path)
        if m:
            return template.format(*m.groups())
    return path if len(path) < 64 else path[:64] + "…"


class Gate:
    """ASGI middleware in front of the Quart app (see module docstring)."""

    def __init__(
        self,
        app: AsgiApp,
        *,
        lifecycle: Lifecycle,
        keys: KeyStore,
        config: Config,
        pressure: Callable[[], float],
        on_error: Callable[[TopicdError], None] | None = None,
        streams: WatchStreams | None = None,
        permits: ClientPermits | None = None,
        probe: Callable[[str], Awaitable[dict[str, JsonValue]]] | None = None,
        requests_by_path: dict[str, int] | None = None,
        work: WorkStreams | None = None,
        fast_routes: FastRoutes | None = None,
        compressor: Compressor | None = None,
        dashboard: DashboardHub | None = None,
        sojourns: Callable[[], Sojourns] | None = None,
    ) -> None:
        self.app = app
        # the tracker each write served directly begins and ends in (governor s6)
        self.sojourns = sojourns
        self.compressor = compressor
        self.work = work
        self.dashboard = dashboard
        # control work (scheduler spec R1): no client permit
        self.control_paths = CONTROL_PATHS | (
            dashboard.control_paths() if dashboard is not None else frozenset()
        )
        self.fast_routes = fast_routes
        self.max_body = config.limits.max_body_bytes
        self.body_timeout = max(1, config.server.header_read_timeout_ms // 1000)  # as Quart's
        self.requests_by_path = requests_by_path if requests_by_path is not None else {}
        self.permits = permits
        self.probe = probe
        self.streams = streams
        self.on_error = on_error
        self.lifecycle = lifecycle
        self.keys = keys
        self.probe_auth = config.auth.probe_auth
        self.http2 = config.server.http2
        self.max_inflight = config.limits.max_inflight_per_key
        self.access = config.logging.access_log
        self.pressure = pressure
        self._inflight: dict[str, int] = {}
        # the deployment's in-flight count when several processes serve it (the engine's
        # `watch.slots`, auth on and the cap on; set by `create_app`): None, this gate's
        self.request_slots: ConnectionSlots | None = None
        # `GET /v0/ws` upgrades on the direct socket path (`topicd.http.ws`); set by
        # `create_app`
        self.ws_upgrade: Upgrade | None = None
        self.ws_asgi: AsgiApp | None = None  # the same, when the handshake reaches Hypercorn
        # silent HTTP/1.1 connections held without a task (set by `server.serve`)
        self.idle: IdleConnections | None = None

    async def _answer_probe(self, path: str, t0: float, send: Send) -> None:
        """A probe answered here, without the framework (control work, scheduler spec R1)."""
        assert self.probe is not None
        try:
            payload = await self.probe(path)
        except TopicdError as err:
            if self.on_error is not None:
                self.on_error(err)
            await send_error(send, err)
            return
        payload["performance"] = {"server_total_ms": round(perf_ms() - t0, 3)}
        body = orjson.dumps(payload)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", JSON.encode()),
                    (b"content-length", b"%d" % len(body)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def pressure_header(self) -> bytes:
        """The `X-Topicd-Pressure` value (README §6), clamped to [0, 1]."""
        return b"%.3f" % min(max(self.pressure(), 0.0), 1.0)

    def quick_refusal(
        self, path: str | None = None
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """(status, headers, body) of a `429 client_waiters` for a client request that
        arrives while every permit and waiter slot is taken, decided before the request is
        parsed (the cheap refusal of scheduler spec B.5); None when only the full gate may
        answer (authentication on: a `401` comes first; not serving: `503` does; control
        work such as the dashboard at `path` takes no permit)."""
        permits = self.permits
        if (
            permits is None
            or (path is not None and path in self.control_paths)
            or self.keys.enabled
            or self.lifecycle.phase.value is not Phase.SERVING
            or not permits.full()
        ):
            return None
        err = permits.refusal()
        if self.on_error is not None:
            self.on_error(err)
        status, headers, body = error_parts(err)
        headers.append((b"content-length", b"%d" % len(body)))
        headers.append((b"x-topicd-pressure", self.pressure_header()))
        if self.access:
            access_log.info("%s %s %d %.2fms", "-", "-", status, 0.0)
        return status, headers, body

    def is_stream(self, scope: Scope) -> bool:
        """Whether this request opens an SSE stream (the direct socket path may serve it)."""
        if self.work is not None and self.work.topic_of(scope) is not None:
            return True
        if self.dashboard is not None and self.dashboard.is_feed(scope):
            return True
        return self.streams is not None and self.streams.wid_of(scope) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http":
            if kind == "websocket" and self.ws_asgi is not None and scope.get("path") == WS_PATH:
                await self.ws_asgi(scope, receive, send)
            elif kind == "websocket":
                await self._refuse_websocket(scope, receive, send)
            else:
                await self.app(scope, receive, send)  # the lifespan
            return
        t0 = perf_ms()
        scope["topicd.t0"] = t0
        by_path = self.requests_by_path
        served_by = "direct" if scope.get("topicd.direct") else "hypercorn"
        by_path[served_by] = by_path.get(served_by, 0) + 1
        path = cast("str", scope["path"])
        status_box = [0]

        async def send_stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(cast("list[tuple[bytes, bytes]]", message.get("headers", [])))
                # the pressure as the answer starts, not as the request came in: a write
                # that waited for its commit must not report the pressure it found then
                # (a client paces on this value, stamped with the time it arrives)
                headers.append((b"x-topicd-pressure", self.pressure_header()))
                message["headers"] = headers
                status_box[0] = cast("int", message["status"])
            await send(message)

        lifecycle = self.lifecycle
        lifecycle.request_started()
        key_id: str | None = None
        slot: Slot | None = None
        permit: Permit | None = None
        wid = None if self.streams is None else self.streams.wid_of(scope)
        queue = None if self.work is None else self.work.topic_of(scope)
        feed = self.dashboard is not None and self.dashboard.is_feed(scope)
        try:
            if served_by == "hypercorn" and _framing_conflict(scope):
                # RFC 9112 §6.1: answer, then close. (The direct path refuses these before
                # a hand-off; this is a request Hypercorn parsed after one, or with the
                # direct path off. h11 frames the body by `transfer-encoding` and would
                # read on; `connection: close` in the answer makes Hypercorn close.)
                # (the body is read first: Hypercorn closes a `connection: close` answer
                # from its reader too when more bytes come while the answer is going out)
                await self._drop_body(receive)
                conflict = InvalidRequest("both Content-Length and Transfer-Encoding")
                if self.on_error is not None:
                    self.on_error(conflict)
                await send_error(send_stamped, conflict, close=True)
                return
            if feed or queue is not None:
                # the dashboard feed or a `/work` stream: each authenticates itself
                # (`?token=`) and takes no in-flight slot
                err = self._admit(scope, path, authenticate=False)
                if err is None:
                    try:
                        if feed:
                            assert self.dashboard is not None
                            await self.dashboard(scope, receive, send_stamped)
                        else:
                            assert self.work is not None
                            assert queue is not None
                            await self.work(scope, receive, send_stamped, queue)
                        return
                    except TopicdError as refused:
                        if status_box[0]:
                            raise  # (never: refusals come before the answer starts)
                        err = refused
                if self.on_error is not None:
                    self.on_error(err)
                await send_error(send_stamped, err)
                return
            if wid is not None:
                # an SSE stream: it authenticates itself (404 before 401) and is exempt
                # from the in-flight cap (streams have their own caps)
                assert self.streams is not None
                err = self._admit(scope, path, authenticate=False)
                if err is None:
                    await self.streams(scope, receive, send_stamped, wid)
                    return
                if self.on_error is not None:
                    self.on_error(err)
                await send_error(send_stamped, err)
                return
            err = self._admit(scope, path)
            if (
                err is None
                and self.probe is not None
                and path in PROBE_PATHS
                and scope.get("method") == "GET"
            ):
                await self._answer_probe(path, t0, send_stamped)
                return
            if err is None:
                if self.request_slots is None:
                    key_id, err = self._take_key(scope, path)
                else:
                    slot, err = await self._take_request_slot(scope, path)
            if err is None:
                permit, err = await self._take_permit(path)
            if err is not None:
                if self.on_error is not None:
                    self.on_error(err)
                await send_error(send_stamped, err)
            else:
                fast = None if self.fast_routes is None else self.fast_routes(scope)
                token = ClientPermits.hold(permit)
                try:
                    if fast is None:
                        await self.app(scope, receive, send_stamped)
                    else:

                        async def read() -> bytes:
                            return await self._read_body(scope, receive)

                        answer = await self._fast_answer(fast, scope, read)
                        if answer is not None:
                            status, headers, body = answer
                            await send_stamped(
                                {
                                    "type": "http.response.start",
                                    "status": status,
                                    "headers": headers,
                                }
                            )
                            await send_stamped({"type": "http.response.body", "body": body})
                finally:
                    ClientPermits.unhold(token)
        except Exception:
            if status_box[0]:
                raise  # the answer is under way: the server closes the connection
            # a bug: the framework renders its own; this is one in the gate or a stream
            log.exception("unhandled error on %s %s", scope.get("method"), path_template(path))
            await send_error(send_stamped, Internal("internal error (a bug; see the server log)"))
        finally:
            self._release(permit, key_id, slot)
            lifecycle.request_finished()
            if self.access:
                self._log_access(scope, path, status_box[0], t0)

    async def serve_direct(self, scope: Scope, body: bytes) -> Answer | None:
        """A hot endpoint (`fast_routes`) on the direct socket path, whose body arrived
        with its head: (status, headers, body) of the whole answer, pressure header
        included; None when `scope` is not a hot endpoint (the caller runs the ASGI
        exchange instead). The steps are `__call__`'s for a client request, through the
        same helpers (lifecycle, authentication, in-flight cap, client permit, the one
        handler and its rendering, the pressure header as the answer is made, the access
        log), without an ASGI message, a send callback or an exchange object."""
        fast = None if self.fast_routes is None else self.fast_routes(scope)
        if fast is None:
            return None
        t0 = perf_ms()
        scope["topicd.t0"] = t0
        by_path = self.requests_by_path
        by_path["direct"] = by_path.get("direct", 0) + 1
        path = cast("str", scope["path"])
        lifecycle = self.lifecycle
        lifecycle.request_started()
        key_id: str | None = None
        slot: Slot | None = None
        permit: Permit | None = None
        answer: Answer | None = None
        in_hand_at = scope.get("topicd.in_hand_at")
        soj = (
            self.sojourns()
            if self.sojourns is not None and in_hand_at is not None and scope.get("topicd.sojourn")
            else None
        )
        ticket = soj.begin() if soj is not None else 0
        try:
            err = self._admit(scope, path)
            if err is None:
                if self.request_slots is None:
                    key_id, err = self._take_key(scope, path)
                else:
                    slot, err = await self._take_request_slot(scope, path)
            if err is None:
                permit, err = await self._take_permit(path)
            if err is not None:
                if self.on_error is not None:
                    self.on_error(err)
                answer = error_answer(err)
            else:
                token = ClientPermits.hold(permit)
                try:

                    async def read() -> bytes:
                        if len(body) > self.max_body:
                            raise self._too_large()
                        return body

                    answer = await self._fast_answer(fast, scope, read)
                finally:
                    ClientPermits.unhold(token)
                assert answer is not None  # (`read` never finds the client gone)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), path_template(path))
            answer = error_answer(Internal("internal error (a bug; see the server log)"))
        finally:
            self._release(permit, key_id, slot)
            lifecycle.request_finished()
            if soj is not None:
                # (recorded when served, not refused on its way in)
                served = answer is not None and answer[0] < 300
                soj.end(ticket, cast("float", in_hand_at), trio.current_time(), served)
        assert answer is not None
        status, headers, out = answer
        # (the pressure as the answer is made, as `__call__`'s `send_stamped` stamps it)
        headers.append((b"x-topicd-pressure", self.pressure_header()))
        if self.access:
            self._log_access(scope, path, status, t0)
        return status, headers, out

    def _take_key(self, scope: Scope, path: str) -> tuple[str | None, TopicdError | None]:
        """An admitted request's slot under its key's in-flight cap (auth on only):
        (the key now holding one more slot, or None; the `429` when the key is at its
        cap)."""
        if not (self.keys.enabled and self.max_inflight) or path in PROBE_PATHS:
            return None, None
        p = scope["topicd.principal"]
        assert isinstance(p, Principal)
        count = self._inflight.get(p.key_id, 0)
        if count >= self.max_inflight:
            return None, Throttled.limit("max_inflight_per_key", self.max_inflight)
        self._inflight[p.key_id] = count + 1
        return p.key_id, None

    async def _take_request_slot(
        self, scope: Scope, path: str
    ) -> tuple[Slot | None, TopicdError | None]:
        """`_take_key` when the deployment's count decides (`request_slots`): (the
        request's slot, or None; the `429` at the key's cap, or `503` when the count
        cannot be reached)."""
        slots = self.request_slots
        assert slots is not None
        if path in PROBE_PATHS:
            await trio.lowlevel.checkpoint()
            return None, None
        p = scope["topicd.principal"]
        assert isinstance(p, Principal)
        try:
            return await slots.acquire_request(p.key_id), None
        except TopicdError as err:
            return None, err

    async def _take_permit(self, path: str) -> tuple[Permit | None, TopicdError | None]:
        """A client permit for client work (scheduler spec R1; control work takes none):
        (the permit, or None; the `429 client_waiters` when every permit and waiter slot
        is taken)."""
        permits = self.permits
        if permits is None or path in self.control_paths:
            return None, None
        if permits.full():
            return None, permits.refusal()
        return await permits.admit(), None

    def _release(self, permit: Permit | None, key_id: str | None, slot: Slot | None) -> None:
        """Give back what `_take_permit` and `_take_key` (or `_take_request_slot`) took."""
        if permit is not None:
            permit.release()
        if slot is not None:
            assert self.request_slots is not None
            self.request_slots.release_request(slot)
        if key_id is not None:
            left = self._inflight[key_id] - 1
            if left:
                self._inflight[key_id] = left
            else:
                del self._inflight[key_id]

    def _log_access(self, scope: Scope, path: str, status: int, t0: float) -> None:
        access_log.info(
            "%s %s %d %.2fms", scope.get("method"), path_template(path), status, perf_ms() - t0
        )

    def _handler_error(self, err: TopicdError) -> Answer:
        """A handler's error as the canonical error answer, counted: `content-length`
        second, as the framework lays out its answers."""
        if self.on_error is not None:
            self.on_error(err)
        status, headers, body = error_parts(err)
        headers.insert(1, (b"content-length", b"%d" % len(body)))
        return status, headers, body

    async def _fast_answer(
        self, handler: FastHandler, scope: Scope, read: ReadBody
    ) -> Answer | None:
        """A hot endpoint's answer without the framework (no request/response objects,
        context locals or app task): (status, headers, body), laid out as the framework
        lays it out (`content-type`, `content-length`, then an error's own headers);
        None when the client left before its body arrived (nothing to answer)."""
        try:
            status, body = await handler(scope, read)
        except _ClientGone:
            return None
        except TopicdError as err:
            return self._handler_error(err)
        headers = [(b"content-type", b"application/json")]
        compressor = self.compressor
        if compressor is not None and len(body) >= compressor.min_bytes:
            # a large answer (a claim of many jobs, the seqs of a big write)
            headers.append((b"vary", b"Accept-Encoding"))
            accept = _header(scope, b"accept-encoding")
            # (without the header nothing is encoded: no call for it)
            encoded = None if accept is None else await compressor.encode(body, accept)
            if encoded is not None:
                body = encoded
                headers.append((b"content-encoding", b"gzip"))
        headers.insert(1, (b"content-length", b"%d" % len(body)))
        return status, headers, body

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole request body, bounded as the framework bounds it: `413` beyond
        `limits.max_body_bytes` (declared or received), `400` when it does not arrive
        within the body timeout."""
        take = scope.get("topicd.take_body")
        body = None if take is None else cast("Callable[[], bytes | None]", take)()
        if body is not None:  # the direct path read it with the head: no wait, no message
            if len(body) > self.max_body:
                raise self._too_large()
            return body
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise self._too_large()
        parts: list[bytes] = []
        size = 0
        with trio.move_on_after(self.body_timeout):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    raise _ClientGone
                chunk = cast("bytes", message.get("body", b""))
                size += len(chunk)
                if size > self.max_body:
                    raise self._too_large()
                parts.append(chunk)
                if not message.get("more_body", False):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
        raise InvalidRequest("the request body did not arrive in time")

    async def _drop_body(self, receive: Receive) -> None:
        """Read and drop the request body, bounded by `limits.max_body_bytes` and the body
        timeout (beyond either, the caller answers anyway)."""
        size = 0
        with trio.move_on_after(self.body_timeout):
            while size <= self.max_body:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                size += len(cast("bytes", message.get("body", b"")))

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body exceeds max_body_bytes {self.max_body}")

    async def _refuse_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`404 not_found` for a WebSocket handshake to any path but `/v0/ws`. Sent as
        the HTTP answer to the handshake (ASGI's websocket denial response), with the
        canonical body and the pressure header, without the framework."""
        t0 = perf_ms()
        path = cast("str", scope.get("path", ""))
        message = await receive()
        if message["type"] != "websocket.connect":
            return  # the client left
        err = NotFound(f"no WebSocket endpoint at {path_template(path)}")
        extensions = cast("dict[str, object]", scope.get("extensions") or {})
        if "websocket.http.response" not in extensions:
            await send({"type": "websocket.close", "code": 1008})  # the server's own 403
            return
        status, headers, body = error_parts(err)
        headers.append((b"content-length", b"%d" % len(body)))
        headers.append((b"x-topicd-pressure", self.pressure_header()))
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
        if self.access:
            access_log.info("GET %s %d %.2fms", path_template(path), status, perf_ms() - t0)

    def admit(self, scope: Scope, path: str) -> TopicdError | None:
        """The gate's admission of a request it does not run itself (a WebSocket
        handshake on the direct path): lifecycle phase, then authentication."""
        return self._admit(scope, path)

    def _admit(self, scope: Scope, path: str, *, authenticate: bool = True) -> TopicdError | None:
        probe = path in PROBE_PATHS
        if not self.http2 and scope.get("http_version") == "2":
            return InvalidRequest("HTTP/2 is disabled on this server (server.http2 = false)")
        phase = self.lifecycle.phase.value
        if phase is not Phase.SERVING and not probe and path != METRICS_PATH:
            if phase is Phase.STARTING:
                return NotReady(
                    "recovery in progress",
                    {"replay_progress": round(self.lifecycle.replay_progress, 4)},
                )
            return ShuttingDown("the server is shutting down")
        if not authenticate:
            return None
        if self.keys.enabled and (not probe or self.probe_auth):
            auth = _header(scope, b"authorization")
            p = self.keys.authenticate(auth)
            if p is None:
                return Unauthorized(
                    "missing bearer key" if auth is None else "unknown or malformed bearer key"
                )
            scope["topicd.principal"] = p
        else:
            scope["topicd.principal"] = DEV_PRINCIPAL
        return None


class _ClientGone(Exception):
    """The client left before its request body arrived: nothing to answer."""


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in cast("list[tuple[bytes, bytes]]", scope.get("headers", [])):
        if key == name:
            return value.decode("latin-1")
    return None


def _framing_conflict(scope: Scope) -> bool:
    """Whether a request carries both `content-length` and `transfer-encoding`."""
    names = {key for key, _ in cast("list[tuple[bytes, bytes]]", scope.get("headers", []))}
    return b"content-length" in names and b"transfer-encoding" in names


def error_answer(err: TopicdError, *, close: bool = False) -> Answer:
    """The gate's own canonical error answer (a refusal, or a bug outside a handler):
    (status, headers, body), `content-length` after the error's headers."""
    status, headers, body = error_parts(err)
    headers.append((b"content-length", str(len(body)).encode()))
    if close:
        headers.append((b"connection", b"close"))
    return status, headers, body


async def send_error(send: Send, err: TopicdError, *, close: bool = False) -> None:
    status, headers, body = error_answer(err, close=close)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------


def _count(ref: EngineRef, err: TopicdError) -> None:
    if isinstance(err, Throttled):
        counts = ref.engine.throttled
        counts[err.cause_label] = counts.get(err.cause_label, 0) + 1


def _method_and_path() -> tuple[str, str]:
    """The current request's method and path, also outside a request context (a
    WebSocket handshake that reached the framework has a websocket context instead)."""
    if has_request_context():
        return request.method, request.path
    if has_websocket_context():
        return "GET", websocket.path
    return "-", "-"


def _slashed_topic_name(raw: object) -> str | None:
    """From a request's `raw_path`: the topic name of a topic route whose name segment
    holds an encoded slash (`/v0/topics/a%2Fb`, `/v0/topics/a%2Fb/diff`). The decoded
    path matches no route, yet the client named a topic, which is `400`, not `404`.
    None otherwise."""
    if not isinstance(raw, bytes) or not raw.startswith(b"/v0/topics/"):
        return None
    segments = raw[len(b"/v0/topics/") :].split(b"/")
    if len(segments) > 2 or (len(segments) == 2 and segments[1] not in _TOPIC_ACTIONS):
        return None
    name = unquote(segments[0].decode("latin-1"))
    return name if "/" in name else None


def _render_error(err: TopicdError) -> Response:
    status, headers, body = error_parts(err)
    resp = Response(body, status=status, content_type=JSON)
    for name, value in headers[1:]:
        resp.headers[name.decode()] = value.decode()
    return resp


class EngineRef:
    """The engine the routes use. The daemon serves probes while recovery runs and swaps
    the recovered engine in before the phase turns SERVING (until then the gate answers
    every other route `503 not_ready`, so no handler touches the placeholder)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.permits: ClientPermits | None = None  # create_app's (metrics read them)
        self.dashboard: DashboardHub | None = None  # create_app's (metrics read its drops)
        # requests the gate saw, by server path: "direct" (topicd's socket loop) or
        # "hypercorn"; the gate counts into this dict, metrics read it
        self.requests_by_path: dict[str, int] = {"direct": 0, "hypercorn": 0}
        # run on each engine swapped in (what a route module sets on the engine itself)
        self.on_engine: list[Callable[[Engine], None]] = []

    @property
    def engine(self) -> Engine:
        return self._engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self._engine = engine
        self.register_permits()
        for attach in self.on_engine:
            attach(engine)

    def register_permits(self) -> None:
        """The client-permit queues in the engine's saturation registry (R4)."""
        permits = self.permits
        if permits is None:
            return
        st = permits.stats
        reg = self._engine.saturation
        reg.register("client_permits", lambda: st.in_use, lambda: st.capacity)
        self._engine.admission = lambda now: (  # governor signal s4
            permits.waited_area(now),
            st.rejected,
            st.capacity,
            permits.max_waiters,
        )
        gov = self._engine.cfg.governor
        if gov.admission_refuse_fill > 0 and gov.admission_waiters_per_permit > 0:
            # the room as it is, read by every answer's pressure (`Engine.pressure`)
            self._engine.admission_now = lambda: admission_signal(
                st.waiting, st.capacity, permits.max_waiters, gov
            )
        reg.register(
            "client_waiters",
            lambda: st.waiting,
            lambda: permits.max_waiters,
            full=lambda: st.rejected,
            peak=lambda: st.peak_waiting,
        )
        hub = self.dashboard
        if hub is not None:
            reg.register(
                "dashboard_viewers",
                lambda: len(hub.viewers),
                lambda: hub.cfg.max_viewers,
                full=lambda: hub.dropped,
            )


def create_app(
    engine: Engine | EngineRef, config: Config, lifecycle: Lifecycle, keys: KeyStore
) -> QuartTrio:
    """The full `/v0` application, gate included."""
    ref = engine if isinstance(engine, EngineRef) else EngineRef(engine)
    from topicd.http import dashboard, metrics, ops, queues, routers, topics, watch, work, ws

    app = QuartTrio("topicd")
    # no framework answer to OPTIONS: on a known path it is `405` with `Allow`, like any
    # other method the path does not serve (README §1)
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    # no redirect answers either: `//` in a path is no route (or a bad topic name), not a
    # `308` to the path with the slashes merged
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = config.limits.max_body_bytes
    app.config["BODY_TIMEOUT"] = max(1, config.server.header_read_timeout_ms // 1000)
    app.config["PROPAGATE_EXCEPTIONS"] = False
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["topicd"] = {"engine": ref, "config": config, "lifecycle": lifecycle}

    topics.register(app, ref, config)
    ws.register(app)
    queues.register(app, ref, config)
    routers.register(app, ref, config)
    ops.register(app, ref, config, lifecycle)
    metrics.register(app, ref, config, lifecycle)
    watch.register(app, ref, config, keys)
    hub: DashboardHub | None = None
    if config.dashboard.enabled:
        hub = dashboard.DashboardHub(ref, config, lifecycle, keys)
        dashboard.register(app, hub)
    ref.dashboard = hub

    compressor = Compressor()

    @app.after_request
    async def _compress(response: Response) -> Response:
        return await compressor.finish(response, request.headers.get("Accept-Encoding"))

    @app.errorhandler(TopicdError)
    async def _topicd_error(err: TopicdError) -> Response:
        _count(ref, err)
        return _render_error(err)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        method, path = _method_and_path()
        err: TopicdError
        if code == 404:
            raw = request.scope.get("raw_path") if has_request_context() else None
            name = _slashed_topic_name(raw)
            if name is not None:
                try:
                    check_topic_name(name)
                except InvalidRequest as bad:  # always: `/` is never part of a name
                    return _render_error(bad)
            err = NotFound(f"no route for {method} {path}")
        elif code == 405:
            # fail closed (README §2.3): other methods on a topic path need `write`
            m = _TOPIC_PATH.match(path)
            if m is not None:
                try:
                    principal().require("write", m.group(1))
                except TopicdError as denied:
                    return _render_error(denied)
            allow = list(cast("WzMethodNotAllowed", exc).valid_methods or [])
            err = MethodNotAllowed(f"{method} is not allowed on {path}", allow)
        elif code == 413:
            err = PayloadTooLarge(
                f"request body exceeds max_body_bytes {config.limits.max_body_bytes}"
            )
        elif code == 408:
            err = InvalidRequest("the request body did not arrive in time")
        elif 400 <= code < 500:
            err = InvalidRequest(exc.description or "bad request")
        else:
            err = Internal("internal error")
        return _render_error(err)

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        method, path = _method_and_path()
        log.exception("unhandled error on %s %s", method, path_template(path))
        return _render_error(Internal("internal error (a bug; see the server log)"))

    ref.permits = ClientPermits(
        config.classes.client_permits,
        config.classes.client_waiters,
        lambda: ref.engine.retry_hint_ms(),
        lambda: ref.engine.governor.overloaded,
    )
    ref.register_permits()
    app.asgi_app = Gate(  # type: ignore[assignment,method-assign]
        cast("AsgiApp", app.asgi_app),
        lifecycle=lifecycle,
        keys=keys,
        config=config,
        pressure=lambda: ref.engine.pressure,
        on_error=lambda err: _count(ref, err),
        streams=watch.WatchStreams(ref, config, keys),
        permits=ref.permits,
        probe=lambda path: ops.probe_answer(path, ref, config, lifecycle),
        requests_by_path=ref.requests_by_path,
        work=work.WorkStreams(ref, config, keys),
        fast_routes=any_route(topics.fast_routes(ref, config), queues.fast_routes(ref, config)),
        compressor=compressor,
        dashboard=hub,
        sojourns=lambda: ref.engine.sojourns,
    )
    gate = gate_of(app)
    if keys.enabled and config.limits.max_inflight_per_key:

        def count_requests(engine: Engine) -> None:
            # (the jetstream backend's deployment-wide count; None: the gate's own)
            gate.request_slots = engine.watch.slots

        count_requests(ref.engine)
        ref.on_engine.append(count_requests)
    endpoint = ws.WsEndpoint(
        ref,
        config,
        keys,
        lifecycle,
        admit=gate.admit,
        pressure=gate.pressure_header,
        on_error=lambda err: _count(ref, err),
    )
    gate.ws_upgrade = endpoint.upgrade
    gate.ws_asgi = endpoint.asgi
    return app


def gate_of(app: QuartTrio) -> Gate:
    """The gate `create_app` put in front of the app's ASGI entry."""
    gate = app.asgi_app
    assert isinstance(gate, Gate)
    return gate
