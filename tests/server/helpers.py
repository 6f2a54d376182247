"""Shared set-up for the real-socket server tests."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import orjson
import trio

from topicd.http.app import gate_of
from topicd.testing.harness import serve_in_process


@asynccontextmanager
async def served(cfg) -> AsyncIterator[tuple[Any, Any, str, int]]:
    """A real server on port 0: (engine, app, host, port)."""
    apps: list = []
    async with serve_in_process(cfg, apps) as (engine, url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield engine, apps[0], host, int(port)


@asynccontextmanager
async def served_with_topic(cfg) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str, int]]:
    """`served` with topic `d` created: (engine, httpx client, host, port)."""
    async with AsyncExitStack() as stack:
        engine, _app, host, port = await stack.enter_async_context(served(cfg))
        url = f"http://{host}:{port}"
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
        await http.put("/v0/topics/d", json={})
        yield engine, http, host, port


@asynccontextmanager
async def permits_taken(app) -> AsyncIterator[Any]:
    """Hold every client permit of a server configured with one permit and no waiter
    slot (so it is full); yields the permit pool."""
    pool = gate_of(app).permits
    assert pool is not None
    held = await pool.admit()
    try:
        yield pool
    finally:
        held.release()


class Reader:
    """Reads `content-length` framed responses off one connection."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    async def head(self) -> bytes:
        """Everything up to the end of the next response head (kept in `buf`)."""
        with trio.fail_after(10):
            while b"\r\n\r\n" not in self.buf:
                data = await self.stream.receive_some(65536)
                assert data, "connection closed before a response"
                self.buf += data
        return self.buf[: self.buf.index(b"\r\n\r\n") + 4]

    async def raw(self) -> tuple[int, bytes, bytes]:
        """(status, lowercased head, body) of the next `content-length` framed response."""
        await self.head()
        with trio.fail_after(10):
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            m = re.search(rb"content-length: (\d+)", head.lower())
            n = int(m.group(1)) if m else 0
            while len(rest) < n:
                data = await self.stream.receive_some(65536)
                assert data
                rest += data
        self.buf = rest[n:]
        return int(head[9:12]), head.lower(), rest[:n]

    async def response(self) -> tuple[int, bytes, dict]:
        status, head, body = await self.raw()
        return status, head, orjson.loads(body) if body else {}

    async def eof(self) -> bool:
        with trio.fail_after(10):
            while True:
                data = await self.stream.receive_some(65536)
                if not data:
                    return True
                self.buf += data
