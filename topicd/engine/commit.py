"""The one commit path every mutation goes through.

The engine never changes visible state directly. A write reserves seqs, builds its records
and hands an `AppendBatch` to `CommitPath.submit()`; the path decides when the batch is
*published* (made visible, in seq order) by calling the engine's publish callback, and
resolves the batch's `Completion`, which the request awaits. Control mutations (topic
create/config/delete, record deletes) go through `CommitPath.control()` the same way: the
mutation's `apply` callback runs when the path says it is committed.

`InMemoryCommitPath` publishes synchronously inside `submit()`: ack = visibility = the
in-memory append, which is what the `ephemeral` class promises. The write-ahead log
(storage) implements the same protocol with per-shard group commit, publishing from its
committer tasks after `write()`/`fdatasync`, and failing a batch with
`StorageUnavailable` without ever publishing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

if TYPE_CHECKING:
    from collections.abc import Callable

    from topicd.engine.idempotency import IdemEntry
    from topicd.engine.topic import Topic
    from topicd.engine.writes import PreparedWrite
    from topicd.errors import TopicdError

_T = TypeVar("_T")


@dataclass(eq=False, slots=True)
class AppendBatch:
    """One write request's records: committed atomically or not at all.

    `encs` are the records' stored JSON texts for seqs `first_seq ..`; `prepared` keeps
    their sizes and sparse extras (tags, nodes, priorities, shapes).
    """

    topic: Topic
    first_seq: int
    ts: int
    encs: list[bytes]
    prepared: PreparedWrite
    idem_key: str | None = None
    idem: IdemEntry | None = None
    durability: str = "disk"
    head_after: int = 0  # topic head right after this batch published
    fsync_ms: float = 0.0
    completion: Completion = field(default_factory=lambda: Completion())

    @property
    def count(self) -> int:
        return len(self.encs)

    @property
    def nbytes(self) -> int:
        return self.prepared.nbytes


class Completion:
    """Resolves exactly once: OK, or FAILED with the error the request must return."""

    __slots__ = ("_error", "_event", "_resolved")

    def __init__(self) -> None:
        self._resolved = False
        self._error: TopicdError | None = None
        self._event: trio.Event | None = None

    @property
    def resolved(self) -> bool:
        return self._resolved

    def set_ok(self) -> None:
        assert not self._resolved
        self._resolved = True
        if self._event is not None:
            self._event.set()

    def set_failed(self, error: TopicdError) -> None:
        assert not self._resolved
        self._resolved = True
        self._error = error
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        """Wait for the outcome; raise the failure. A checkpoint even when resolved.

        Cancellation abandons the wait only: the submission commits or fails on its own.
        """
        if not self._resolved:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        else:
            await trio.lowlevel.checkpoint()
        if self._error is not None:
            raise self._error


class CommitPath(Protocol):
    def submit(self, batch: AppendBatch) -> Completion:
        """Accept a batch (synchronous, cannot fail once admitted); publish it later."""
        ...

    async def control(self, topic: Topic | None, apply: Callable[[], _T]) -> _T:
        """Log a control mutation and run `apply` once it is committed; return its value."""
        ...


class InMemoryCommitPath:
    """Publishes at once: nothing is logged (the `ephemeral` behaviour for every class)."""

    def __init__(self, publish: Callable[[AppendBatch], None]) -> None:
        self._publish = publish

    def submit(self, batch: AppendBatch) -> Completion:
        self._publish(batch)
        batch.completion.set_ok()
        return batch.completion

    async def control(self, topic: Topic | None, apply: Callable[[], _T]) -> _T:
        await trio.lowlevel.checkpoint()
        return apply()
