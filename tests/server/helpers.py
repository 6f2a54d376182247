"""Shared set-up for the real-socket server tests, and `tree_state` for the tests that
prove a command left a directory exactly as it found it."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
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


def tree_state(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything a command could change under `root` (which must exist): for the root and
    every entry below it (hidden ones included), its kind, mode and mtime, and for a file
    also its size and SHA-256, for a link its target. Equal states mean nothing was
    created, removed, renamed, written or truncated, not even a file made and removed
    again (that changes the directory's mtime)."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            path = Path(dirpath, name)
            st = path.lstat()
            key = path.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                out[key] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[key] = ("dir", st.st_mode, st.st_mtime_ns)
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                out[key] = ("file", st.st_mode, st.st_mtime_ns, st.st_size, digest)
    return out


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
