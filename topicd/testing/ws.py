"""A small WebSocket client for tests and benchmarks (wsproto over any Trio stream).

`WsClient.connect` opens a real TCP connection; `open_ws_in_process` runs the server
side of `/v0/ws` (`topicd.http.ws`) on an in-memory stream pair in the test's own
nursery, so `MockClock` drives it. Messages are decoded JSON objects; the client keeps
the handshake answer (`status`, `reject_body`) when the server refuses the upgrade.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, cast

import orjson
import trio
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from topicd.http.app import gate_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from quart_trio import QuartTrio

    from topicd.errors import JsonValue

Json = dict[str, "JsonValue"]


class WsClosed(Exception):
    """The server closed the WebSocket (`code`) or the connection ended."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"closed ({code})")
        self.code = code


class WsClient:
    def __init__(self, stream: trio.abc.Stream, host: str = "localhost") -> None:
        self.stream = stream
        self.host = host
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.messages: deque[Json] = deque()
        self.status = 0  # 101, or the status of a refused handshake
        self.reject_body = b""
        self.close_code: int | None = None
        self.pongs: list[bytes] = []
        self.binary: list[bytes] = []
        self._text: list[str] = []
        self._rejected_done = False  # the whole refusal (head and body) arrived
        self.pending_out = b""  # a pong owed to the server's ping

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        headers: dict[str, str] | None = None,
        path: str = "/v0/ws",
        *,
        rcvbuf: int | None = None,
    ) -> WsClient:
        """Connect and handshake; `rcvbuf` shrinks the kernel receive buffer so a client
        that stops reading blocks the server's writes sooner."""
        sock = trio.socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, rcvbuf)
        await sock.connect((host, port))
        stream = trio.SocketStream(sock)
        client = cls(stream, host)
        await stream.send_all(client.request(headers, path))
        await client.read_handshake()
        return client

    def request(self, headers: dict[str, str] | None = None, path: str = "/v0/ws") -> bytes:
        """The handshake request's bytes."""
        extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        return self.ws.send(Request(host=self.host, target=path, extra_headers=extra))

    async def read_handshake(self) -> int:
        while not self.status or (self.status != 101 and not self._rejected_done):
            data = await self.stream.receive_some(65536)
            if not data:
                break
            self.ws.receive_data(bytes(data))
            self._pump_events()
        return self.status

    def _pump_events(self) -> None:
        for event in self.ws.events():
            if isinstance(event, AcceptConnection):
                self.status = 101
            elif isinstance(event, RejectConnection):
                self.status = event.status_code
                self._rejected_done = not event.has_body
            elif isinstance(event, RejectData):
                self.reject_body += event.data
                self._rejected_done = event.body_finished
            elif isinstance(event, TextMessage):
                self._text.append(event.data)
                if event.message_finished:
                    text, self._text = "".join(self._text), []
                    self.messages.append(cast("Json", orjson.loads(text)))
            elif isinstance(event, BytesMessage):
                self.binary.append(bytes(event.data))
            elif isinstance(event, Pong):
                self.pongs.append(bytes(event.payload))
            elif isinstance(event, Ping):
                self.pending_out = self.ws.send(event.response())
            elif isinstance(event, CloseConnection):
                self.close_code = event.code

    async def send(self, obj: Json | str) -> None:
        text = obj if isinstance(obj, str) else orjson.dumps(obj).decode()
        await self.stream.send_all(self.ws.send(TextMessage(data=text)))

    async def send_raw_event(self, event: BytesMessage | Ping | TextMessage) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def recv(self) -> Json:
        """The next JSON message; `WsClosed` when the server closes instead."""
        while not self.messages:
            if self.close_code is not None:
                raise WsClosed(self.close_code)
            data = await self.stream.receive_some(65536)
            if not data:
                raise WsClosed(None)
            self.ws.receive_data(bytes(data))
            self._pump_events()
            if self.pending_out:
                out, self.pending_out = self.pending_out, b""
                await self.stream.send_all(out)
        return self.messages.popleft()

    async def recv_until(self, pred: Callable[[Json], bool]) -> list[Json]:
        """Messages up to and including the first one `pred` accepts."""
        out: list[Json] = []
        while True:
            msg = await self.recv()
            out.append(msg)
            if pred(msg):
                return out

    async def request_reply(self, obj: Json) -> Json:
        """Send a command and return the reply with its `request_id` (other messages
        received meanwhile stay queued, in order)."""
        await self.send(obj)
        rid = obj.get("request_id")
        skipped: list[Json] = []
        while True:
            msg = await self.recv()
            if msg.get("request_id") == rid and msg.get("op") not in ("record", "caught_up"):
                self.messages.extendleft(reversed(skipped))
                return msg
            skipped.append(msg)

    async def close(self, code: int = 1000) -> None:
        """Send a close frame (or answer the server's)."""
        if self.ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            await self.stream.send_all(self.ws.send(CloseConnection(code=code)))

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await self.stream.aclose()


async def open_ws_in_process(
    nursery: trio.Nursery,
    app: QuartTrio,
    headers: dict[str, str] | None = None,
    *,
    lockstep: bool = False,
) -> WsClient:
    """A client connected to `app`'s `/v0/ws` over an in-memory stream pair, the server
    side running in `nursery`. `lockstep`: every server write waits until the client
    reads it (a client that stops reading stalls the server's writes at once)."""
    pair = trio.testing.lockstep_stream_pair if lockstep else trio.testing.memory_stream_pair
    client_end, server_end = pair()
    client = WsClient(client_end)
    head = client.request(headers)
    upgrade = gate_of(app).ws_upgrade
    assert upgrade is not None
    nursery.start_soon(upgrade, server_end, head, b"")
    await client.read_handshake()
    return client
