"""Process lifecycle: the phase every part of topicd can read or wait on.

`STARTING → SERVING → DRAINING → STOPPING → STOPPED`, plus `FAILED` (architecture §11.1).
The phase is a trio-util `AsyncValue`, so a task can `await lifecycle.phase.wait_value(...)`
instead of polling a flag. Probes read it synchronously.
"""

from __future__ import annotations

import enum

import trio
from trio_util import AsyncValue


class Phase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class Lifecycle:
    def __init__(self) -> None:
        self.phase: AsyncValue[Phase] = AsyncValue(Phase.STARTING)
        self.replay_progress = 0.0
        self.started_at = trio.current_time()
        self.inflight = 0
        self.idle = trio.Event()  # set whenever inflight drops to 0 while draining

    def uptime_ms(self) -> int:
        return int((trio.current_time() - self.started_at) * 1000)

    def set_progress(self, fraction: float) -> None:
        """Recovery progress (called from the recovery thread: one float store)."""
        self.replay_progress = fraction

    def set_serving(self) -> None:
        """Recovery finished. A drain that began during recovery wins."""
        self.replay_progress = 1.0
        if self.phase.value is Phase.STARTING:
            self.phase.value = Phase.SERVING

    def begin_drain(self) -> None:
        if self.phase.value in (Phase.STARTING, Phase.SERVING):
            self.phase.value = Phase.DRAINING
            if self.inflight == 0:
                self.idle.set()

    def request_started(self) -> None:
        self.inflight += 1

    def request_finished(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self.phase.value is Phase.DRAINING:
            self.idle.set()
