"""Shared helpers for the SSE watch contract tests (api-routers-watch §2).

Everything here goes through the public surface: HTTP requests on the Quart test client
for `POST /v0/watch` and the topic endpoints, and `topicd.testing.sse.open_stream` for
`GET /v0/watch/:wid` (raw ASGI, body channel of capacity 0, so a test that stops reading
is a client that stops reading). Frames are reduced to `(event, id map, data)` tuples so a
test can compare a whole run of frames with one exact `==`.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import trio
import trio.testing

from topicd.engine.watch import pump
from topicd.testing.sse import AsgiStream, Frame, open_stream
from topicd.wire import WatchIn

WID_RE = re.compile(r"wid_[A-Za-z0-9_-]{22}")
B64URL_RE = re.compile(r"[A-Za-z0-9_-]+")
PRESSURE_RE = re.compile(r"0\.\d{3}|1\.000")

# the events that carry `id:` (api-routers-watch §2.5/§2.6); `error` carries it on shutdown only
DATA_EVENTS = {"record", "tombstone", "caught-up", "topic-deleted"}

# ---- composite ids -----------------------------------------------------------------------


def compact(obj: Any) -> bytes:
    """Compact JSON with object keys sorted bytewise (the composite-id encoding)."""
    if isinstance(obj, dict):
        items = sorted(obj.items(), key=lambda kv: kv[0].encode())
        return b"{" + b",".join(compact(k) + b":" + compact(v) for k, v in items) + b"}"
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def enc_id(cursors: dict[str, int], *, padded: bool = False) -> str:
    """The composite id of a cursor map: base64url of its compact JSON, keys sorted."""
    raw = base64.urlsafe_b64encode(compact(cursors)).decode()
    return raw if padded else raw.rstrip("=")


def dec_id(value: str) -> dict[str, int]:
    """Decode an `id:` value, asserting it is exactly how the spec says it is encoded."""
    assert B64URL_RE.fullmatch(value), f"id is not unpadded base64url: {value!r}"
    raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    obj = orjson.loads(raw)
    assert isinstance(obj, dict), obj
    assert raw == compact(obj), f"id JSON is not compact with sorted keys: {raw!r}"
    return obj


# ---- frames ------------------------------------------------------------------------------


def summarize(frame: Frame) -> tuple[str, Any, Any]:
    """`(event, decoded id or None, data)`; `("hb", None, None)` for a heartbeat and
    `("retry", None, ms)` for the retry block. Checks the per-frame invariants of §2.6."""
    if frame.heartbeat:
        assert frame.comment == "hb", f"topicd heartbeats are exactly ': hb': {frame}"
        assert frame.id is None and frame.retry is None, frame
        return ("hb", None, None)
    if frame.retry is not None:
        assert frame.event is None and frame.raw_data is None and frame.id is None, frame
        assert frame.comment is None, frame
        return ("retry", None, frame.retry)
    assert frame.comment is None and frame.event is not None, frame
    assert frame.raw_data is not None, f"an event without data: {frame}"
    if frame.event in DATA_EVENTS:
        assert frame.id is not None, f"data-bearing frame without id: {frame}"
    return (frame.event, None if frame.id is None else dec_id(frame.id), frame.data)


def seqs(frame: tuple[str, Any, Any]) -> list[int]:
    """The `$seq`s of a summarized `record` frame."""
    assert frame[0] == "record", frame
    return [r["$seq"] for r in frame[2]["records"]]


def caught_up(topic: str, head: int, cursors: dict[str, int]) -> tuple[str, Any, Any]:
    return ("caught-up", cursors, {"topic": topic, "head_seq": head})


def summarize_all(frames: list[Frame]) -> list[tuple[str, Any, Any]]:
    return [summarize(f) for f in frames]


def _pending(s: AsgiStream) -> list[Frame]:
    """Frames already parsed but not yet handed to the test (a chunk may hold several)."""
    return s.__dict__.setdefault("_pending", [])


async def _fill(s: AsgiStream, n: int, within: float) -> list[Frame]:
    pending = _pending(s)
    with trio.move_on_after(within):
        while len(pending) < n and not s.ended:
            pending.extend(await s.read_frames(1))
    return pending


async def read(s: AsgiStream, n: int, *, within: float = 5.0) -> list[tuple[str, Any, Any]]:
    """Exactly the next `n` frames (waiting at most `within` virtual seconds)."""
    pending = await _fill(s, n, within)
    got, pending[:] = pending[:n], pending[n:]
    assert len(got) == n, f"wanted {n} frames, got {summarize_all(got)}"
    return summarize_all(got)


async def read_until_event(
    s: AsgiStream, event: str, *, within: float = 5.0
) -> list[tuple[str, Any, Any]]:
    """Frames up to and including the first `event` frame."""
    out: list[tuple[str, Any, Any]] = []
    with trio.move_on_after(within):
        while not (out and out[-1][0] == event):
            pending = await _fill(s, 1, math.inf)
            if not pending:
                break
            out.append(summarize(pending.pop(0)))
    assert out and out[-1][0] == event, f"no {event!r} frame: {out}"
    return out


async def quiet(s: AsgiStream, seconds: float) -> None:
    """Nothing is written for `seconds` of virtual time (keep it below the heartbeat)."""
    pending = await _fill(s, 1, seconds)
    assert pending == [], f"unexpected frames: {summarize_all(pending)}"


async def ends(s: AsgiStream, *, within: float = 5.0) -> None:
    """The server ends the stream (no further frame)."""
    pending = await _fill(s, 1, within)
    assert pending == [], f"unexpected frames: {summarize_all(pending)}"
    assert s.ended, "the stream did not end"
    with trio.fail_after(within):
        await s.wait_done()


async def open_ok(
    harness: Any,
    nursery: Any,
    wid: str,
    *,
    headers: dict[str, str] | None = None,
    query: str = "",
) -> AsgiStream:
    """Open the stream, assert `200` and the opening `retry: 2000` + `: hb` blocks."""
    s = await open_stream(nursery, harness.app.asgi_app, wid, headers=headers, query=query)
    if s.status != 200:
        await s.wait_done()
        raise AssertionError(f"stream open failed: {s.status} {s.body!r}")
    check_pressure(s.headers.get("x-topicd-pressure"))
    assert await read(s, 2) == [("retry", None, 2000), ("hb", None, None)]
    return s


async def open_fail(
    harness: Any,
    nursery: Any,
    wid: str,
    status: int,
    code: str,
    *,
    headers: dict[str, str] | None = None,
    query: str = "",
) -> dict[str, Any]:
    """Open the stream, assert the canonical error body (README §5); returns `error`."""
    s = await open_stream(nursery, harness.app.asgi_app, wid, headers=headers, query=query)
    await s.wait_done()
    assert s.status == status, (s.status, s.body)
    check_pressure(s.headers.get("x-topicd-pressure"))
    assert s.headers.get("content-type", "").startswith("application/json"), s.headers
    return check_error_body(s.error_body, code)


async def close(s: AsgiStream) -> None:
    s.disconnect()
    await s.wait_done()


# ---- HTTP --------------------------------------------------------------------------------


def check_pressure(value: str | None) -> None:
    """README §6: every response carries `X-Topicd-Pressure: <0.000-1.000>`."""
    assert value is not None, "X-Topicd-Pressure missing"
    assert PRESSURE_RE.fullmatch(value), value


def check_error_body(body: Any, code: str) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) <= {"error", "performance"}, body
    err = body["error"]
    assert {"code", "message"} <= set(err) <= {"code", "message", "detail"}, err
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"], err
    if "detail" in err:
        assert isinstance(err["detail"], dict) and err["detail"], err
    return err


async def fail(r: Any, status: int, code: str) -> dict[str, Any]:
    raw = await r.get_data()
    assert r.status_code == status, (r.status_code, raw)
    assert r.headers.get("Content-Type", "").startswith("application/json"), r.headers
    check_pressure(r.headers.get("X-Topicd-Pressure"))
    return check_error_body(json.loads(raw), code)


async def ok_json(r: Any, status: int = 200) -> dict[str, Any]:
    raw = await r.get_data()
    assert r.status_code == status, (r.status_code, raw)
    check_pressure(r.headers.get("X-Topicd-Pressure"))
    return json.loads(raw)


async def create(
    client: Any,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    query: dict[str, str] | None = None,
) -> dict[str, Any]:
    r = await client.post("/v0/watch", json=body, headers=headers or {}, query_string=query)
    return await ok_json(r)


async def wid_of(client: Any, body: dict[str, Any], **kw: Any) -> str:
    return (await create(client, body, **kw))["wid"]


async def write(
    client: Any, topic: str, records: list[dict[str, Any]], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    r = await client.post(f"/v0/topics/{topic}", json={"records": records}, headers=headers or {})
    raw = await r.get_data()
    assert r.status_code in (200, 201), raw
    return json.loads(raw)


async def write_n(client: Any, topic: str, n: int, **fields: Any) -> dict[str, Any]:
    return await write(client, topic, [{"data": i, **fields} for i in range(n)])


async def each_bounded(fn, items, limit: int = 16) -> None:
    """`await fn(item)` for every item, at most `limit` at a time (set-up of many topics:
    on a replicated backend each one is a quorum round trip, so they overlap)."""
    limiter = trio.CapacityLimiter(limit)

    async def one(item) -> None:
        async with limiter:
            await fn(item)

    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(one, item)


async def put_topic(
    client: Any, topic: str, config: dict[str, Any] | None = None, headers: dict | None = None
) -> dict[str, Any]:
    r = await client.put(f"/v0/topics/{topic}", json=config or {}, headers=headers or {})
    raw = await r.get_data()
    assert r.status_code in (200, 201), raw
    return json.loads(raw)


async def delete_topic(client: Any, topic: str) -> None:
    r = await client.delete(f"/v0/topics/{topic}")
    body = await ok_json(r)
    assert body["deleted"] is True, body


async def diff(client: Any, topic: str, **body: Any) -> dict[str, Any]:
    r = await client.post(f"/v0/topics/{topic}/diff", json=body)
    return await ok_json(r)


async def state(client: Any, topic: str) -> dict[str, Any]:
    r = await client.get(f"/v0/topics/{topic}", query_string={"touch": "false"})
    return await ok_json(r)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def start_pumped(
    engine: Any,
    nursery: trio.Nursery,
    req: WatchIn,
    write: Callable[[bytes], Awaitable[None]],
    **transport: Any,
) -> tuple[Any, Any]:
    """Create a watch session for `req`, open its stream with a scripted transport (the
    direct path's `direct`, `raw_write` and `sock` given in `transport`), start its pump
    writing through `write`, and let it park: (session, conn)."""
    session, _ = engine.create_watch(None, req, False)
    conn = engine.watch.open_stream(session, None)
    for name, value in transport.items():
        setattr(conn, name, value)
    nursery.start_soon(
        lambda: pump(
            conn,
            engine.watch,
            write,
            retry_ms=2000,
            max_scan=10000,
            now_ms=engine.clock.now_ms,
            enforce=engine.enforce,
            payloads=engine.payloads,
        )
    )
    await trio.testing.wait_all_tasks_blocked()
    return session, conn
