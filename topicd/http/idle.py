"""Idle HTTP/1.1 connections, held without a task each (`IdleConnections`).

A connection that waits for the bytes of its next request head (a new connection that
has sent nothing yet, a keep-alive connection between requests, a head that stops
half-way) would otherwise keep a task blocked in a read: the task, its chain of
coroutines, a cancel scope for the header timeout and the read's registration, about 40
objects the garbage collector tracks and 5–7 KiB per connection. Ten thousand such
connections make every full collection walk 400,000 objects (hundreds of milliseconds
during which the event loop answers nothing, docs/PERFORMANCE.md, "Fuzzing"), and leave
the memory they used fragmented after they close.

So a connection that stays silent for `PARK_AFTER_S` is parked here instead: its socket
(and the head bytes read so far, and its header deadline) goes into one table, its file
descriptor into an epoll set of this object's own, and its task ends. One task (`run`)
waits on that epoll set and on the earliest deadline: a connection that becomes readable
(bytes, EOF or an error) is handed back to a new task (`resume`), one whose deadline
passes is closed, as the timeout would have closed it. Both are done in bounded batches
(`BATCH`), so a wave of timeouts or wake-ups does not hold the event loop for long.
"""

from __future__ import annotations

import contextlib
import heapq
import select
from collections.abc import Awaitable, Callable
from typing import Final

import trio

PARK_AFTER_S: Final = 1.0  # silent this long (and the head not complete): parked
BATCH: Final = 64  # wake-ups or time-outs handled per turn of the event loop
STALE_SLACK: Final = 1000  # deadline entries beyond twice the parked ones: compacted
AVAILABLE: Final = hasattr(select, "epoll")  # (Linux; elsewhere idle connections keep a task)
_EVENTS: Final = (select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT) if AVAILABLE else 0

Resume = Callable[[trio.SocketStream, bytes, float], Awaitable[None]]


class IdleConnections:
    """Parked connections: fd -> (stream, head bytes so far, header deadline, ticket)."""

    def __init__(self, resume: Resume) -> None:
        self._resume = resume
        self._epoll = select.epoll()
        self._parked: dict[int, tuple[trio.SocketStream, bytes, float, int]] = {}
        self._deadlines: list[tuple[float, int, int]] = []  # heap of (deadline, ticket, fd)
        self._ticket = 0
        self._wait: trio.CancelScope | None = None
        self.closed = False

    def __len__(self) -> int:
        return len(self._parked)

    def heap_size(self) -> int:
        """Deadline entries kept: one per parked connection, plus those of connections
        woken since (dropped when their deadline passes, or when they outnumber the
        parked ones by `STALE_SLACK` beyond twice)."""
        return len(self._deadlines)

    def park(self, stream: trio.SocketStream, head: bytes, deadline: float) -> bool:
        """Take `stream` (its task is about to end). False: not taken (closed, or the
        socket is already gone); the caller closes it."""
        if self.closed:
            return False
        try:
            fd = stream.socket.fileno()
            if fd < 0:
                return False
            self._epoll.register(fd, _EVENTS)
        except (OSError, ValueError):
            return False
        self._ticket += 1
        self._parked[fd] = (stream, head, deadline, self._ticket)
        heapq.heappush(self._deadlines, (deadline, self._ticket, fd))
        if len(self._deadlines) > 2 * len(self._parked) + STALE_SLACK:
            # mostly entries of connections woken since (a slow drip parks again after
            # each byte): keep those of the parked ones only
            self._deadlines = [(d, t, f) for f, (_s, _h, d, t) in self._parked.items()]
            heapq.heapify(self._deadlines)
        if self._wait is not None and deadline < self._wait.deadline:
            self._wait.deadline = deadline
        return True

    def _unpark(self, fd: int) -> tuple[trio.SocketStream, bytes, float, int]:
        entry = self._parked.pop(fd)
        with contextlib.suppress(OSError):  # (already gone from the set)
            self._epoll.unregister(fd)
        return entry

    def _expire(self, now: float) -> int:
        """Close up to `BATCH` connections whose deadline has passed; how many entries
        were taken off the heap."""
        done = 0
        heap = self._deadlines
        while heap and heap[0][0] <= now and done < BATCH:
            _deadline, ticket, fd = heapq.heappop(heap)
            done += 1
            entry = self._parked.get(fd)
            if entry is None or entry[3] != ticket:
                continue  # woken (or closed) since: a stale entry
            stream = self._unpark(fd)[0]
            stream.socket.close()  # (no answer: as the header timeout closes)
        return done

    def _wake(self, nursery: trio.Nursery) -> int:
        """Hand up to `BATCH` readable connections back to tasks; how many."""
        events = self._epoll.poll(0, BATCH)
        for fd, _mask in events:
            if fd in self._parked:
                stream, head, deadline, _ticket = self._unpark(fd)
                nursery.start_soon(self._resume, stream, head, deadline)
        return len(events)

    async def run(self, nursery: trio.Nursery) -> None:
        """Wake and expire parked connections until cancelled; then close every one.
        Woken connections are served by new tasks in `nursery`."""
        try:
            while True:
                with trio.CancelScope() as wait:  # (no deadline while nothing is parked)
                    self._wait = wait
                    if self._deadlines:
                        wait.deadline = self._deadlines[0][0]
                    await trio.lowlevel.wait_readable(self._epoll.fileno())
                self._wait = None
                busy = self._wake(nursery) >= BATCH
                busy = self._expire(trio.current_time()) >= BATCH or busy
                if busy:  # more may be due: let the rest of the loop run first
                    await trio.lowlevel.checkpoint()
        finally:
            self._wait = None
            self.close_all()

    def close_all(self) -> None:
        """Close every parked connection and take no more (the server is stopping)."""
        self.closed = True
        for fd in list(self._parked):
            self._unpark(fd)[0].socket.close()
        self._deadlines.clear()
        self._epoll.close()
