"""The HTTP server: Hypercorn's Trio worker, plus a direct socket path for HTTP/1.1.

`serve()` does what `hypercorn.trio.serve` does for one plain-TCP worker (bind, the ASGI
lifespan, one `TCPServer` per connection, graceful shutdown with
`graceful_timeout`), with one difference: each connection's request heads are looked at
before Hypercorn gets the connection, and plain HTTP/1.x requests are served **directly**:
a one-request ASGI exchange (`DirectExchange`) runs topicd's own ASGI entry
(`app.asgi_app`: the gate, then Quart, so admission, drain accounting, the pressure header,
the routes and the access log are the same as on the Hypercorn path) with a `receive`
that hands over the body already read and a `send` that writes the response straight to
the connection's trio socket stream.

* `GET /v0/watch/<wid>` and `GET /v0/topics/<q>/work` streams write the response head
  and then each pre-encoded SSE chunk in HTTP/1.1 chunked framing. This removes
  Hypercorn's per-chunk work (h11 events, its send lock and shielded scopes), which
  measured about half of a watch stream's per-frame CPU (docs/PERFORMANCE.md, "SSE fan-out").
* Probes (`GET /v0/health`, `/healthz`, `/v0/ready`, `/readyz`) are answered by the
  gate without the framework (scheduler spec R1: control work first).
* Every other plain request — no body, or a `content-length` body within
  `limits.max_body_bytes` — is read whole (head and body) and served on the same
  keep-alive loop (`server.direct_http1`, default on): Hypercorn's per-request machinery
  (its connection task, h11 events, the spawned app task and send lock) measured about
  half of a small request's round trip (docs/PERFORMANCE.md, "HTTP core"). A hot
  endpoint (`Gate.serve_direct`: writes, diffs, queue verbs) is answered by the gate
  without an ASGI exchange at all, and its answer written by `send_answer`.
* While every client permit and waiter slot is taken, a client request is answered `429
  client_waiters` from a glance at its head (`_refuse_unparsed`: no h11, no scope, no
  gate task, no framework; with authentication on, the gate decides, still without
  Quart); the connection stays for the next request.
* Every head is parsed by `topicd.http.head` (strict HTTP/1.1, no h11) before anything
  serves it. A head it refuses (malformed, an ambiguous body framing such as
  `Content-Length` with `Transfer-Encoding`) is answered `400` here and the connection
  closed, so nothing behind it runs; bytes that can never make a head (a TLS
  ClientHello, a bare LF) are refused as they arrive. A head over the bound is `431`.
* Anything else — h2c prior knowledge, an `Upgrade` (but `GET /v0/ws`, served by
  `upgrade`), `Transfer-Encoding: chunked`, `Expect`, a `HEAD`, another form of target
  or `HTTP/1.x` version, a body over the limit — goes to Hypercorn unchanged: the bytes
  already read are replayed to it first (`HypercornStream`), so it parses the connection
  from that request on (and keeps it).
  The same stream mends what Hypercorn writes: reason phrases on its status lines, and
  the canonical error answer in place of the bodiless ones it makes itself (a head h11
  refuses later on that connection).

`sse.direct_write = false` turns the direct path off (every request then goes through
Hypercorn); `server.direct_http1 = false` keeps it to streams and probes. Both paths run
the same gate, app and watch code, and the same tests.
"""

from __future__ import annotations

import errno
import logging
import os
from http import HTTPStatus
from typing import TYPE_CHECKING, Final, cast
from urllib.parse import unquote
from wsgiref.handlers import format_date_time

import trio
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

from topicd.clock import SystemWallClock
from topicd.errors import Internal, InvalidRequest, RequestHeadTooLarge
from topicd.http.app import CONTROL_PATHS, PROBE_PATHS, error_parts, gate_of
from topicd.http.head import Head, HeadCache, Refusal, early_refusal
from topicd.http.idle import AVAILABLE as IDLE_AVAILABLE
from topicd.http.idle import PARK_AFTER_S, IdleConnections

if TYPE_CHECKING:
    import socket
    from collections.abc import Awaitable, Callable

    from hypercorn.config import Config as HyperConfig
    from hypercorn.typing import AppWrapper, Framework, LifespanState
    from quart_trio import QuartTrio

    from topicd.errors import TopicdError
    from topicd.http.app import AsgiApp, DirectAnswer, Message, Scope, Upgrade

log = logging.getLogger("topicd.http")

# accept() errors that mean "out of descriptors or memory for now" (as trio's
# `serve_listeners` treats them): logged, retried after a pause
ACCEPT_CAPACITY_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})

ACCEPT_BATCH: Final = 64  # connections accepted per turn of the event loop, at most

STREAM_HEAD: Final = b"GET /v0/watch/"
RECV_BYTES: Final = 65536
DISCARD_LIMIT: Final = 65536  # bytes a streaming client may send before it is cut off
_REASONS: Final = {int(st): st.phrase.encode("ascii") for st in HTTPStatus}


_WALL: Final = SystemWallClock()  # the `date` header is real time by definition
_date_cache: list[object] = [0, b""]


def _date_line() -> bytes:
    """The `date:` header line, formatted once per second."""
    now = _WALL.now_ms() // 1000
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = b"date: " + format_date_time(now).encode("ascii") + b"\r\n"
    return cast("bytes", _date_cache[1])


async def close_quietly(stream: trio.SocketStream) -> None:
    """Close a connection, shielded and bounded (the peer may be gone or stuck)."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        await stream.aclose()


def response_head(
    status: int, headers: list[tuple[bytes, bytes]], *, chunked: bool = False, close: bool
) -> bytes:
    """An HTTP/1.1 response head: status line, `headers`, `date`, then either
    `transfer-encoding: chunked` or (with `close`) `connection: close`."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Status"))]
    for key, value in headers:  # (pieces, no generator: this runs for every answer)
        lines += (key, b": ", value, b"\r\n")
    lines.append(_date_line())
    if chunked:
        lines.append(b"transfer-encoding: chunked\r\n")
    elif close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


_H11_STATUS: Final = b"HTTP/1.1 "
# the head of an answer Hypercorn makes itself, without the app (its `_send_error_response`)
# (the fields it starts with; h11 moves `connection` last for an HTTP/1.0 client, and
# every answer that went through the gate carries the pressure header)
_H11_OWN_ERROR: Final = b"\r\ncontent-length: 0\r\n"
_STAMPED: Final = b"\r\nx-topicd-pressure: "
LINGER_S: Final = 1.0  # after refusing a head: how long the client's rest is read
LINGER_BYTES: Final = 1 << 20  # ... and how much of it


def refusal_bytes(err: TopicdError, pressure: bytes) -> bytes:
    """A complete `connection: close` answer with the canonical error body, for errors
    rendered outside the app (no scope, no gate)."""
    status, headers, body = error_parts(err)
    headers.append((b"content-length", b"%d" % len(body)))
    headers.append((b"x-topicd-pressure", pressure))
    return response_head(status, headers, close=True) + body


def head_too_large(max_head: int) -> RequestHeadTooLarge:
    return RequestHeadTooLarge(
        f"request head larger than {max_head} bytes (request line and headers)",
        {"max": max_head},
    )


def hypercorn_refusal(status: int, max_head: int) -> TopicdError:
    """The error behind a bodiless answer Hypercorn (h11) made itself with `status`."""
    if status == 431:
        return head_too_large(max_head)
    if status >= 500 and status != 501:
        return Internal("internal error (a bug; see the server log)")
    # 400 (malformed head, bad WebSocket handshake) and 501 (a transfer coding h11 does
    # not know): the request is what is wrong
    return InvalidRequest("malformed or unsupported HTTP/1.1 request")


class HypercornStream(trio.abc.HalfCloseableStream):
    """The connection as Hypercorn sees it.

    Reads first return the bytes the direct path already read (`prefix`), so Hypercorn
    parses the connection from that request on. Writes mend Hypercorn's HTTP/1.1 answers:

    * h11 writes status lines without a reason phrase (`HTTP/1.1 200 `): the phrase is
      added, as the direct path writes it;
    * the answers Hypercorn makes itself, without the app (a malformed head, a head over
      `h11_max_incomplete_size`, a bad WebSocket handshake), have no body and no pressure
      header: they are replaced by the canonical error answer. Closing after one first
      reads what the client still sends (bounded by `LINGER_S` and `LINGER_BYTES`), so
      unread request bytes do not turn the close into a reset that could destroy the
      answer before the client reads it.

    Hypercorn writes each h11 event with its own `send_all`, so a response head always
    starts a write. HTTP/2 frames never start with `HTTP/1.1 ` (that length field would
    be about 4.7 MB, above any frame size a peer allows).
    """

    def __init__(
        self,
        stream: trio.SocketStream,
        prefix: bytes = b"",
        *,
        pressure: Callable[[], bytes] | None = None,
        max_head: int = 0,
    ) -> None:
        self.stream = stream
        self.socket = stream.socket
        self._prefix = prefix
        self._pressure = pressure
        self._max_head = max_head
        self._linger = False
        # Hypercorn sends `send_eof` outside its send lock (its reader may close while an
        # answer is going out): one lock here keeps the two from colliding
        self._sending = trio.Lock()
        self._eof = False
        self.on_close: Callable[[], Awaitable[None]] | None = None

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            data, self._prefix = self._prefix, b""
            await trio.lowlevel.checkpoint()
            return data
        return await self.stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if data[:9] == _H11_STATUS and data[12:14] == b" \r":
            data = self._mend(bytes(data))
        async with self._sending:
            if self._eof:
                raise trio.BrokenResourceError("the connection was closed for writing")
            await self.stream.send_all(data)

    def _mend(self, head: bytes) -> bytes:
        """`head` (h11's, empty reason phrase) as topicd writes it."""
        status = int(head[9:12])
        if status >= 400 and _H11_OWN_ERROR in head and _STAMPED not in head:
            self._linger = True
            pressure = b"0.000" if self._pressure is None else self._pressure()
            return refusal_bytes(hypercorn_refusal(status, self._max_head), pressure)
        return head[:13] + _REASONS.get(status, b"Status") + head[13:]

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        async with self._sending:
            self._eof = True
            await self.stream.send_eof()

    async def aclose(self) -> None:
        try:
            if self._linger:
                self._linger = False
                await linger(self.stream)
        finally:
            await self.stream.aclose()
            if self.on_close is not None:
                on_close, self.on_close = self.on_close, None
                await on_close()


async def linger(stream: trio.SocketStream) -> None:
    """Read and drop what the client still sends after a refusal (bounded), so closing
    with unread bytes does not reset the connection under the answer."""
    got = 0
    with trio.move_on_after(LINGER_S):
        try:
            while got < LINGER_BYTES:
                data = await stream.receive_some(RECV_BYTES)
                if not data:
                    return
                got += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            return


PROBE_HEADS: Final = (b"GET /v0/health ", b"GET /healthz ", b"GET /v0/ready ", b"GET /readyz ")
WS_HEAD: Final = b"GET /v0/ws"  # a WebSocket upgrade: `upgrade` (topicd.http.ws) serves it
DIRECT_HEADS: Final = (STREAM_HEAD, WS_HEAD, *PROBE_HEADS)


WORK_HEAD: Final = b"GET /v0/topics/"


def _work_stream(head: bytes) -> bool | None:
    """Whether a head starting `GET /v0/topics/` opens a `/work` stream (its request
    line ends in `/v0/topics/<name>/work`, before any query); None: line incomplete."""
    eol = head.find(b"\r\n")
    if eol < 0:
        return None
    parts = head[:eol].split(b" ")
    if len(parts) != 3:
        return False
    path = parts[1].partition(b"?")[0]
    return path.endswith(b"/work") and path.count(b"/") == 4


def sniff(head: bytes) -> bool | None:
    """True: a request the direct path may serve (read on to the end of its head);
    False: Hypercorn's; None: too few bytes to tell."""
    if head.startswith(WORK_HEAD):
        return _work_stream(head)
    undecided = False
    for prefix in (*DIRECT_HEADS, WORK_HEAD):
        n = min(len(head), len(prefix))
        if head[:n] == prefix[:n]:
            if n == len(prefix):
                return True
            undecided = True
    return None if undecided else False


H2_PREFACE: Final = b"PRI * HTTP/2.0"


def sniff_any(head: bytes) -> bool | None:
    """`sniff` when every plain HTTP/1.x request may be served directly: only the h2c
    prior-knowledge preface is Hypercorn's from the first bytes."""
    n = min(len(head), len(H2_PREFACE))
    if head[:n] != H2_PREFACE[:n]:
        return True
    return None if n < len(H2_PREFACE) else False


Addrs = tuple[tuple[str, int], tuple[str, int]]  # (client, server)


def socket_addrs(stream: trio.SocketStream) -> Addrs | None:
    """The connection's (peer, local) addresses, or None when it is already gone."""
    sock = stream.socket
    try:
        client = sock.getpeername()
        server = sock.getsockname()
    except OSError:
        return None
    return (client[0], client[1]), (server[0], server[1])


def head_scope(head: Head, addrs: Addrs) -> Scope:
    """The ASGI scope of a head parsed by `parse_head` (served directly). A
    `content-length` body is the caller's to read."""
    raw_path, _, query = head.target.partition(b"?")
    path = raw_path.decode("ascii")  # (the parser admits printable ASCII only)
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1" if head.version == b"1.1" else "1.0",
        "method": head.method.decode("ascii"),
        "scheme": "http",
        "path": unquote(path) if "%" in path else path,
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": list(head.headers),  # (its own: a `Head` may serve many requests)
        "client": addrs[0],
        "server": addrs[1],
        "extensions": {},
        "state": {},
        "topicd.direct": True,
    }


class DirectExchange:
    """One request served on a raw socket stream (see module docstring).

    A stream open ends the connection with the stream. A probe answered with a
    `content-length` may keep the connection (`keep_alive`) for the next request."""

    def __init__(
        self,
        stream: trio.SocketStream,
        scope: Scope,
        *,
        keep_alive: bool = False,
        body: bytes = b"",
    ) -> None:
        self.stream = stream
        self.scope = scope
        self.body = body
        self.http11 = scope["http_version"] == "1.1"
        self.keep_alive = keep_alive
        self.cancel = trio.CancelScope()
        self._requested = False
        self._head: bytes | None = None  # the response head, sent with the first body
        self._chunked = False
        self._done = False
        self._broken = False
        # the stdlib socket under trio's, for the drain's non-blocking writes (trio's own
        # send is a coroutine; the drain is synchronous)
        self._sock = raw_socket(stream)
        scope["topicd.direct_write"] = (self.try_write, self.send_raw, self.chunk_socket)
        scope["topicd.take_body"] = self.take_body

    async def run(self, app: AsgiApp) -> bool:
        """Serve the request; True if the connection stays open for another one."""
        try:
            with self.cancel:
                try:
                    await app(self.scope, self.receive, self.send)
                except Exception:
                    # the gate answers every error, bugs included, until its answer has
                    # started; this one came after: log it, keep the server up, and end
                    # the connection (the answer is cut short)
                    log.exception("unhandled error on a direct request")
        finally:
            if not (self.keep_alive and self._done and not self._broken):
                self.keep_alive = False
                await close_quietly(self.stream)
        return self.keep_alive

    def take_body(self) -> bytes | None:
        """The request body, read with the head (None once `receive` or this gave it out):
        a handler that wants the whole body takes it without an ASGI message."""
        if self._requested:
            return None
        self._requested = True
        body, self.body = self.body, b""
        return body

    async def receive(self) -> Message:
        if not self._requested:
            self._requested = True
            body, self.body = self.body, b""
            return {"type": "http.request", "body": body, "more_body": False}
        if self.keep_alive:
            await trio.sleep_forever()  # the next bytes are the next request's
        received = 0
        while not self._broken:
            try:
                data = await self.stream.receive_some(RECV_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                break
            received += len(data)
            if not data or received > DISCARD_LIMIT:
                break  # EOF, or a client that talks instead of listening
        self._broken = True
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self._done or self._broken:
            return
        kind = message["type"]
        if kind == "http.response.start":
            self._head = self._render_head(message)
            return
        if kind != "http.response.body":
            return
        body = cast("bytes", message.get("body", b""))
        more = bool(message.get("more_body", False))
        out = b""
        if self._head is not None:
            out, self._head = self._head, None
        if self._chunked:
            if body:
                out += b"%x\r\n" % len(body) + body + b"\r\n"
            if not more:
                out += b"0\r\n\r\n"
        else:
            out += body
        if not more:
            self._done = True
        if out:
            try:
                await self.stream.send_all(out)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._broken = True
                self.cancel.cancel()  # the client is gone: end the exchange

    def try_write(self, payload: bytes) -> bytes | None:
        """Frame `payload` as one body chunk and send what the socket takes now, without
        blocking; returns the unsent rest (None: the connection is broken or finished).
        Only called while nothing else writes: the stream's pump is parked."""
        if self._done or self._broken or self._head is not None:
            return None
        data = b"%x\r\n" % len(payload) + payload + b"\r\n" if self._chunked else payload
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._broken = True
            return None
        return data[sent:]

    def chunk_socket(self) -> socket.socket | None:
        """The socket itself, for bytes already framed as body chunks (the watch drain's
        shared batches), once the answer's start is rendered with a chunked body; else
        None. Written to only while nothing else writes: the stream's pump is parked,
        which it first does after its first write (the head goes out with it)."""
        if self._chunked and not (self._done or self._broken):
            return self._sock
        return None

    async def send_raw(self, data: bytes | memoryview) -> None:
        """Send bytes as they are (the rest of a `try_write`, or of a shared batch)."""
        if self._done or self._broken:
            return
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._broken = True
            self.cancel.cancel()

    def _render_head(self, message: Message) -> bytes:
        status = cast("int", message["status"])
        headers = cast("list[tuple[bytes, bytes]]", message.get("headers", []))
        sized = any(k.lower() == b"content-length" for k, _ in headers)
        self._chunked = self.http11 and not sized
        if not sized:
            self.keep_alive = False  # a body without a length ends with the connection
        if not self._chunked:
            headers = [(k, v) for k, v in headers if k.lower() != b"connection"]
        return response_head(
            status, headers, chunked=self._chunked, close=not self._chunked and not self.keep_alive
        )


def raw_socket(stream: trio.SocketStream) -> socket.socket:
    """The stdlib socket under trio's: the synchronous, non-blocking writes and reads of
    the fast paths (trio's own are coroutines)."""
    return cast("socket.socket", getattr(stream.socket, "_sock"))  # noqa: B009


async def send_answer(stream: trio.SocketStream, data: bytes) -> None:
    """Write a whole answer: one non-blocking `send` (usually all of it fits), the rest
    through the stream; then one yield, as the stream's own write ends. The yield is
    kept on purpose: while the loop serves the others, the client's next request
    arrives, and the next read takes it without a wait (without the yield, each write
    measured 140-153 µs of server CPU at 64 connections against 110-117)."""
    sock = raw_socket(stream)
    try:
        sent = sock.send(data)
    except BlockingIOError:
        sent = 0
    except OSError as exc:
        raise trio.BrokenResourceError(f"send: {exc}") from exc
    if sent < len(data):
        await stream.send_all(memoryview(data)[sent:])
    else:
        await trio.lowlevel.cancel_shielded_checkpoint()


def _ready_bytes(sock: socket.socket) -> bytes:
    """What the client already sent, taken without waiting (b"" when nothing is there,
    at EOF and on an error: the stream's own read then sees those). A keep-alive client
    usually sends its next request while the loop serves the others whose commit it
    shared, so this read finds it, without the read wait, the wake-up and the yield
    after a read that `receive_some` costs."""
    try:
        return sock.recv(RECV_BYTES)
    except OSError:  # (BlockingIOError: nothing yet)
        return b""


class Listener:
    """Per-connection entry: sniff the first head, then serve it directly or via Hypercorn."""

    def __init__(
        self,
        app: AppWrapper,
        asgi: AsgiApp,
        is_stream: Callable[[Scope], bool],
        config: HyperConfig,
        context: WorkerContext,
        state: ConnectionState,
        *,
        direct: bool,
        all_http1: bool = False,
        max_body: int = 0,
        full: Callable[[], bool] | None = None,
        quick_refusal: Callable[[str], tuple[int, list[tuple[bytes, bytes]], bytes] | None]
        | None = None,
        pressure: Callable[[], bytes] | None = None,
        upgrade: Upgrade | None = None,
        fast: DirectAnswer | None = None,
    ) -> None:
        self.app = app
        self.asgi = asgi
        # hot endpoints answered by the gate itself (`Gate.serve_direct`), no ASGI exchange
        self.fast = fast
        self.upgrade = upgrade  # `GET /v0/ws` upgrades (None: Hypercorn's, like any upgrade)
        self.is_stream = is_stream
        self.full = full  # client permits and waiters exhausted: refuse here, cheaply
        self.quick_refusal = quick_refusal
        self.pressure = pressure  # the `X-Topicd-Pressure` value, for answers made here
        self.config = config
        self.context = context
        self.state = state
        self.direct = direct
        self.all_http1 = all_http1  # every plain HTTP/1.x request, not only streams/probes
        self.max_body = max_body
        self.max_head = config.h11_max_incomplete_size
        self.heads = HeadCache()  # the heads parsed lately (a repeated one is not parsed again)
        self.sniffing: set[trio.CancelScope] = set()
        self.closing = False
        # silent connections wait here without a task (None: each keeps its task)
        self.idle: IdleConnections | None = (
            IdleConnections(self.resume) if direct and IDLE_AVAILABLE else None
        )

    def shutdown(self) -> None:
        """Stop waiting for first requests (idle new connections close)."""
        self.closing = True
        for scope in list(self.sniffing):
            scope.cancel()
        if self.idle is not None and not self.idle.closed:
            self.idle.close_all()

    async def accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept connections on `listener` for ever, each served by `self` in a task of
        its own in `nursery` (trio's `serve_listeners`, but the task owns its connection:
        it closes it or parks it in `idle`)."""
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                        raise
                    log.error("accept: %s; retrying in %.1f s", os.strerror(exc.errno), 0.1)
                    await trio.sleep(0.1)
                else:
                    nursery.start_soon(self, stream)
                    self._accept_ready(listener, nursery)

    def _accept_ready(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept what else is already waiting, up to `ACCEPT_BATCH - 1` more, without
        waiting: one accept per turn of the event loop would take thousands of turns to
        drain a wave of reconnects (10,000 idle connections timed out together), and
        connections waiting that long to be accepted start their header timeout late."""
        sock = cast("socket.socket", getattr(listener.socket, "_sock"))  # noqa: B009
        for _ in range(ACCEPT_BATCH - 1):
            try:
                raw, _addr = sock.accept()
            except BlockingIOError:
                return
            except OSError:
                return  # (the next `listener.accept` sees it and decides)
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(raw))
            nursery.start_soon(self, stream)

    async def _read_head(
        self, stream: trio.SocketStream, head: bytes, deadline: float
    ) -> tuple[bytes, str | Refusal]:
        """Read until the head is complete: ("head", the head first), "other" (the h2c
        prior-knowledge preface: Hypercorn's), "too_big" (over `max_head` bytes), a
        `Refusal` (bytes that can never make a valid head: refused at once, not at the
        timeout), "park" (silent for `PARK_AFTER_S` with the head not complete: to be
        parked in `idle` until `deadline`), or "closed" (EOF, idle past `deadline`,
        shutting down). Empty lines before a request line are dropped (RFC 9112 §2.2)."""
        while head[:2] == b"\r\n":
            head = head[2:]
        end = head.find(b"\r\n\r\n")
        if 0 <= end <= self.max_head:  # all there already: no read, no scope
            return head, "head" if sniff_any(head) else "other"
        checked = 0  # bytes of `head` that `early_refusal` has seen
        parking = self.idle is not None and not self.idle.closed
        with trio.CancelScope() as scope:
            self.sniffing.add(scope)
            try:
                while True:
                    while head[:2] == b"\r\n":
                        head = head[2:]
                    end = head.find(b"\r\n\r\n")
                    # (only the head counts against the limit: a body may follow it)
                    if (end if end >= 0 else len(head)) > self.max_head:
                        return head, "too_big"
                    if end >= 0:
                        return head, "head" if sniff_any(head) else "other"
                    if len(head) > checked:
                        refusal = early_refusal(head, checked)
                        if refusal is not None:
                            return head, refusal
                        checked = len(head)
                    # (each read may park: a slow drip parks between its bytes)
                    now = trio.current_time()
                    scope.deadline = min(deadline, now + PARK_AFTER_S) if parking else deadline
                    data = await stream.receive_some(RECV_BYTES)
                    if not data:
                        return head, "closed"  # (with half a head: nothing to answer)
                    head += data
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return head, "closed"
            finally:
                self.sniffing.discard(scope)
        if parking and not self.closing and trio.current_time() < deadline:
            return head, "park"
        return head, "closed"  # cancelled: the deadline or the shutdown

    async def __call__(self, stream: trio.SocketStream) -> None:
        """Serve a new connection (the task owns `stream`: closed or parked on return)."""
        await self.resume(stream, b"", trio.current_time() + self.config.keep_alive_timeout)

    async def resume(self, stream: trio.SocketStream, head: bytes, deadline: float) -> None:
        """Serve a connection from `head` (bytes already read of the next request head,
        which must be complete by `deadline`): a new one, or one woken from `idle`."""
        parked = False
        try:
            parked = await self._serve(stream, head, deadline)
        finally:
            if not parked:  # (most paths have closed it already)
                await trio.aclose_forcefully(stream)

    async def _serve(self, stream: trio.SocketStream, head: bytes, deadline: float) -> bool:
        """The connection's keep-alive loop; True when it ends parked in `idle`."""
        addrs = socket_addrs(stream) if self.direct else None
        sock = raw_socket(stream)
        first = True
        while self.direct and not self.closing and addrs is not None:
            if not first:  # the next request's head: its own header timeout
                deadline = trio.current_time() + self.config.keep_alive_timeout
                if b"\r\n\r\n" not in head:
                    head += _ready_bytes(sock)
            first = False
            head, verdict = await self._read_head(stream, head, deadline)
            if verdict == "park":
                assert self.idle is not None
                # (the task ends; `idle` wakes the connection in a new one)
                return self.idle.park(stream, head, deadline)
            if verdict == "closed":
                await close_quietly(stream)
                return False
            if verdict == "too_big":
                await self._refuse_head(stream, head_too_large(self.max_head))
                return False
            if isinstance(verdict, Refusal):
                await self._refuse_head(stream, InvalidRequest(verdict.reason))
                return False
            if verdict == "other":
                break
            end = head.index(b"\r\n\r\n")
            parsed = self.heads.parse(head[:end])
            if isinstance(parsed, Refusal):
                await self._refuse_head(stream, InvalidRequest(parsed.reason))
                return False
            end += 4
            if self.full is not None and self.full():
                refused, head = await self._refuse_unparsed(stream, head)
                if refused is None:  # the client left (or asked to close)
                    await close_quietly(stream)
                    return False
                if refused:
                    continue
            if (
                self.upgrade is not None
                and head.startswith(WS_HEAD)
                and await self.upgrade(stream, head[:end], head[end:])
            ):
                return False
            if parsed.handoff or not (self.all_http1 or sniff(head)):
                break  # (an upgrade, `Transfer-Encoding`, `Expect`, another 1.x version)
            scope = head_scope(parsed, addrs)
            bodiless_get = parsed.method == b"GET" and parsed.length is None
            keep = parsed.version == b"1.1" and not parsed.close
            if bodiless_get and cast("str", scope["path"]) in PROBE_PATHS:
                exchange = DirectExchange(stream, scope, keep_alive=keep)
                if not await exchange.run(self.asgi):
                    return False
                head = head[end:]  # what the client already sent of its next request
                continue
            if bodiless_get and self.is_stream(scope):
                await DirectExchange(stream, scope).run(self.asgi)
                return False
            if not self.all_http1:
                break
            served, head = await self._serve_plain(stream, scope, parsed, head, end)
            if not served:
                break
        conn_stream = HypercornStream(stream, head, pressure=self.pressure, max_head=self.max_head)
        server = TCPServer(
            self.app,
            self.config,
            self.context,
            self.state,
            cast("trio.SSLStream[trio.SocketStream]", conn_stream),
        )
        # once the connection is closed, nothing is left to time out: Hypercorn would
        # otherwise keep its idle timer (and this task) to `keep_alive_timeout` after it
        # closes a connection over a malformed request
        conn_stream.on_close = server.idle_task.stop
        await server.run()
        return False

    async def _refuse_head(self, stream: trio.SocketStream, err: TopicdError) -> None:
        """Answer `err` to a head refused before parsing is done, then close: `431` for a
        head over `max_head` bytes (answered here, not left to h11: h11 bounds only a head
        still incomplete in its buffer, so a larger head that arrived whole would pass),
        `400` for one `parse_head` or `early_refusal` refuses. Nothing after the head is
        read as a request: what the client still sends is read and dropped (bounded)."""
        pressure = b"0.000" if self.pressure is None else self.pressure()
        try:
            await stream.send_all(refusal_bytes(err, pressure))
            await stream.send_eof()
            await linger(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await close_quietly(stream)

    async def _read_to(self, stream: trio.SocketStream, data: bytes, total: int) -> bytes:
        """`data` and what follows it on the connection, until `total` bytes (or more, when
        the client pipelines) are there; fewer when the client leaves or is too slow."""
        if len(data) >= total:
            return data
        pieces = [data]
        have = len(data)
        with trio.move_on_after(self.config.keep_alive_timeout):
            while have < total:
                try:
                    more = await stream.receive_some(max(RECV_BYTES, total - have))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                if not more:
                    break
                pieces.append(more)
                have += len(more)
        return b"".join(pieces)

    async def _serve_plain(
        self, stream: trio.SocketStream, scope: Scope, parsed: Head, head: bytes, end: int
    ) -> tuple[bool, bytes]:
        """Serve one plain request (no body, or a `content-length` one) directly: read its
        body, run the app, keep the connection when HTTP/1.1 allows. Returns (served,
        bytes read beyond it); when not served, the bytes are everything read of this
        request, for Hypercorn (a `HEAD`, a body over the limit)."""
        if parsed.method == b"HEAD":
            return False, head
        length = parsed.length or 0
        if self.max_body and length > self.max_body:
            return False, head  # Quart answers it (413)
        data = await self._read_to(stream, head, end + length)
        if len(data) < end + length:  # gone or too slow: nothing to answer
            await close_quietly(stream)
            return True, b""
        # the whole request is in hand: a write's sojourn (governor s6) counts from here,
        # not from its head, so a client slow to send its body (a producer short of CPU)
        # does not read as the server's pressure
        scope["topicd.in_hand_at"] = trio.current_time()
        keep = parsed.version == b"1.1" and not parsed.close
        body = data[end : end + length]
        answer = None if self.fast is None else await self.fast(scope, body)
        if answer is None:
            exchange = DirectExchange(stream, scope, keep_alive=keep, body=body)
            if not await exchange.run(self.asgi):
                return True, b""  # closed: the next read sees it
            return True, data[end + length :]
        # a hot endpoint, answered by the gate without an ASGI exchange
        status, headers, out = answer
        try:
            await send_answer(stream, response_head(status, headers, close=not keep) + out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            keep = False
        if not keep:
            await close_quietly(stream)
            return True, b""  # the next read sees it closed
        return True, data[end + length :]

    async def _refuse_unparsed(
        self, stream: trio.SocketStream, head: bytes
    ) -> tuple[bool | None, bytes]:
        """At full client permits and waiters, answer a client request `429
        client_waiters` from a glance at its head (request line, `content-length`,
        `connection`), without parsing it (no h11, no scope, no gate task, no framework):
        a refusal must cost far less than an accepted write (scheduler spec B.5). Returns
        (True, bytes after it) when refused, (False, head) when the usual path must serve
        it (control work, streams, anything unusual, a permit freed meanwhile), (None, _)
        when the connection is gone."""
        end = head.find(b"\r\n\r\n") + 4
        glance = _glance(head, end) if end >= 4 and self.quick_refusal is not None else None
        if glance is None:
            return False, head
        method, path, length, keep = glance
        if (
            path in CONTROL_PATHS
            or method == b"HEAD"
            or (method == b"GET" and (path.startswith("/v0/watch/") or path.endswith("/work")))
            or (self.max_body and length > self.max_body)
        ):
            return False, head
        data = await self._read_to(stream, head, end + length)
        if len(data) < end + length:
            return None, b""
        assert self.quick_refusal is not None
        answer = self.quick_refusal(path)  # (None for control work, e.g. the dashboard)
        if answer is None:
            return False, data  # room again, or the full gate decides
        status, headers, body = answer
        try:
            await stream.send_all(response_head(status, headers, close=not keep) + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None, b""
        if not keep:
            return None, b""  # the caller closes
        return True, data[end + length :]


_GLANCE_REFUSED: Final = (b"\r\ntransfer-encoding:", b"\r\nexpect:", b"\r\nupgrade:")


def _glance(head: bytes, end: int) -> tuple[bytes, str, int, bool] | None:
    """(method, path, content-length, keep-alive) of a complete head, read without a
    parser, for the quick refusal; None when anything is unusual (the parser decides)."""
    line_end = head.find(b"\r\n")
    parts = head[:line_end].split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        return None
    method, target, version = parts
    fields = head[line_end : end - 2].lower()
    if any(name in fields for name in _GLANCE_REFUSED):
        return None
    length = 0
    at = fields.find(b"\r\ncontent-length:")
    if at >= 0:
        if fields.find(b"\r\ncontent-length:", at + 2) >= 0:
            return None  # a repeated length: the parser rules on it
        stop = fields.find(b"\r\n", at + 2)
        value = fields[at + 17 : stop if stop >= 0 else None].strip()
        if not value.isdigit() or len(value) > 15:
            return None
        length = int(value)
    keep = version == b"HTTP/1.1" and b"\r\nconnection: close" not in fields
    return method, target.partition(b"?")[0].decode("latin-1"), length, keep


async def serve(
    app: QuartTrio,
    config: HyperConfig,
    *,
    direct: bool = True,
    direct_http1: bool = False,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve topicd's `app` (from `create_app`) on `config.bind` until `shutdown_trigger`.

    The direct path runs the app's gate (its ASGI entry) for the stream opens the gate
    recognises (see module docstring); `direct=False` gives every request to Hypercorn.
    """
    gate = gate_of(app)
    asgi: AsgiApp = gate
    is_stream = gate.is_stream
    permits = gate.permits
    wrapped = wrap_app(cast("Framework", app), config.wsgi_max_body_size, "asgi")
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            listeners: list[trio.SocketListener] = []
            binds: list[str] = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            handler = Listener(
                wrapped,
                asgi,
                is_stream,
                config,
                context,
                ConnectionState(lifespan_state.copy()),
                direct=direct,
                all_http1=direct_http1,
                max_body=int(app.config.get("MAX_CONTENT_LENGTH") or 0),
                full=(lambda: permits.full()) if permits is not None else None,
                quick_refusal=gate.quick_refusal,
                pressure=gate.pressure_header,
                upgrade=gate.ws_upgrade,
                fast=gate.serve_direct,
            )
            gate.idle = handler.idle
            task_status.started(binds)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    if handler.idle is not None:
                        nursery.start_soon(handler.idle.run, server_nursery)
                    for listener in listeners:
                        nursery.start_soon(handler.accept, listener, server_nursery)
                    await trio.sleep_forever()
            except* ShutdownError:
                pass
            finally:
                handler.shutdown()
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
