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

A sojourn is a wait only when the write met another: a write that came in while no
other write was in hand, and was answered before the next one came, waited for no one's
write: its time is its own service (a client sending one 60 MiB batch after another takes
a second a write on an idle server). Such *alone* writes are kept and counted but left out
of the median, so a single sequential writer never raises s6 and is never refused
`write_delay` for the size of its own writes (the loop it holds meanwhile is s2's). The
gate tells the tracker when each write comes in (`begin`) and goes (`end`); a write that
overlapped another, or came in behind one, counts.

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

    __slots__ = ("_arrivals", "_done", "_in_hand", "alone", "recorded", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # (answered at, seconds, met another write): only those that met one are medianed
        self._done: deque[tuple[float, float, bool]] = deque(maxlen=SAMPLES_MAX)
        self.recorded = 0  # writes recorded since start
        self.alone = 0  # of which alone (left out of the median)
        self._in_hand = 0  # writes begun and not ended
        self._arrivals = 0  # writes begun since start

    def begin(self) -> int:
        """A write's whole request is in hand; returns the ticket its `end` takes: the
        writes begun before it, or -1 when another was in hand (it met one)."""
        ticket = -1 if self._in_hand else self._arrivals
        self._in_hand += 1
        self._arrivals += 1
        return ticket

    def end(self, ticket: int, in_hand_at: float, now: float, served: bool) -> None:
        """The write of `ticket` (from `begin`) is done at `now`: recorded when `served`
        (answered, not refused on its way in), alone when no other write was in hand at
        its start and none came in before its end."""
        self._in_hand -= 1
        if served:
            self.record(in_hand_at, now, met=ticket < 0 or self._arrivals > ticket + 1)

    def record(self, in_hand_at: float, now: float, met: bool = True) -> None:
        """A write whose request was whole in hand at `in_hand_at` is answered at `now`;
        `met`: it met another write (only those are medianed)."""
        self._done.append((now, max(0.0, now - in_hand_at), met))
        self.recorded += 1
        self.alone += not met

    def median_ms(self, now: float) -> float | None:
        """The median sojourn (ms) of the writes answered in the last `window_s` before
        `now` that met another; None when none did (no evidence either way). Older ones
        are forgotten."""
        done = self._done
        horizon = now - self.window_s
        while done and done[0][0] < horizon:
            done.popleft()
        waits = sorted(s for _, s, met in done if met)
        if not waits:
            return None
        n = len(waits)
        mid = waits[n // 2] if n % 2 else (waits[n // 2 - 1] + waits[n // 2]) / 2
        return mid * 1000
