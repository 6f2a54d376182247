"""A wall clock driven by Trio's clock, so `MockClock` autojumps move wall time too."""

from __future__ import annotations

import trio
import trio.testing


class FakeWallClock:
    """`now_ms() = epoch0_ms + (trio.current_time() - t0) * 1000 + offset_ms`.

    `jump(ms)` moves wall time forward or backward without moving Trio time, to model
    NTP steps and operator changes.
    """

    def __init__(self, epoch0_ms: int = 1_767_225_600_000) -> None:
        self.epoch0_ms = epoch0_ms
        self.t0 = trio.current_time()
        self.offset_ms = 0

    def now_ms(self) -> int:
        return self.epoch0_ms + round((trio.current_time() - self.t0) * 1000) + self.offset_ms

    def jump(self, ms: int) -> None:
        self.offset_ms += ms


async def advance(clock: trio.testing.MockClock, seconds: float) -> None:
    """Move virtual time forward by `seconds`, then let every task due by then run and
    settle (instead of sleeping in a test)."""
    clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()
