"""Queue topics on the jetstream backend: the per-queue journal (docs/jetstream.md, "Queues").

A queue's jobs are its stream's records, as for any topic. What the embedded backend logs
besides records, acks (a `RecordsDelete` with explicit seqs) and lease events (`Lease`
frames of a queue with `leases_durable`), goes into the queue's **journal**: one more
stream, `<prefix>_Q<id>` (subject `<prefix>.q.<id>`), created with the topic and deleted
with it. A journal message is one JSON object:

- `{"k": "ack", "seqs": [...]}`: an ack (or a dead-letter move's delete). Its publish is
  the commit point; the jobs' messages are then deleted from the topic's stream. A front
  that stopped in between leaves records the journal has acked: the next load of the
  journal deletes them (memory and stream).
- `{"k": "lease", "events": [...]}`: one call's lease events, exactly the `Lease` frame's
  body (a queue with `leases_durable`). A load replays them into the queue's logged
  projection (`JobQueue.replay`), as recovery replays the WAL's frames.
- `{"k": "own", "front": id}`: a new owner front took the queue over (see below).

Every publish carries `Nats-Expected-Last-Sequence` = the journal's last seq this front
knows: the journal has one writer, the queue's owner. A front that takes a shard over
loads the journal of each of its queues (rebuilding the leases from it, as a restart
does) and publishes an `own` marker on top, so a deposed owner's next ack or lease
publish fails its fence (`503`) and can never land after the new owner began serving.
A follower front reads the journal's new messages before each read of a queue (and
applies the acks to its records), so its diffs see acks made through the owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import partial
from typing import TYPE_CHECKING, Final, TypeVar

import orjson
import trio

from topicd.engine.queues import QueueSnap, leases_durable
from topicd.errors import StorageUnavailable, TopicNotFound

if TYPE_CHECKING:
    from collections.abc import Callable

    from nats.aio.msg import Msg

    from topicd.engine.topic import Topic
    from topicd.storage.jetstream import JetStreamBackend, JetStreamStore

log = logging.getLogger("topicd.storage.jsqueues")

_T = TypeVar("_T")

PAGE: Final = 256  # journal messages per direct get
# an owner compacts a queue's journal once this many messages are above its last
# snapshot (and twice the snapshot's own messages)
COMPACT_MIN: Final = 1024
SNAP_PART: Final = 4096  # lease entries per snapshot message
READ_ATTEMPTS: Final = 20  # direct gets behind the leader's last seq: retries, 50 ms apart


def stream(store: JetStreamStore, topic_id: int) -> str:
    return f"{store.prefix}_Q{topic_id}"


def subject(store: JetStreamStore, topic_id: int) -> str:
    return f"{store.prefix}.q.{topic_id}"


# ---- the client half (coroutines on the bridge's asyncio loop) -------------------------


async def create(store: JetStreamStore, topic_id: int) -> None:
    from nats.js import api

    assert store.js is not None
    await store.js.add_stream(
        api.StreamConfig(
            name=stream(store, topic_id),
            subjects=[subject(store, topic_id)],
            storage=api.StorageType.FILE,
            num_replicas=store.replicas,
            allow_direct=True,
            deny_delete=True,
            deny_purge=False,
        )
    )


async def delete(store: JetStreamStore, topic_id: int) -> None:
    import nats.js.errors

    assert store.js is not None
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await store.js.delete_stream(stream(store, topic_id))


async def append(store: JetStreamStore, topic_id: int, expected_last: int, payload: bytes) -> int:
    """Publish one journal message at `expected_last + 1` (raises on a failed fence)."""
    assert store.js is not None
    ack = await store.js.publish(
        subject(store, topic_id),
        payload,
        headers={"Nats-Expected-Last-Sequence": str(expected_last)},
    )
    return int(ack.seq)


async def read(
    store: JetStreamStore, topic_id: int, after: int
) -> tuple[list[tuple[int, bytes]], int, bool]:
    """(the journal's messages above seq `after` with their seqs, its last seq, whether
    it was compacted past `after`: messages above `after` were purged, and a snapshot
    stands for them), as its leader holds them: the leader's last seq first, then
    batched direct gets up to it (a journal has no interior gaps, so a short answer is a
    lagging replica's and is retried, or a compaction's purge: then the read goes on
    from the new first seq)."""
    import nats.js.errors

    assert store.js is not None
    assert store.nc is not None
    name = stream(store, topic_id)
    try:
        info = await store.js.stream_info(name)
    except nats.js.errors.NotFoundError:
        return [], after, False
    first, last = int(info.state.first_seq), int(info.state.last_seq)
    skipped = first > after + 1 and last > after
    out: list[tuple[int, bytes]] = []
    seq = max(after + 1, first)
    attempts = 0
    while seq <= last:
        got = await _direct(store, name, seq, min(PAGE, last - seq + 1))
        run: list[tuple[int, bytes]] = []
        for s, data in sorted(got):
            if s != seq + len(run):
                break
            run.append((s, data))
        if not run:
            info = await store.js.stream_info(name)
            if int(info.state.first_seq) > seq:  # purged meanwhile by a compaction
                seq, skipped = int(info.state.first_seq), True
                continue
            attempts += 1
            if attempts >= READ_ATTEMPTS:
                raise RuntimeError(f"direct gets from {name} stay behind its leader")
            await asyncio.sleep(0.05)
            continue
        out.extend(run)
        seq += len(run)
    return out, max(last, after), skipped


async def purge(store: JetStreamStore, topic_id: int, below: int) -> None:
    """Remove the journal's messages below seq `below` (a snapshot stands for them)."""
    assert store.js is not None
    await store.js.purge_stream(stream(store, topic_id), seq=below)


async def _direct(store: JetStreamStore, name: str, lo: int, n: int) -> list[tuple[int, bytes]]:
    nc = store.nc
    assert nc is not None
    got: list[tuple[int, bytes]] = []
    done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def collect(msg: Msg) -> None:
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is not None:
            if not done.done():
                done.set_result(status)
            return
        got.append((int(headers["Nats-Sequence"]), bytes(msg.data)))

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=collect)
    try:
        req = {"seq": lo, "batch": n}
        await nc.publish(f"$JS.API.DIRECT.GET.{name}", orjson.dumps(req), reply=inbox)
        await asyncio.wait_for(done, store.timeout)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return got


async def journal_ids(store: JetStreamStore) -> list[int]:
    """The topic ids of every journal stream of this prefix (a listing by the metadata
    leader; one request per 256 streams)."""
    assert store.nc is not None
    head = f"{store.prefix}_Q"
    out: list[int] = []
    offset = 0
    while True:
        req = {"offset": offset, "subject": f"{store.prefix}.q.>"}
        msg = await store.nc.request(
            "$JS.API.STREAM.NAMES", orjson.dumps(req), timeout=store.timeout
        )
        resp = orjson.loads(msg.data)
        if "error" in resp:
            raise RuntimeError(f"listing the journals: {resp['error']}")
        names = resp.get("streams") or []
        out.extend(
            int(n[len(head) :]) for n in names if n.startswith(head) and n[len(head) :].isdigit()
        )
        offset += len(names)
        if not names or offset >= int(resp.get("total", 0)):
            return sorted(out)


async def delete_jobs(store: JetStreamStore, topic_id: int, seqs: list[int]) -> None:
    """Delete acked jobs' messages from the topic's stream (concurrently; gone is fine)."""
    import nats.js.errors

    assert store.js is not None
    js = store.js
    name = store.stream(topic_id)

    async def one(seq: int) -> None:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_msg(name, seq)

    await asyncio.gather(*(one(s) for s in seqs))


# ---- the Trio half ----------------------------------------------------------------------


class Journals:
    """The journals of one front's queues: the last seq it knows of each, and the
    owner's fenced appends."""

    def __init__(self, backend: JetStreamBackend) -> None:
        self.backend = backend
        self.heads: dict[int, int] = {}  # topic id -> the journal's last seq seen here
        self.locks: dict[int, trio.Lock] = {}
        # acks journaled whose jobs are still being deleted from the stream and applied
        # (per topic id), and an event set when the last of a topic's finishes
        self.inflight: dict[int, int] = {}
        self.idle: dict[int, trio.Event] = {}
        # acked jobs whose delete from the stream failed (a compaction retries them
        # first: every ack below a snapshot must have its jobs gone from the stream)
        self.undeleted: dict[int, set[int]] = {}
        # the seq of the last snapshot (its first part) each journal holds, as far as
        # this front knows; a snapshot being read: its parts so far
        self.snap_at: dict[int, int] = {}
        self._parts: dict[int, list[dict[str, object]]] = {}

    def lock(self, topic_id: int) -> trio.Lock:
        lock = self.locks.get(topic_id)
        if lock is None:
            lock = self.locks[topic_id] = trio.Lock()
        return lock

    async def create(self, topic_id: int) -> None:
        await self.backend._call(partial(create, self.backend.store, topic_id))
        self.heads[topic_id] = 0

    async def sweep(self, live: set[int]) -> None:
        """At the start of a front owning every shard: delete the journals of topics
        that no longer exist (left behind by a front that stopped between a queue's
        delete and its journal's)."""
        store = self.backend.store
        for tid in await self.backend._call(partial(journal_ids, store)):
            if tid not in live:
                log.warning("removing journal %s: no registry entry names it", stream(store, tid))
                await self.backend._call(partial(delete, store, tid))

    async def delete(self, topic_id: int) -> None:
        self.heads.pop(topic_id, None)
        self.locks.pop(topic_id, None)
        self.snap_at.pop(topic_id, None)
        self.undeleted.pop(topic_id, None)
        await self.backend._call(partial(delete, self.backend.store, topic_id))

    async def _publish(self, topic: Topic, msg: dict[str, object]) -> None:
        """The owner's fenced append. A failed fence: another front wrote the journal
        since; if this front still holds the lease (a deposed owner wrote before this
        one's marker), load what it wrote and try once more, otherwise `503`."""
        backend = self.backend
        tid = topic.topic_id
        payload = orjson.dumps(msg)
        for attempt in range(2):
            head = self.heads.get(tid, 0)
            try:
                self.heads[tid] = await backend._call(
                    partial(append, backend.store, tid, head, payload)
                )
                return
            except StorageUnavailable:
                fronts = backend.fronts
                if attempt or fronts is None or not await fronts.holds_lease(topic.name):
                    raise
            await self.follow(topic)
        raise AssertionError("unreachable")

    async def ack(self, topic: Topic, seqs: list[int], apply: Callable[[], _T]) -> _T:
        """An ack's delete: journaled (the commit point), the jobs deleted from the
        stream, then applied."""
        tid = topic.topic_id
        async with self.lock(tid):
            if topic.deleted:
                raise TopicNotFound(topic.name)
            await self._publish(topic, {"k": "ack", "seqs": seqs})
            self.inflight[tid] = self.inflight.get(tid, 0) + 1
        try:
            try:
                await self.backend._call(partial(delete_jobs, self.backend.store, tid, seqs))
            except Exception as exc:  # journaled: the next load of the journal finishes it
                log.warning(
                    "queue %r: acked jobs not deleted from the stream yet: %s", topic.name, exc
                )
                self.undeleted.setdefault(tid, set()).update(seqs)
            return apply()
        finally:
            self.inflight[tid] -= 1
            if not self.inflight[tid]:
                del self.inflight[tid]
                idle = self.idle.pop(tid, None)
                if idle is not None:
                    idle.set()

    async def settled(self, topic_id: int) -> None:
        """Until the acks journaled so far have deleted their jobs and been applied
        (with the journal lock held: no new ack starts meanwhile)."""
        while self.inflight.get(topic_id):
            idle = self.idle.get(topic_id)
            if idle is None:
                idle = self.idle[topic_id] = trio.Event()
            await idle.wait()
        await trio.lowlevel.checkpoint()

    async def lease(self, topic: Topic, body: dict[str, object], apply: Callable[[], _T]) -> _T:
        async with self.lock(topic.topic_id):
            if topic.deleted:
                raise TopicNotFound(topic.name)
            await self._publish(topic, {"k": "lease", "events": body["events"]})
            return apply()

    async def follow(self, topic: Topic) -> int:
        """Apply the journal's messages this front has not seen: acks delete their
        records here; lease events go into the logged projection. Returns how many."""
        backend = self.backend
        tid = topic.topic_id
        msgs, last, skipped = await backend._call(
            partial(read, backend.store, tid, self.heads.get(tid, 0))
        )
        if topic.deleted:
            return 0
        self._apply(topic, msgs)
        self.heads[tid] = max(self.heads.get(tid, 0), last)
        if skipped:
            await self._acked_elsewhere(topic)
        return len(msgs)

    async def _acked_elsewhere(self, topic: Topic) -> None:
        """The journal was compacted past what this front had read: the acks it missed
        are gone from it, and their jobs from the stream (a compaction deletes every
        acked job first), so the records the stream no longer holds are dropped here."""
        fronts = self.backend.fronts
        assert fronts is not None
        log.info("queue %r: its journal was compacted past this front's reads", topic.name)
        await fronts.reconcile(topic)

    def _apply(self, topic: Topic, msgs: list[tuple[int, bytes]]) -> list[int]:
        """Apply journal messages; returns the acked seqs whose records were still live."""
        engine = self.backend.engine
        assert engine is not None
        q = topic.queue
        tid = topic.topic_id
        live: list[int] = []
        for seq, raw in msgs:
            msg = orjson.loads(raw)
            kind = msg.get("k")
            parts = self._parts.get(tid)
            if kind == "snap":
                part, count = int(msg["part"]), int(msg["parts"])
                if part == 0:
                    parts = self._parts[tid] = []
                if parts is None or len(parts) != part:
                    self._parts.pop(tid, None)  # (a torn snapshot: its owner stopped)
                    continue
                parts.append(msg)
                if len(parts) == count:  # complete: it stands for everything before it
                    del self._parts[tid]
                    self.snap_at[tid] = seq - count + 1
                    if q is not None:
                        q.restore(_snap_of(parts))
                continue
            if parts is not None:  # a snapshot cut short by another message: not one
                del self._parts[tid]
            if kind == "ack":
                acked = [int(s) for s in msg["seqs"]]
                if q is not None:  # (an acked job's lease events are history)
                    for seq in acked:
                        q.logged.pop(seq, None)
                        q.logged_delays.pop(seq, None)
                seqs = [s for s in acked if topic.live(s)]
                if seqs:
                    live.extend(seqs)
                    engine.apply_seqs_delete(topic, seqs)
            elif kind == "lease" and q is not None:
                q.replay([tuple(e) for e in msg["events"]])
        return live

    async def load(self, topic: Topic, *, repair: bool) -> None:
        """At a rebuild: the whole journal (the logged projection of durable leases is
        replayed; acks whose records the stream still holds are applied, and with
        `repair` deleted from the stream)."""
        backend = self.backend
        tid = topic.topic_id
        self._parts.pop(tid, None)
        msgs, last, skipped = await backend._call(partial(read, backend.store, tid, 0))
        if repair and last == 0:
            # a queue made before journals existed, or whose journal a crash lost: make one
            await backend._call(partial(create, backend.store, tid))
        stale = self._apply(topic, msgs)
        self.heads[tid] = last
        if skipped:
            await self._acked_elsewhere(topic)
        if repair and stale:
            await backend._call(partial(delete_jobs, backend.store, tid, stale))

    async def fence(self, topic: Topic, front: str) -> None:
        """This front starts as `topic`'s owner (its journal just loaded): fence any
        previous owner out."""
        async with self.lock(topic.topic_id):
            await self._publish(topic, {"k": "own", "front": front})

    def compact_due(self, topic: Topic) -> bool:
        """Whether `topic`'s journal holds enough messages above its last snapshot for a
        compaction to pay (`COMPACT_MIN` and twice the messages a snapshot takes)."""
        q = topic.queue
        tid = topic.topic_id
        if q is None or tid not in self.heads:
            return False
        above = self.heads[tid] - self.snap_at.get(tid, 0)
        entries = len(q.leases) + len(q.deliveries) + len(q.delayed)
        return above >= max(COMPACT_MIN, 2 * (1 + entries // SNAP_PART))

    async def compact(self, topic: Topic) -> bool:
        """The owner's compaction of `topic`'s journal: a snapshot of the queue's lease
        state (its leases, delivery counters and nack delays) appended, fenced like any
        append (a deposed owner's fails), then the journal purged below it. Before it,
        every ack journaled has its jobs deleted from the stream, so a front that reads
        the journal from the snapshot on finds the stream holding no acked job. Returns
        whether it compacted."""
        engine = self.backend.engine
        assert engine is not None
        tid = topic.topic_id
        q = topic.queue
        if q is None:
            return False
        async with self.lock(tid):
            if topic.deleted:
                return False
            await self.settled(tid)  # (acks in flight: their jobs deleted, applied)
            undeleted = self.undeleted.pop(tid, None)
            if undeleted:
                try:
                    await self.backend._call(
                        partial(delete_jobs, self.backend.store, tid, sorted(undeleted))
                    )
                except BaseException:
                    self.undeleted.setdefault(tid, set()).update(undeleted)
                    raise
            if leases_durable(topic):
                snap = q.export(trio.current_time(), engine.clock.now_ms())
            else:  # (nothing about leases is journaled: an empty snapshot)
                snap = QueueSnap([], [], [])
            bodies = _snap_messages(snap)
            first = self.heads.get(tid, 0) + 1
            for body in bodies:
                await self._publish(topic, body)
            if self.heads[tid] != first + len(bodies) - 1:
                return False  # (another front's messages came in between: not one)
            self.snap_at[tid] = first
        from topicd.storage.jetstream import fault

        fault("journal.after_snapshot")
        await self.backend._call(partial(purge, self.backend.store, tid, first))
        log.info(
            "queue %r: journal compacted below seq %d (%d snapshot messages)",
            topic.name,
            first,
            len(bodies),
        )
        return True

    async def take_over(self, topic: Topic, front: str) -> None:
        """This front now owns `topic` (a queue): rebuild its leases from the journal, as
        a restart does, and fence the previous owner out with an `own` marker."""
        engine = self.backend.engine
        assert engine is not None
        q = topic.queue
        if q is None:
            return
        async with self.lock(topic.topic_id):
            self.heads[topic.topic_id] = 0
            q.logged = {}
            q.logged_delays = {}
            q.deliveries.clear()
            await self.load(topic, repair=True)
            await self._publish(topic, {"k": "own", "front": front})
            q.rebuild(engine.queues._lease_seed(), leases_durable(topic))
            q.resume(trio.current_time(), engine.clock.now_ms())
            engine.queues._schedule(q)
            q.changed()


def _snap_messages(snap: QueueSnap) -> list[dict[str, object]]:
    """A snapshot's journal messages: its leases, counters and delays, `SNAP_PART`
    entries per message (every message names its part and the count)."""
    rows: list[tuple[str, list[object]]] = []
    rows.extend(("l", [*x]) for x in snap.leases)
    rows.extend(("d", [*x]) for x in snap.deliveries)
    rows.extend(("w", [*x]) for x in snap.delays)
    chunks = [rows[i : i + SNAP_PART] for i in range(0, len(rows), SNAP_PART)] or [[]]
    out: list[dict[str, object]] = []
    for i, chunk in enumerate(chunks):
        body: dict[str, object] = {"k": "snap", "part": i, "parts": len(chunks)}
        for key in ("l", "d", "w"):
            body[key] = [row for kind, row in chunk if kind == key]
        out.append(body)
    return out


def _snap_of(parts: list[dict[str, object]]) -> QueueSnap:
    """The lease state a complete snapshot's messages carry."""
    leases: list[tuple[int, str, int, int]] = []
    deliveries: list[tuple[int, int]] = []
    delays: list[tuple[int, int]] = []
    for part in parts:
        for a, b, c, d in part["l"]:  # type: ignore[attr-defined]
            leases.append((int(a), str(b), int(c), int(d)))
        for a, b in part["d"]:  # type: ignore[attr-defined]
            deliveries.append((int(a), int(b)))
        for a, b in part["w"]:  # type: ignore[attr-defined]
            delays.append((int(a), int(b)))
    return QueueSnap(leases, deliveries, delays)
