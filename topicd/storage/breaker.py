"""The storage circuit breaker of one WAL shard (scheduler spec R3).

closed → open → half-open → closed. Any sync error, and any rotation failure, opens it at
once; write errors open it when `failure_threshold` of them fall within
`failure_window_ms`. While open, every request needing the shard's WAL gets
`503 storage_unavailable` with `Retry-After` = seconds until half-open. After `open_ms`
the breaker is half-open: client writes are still refused, and the committer writes a
synthetic probe (a `Probe` frame into a fresh file, synced) every `probe_interval_ms`;
`success_threshold` consecutive successes close it, a failure reopens it with the open
time doubled (capped at `max_open_ms`).

Time is Trio's clock, so `MockClock` drives every window in tests.
"""

from __future__ import annotations

import enum
import math
from collections import deque

import trio

from topicd.errors import StorageUnavailable


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class Breaker:
    def __init__(
        self,
        shard: int,
        *,
        failure_threshold: int = 5,
        failure_window_ms: int = 10000,
        open_ms: int = 30000,
        max_open_ms: int = 300000,
        success_threshold: int = 2,
    ) -> None:
        self.shard = shard
        self._threshold = failure_threshold
        self._window_s = failure_window_ms / 1000
        self._base_open_s = open_ms / 1000
        self._max_open_s = max_open_ms / 1000
        self._success_threshold = success_threshold
        self._open_s = self._base_open_s
        self._failures: deque[float] = deque()
        self._open_until = 0.0
        self._successes = 0
        self.state = BreakerState.CLOSED
        self.reason = ""
        self.trips = 0
        self.changed = trio.Event()  # set (and replaced) on every state change

    def _set(self, state: BreakerState) -> None:
        if state is not self.state:
            self.state = state
            self.changed.set()
            self.changed = trio.Event()

    def _trip(self, reason: str) -> None:
        self.reason = reason
        self.trips += 1
        self._failures.clear()
        self._successes = 0
        self._open_until = trio.current_time() + self._open_s
        self._set(BreakerState.OPEN)

    def poll(self) -> BreakerState:
        """Advance open → half-open once `open_ms` has passed; return the state."""
        if self.state is BreakerState.OPEN and trio.current_time() >= self._open_until:
            self._set(BreakerState.HALF_OPEN)
        return self.state

    @property
    def open_until(self) -> float:
        return self._open_until

    def retry_after_ms(self) -> int:
        left = self._open_until - trio.current_time()
        return max(1000, math.ceil(left * 1000))

    def check(self) -> None:
        """Raise `503 storage_unavailable` unless the breaker is closed."""
        if self.poll() is BreakerState.CLOSED:
            return
        ms = self.retry_after_ms()
        raise StorageUnavailable(
            f"WAL shard {self.shard} is unavailable ({self.reason}); retry after {ms} ms",
            {"shard": self.shard, "reason": self.reason, "retry_after_ms": ms},
            retry_after_s=math.ceil(ms / 1000),
        )

    def record_write_error(self, reason: str) -> None:
        now = trio.current_time()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self._window_s:
            self._failures.popleft()
        if self.state is not BreakerState.CLOSED:
            self._reopen(reason)
        elif len(self._failures) >= self._threshold:
            self._trip(reason)
        else:
            self.reason = reason

    def record_sync_error(self, reason: str) -> None:
        if self.state is BreakerState.CLOSED:
            self._trip(reason)
        else:
            self._reopen(reason)

    def _reopen(self, reason: str) -> None:
        self._open_s = min(self._open_s * 2, self._max_open_s)
        self._trip(reason)

    def record_probe(self, ok: bool, reason: str = "probe failed") -> None:
        if not ok:
            self._reopen(reason)
            return
        self._successes += 1
        if self._successes >= self._success_threshold:
            self._open_s = self._base_open_s
            self._successes = 0
            self.reason = ""
            self._set(BreakerState.CLOSED)
