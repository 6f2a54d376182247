"""Shared by the scheduler and governor tests: writes, live connections, what they got."""

from __future__ import annotations

import msgspec
import orjson
import trio

from topicd.engine.watch import LIVE, Conn, FrameRef
from topicd.wire import RecordIn, WatchIn, WatchTopicIn, WriteIn


def write_req(*values: object) -> WriteIn:
    return WriteIn(records=[RecordIn(data=msgspec.Raw(orjson.dumps(v))) for v in values])


async def live_conn(engine, name: str, **opts: object) -> Conn:
    """A registered connection with `name` already in live mode at its head."""
    req = WatchIn(topics={name: WatchTopicIn(tail=True)}, **opts)  # type: ignore[arg-type]
    session, _ = engine.create_watch(None, req, False)
    conn = engine.watch.open_stream(session, None)
    conn.mode[name] = LIVE
    conn.enqueued_to[name] = session.cursors[name]
    return conn


def received(conn: Conn, *, advisories: bool = False) -> list[FrameRef]:
    """Everything queued on the connection's channel: topic frames, and with
    `advisories` also topic-less frames that carry a body (pokes are never kept)."""
    out = []
    while True:
        try:
            ref = conn.recv_ch.receive_nowait()
        except trio.WouldBlock:
            return out
        conn.buffered_bytes -= ref.nbytes
        if ref.topic or (advisories and ref.body is not None):
            out.append(ref)
