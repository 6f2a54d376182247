"""`GET /v0/topics/:q/work`: the push-worker stream, served at the ASGI layer.

Like the watch stream (`topicd.http.watch`), the gate hands the request to `WorkStreams`
before Quart, so on the direct HTTP/1.1 path the frames are written straight to the
socket. `WorkStreams` runs the establishment checks in order — `406` (Accept), `401`
(no valid key: the `Authorization` header, or `?token=` when there is no header),
`400` (`node`), `403` (read and write on the topic), `404 topic_not_found`,
`409 not_a_queue`, `429` (the SSE caps) — sends the response head and runs the
stream's pump (`topicd.engine.work.work_pump`) in the stream's cancel scope, with a
second task that watches for the client's disconnect. Streams hold no per-key in-flight
slot; they count against the SSE caps (the deployment's with several fronts:
`topicd.engine.slots`).
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Final, cast

import trio

from topicd.engine.work import WorkConn, work_pump
from topicd.errors import InvalidRequest, NotAQueue, TopicdError
from topicd.http.watch import _until_disconnect, stream_request
from topicd.wire import check_worker_node

if TYPE_CHECKING:
    from topicd.config import Config
    from topicd.engine.slots import Slot
    from topicd.http.app import EngineRef, Receive, Scope, Send
    from topicd.http.auth import KeyStore

_PATH: Final = re.compile(r"^/v0/topics/([^/]+)/work$")
_INT: Final = re.compile(r"[+-]?\d{1,18}")
_HEAD: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),
]


def _int_or_none(values: list[str] | None) -> int | None:
    if not values or not _INT.fullmatch(values[0].strip()):
        return None
    return int(values[0])


class WorkStreams:
    """`GET /v0/topics/:q/work` at the ASGI layer (see module docstring)."""

    def __init__(self, ref: EngineRef, config: Config, keys: KeyStore) -> None:
        self.ref = ref
        self.cfg = config
        self.keys = keys

    @staticmethod
    def topic_of(scope: Scope) -> str | None:
        """The queue's name if this request opens a `/work` stream, else None."""
        if scope.get("method") != "GET":
            return None
        m = _PATH.match(cast("str", scope["path"]))
        return None if m is None else m.group(1)

    async def establish(self, scope: Scope, name: str) -> tuple[WorkConn, Slot | None]:
        """The establishment checks in order (module docstring); registers the stream.
        With deployment-wide slots (several fronts) the caps are checked by taking one
        there, last; the stream gives it back when it ends."""
        query, who = stream_request(scope, self.keys, "work stream")
        nodes = query.get("node")
        if not nodes:
            raise InvalidRequest("the node query parameter is required", {"field": "node"})
        node = nodes[0]
        check_worker_node(node, self.cfg.protocol.max_node_bytes)
        who.require("read", name)
        who.require("write", name)
        engine = self.ref.engine
        topic = engine.get(name)
        if topic.queue is None:
            raise NotAQueue(f"topic {name!r} is a log, not a queue", {"topic": name})
        max_claim = self.cfg.queue.max_claim
        want = min(max(_int_or_none(query.get("max")) or 1, 1), max_claim)
        lease_ms = _int_or_none(query.get("lease_ms"))
        if lease_ms is not None:
            lease_ms = max(lease_ms, 0)
        key = who.key_id if self.keys.enabled else None
        slots = engine.watch.slots
        slot = None if slots is None else await slots.acquire(key)  # 429 at a cap
        engine.watch.reserve_stream(key)  # (429 at a cap: this process's counts)
        conn = WorkConn(topic, node, want, lease_ms, key)
        conn.remote = engine.queues.runs_elsewhere(name)
        engine.queues.attach_work(conn)
        return conn, slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send, name: str) -> None:
        """Establish (a refusal raises its `TopicdError` before anything is sent: the
        gate answers it) and serve the stream until it ends."""
        engine = self.ref.engine
        if engine.queues.runs_elsewhere(name):
            # a front that does not run the queue: learn of it first (read-after-write);
            # whatever fails here, the establishment checks below answer in their order
            with contextlib.suppress(TopicdError):
                await engine.sync_topic(name)
        conn, slot = await self.establish(scope, name)
        try:
            if scope.get("topicd.direct"):
                engine.watch.stats.streams_direct += 1
            engine.watch.stats.streams_opened += 1
            headers = list(_HEAD)
            if scope.get("http_version") in ("1.0", "1.1"):
                headers.append((b"connection", b"keep-alive"))
            await send({"type": "http.response.start", "status": 200, "headers": headers})

            async def write(chunk: bytes) -> None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

            q = self.cfg.queue
            ended = False
            with conn.cancel_scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
                    await work_pump(
                        conn,
                        engine.queues,
                        write,
                        retry_ms=self.cfg.watch.sse_retry_ms,
                        heartbeat_ms=q.work_heartbeat_ms,
                        poll_ms=q.work_poll_ms,
                    )
                    ended = True  # a terminal frame was written
                    nursery.cancel_scope.cancel()
            if ended:
                with trio.move_on_after(1.0):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            engine.queues.detach_work(conn)  # (the pump did; idempotent)
            engine.watch.release_stream(conn.key_id)
            if slot is not None and engine.watch.slots is not None:
                await engine.watch.slots.release(slot)
