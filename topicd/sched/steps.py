"""The loop's longest steps over a span of work, split into that work's and the rest.

A Trio task runs on the loop from one await that suspends it to the next (a *step*);
nothing else runs meanwhile, so the longest step is the longest the loop was held. A
`StepMeter` is a Trio instrument (`before_task_step` / `after_task_step`, timed with
`time.perf_counter`) installed only for the span it measures — `with StepMeter.span():`
— so the loop pays for it only then. It keeps two maxima: the steps of its *own* tasks
(the task that opened the span, and every task spawned while it is open by one of them
or into a nursery one of them owns) and the steps of every other task, with the name of
the task and where it suspended after its longest step (the await that ended it: the
step ran the code before it); for the own tasks also where that step had resumed. A
step's time includes whatever held the loop thread during it: garbage collection,
waiting for the GIL while a worker thread runs Python, waiting for a CPU on a busy
machine; so each maximum also keeps the loop thread's CPU time in its step and the
collector's time in it, and the page faults the loop thread took in it (the CPU time
counts the kernel's work on them). The longest single collection of the span is kept
too, with the thread it ran in.

The step of the opening task that is running when the span opens is counted from the
opening, and the one running when it closes up to the closing.
"""

from __future__ import annotations

import contextlib
import gc
import posixpath
import resource
import threading
from time import perf_counter, thread_time
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Iterator

_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def faults() -> int:
    """Page faults (minor and major) of the calling thread so far (of the process where
    threads are not counted apart)."""
    ru = resource.getrusage(_WHO)
    return ru.ru_minflt + ru.ru_majflt


def suspended_at(task: trio.lowlevel.Task) -> str:
    """Where a suspended task waits: the innermost frame outside Trio, `file:line`
    (`(its end)` after its last step)."""
    where = ""
    coro: object = task.coro
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            path = frame.f_code.co_filename
            if "/trio/" not in path and posixpath.basename(path) != "contextlib.py":
                where = f"{posixpath.basename(path)}:{frame.f_lineno}"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return where or "(its end)"


class StepMeter(trio.abc.Instrument):
    """The longest loop step of a span's own tasks and of the other tasks (seconds),
    each with the loop thread's CPU time in it (`time.thread_time`: the rest is waiting
    for the GIL or for a CPU) and the garbage collections' time in it."""

    def __init__(self) -> None:
        self.own_s = 0.0  # the longest step of an own task
        self.own_cpu_s = 0.0
        self.own_gc_s = 0.0
        self.own_faults = 0
        self.own_at = ""  # where that task suspended after it
        self.own_from = ""  # and where it had resumed (the step ran the code between)
        self.other_s = 0.0  # the longest step of any other task
        self.other_cpu_s = 0.0
        self.other_gc_s = 0.0
        self.other_faults = 0
        self.other_task = ""  # that task's name
        self.other_at = ""
        # the longest garbage collection in the span, its generation, and whether it ran
        # on the loop thread (a worker thread's allocations can start one too: the loop
        # then waits for the GIL through it, in whatever step it is in)
        self.gc_s = 0.0
        self.gc_generation = -1
        self.gc_on_loop = True
        self._loop_thread = 0
        self._own: set[trio.lowlevel.Task] = set()
        self._own_last: dict[trio.lowlevel.Task, str] = {}  # where each own task waits
        self._t0 = self._cpu0 = self._gc0 = 0.0
        self._faults0 = 0
        self._gc_total = self._gc_start = 0.0

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = perf_counter()
            return
        took = perf_counter() - self._gc_start
        self._gc_total += took
        if took > self.gc_s:
            self.gc_s = took
            self.gc_generation = info.get("generation", -1)
            self.gc_on_loop = threading.get_ident() == self._loop_thread

    @contextlib.contextmanager
    def span(self) -> Iterator[StepMeter]:
        """Measure from here to the end of the block (from inside a task: the task is
        the span's own). Resets the maxima; removes the instrument however the block
        ends."""
        task = trio.lowlevel.current_task()
        self.own_s = self.own_cpu_s = self.own_gc_s = 0.0
        self.other_s = self.other_cpu_s = self.other_gc_s = 0.0
        self.own_faults = self.other_faults = 0
        self.own_at = self.own_from = self.other_task = self.other_at = ""
        self.gc_s, self.gc_generation, self.gc_on_loop = 0.0, -1, True
        self._loop_thread = threading.get_ident()
        self._own = {task}
        self._own_last = {}
        gc.callbacks.append(self._gc)
        trio.lowlevel.add_instrument(self)
        # (the opening task's step so far is not counted)
        self._t0, self._cpu0, self._gc0 = perf_counter(), thread_time(), self._gc_total
        self._faults0 = faults()
        try:
            yield self
        finally:
            trio.lowlevel.remove_instrument(self)
            gc.callbacks.remove(self._gc)
            took = perf_counter() - self._t0  # the closing task's step so far
            if task in self._own and took > self.own_s:
                self.own_s, self.own_at = took, "(the span's end)"
                self.own_cpu_s = thread_time() - self._cpu0
                self.own_gc_s = self._gc_total - self._gc0
                self.own_faults = faults() - self._faults0
                self.own_from = self._own_last.get(task, "(the span's start)")
            self._own = set()
            self._own_last = {}

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        own = self._own
        nursery = task.parent_nursery
        if nursery is not None and nursery.parent_task in own:
            own.add(task)
            return
        with contextlib.suppress(RuntimeError):  # (spawned outside any task)
            if trio.lowlevel.current_task() in own:
                own.add(task)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._cpu0 = thread_time()
        self._gc0 = self._gc_total
        self._faults0 = faults()
        self._t0 = perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = perf_counter() - self._t0
        if task in self._own:
            at = suspended_at(task)  # (the own tasks' steps are few: worth locating)
            if took > self.own_s:
                self.own_s = took
                self.own_cpu_s = thread_time() - self._cpu0
                self.own_gc_s = self._gc_total - self._gc0
                self.own_faults = faults() - self._faults0
                self.own_from = self._own_last.get(task, "(the span's start)")
                self.own_at = at
            self._own_last[task] = at
        elif took > self.other_s:
            self.other_s = took
            self.other_cpu_s = thread_time() - self._cpu0
            self.other_gc_s = self._gc_total - self._gc0
            self.other_faults = faults() - self._faults0
            self.other_task = task.name
            self.other_at = suspended_at(task)
