"""Work classes: client permits, maintenance permits and yield budgets (scheduler spec R1).

Client work — REST handlers: writes, reads, claims, control-plane changes — runs only
while it holds one of `classes.client_permits` permits (a request taking a free one runs
from the next loop batch on, so the others ready in the same batch wait), so at most
that many client requests are runnable at once and one pass of the event loop stays
short: probes,
metrics, SSE heartbeats, the governor and the scheduler (control and delivery work,
which take no permit) are served within one batch however many clients push. At most
`classes.client_waiters` requests wait for a permit; beyond that a request gets `429
throttled` with `cause:"client_waiters"` before its body is parsed (and with
`cause:"loop_lag"`, `"wal_backlog"` or `"write_delay"` while the governor finds the server
overloaded) (the direct HTTP path
answers from a glance at the head and reads the body off the socket unparsed, so the
connection stays usable; see `http/server.py`).

A request gives its permit back as soon as it only waits — for a long-poll's wake-up, a
WAL completion (an append's, or a control frame's: an ack's synced delete), room at a full
ingest — with `give_back()`: a parked task costs no loop
time, and holding permits while parked would let 32 long-polls starve every writer. It
does not take one again: what is left (rendering the answer) is short and bounded.

Long loops on the loop thread (the drain's fan-out, the retention sweep) yield with a
`Budget`: `await budget.tick()` checkpoints once a class quantum of time has passed since
the last yield (`weight × classes.quantum_base_us`: delivery 1 ms, maintenance 0.25 ms),
or after `classes.quantum_items` items whatever the time, so under `MockClock` (whose
time does not move while code runs) the count bound is what tests see. Maintenance jobs
(checkpoints, retention sweeps) run at most `classes.maintenance_permits` at once.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from topicd.errors import Throttled

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass
class PermitStats:
    capacity: int
    in_use: int = 0
    waiting: int = 0
    peak_in_use: int = 0
    peak_waiting: int = 0
    waited: int = 0  # admissions that had to wait
    rejected: int = 0  # 429 client_waiters
    overload_rejected: int = 0  # 429 loop_lag, wal_backlog, write_delay
    wait_s_total: float = 0.0
    wait_area: float = 0.0  # ∫ waiting dt (request-seconds spent waiting), up to `area_at`
    area_at: float = 0.0


class Permit:
    """One admitted request's hold on a permit."""

    __slots__ = ("held", "pool")

    def __init__(self, pool: ClientPermits) -> None:
        self.pool = pool
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.pool.release()


_HELD: ContextVar[Permit | None] = ContextVar("topicd_client_permit", default=None)


class ClientPermits:
    def __init__(
        self,
        permits: int,
        max_waiters: int,
        retry_hint_ms: Callable[[], int],
        overloaded: Callable[[], str | None] | None = None,
    ) -> None:
        self._sem = trio.Semaphore(permits)
        self.max_waiters = max_waiters
        self.retry_hint_ms = retry_hint_ms
        # the governor's verdict that a queue is at its time bound, as the cause to
        # refuse with (see `Governor.overloaded`): client requests are refused as at
        # full waiters
        self.overloaded = overloaded
        self.stats = PermitStats(capacity=permits)

    def _waiters_full(self) -> bool:
        return self._sem.value == 0 and self.stats.waiting >= self.max_waiters

    def full(self) -> bool:
        """Whether a request arriving now would be refused (no permit and waiters full,
        or the server overloaded)."""
        over = self.overloaded
        return self._waiters_full() or (over is not None and over() is not None)

    def waited_area(self, now: float) -> float:
        """Request-seconds spent waiting for a permit since start, up to `now`."""
        st = self.stats
        st.wait_area += st.waiting * (now - st.area_at)
        st.area_at = now
        return st.wait_area

    def refusal(self) -> Throttled:
        """The `429 client_waiters` for a request `full()` refused (not raised: a raised
        and caught exception keeps its frame alive in a reference cycle, and a flood of
        refusals would fill the cyclic garbage collector)."""
        if not self._waiters_full() and self.overloaded is not None:
            self.stats.overload_rejected += 1
            return Throttled.pressure(self.retry_hint_ms(), cause=self.overloaded() or "overload")
        self.stats.rejected += 1
        return Throttled.pressure(self.retry_hint_ms(), cause="client_waiters")

    async def admit(self) -> Permit:
        """A permit, waiting for one if needed; `429 client_waiters` when too many wait."""
        stats = self.stats
        if self._sem.value > 0:
            self._sem.acquire_nowait()
        else:
            if stats.waiting >= self.max_waiters:
                raise self.refusal()
            t0 = trio.current_time()
            self.waited_area(t0)
            stats.waiting += 1
            stats.waited += 1
            stats.peak_waiting = max(stats.peak_waiting, stats.waiting)
            try:
                await self._sem.acquire()
            finally:
                t1 = trio.current_time()
                self.waited_area(t1)
                stats.waiting -= 1
                stats.wait_s_total += t1 - t0
        stats.in_use += 1
        stats.peak_in_use = max(stats.peak_in_use, stats.in_use)
        return Permit(self)

    def release(self) -> None:
        self.stats.in_use -= 1
        self._sem.release()

    @staticmethod
    def hold(permit: Permit | None) -> Token[Permit | None]:
        """Make `permit` the current task's (and its children's); returns a reset token."""
        return _HELD.set(permit)

    @staticmethod
    def unhold(token: Token[Permit | None]) -> None:
        _HELD.reset(token)


def give_back() -> None:
    """The current request only waits from here on: free its permit (see module doc)."""
    permit = _HELD.get()
    if permit is not None:
        permit.release()


WEIGHTS: dict[str, int] = {"control": 8, "delivery": 4, "client": 2, "maintenance": 1}


class Budget:
    """Cooperative yielding for one long loop (R1.2): `await tick()` per item."""

    __slots__ = ("_count", "_since", "every", "quantum_s", "yields")

    def __init__(self, quantum_s: float, every: int) -> None:
        self.quantum_s = quantum_s
        self.every = every
        self.yields = 0
        self._count = 0
        self._since = trio.current_time()

    @classmethod
    def for_class(cls, name: str, quantum_base_us: int, every: int) -> Budget:
        return cls(WEIGHTS[name] * quantum_base_us / 1_000_000, every)

    def due(self) -> bool:
        """Whether the next `tick()` will yield (counts the item)."""
        self._count += 1
        return self._count >= self.every or trio.current_time() - self._since >= self.quantum_s

    def left(self) -> int:
        """Items the count bound still allows before a yield is due (at least 1)."""
        return max(1, self.every - self._count)

    def spend(self, n: int) -> bool:
        """Count `n` items at once, reading the clock once: whether `pause()` is due."""
        self._count += n
        return self._count >= self.every or trio.current_time() - self._since >= self.quantum_s

    async def tick(self) -> None:
        """Count one item; yield to the loop when the quantum or the item bound is used."""
        if self.due():
            await self.pause()

    async def pause(self) -> None:
        self.yields += 1
        await trio.lowlevel.checkpoint()
        self._count = 0
        self._since = trio.current_time()
