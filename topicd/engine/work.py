"""`GET /v0/topics/:q/work`: push workers over SSE (one `WorkConn` per stream).

The server keeps up to `max` jobs leased to a stream and pushes each as an `event: job`
frame; the worker acks, nacks and extends with the ordinary endpoints. The pump
(`work_pump`) is the stream's one task:

    deficit = max - leases this stream still holds
    if deficit > 0: claim `deficit` jobs through the claim path (cohort included), write
    then wait for a refill signal, at most `queue.work_poll_ms`; `: hb` after
    `queue.work_heartbeat_ms` without other output

The refill signal is a channel of capacity 1: the queue kicks every attached stream
when something can free depth or make a job claimable (an append, ack, nack, release,
expiry, delete); a kick that finds the signal already pending is coalesced into it, so
the channel never holds more than one item and a kick never waits. The poll is only the
fallback the contract names; every change the queue sees wakes the stream at once.

Writes go straight to the connection (the direct socket path's chunked send, or the
ASGI send on Hypercorn), at most one refill's frames at a time: a stream buffers
nothing beyond the jobs it holds. A write blocked longer than
`watch.slow_consumer_timeout_ms` ends the stream (the engine's watchdog).

However the stream ends (clean close, broken pipe, cancellation, shutdown), its leases
still held are released in the pump's `finally`, synchronously: the jobs are claimable at
once with their delivery counters kept, and no retry backoff applies.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import TYPE_CHECKING, Final

import trio

from topicd.engine.watch import HEARTBEAT, error_frame
from topicd.errors import TopicdError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from topicd.engine.queues import QueueService
    from topicd.engine.topic import Topic

NO_LONGER_A_QUEUE: Final = "topic is no longer a queue"
# the longest a stream's end waits for the queue's owner process to release its leases
# (beyond, they expire at their deadlines instead)
REMOTE_RELEASE_S: Final = 2.0


class WorkConn:
    """One open `/work` stream: its target depth, its leases and its refill signal."""

    def __init__(
        self, topic: Topic, node: str, want: int, lease_ms: int | None, key_id: str | None
    ) -> None:
        self.topic = topic  # the instance the stream opened on (a re-created one is not it)
        self.node = node
        self.want = want
        self.lease_ms = lease_ms  # None: the topic's `lease_ms` at each claim
        self.key_id = key_id  # the SSE cap slot's key (None in dev mode)
        self.held: dict[int, int] = {}  # seq -> lease id of each job pushed on this stream
        # the queue runs on another process (`engine.forward`): its owner counts this
        # stream's leases at each refill (`QueueService.claim_for_work`)
        self.remote = False
        self.stream_id = secrets.token_hex(8)  # (names the stream to that owner)
        self._kick_send, self.kicks = trio.open_memory_channel[None](1)
        self.cancel_scope = trio.CancelScope()
        self.stop: bytes | None = None  # a terminal frame to write, then end
        self.advisory: bytes | None = None  # one pending pacing frame (latest dropped)
        self.write_started: float | None = None  # when the current write began
        self.last_write = 0.0  # Trio time of the last write (the heartbeat counts from it)
        self.jobs_sent = 0

    def kick(self) -> None:
        """Signal the pump to re-check (never waits; a pending signal absorbs this one)."""
        with contextlib.suppress(
            trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
        ):
            self._kick_send.send_nowait(None)

    def in_flight(self) -> int:
        """Leases pushed on this stream that are still held (acked, nacked, expired or
        re-leased ones are forgotten here); 0 for a stream whose queue runs elsewhere
        (the owner counts them when asked for the refill)."""
        if self.remote:
            return 0
        q = self.topic.queue
        if q is None:
            self.held.clear()
            return 0
        leases = q.leases
        gone = [
            seq
            for seq, lease_id in self.held.items()
            if (lease := leases.get(seq)) is None or lease.lease_id != lease_id
        ]
        for seq in gone:
            del self.held[seq]
        return len(self.held)


def job_frame(topic: Topic, item: bytes) -> bytes:
    """`id: <$seq>`, `event: job`, and the claim item with `topic` first."""
    assert item.startswith(b'{"$seq":')
    end = item.index(b",", 8)
    seq = item[8:end]
    return b"".join(
        (b"id: ", seq, b'\nevent: job\ndata: {"topic":', topic.name_json, b",", item[1:], b"\n\n")
    )


async def work_pump(
    conn: WorkConn,
    service: QueueService,
    write: Callable[[bytes], Awaitable[None]],
    *,
    retry_ms: int,
    heartbeat_ms: int,
    poll_ms: int,
) -> None:
    """Produce and write the stream until it ends or is cancelled (module docstring).
    Always releases the stream's leases and detaches it on the way out."""
    topic = conn.topic
    heartbeat = heartbeat_ms / 1000
    poll = poll_ms / 1000

    async def emit(chunk: bytes) -> None:
        conn.write_started = trio.current_time()
        await write(chunk)
        conn.write_started = None
        conn.last_write = trio.current_time()

    try:
        await emit(b"retry: %d\n\n" % retry_ms + HEARTBEAT)
        while True:
            if conn.stop is not None:
                await emit(conn.stop)
                return
            if topic.deleted or topic.queue is None:
                await emit(error_frame(409, NO_LONGER_A_QUEUE, topic=topic.name))
                return
            out: list[bytes] = []
            if conn.advisory is not None:
                out.append(conn.advisory)
                conn.advisory = None
            deficit = conn.want - conn.in_flight()
            if deficit > 0:
                try:
                    items = await service.claim_for_work(conn, deficit)
                except TopicdError:
                    # the topic went away meanwhile: its delete kicked this stream, so
                    # the wait below returns at once and the check above ends it
                    items = []
                out.extend(job_frame(topic, item) for item in items)
                conn.jobs_sent += len(items)
            if out:
                await emit(b"".join(out))
            with trio.move_on_at(min(trio.current_time() + poll, conn.last_write + heartbeat)):
                await conn.kicks.receive()
                continue
            if trio.current_time() >= conn.last_write + heartbeat:
                await emit(HEARTBEAT)
    finally:
        if conn.remote:
            with trio.CancelScope(shield=True), trio.move_on_after(REMOTE_RELEASE_S):
                await service.release_remote(conn)
        service.detach_work(conn)
