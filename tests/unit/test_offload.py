"""The offload seam's dedicated threads (the WAL group's committers).

Method: real threads (the subject), a real Trio loop. A call that must block holds a
`threading.Event`; the loop waits for a thread-side condition with
`trio.to_thread.run_sync(event.wait)`, never by sleeping.
"""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from topicd.offload import ThreadOffload


def make(n: int = 2) -> ThreadOffload:
    return ThreadOffload({"wal": n, "misc": 1}, dedicated=("wal",))


async def test_a_dedicated_call_returns_its_value_from_a_named_thread() -> None:
    off = make()
    try:
        name = await off.run(lambda: threading.current_thread().name, group="wal")
        assert name.startswith("topicd-wal-")
        assert await off.run(pow, 2, 10, group="wal") == 1024
        other = await off.run(lambda: threading.current_thread().name, group="misc")
        assert not other.startswith("topicd-")  # other groups keep Trio's thread cache
        st = off.stats("wal")
        assert st.calls == 2 and st.in_flight == 0
    finally:
        off.close()


async def test_a_dedicated_call_raises_what_the_function_raised() -> None:
    off = make()
    try:

        def fail() -> None:
            raise OSError(5, "EIO")

        with pytest.raises(OSError, match="EIO"):
            await off.run(fail, group="wal")
        assert await off.run(int, "7", group="wal") == 7  # the thread is still there
    finally:
        off.close()


async def test_a_started_call_is_waited_for_even_when_the_caller_is_cancelled() -> None:
    off = make()
    started, release = threading.Event(), threading.Event()
    done: list[str] = []

    def write() -> str:
        started.set()
        release.wait()
        done.append("written")
        return "ok"

    got: list[str] = []
    scope = trio.CancelScope()

    async def caller() -> None:
        with scope:
            got.append(await off.run(write, group="wal"))
            await trio.lowlevel.checkpoint()  # the cancellation lands here

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            await trio.to_thread.run_sync(started.wait)
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert not done and not got  # still in the thread: the caller still waits
            release.set()
        assert scope.cancelled_caught
        assert done == ["written"] and got == ["ok"]
        assert off.stats("wal").in_flight == 0
    finally:
        release.set()
        off.close()


async def test_at_most_n_calls_run_at_once_and_the_rest_wait_in_order() -> None:
    off = make(2)
    release = threading.Event()
    two_running = threading.Barrier(3)  # the two threads and the test
    order: list[int] = []

    def job(k: int) -> int:
        order.append(k)
        if k < 2:
            two_running.wait()
            release.wait()
        return k

    results: list[int] = []

    async def call(k: int) -> None:
        results.append(await off.run(job, k, group="wal"))

    try:
        async with trio.open_nursery() as nursery:
            for k in range(3):
                nursery.start_soon(call, k)
                await trio.testing.wait_all_tasks_blocked()
            await trio.to_thread.run_sync(two_running.wait)
            committers = off._committers["wal"]
            assert sorted(order) == [0, 1]  # both threads busy ...
            assert committers._jobs.qsize() == 1  # ... the third call waits its turn
            release.set()
        assert sorted(results) == [0, 1, 2] and order[2] == 2
    finally:
        release.set()
        off.close()


async def test_close_ends_the_threads() -> None:
    off = make(2)
    await off.run(int, group="wal")
    threads = list(off._committers["wal"]._threads)
    assert len(threads) == 2
    off.close()
    for t in threads:
        await trio.to_thread.run_sync(t.join)
    assert not any(t.is_alive() for t in threads)
