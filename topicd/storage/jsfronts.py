"""Several fronts on one JetStream deployment: the owner lease, forwarding, following.

Every front of a deployment (`storage.jetstream.prefix`) serves the whole `/v0` API. One
of them, the **owner**, runs every mutation (topic create, config and delete, writes,
record deletes) and the housekeeping that writes to JetStream (floors, purges); the
others, **followers**, forward their mutations to it and serve reads from their own
memory, brought up to date before each read (docs/jetstream.md, "Several fronts"):

* **The lease.** The registry key `front.owner` holds `{"front", "subject", "until_ms"}`.
  A front that finds it absent or expired takes it by compare-and-set on its revision
  (create-if-absent when absent); the owner renews it the same way every third of
  `storage.jetstream.lease_ms`. An owner whose renewal finds another revision has lost
  it and turns follower. Safety does not rest on the lease (wall clocks may disagree):
  every record write is fenced by the stream's expected last sequence, so a deposed
  owner's write fails once the new owner has written, and is read back if it landed.
* **Forwarding.** A follower sends a mutation to the owner's subject as one NATS
  request: a JSON head line (`op`, the topic, the idempotency key, the admin flag) and the
  request body re-encoded. The owner runs it through its engine and answers the result,
  or the error's canonical body, which the follower raises as the same error.
* **Following.** Before a read, a follower reads the topic's registry entry and its
  stream's last sequence (one round trip), then loads the records it lacks, applies a
  changed config and the record deletes the entry lists, or drops the topic when the
  entry is gone; a name it does not know is looked up in the registry's name index. The
  owner publishes a notice per committed write and per registry change
  (`<prefix>.n.<id>`), on which followers catch the topic up at once, which wakes their
  long-polls and watch streams; a poll every `POLL_S` seconds makes up for lost notices
  and discovers created and deleted topics for listings.
* **Takeover.** A follower taking the lease first catches every topic up, then runs
  mutations itself. Idempotency keys travel with the records (the key rides on a write's
  first record), so a client retrying a write the dead owner acknowledged gets the
  original seqs back.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from functools import partial
from typing import TYPE_CHECKING, Final

import msgspec
import orjson
import trio

from topicd.engine.engine import DeleteResult, WriteResult
from topicd.errors import (
    Internal,
    StorageUnavailable,
    TopicdError,
    error_from_wire,
)
from topicd.storage.jetstream import (
    REV,
    _install,
    _load_topic,
)
from topicd.storage.recovery import config_from_wire
from topicd.wire import CONFIG_DECODER, DELETE_DECODER, decode_write

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from topicd.clock import WallClock
    from topicd.engine.engine import Engine
    from topicd.engine.topic import Topic
    from topicd.errors import JsonValue
    from topicd.storage.jetstream import JetStreamBackend, _Lane
    from topicd.wire import DeleteIn, PlainWriteIn, TopicConfigIn, WriteIn

log = logging.getLogger("topicd.storage.jsfronts")

POLL_S: Final = 1.0  # followers: the fallback poll for lost notices and new/gone topics
FORWARD_QUEUE_MAX: Final = 4096  # forwarded requests waiting on the owner, beyond: 503
FORWARD_TASKS_MAX: Final = 1024  # forwarded requests the owner runs at once


class Fronts:
    """This front's role among the deployment's fronts; the engine's `Forwarder` while
    it follows (see the module docstring)."""

    def __init__(self, engine: Engine, backend: JetStreamBackend, clock: WallClock) -> None:
        self.engine = engine
        self.backend = backend
        self.store = backend.store
        self.clock = clock
        self.front_id = uuid.uuid4().hex[:12]
        self.subject = f"{self.store.prefix}.fwd.{self.front_id}"
        self.lease_ms = backend.cfg.storage.jetstream.lease_ms
        self.owner = False
        self.owner_subject: str | None = None
        self.lease_rev = 0
        self.promoting = False
        self.promoted = trio.Event()  # set when this front takes the lease over
        self.forwarded = 0  # mutations this front forwarded (tests, metrics)
        self.served = 0  # forwarded mutations this front ran as the owner
        self._limit = trio.Semaphore(FORWARD_TASKS_MAX)
        self._install_lock = trio.Lock()

    # ---- the lease ---------------------------------------------------------------------

    def _lease_value(self) -> dict[str, JsonValue]:
        return {
            "front": self.front_id,
            "subject": self.subject,
            "until_ms": self.clock.now_ms() + self.lease_ms,
        }

    async def try_lease(self) -> bool:
        """Take or renew the owner lease if it is ours, absent or expired; whether this
        front holds it now. Follows the owner named there otherwise."""
        call = self.backend.bridge.call
        value, rev = await call(self.store.lease)
        now = self.clock.now_ms()
        mine = value is not None and value.get("front") == self.front_id
        if value is not None and not mine and int(str(value.get("until_ms", 0))) > now:
            subject = str(value.get("subject"))
            self.owner_subject = subject
            if await call(partial(self.store.alive, subject)):
                return False
            # nobody listens there any more (its connection closed: a killed front):
            # take the lease now rather than when it runs out
            log.warning("front %s: the owner front %s is gone", self.front_id, value.get("front"))
        got = await call(partial(self.store.write_lease, self._lease_value(), rev))
        if got is None:  # someone else moved first: follow them
            value, rev = await call(self.store.lease)
            self.owner_subject = None if value is None else str(value.get("subject"))
            return False
        self.lease_rev = got
        self.owner_subject = self.subject
        return True

    async def start(self) -> bool:
        """At start, before the rebuild: listen for forwarded requests (they wait until
        `run`), then take the lease if free. Returns whether this front is the owner (only
        the owner repairs the registry while rebuilding)."""
        await self.backend.bridge.call(partial(self.store.listen, self.subject, FORWARD_QUEUE_MAX))
        self.owner = await self.try_lease()
        self.store.notify = self.owner
        return self.owner

    def begin(self) -> None:
        """After the rebuild: a follower's engine forwards its mutations."""
        self.engine.forward = None if self.owner else self
        log.info(
            "front %s: %s",
            self.front_id,
            "owner" if self.owner else f"follower of {self.owner_subject}",
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        call = self.backend.bridge.call
        await call(self.store.follow_notices)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve)
            nursery.start_soon(self._follow_notices)
            nursery.start_soon(self._poll)
            task_status.started()
            while True:
                await trio.sleep(self.lease_ms / 3000)
                try:
                    await self._tend_lease()
                except Exception as exc:
                    log.warning("front %s: the owner lease: %s", self.front_id, exc)

    async def _tend_lease(self) -> None:
        if self.owner:
            call = self.backend.bridge.call
            # (a renewal that fails for want of the cluster changes nothing: this front
            # cannot write either then, and it steps down only once it learns another
            # front holds the lease; the fences keep two owners apart meanwhile)
            got = await call(partial(self.store.write_lease, self._lease_value(), self.lease_rev))
            if got is not None:
                self.lease_rev = got
                return
            self._step_down("another front holds its lease")
            await self.try_lease()  # learn the new owner
            return
        if await self.try_lease():
            await self._promote()

    def _step_down(self, why: str) -> None:
        log.warning("front %s: no longer the owner (%s); following", self.front_id, why)
        self.owner = False
        self.store.notify = False
        self.engine.forward = self

    async def release(self) -> None:
        """At shutdown: an owner gives its lease up (compare-and-set to an expired term),
        so a follower takes over at its next check instead of after the term."""
        if not self.owner:
            await trio.lowlevel.checkpoint()
            return
        self.owner = False
        value = self._lease_value() | {"until_ms": 0}
        with contextlib.suppress(Exception):
            await self.backend.bridge.call(partial(self.store.write_lease, value, self.lease_rev))

    async def _promote(self) -> None:
        """This follower took the lease: catch every topic up, then run mutations."""
        self.promoting = True
        try:
            await self.sync_all()
            next_id = await self.backend.bridge.call(self.store.next_id)
            self.engine.next_topic_id = max(self.engine.next_topic_id, next_id)
            self.owner = True
            self.store.notify = True
            self.engine.forward = None
            self.promoted.set()
            log.warning("front %s: took the owner lease", self.front_id)
        finally:
            self.promoting = False

    # ---- the owner: forwarded mutations ------------------------------------------------

    async def _serve(self) -> None:
        call = self.backend.bridge.call
        async with trio.open_nursery() as nursery:
            while True:
                for msg in await call(self.store.next_requests):
                    await self._limit.acquire()
                    nursery.start_soon(self._answer, msg)

    async def _answer(self, msg: Msg) -> None:
        try:
            try:
                payload = await self._run_forwarded(bytes(msg.data))
            except TopicdError as err:
                payload = _error_body(err)
            except Exception:
                log.exception("a forwarded request failed")
                payload = _error_body(Internal("internal error (a bug; see the server log)"))
            with contextlib.suppress(Exception):
                await self.backend.bridge.call(partial(self.store.respond, msg, payload))
        finally:
            self._limit.release()

    async def _run_forwarded(self, data: bytes) -> bytes:
        if not self.owner or self.promoting:
            await trio.lowlevel.checkpoint()
            raise StorageUnavailable(
                "this front is not the owner (any more); retry",
                {"backend": "jetstream", "front": self.front_id},
            )
        head_raw, _, body = data.partition(b"\n")
        head = orjson.loads(head_raw)
        op = head["op"]
        name = head["topic"]
        engine = self.engine
        self.served += 1
        if op == "append":
            res = await engine.append(
                name, decode_write(body), header_key=head.get("key"), can_admin=head["admin"]
            )
            return orjson.dumps({"ok": msgspec.to_builtins(res)})
        if op == "put":
            cin = CONFIG_DECODER.decode(body) if body else None
            _, created = await engine.put_topic(name, cin)
            return orjson.dumps({"ok": {"created": created}})
        if op == "delete_topic":
            deleted, removed = await engine.delete_topic_cascade(name, bool(head["if_empty"]))
            return orjson.dumps({"ok": {"deleted": deleted, "removed": removed}})
        if op == "delete_records":
            result = await engine.delete_records(name, DELETE_DECODER.decode(body))
            return orjson.dumps({"ok": {"deleted": result.deleted}})
        raise AssertionError(f"unknown forwarded op {op!r}")

    # ---- the follower: Forwarder -------------------------------------------------------

    async def _forward(self, head: dict[str, JsonValue], body: bytes) -> dict[str, object]:
        subject = self.owner_subject
        if subject is None or subject == self.subject:
            await trio.lowlevel.checkpoint()
            raise StorageUnavailable(
                "no owner front holds the lease yet; retry", {"backend": "jetstream"}
            )
        payload = orjson.dumps(head) + b"\n" + body
        self.forwarded += 1
        try:
            raw = await self.backend.bridge.call(partial(self.store.forward, subject, payload))
        except Exception as exc:
            raise StorageUnavailable(
                f"the owner front did not answer ({str(exc) or type(exc).__name__}); retry",
                {"backend": "jetstream"},
            ) from exc
        answer = orjson.loads(raw)
        err = answer.get("error")
        if err is not None:
            detail = err.get("detail") or {}
            raise error_from_wire(
                err["code"], int(err["status"]), err["message"], detail, err.get("retry_after")
            )
        ok = answer["ok"]
        assert isinstance(ok, dict)
        return ok

    async def append(
        self,
        name: str,
        req: WriteIn | PlainWriteIn,
        header_key: str | None,
        can_admin: bool,
    ) -> WriteResult:
        ok = await self._forward(
            {"op": "append", "topic": name, "key": header_key, "admin": can_admin},
            msgspec.json.encode(req),
        )
        return msgspec.convert(ok, WriteResult)

    async def put_topic(self, name: str, cin: TopicConfigIn | None) -> tuple[Topic, bool]:
        body = b"" if cin is None else msgspec.json.encode(cin)
        ok = await self._forward({"op": "put", "topic": name}, body)
        await self.catch_up(name)
        return self.engine.get(name), bool(ok["created"])

    async def delete_topic(self, name: str, if_empty: bool) -> tuple[bool, list[str]]:
        ok = await self._forward({"op": "delete_topic", "topic": name, "if_empty": if_empty}, b"")
        await self.catch_up(name)
        removed = ok.get("removed") or []
        assert isinstance(removed, list)
        return bool(ok["deleted"]), [str(r) for r in removed]

    async def delete_records(self, name: str, req: DeleteIn) -> DeleteResult:
        ok = await self._forward({"op": "delete_records", "topic": name}, msgspec.json.encode(req))
        await self.catch_up(name)
        return DeleteResult(self.engine.get(name), int(str(ok["deleted"])))

    async def catch_up(self, name: str) -> None:
        topic = self.engine.topics.get(name)
        if topic is not None:
            topic = await self.refresh(topic)
            if topic is not None:
                return
        await self._discover(name)

    # ---- following ---------------------------------------------------------------------

    async def refresh(self, topic: Topic) -> Topic | None:
        """Bring `topic` up to its registry entry and stream; None when it is gone."""
        backend = self.backend
        lane = backend.lane(topic)
        ticket = lane.syncs_begun
        async with lane.resync_lock:
            if topic.deleted:
                await trio.lowlevel.checkpoint()
                return None
            if lane.syncs_done > ticket:
                # a catch-up that began after this call did has finished: it saw at
                # least what this one would (concurrent reads share one round trip)
                await trio.lowlevel.checkpoint()
                return topic
            lane.syncs_begun += 1
            number = lane.syncs_begun
            tid = topic.topic_id
            entry, last = await backend._call(partial(self.store.probe, tid))
            if _gone(topic):  # dropped while we waited
                return None
            if entry is None:
                self._drop(topic)
                return None
            self._apply_entry(topic, lane, entry)
            # (no stream but an entry: a crash mid-create, which the owner's next start
            # repairs; nothing to load meanwhile)
            if last is not None and last > topic.head_seq and not lane.busy and not lane.pending:
                engine = self.engine
                await _load_topic(engine, backend, topic, engine.clock.now_ms, topic.head_seq + 1)
                if _gone(topic):
                    return None
                engine.durable(topic, topic.head_seq)
                backend._release(topic)
            lane.syncs_done = number
            return topic

    async def _remove(self, topic: Topic) -> None:
        """Drop a topic whose registry entry is gone (not while a catch-up loads it)."""
        async with self.backend.lane(topic).resync_lock:
            self._drop(topic)

    def _drop(self, topic: Topic) -> None:
        if not topic.deleted:
            self.engine.apply_delete_topic(topic, False, self.clock.now_ms())
            self.backend._lanes.pop(topic.topic_id, None)

    async def holds_lease(self) -> bool:
        """Whether the lease in the registry is still this front's (one round trip)."""
        value, rev = await self.backend._call(self.store.lease)
        return (
            self.owner
            and value is not None
            and value.get("front") == self.front_id
            and rev == self.lease_rev
        )

    def adopt(self, topic: Topic, lane: _Lane, entry: dict[str, object]) -> None:
        """Take over what another front wrote into `topic`'s entry (see `_apply_entry`)."""
        self._apply_entry(topic, lane, entry)

    def _apply_entry(self, topic: Topic, lane: _Lane, entry: dict[str, object]) -> None:
        engine = self.engine
        now = self.clock.now_ms()
        wire = entry.get("config")
        if isinstance(wire, dict) and wire != topic.config.to_wire():
            engine.apply_config(topic, config_from_wire(wire), now)
        deletes = entry.get("deletes") or []
        assert isinstance(deletes, list)
        for op in deletes:
            number, before, match, bound = op
            if int(number) <= lane.deletes_applied:
                continue
            if int(number) > lane.deletes_applied + 1 and lane.deletes_applied:
                log.warning(
                    "topic %r: record deletes %d..%d passed this front by",
                    topic.name,
                    lane.deletes_applied + 1,
                    int(number) - 1,
                )
            engine.apply_records_delete(
                topic,
                None if before is None else int(before),
                None if match is None else (str(match[0]), str(match[1])),
                int(bound),
                now,
            )
            lane.deletes_applied = int(number)
        lane.deletes = list(deletes)
        lane.entry_rev = int(str(entry.get(REV, 0)))
        # what the entry holds: after a takeover, the floor task writes this front's own
        # (possibly higher) floor
        lane.floor_written = int(str(entry.get("floor", 1)))

    async def _discover(self, name: str) -> None:
        """A name this front does not serve: load its live instance, if the registry
        has one."""
        call = self.backend._call
        tid = await call(partial(self.store.lookup_name, name))
        if tid is None or tid in self.engine.by_id:
            return
        await self._install_id(tid)

    async def _install_id(self, tid: int) -> Topic | None:
        async with self._install_lock:  # one at a time: each checks what the last did
            return await self._install_locked(tid)

    async def _install_locked(self, tid: int) -> Topic | None:
        engine = self.engine
        if tid in engine.by_id:
            await trio.lowlevel.checkpoint()
            return None
        entry, _ = await self.backend._call(partial(self.store.entry, tid))
        if entry is None or tid in engine.by_id:
            return None
        name = entry.get("name")
        if not isinstance(name, str):
            return None
        old = engine.topics.get(name)
        if old is not None:  # a deleted instance this front has not dropped yet
            if old.topic_id > tid:
                return None
            await self._remove(old)
            if name in engine.topics or tid in engine.by_id:
                return None
        topic, _ = await _install(engine, self.backend, tid, entry, repair=False, live=True)
        return topic

    async def sync_all(self) -> None:
        """Every topic: created and deleted ones, then each one's entry and records."""
        call = self.backend._call
        ids = await call(self.store.entry_ids)
        for topic in list(self.engine.by_id.values()):
            if topic.topic_id not in ids:
                await self._remove(topic)
        for tid in sorted(ids - set(self.engine.by_id)):
            await self._install_id(tid)
        for topic in list(self.engine.by_id.values()):
            await self.refresh(topic)

    async def _follow_notices(self) -> None:
        call = self.backend.bridge.call
        while True:
            tids = await call(self.store.next_notices)
            if self.owner:
                continue
            for tid in tids:
                topic = self.engine.by_id.get(tid)
                try:
                    if topic is None:
                        await self._install_id(tid)
                    else:
                        await self.refresh(topic)
                except TopicdError as exc:
                    log.warning("front %s: topic %d not caught up: %s", self.front_id, tid, exc)

    async def _poll(self) -> None:
        while True:
            await trio.sleep(POLL_S)
            try:
                await self.poll_once()
            except TopicdError as exc:
                log.warning("front %s: poll failed: %s", self.front_id, exc)

    async def poll_once(self) -> None:
        """The fallback for lost notices, and how topics created or deleted elsewhere
        reach this front's listing: the streams' last seqs and the registry's ids.

        On the owner, it finds what a deposed owner did before it noticed (a topic it
        created, records it wrote): those were acknowledged, so they are taken in."""
        backend = self.backend
        engine = self.engine
        heads = await backend._call(self.store.stream_heads)
        ids = await backend._call(self.store.entry_ids)
        for topic in list(engine.by_id.values()):
            tid = topic.topic_id
            if self.owner:
                if heads.get(tid, 0) > topic.head_seq:
                    await backend.resync(topic)
            elif tid not in ids:
                await self._remove(topic)
            elif heads.get(tid, 0) > topic.head_seq:
                await self.refresh(topic)
        for tid in sorted(ids - set(engine.by_id)):
            if self.owner and tid in backend._lanes:
                continue  # this front is creating it right now
            await self._install_id(tid)


def _gone(topic: Topic) -> bool:
    return topic.deleted


def _error_body(err: TopicdError) -> bytes:
    body = err.body()
    inner = body["error"]
    assert isinstance(inner, dict)
    inner["status"] = err.http_status
    inner["retry_after"] = err.retry_after_s()
    return orjson.dumps(body)
