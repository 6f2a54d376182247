"""`SyncClient`: the async client behind a blocking facade, for scripts and REPLs.

One background thread runs a Trio loop (an `anyio` blocking portal) that owns an async
`Client`; every method hands its call to that loop and waits. The connection pool and the
backpressure state therefore live as long as the `SyncClient`, so keep-alive works across
calls. Iterators (`diff`, `watch`) fetch one event per step through the same loop. Close
it (`close()`, or `with SyncClient(...) as client:`) to stop the thread.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Literal, TypeVar

from anyio.from_thread import start_blocking_portal

from topicd.client._client import AUTO, DEFAULT_URL, Client, _Auto

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
    from types import TracebackType

    from topicd.client.backpressure import BackpressurePolicy
    from topicd.client.errors import JsonObject
    from topicd.client.models import Event, Job, LeaseResult, WriteResult

_T = TypeVar("_T")


class SyncClient:
    """Blocking twin of `Client` (same arguments, same methods, same errors)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        policy: BackpressurePolicy | None = None,
        timeout: float = 10.0,
    ) -> None:
        self._cm = start_blocking_portal("trio")
        self._portal = self._cm.__enter__()
        self._client: Client = self._portal.call(self._make, url, token, policy, timeout)

    @staticmethod
    async def _make(
        url: str, token: str | None, policy: BackpressurePolicy | None, timeout_s: float
    ) -> Client:
        return Client(url, token=token, policy=policy, timeout=timeout_s)

    def close(self) -> None:
        try:
            self._portal.call(self._client.aclose)
        finally:
            self._cm.__exit__(None, None, None)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        return self._portal.call(fn)

    def put_topic(self, topic: str, config: Mapping[str, object] | None = None) -> JsonObject:
        return self._run(partial(self._client.put_topic, topic, config))

    def get_topic(self, topic: str, *, touch: bool = True) -> JsonObject:
        return self._run(partial(self._client.get_topic, topic, touch=touch))

    def list_topics(self, prefix: str | None = None) -> list[JsonObject]:
        return self._run(partial(self._client.list_topics, prefix))

    def delete_topic(self, topic: str, *, if_empty: bool = False) -> JsonObject:
        return self._run(partial(self._client.delete_topic, topic, if_empty=if_empty))

    def write(
        self,
        topic: str,
        data: object,
        *,
        tag: str | None = None,
        meta: object = None,
        node: str | None = None,
        priority: int | None = None,
        idempotency_key: str | _Auto | None = AUTO,
        create: bool | None = None,
        config: Mapping[str, object] | None = None,
    ) -> WriteResult:
        call = partial(
            self._client.write,
            topic,
            data,
            tag=tag,
            meta=meta,
            node=node,
            priority=priority,
            idempotency_key=idempotency_key,
            create=create,
            config=config,
        )
        return self._run(call)

    def write_batch(
        self,
        topic: str,
        records: Sequence[Mapping[str, object]],
        *,
        node: str | None = None,
        idempotency_key: str | _Auto | None = AUTO,
        create: bool | None = None,
        config: Mapping[str, object] | None = None,
    ) -> WriteResult:
        call = partial(
            self._client.write_batch,
            topic,
            records,
            node=node,
            idempotency_key=idempotency_key,
            create=create,
            config=config,
        )
        return self._run(call)

    def diff(
        self,
        topic: str,
        from_seq: int = 0,
        *,
        limit: int = 0,
        node: str | Sequence[str] | None = None,
        include_tags: bool = False,
        include_meta: bool = True,
    ) -> Iterator[Event]:
        """Events up to the topic's head (the blocking form of `Client.diff`)."""
        reader = self._client.diff(
            topic,
            from_seq,
            limit=limit,
            node=node,
            include_tags=include_tags,
            include_meta=include_meta,
        )
        while True:
            try:
                yield self._run(reader.__anext__)
            except StopAsyncIteration:
                return

    def watch(
        self,
        topics: Mapping[str, int | Literal["tail"]],
        *,
        node: str | Sequence[str] | None = None,
        include_tags: bool = False,
        include_meta: bool = True,
    ) -> Iterator[Event]:
        """Live events (the blocking form of `Client.watch`); closing the iterator (or
        leaving its `for` loop) closes the stream."""
        stream = self._client.watch(
            topics, node=node, include_tags=include_tags, include_meta=include_meta
        )
        try:
            while True:
                try:
                    yield self._run(stream.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self._run(stream.aclose)

    def claim(
        self, queue: str, node: str, *, max: int = 1, lease_ms: int | None = None
    ) -> list[Job]:
        return self._run(partial(self._client.claim, queue, node, max=max, lease_ms=lease_ms))

    def ack(self, queue: str, node: str, seqs: Sequence[int]) -> LeaseResult:
        return self._run(partial(self._client.ack, queue, node, seqs))

    def nack(self, queue: str, node: str, seqs: Sequence[int], *, delay_ms: int = 0) -> LeaseResult:
        return self._run(partial(self._client.nack, queue, node, seqs, delay_ms=delay_ms))

    def extend(self, queue: str, node: str, seqs: Sequence[int], *, lease_ms: int) -> LeaseResult:
        return self._run(partial(self._client.extend, queue, node, seqs, lease_ms=lease_ms))

    def put_router(self, router: str, source: str, dest: str) -> JsonObject:
        return self._run(partial(self._client.put_router, router, source, dest))

    def get_router(self, router: str) -> JsonObject:
        return self._run(partial(self._client.get_router, router))

    def list_routers(self) -> list[JsonObject]:
        return self._run(self._client.list_routers)

    def delete_router(self, router: str) -> JsonObject:
        return self._run(partial(self._client.delete_router, router))

    def health(self) -> JsonObject:
        return self._run(self._client.health)
