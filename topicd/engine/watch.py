"""Watch sessions and their SSE connections (api-routers-watch §2; architecture §7).

A **session** (`POST /v0/watch`) stores the subscription — the topics in order, bound to
the instances that existed at creation, the frame options — and the authoritative cursor
per topic. A **connection** (`GET /v0/watch/:wid`) streams frames for one session; one
stream per session at a time (a newer GET supersedes the older stream with a `409`).

Delivery runs in one of two modes per topic of a connection:

* **live**: the topic's drain (`topicd.sched.scheduler`) builds each distinct frame body
  once per options group and offers a `FrameRef` to every live connection with a
  non-blocking `send_nowait` into the connection's bounded channel (`sse.channel_frames`
  frames, `sse.channel_bytes` bytes). A full channel never makes the drain wait: the
  connection is marked **lagged**, nothing more is buffered for it, and every topic
  switches to pull.
* **pull**: the connection's own pump reads from its position through the diff path
  (`Topic.read`: records still retained in order, a tombstone with the exact range for
  whatever cap/TTL evicted meanwhile) until it reaches the head, then — in the same
  synchronous step that finds it there — switches the topic to live.

The pump (`pump`) is one coroutine per connection: it waits (channel, heartbeat timer,
catch-up) and writes pre-encoded `bytes` through the `write` callable it is given (the
ASGI send, or the direct socket path's). On the direct path a connection also has a
non-blocking `direct` writer: while the pump is parked on an empty channel, the drain
writes live frames to the socket itself, and the pump finishes whatever the socket did
not take before it writes anything else.

The drain hands each connection a `LiveBatch`: the frames of one drain for one options
group, plus their bytes as one shared buffer (`wire`: for SSE one HTTP/1.1 chunk holding
every event with its `id:` line, for WebSocket the frames back to back). A stream whose
session watches one topic has the same `id:` line as every other such stream at the same
position (the cursor map has one entry), so the whole batch is encoded once per drain.
A connection whose pump is parked at exactly the batch's start (`ready_at`, set only
while nothing else can write: single topic, live, not lagged, no terminal frame pending,
a chunked direct socket `sock`) gets the batch with one non-blocking `sock.send` and a
few stores (`Conn.push`); what the socket does not take becomes the pump's `remainder`
(a view into the shared buffer) and the pump is woken to finish it. Every other
connection gets the batch frame by frame through `Conn.offer`, which queues or writes
each with its own `id:` line.

The connection's stream position (`Conn.pos`) moves as frames are produced; the session's
cursors follow once a write has completed, so a reconnect resumes after what was written.
The per-connection memory bound is the channel's: at most `channel_frames` references to
shared, immutable frame bodies totalling at most `channel_bytes` bytes, plus the unsent
rest of one direct write (a view into one shared batch of at most `COALESCE_BYTES`, or
one frame where a single frame is larger).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, TypeAlias

import orjson
import trio
from wsproto.frame_protocol import FrameProtocol

from topicd.errors import JsonValue, NotFound, Throttled, TopicdError, Unauthorized

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from typing import Protocol

    from topicd.config import Config
    from topicd.engine.payloads import Hold, PayloadCache
    from topicd.engine.slots import ConnectionSlots, Slot
    from topicd.engine.topic import Topic
    from topicd.engine.ws import WsConn

    Watcher: TypeAlias = "Conn | WsConn"  # what a topic's drain offers frames to

    class Sock(Protocol):
        """A non-blocking socket (a test's fake in tests): `send` returns how many bytes
        it took, raises `BlockingIOError` when none fit now, another `OSError` when the
        connection is broken."""

        def send(self, data: bytes, /) -> int: ...


log = logging.getLogger("topicd.watch")

PULL: Final = 0
LIVE: Final = 1
DONE: Final = 2  # terminal for this topic (deleted)
HEARTBEAT: Final = b": hb\n\n"
CATCHUP_FRAMES: Final = 4  # frames one catch-up pass builds per topic before moving on
COALESCE_FRAMES: Final = 64  # queued frames one socket write may carry
COALESCE_BYTES: Final = 262144


@dataclass(frozen=True, slots=True)
class WatchOptions:
    """What shapes a session's frames; sessions with equal options share frame bodies."""

    node_filter: frozenset[str] | None
    limit: int
    max_bytes: int
    include_meta: bool
    include_tags: bool
    include_data: bool
    strong: bool
    ws: bool = False  # frames are WebSocket text frames (`/v0/ws`), not SSE events


@dataclass(eq=False, slots=True)
class FrameRef:
    """One channel item: the frame for one topic range `(from_seq, to_seq]`.

    `body` is the shared `event:`/`data:` bytes, or None for a range the session's options
    reduce to nothing (it only moves the cursor). `from_seq == to_seq` marks a frame that
    moves nothing (`caught-up`). An empty `topic` is a wake-up poke."""

    topic: str
    from_seq: int
    to_seq: int
    body: bytes | None
    nbytes: int
    tomb: bool = False  # a tombstone frame (the drain announces the head after one)


_POKE: Final = FrameRef("", 0, 0, None, 0)


@dataclass(eq=False, slots=True)
class LiveBatch:
    """The frames one drain made for one options group (`live_batches`), contiguous
    from `first` to `last`, and their bytes as one shared buffer: `wire` is what the
    socket of a connection parked at `first` gets, in one send (empty when the frames
    carry no body: the range only moves the cursor)."""

    topic: str
    first: int
    last: int
    frames: list[FrameRef]
    wire: bytes


def _sse_chunk(payload: bytes) -> bytes:
    """`payload` as one HTTP/1.1 chunk (the framing of a direct SSE stream's body)."""
    return b"%x\r\n%b\r\n" % (len(payload), payload) if payload else b""


def live_batches(name: str, frames: list[FrameRef], *, ws: bool) -> list[LiveBatch]:
    """`frames` (contiguous, of topic `name`) cut into batches of at most
    `COALESCE_BYTES` (a larger frame is a batch of its own), each with its shared `wire`.

    SSE: every event gets the `id:` line a single-topic stream has after it (its cursor
    map is `{name: to_seq}`), and the batch is one chunk. WebSocket: the frames as they
    are (a WebSocket frame carries no cursor line)."""
    out: list[LiveBatch] = []
    run: list[FrameRef] = []
    parts: list[bytes] = []
    size = 0

    def flush() -> None:
        payload = b"".join(parts)
        wire = payload if ws else _sse_chunk(payload)
        out.append(LiveBatch(name, run[0].from_seq, run[-1].to_seq, run, wire))

    for ref in frames:
        if run and size + ref.nbytes > COALESCE_BYTES:
            flush()
            run, parts, size = [], [], 0
        run.append(ref)
        body = ref.body
        if body is not None:
            if ws:
                parts.append(body)
            else:
                parts.append(b"id: " + composite_id({name: ref.to_seq}) + b"\n" + body)
            size += ref.nbytes
    if run:
        flush()
    return out


def event(name: bytes, data: JsonValue | bytes) -> bytes:
    payload = data if isinstance(data, bytes) else orjson.dumps(data)
    return b"event: " + name + b"\ndata: " + payload + b"\n\n"


def error_frame(code: int | str, message: str, **extra: JsonValue) -> bytes:
    body: dict[str, JsonValue] = {"code": code, "error": message, "message": message}
    body.update(extra)
    return event(b"error", body)


_WS_FRAMES: Final = FrameProtocol(client=False, extensions=[])


def ws_frame(payload: bytes) -> bytes:
    """One complete, unmasked WebSocket text frame (server to client) carrying the JSON
    `payload`, encoded by wsproto. Server frames depend on nothing but the payload (no
    mask, no per-message compression), so one encoding is shared by every connection."""
    return bytes(_WS_FRAMES.send_data(payload.decode("utf-8")))


def ws_payload(frame: bytes) -> bytes:
    """The payload of a frame `ws_frame` made (for a transport that frames messages
    itself): its header is 2, 4 or 10 bytes, by the 7-bit length field."""
    size = frame[1] & 0x7F
    return frame[2 if size < 126 else 4 if size == 126 else 10 :]


def ws_message(op: str, fields: dict[str, JsonValue]) -> bytes:
    """`{"op": op, ...fields}` as a WebSocket text frame."""
    return ws_frame(orjson.dumps({"op": op, **fields}))


def caught_up_frame(topic: Topic, *, ws: bool = False) -> bytes:
    if ws:
        return ws_message("caught_up", {"topic": topic.name, "head_seq": topic.head_seq})
    return event(b"caught-up", {"topic": topic.name, "head_seq": topic.head_seq})


def deleted_frame(name: str) -> bytes:
    return event(b"topic-deleted", {"topic": name, "head_seq": 0, "reason": "deleted"})


_ONE_TOPIC_IDS: dict[tuple[str, int], bytes] = {}
_ONE_TOPIC_IDS_MAX: Final = 4096


def composite_id(cursors: dict[str, int]) -> bytes:
    """base64url (no padding) of the compact JSON cursor map, keys sorted bytewise
    (topic names are ASCII, so code point order is byte order).

    Single-topic maps (the common fan-out case: many watchers of one topic at the same
    position) come from a small cache, so a frame's id is encoded once, not per watcher.
    """
    if len(cursors) == 1:
        key = next(iter(cursors.items()))
        cached = _ONE_TOPIC_IDS.get(key)
        if cached is None:
            if len(_ONE_TOPIC_IDS) >= _ONE_TOPIC_IDS_MAX:
                _ONE_TOPIC_IDS.clear()
            raw = orjson.dumps(cursors)
            cached = _ONE_TOPIC_IDS[key] = base64.urlsafe_b64encode(raw).rstrip(b"=")
        return cached
    raw = orjson.dumps(cursors, option=orjson.OPT_SORT_KEYS)
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


def decode_composite_id(text: str) -> dict[str, int] | None:
    """The cursor map of an `id:` value (padded or unpadded base64url), or None if it
    does not decode (the caller then ignores it). Entries that are not a topic name
    mapped to a non-negative integer are dropped."""
    text = text.strip()
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        obj = orjson.loads(raw)
    except (ValueError, orjson.JSONDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    return {
        k: v
        for k, v in obj.items()
        if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
    }


def build_frames(
    topic: Topic,
    start: int,
    end: int,
    opts: WatchOptions,
    max_scan: int,
    *,
    first_read: bool = False,
    max_frames: int = 0,
) -> tuple[list[FrameRef], int, int | None]:
    """The frames for the topic's records after `start`, never past `end`, through the
    diff path: a tombstone where cap/TTL (or a crash) removed records the cursor had not
    passed, then `record` frames of at most `opts.limit` records / `opts.max_bytes`.

    `max_frames` (0: no bound) stops early, and so does a record whose bytes are only in
    its segment (`topicd.engine.payloads`). Returns (frames, the position they lead to,
    that record's seq or None).
    A cursor above the head (a previous instance's) gets the `recreated` tombstone and
    restarts at `earliest_seq - 1`, the one case where the position moves down.
    """
    out: list[FrameRef] = []
    cursor = start
    name = topic.name
    node_filter = opts.node_filter if topic.config.dedupe_node else None
    ws = opts.ws
    first = first_read and not ws  # the WebSocket keeps the tombstone's own reason
    while cursor < end or cursor > topic.head_seq:
        res = topic.read(
            cursor,
            opts.limit,
            opts.max_bytes,
            node_filter,
            opts.include_tags,
            opts.include_meta,
            max_scan,
            opts.include_data,
            end,
        )
        after = cursor
        tomb = res.tombstone
        if tomb is not None:
            after = topic.earliest_seq - 1 if cursor > res.head_seq else tomb.gap_to
            fields: dict[str, JsonValue] = {
                "topic": name,
                "reason": "from_seq_too_old" if first else tomb.reason,
                "gap_from": tomb.gap_from,
                "gap_to": tomb.gap_to,
                "earliest_seq": tomb.earliest_seq,
                "head_seq": tomb.head_seq,
            }
            body = ws_message("tombstone", fields) if ws else event(b"tombstone", fields)
            out.append(FrameRef(name, cursor, after, body, len(body), tomb=True))
        first = False
        nxt = res.next_from_seq
        if res.records:
            data = b"".join(
                (
                    b'{"op":"record","topic":' if ws else b'{"topic":',
                    topic.name_json,
                    b',"records":[',
                    b",".join(res.records),
                    b'],"from_seq":%d,"to_seq":%d,"head_seq":%d}' % (after, nxt, res.head_seq),
                )
            )
            body = ws_frame(data) if ws else b"event: record\ndata: " + data + b"\n\n"
            out.append(FrameRef(name, after, nxt, body, len(body)))
        elif nxt > after:
            out.append(FrameRef(name, after, nxt, None, 0))  # skipped only: no frame
        cursor = nxt
        if res.missing is not None:
            return out, cursor, res.missing  # the rest waits for a load
        if nxt == after and tomb is None:
            break  # no progress possible (defensive; the walk always moves or ends)
        if max_frames and len(out) >= max_frames:
            break
    return out, cursor, None


def send_nowait(sock: Sock, data: bytes) -> int:
    """One non-blocking `send` of a drain's shared bytes: how many the socket took (0
    when its buffer is full), or -1 when the connection is gone."""
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0
    except OSError:
        return -1


class Conn:
    """One open stream of a session (architecture §7.1)."""

    def __init__(self, session: Session, frames: int, max_bytes: int) -> None:
        self.session = session
        self.send_ch, self.recv_ch = trio.open_memory_channel[FrameRef](frames)
        self.max_bytes = max_bytes
        self.buffered_bytes = 0
        self.pos: dict[str, int] = dict(session.cursors)  # the stream's position
        self.mode: dict[str, int] = dict.fromkeys(session.topics, PULL)
        self.enqueued_to: dict[str, int] = {}
        self.lagged = False
        self.lagged_since: float | None = None
        self.first_read: set[str] = set(session.topics)
        self.announce: set[str] = set(session.topics)  # owe a `caught-up` at head
        # topics switched to pull only because a drain met bytes no longer in memory:
        # the stream was live and is not behind, so it owes no `caught-up`
        self.quiet_pull: set[str] = set()
        self.stop: bytes | None = None  # a terminal frame to write, then end
        self.stop_with_id = False  # prefix it with the `id:` of the position (shutdown)
        self.cancel_scope = trio.CancelScope()
        self.write_started: float | None = None  # when the current socket write began
        self.frames_written = 0
        self.last_write = 0.0  # Trio time of the last write (the heartbeat counts from it)
        # the direct socket path (set by the transport; None: every frame via the pump):
        # `direct(payload)` frames and sends without blocking and returns what the socket
        # did not take (None: the connection is broken); `raw_write` sends such a
        # remainder as is
        self.direct: Callable[[bytes], bytes | None] | None = None
        self.raw_write: Callable[[bytes | memoryview], Awaitable[None]] | None = None
        # the socket itself when the body is HTTP/1.1 chunks (a `LiveBatch`'s framing)
        self.sock: Sock | None = None
        self.idle = False  # the pump waits on an empty channel: the drain may write itself
        # bytes a direct write left unsent: the pump writes them first
        self.remainder: bytes | memoryview = b""
        # the single topic of the session (None: several, their `id:` lines differ)
        self.only: str | None = session.topics[0] if len(session.topics) == 1 else None
        # >= 0 only while the pump is parked, idle, live at this position of `only`, not
        # lagged, with nothing pending and `sock` set: a batch starting here is sent whole
        self.ready_at = -1
        # its deployment-wide connection slot (`WatchRegistry.slots`), given back when
        # its HTTP task ends, or handed to the stream that supersedes it
        self.slot: Slot | None = None
        self.batches_sent = 0  # drain batches this stream got as one `send` (or its start)

    def take_remainder(self) -> bytes | memoryview:
        """What a direct write left unsent (cleared): the pump sends it next, as is."""
        rest, self.remainder = self.remainder, b""
        return rest

    def park(self) -> None:
        """The pump is about to wait on its empty channel: whether the drain may write
        to the socket meanwhile (`idle`), and whether a whole batch may go in one send
        (`ready_at`). Called only when the receive will park: a receive that finds a frame
        queued still yields once, and the drain must not overtake that frame."""
        self.idle = idle = self.direct is not None and not self.pulling()
        only = self.only
        if (
            idle
            and only is not None
            and self.sock is not None
            and self.stop is None
            and not self.lagged
            and self.mode[only] == LIVE
        ):
            self.ready_at = self.enqueued_to[only]
        else:
            self.ready_at = -1

    def unpark(self) -> None:
        """The pump runs again: from here on only it writes to the socket."""
        self.idle = False
        self.ready_at = -1

    def push(self, batch: LiveBatch, now: float) -> bool:
        """Hand a drain's batch to this connection without ever waiting: parked at its
        start, one non-blocking send of the shared bytes; otherwise frame by frame
        (`offer`). `now` is the drain's Trio time (the heartbeat counts from the write).

        Returns False when the connection is gone (the caller detaches it)."""
        if self.ready_at != batch.first:
            return all(self.offer(ref) for ref in batch.frames)
        # the hot path of a fan-out: one send, a few stores
        wire = batch.wire
        last = batch.last
        name = batch.topic
        sent = 0
        if wire:
            assert self.sock is not None
            sent = send_nowait(self.sock, wire)
            if sent < 0:
                return False
            self.frames_written += 1
            self.batches_sent += 1
            self.last_write = now
        self.pos[name] = self.enqueued_to[name] = last
        if sent == len(wire):
            self.ready_at = last
            self.session.cursors[name] = last  # written: a reconnect resumes after it
            return True
        self.remainder = memoryview(wire)[sent:]  # shared bytes: no copy
        self.unpark()
        self.poke()
        return True

    def opts_for(self, name: str) -> WatchOptions:
        """The frame options of this stream's topic `name` (one set per session)."""
        return self.session.opts

    def on_deleted(self, name: str) -> None:
        """The topic was deleted: the pump reports it (`topic-deleted`)."""
        if self.mode.get(name) == LIVE:
            self.mode[name] = PULL
        self.poke()

    def set_pull(self, name: str, *, quiet: bool = False) -> None:
        """Switch one topic to pull; the pump catches it up from its position (`quiet`:
        only to load bytes a drain did not find in memory; the catch-up then ends
        without a `caught-up`, as the live frames it stands for would have)."""
        if self.mode.get(name) == LIVE:
            self.mode[name] = PULL
            if quiet:
                self.quiet_pull.add(name)
            self.poke()
        if not quiet:
            self.quiet_pull.discard(name)

    def mark_lagged(self) -> None:
        """The channel is full: buffer nothing more, every topic reads from the log."""
        self.ready_at = -1
        self.quiet_pull.clear()
        if not self.lagged:
            self.lagged = True
            self.lagged_since = trio.current_time()
            self.session.registry_lagged()
        for name, mode in self.mode.items():
            if mode == LIVE:
                self.mode[name] = PULL

    def offer(self, ref: FrameRef) -> bool:
        """Hand a frame to this connection without ever waiting (architecture §7.3).

        Returns False when the connection is gone (the caller detaches it)."""
        name = ref.topic
        if self.mode.get(name) != LIVE:
            return True  # pull mode: the pump reads from its position
        if self.lagged:
            self.mode[name] = PULL  # rejoined live while others still catch up: re-read
            self.quiet_pull.discard(name)
            return True
        if self.enqueued_to.get(name) != ref.from_seq:
            self.set_pull(name)  # range mismatch: never guess
            return True
        if self.idle and self.direct is not None and self.stop is None:
            return self._write_now(ref)
        if self.buffered_bytes + ref.nbytes > self.max_bytes:
            self.mark_lagged()
            return True
        try:
            self.send_ch.send_nowait(ref)
        except trio.WouldBlock:
            self.mark_lagged()  # stop buffering for this connection
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        self.buffered_bytes += ref.nbytes
        self.enqueued_to[name] = ref.to_seq
        return True

    def poke(self) -> None:
        """Wake the pump (best effort: a full channel means the pump is busy anyway).
        Whatever pokes changed the stream's state: no whole batch goes out until the pump
        has looked at it."""
        self.ready_at = -1
        with contextlib.suppress(
            trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
        ):
            self.send_ch.send_nowait(_POKE)

    def _write_now(self, ref: FrameRef) -> bool:
        """The drain writes the frame to the idle stream's socket itself (no task switch,
        no channel); what the socket does not take now, the pump writes next."""
        assert self.direct is not None
        name = ref.topic
        pos = self.pos
        pos[name] = ref.to_seq
        self.enqueued_to[name] = ref.to_seq
        if ref.body is None:
            return True  # the range only moves the cursor
        left = self.direct(b"id: " + composite_id(pos) + b"\n" + ref.body)
        if left is None:
            return False  # the connection is gone
        self.frames_written += 1
        self.last_write = trio.current_time()
        if left:
            self.remainder = left
            self.unpark()
            self.poke()
        elif self.session.conn is self:
            self.session.cursors.update(pos)  # written: a reconnect resumes after it
        return True

    def advise(self, body: bytes) -> bool:
        """Queue an advisory frame (no `id:`, moves no cursor). False when the channel is
        full or gone: advisories are the one frame kind that may be dropped (R4)."""
        if self.lagged or self.buffered_bytes + len(body) > self.max_bytes:
            return False
        try:
            self.send_ch.send_nowait(FrameRef("", 0, 0, body, len(body)))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        self.buffered_bytes += len(body)
        return True

    def stopping(self) -> bool:
        return self.stop is not None

    def pulling(self) -> bool:
        return PULL in self.mode.values()

    def finished(self) -> bool:
        """Every topic is terminal: the stream ends."""
        return all(m == DONE for m in self.mode.values())


@dataclass(eq=False)
class Session:
    wid: str
    key_id: str | None  # the creating key (None in dev mode)
    topics: list[str]
    instances: dict[str, Topic]
    cursors: dict[str, int]  # authoritative: positions already written to a stream
    opts: WatchOptions
    heartbeat_ms: int
    last_used: float
    stats: WatchStats
    conn: Conn | None = None
    streams: int = 0
    # its hold on the deployment-wide `max_watch_sessions` (`WatchRegistry.slots`)
    slot: Slot | None = None

    def registry_lagged(self) -> None:
        self.stats.lagged += 1


@dataclass
class WatchStats:
    sessions_created: int = 0
    sessions_reclaimed: int = 0
    streams_opened: int = 0
    streams_direct: int = 0  # of those, served on the direct socket path
    lagged: int = 0  # topicd_sse_lagged_total
    slow_closed: int = 0
    advisories: int = 0  # pacing `error` 429 frames queued
    advisories_dropped: int = 0  # ... and dropped at a full channel


@dataclass
class Group:
    """The live connections of one topic that share frame options."""

    opts: WatchOptions
    conns: list[Watcher] = field(default_factory=list)


class WatchRegistry:
    """Every watch session and connection, and which connections watch which topic."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.sessions: dict[str, Session] = {}
        # insertion-ordered sets of the connections (SSE and WebSocket) watching a topic
        self.watchers: dict[Topic, dict[Watcher, None]] = {}
        self.ws_conns: dict[WsConn, None] = {}  # open WebSocket connections
        self.conns: dict[Conn, None] = {}
        self.strong: dict[Topic, int] = {}  # streams with `consistency:"strong"` per topic
        self._groups: dict[Topic, list[Group]] = {}  # groups() cache
        self.per_key: dict[str, int] = {}  # SSE connections per key (watch and `/work`)
        self.other_streams = 0  # open SSE connections that are not watch streams (`/work`)
        self._released = trio.lowlevel.ParkingLot()  # woken whenever a stream closes
        self.stats = WatchStats()
        self.catchup = trio.CapacityLimiter(cfg.sse.catchup_concurrency)
        self.shutting_down = False
        # the deployment-wide caps (several processes serve it: `topicd.engine.slots`);
        # None: this process's own counts are the caps, checked here
        self.slots: ConnectionSlots | None = None

    # ---- sessions -------------------------------------------------------------------

    def reclaim_idle(self) -> int:
        """Drop sessions with no open stream whose last use is older than the TTL."""
        ttl = self.cfg.watch.session_ttl_ms / 1000
        now = trio.current_time()
        stale = [
            wid for wid, s in self.sessions.items() if s.conn is None and now - s.last_used > ttl
        ]
        for wid in stale:
            slot = self.sessions.pop(wid).slot
            if slot is not None and self.slots is not None:
                self.slots.release_session(slot)
        self.stats.sessions_reclaimed += len(stale)
        return len(stale)

    def check_session_cap(self) -> None:
        """`429 {limit}` at `max_watch_sessions` (with deployment-wide `slots`, the
        count is theirs: `count_session`)."""
        cap = self.cfg.limits.max_watch_sessions
        if cap and self.slots is None and len(self.sessions) >= cap:
            raise Throttled.limit("max_watch_sessions", cap)

    async def count_session(self, session: Session) -> None:
        """With deployment-wide `slots` and the cap on, `session` (just stored) takes its
        slot there; refused (`429`, `503`) or cancelled, it is dropped again."""
        if self.slots is None or not self.cfg.limits.max_watch_sessions:
            await trio.lowlevel.checkpoint()
            return  # (this process's own count decided: `check_session_cap`)
        counted = False
        try:
            session.slot = await self.slots.acquire_session()
            counted = True
        finally:
            if not counted:
                self.sessions.pop(session.wid, None)
                self.stats.sessions_created -= 1

    def create(
        self,
        key_id: str | None,
        topics: list[tuple[Topic, int]],
        opts: WatchOptions,
        heartbeat_ms: int,
    ) -> Session:
        """Store a validated session. `topics`: (instance, resolved start) in order."""
        self.check_session_cap()
        wid = "wid_" + base64.urlsafe_b64encode(secrets.token_bytes(16)).rstrip(b"=").decode()
        session = Session(
            wid,
            key_id,
            [t.name for t, _ in topics],
            {t.name: t for t, _ in topics},
            {t.name: start for t, start in topics},
            opts,
            heartbeat_ms,
            trio.current_time(),
            self.stats,
        )
        self.sessions[wid] = session
        self.stats.sessions_created += 1
        return session

    def lookup(self, wid: str) -> Session:
        """The session of a stream open (`404` when unknown or reclaimed)."""
        self.reclaim_idle()
        session = self.sessions.get(wid)
        if session is None:
            raise NotFound("unknown or expired watch session; create a new one with POST")
        return session

    @staticmethod
    def check_key(session: Session, key_id: str | None) -> None:
        """The stream must present the key that created the session (auth on)."""
        if key_id is None:
            raise Unauthorized("this watch stream needs the key that created the session")
        if key_id != session.key_id:
            raise Unauthorized("this watch session belongs to another key")

    # ---- connections ----------------------------------------------------------------

    def open_stream(
        self, session: Session, rewind: dict[str, int] | None, slot: Slot | None = None
    ) -> Conn:
        """Register a stream (caps checked here, or by `slot` taken from the
        deployment-wide `slots`); a previous stream is superseded, and hands its slot
        on when the stream brings none."""
        old = session.conn
        key = session.key_id
        self.check_sse_caps(key, replacing=old is not None)
        if old is not None:
            if slot is None:
                slot, old.slot = old.slot, None
            old.stop = error_frame(409, "superseded by a newer stream for this watch session")
            self.close(old)
            old.cancel_scope.deadline = trio.current_time() + 1.0  # bounded last write
        if rewind:
            cursors = session.cursors
            for name, seq in rewind.items():
                if name in cursors and seq < cursors[name]:
                    cursors[name] = seq  # rewind only, never advance
        sse = self.cfg.sse
        conn = Conn(session, sse.channel_frames, sse.channel_bytes)
        conn.slot = slot
        session.conn = conn
        session.streams += 1
        session.last_used = trio.current_time()
        self.conns[conn] = None
        if key is not None:
            self.per_key[key] = self.per_key.get(key, 0) + 1
        strong = session.opts.strong
        for topic in session.instances.values():
            if not topic.deleted:
                self.watchers.setdefault(topic, {})[conn] = None
                self._groups.pop(topic, None)
                if strong:
                    self.strong[topic] = self.strong.get(topic, 0) + 1
        self.stats.streams_opened += 1
        return conn

    def sse_connections(self) -> int:
        """Open SSE connections of every kind (the `max_sse_connections` count)."""
        return len(self.conns) + self.other_streams

    async def wait_streams_below(self, n: int) -> None:
        """Return once fewer than `n` SSE connections (of every kind) are open."""
        while self.sse_connections() >= n:
            await self._released.park()

    def check_sse_caps(self, key: str | None, *, replacing: bool = False) -> None:
        """`429 {limit}` when one more SSE connection (for `key`; None in dev mode)
        would pass a cap; `replacing`: it takes over an open one. With deployment-wide
        `slots`, the stream's slot was taken there (nothing to check here)."""
        if self.slots is not None:
            return
        limits = self.cfg.limits
        live = self.sse_connections() - replacing
        if limits.max_sse_connections and live >= limits.max_sse_connections:
            raise Throttled.limit("max_sse_connections", limits.max_sse_connections)
        if key is not None and limits.max_sse_connections_per_key:
            used = self.per_key.get(key, 0) - replacing
            if used >= limits.max_sse_connections_per_key:
                raise Throttled.limit(
                    "max_sse_connections_per_key", limits.max_sse_connections_per_key
                )

    def reserve_stream(self, key: str | None) -> None:
        """Take an SSE connection slot for a stream that is not a watch (`/work`)."""
        self.check_sse_caps(key)
        self.other_streams += 1
        if key is not None:
            self.per_key[key] = self.per_key.get(key, 0) + 1

    def release_stream(self, key: str | None) -> None:
        """Give back a `reserve_stream` slot (exactly once per reservation)."""
        self.other_streams -= 1
        self._released.unpark_all()
        if key is not None:
            left = self.per_key.get(key, 1) - 1
            if left:
                self.per_key[key] = left
            else:
                self.per_key.pop(key, None)

    def close(self, conn: Watcher) -> None:
        """Unregister a stream (synchronous, idempotent). The session keeps its cursors."""
        if conn in self.ws_conns:
            conn.detach()
            return
        if conn not in self.conns:
            return
        assert isinstance(conn, Conn)
        del self.conns[conn]
        conn.ready_at = -1  # a drain holding the old group list must not write to it
        self._released.unpark_all()
        session = conn.session
        if session.conn is conn:
            session.conn = None
            session.last_used = trio.current_time()
        key = session.key_id
        if key is not None:
            left = self.per_key.get(key, 1) - 1
            if left:
                self.per_key[key] = left
            else:
                self.per_key.pop(key, None)
        strong = session.opts.strong
        for topic in session.instances.values():
            watchers = self.watchers.get(topic)
            if watchers is not None and watchers.pop(conn, 0) is None:
                self._groups.pop(topic, None)
                if not watchers:
                    del self.watchers[topic]
                if strong:
                    left = self.strong[topic] - 1
                    if left:
                        self.strong[topic] = left
                    else:
                        del self.strong[topic]
        conn.send_ch.close()

    def groups(self, topic: Topic) -> list[Group]:
        """The topic's connections grouped by frame options (one frame build per group);
        cached until a stream of the topic opens or closes."""
        cached = self._groups.get(topic)
        if cached is not None:
            return cached
        conns = self.watchers.get(topic)
        if not conns:
            return []
        groups: dict[WatchOptions, Group] = {}
        for conn in conns:
            opts = conn.opts_for(topic.name)
            group = groups.get(opts)
            if group is None:
                group = groups[opts] = Group(opts)
            group.conns.append(conn)
        out = self._groups[topic] = list(groups.values())
        return out

    def has_strong(self, topic: Topic) -> bool:
        return topic in self.strong

    def topic_deleted(self, topic: Topic) -> None:
        """Every stream watching `topic` sends `topic-deleted` for it."""
        self.strong.pop(topic, None)
        self._groups.pop(topic, None)
        for conn in self.watchers.pop(topic, {}):
            conn.on_deleted(topic.name)

    def advise_paused(self, paused: Callable[[Topic], bool], retry_after_ms: int) -> None:
        """One advisory `error` frame (`code` 429) to every stream watching a topic whose
        push the governor paused (api-routers-watch §2.6; scheduler spec B.5)."""
        message = "push paused under load"
        for conn in list(self.conns):
            session = conn.session
            names = [
                name
                for name in session.topics
                if (t := session.instances.get(name)) is not None and not t.deleted and paused(t)
            ]
            if not names:
                continue
            data = orjson.dumps(
                {
                    "code": 429,
                    "error": message,
                    "message": message,
                    "retry_after_ms": retry_after_ms,
                    "topics": names,
                }
            )
            if conn.advise(b"event: error\ndata: " + data + b"\n\n"):
                self.stats.advisories += 1
            else:
                self.stats.advisories_dropped += 1

    def shutdown(self) -> None:
        """Graceful drain: every stream ends with the terminal `server_shutting_down`."""
        self.shutting_down = True
        for conn in list(self.conns):
            conn.stop = error_frame("server_shutting_down", "the server is shutting down")
            conn.stop_with_id = True
            conn.poke()
        for ws in list(self.ws_conns):
            ws.shutdown()

    def slow(self, now: float, timeout_s: float) -> list[Watcher]:
        """Connections (SSE and WebSocket) whose current socket write has been blocked
        longer than timeout."""
        every: list[Watcher] = [*self.conns, *self.ws_conns]
        return [
            c for c in every if c.write_started is not None and now - c.write_started > timeout_s
        ]


# ---- the pump -------------------------------------------------------------------------


def catch_up(
    conn: Conn, max_scan: int, now_ms: int, enforce: Callable[[Topic], None]
) -> tuple[list[bytes], bool, tuple[Topic, int] | None]:
    """One catch-up pass over the topics in pull mode (architecture §7.5).

    Synchronous: builds at most `CATCHUP_FRAMES` frames per topic, in session order,
    moves the stream position, and switches a topic to live in the same step that finds
    it at its head. Returns (the bytes to write, whether anything moved, the first
    record found only in its segment: the pump loads it and passes again).
    """
    out: list[bytes] = []
    moved = False
    miss: tuple[Topic, int] | None = None
    session = conn.session
    opts = session.opts
    pos = conn.pos
    mode = conn.mode
    for name in session.topics:
        if mode[name] != PULL:
            continue
        topic = session.instances[name]
        if topic.deleted:
            mode[name] = DONE
            out.append(b"id: " + composite_id(pos) + b"\n" + deleted_frame(name))
            moved = True
            continue
        enforce(topic)  # TTL expiry first: what expired is a tombstone, never a record
        bound = topic.durable_head if opts.strong else topic.head_seq
        cur = pos[name]
        first = name in conn.first_read
        conn.first_read.discard(name)
        if cur < bound or cur > topic.head_seq:
            frames, _, missing = build_frames(
                topic, cur, bound, opts, max_scan, first_read=first, max_frames=CATCHUP_FRAMES
            )
            if missing is not None and miss is None:
                miss = (topic, missing)
            for ref in frames:
                pos[name] = ref.to_seq
                if ref.body is not None:
                    out.append(b"id: " + composite_id(pos) + b"\n" + ref.body)
                    if name not in conn.quiet_pull:
                        conn.announce.add(name)
            if frames:
                moved = True
                topic.last_read_ts = now_ms  # watch delivery is a read (recency)
                topic.mark_changed()
        if pos[name] >= bound and pos[name] <= topic.head_seq:
            mode[name] = LIVE  # at the head: the drains feed it from here
            conn.quiet_pull.discard(name)
            conn.enqueued_to[name] = pos[name]
            if name in conn.announce:
                conn.announce.discard(name)
                out.append(b"id: " + composite_id(pos) + b"\n" + caught_up_frame(topic))
    if conn.lagged and PULL not in mode.values():
        conn.lagged = False
        conn.lagged_since = None
    return out, moved, miss


async def pump(
    conn: Conn,
    registry: WatchRegistry,
    write: Callable[[bytes], Awaitable[None]],
    *,
    retry_ms: int,
    max_scan: int,
    now_ms: Callable[[], int],
    enforce: Callable[[Topic], None],
    payloads: PayloadCache,
) -> None:
    """Produce and write the stream (architecture §7.4) until it ends or is cancelled.

    A catch-up that meets records whose bytes are only in their segments loads them
    (offloaded, `payloads`) and passes again, holding them until that pass used them."""
    session = conn.session
    hold: Hold | None = None
    heartbeat = session.heartbeat_ms / 1000
    recv = conn.recv_ch
    pos = conn.pos

    async def emit(chunk: bytes | memoryview, raw: bool = False) -> None:
        conn.write_started = trio.current_time()
        if raw:
            assert conn.raw_write is not None
            await conn.raw_write(chunk)
        else:
            assert isinstance(chunk, bytes)
            await write(chunk)
        conn.write_started = None
        conn.last_write = trio.current_time()
        conn.frames_written += 1
        if session.conn is conn:
            session.cursors.update(pos)  # written: a reconnect resumes after it

    try:
        await emit(b"retry: %d\n\n" % retry_ms + HEARTBEAT)
        while True:
            if conn.remainder:
                # the rest of a frame the drain wrote directly: first, and as is
                rest, conn.remainder = conn.remainder, b""
                conn.frames_written -= 1  # counted when the drain wrote its start
                await emit(rest, raw=True)
                continue
            if conn.stop is not None:
                if conn.stop_with_id:
                    await emit(b"id: " + composite_id(pos) + b"\n" + conn.stop)
                else:
                    await emit(conn.stop)
                return
            if conn.pulling() and recv.statistics().current_buffer_used == 0:
                async with registry.catchup:
                    out, moved, miss = catch_up(conn, max_scan, now_ms(), enforce)
                if hold is not None:
                    hold.__exit__(None, None, None)  # the pass used what it loaded
                    hold = None
                if out:
                    await emit(b"".join(out))
                if conn.finished():
                    return
                if miss is not None:
                    hold = payloads.hold()
                    topic, seq = miss
                    opts = session.opts
                    try:
                        await payloads.load(topic, seq, opts.limit, opts.max_bytes, hold)
                    except TopicdError as exc:  # unreadable or corrupt: counted, logged
                        await emit(error_frame(exc.code, exc.message, topic=topic.name))
                        return
                    continue
                if moved:
                    continue
            ref: FrameRef | None = None
            if recv.statistics().current_buffer_used == 0:
                conn.park()  # this receive will park: the drain may write meanwhile
            try:
                with trio.move_on_at(conn.last_write + heartbeat):
                    ref = await recv.receive()
            except trio.EndOfChannel:
                if not conn.stopping():
                    return
                continue  # superseded: write the terminal frame
            finally:
                conn.unpark()
            if ref is None:
                if trio.current_time() < conn.last_write + heartbeat:
                    continue  # the drain wrote meanwhile: silence starts from there
                # the heartbeat is the pump's own timer: never queued behind frames
                await emit(HEARTBEAT)
                continue
            out = []
            size = 0
            while True:
                conn.buffered_bytes -= ref.nbytes
                name = ref.topic
                if name:
                    cur = pos.get(name, -1)
                    if ref.from_seq == cur:
                        pos[name] = ref.to_seq
                        if ref.body is not None:
                            out.append(b"id: " + composite_id(pos) + b"\n" + ref.body)
                            size += ref.nbytes
                    elif ref.to_seq > cur:
                        conn.set_pull(name)  # not contiguous: re-read from the position
                elif ref.body is not None:
                    out.append(ref.body)  # an advisory frame: no id, no cursor
                    size += ref.nbytes
                if size >= COALESCE_BYTES or len(out) >= COALESCE_FRAMES or conn.stop:
                    break
                try:
                    ref = recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            if out:
                rest = conn.take_remainder()
                if rest:
                    # an item handed to the parked receive (an advisory) came before the
                    # drain's direct write stopped mid-frame: that frame's rest goes first
                    conn.frames_written -= 1  # counted when the drain wrote its start
                    await emit(rest, raw=True)
                await emit(b"".join(out))
    finally:
        if hold is not None:
            hold.__exit__(None, None, None)
        registry.close(conn)
