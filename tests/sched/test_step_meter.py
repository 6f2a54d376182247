"""`StepMeter`: the longest loop step of a span's own tasks and of the others.

The steps are real time (`time.perf_counter`): each test holds the loop with a
busy-wait of a known length, so a step is at least that long whatever the machine's
load, and checks which side it was counted on.
"""

from __future__ import annotations

import gc
import time

import pytest
import trio
import trio.lowlevel

from topicd.sched.steps import StepMeter


def hold(ms: float) -> None:
    """Keep the loop thread busy for `ms` (no await: one step)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


async def test_own_steps_and_spawned_children_count_as_own_the_rest_as_other():
    meter = StepMeter()
    go = trio.Event()

    async def hog() -> None:
        await go.wait()
        hold(40)
        await trio.lowlevel.checkpoint()

    async def child() -> None:
        await trio.lowlevel.checkpoint()
        hold(25)

    async with trio.open_nursery() as outside:
        outside.start_soon(hog, name="hog")
        await trio.lowlevel.checkpoint()  # (the hog is waiting)
        with meter.span():
            async with trio.open_nursery() as mine:  # a task the span's task starts
                mine.start_soon(child, name="child")
            go.set()
            await trio.lowlevel.checkpoint()  # (the hog runs here)
            await trio.lowlevel.checkpoint()
    assert meter.own_s >= 0.025
    assert meter.other_s >= 0.040
    assert meter.other_task == "hog"
    assert meter.other_at.startswith("test_step_meter.py:")


async def test_the_step_running_at_the_span_end_counts():
    meter = StepMeter()
    with meter.span():
        await trio.lowlevel.checkpoint()
        hold(20)
    assert meter.own_s >= 0.020
    assert meter.own_at == "(the span's end)"


async def test_the_instrument_is_removed_however_the_span_ends():
    meter = StepMeter()
    with meter.span():
        await trio.lowlevel.checkpoint()
    with pytest.raises(KeyError):  # (not installed any more)
        trio.lowlevel.remove_instrument(meter)

    async def fails() -> None:
        with meter.span():
            await trio.lowlevel.checkpoint()
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await fails()
    with pytest.raises(KeyError):
        trio.lowlevel.remove_instrument(meter)
    with trio.move_on_after(0) as scope, meter.span():
        await trio.sleep_forever()  # (cancelled at once by the scope)
    assert scope.cancelled_caught
    with pytest.raises(KeyError):
        trio.lowlevel.remove_instrument(meter)


async def test_a_new_span_starts_from_zero():
    meter = StepMeter()

    go = trio.Event()

    async def other() -> None:
        await go.wait()
        hold(5)

    async with trio.open_nursery() as outside:
        outside.start_soon(other, name="other")
        await trio.lowlevel.checkpoint()
        with meter.span():
            go.set()
            await trio.lowlevel.checkpoint()
            hold(20)
            await trio.lowlevel.checkpoint()
    assert meter.own_s >= 0.020
    first_at = meter.own_at
    assert meter.other_task == "other"
    with meter.span():
        await trio.lowlevel.checkpoint()
    # (nothing else ran in the second span, and its own steps ended elsewhere)
    assert (meter.other_s, meter.other_task, meter.other_at) == (0.0, "", "")
    assert meter.own_at != first_at


async def test_a_task_the_span_starts_in_another_nursery_is_its_own():
    meter = StepMeter()

    async def helper() -> None:
        hold(15)
        await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as outside:
        with meter.span():
            outside.start_soon(helper, name="helper")  # (a nursery the span does not own)
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()
    assert meter.own_s >= 0.015
    assert meter.other_task != "helper"


async def test_a_collection_in_the_longest_step_is_counted():
    meter = StepMeter()
    with meter.span():
        await trio.lowlevel.checkpoint()
        hold(5)
        gc.collect()
        await trio.lowlevel.checkpoint()
    assert meter.own_s >= 0.005
    assert 0 < meter.own_gc_s <= meter.own_s
    assert meter.own_cpu_s > 0
    assert gc.callbacks.count(meter._gc) == 0  # (removed with the instrument)


async def test_the_longest_collection_and_its_thread_are_kept():
    meter = StepMeter()
    with meter.span():
        await trio.lowlevel.checkpoint()
        gc.collect()
    assert meter.gc_s > 0
    assert (meter.gc_generation, meter.gc_on_loop) == (2, True)

    def collect_long() -> None:  # a worker thread's collection, made the longest
        keep = [[] for _ in range(200_000)]
        gc.collect()
        del keep

    with meter.span():
        await trio.to_thread.run_sync(collect_long)
    assert meter.gc_s > 0
    assert (meter.gc_generation, meter.gc_on_loop) == (2, False)


async def test_the_longest_step_counts_the_page_faults_it_took():
    # a step that touches every page of a fresh 32 MiB anonymous mapping faults each one
    # in (the first touch of a mapped page is a fault: heap memory could be resident
    # already); they are the loop thread's, counted with that step
    import mmap

    meter = StepMeter()
    size = 32 << 20
    with mmap.mmap(-1, size) as fresh, meter.span():
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
        for at in range(0, size, mmap.PAGESIZE):
            fresh[at] = 1
        hold(30)  # (the longest own step: this one)
        await trio.lowlevel.checkpoint()
    assert meter.own_s >= 0.030
    # (one fault a page, or one a 2 MiB huge page where transparent huge pages are on)
    assert meter.own_faults >= size // (2 << 20)
