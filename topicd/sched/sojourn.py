"""How long client writes wait in the server: the governor's sojourn signal (s6).

A write's *sojourn* is the time from its whole request (head and body) in the server's
hands to its answer being ready: any wait for a client permit, the parse, the wait for
its WAL commit. It does not count from the head: a body that comes in slowly is the
client's time, not the server's (a producer short of CPU sends a 100 KB body in pieces,
tens of ms apart, and counted from the head it read as pressure on a server whose loop
was a third idle, docs/decisions.md); the loop turns a body takes to read on a
saturated server are s2's. Every other pressure signal reads one
queue at the instant of a sample (a loop batch, the WAL's oldest write, the permit
waiters); a request that went through several of them, or through one that swings from
one sample to the next, is seen by none of them. The sojourn is what each request
actually waited, whichever queue held it (CoDel's measure: time in the system, not the
length of a queue).

`Sojourns` keeps the sojourns of the writes answered lately, at most `SAMPLES_MAX`, and
the governor reads their median over the last `window_s` at each sample. The median
rather than the minimum: under a real overload some writes still pass quickly (one
whose request arrives just before its batch runs), and a single one should not clear the
signal; rather than the maximum: one slow commit should not raise it. Long-polls and
streams are not writes and are never recorded (they wait on purpose).

Pure and synchronous: the caller passes Trio times (MockClock in tests).
"""

from __future__ import annotations

from collections import deque
from typing import Final

SAMPLES_MAX: Final = 1024  # sojourns kept (the newest win): bounds memory and the sort


class Sojourns:
    """The sojourns of the client writes answered lately (see module docstring)."""

    __slots__ = ("_done", "recorded", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._done: deque[tuple[float, float]] = deque(maxlen=SAMPLES_MAX)  # (at, seconds)
        self.recorded = 0  # writes recorded since start

    def record(self, in_hand_at: float, now: float) -> None:
        """A write whose request was whole in hand at `in_hand_at` is answered at `now`."""
        self._done.append((now, max(0.0, now - in_hand_at)))
        self.recorded += 1

    def median_ms(self, now: float) -> float | None:
        """The median sojourn (ms) of the writes answered in the last `window_s` before
        `now`; None when none was (no evidence either way). Older ones are forgotten."""
        done = self._done
        horizon = now - self.window_s
        while done and done[0][0] < horizon:
            done.popleft()
        if not done:
            return None
        waits = sorted(s for _, s in done)
        n = len(waits)
        mid = waits[n // 2] if n % 2 else (waits[n // 2 - 1] + waits[n // 2]) / 2
        return mid * 1000
