"""`WatchStream`: the multiplexed SSE watch as an async iterator that never loses its
place.

It creates a session (`POST /v0/watch`), opens its stream (`GET /v0/watch/:wid`) and turns
frames into events: one `Record` per record, `Tombstone`, `CaughtUp`, `TopicDeleted` and
`PushPaused`. It keeps, per topic, the cursor of the last event it handed out (`cursors`);
after a `record` frame's last record the cursor becomes the frame's `to_seq`, and after
any frame carrying an `id:` the cursors become that id's map (so seqs the server passed
over without a frame count too).

Reconnecting: when the connection drops, the server says it is shutting down or a slow
consumer was cut off, or nothing (not even a heartbeat) arrives for twice the heartbeat
interval plus two seconds, the stream reopens the same session with `Last-Event-ID` set
to `cursors` (the server rewinds to it, never forward). When the session is gone (`404`:
the server restarted, or the session was reclaimed) it creates a new one starting at
`cursors`. Events are handed out only from frames already parsed, and a record at or
below its topic's cursor is dropped, so nothing is repeated; the rewind means nothing is
skipped. Consecutive failed attempts back off like transport retries and give up with
`ConnectionFailed` after `max_retries`.
"""

from __future__ import annotations

import base64
import logging
from collections import deque
from typing import TYPE_CHECKING, Literal

import anyio
import anyio.lowlevel
import httpx
import msgspec

from topicd.client.errors import (
    CapacityError,
    ClientError,
    ConnectionFailed,
    JsonObject,
    NotFound,
    ProtocolError,
    ServerError,
    Throttled,
    TopicNotFound,
    Unavailable,
    WatchSuperseded,
)
from topicd.client.models import CaughtUp, Event, PushPaused, Record, Tombstone, TopicDeleted
from topicd.client.sse import SseEvent, SseParser

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence
    from types import TracebackType

    from topicd.client._client import Client

log = logging.getLogger("topicd.client")

WATCHDOG_SLACK_S = 2.0


class _RecordFrame(msgspec.Struct):
    topic: str
    records: list[msgspec.Raw]
    to_seq: int | None = None


_RECORD_FRAME = msgspec.json.Decoder(_RecordFrame)


def encode_cursor(cursors: dict[str, int]) -> str:
    """The composite cursor: base64url (no padding) of the compact, key-sorted JSON map."""
    raw = msgspec.json.encode(dict(sorted(cursors.items())))
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_cursor(value: str) -> dict[str, int] | None:
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        obj = msgspec.json.decode(raw)
    except (ValueError, msgspec.DecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    return {k: v for k, v in obj.items() if isinstance(v, int) and not isinstance(v, bool)}


class _Reconnect(Exception):
    """The stream must be reopened (internal)."""


# a pending item: an event to hand out (or None), the topic, the cursor it leaves
# behind (or None), an id map to apply after it (or None), an error to raise instead
_Item = tuple[Event | None, str | None, int | None, dict[str, int] | None, ClientError | None]


class WatchStream:
    """See the module docstring. Build it with `Client.watch`; close it with `aclose()`
    or `async with`."""

    def __init__(
        self,
        client: Client,
        topics: dict[str, int | Literal["tail"]],
        *,
        node: str | Sequence[str] | None,
        include_tags: bool,
        include_meta: bool,
        include_data: bool,
        limit: int,
        heartbeat_ms: int,
        consistency: str,
    ) -> None:
        if not topics:
            raise ValueError("watch at least one topic")
        self.client = client
        self.cursors: dict[str, int] = {}
        self.reconnects = 0
        self.sessions = 0
        self._start = topics
        self._queued: dict[str, int] = {}
        self._terminal: set[str] = set()
        self._options: dict[str, object] = {
            "include_tags": include_tags,
            "include_meta": include_meta,
            "include_data": include_data,
            "heartbeat_ms": heartbeat_ms,
        }
        if node is not None:
            self._options["node"] = node if isinstance(node, str) else list(node)
        if limit:
            self._options["limit"] = limit
        if consistency != "eventual":
            self._options["consistency"] = consistency
        self._heartbeat_ms = heartbeat_ms
        self._wid: str | None = None
        self._resp: httpx.Response | None = None
        self._chunks: AsyncIterator[bytes] | None = None
        self._parser = SseParser()
        self._pending: deque[_Item] = deque()
        self._retry_ms = 2000
        self._closed = False

    async def __aenter__(self) -> WatchStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        await self._drop()

    def __aiter__(self) -> WatchStream:
        return self

    @property
    def wid(self) -> str | None:
        return self._wid

    async def __anext__(self) -> Event:
        while True:
            while self._pending:
                event, topic, cursor, id_map, error = self._pending.popleft()
                if error is not None:
                    raise error
                if topic is not None and cursor is not None:
                    self.cursors[topic] = cursor
                if id_map is not None:
                    self._apply(self.cursors, id_map)
                if event is not None:
                    return event
            if self._closed or (self.cursors and self._terminal >= set(self.cursors)):
                raise StopAsyncIteration
            try:
                await self._fill()
            except _Reconnect:
                self.reconnects += 1
                await self._drop()

    def _apply(self, target: dict[str, int], id_map: dict[str, int]) -> None:
        for topic, seq in id_map.items():
            if topic in target and topic not in self._terminal:
                target[topic] = seq

    # ---- connection ----------------------------------------------------------------------

    async def _drop(self) -> None:
        resp, self._resp, self._chunks = self._resp, None, None
        self._parser = SseParser()
        if resp is not None:
            with anyio.move_on_after(5, shield=True):
                await resp.aclose()

    async def _fill(self) -> None:
        if self._chunks is None:
            await self._connect()
        assert self._chunks is not None
        watchdog_s = 2 * self._heartbeat_ms / 1000 + WATCHDOG_SLACK_S
        chunk = b""
        with anyio.move_on_after(watchdog_s) as scope:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                log.info("watch %s: the server closed the stream; reconnecting", self._wid)
                raise _Reconnect from None
            except httpx.TransportError as exc:
                log.info("watch %s: connection lost (%r); reconnecting", self._wid, exc)
                raise _Reconnect from None
        if scope.cancelled_caught:
            log.info("watch %s: silent for %.1f s; reconnecting", self._wid, watchdog_s)
            raise _Reconnect
        for frame in self._parser.feed(chunk):
            self._frame(frame)

    async def _connect(self) -> None:
        failures = 0
        while True:
            if self._closed:
                raise StopAsyncIteration
            try:
                if self._wid is None:
                    await self._create_session()
                    if self._terminal >= set(self.cursors):
                        return self._no_stream()
                await self._open_stream()
                return
            except NotFound:
                self._wid = None  # restarted or reclaimed: a new session from `cursors`
                wait_s = 0.0
            except CapacityError as exc:
                wait_s = self._wait_s(exc.retry_after_ms, failures)
            except (Throttled, Unavailable) as exc:
                wait_s = self._wait_s(exc.retry_after_ms, failures)
            except ConnectionFailed:
                wait_s = self._wait_s(None, failures)
            failures += 1
            if failures > self.client.policy.max_retries:
                raise ConnectionFailed(
                    f"watch: could not reopen the stream after {failures} attempts"
                )
            if wait_s:
                await self.client.clock.sleep(wait_s)

    def _no_stream(self) -> None:
        """Every topic is gone: nothing to open; the iterator ends after its events."""
        self._chunks = _empty()

    def _wait_s(self, hint_ms: int | None, failures: int) -> float:
        if hint_ms is not None:
            return self.client.hint_s(hint_ms)
        return min(self.client.backoff_s(failures), self._retry_ms / 1000)

    async def _create_session(self) -> None:
        first = self.sessions == 0
        topics: dict[str, object] = {}
        if first:
            for topic, start in self._start.items():
                topics[topic] = {"tail": True} if start == "tail" else {"from_seq": start}
        else:
            for topic, seq in self.cursors.items():
                if topic not in self._terminal:
                    topics[topic] = {"from_seq": seq}
        body = dict(self._options, topics=topics)
        params = None if first else {"lenient": "true"}
        try:
            resp = await self.client._request(
                "POST", "/v0/watch", body=body, params=params, safe=True, retries=False
            )
        except TopicNotFound:
            if first:
                raise
            for topic in topics:
                self._gone(topic)
            return
        try:
            created = msgspec.json.decode(resp.content)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"POST /v0/watch: {exc}") from None
        if not isinstance(created, dict) or not isinstance(created.get("wid"), str):
            raise ProtocolError("POST /v0/watch: no `wid`")
        self.sessions += 1
        self._wid = created["wid"]
        hb = created.get("heartbeat_ms")
        if isinstance(hb, int) and hb > 0:
            self._heartbeat_ms = hb
        resolved = created.get("topics")
        resolved = resolved if isinstance(resolved, dict) else {}
        for topic in topics:
            info = resolved.get(topic)
            if not isinstance(info, dict):
                self._gone(topic)  # dropped by `lenient`: deleted while we were away
                continue
            resolved_from = info.get("from_seq")
            if first and isinstance(resolved_from, int):
                self.cursors[topic] = resolved_from
                self._queued[topic] = resolved_from

    def _gone(self, topic: str) -> None:
        self.cursors.setdefault(topic, 0)
        self._queued.setdefault(topic, 0)
        if topic not in self._terminal:
            self._terminal.add(topic)
            self._pending.append((TopicDeleted(topic), None, None, None, None))

    async def _open_stream(self) -> None:
        headers = {"accept": "text/event-stream"}
        if self.cursors:
            headers["last-event-id"] = encode_cursor(self.cursors)
        req = self.client.http.build_request(
            "GET",
            f"/v0/watch/{self._wid}",
            headers=headers,
            timeout=httpx.Timeout(self.client.http.timeout.connect, read=None),
        )
        try:
            resp = await self.client.http.send(req, stream=True)
        except httpx.TransportError as exc:
            raise ConnectionFailed(f"GET /v0/watch/{self._wid}: {exc!r}") from exc
        self.client.signals.observe_pressure(resp.headers.get("x-topicd-pressure"))
        if not resp.is_success:
            try:
                await resp.aread()
            except httpx.TransportError as exc:
                raise ConnectionFailed(f"GET /v0/watch/{self._wid}: {exc!r}") from exc
            finally:
                await resp.aclose()
            err: ServerError = self.client._error(resp)
            raise err
        self._resp = resp
        self._chunks = resp.aiter_raw()
        self._parser = SseParser()
        self._queued = dict(self.cursors)

    # ---- frames --------------------------------------------------------------------------

    def _frame(self, frame: SseEvent) -> None:
        if frame.retry_ms is not None:
            self._retry_ms = frame.retry_ms
        id_map = decode_cursor(frame.id) if frame.id else None
        kind = frame.event
        if kind is None or frame.data is None:
            return  # heartbeat or `retry:`
        try:
            if kind == "record":
                self._record_frame(frame.data, id_map)
                return
            obj = msgspec.json.decode(frame.data)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"watch frame {kind}: {exc}") from None
        if not isinstance(obj, dict):
            raise ProtocolError(f"watch frame {kind}: data is not an object")
        topic = obj.get("topic")
        topic = topic if isinstance(topic, str) else None
        event: Event | None = None
        cursor: int | None = None
        if kind == "tombstone" and topic is not None:
            event = Tombstone.from_json(topic, obj)
            cursor = event.resume_after
        elif kind == "caught-up" and topic is not None:
            head = obj.get("head_seq")
            event = CaughtUp(topic, head if isinstance(head, int) else 0)
        elif kind == "topic-deleted" and topic is not None:
            event = TopicDeleted(topic)
            self._terminal.add(topic)
        elif kind == "error":
            self._error_frame(obj, id_map)
            return
        if topic is not None and cursor is not None:
            self._queued[topic] = cursor
        if id_map is not None:
            self._apply(self._queued, id_map)
        self._pending.append((event, topic, cursor, id_map, None))

    def _record_frame(self, data: str, id_map: dict[str, int] | None) -> None:
        frame = _RECORD_FRAME.decode(data)
        topic = frame.topic
        last = self._queued.get(topic)
        if last is not None and frame.to_seq is not None and frame.to_seq < last:
            return  # wholly below what was handed out already (never expected)
        for raw in frame.records:
            rec = Record.decode(topic, bytes(raw))
            if last is not None and rec.seq <= last:
                continue  # already handed out before a reconnect
            last = rec.seq
            self._pending.append((rec, topic, rec.seq, None, None))
        end = frame.to_seq if frame.to_seq is not None else last
        if end is not None and (last is None or end >= last):
            self._queued[topic] = end
        if id_map is not None:
            self._apply(self._queued, id_map)
        self._pending.append((None, topic, end, id_map, None))

    def _error_frame(self, obj: JsonObject, id_map: dict[str, int] | None) -> None:
        code = obj.get("code")
        if code == 429:
            topics = obj.get("topics")
            ms = obj.get("retry_after_ms")
            event = PushPaused(
                tuple(t for t in topics if isinstance(t, str)) if isinstance(topics, list) else (),
                ms if isinstance(ms, int) else 0,
            )
            self._pending.append((event, None, None, None, None))
            return
        if code == 409:
            self._pending.append(
                (None, None, None, None, WatchSuperseded(f"watch {self._wid} was taken over"))
            )
            return
        if id_map is not None:
            self._apply(self._queued, id_map)
            self._pending.append((None, None, None, id_map, None))
        if code == 410:
            self._wid = None
        log.info("watch %s: error frame %s; reconnecting", self._wid, code)
        # server_shutting_down, 503 (cut off as a slow consumer), 410: reopen the stream
        self._chunks = _reconnect_marker()


class _Scripted:
    """A stand-in for the stream's byte iterator: ends (`reconnect=False`) or asks for a
    reconnect on its first read."""

    def __init__(self, *, reconnect: bool) -> None:
        self.reconnect = reconnect

    def __aiter__(self) -> _Scripted:
        return self

    async def __anext__(self) -> bytes:
        await anyio.lowlevel.checkpoint()
        if self.reconnect:
            raise _Reconnect
        raise StopAsyncIteration


def _empty() -> AsyncIterator[bytes]:
    return _Scripted(reconnect=False)


def _reconnect_marker() -> AsyncIterator[bytes]:
    return _Scripted(reconnect=True)
