"""The offload seam: how blocking work leaves the event loop (architecture §9).

`await offload.run(fn, *args, group="wal", cancellable=False)` runs `fn(*args)`:

* `ThreadOffload` (production) in a Trio worker thread, under the capacity limiter of
  its group (`wal`: one token per shard; `misc`: `io.misc_threads`; `read`:
  `io.read_threads`; `snapshot`: one). WAL writes, syncs, renames and truncations are not
  cancellable: the awaiting task waits for the thread even when cancelled, because an
  abandoned write would leave a shard in an unknown state. Reads may be cancellable.
* `InlineOffload` (deterministic tests) calls `fn` on the loop thread and then
  checkpoints, optionally after a virtual delay (`await trio.sleep(d)`), so `MockClock`
  can model a slow fsync without real threads (Trio counts the loop as idle while a thread
  runs, which would let autojump fire mid-syscall).

Each group tracks busy time (the governor's pool-saturation signal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, TypeVarTuple

import trio

if TYPE_CHECKING:
    from collections.abc import Callable

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


@dataclass
class GroupStats:
    calls: int = 0
    busy_s: float = 0.0  # token-seconds of finished calls
    in_flight: int = 0
    started_sum: float = 0.0  # sum of the start times of the calls in flight

    def busy_integral(self, now: float) -> float:
        """Token-seconds busy up to `now`, calls still running included."""
        return self.busy_s + self.in_flight * now - self.started_sum


class Offload(Protocol):
    async def run(
        self, fn: Callable[[*_Ts], _T], *args: *_Ts, group: str, cancellable: bool = False
    ) -> _T: ...

    def stats(self, group: str) -> GroupStats: ...

    def tokens(self, group: str) -> int:
        """Concurrent calls the group allows."""
        ...


class ThreadOffload:
    """Worker threads, one `trio.CapacityLimiter` per group."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self._limiters = {name: trio.CapacityLimiter(n) for name, n in sizes.items()}
        self._stats = {name: GroupStats() for name in sizes}

    async def run(
        self, fn: Callable[[*_Ts], _T], *args: *_Ts, group: str, cancellable: bool = False
    ) -> _T:
        stats = self._stats[group]
        stats.calls += 1
        stats.in_flight += 1
        t0 = trio.current_time()
        stats.started_sum += t0
        try:
            return await trio.to_thread.run_sync(
                fn, *args, limiter=self._limiters[group], abandon_on_cancel=cancellable
            )
        finally:
            stats.in_flight -= 1
            stats.started_sum -= t0
            stats.busy_s += trio.current_time() - t0

    def stats(self, group: str) -> GroupStats:
        return self._stats[group]

    def tokens(self, group: str) -> int:
        return int(self._limiters[group].total_tokens)


class InlineOffload:
    """Runs on the loop thread (tests). `delay_s(group)` adds virtual latency per call."""

    def __init__(self, delay_s: Callable[[str], float] | None = None) -> None:
        self._delay = delay_s
        self._stats: dict[str, GroupStats] = {}

    async def run(
        self, fn: Callable[[*_Ts], _T], *args: *_Ts, group: str, cancellable: bool = False
    ) -> _T:
        stats = self._stats.setdefault(group, GroupStats())
        stats.calls += 1
        stats.in_flight += 1
        t0 = trio.current_time()
        stats.started_sum += t0
        try:
            delay = self._delay(group) if self._delay is not None else 0.0
            # a non-cancellable call completes and returns even if the caller is cancelled
            with trio.CancelScope(shield=not cancellable):
                if delay > 0:
                    await trio.sleep(delay)
                result = fn(*args)
                await trio.lowlevel.checkpoint()
            return result
        finally:
            stats.in_flight -= 1
            stats.started_sum -= t0
            stats.busy_s += trio.current_time() - t0

    def stats(self, group: str) -> GroupStats:
        return self._stats.setdefault(group, GroupStats())

    def tokens(self, group: str) -> int:
        return 1
