"""The asyncio ↔ Trio bridge: an asyncio loop on a dedicated thread.

The JetStream client (`nats-py`) is an asyncio library; topicd runs on Trio. Rather than
running both loops on one thread (`trio-asyncio`), the client gets its own asyncio loop on
one daemon thread, and Trio tasks hand it coroutines: `await bridge.call(factory)` builds
the coroutine, schedules it on the asyncio loop (`run_coroutine_threadsafe`), and parks
the Trio task on an event the loop sets through the Trio token when the coroutine ends.
One call costs two cross-thread wake-ups (docs/PERFORMANCE.md measures it against a
direct asyncio call). Cancelling the Trio task cancels the asyncio task and does not wait
for it (a publish already sent may still land: the backend's sequence fencing decides).

Nothing else crosses the threads: the client's objects live on the asyncio thread and are
only touched by coroutines the bridge runs there.

`AsyncioBridge.observer` (None in a server) is told when a call begins and ends, except
calls that park until something arrives from outside (`parks=True`: the next forwarded
request, the next notice). The tests' virtual clock uses it to move time only while no
request to the servers is in flight (tests/jetstream/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import trio

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from concurrent.futures import Future

_T = TypeVar("_T")


class CallObserver(Protocol):
    """Told (on the Trio thread) when a bridged call begins and when it ends."""

    def call_began(self) -> None: ...

    def call_ended(self) -> None: ...


class AsyncioBridge:
    """An asyncio event loop running on its own thread (`start` / `close`)."""

    observer: ClassVar[CallObserver | None] = None  # (a test seam; see the module doc)

    def __init__(self, name: str = "topicd-asyncio") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        assert self._loop is None
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._thread = threading.Thread(target=main, name=self._name, daemon=True)
        self._loop = loop
        self._thread.start()
        ready.wait()

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join the thread (blocking)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        thread.join()
        loop.close()
        self._loop = self._thread = None

    async def call(
        self, factory: Callable[[], Coroutine[object, object, _T]], *, parks: bool = False
    ) -> _T:
        """Run `factory()` on the asyncio loop; return its result or raise its exception
        (`parks`: the call waits for something from outside, not for a reply)."""
        observer = None if parks else AsyncioBridge.observer
        if observer is None:
            return await self._call(factory)
        observer.call_began()
        try:
            return await self._call(factory)
        finally:
            observer.call_ended()

    async def _call(self, factory: Callable[[], Coroutine[object, object, _T]]) -> _T:
        loop = self._loop
        assert loop is not None, "the bridge is not started"
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_: Future[_T]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future = asyncio.run_coroutine_threadsafe(factory(), loop)
        future.add_done_callback(wake)
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        return future.result()
