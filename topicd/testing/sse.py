"""Test helpers for the SSE watch: a spec-following frame parser and an in-process
stream client that drives the ASGI app directly.

`SseParser` implements the EventSource parsing rules (api-routers-watch §2.6): blocks end
at a blank line; `event:`, `data:`, `id:` and `retry:` fields; comment lines are
heartbeats. It is strict where topicd promises more than the standard (frames separated
by `\\n\\n`, never CRLF; compact JSON) and records what it saw so tests can assert exact
shapes.

`AsgiStream` opens `GET /v0/watch/:wid` against the app with hand-made ASGI callables:
the body chunks go through a channel of capacity 0, so a test that stops reading is a
client that stops reading — the server's `send` blocks exactly as over a full socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import orjson
import trio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, MutableMapping

    _AsgiApp: TypeAlias = Callable[
        [
            MutableMapping[str, object],
            Callable[[], Awaitable[MutableMapping[str, object]]],
            Callable[[MutableMapping[str, object]], Awaitable[None]],
        ],
        Awaitable[None],
    ]

    from topicd.engine.watch import FrameRef  # noqa: F401


@dataclass
class Frame:
    """One parsed SSE block."""

    event: str | None = None
    data: object = None  # parsed JSON (tests index into it)
    raw_data: str | None = None
    id: str | None = None
    retry: int | None = None
    comment: str | None = None

    @property
    def heartbeat(self) -> bool:
        return self.comment is not None and self.event is None and self.raw_data is None


class SseParser:
    """Incremental parser: feed bytes, collect frames."""

    def __init__(self) -> None:
        self.buf = b""
        self.frames: list[Frame] = []

    def feed(self, chunk: bytes) -> list[Frame]:
        assert b"\r" not in chunk, "topicd frames never use CR"
        self.buf += chunk
        out: list[Frame] = []
        while True:
            end = self.buf.find(b"\n\n")
            if end < 0:
                break
            block, self.buf = self.buf[:end], self.buf[end + 2 :]
            out.append(self._parse(block.decode("utf-8")))
        self.frames.extend(out)
        return out

    @staticmethod
    def _parse(block: str) -> Frame:
        f = Frame()
        data_lines: list[str] = []
        for line in block.split("\n"):
            if line.startswith(":"):
                assert f.comment is None, f"two comment lines in one block: {block!r}"
                f.comment = line[1:].strip()
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                f.event = value
            elif name == "data":
                data_lines.append(value)
            elif name == "id":
                f.id = value
            elif name == "retry":
                f.retry = int(value)
            else:
                raise AssertionError(f"unknown SSE field in {block!r}")
        if data_lines:
            assert len(data_lines) == 1, "topicd data is one compact JSON line"
            f.raw_data = data_lines[0]
            f.data = orjson.loads(f.raw_data)
            assert orjson.dumps(f.data) == f.raw_data.encode(), "data is compact JSON"
        if f.comment is not None:
            shared = f.event is not None or f.id is not None or data_lines
            assert not shared, f"a heartbeat shares its block: {block!r}"
        return f


@dataclass
class AsgiStream:
    """An in-process SSE client on the ASGI app (see module docstring)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    parser: SseParser = field(default_factory=SseParser)
    ended: bool = False
    _chunks: trio.MemoryReceiveChannel[bytes] | None = None
    _disconnect: trio.Event = field(default_factory=trio.Event)
    _started: trio.Event = field(default_factory=trio.Event)
    _done: trio.Event = field(default_factory=trio.Event)

    async def read_frames(self, n: int = 1, *, timeout: float | None = None) -> list[Frame]:  # noqa: ASYNC109
        """Read until at least `n` new frames arrived (or the stream ended)."""
        assert self._chunks is not None
        got: list[Frame] = []
        with _bounded(timeout):
            while len(got) < n:
                try:
                    chunk = await self._chunks.receive()
                except trio.EndOfChannel:
                    self.ended = True
                    break
                got.extend(self.parser.feed(chunk))
        return got

    async def read_until(
        self,
        pred: Callable[[Frame], bool],
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> list[Frame]:
        """Read frames until one satisfies `pred`; returns every frame read."""
        got: list[Frame] = []
        with _bounded(timeout):
            while not self.ended:
                new = await self.read_frames(1)
                got.extend(new)
                if any(pred(f) for f in new):
                    return got
        return got

    def disconnect(self) -> None:
        self._disconnect.set()

    async def wait_done(self) -> None:
        await self._done.wait()

    @property
    def error_body(self) -> object:
        return orjson.loads(self.body)


def _bounded(timeout: float | None) -> trio.CancelScope:
    return trio.CancelScope() if timeout is None else trio.move_on_after(timeout)


def _scope(path: str, query: bytes, headers: list[tuple[bytes, bytes]]) -> dict[str, object]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 4000),
        "extensions": {},
    }


async def open_stream(
    nursery: trio.Nursery,
    app: _AsgiApp,
    wid: str,
    *,
    headers: dict[str, str] | None = None,
    query: str = "",
) -> AsgiStream:
    """Start `GET /v0/watch/:wid` and return once the response head arrived."""
    return await open_sse(nursery, app, f"/v0/watch/{wid}", headers=headers, query=query)


async def open_sse(
    nursery: trio.Nursery,
    app: _AsgiApp,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    query: str = "",
) -> AsgiStream:
    """Start `GET path` (an SSE stream: a watch or `/work`) and return once the response
    head arrived."""
    stream = AsgiStream()
    send_ch, recv_ch = trio.open_memory_channel[bytes](0)
    stream._chunks = recv_ch
    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = _scope(path, query.encode(), hdrs)
    first = [True]

    async def receive() -> MutableMapping[str, object]:
        if first[0]:
            first[0] = False
            return {"type": "http.request", "body": b"", "more_body": False}
        await stream._disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, object]) -> None:
        if message["type"] == "http.response.start":
            stream.status = int(message["status"])  # type: ignore[call-overload]
            for k, v in message.get("headers", []):  # type: ignore[attr-defined]
                stream.headers[k.decode().lower()] = v.decode()
            stream._started.set()
            return
        body = message.get("body", b"")
        assert isinstance(body, bytes)
        if stream.status != 200:
            stream.body += body
            return
        if body:
            await send_ch.send(body)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            send_ch.close()
            stream._started.set()
            stream._done.set()

    nursery.start_soon(run)
    await stream._started.wait()
    return stream


class RawSseClient:
    """An SSE client on a raw TCP socket (HTTP/1.1, chunked body), for real servers.

    It reads only when asked to, so a test can make it stall; `rcvbuf` shrinks the
    kernel receive buffer so the server's writes block sooner.
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.raw = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.parser = SseParser()
        self.ended = False

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        path: str,
        headers: dict[str, str] | None = None,
        *,
        rcvbuf: int | None = None,
    ) -> RawSseClient:
        sock = trio.socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, rcvbuf)
        await sock.connect((host, port))
        client = cls(trio.SocketStream(sock))
        lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Accept: text/event-stream"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        await client.stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
        return client

    async def _fill(self) -> bool:
        data = await self.stream.receive_some(65536)
        if not data:
            self.ended = True
            return False
        self.raw += data
        return True

    async def read_head(self) -> None:
        while b"\r\n\r\n" not in self.raw:
            if not await self._fill():
                raise AssertionError("connection closed before the response head")
        head, self.raw = self.raw.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split(" ")[1])
        for line in header_lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        assert self.headers.get("transfer-encoding") == "chunked" or self.status != 200

    def _decode_chunks(self) -> bytes:
        """The body bytes of every complete chunk received so far."""
        out = b""
        while True:
            end = self.raw.find(b"\r\n")
            if end < 0:
                break
            size = int(self.raw[:end].split(b";")[0], 16)
            if size == 0:
                self.ended = True
                self.raw = b""
                break
            total = end + 2 + size + 2
            if len(self.raw) < total:
                break
            out += self.raw[end + 2 : end + 2 + size]
            self.raw = self.raw[total:]
        return out

    async def read_frames(self, n: int = 1) -> list[Frame]:
        got: list[Frame] = []
        while len(got) < n and not self.ended:
            got.extend(self.parser.feed(self._decode_chunks()))
            if len(got) >= n:
                break
            if not await self._fill():
                break
        got.extend(self.parser.feed(self._decode_chunks()))
        return got

    async def read_until(self, pred: Callable[[Frame], bool]) -> list[Frame]:
        got: list[Frame] = []
        while not self.ended:
            new = await self.read_frames(1)
            got.extend(new)
            if any(pred(f) for f in new):
                break
        return got

    async def aclose(self) -> None:
        await self.stream.aclose()
