"""The forwarding seam: an engine that does not run its topics' mutations itself.

On a storage backend shared by several processes (the jetstream backend's *fronts*), one
front owns the mutations (topic create, config and delete, writes, record deletes) of a
topic and the others hand them over. `Engine.forward` is then set: the engine passes each mutation
to it whole (the owner runs it through its own engine, with its validation, seqs,
idempotency and errors), and before a read it lets the forwarder bring the topic up to
date (`catch_up`), so a read on any process sees every write acknowledged before it
began. Read times (`last_read_ts`) are the owner's too: a read on another process hands
its time to the owner and takes the owner's back, and the topic count a readiness probe
reports is the shared storage's (`topic_count`). With `forward` None (the default, every
single-process backend) nothing changes. Queue calls (claim, ack, nack, extend) of a
topic another process owns run on the owner too (`queue_op`): one lease table per queue.

`Engine.peers` is set on every such process, whether or not it forwards anything: the
other processes of the deployment, which `/v0/metrics` asks for their own figures
(`Peers.gather_figures`) so that a scrape of any of them answers for the whole deployment.
Each answers from `Engine.figures`, which the HTTP layer sets (the figures are its
format), counting the topics of the shards the asker assigned it, so that each topic is
counted by one process only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from topicd.engine.engine import DeleteResult, WriteResult
    from topicd.engine.topic import Topic
    from topicd.errors import JsonValue
    from topicd.wire import DeleteIn, PlainWriteIn, TopicConfigIn, WriteIn

    # what a process answers when asked for its figures: the request's head (`form`), and
    # which topics it counts (by name: those of the shards the asker assigned it)
    Figures = Callable[[dict[str, JsonValue], Callable[[str], bool]], Awaitable[JsonValue]]


@dataclass(frozen=True, slots=True)
class Answer:
    """One other process's figures (`Engine.figures`' answer), which count the topics of
    `shards`."""

    front: str
    shards: frozenset[int]
    figures: JsonValue


@dataclass(frozen=True, slots=True)
class Gathered:
    """What `Peers.gather_figures` got: `live` processes in all (this one included);
    the answers that came in time; the ids of those that did not."""

    live: int
    answers: list[Answer]
    missing: list[str]


class Peers(Protocol):
    """The other processes sharing this one's storage (for `/v0/metrics`)."""

    def shard_of(self, name: str) -> int:
        """The shard of topic `name` (the unit `Answer.shards` counts in)."""
        ...

    async def gather_figures(self, head: dict[str, JsonValue]) -> Gathered:
        """Ask every other live process for its figures (`Engine.figures` there), in
        parallel, each within a short bound; one that does not answer in time is left
        out (`Gathered.missing`). Never raises for want of an answer."""
        ...


class Forwarder(Protocol):
    """Where a non-owning engine sends its mutations (each raises the owner's error)."""

    def owns(self, name: str) -> bool:
        """Whether this process runs `name`'s mutations itself (then nothing is
        forwarded or caught up for it)."""
        ...

    async def put_topic(self, name: str, cin: TopicConfigIn | None) -> tuple[Topic, bool]:
        """`Engine.put_topic` on the owner; returns this process's (caught-up) topic."""
        ...

    async def delete_topic(self, name: str, if_empty: bool) -> tuple[bool, list[str]]:
        """`Engine.delete_topic_cascade` on the owner."""
        ...

    async def append(
        self,
        name: str,
        req: WriteIn | PlainWriteIn,
        header_key: str | None,
        can_admin: bool,
    ) -> WriteResult:
        """`Engine.append` on the owner."""
        ...

    async def delete_records(self, name: str, req: DeleteIn) -> DeleteResult:
        """`Engine.delete_records` on the owner; the result names this process's topic."""
        ...

    async def queue_op(self, name: str, op: str, args: dict[str, object]) -> dict[str, object]:
        """A queue call (`claim`, `ack`, `nack`, `extend`: `QueueService`'s method of that
        name with `args`) run on the owner, which runs every queue's leases; returns the
        owner's answer (see `QueueService.forwarded_answer`)."""
        ...

    def queue_counts(self, topic: Topic) -> tuple[int, int, int, int] | None:
        """The owner's last known (ready, in_flight, delayed, dead_lettered) of `topic`, a
        queue this process does not run (None: none known yet)."""
        ...

    async def catch_up_all(self) -> None:
        """Before a listing: learn the topics created and deleted elsewhere, catch up
        those whose records moved, and take the owners' read times."""
        ...

    async def catch_up(self, name: str, *, touch: bool = False, reads: bool = False) -> None:
        """Bring `name` (its records, config, record deletes, existence) up to what the
        shared storage held when the call began; `reads`: its read time too, up to the
        owner's; `touch`: this read counts as one (the owner has it before this returns)."""
        ...

    async def share_reads(self, topics: list[Topic]) -> None:
        """After a listing that touched `topics`: their owners have the read times."""
        ...

    async def topic_count(self) -> int:
        """The topics of the whole shared storage (for the readiness probe)."""
        ...
