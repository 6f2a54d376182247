"""The one commit path every mutation goes through.

The engine never changes visible state directly. A write reserves seqs, builds its records
and hands an `AppendBatch` to `CommitPath.submit()`; the path decides when the batch is
*published* (made visible, in seq order) by calling `CommitHooks.publish_append`, and
resolves the batch's `Completion`, which the request awaits. Control mutations (topic
create/config/delete, record deletes, seq reservations, lost ranges) go through
`CommitPath.control()` the same way, with the encoded frame that makes them durable and
an `apply` callback that runs once they are committed. Recovery replays the same frames
through the same `Engine.apply_*` methods, so live and replayed state cannot diverge.

`InMemoryCommitPath` publishes synchronously inside `submit()` and applies control
mutations at once: nothing is logged (tests, and the `ephemeral` behaviour).
`topicd.storage.wal.WalCommitPath` is the write-ahead log: per-shard group commit,
publishing from committer tasks after `write()`/`fdatasync`, and failing a batch with
`StorageUnavailable` without ever publishing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

from topicd.errors import TopicdError

if TYPE_CHECKING:
    from collections.abc import Callable

    from topicd.engine.idempotency import IdemEntry
    from topicd.engine.topic import Topic
    from topicd.engine.writes import PreparedWrite
    from topicd.errors import JsonValue

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
    synced: bool = True  # on disk when published (False: written, fdatasync pending)
    fsync_ms: float = 0.0
    wal_append_ms: float | None = None  # None: the batch never touched the WAL
    completion: Completion = field(default_factory=lambda: Completion())
    # the encs joined by NUL bytes, as `encode_batch` formatted them: the WAL's Append
    # body takes it without per-record work; the commit path drops it once framed
    joined: bytes | memoryview | None = None

    @property
    def count(self) -> int:
        return len(self.encs)

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.encs) - 1

    @property
    def nbytes(self) -> int:
        return self.prepared.nbytes


class Completion:
    """Resolves exactly once: OK, or FAILED with the error the request must return.

    One task waits (the request that submitted the batch): resolving reschedules it
    directly, without an event object per write."""

    __slots__ = ("_error", "_resolved", "_waiter")

    def __init__(self) -> None:
        self._resolved = False
        self._error: TopicdError | None = None
        self._waiter: trio.lowlevel.Task | None = None

    @property
    def resolved(self) -> bool:
        return self._resolved

    @property
    def error(self) -> TopicdError | None:
        return self._error

    def set_ok(self) -> None:
        assert not self._resolved
        self._resolved = True
        self._wake()

    def set_failed(self, error: TopicdError) -> None:
        assert not self._resolved
        self._resolved = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter)

    async def wait(self) -> None:
        """Wait for the outcome; raise the failure. A checkpoint even when resolved.

        Cancellation abandons the wait only: the submission commits or fails on its own.
        """
        if not self._resolved:
            assert self._waiter is None, "one task waits for a completion"
            self._waiter = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self._waiter = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.checkpoint()
        if self._error is not None:
            raise self._error


class CommitHooks(Protocol):
    """What the engine offers the commit path."""

    def publish_append(self, batch: AppendBatch) -> None:
        """Make a committed batch visible (in seq order per topic) and resolve it."""
        ...

    def fail_append(self, batch: AppendBatch, error: TopicdError) -> None:
        """A batch will never be published: resolve it FAILED, drop its idempotency entry."""
        ...

    def rewind(self, topic: Topic) -> None:
        """Every pending submission of `topic` failed: release the seqs above its head."""
        ...

    def durable(self, topic: Topic, seq: int) -> None:
        """A sync made `topic`'s records up to `seq` durable (published earlier unsynced)."""
        ...


class CommitPath(Protocol):
    def attach(self, hooks: CommitHooks) -> None: ...

    def admit(self, topic: Topic, nbytes: int, *, bypass: bool = False) -> None:
        """Steps 9-10 of api-topics §6.2 for a write of `nbytes`: the shard's breaker is
        closed (every class but `ephemeral`), pressure admission passes (skipped with
        `bypass`: a `disable_backpressure` write) and its ingest has room. Raises
        `StorageUnavailable` or `Throttled` (cause `wal_ingest`, or pressure).
        Synchronous."""
        ...

    def backlog_full(self, topic: Topic) -> bool:
        """Whether a write to `topic` would add to records pinned in memory past their
        bound (the checkpoint backlog of a WAL backend): it should wait first."""
        ...

    async def wait_backlog(self) -> None:
        """Until the backlog `backlog_full` reports is below its bound again."""
        ...

    def govern(self, pressure: float, commit_window_ms: float | None) -> None:
        """The governor's sample: current pressure, and the group-commit window when it
        moved (None: unchanged)."""
        ...

    def pool_loads(self, now: float) -> list[tuple[str, float, int]]:
        """Offload groups as (group, busy token-seconds up to `now`, tokens): signal s3."""
        ...

    def backlog_ratio(self) -> float:
        """How long the accepted, uncommitted writes take to commit, as a share of the
        time bound on them (signal s5; 0 where nothing queues for a commit)."""
        ...

    def check_stalls(self, now: float) -> None:
        """Open a shard's breaker whose WAL call has been outstanding too long (R3.2)."""
        ...

    async def wait_for_room(self, topic: Topic, nbytes: int) -> None:
        """Wait until `admit` could pass (a `disable_backpressure` write); the caller
        bounds the wait with its own cancel scope."""
        ...

    def submit(self, batch: AppendBatch) -> None:
        """Accept an admitted batch (synchronous, cannot fail); publish it later."""
        ...

    async def control(
        self,
        topic: Topic,
        frame: bytes | None,
        apply: Callable[[], _T],
        *,
        sync: bool = True,
        abandoned: Callable[[], None] | None = None,
    ) -> _T:
        """Log `frame` for `topic` (None: nothing to log) and run `apply` once it is
        durable (`sync=False`: once written, not synced); return its value (or raise what
        it raised).

        `abandoned`, if given, runs exactly when the mutation will never be applied (the
        commit failed, `apply` raised, or the call was cancelled before the mutation was
        handed over), whether or not the caller still waits: a caller that must undo
        something on failure can then be cancelled safely, without a shielded wait."""
        ...

    def status(self) -> dict[str, JsonValue] | None:
        """Storage state for `/v0/ready` (None without a WAL)."""
        ...

    def check_all(self) -> None:
        """Raise `503 storage_unavailable` if any shard's breaker is not closed."""
        ...


class StorageBackend(CommitPath, Protocol):
    """The storage seam: everything the engine asks of storage (docs/architecture.md).

    `CommitPath` is its write half: appends (`submit`; the backend publishes each batch
    through `CommitHooks.publish_append` with the seqs it committed) and control mutations
    (`control`: topic registry and configs, deletes by seq and by tag, floors, seq
    reservations, router and lease state, each as the frame that makes it durable). The
    rest is below. Only the embedded backend (WAL + segments) needs `checkpoint`;
    recovery is the backend's constructor (`topicd.storage.service`). A replicated backend
    would assign seqs itself and implement `checkpoint` as a no-op.
    """

    async def checkpoint(self, *, final: bool = False) -> bool:
        """Make the log trimmable (absorb into segments, snapshot); True on success."""
        ...

    async def read_stored(self, topic: Topic, seq: int, min_visible: int) -> bytes | None:
        """The stored JSON of record `seq` from durable storage (None when no live record
        at or above `min_visible` holds it). A checksum failure raises `Internal` (500)
        and is counted: corrupt bytes are never served."""
        ...

    async def read_stored_range(
        self, topic: Topic, lo: int, hi: int, max_bytes: int
    ) -> dict[int, bytes]:
        """The stored JSON of the live records `lo ..= hi` from durable storage, in seq
        order, stopping once `max_bytes` of them were read (at least one record). The
        payload cache's misses (`topicd.engine.payloads`). Like `read_stored`: offloaded,
        verified, a checksum failure raises `Internal` (500) and is counted."""
        ...

    def storage_stats(self) -> dict[str, int]:
        """Counters for metrics (segments, sealed, bytes, corruptions)."""
        ...


class InMemoryCommitPath:
    """Publishes at once: nothing is logged (the `ephemeral` behaviour for every class)."""

    def __init__(self) -> None:
        self._hooks: CommitHooks | None = None

    def attach(self, hooks: CommitHooks) -> None:
        self._hooks = hooks

    def admit(self, topic: Topic, nbytes: int, *, bypass: bool = False) -> None:
        return None

    def backlog_full(self, topic: Topic) -> bool:
        return False

    async def wait_backlog(self) -> None:
        return None

    def govern(self, pressure: float, commit_window_ms: float | None) -> None:
        return None

    def pool_loads(self, now: float) -> list[tuple[str, float, int]]:
        return []

    def backlog_ratio(self) -> float:
        return 0.0

    def check_stalls(self, now: float) -> None:
        return None

    async def wait_for_room(self, topic: Topic, nbytes: int) -> None:
        await trio.lowlevel.checkpoint()

    def submit(self, batch: AppendBatch) -> None:
        assert self._hooks is not None
        self._hooks.publish_append(batch)

    async def control(
        self,
        topic: Topic,
        frame: bytes | None,
        apply: Callable[[], _T],
        *,
        sync: bool = True,
        abandoned: Callable[[], None] | None = None,
    ) -> _T:
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled:
            if abandoned is not None:
                abandoned()
            raise
        try:
            return apply()
        except TopicdError:
            if abandoned is not None:
                abandoned()
            raise

    def status(self) -> dict[str, JsonValue] | None:
        return None

    def check_all(self) -> None:
        return None

    # ---- StorageBackend: the fake has nothing beyond memory --------------------------

    async def checkpoint(self, *, final: bool = False) -> bool:
        await trio.lowlevel.checkpoint()
        return True

    async def read_stored(self, topic: Topic, seq: int, min_visible: int) -> bytes | None:
        await trio.lowlevel.checkpoint()
        enc = topic.enc(seq)
        return enc if isinstance(enc, bytes) and seq >= min_visible else None

    async def read_stored_range(
        self, topic: Topic, lo: int, hi: int, max_bytes: int
    ) -> dict[int, bytes]:
        await trio.lowlevel.checkpoint()  # nothing is ever evicted without segments
        out: dict[int, bytes] = {}
        for seq in range(lo, hi + 1):
            enc = topic.enc(seq)
            if isinstance(enc, bytes):
                out[seq] = enc
        return out

    def storage_stats(self) -> dict[str, int]:
        return {}
