"""Shared set-up for the real-socket server tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx

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
