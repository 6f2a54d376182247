"""WebSocket subscriptions on the watch machinery (api-routers-watch §3; architecture §7).

A WebSocket connection (`WsConn`) subscribes and unsubscribes topics one command at a
time, each subscription (`Sub`) with its own position and frame options. Delivery is the
SSE watch's live path, not a loop per connection:

* **live**: the topic's drain builds each frame once per options group — WebSocket groups
  get complete, unmasked text frames (`ws_frame`), so one encoding is written to every
  connection — and hands the drain's frames to each connection as one `LiveBatch`
  (`WsConn.push`), which never waits. While the writer is parked on an empty queue and
  the connection has a single live subscription at the batch's start (`ready_at`), the
  batch's shared bytes go to the socket in one non-blocking `send`; otherwise each frame
  is offered (`WsConn.offer`): written to the socket by the drain itself while the writer
  is parked (`direct`), else put into the connection's outbound queue,
  `watch.ws_outbound_queue` messages (and at most `sse.channel_bytes` bytes of shared
  frames). A full queue marks the connection **lagged**: nothing more is queued for it,
  every subscription switches to pull.
* **pull**: the writer (`ws_pump`) reads the subscription from its position through the
  diff path (`build_frames`): retained records in order, a `tombstone` with the exact
  range for what cap/TTL evicted meanwhile, then `caught_up`, and — in the same
  synchronous step that finds it at the head — switches it back to live. A lagged
  connection's cursors lag; nothing is dropped and no gap is silent.

Command replies (`subscribed`, `ack`, `pong`, `error`, ...) travel through the same
queue, so a client that stops reading stops having its commands answered: the reader
waits for room (`WsConn.reply`), which is the bound on what one connection can hold.
The per-connection memory bound is therefore `ws_outbound_queue` references to shared
frames or replies (at most `sse.channel_bytes` of live frames), plus one catch-up pass
being written (about `CATCHUP_BYTES` plus `CATCHUP_FRAMES` frames of one subscription),
plus the unsent rest of one direct write (a view into one shared batch).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import trio

from topicd.engine.watch import (
    LIVE,
    PULL,
    FrameRef,
    build_frames,
    caught_up_frame,
    send_nowait,
    ws_message,
)
from topicd.errors import TopicdError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from topicd.engine.payloads import Hold, PayloadCache
    from topicd.engine.topic import Topic
    from topicd.engine.watch import LiveBatch, Sock, WatchOptions, WatchRegistry
    from topicd.errors import JsonValue

CATCHUP_FRAMES: Final = 4  # frames one catch-up pass builds per subscription
CATCHUP_BYTES: Final = 262144  # ... and the bytes after which a pass stops
COALESCE_FRAMES: Final = 64  # queued messages one socket write may carry
COALESCE_BYTES: Final = 262144

Item = tuple["Sub | None", FrameRef]  # (the subscription a frame is for; None: a reply)
_POKE: Final[Item] = (None, FrameRef("", 0, 0, None, 0))


@dataclass(eq=False, slots=True)
class Sub:
    """One topic subscription of a connection."""

    topic: Topic
    opts: WatchOptions
    pos: int  # the last seq delivered (written or queued for writing)
    mode: int = PULL
    enqueued_to: int = -1  # live: the end of the last frame handed to the connection
    announce: bool = True  # owe a `caught_up` when it reaches the head
    quiet: bool = False  # pulling only to load bytes a drain missed: owes no `caught_up`


class WsConn:
    """One open `/v0/ws` connection: its subscriptions and its outbound queue."""

    def __init__(
        self, registry: WatchRegistry, key_id: str | None, queue: int, max_bytes: int
    ) -> None:
        self.registry = registry
        self.key_id = key_id  # the SSE-cap slot it holds (None in dev mode)
        self.subs: dict[str, Sub] = {}
        self.send_ch, self.recv_ch = trio.open_memory_channel[Item](queue)
        self.max_bytes = max_bytes
        self.buffered_bytes = 0
        self.lagged = False
        self.lagged_since: float | None = None
        self.stop: bytes | None = None  # a terminal message to write, then end
        self.draining = False  # `stop` is the graceful drain's (a close frame follows)
        self.closed = False
        self.cancel_scope = trio.CancelScope()
        self.write_started: float | None = None  # when the current socket write began
        self.frames_written = 0
        # the direct socket path (None: every frame via the writer): `direct(frame)` sends
        # without blocking and returns what the socket did not take (None: broken)
        self.direct: Callable[[bytes], bytes | None] | None = None
        self.sock: Sock | None = None  # the same socket, for a `LiveBatch` in one send
        self.idle = False  # the writer waits on an empty queue: the drain may write itself
        # bytes a direct write left unsent: the writer sends them first
        self.remainder: bytes | memoryview = b""
        self.next_pass = 0  # where the next catch-up pass starts (round robin)
        # >= 0 only while the writer is parked and the one subscription (`ready_sub`) is
        # live at this position, not lagged, nothing pending: a batch starting here goes
        # out in one send
        self.ready_at = -1
        self.ready_sub: Sub | None = None
        self.batches_sent = 0  # drain batches this stream got as one `send` (or its start)

    # ---- the drain's side (synchronous, never waits) ---------------------------------

    def opts_for(self, name: str) -> WatchOptions:
        return self.subs[name].opts

    def park(self) -> None:
        """The writer is about to wait on its empty queue (see `Conn.park`)."""
        self.idle = idle = self.direct is not None and not self.pulling()
        self.ready_at = -1
        self.ready_sub = None
        if idle and len(self.subs) == 1 and self.sock is not None and self.stop is None:
            (sub,) = self.subs.values()
            if sub.mode == LIVE and not self.lagged:
                self.ready_at = sub.enqueued_to
                self.ready_sub = sub

    def unpark(self) -> None:
        self.idle = False
        self.ready_at = -1
        self.ready_sub = None

    def push(self, batch: LiveBatch, now: float) -> bool:
        """Hand a drain's batch to this connection without waiting (see `Conn.push`;
        `now` is unused: a WebSocket has no heartbeat of its own). Returns False when the
        connection is gone (the caller detaches it)."""
        sub = self.ready_sub
        if self.ready_at != batch.first or sub is None or sub.topic.name != batch.topic:
            return all(self.offer(ref) for ref in batch.frames)
        wire = batch.wire
        sent = 0
        if wire:
            assert self.sock is not None
            sent = send_nowait(self.sock, wire)
            if sent < 0:
                return False
            self.frames_written += 1
            self.batches_sent += 1
        sub.pos = sub.enqueued_to = last = batch.last
        if sent == len(wire):
            self.ready_at = last
            return True
        self.remainder = memoryview(wire)[sent:]  # shared bytes: no copy
        self.unpark()
        self.poke()
        return True

    def offer(self, ref: FrameRef) -> bool:
        """Hand a shared frame to this connection without waiting (architecture §7.3).
        Returns False when the connection is gone (the caller detaches it)."""
        sub = self.subs.get(ref.topic)
        if sub is None or sub.mode != LIVE:
            return True  # unsubscribed meanwhile, or pulling from its position
        if self.lagged:
            sub.mode = PULL  # rejoined live while others still catch up: re-read
            sub.quiet = False
            return True
        if sub.enqueued_to != ref.from_seq:
            sub.mode = PULL  # range mismatch: never guess
            sub.quiet = False
            self.poke()
            return True
        if self.idle and self.direct is not None and self.stop is None:
            return self._write_now(sub, ref)
        if self.buffered_bytes + ref.nbytes > self.max_bytes:
            self.mark_lagged()
            return True
        try:
            self.send_ch.send_nowait((sub, ref))
        except trio.WouldBlock:
            self.mark_lagged()  # stop queueing for this connection
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        self.buffered_bytes += ref.nbytes
        sub.enqueued_to = ref.to_seq
        return True

    def _write_now(self, sub: Sub, ref: FrameRef) -> bool:
        """The drain writes the frame to the idle connection's socket itself; what the
        socket does not take now, the writer sends next."""
        assert self.direct is not None
        sub.pos = sub.enqueued_to = ref.to_seq
        if ref.body is None:
            return True  # the range only moves the position
        left = self.direct(ref.body)
        if left is None:
            return False
        self.frames_written += 1
        if left:
            self.remainder = left
            self.unpark()
            self.poke()
        return True

    def mark_lagged(self) -> None:
        """The queue is full: queue nothing more, every subscription reads the log."""
        self.ready_at = -1
        if not self.lagged:
            self.lagged = True
            self.lagged_since = trio.current_time()
            self.registry.stats.lagged += 1
        for sub in self.subs.values():
            if sub.mode == LIVE:
                sub.mode = PULL
                sub.quiet = False

    def on_deleted(self, name: str) -> None:
        """The topic was deleted: the writer reports it (`topic_deleted`)."""
        sub = self.subs.get(name)
        if sub is not None and sub.mode == LIVE:
            sub.mode = PULL
            sub.quiet = False
        self.poke()

    def poke(self) -> None:
        """Wake the writer (best effort: a full queue means it is busy anyway). Whatever
        pokes changed the connection's state: no whole batch goes out until the writer has
        looked at it."""
        self.ready_at = -1
        with contextlib.suppress(
            trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
        ):
            self.send_ch.send_nowait(_POKE)

    def pulling(self) -> bool:
        return any(sub.mode == PULL for sub in self.subs.values())

    def set_pull(self, name: str, *, quiet: bool = False) -> None:
        """Switch one subscription to pull (a drain met records whose bytes are only in
        their segment); the writer catches it up from its position, loading them
        (`quiet`: the subscription is not behind, so it owes no `caught_up` for it)."""
        sub = self.subs.get(name)
        if sub is not None and sub.mode == LIVE:
            sub.mode = PULL
            sub.quiet = quiet
            self.poke()

    # ---- subscriptions ----------------------------------------------------------------

    def subscribe(self, topic: Topic, opts: WatchOptions, start: int) -> None:
        """Start (or restart) delivering `topic` after `start`, pulling from the log
        first. A subscription of the same name is replaced (`unsubscribe` it first so
        nothing of it is written after the reply)."""
        self.unsubscribe(topic.name)
        self.subs[topic.name] = Sub(topic, opts, start)
        registry = self.registry
        if not topic.deleted:
            registry.watchers.setdefault(topic, {})[self] = None
            registry._groups.pop(topic, None)
        self.poke()

    def unsubscribe(self, name: str) -> bool:
        """Stop delivering `name` (its queued frames are dropped). False if unknown."""
        sub = self.subs.pop(name, None)
        if sub is None:
            return False
        if sub is self.ready_sub:
            self.ready_at = -1  # nothing of it is written after the reply
        registry = self.registry
        watchers = registry.watchers.get(sub.topic)
        if watchers is not None and watchers.pop(self, 0) is None:
            registry._groups.pop(sub.topic, None)
            if not watchers:
                del registry.watchers[sub.topic]
        return True

    # ---- replies and lifetime ---------------------------------------------------------

    async def reply(self, frame: bytes) -> None:
        """Queue a command reply (a complete frame), waiting for room: replies are never
        dropped, and a client that does not read is not answered further."""
        self.buffered_bytes += len(frame)
        try:
            await self.send_ch.send((None, FrameRef("", 0, 0, frame, len(frame))))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.buffered_bytes -= len(frame)

    def shutdown(self) -> None:
        """Graceful drain: the terminal `server_shutting_down` error, then the close."""
        self.draining = True
        self.stop = ws_message(
            "error",
            {
                "request_id": None,
                "code": "server_shutting_down",
                "message": "the server is shutting down",
            },
        )
        self.poke()

    def detach(self) -> None:
        """Unregister the connection (synchronous, idempotent): every subscription, the
        SSE-cap slot, the queue."""
        if self.closed:
            return
        self.closed = True
        for name in list(self.subs):
            self.unsubscribe(name)
        registry = self.registry
        registry.ws_conns.pop(self, None)
        registry.release_stream(self.key_id)
        self.send_ch.close()


def open_ws(registry: WatchRegistry, key_id: str | None, queue: int, max_bytes: int) -> WsConn:
    """Register a WebSocket connection; `429 {limit}` past the SSE connection caps."""
    registry.reserve_stream(key_id)
    conn = WsConn(registry, key_id, queue, max_bytes)
    registry.ws_conns[conn] = None
    return conn


def topic_deleted_frame(name: str) -> bytes:
    return ws_message("topic_deleted", {"topic": name, "head_seq": 0, "reason": "deleted"})


def catch_up(
    conn: WsConn, max_scan: int, now_ms: int, enforce: Callable[[Topic], None]
) -> tuple[list[bytes], bool, tuple[Topic, Sub, int] | None]:
    """One catch-up pass over the subscriptions in pull mode (architecture §7.5).

    Synchronous: builds at most `CATCHUP_FRAMES` frames per subscription, moves its
    position, and switches it to live in the same step that finds it at the head. A
    pass stops once it holds `CATCHUP_BYTES` (so it holds at most that plus
    `CATCHUP_FRAMES` frames of one subscription); each pass starts one subscription
    further on, so a long backlog does not starve the others. Returns (the frames to
    write, whether anything moved, the first subscription stopped at a record whose
    bytes are only in its segment: the writer loads them and passes again)."""
    out: list[bytes] = []
    size = 0
    moved = False
    miss: tuple[Topic, Sub, int] | None = None
    items = list(conn.subs.items())
    if items:
        k = conn.next_pass % len(items)
        items = items[k:] + items[:k]
        conn.next_pass += 1
    for name, sub in items:
        if size >= CATCHUP_BYTES:
            moved = True  # the rest on the next pass
            break
        if sub.mode != PULL:
            continue
        topic = sub.topic
        if topic.deleted:
            conn.unsubscribe(name)  # `topic_deleted` also drops the subscription
            out.append(topic_deleted_frame(name))
            moved = True
            continue
        enforce(topic)  # TTL expiry first: what expired is a tombstone, never a record
        head = topic.head_seq
        if sub.pos < head or sub.pos > head:
            frames, _, missing = build_frames(
                topic, sub.pos, head, sub.opts, max_scan, max_frames=CATCHUP_FRAMES
            )
            if missing is not None and miss is None:
                miss = (topic, sub, missing)
            for ref in frames:
                sub.pos = ref.to_seq
                if ref.body is not None:
                    out.append(ref.body)
                    size += ref.nbytes
                    sub.announce = sub.announce or not sub.quiet
            if frames:
                moved = True
                topic.last_read_ts = now_ms  # delivery is a read (recency)
        if sub.pos == topic.head_seq:
            sub.mode = LIVE  # at the head: the drains feed it from here
            sub.quiet = False
            sub.enqueued_to = sub.pos
            if sub.announce:
                sub.announce = False
                out.append(caught_up_frame(topic, ws=True))
    if conn.lagged and not conn.pulling():
        conn.lagged = False
        conn.lagged_since = None
    return out, moved, miss


async def ws_pump(
    conn: WsConn,
    write: Callable[[Sequence[bytes | memoryview]], Awaitable[None]],
    *,
    catchup: trio.CapacityLimiter,
    max_scan: int,
    now_ms: Callable[[], int],
    enforce: Callable[[Topic], None],
    payloads: PayloadCache,
) -> None:
    """Write the connection's outbound messages until it stops or is cancelled: queued
    replies and live frames in order, catch-up reads whenever the queue is empty. A
    catch-up that meets records whose bytes are only in their segments loads them
    (offloaded, `payloads`) and passes again, holding them until that pass used them."""
    recv = conn.recv_ch
    hold: Hold | None = None

    async def emit(frames: Sequence[bytes | memoryview]) -> None:
        if conn.remainder:
            # the rest of a frame the drain began writing: first, whatever woke the
            # writer (a reply handed over while it was parked may precede that frame)
            frames = [conn.remainder, *frames]
            conn.remainder = b""
            conn.frames_written -= 1  # counted when the drain wrote its start
        conn.write_started = trio.current_time()
        await write(frames)
        conn.write_started = None
        conn.frames_written += 1

    try:
        while True:
            if conn.remainder:
                await emit([])  # (emit writes the remainder first)
                continue
            if conn.stop is not None:
                await emit([conn.stop])
                return
            if conn.pulling() and recv.statistics().current_buffer_used == 0:
                async with catchup:
                    out, moved, miss = catch_up(conn, max_scan, now_ms(), enforce)
                if hold is not None:
                    hold.__exit__(None, None, None)  # the pass used what it loaded
                    hold = None
                if out:
                    await emit(out)
                if miss is not None:
                    topic, missed, seq = miss
                    hold = payloads.hold()
                    try:
                        await payloads.load(
                            topic, seq, missed.opts.limit, missed.opts.max_bytes, hold
                        )
                    except TopicdError as exc:  # unreadable or corrupt: counted, logged
                        # the subscription ends with the error; the connection and its
                        # other subscriptions go on
                        conn.unsubscribe(topic.name)
                        fields: dict[str, JsonValue] = {
                            "request_id": None,
                            "code": exc.code,
                            "message": exc.message,
                            "topic": topic.name,
                        }
                        await emit([ws_message("error", fields)])
                    continue
                if moved:
                    continue
            # parked only when this receive will park: a receive that finds a message
            # queued still yields once, and the drain must not overtake that message
            if recv.statistics().current_buffer_used == 0:
                conn.park()
            try:
                item = await recv.receive()
            except trio.EndOfChannel:
                return
            finally:
                conn.unpark()
            out = []
            size = 0
            subs = conn.subs
            while True:
                sub, ref = item
                conn.buffered_bytes -= ref.nbytes
                if sub is None:
                    if ref.body is not None:
                        out.append(ref.body)  # a reply
                        size += ref.nbytes
                elif subs.get(ref.topic) is sub:  # (else: unsubscribed or replaced meanwhile)
                    if ref.from_seq == sub.pos:
                        sub.pos = ref.to_seq
                        if ref.body is not None:
                            out.append(ref.body)
                            size += ref.nbytes
                    elif ref.to_seq > sub.pos and sub.mode == LIVE:
                        sub.mode = PULL  # not contiguous: re-read from the position
                        sub.quiet = False
                if size >= COALESCE_BYTES or len(out) >= COALESCE_FRAMES or conn.stop:
                    break
                try:
                    item = recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            if out:
                await emit(out)
    finally:
        if hold is not None:
            hold.__exit__(None, None, None)  # what a cancelled pass loaded
