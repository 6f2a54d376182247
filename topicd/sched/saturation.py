"""The saturation registry (scheduler spec R4) and queue-depth levels (R5).

Every bounded queue of the process registers a depth and a capacity (and, where it has
one, a count of the times it was found full). The governor samples the registry every
100 ms: peaks are the highest depth sampled (or the queue's own peak where it keeps
one), and each queue's **level** follows `depth ÷ capacity` through normal (< 0.70),
warning, critical (≥ 0.85) and overflow (> 0.95), leaving a level only when the ratio
falls `levels.hysteresis` below its lower bound. A queue entering warning or above is
logged at most once per `levels.warn_log_interval_ms`.

Exported as `topicd_queue_depth|capacity|saturation|peak{queue}`,
`topicd_queue_full_total{queue}`, `topicd_queue_level{queue}` (0-3) and
`topicd_queue_level_changes_total{queue,level}`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable

    from topicd.config import LevelsConfig

log = logging.getLogger("topicd.saturation")

LEVELS: Final = ("normal", "warning", "critical", "overflow")


@dataclass
class Queue:
    name: str
    depth: Callable[[], int]
    capacity: Callable[[], int]
    full: Callable[[], int] | None = None
    own_peak: Callable[[], int] | None = None
    owner: object = None  # what registered it (a job queue unregisters only its own entry)
    peak: int = 0
    level: int = 0
    changes: dict[int, int] = field(default_factory=dict)  # level -> times entered
    last_warned: float | None = None

    def saturation(self) -> float:
        cap = self.capacity()
        return self.depth() / cap if cap > 0 else 0.0


class SaturationRegistry:
    def __init__(self, cfg: LevelsConfig) -> None:
        self.cfg = cfg
        self.queues: dict[str, Queue] = {}

    def register(
        self,
        name: str,
        depth: Callable[[], int],
        capacity: Callable[[], int],
        *,
        full: Callable[[], int] | None = None,
        peak: Callable[[], int] | None = None,
        owner: object = None,
    ) -> None:
        self.queues[name] = Queue(name, depth, capacity, full, peak, owner)

    def unregister(self, name: str) -> None:
        self.queues.pop(name, None)

    def level_for(self, current: int, ratio: float) -> int:
        """The level of `ratio` given the `current` one (hysteresis on the way down)."""
        c = self.cfg
        bounds = (c.warning, c.critical, c.overflow)  # lower bounds of levels 1..3
        up = 0
        for i, b in enumerate(bounds, start=1):
            if ratio >= b if i < 3 else ratio > b:
                up = i
        if up >= current:
            return up
        level = current  # going down: only past each lower bound minus the hysteresis
        while level > 0 and ratio < bounds[level - 1] - c.hysteresis:
            level -= 1
        return level

    def sample(self, now_s: float) -> None:
        """Update peaks and levels (the governor calls this every sample)."""
        for q in self.queues.values():
            self.observe(q, now_s)

    def observe(self, q: Queue, now_s: float) -> int:
        """Update one queue's peak and level now (also called where a level gates
        admission, so the decision never waits for the next sample); returns the level."""
        depth = q.depth()
        q.peak = max(q.peak, depth, q.own_peak() if q.own_peak is not None else 0)
        level = self.level_for(q.level, q.saturation())
        if level != q.level:
            q.changes[level] = q.changes.get(level, 0) + 1
            warn_every = self.cfg.warn_log_interval_ms / 1000
            if level > q.level and (q.last_warned is None or now_s - q.last_warned >= warn_every):
                q.last_warned = now_s
                log.warning("queue %s is %s: %d of %d", q.name, LEVELS[level], depth, q.capacity())
            q.level = level
        return level
