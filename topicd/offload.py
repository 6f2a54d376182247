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

import contextlib
import queue
import threading
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar, TypeVarTuple

import outcome
import trio

if TYPE_CHECKING:
    from collections.abc import Callable

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

# a dedicated thread's call: (the call, the loop's token, the waiting task)
_Job: TypeAlias = "tuple[Callable[[], object], trio.lowlevel.TrioToken, trio.lowlevel.Task]"


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


class _Committers:
    """`n` long-lived threads fed by one queue, for a group whose calls are short, frequent
    and never cancellable (the WAL's writes and syncs). A call costs a queue put and one
    wake-up of the loop (`run_sync_soon`), where `trio.to_thread` also takes a limiter
    token, copies the context and hands the call to its thread cache: a round trip of
    about 25 µs instead of 55 on the project machine, paid by every group commit. At
    most `n` calls run at once, as with a limiter of `n` tokens; the rest wait in the
    queue, in order."""

    def __init__(self, name: str, n: int) -> None:
        self.name = name
        self.n = n
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def _start(self) -> None:
        for i in range(self.n):
            t = threading.Thread(target=self._work, name=f"topicd-{self.name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            call, token, task = job
            result = outcome.capture(call)
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    async def run(self, call: Callable[[], _T]) -> _T:
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._threads:
            self._start()
        task = trio.lowlevel.current_task()
        self._jobs.put((call, trio.lowlevel.current_trio_token(), task))

        def abort(_: object) -> trio.lowlevel.Abort:
            return trio.lowlevel.Abort.FAILED  # a started write or sync is waited for

        return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Let the threads end once the queued calls are done."""
        for _ in self._threads:
            self._jobs.put(None)
        self._threads = []


class ThreadOffload:
    """Worker threads, one `trio.CapacityLimiter` per group; the groups in `dedicated`
    run on long-lived threads of their own instead (see `_Committers`)."""

    def __init__(self, sizes: dict[str, int], dedicated: tuple[str, ...] = ()) -> None:
        self._limiters = {name: trio.CapacityLimiter(n) for name, n in sizes.items()}
        self._stats = {name: GroupStats() for name in sizes}
        self._committers = {name: _Committers(name, sizes[name]) for name in dedicated}

    async def run(
        self, fn: Callable[[*_Ts], _T], *args: *_Ts, group: str, cancellable: bool = False
    ) -> _T:
        stats = self._stats[group]
        stats.calls += 1
        stats.in_flight += 1
        t0 = trio.current_time()
        stats.started_sum += t0
        try:
            committers = self._committers.get(group)
            if committers is not None and not cancellable:
                return await committers.run(partial(fn, *args))
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

    def close(self) -> None:
        """Stop the dedicated threads (each ends after the calls queued before it)."""
        for committers in self._committers.values():
            committers.close()


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
