"""The time seam.

Two kinds of time exist in topicd:

* **Monotonic time** (timeouts, ticks, deadlines) always comes from Trio
  (`trio.current_time()`, `trio.sleep`, `trio.move_on_after`), so `MockClock` drives it in
  tests. Nothing in topicd reads `time.monotonic()`.
* **Wall time** (`$ts`, TTL expiry, idempotency windows, `last_*_ts`) comes from a
  `WallClock` passed to constructors. `SystemWallClock` reads the OS clock;
  `topicd.testing.fake_clock.FakeWallClock` derives wall time from `trio.current_time()`
  so an autojumping `MockClock` moves both kinds of time together.

`perf_ms()` is a measuring stick for the `performance` block only; it never drives logic.
This module is the only place allowed to import the `time` module's clocks (tidy test).
"""

from __future__ import annotations

import time
from typing import Protocol


class WallClock(Protocol):
    """Milliseconds since the Unix epoch. May jump (NTP, operator); callers must cope."""

    def now_ms(self) -> int: ...


class SystemWallClock:
    """The operating system's real-time clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


def perf_ms() -> float:
    """High-resolution elapsed-time reading in milliseconds (for reporting only)."""
    return time.perf_counter() * 1000.0
