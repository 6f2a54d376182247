"""Several fronts on one JetStream deployment: owner leases, forwarding, following.

Every front of a deployment (`storage.jetstream.prefix`) serves the whole `/v0` API.
Topics fall into `storage.jetstream.shards` shards by a hash of their name; each shard
has one **owner** front, which runs its topics' mutations (topic create, config and
delete, writes, record deletes) and the housekeeping that writes to JetStream (floors,
purges). For those topics the other fronts are **followers**: they forward the
mutations to the owner and serve reads from their own memory, brought up to date before
each read (docs/jetstream.md, "Several fronts"):

* **The leases.** The registry key `front.owner.<shard>` holds `{"front", "subject",
  "until_ms"}`. A front takes a shard's lease by compare-and-set on its revision
  (create-if-absent when absent) when it is absent or expired and the front is under
  its share (`ceil(shards / live fronts)`, the live fronts being `front.members`), or
  when its holder is gone; an owner renews its leases every third of
  `storage.jetstream.lease_ms`, gives up the ones over its share, and steps down from
  one whose renewal finds another revision, or whose term nearly ran out unrenewed
  (`check_terms`: past it another front may write the shard, and an owner's reads do
  not catch up). Safety does not rest on the leases (wall
  clocks may disagree): every record write is fenced by the stream's expected last
  sequence and every registry write by compare-and-set.
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
* **Read times.** A topic's `last_read_ts` is its owner's: a follower's read hands its
  time to the owner and takes the owner's back (a `reads` request, in parallel with the
  catch-up's round trip), a listing takes every owner's, and the poll hands the owners
  the times of reads that did not (watch deliveries), batched per owner.
* **Watch order.** A watch stream over topics of several owners gets this front's
  commits only after an ordering round has caught up its other owners' topics (`hold`),
  so its live frames follow the acknowledgement order, as on one process.
* **Metrics.** A `/v0/metrics` scrape asks every other live front for its own figures
  (a `metrics` request each, in parallel, `METRICS_WAIT_S` at most), each counting the
  topics of the shards the asker assigned it (those it believes that front owns), and
  merges them (`topicd.http.metrics`); a front that does not answer is left out.
* **Takeover.** A front taking a lease first catches every topic up, then runs the
  shard's mutations itself. Idempotency keys travel with the records (the key rides on a write's
  first record), so a client retrying a write the dead owner acknowledged gets the
  original seqs back.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from functools import partial
from typing import TYPE_CHECKING, Final

import msgspec
import orjson
import trio
import xxhash

from topicd.engine.engine import DeleteResult, WriteResult
from topicd.engine.forward import Answer, Gathered
from topicd.engine.router import RouterService
from topicd.engine.watch import Conn
from topicd.errors import (
    Internal,
    NotReady,
    StorageUnavailable,
    TopicdError,
    error_from_wire,
)
from topicd.storage.jetstream import (
    REV,
    JetStreamUnavailable,
    _install,
    _load_topic,
)
from topicd.storage.jsrouters import JsRouters, merge_feed, router_graph
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
# a read on a follower waits this long for the owner's read time (then goes on without)
READS_WAIT_S: Final = 0.5
# a readiness probe on a follower waits this long for the registry's topic count (then
# answers this front's own)
COUNT_WAIT_S: Final = 0.5
# a `/v0/metrics` scrape waits this long for the other fronts' figures (then goes on
# without those that did not answer; a stopped front answers at once: no responders)
METRICS_WAIT_S: Final = 1.0
COMPRESS_STEP: Final = 1 << 17  # bytes of a metrics answer compressed a loop step
# a follower reading which records a stream holds (record deletes it missed) reads the
# entry again after the stream; while the entry keeps changing, at most this many rounds
RECONCILE_ATTEMPTS: Final = 8


# an owner steps down from a shard whose term has less than this share of `lease_ms`
# left (its lease check, every third of it, is then two checks late)
LAPSE_MARGIN: Final = 0.1
# after this front took a shard over from a term that ran out (a failover, not a
# handover), it gives no shard up for an even share for this many terms: a handover costs
# the shard's topics the new owner's catch-up, slow while the cluster recovers, and the
# fronts cut off rejoin one at a time
BALANCE_HOLD_TERMS: Final = 5
# a front that has counted no other member for this many terms is alone: it keeps its
# shards past an unrenewed term while connected (`check_terms`)
ALONE_AFTER_TERMS: Final = 10


class Fronts:
    """This front's role among the deployment's fronts; the engine's `Forwarder` unless
    it owns every shard (see the module docstring)."""

    def __init__(
        self, engine: Engine, backend: JetStreamBackend, clock: WallClock, front_id: str
    ) -> None:
        self.engine = engine
        self.backend = backend
        self.store = backend.store
        self.clock = clock
        self.front_id = front_id
        self.subject = f"{self.store.prefix}.fwd.{self.front_id}"
        js_cfg = backend.cfg.storage.jetstream
        self.lease_ms = js_cfg.lease_ms
        self.shards = js_cfg.shards
        # how long an owner may hold a forwarded call on purpose (`hold_s`): a
        # `disable_backpressure` write waits out a full queue and a full ingest, at most
        # `bypass_wait_ms` each; a claim waits out its queue's coalescing window. Only such
        # a call waits that long on top of the request timeout before a follower answers
        # `503`; any other call answers `503` after the request timeout, so an owner stuck
        # on a stream whose leader is gone does not hold its followers' clients longer
        # than it holds its own
        cfg = backend.cfg
        self.bypass_hold_s = 2 * cfg.backpressure.bypass_wait_ms / 1000
        self.max_claim_hold_s = cfg.queue.max_claim_jitter_ms / 1000
        self.owned: set[int] = set()  # the shards this front owns
        self.lease_revs: dict[int, int] = {}
        # shard -> the end of the term this front last wrote into its lease (its own
        # clock): past it (less `LAPSE_MARGIN`), another front may hold the shard
        self.lease_until: dict[int, int] = {}
        # until when (this front's clock) it gives no shard up for balance
        self.hold_until = 0
        self.owner_subjects: dict[int, str] = {}  # shard -> its owner's request subject
        self.live = 1  # fronts alive (the membership table), this one included
        # when this front last counted another member (its wall clock, ms)
        self.others_seen_ms: int | None = None
        self.promoted = trio.Event()  # set when this front takes a lease over
        self.forwarded = 0  # mutations this front forwarded (tests, metrics)
        self.served = 0  # forwarded mutations this front ran as the owner
        # queue topics run by another front: (ready, in_flight, delayed, dead_lettered) as
        # its last answer gave them (`queue_op`, the read-time exchange)
        self.qcounts: dict[str, tuple[int, int, int, int]] = {}
        self._limit = trio.Semaphore(FORWARD_TASKS_MAX)
        self._install_lock = trio.Lock()
        self._poll_lock = trio.Lock()  # (listings' catch-ups, one at a time)
        self._polls_begun = self._polls_done = 0
        # watch wakes held back until the stream's topics of other owners are caught up
        # (`hold`): topic -> the ordering round under way when it was held
        self._held: dict[Topic, int] = {}
        self._rounds = 0  # ordering rounds begun
        self._done = 0  # ... and finished
        # ordered topics this front owns -> the round a write received since needs
        self._need: dict[Topic, int] = {}
        self._order_wake = trio.Event()
        self._releasing = False
        # queues this front owns whose `/work` streams on other fronts should refill
        # (`work_changed`): their notices go out from `_send_work_notices`
        self._work_changed: dict[Topic, None] = {}
        self._work_wake = trio.Event()
        engine.peers = self  # (`/v0/metrics` gathers the other fronts' figures)

    # ---- shards and the leases ---------------------------------------------------------

    @property
    def owner(self) -> bool:
        """Whether this front owns every shard (then its engine forwards nothing)."""
        return len(self.owned) == self.shards

    def shard_of(self, name: str) -> int:
        return self.shard_of_name(name, self.shards)

    @staticmethod
    def shard_of_name(name: str, shards: int) -> int:
        """The shard of topic `name` among `shards`."""
        return 0 if shards == 1 else xxhash.xxh32_intdigest(name.encode()) % shards

    def owns(self, name: str) -> bool:
        return self.shard_of(name) in self.owned

    def _lease_value(self, until_ms: int | None = None) -> dict[str, JsonValue]:
        return {
            "front": self.front_id,
            "subject": self.subject,
            "until_ms": self.clock.now_ms() + self.lease_ms if until_ms is None else until_ms,
        }

    def _set_role(self) -> None:
        # notices only when another front may listen (one joining is caught up by its
        # reads and its poll until this front's next check sees it)
        self.store.notify = bool(self.owned) and self.live > 1
        self.store.ignore_notices = self.owner
        self.engine.forward = None if self.owner else self

    async def _membership(self, drop: str | None = None) -> int:
        now = self.clock.now_ms()
        self.live = await self.backend.bridge.call(
            partial(self.store.members, self.front_id, now + self.lease_ms, now, drop)
        )
        if self.live > 1:
            self.others_seen_ms = now
        self.store.notify = bool(self.owned) and self.live > 1
        return self.live

    def quota(self) -> int:
        """The shards this front should own: an even share among the live fronts."""
        return -(-self.shards // max(1, self.live))

    async def _check_shard(self, k: int, *, may_take: bool) -> bool:
        """Learn shard `k`'s owner; take its lease when it is absent, expired or its
        holder gone (a gone holder's shard is taken even over the quota). Whether this
        front took it."""
        call = self.backend.bridge.call
        value, rev = await call(partial(self.store.lease, k))
        now = self.clock.now_ms()
        if value is not None and value.get("front") != self.front_id:
            subject = str(value.get("subject"))
            self.owner_subjects[k] = subject
            if int(str(value.get("until_ms", 0))) > now:
                if await call(partial(self.store.alive, subject)):
                    return False
                # nobody listens there any more (its connection closed: a killed front):
                # take the lease now rather than when it runs out
                holder = str(value.get("front"))
                log.warning("front %s: the owner front %s is gone", self.front_id, holder)
                await self._membership(drop=holder)
                if self.backend.slots is not None:
                    self.backend.slots.forget(holder)  # (its streams are gone with it)
            elif not may_take:
                return False
        elif not may_take:  # absent, or this front's own, given up
            return False
        term = self._lease_value()
        got = await call(partial(self.store.write_lease, term, rev, k))
        if got is None:  # someone else moved first: follow them
            value, rev = await call(partial(self.store.lease, k))
            if value is not None:
                self.owner_subjects[k] = str(value.get("subject"))
            return False
        self.lease_revs[k] = got
        self.lease_until[k] = int(str(term["until_ms"]))
        self.owner_subjects[k] = self.subject
        if value is not None and int(str(value.get("until_ms", 0))) > 0:
            # (a term that ran out or whose holder is gone, not one given up: a failover)
            self.hold_until = now + BALANCE_HOLD_TERMS * self.lease_ms
        return True

    async def start(self) -> bool:
        """At start, before the rebuild: listen for forwarded requests (they wait until
        `run`), join the members, take the shards free for this front. Returns whether it
        owns every shard (only then does it repair the registry while rebuilding)."""
        call = self.backend.bridge.call
        found = await call(partial(self.store.check_shards, self.shards))
        if found != self.shards:
            raise JetStreamUnavailable(
                f"this deployment (prefix {self.store.prefix!r}) runs "
                f"{found} owner shards; storage.jetstream.shards is {self.shards}"
            )
        await call(partial(self.store.listen, self.subject, FORWARD_QUEUE_MAX))
        await self._membership()
        for k in self._shard_order():
            if await self._check_shard(k, may_take=len(self.owned) < self.quota()):
                self.owned.add(k)
        self._set_role()
        return self.owner

    def _shard_order(self) -> list[int]:
        """Shards from a front-specific offset (fronts starting together contend less)."""
        first = xxhash.xxh32_intdigest(self.front_id.encode()) % self.shards
        return [(first + i) % self.shards for i in range(self.shards)]

    def begin(self) -> None:
        """After the rebuild: route the mutations of shards this front does not own."""
        self._set_role()
        log.info(
            "front %s: %s",
            self.front_id,
            "owner"
            if self.owner
            else f"owner of shards {sorted(self.owned)} of {self.shards}, follower of the rest",
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        call = self.backend.bridge.call
        await call(self.store.follow_notices)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve)
            nursery.start_soon(self._follow_notices)
            nursery.start_soon(self._poll)
            nursery.start_soon(self._watch_terms)
            nursery.start_soon(self._order_wakes)
            nursery.start_soon(self._send_work_notices)
            task_status.started()
            while True:
                await trio.sleep(self.lease_ms / 3000)
                try:
                    await self._tend_lease()
                except Exception as exc:
                    log.warning("front %s: the owner leases: %s", self.front_id, exc)

    async def _tend_lease(self) -> None:
        """One lease check: renew the shards owned, give up those over the quota (another
        front joined), learn the other shards' owners and take what is free for this
        front (or whose owner is gone)."""
        call = self.backend.bridge.call
        await self._membership()
        for k in sorted(self.owned):
            # (a renewal that fails for want of the cluster changes nothing: this front
            # cannot write either then, and it steps down only once it learns another
            # front holds the lease; the fences keep two owners apart meanwhile)
            value = self._lease_value()
            got = await call(partial(self.store.write_lease, value, self.lease_revs[k], k))
            if got is not None:
                self.lease_revs[k] = got
                self.lease_until[k] = int(str(value["until_ms"]))
            else:
                self._step_down(k, "another front holds its lease")
        while len(self.owned) > self.quota() and self.clock.now_ms() >= self.hold_until:
            # (not soon after a failover: `BALANCE_HOLD_TERMS`)
            await self._give_up(max(self.owned), f"{self.live} fronts share the shards")
        for k in self._shard_order():
            if k in self.owned:
                continue
            if await self._check_shard(k, may_take=len(self.owned) < self.quota()):
                await self._promote(k)

    async def _watch_terms(self) -> None:
        """Step down from a shard whose term runs out before the lease check renewed it
        (`check_terms`), at a tenth of `lease_ms`: independent of the lease check, which
        may be stuck behind a slow round trip or a long takeover."""
        while True:
            await trio.sleep(self.lease_ms / 10_000)
            self.check_terms()

    def check_terms(self) -> None:
        """Step down from every owned shard whose term (as this front last wrote it)
        ends within `LAPSE_MARGIN` of `lease_ms`: from then on another front may take
        the lease by expiry and write the shard's topics, and an owner serves reads from
        its memory without catching up, so it would answer reads that miss those
        writes. As a follower it catches each topic up before a read; its next lease
        check takes the shard back (a full takeover) if nobody else did. A front alone
        among the members keeps its shards while it is connected (its renewals then fail
        only for the cluster's want, when no other front could take them either, or its
        wall clock stepped forward), once it has counted no other member for
        `ALONE_AFTER_TERMS` terms; cut off from NATS past its term, or alone only lately
        (the others' memberships lapsed while they were cut off: they may be back and
        take its shards by expiry while its own lease check hangs on a server that
        stopped answering), it steps down too: a front may have joined meanwhile and
        taken them, unseen by this one."""
        now = self.clock.now_ms()
        seen = self.others_seen_ms
        alone = seen is None or now - seen >= ALONE_AFTER_TERMS * self.lease_ms
        if self.live <= 1 and alone and self.store.is_connected():
            return
        margin = self.lease_ms * LAPSE_MARGIN
        for k in sorted(self.owned):
            if now >= self.lease_until.get(k, 0) - margin:
                self._step_down(k, "its term ran out before this front renewed it")

    def _step_down(self, k: int, why: str) -> None:
        log.warning("front %s: no longer the owner of shard %d (%s)", self.front_id, k, why)
        self.owned.discard(k)
        self.owner_subjects.pop(k, None)
        self._set_role()
        routers = self.engine.routers
        if isinstance(routers, JsRouters):
            routers.drop(k)  # (a router runs on its destination's owner)

    async def _give_up(self, k: int, why: str) -> None:
        """Hand shard `k` over: stop running its mutations, then expire its lease so the
        front that needs it takes it at its next check."""
        rev = self.lease_revs.get(k, 0)
        self._step_down(k, why)
        with contextlib.suppress(Exception):
            await self.backend.bridge.call(
                partial(self.store.write_lease, self._lease_value(0), rev, k)
            )

    async def release(self) -> None:
        """At shutdown: give every lease up and leave the members, so the other fronts
        take the shards at their next check instead of after the term."""
        for k in sorted(self.owned):
            await self._give_up(k, "shutting down")
        with contextlib.suppress(Exception):
            now = self.clock.now_ms()
            await self.backend.bridge.call(partial(self.store.members, self.front_id, 0, now, None))

    async def _promote(self, k: int) -> None:
        """This front took shard `k`'s lease: catch every topic up (a queue's leases
        rebuilt from its journal, the last owner fenced out of it), then run the shard's
        mutations."""
        await self.sync_all(k)
        for topic in list(self.engine.by_id.values()):
            lane = self.backend.lane(topic)
            if lane.move is not None and self.shard_of(topic.name) == k:
                # a stream move the last owner left: keep the stream the entry names
                async with lane.registry_lock:
                    await self.backend.finish_move(topic, lane)
            if topic.queue is not None and self.shard_of(topic.name) == k:
                await self.backend.journals.take_over(topic, self.front_id)
        next_id = await self.backend.bridge.call(self.store.next_id)
        self.engine.next_topic_id = max(self.engine.next_topic_id, next_id)
        # the catch-up may have outlasted the term taken: renew it before owning
        value = self._lease_value()
        got = await self.backend.bridge.call(
            partial(self.store.write_lease, value, self.lease_revs.get(k, 0), k)
        )
        if got is None:
            log.warning("front %s: shard %d was taken while catching it up", self.front_id, k)
            return
        self.lease_revs[k] = got
        self.lease_until[k] = int(str(value["until_ms"]))
        routers = self.engine.routers
        if isinstance(routers, JsRouters):
            # the routers into the shard's topics run here from now on, at the cursors
            # the catch-up found in their streams (copies the last owner stored):
            # attached before the shard is owned, so a read its owner answers (a
            # follower's, a forwarded `GET` of a router) always finds them
            await routers.rebuild(repair=False, taking=k)
        self.owned.add(k)
        self._set_role()
        self.promoted.set()
        log.warning("front %s: took the owner lease of shard %d", self.front_id, k)

    async def holds_lease(self, name: str) -> bool:
        """Whether the lease of `name`'s shard is still this front's (one round trip)."""
        k = self.shard_of(name)
        if k not in self.owned:
            await trio.lowlevel.checkpoint()
            return False
        value, rev = await self.backend._call(partial(self.store.lease, k))
        return (
            value is not None
            and value.get("front") == self.front_id
            and rev == self.lease_revs.get(k)
        )

    # ---- the owner: forwarded mutations ------------------------------------------------

    async def _serve(self) -> None:
        call = self.backend.bridge.call
        async with trio.open_nursery() as nursery:
            while True:
                for msg in await call(self.store.next_requests, parks=True):
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
        head_raw, _, body = data.partition(b"\n")
        head = orjson.loads(head_raw)
        op = head["op"]
        if op == "reads":
            return await self._serve_reads(head)
        if op == "metrics":
            return await self._serve_metrics(head)
        if op == "slots":  # another front's refusal asks what this one holds now
            await trio.lowlevel.checkpoint()
            slots = self.backend.slots
            keys = head.get("keys") or []
            assert slots is not None
            assert isinstance(keys, list)
            sessions, shares = bool(head.get("sessions")), bool(head.get("shares"))
            return orjson.dumps({"ok": slots.live([str(k) for k in keys], sessions, shares)})
        routers = self.engine.routers
        assert isinstance(routers, JsRouters)
        if op == "router_totals":
            await trio.lowlevel.checkpoint()
            names = head.get("routers") or []
            assert isinstance(names, list)
            return orjson.dumps({"ok": {"totals": routers.totals([str(n) for n in names])}})
        name = head["topic"]
        if not self.owns(name):
            await trio.lowlevel.checkpoint()
            raise StorageUnavailable(
                "this front does not own the topic's shard (any more); retry",
                {"backend": "jetstream", "front": self.front_id},
            )
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
        if op in ("router_put", "router_get", "router_delete", "router_reload", "router_drain"):
            return orjson.dumps({"ok": await routers.serve(op, str(head["router"]), body)})
        if op == "ensure":  # a router's endpoint, created with defaults when absent
            await RouterService._ensure(routers, name)
            return orjson.dumps({"ok": {}})
        if op == "queue":
            args = head["args"]
            assert isinstance(args, dict)
            ok = await engine.queues.run_forwarded(name, str(head["qop"]), args)
            topic = engine.topics.get(name)
            if topic is not None and topic.queue is not None and topic.queue.remote_work:
                topic.queue.on_remote = partial(self.work_changed, topic)
            return orjson.dumps({"ok": ok})
        raise AssertionError(f"unknown forwarded op {op!r}")

    async def _serve_reads(self, head: dict[str, JsonValue]) -> bytes:
        """A follower's read times: take the newer ones; answer this front's (of the
        topics asked about, or, with `all`, of every topic of its shards). A router
        destination run here asked about is brought up to date first (its feed's copies
        stored) and its head answered, which the follower's read then loads up to."""
        engine = self.engine
        routers = engine.routers
        heads: dict[str, int] = {}
        out: dict[str, int] = {}
        queues: dict[str, list[int]] = {}  # queue topics asked about: the owner's counts
        reads = head.get("reads") or {}
        assert isinstance(reads, dict)
        depth = head.get("depth")
        for key in list(reads):
            topic = engine.by_id.get(int(key))
            if not isinstance(depth, int) or topic is None or not self.owns(topic.name):
                continue
            if isinstance(routers, JsRouters) and routers.feed(topic):
                try:
                    await routers.freshen(topic, depth)
                except TopicdError as exc:  # (no head: the asker's read answers 503)
                    log.warning("topic %r not brought up to date for a read: %s", topic.name, exc)
                    continue
            heads[key] = topic.head_seq  # (as its owner: every topic of its own)
        await trio.lowlevel.checkpoint()
        for key, ts in reads.items():
            topic = engine.by_id.get(int(key))
            if topic is None:
                continue
            if isinstance(ts, int):
                _merge_read(topic, ts)
            if topic.last_read_ts is not None:
                out[key] = topic.last_read_ts
            q = topic.queue
            if q is not None and self.owns(topic.name):
                c = engine.queues.counts(topic)
                queues[key] = [c.ready, c.in_flight, c.delayed, q.dead_lettered]
        if head.get("all"):
            for topic in engine.by_id.values():
                if topic.last_read_ts is not None and self.owns(topic.name):
                    out[str(topic.topic_id)] = topic.last_read_ts
        return orjson.dumps({"ok": {"reads": out, "queues": queues, "heads": heads}})

    # ---- metrics: every front's figures ------------------------------------------------

    async def _serve_metrics(self, head: dict[str, JsonValue]) -> bytes:
        """Another front's scrape: this front's figures (`Engine.figures`), counting the
        topics of the shards it was assigned; zlib-compressed (a thousand topics' series
        are about a megabyte of JSON, NATS's default message limit)."""
        figures = self.engine.figures
        if figures is None:  # (not serving yet: the asker leaves this front out)
            await trio.lowlevel.checkpoint()
            raise NotReady("this front is not serving yet", {"front": self.front_id})
        got = head.get("shards")
        shards = {int(k) for k in got if isinstance(k, int)} if isinstance(got, list) else set()
        ok = await figures(head, lambda name: self.shard_of(name) in shards)
        raw = memoryview(orjson.dumps({"ok": ok}))
        packer = zlib.compressobj(1)
        parts: list[bytes] = []
        for i in range(0, len(raw), COMPRESS_STEP):  # (a megabyte at once: an 8 ms step)
            await trio.lowlevel.checkpoint()
            parts.append(packer.compress(raw[i : i + COMPRESS_STEP]))
        parts.append(packer.flush())
        return b"".join(parts)

    async def gather_figures(self, head: dict[str, JsonValue]) -> Gathered:
        """Every other live front's figures (`_serve_metrics`), asked in parallel, each
        counting the topics of the shards this front believes it owns; `METRICS_WAIT_S`
        at most. The live fronts are the members as this front's last lease check found
        them. A front that does not answer in time, or answers an error, is missing."""
        requests: dict[str, bytes] = {}
        assigned: dict[str, tuple[str, frozenset[int]]] = {}
        for front in self.store.member_ids:
            if front == self.front_id:
                continue
            subject = f"{self.store.prefix}.fwd.{front}"
            shards = frozenset(
                k for k, s in self.owner_subjects.items() if s == subject and k not in self.owned
            )
            assigned[subject] = (front, shards)
            requests[subject] = (
                orjson.dumps({**head, "op": "metrics", "shards": sorted(shards)}) + b"\n"
            )
        got: dict[str, bytes | None] = {}
        if requests:
            with trio.move_on_after(2 * METRICS_WAIT_S), contextlib.suppress(Exception):
                got = await self.backend.bridge.call(
                    partial(self.store.ask_all, requests, METRICS_WAIT_S)
                )
        else:
            await trio.lowlevel.checkpoint()
        answers: list[Answer] = []
        missing: list[str] = []
        for subject, (front, shards) in assigned.items():
            ok = _figures_of(got.get(subject))
            if ok is None:
                missing.append(front)
            else:
                answers.append(Answer(front, shards, ok))
        return Gathered(1 + len(assigned), answers, missing)

    # ---- the follower: read times --------------------------------------------------------

    def _reads_request(
        self, reads: dict[int, int | None], everything: bool = False, depth: int | None = None
    ) -> bytes:
        """A `reads` request; with `depth` (a client's read, `depth` router hops from
        it), the owner also brings the router destinations among them up to date."""
        head: dict[str, JsonValue] = {
            "op": "reads",
            "reads": {str(k): v for k, v in reads.items()},
            "all": everything,
        }
        if depth is not None:
            head["depth"] = depth
        return orjson.dumps(head) + b"\n"

    def runner_of(self, topic: Topic) -> str | None:
        """The request subject of the front running the routers into `topic` (its
        owner), when another front."""
        return self._owner_of(topic)

    async def router_call(self, op: str, topic: str, router: str, body: bytes) -> dict[str, object]:
        """A router call (`JsRouters.serve`, or `ensure` of topic `topic`) run by the
        owner of topic `topic` (a router's destination)."""
        import nats.errors

        head: dict[str, JsonValue] = {"op": op, "topic": topic, "router": router}
        k = self.shard_of(topic)
        tried = self.owner_subjects.get(k)
        try:
            return await self._forward(head, body)
        except StorageUnavailable as exc:
            if not isinstance(exc.__cause__, nats.errors.NoRespondersError):
                raise
        # the owner this front knew is gone (killed): another front may have taken the
        # shard since, before this front's next lease check. Router calls are idempotent
        # (a PUT of the same definition, a DELETE, a read): ask the lease, send it there
        # (unless it names the front just found gone; this front's lease check may have
        # learned the new owner meanwhile)
        tried = tried or self.owner_subjects.get(k)
        value, _ = await self.backend._call(partial(self.store.lease, k))
        if (
            value is None
            or value.get("front") == self.front_id
            or str(value.get("subject")) == tried
            or int(str(value.get("until_ms", 0))) <= self.clock.now_ms()
        ):
            raise StorageUnavailable(
                "the owner front is gone and no other holds the lease yet; retry",
                {"backend": "jetstream"},
            )
        self.owner_subjects[k] = str(value.get("subject"))
        return await self._forward(head, body)

    async def router_totals(self, subject: str, names: list[str]) -> dict[str, tuple[int, int]]:
        """The cursors and totals of the routers of `names` from the front at `subject`
        (what it does not answer in time stays as the registry has it)."""
        payload = orjson.dumps({"op": "router_totals", "routers": names}) + b"\n"
        raw = await self.backend.bridge.call(
            partial(self.store.ask, subject, payload, self.store.timeout)
        )
        ok = None if raw is None else orjson.loads(raw).get("ok")
        got = ok.get("totals") if isinstance(ok, dict) else None
        if not isinstance(got, dict):
            return {}
        return {str(n): (int(v[0]), int(v[1])) for n, v in got.items() if isinstance(v, list)}

    def _owner_of(self, topic: Topic) -> str | None:
        """The request subject of `topic`'s owner, when another front (else None)."""
        subject = self.owner_subjects.get(self.shard_of(topic.name))
        return None if subject is None or subject == self.subject else subject

    def _take_reads(self, raw: bytes | None) -> None:
        """Apply an owner's answer to a `reads` request (None: it gave none)."""
        if raw is None:
            return
        ok = orjson.loads(raw).get("ok")
        if not isinstance(ok, dict):
            return
        for key, ts in (ok.get("reads") or {}).items():
            topic = self.engine.by_id.get(int(key))
            if topic is not None and isinstance(ts, int):
                _merge_read(topic, ts)
                lane = self.backend.lane(topic)
                lane.read_sent = max(lane.read_sent, ts)
        for key, counts in (ok.get("queues") or {}).items():
            topic = self.engine.by_id.get(int(key))
            if topic is not None and topic.queue is not None and isinstance(counts, list):
                self._take_counts(topic.name, counts)

    def _take_counts(self, name: str, counts: list[object]) -> None:
        ready, in_flight, delayed, dead = (int(str(c)) for c in counts)
        self.qcounts[name] = (ready, in_flight, delayed, dead)
        topic = self.engine.topics.get(name)
        if topic is not None and topic.queue is not None:
            topic.queue.dead_lettered = dead

    # ---- the follower: queue calls ------------------------------------------------------

    async def queue_op(self, name: str, op: str, args: dict[str, object]) -> dict[str, object]:
        head: dict[str, JsonValue] = {"op": "queue", "topic": name, "qop": op}
        head["args"] = args  # type: ignore[assignment]
        # (a claim and a `/work` refill wait out the queue's coalescing window there)
        hold_s = self.claim_hold_s(name) if op in ("claim", "work") else 0.0
        ok = await self._forward(head, b"", hold_s)
        counts = ok.get("counts")
        if isinstance(counts, list):
            self._take_counts(name, counts)
        return ok

    def queue_counts(self, topic: Topic) -> tuple[int, int, int, int] | None:
        return self.qcounts.get(topic.name)

    async def _exchange_reads(
        self,
        subject: str,
        reads: dict[int, int | None],
        wait_s: float,
        *,
        everything: bool = False,
    ) -> None:
        """Hand `subject`'s front the read times `reads` and take its answer (of these
        topics, or with `everything`, of every topic it owns)."""
        payload = self._reads_request(reads, everything)
        raw = await self.backend.bridge.call(partial(self.store.ask, subject, payload, wait_s))
        if raw is not None:
            for tid, ts in reads.items():
                topic = self.engine.by_id.get(tid)
                if topic is not None and ts is not None:
                    lane = self.backend.lane(topic)
                    lane.read_sent = max(lane.read_sent, ts)
        self._take_reads(raw)

    async def share_reads(self, topics: list[Topic]) -> None:
        by_owner: dict[str, dict[int, int | None]] = {}
        for topic in topics:
            subject = self._owner_of(topic)
            if subject is not None and topic.last_read_ts is not None:
                by_owner.setdefault(subject, {})[topic.topic_id] = topic.last_read_ts
        for subject, reads in by_owner.items():
            await self._exchange_reads(subject, reads, READS_WAIT_S)
        await trio.lowlevel.checkpoint()

    async def push_reads(self) -> None:
        """Hand the owners the read times this front has that they may not (reads that
        exchanged none: watch deliveries, a read whose owner did not answer in time):
        one request per owner."""
        by_owner: dict[str, dict[int, int | None]] = {}
        for topic in list(self.engine.by_id.values()):
            ts = topic.last_read_ts
            if ts is None or ts <= self.backend.lane(topic).read_sent:
                continue
            subject = self._owner_of(topic)
            if subject is not None and not self.owns(topic.name):
                by_owner.setdefault(subject, {})[topic.topic_id] = ts
        for subject, reads in by_owner.items():
            await self._exchange_reads(subject, reads, self.store.timeout)
        await trio.lowlevel.checkpoint()

    async def topic_count(self) -> int:
        """The registry's topic count (the topics of every front), or this front's own
        when the registry does not answer within `COUNT_WAIT_S`."""
        with trio.move_on_after(COUNT_WAIT_S):
            with contextlib.suppress(Exception):
                return len(await self.backend.bridge.call(self.store.entry_ids))
        return len(self.engine.topics)

    # ---- the follower: Forwarder -------------------------------------------------------

    def claim_hold_s(self, name: str) -> float:
        """How long the owner may hold a claim of queue `name` on purpose: its coalescing
        window (`claim_jitter_ms`) as this front knows it, or the clamp of any window."""
        topic = self.engine.topics.get(name)
        if topic is None:
            return self.max_claim_hold_s
        return min(topic.config.claim_jitter_ms / 1000, self.max_claim_hold_s)

    async def _forward(
        self, head: dict[str, JsonValue], body: bytes, hold_s: float = 0.0
    ) -> dict[str, object]:
        """`head` and `body` run by the owner of `head["topic"]`'s shard; its answer, or
        `503` when no owner answers within the request timeout plus `hold_s` (how long
        the owner may hold this call on purpose)."""
        k = self.shard_of(str(head["topic"]))
        subject = self.owner_subjects.get(k)
        if subject is None or subject == self.subject:
            # (this front gave the shard up, or has not learned its owner since: ask the
            # lease now rather than answer 503 until the next check)
            value, _ = await self.backend._call(partial(self.store.lease, k))
            if (
                value is None
                or value.get("front") == self.front_id
                or int(str(value.get("until_ms", 0))) <= self.clock.now_ms()
            ):
                raise StorageUnavailable(
                    "no owner front holds the lease yet; retry", {"backend": "jetstream"}
                )
            subject = str(value.get("subject"))
            self.owner_subjects[k] = subject
        payload = orjson.dumps(head) + b"\n" + body
        self.forwarded += 1
        try:
            raw = await self.backend.bridge.call(
                partial(self.store.forward, subject, payload, hold_s)
            )
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
            self.bypass_hold_s if req.disable_backpressure else 0.0,
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

    async def catch_up(
        self, name: str, *, touch: bool = False, reads: bool = False, depth: int | None = None
    ) -> None:
        for _ in range(2):  # (a second round: the instance known here was deleted)
            topic = self.engine.topics.get(name)
            if topic is None:
                await self._discover(name)
                topic = self.engine.topics.get(name)
                if topic is None:
                    return
            # (also after a discovery: another task may be loading the topic, or have
            # loaded it before the write this read must see)
            if await self.refresh(topic, reads=reads, touch=touch, depth=depth) is not None:
                return

    # ---- following ---------------------------------------------------------------------

    async def refresh(
        self,
        topic: Topic,
        *,
        reads: bool = False,
        touch: bool = False,
        depth: int | None = None,
        routed: bool = False,
    ) -> Topic | None:
        """Bring `topic` up to its registry entry and stream; None when it is gone.
        `reads`: also its read time up to the owner's; `touch`: this front's read of it
        now reaches the owner first (both in the same round trip); `depth`: the owner
        also brings it up to date as a router destination first (the read-path
        catch-up of a router chain `depth` hops from the read); `routed`: `topic` is a
        router destination (found after its owner did not answer a client's read).

        A client's read of a router destination answers only after the front running
        its routers did (`_ask_runner`), or fails with `503`: the copies of source
        records already acknowledged may not be in the stream yet."""
        client = reads or touch  # (a client's read: router copies it must see first)
        reads = reads or depth is not None
        backend = self.backend
        lane = backend.lane(topic)
        if touch:
            lane.read_pending = max(lane.read_pending or 0, self.clock.now_ms())
        ticket = lane.syncs_begun
        tid = topic.topic_id
        asked = False
        sent = early_answer = None
        if depth is not None or (client and (routed or self._dest_known(tid))):
            # a router destination: its owner copies into it and stores the copies
            # first, and answers its head. Asked before the catch-up, not while holding
            # the lane (on a cycle of routers, that owner asks this front back)
            asked, sent = True, lane.read_pending
            payload = self._reads_request({tid: sent}, depth=depth or 0)
            early_answer = await self._ask_runner(topic, payload)
        async with lane.resync_lock:
            if topic.deleted:
                await trio.lowlevel.checkpoint()
                return None
            if not asked and (lane.reads_done if reads or touch else lane.syncs_done) > ticket:
                # a catch-up that began after this call did has finished: it saw at
                # least what this one would, this call's read time included
                # (concurrent reads share one round trip)
                await trio.lowlevel.checkpoint()
                return topic
            lane.syncs_begun += 1
            number = lane.syncs_begun
            exchange = reads or touch or lane.read_pending is not None
            subject = self._owner_of(topic) if exchange and not asked else None
            ask = pending = None
            if subject is not None:
                pending, lane.read_pending = lane.read_pending, None
                payload = self._reads_request({tid: pending}, depth=0 if client else None)
                ask = (subject, payload, READS_WAIT_S)
            elif asked:
                pending = sent
                if lane.read_pending == sent:
                    lane.read_pending = None
            entry, newer, answer = await backend._call(
                partial(self.store.probe, tid, topic.head_seq, ask)
            )
            if asked:
                answer = early_answer
            if _gone(topic):  # dropped while we waited
                return None
            if entry is None:
                self._drop(topic)
                return None
            if self._apply_entry(topic, lane, entry):
                # record deletes passed this front by (more than the entry keeps): the
                # stream says which seqs are left
                await self._reconcile(topic, lane, entry)
                if _gone(topic):
                    return None
            newer = newer or _answered_head(answer, tid) > topic.head_seq
            if newer and (lane.busy or lane.pending) and not self.owns(topic.name):
                # writes this front took as the shard's owner are still being published
                # (it stepped down since): their records may be among the newer ones, so
                # wait for them to settle, then read the rest in, rather than answer
                # from memory without the new owner's writes
                if not await backend.wait_idle(lane, 2 * self.store.timeout):
                    raise StorageUnavailable(
                        f"topic {topic.name!r}: this front is still settling writes it "
                        "took as the owner; retry",
                        {"topic": topic.name, "backend": "jetstream"},
                    )
                if _gone(topic):
                    return None
            if newer and not lane.busy and not lane.pending:
                engine = self.engine
                await _load_topic(engine, backend, topic, engine.clock.now_ms, topic.head_seq + 1)
                if _gone(topic):
                    return None
                engine.durable(topic, topic.head_seq)
                backend._release(topic)
            if topic.queue is not None and not self.owns(topic.name):
                # acks made through the owner (its journal; `storage/jsqueues.py`)
                await backend.journals.follow(topic)
                if _gone(topic):
                    return None
            if answer is not None and pending is not None:
                lane.read_sent = max(lane.read_sent, pending)
            self._take_reads(answer)
            lane.syncs_done = number
            # (a client's read its owner did not answer as the owner: not shared with
            # the reads waiting here, each finds out whether it needs the runner)
            unanswered = client and not asked and not _answered(answer, tid)
            if exchange and not unanswered:
                lane.reads_done = number
        if unanswered and await self._routed(topic):
            # a router destination this front did not know of: its runner first, as for
            # one it knows (and the catch-up again, up to the head it answers)
            return await self.refresh(topic, reads=True, routed=True)
        return topic

    def _routers_known(self) -> list[dict[str, object]]:
        routers = self.engine.routers
        return list(routers.known.values()) if isinstance(routers, JsRouters) else []

    def _dest_known(self, tid: int) -> bool:
        """Whether topic `tid` is a router's destination, by the routers' entries as
        this front last read them."""
        return any(b.get("dest_id") == tid for b in self._routers_known())

    async def _routed(self, topic: Topic) -> bool:
        """Whether `topic` is a router's destination: by the entries this front last
        read, else by the router graph (one registry round trip; a router created
        through another front since)."""
        if self._dest_known(topic.topic_id):
            await trio.lowlevel.checkpoint()
            return True
        graph, _ = await self.backend._call(partial(router_graph, self.store))
        return any(len(m) > 1 and m[1] == topic.name for m in graph.values())

    async def _ask_runner(self, topic: Topic, payload: bytes) -> bytes | None:
        """Send `topic`'s owner the read-time request `payload`, which has it bring
        `topic` up to date as a router destination and answer its head; the answer.

        The owner this front knows may not answer as the owner: killed, its shard taken
        over since this front's last lease check (no responders, at once), or still
        taking it over. For a router destination the read needs that answer (the
        copies of acknowledged source records may not be stored yet), so the lease is
        read and the front it names asked; with no answer from a front owning `topic`
        within the request timeout, `503 storage_unavailable` (retryable), unless the
        topic's registry entry is gone (deleted: its owner no longer knows it). Another
        topic's read goes on without the answer (None), as it always could."""
        tid = topic.topic_id
        subject = self._owner_of(topic)
        raw = None
        if subject is not None:
            raw = await self.backend._call(
                partial(self.store.ask, subject, payload, self.store.timeout)
            )
        if _answered(raw, tid) or not await self._routed(topic):
            return raw
        k = self.shard_of(topic.name)
        value, _ = await self.backend._call(partial(self.store.lease, k))
        holder = None if value is None else str(value.get("subject"))
        if value is not None and value.get("front") != self.front_id and holder != subject:
            assert holder is not None
            self.owner_subjects[k] = holder  # (as this front's next lease check would)
            raw = await self.backend._call(
                partial(self.store.ask, holder, payload, self.store.timeout)
            )
            if _answered(raw, tid):
                return raw
        entry, _ = await self.backend._call(partial(self.store.entry, tid))
        if entry is None:
            return raw  # (the topic was deleted: the catch-up drops it, the read is a 404)
        raise StorageUnavailable(
            f"the front running the routers into topic {topic.name!r} did not answer "
            "(its owner is gone or taking over); retry",
            {"backend": "jetstream", "topic": topic.name},
        )

    async def _remove(self, topic: Topic) -> None:
        """Drop a topic whose registry entry is gone (not while a catch-up loads it)."""
        async with self.backend.lane(topic).resync_lock:
            self._drop(topic)

    def _drop(self, topic: Topic) -> None:
        if not topic.deleted:
            self.engine.apply_delete_topic(topic, False, self.clock.now_ms())
            self.backend._lanes.pop(topic.topic_id, None)

    def adopt(self, topic: Topic, lane: _Lane, entry: dict[str, object]) -> None:
        """Take over what another front wrote into `topic`'s entry (see `_apply_entry`)."""
        self._apply_entry(topic, lane, entry)

    def _apply_entry(self, topic: Topic, lane: _Lane, entry: dict[str, object]) -> bool:
        """Bring `topic` to its registry entry: config, stream, floor, record deletes.
        True when record deletes passed this front by (the entry keeps the last
        `DELETES_KEPT`): they are not all applied then (`_reconcile` finishes)."""
        engine = self.engine
        now = self.clock.now_ms()
        # an `ephemeral` topic's stream is in memory, with a seq reservation
        lane.memory = entry.get("storage") == "memory"
        reserved = entry.get("reserved")
        if isinstance(reserved, int):
            lane.reserved = max(lane.reserved, reserved)
        # the stream holding the records (another than the topic's own once they moved)
        self.backend.set_sid(lane, int(str(entry.get("stream", topic.topic_id))))
        move = entry.get("move")
        lane.move = [int(str(x)) for x in move] if isinstance(move, list) else None
        feed = entry.get("feed")  # (a router destination's stored cursors)
        if isinstance(feed, dict):
            merge_feed(lane.feed, feed)
        wire = entry.get("config")
        if isinstance(wire, dict) and wire != topic.config.to_wire():
            engine.apply_config(topic, config_from_wire(wire), now)
        floor = entry.get("floor", 1)
        runs = entry.get("runs") or []
        if isinstance(floor, int) and floor > topic.evict_floor and isinstance(runs, list):
            # the owner's evictions so far: a record delete it ran after them purged
            # the stream, so the records left here would no longer add up to them
            engine.apply_floor(topic, floor, [(int(a), int(b), str(c)) for a, b, c in runs])
        deletes = entry.get("deletes") or []
        assert isinstance(deletes, list)
        missed = bool(deletes) and int(deletes[0][0]) > lane.deletes_applied + 1
        if missed:
            log.info(
                "topic %r: record deletes %d..%d passed this front by; reading which "
                "records its stream still holds",
                topic.name,
                lane.deletes_applied + 1,
                int(deletes[0][0]) - 1,
            )
        for op in deletes:
            number, before, match, bound = op
            if int(number) <= lane.deletes_applied:
                continue
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
        return missed

    async def reconcile(self, topic: Topic) -> None:
        """Drop the records this front holds that `topic`'s stream no longer does (acks
        of a queue whose journal was compacted past this front's reads; `_reconcile`)."""
        entry, _ = await self.backend._call(partial(self.store.entry, topic.topic_id))
        if entry is None or _gone(topic):
            if not _gone(topic):
                self._drop(topic)
            return
        lane = self.backend.lane(topic)
        self._apply_entry(topic, lane, entry)
        await self._reconcile(topic, lane, entry)

    async def _reconcile(self, topic: Topic, lane: _Lane, entry: dict[str, object]) -> None:
        """Drop the records this front holds that the topic's stream no longer does:
        record deletes it missed are purges and message deletes there, so the stream
        is the truth (its first seq, last seq and deleted seqs: one request, no payload).

        The stream is read after the entry, and the entry again after the stream: when
        the entry did not change in between, every purge the stream shows below the
        entry's floor is an eviction this front applied from it (a cap or TTL
        tombstone), and every other seq gone is a record delete (no tombstone), as on
        the owner; otherwise the newer entry is applied and the stream read again."""
        backend = self.backend
        call = backend._call
        tid = topic.topic_id
        rev = int(str(entry.get(REV, 0)))
        for _ in range(RECONCILE_ATTEMPTS):
            first, last, gone = await call(partial(self.store.state, tid))
            again, _ = await call(partial(self.store.entry, tid))
            if _gone(topic):
                return
            if again is None:
                self._drop(topic)
                return
            if int(str(again.get(REV, 0))) == rev:
                break
            entry, rev = again, int(str(again.get(REV, 0)))
            self._apply_entry(topic, lane, entry)
        else:
            raise StorageUnavailable(
                f"topic {topic.name!r}: its registry entry keeps changing; retry",
                {"topic": topic.name, "backend": "jetstream"},
            )
        absent = set(gone)
        dead = [
            seq
            for seq in _live_seqs(topic, min(topic.head_seq, last))
            if seq < first or seq in absent
        ]
        if dead:
            self.engine.apply_seqs_delete(topic, dead)
            log.info("topic %r: %d records deleted elsewhere dropped", topic.name, len(dead))
        deletes = entry.get("deletes") or []
        assert isinstance(deletes, list)
        if deletes:
            lane.deletes_applied = max(lane.deletes_applied, int(deletes[-1][0]))

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
        # (a lane without the topic: this front is creating it right now)
        if tid in engine.by_id or tid in self.backend._lanes:
            await trio.lowlevel.checkpoint()
            return None
        entry, _ = await self.backend._call(partial(self.store.entry, tid))
        if entry is None or tid in engine.by_id or tid in self.backend._lanes:
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

    async def sync_all(self, shard: int | None = None) -> None:
        """Every topic (of `shard`, when given): created and deleted ones, then each one's
        entry and records."""
        call = self.backend._call
        streams = set(await call(self.store.stream_heads))
        ids = await call(self.store.entry_ids)
        for topic in list(self.engine.by_id.values()):
            if topic.topic_id not in ids:
                await self._remove(topic)
        for tid in sorted(self._unknown(ids, streams)):
            await self._install_id(tid)
        for topic in list(self.engine.by_id.values()):
            if shard is None or self.shard_of(topic.name) == shard:
                await self.refresh(topic)

    def work_changed(self, topic: Topic) -> None:
        """On the owner: `topic`'s queue changed (an append, ack, nack, release, expiry)
        while `/work` streams of other fronts refill from it; they hear it by a notice."""
        self._work_changed[topic] = None
        self._work_wake.set()

    async def _send_work_notices(self) -> None:
        call = self.backend.bridge.call
        while True:
            await self._work_wake.wait()
            self._work_wake = trio.Event()
            topics = list(self._work_changed)
            self._work_changed.clear()
            for topic in topics:
                if not topic.deleted and self.owns(topic.name):
                    try:
                        await call(partial(self.store.notify_topic, topic.topic_id))
                    except Exception as exc:  # (lost: the streams' poll makes up for it)
                        log.warning("front %s: no work notice: %s", self.front_id, exc)

    async def _follow_notices(self) -> None:
        call = self.backend.bridge.call
        while True:
            tids = await call(self.store.next_notices, parks=True)  # (a local queue: never fails)
            for tid in tids:
                topic = self.engine.by_id.get(tid)
                if (
                    topic is not None
                    and (q := topic.queue) is not None
                    and q.workers
                    and not self.owns(topic.name)
                ):
                    q.changed()  # its `/work` streams here refill from the owner at once
                if topic is not None and (
                    self.owns(topic.name)
                    or not (
                        topic.has_waiters
                        or topic in self.engine.watch.watchers
                        or self.engine.routers.feeds_out(topic)  # (a feed run here)
                    )
                ):
                    # its own, or nobody waits on it here: a read catches it up when
                    # one comes (and the poll within a second), not every write
                    continue
                try:
                    if topic is None:
                        await self._install_id(tid)
                    else:
                        await self.refresh(topic)
                except Exception as exc:  # (a background loop: it must outlive any failure)
                    log.warning("front %s: topic %d not caught up: %s", self.front_id, tid, exc)

    async def _poll(self) -> None:
        while True:
            await trio.sleep(POLL_S)
            if self.owner and self.live == 1:
                continue  # alone and owning everything: nobody else writes
            try:
                await self.poll_once()
                await self.push_reads()
            except Exception as exc:  # (a background loop: it must outlive any failure)
                log.warning("front %s: poll failed: %s", self.front_id, exc)

    # ---- the order of live watch frames across owners ------------------------------------

    def _ordered(self, topic: Topic) -> bool:
        """Whether the wakes of `topic` are ordered here: a watch stream on this front
        watches it with other topics, one of them owned by another front (whose writes
        reach this front by notices, later than its own commits)."""
        conns = self.engine.watch.watchers.get(topic)
        if not conns:
            return False
        for conn in conns:
            names = conn.session.topics if isinstance(conn, Conn) else conn.subs
            if len(names) > 1 and any(not self.owns(n) for n in names):
                return True
        return False

    def _partners(self, topic: Topic) -> set[str]:
        """The other topics of `topic`'s watch streams here that another front owns."""
        out: set[str] = set()
        for conn in self.engine.watch.watchers.get(topic) or ():
            names = conn.session.topics if isinstance(conn, Conn) else conn.subs
            out.update(n for n in names if n != topic.name and not self.owns(n))
        return out

    def submitted(self, topic: Topic) -> None:
        """A write of `topic` (this front owns it) is about to be published: when its
        wakes are ordered, the next ordering round's listing, begun now (before the
        write is acknowledged), is the one its commit waits for (`hold`)."""
        if (self.owner and self.live == 1) or not self._ordered(topic):
            return
        if self._need.get(topic) != self._rounds + 1:
            self._need[topic] = self._rounds + 1
            self._order_wake.set()

    def hold(self, topic: Topic) -> bool:
        """The scheduler's `hold`: the wakes of ordered topics (`_ordered`) are released
        in the order they came, and the commit of a topic this front owns only after
        the ordering round that began when its write was received (`submitted`) has
        caught up the stream's topics of other owners. A write another owner
        acknowledged before the client sent this one is then in memory first (its
        notice may not have arrived yet), so its frame comes first, as on one process;
        one acknowledged after it is not in that round's listing, so it does not. A
        wake of another owner's topic (its notice) waits only behind the wakes held
        before it."""
        if self._releasing or (self.owner and self.live == 1) or not self._ordered(topic):
            return False
        if topic in self._held:
            return True  # (already queued: its place stays)
        if self.owns(topic.name):
            need = self._need.pop(topic, self._rounds + 1)
            if need <= self._done and not self._held:
                return False  # (its round is over: nothing to wait for)
            self._held[topic] = need
            if need > self._rounds:
                self._order_wake.set()
        elif not self._held:
            return False
        else:
            self._held[topic] = 0
        return True

    async def _order_wakes(self) -> None:
        """Ordering rounds, one at a time (concurrent writes share one): the streams'
        last seqs (one JetStream request, made after the writes it serves were received
        and, unless a round was running then, before they are acknowledged: every write
        acknowledged before they were sent is in it, and none sent after), then a
        catch-up of the partners that moved (`_partners`), then the release
        (`_release`)."""
        sched = self.engine.sched
        sched.hold = self.hold
        try:
            while True:
                await self._order_round()
        finally:
            sched.hold = None
            self._release(None, [])  # (shutting down: every wake held)

    async def _order_round(self) -> None:
        """One ordering round, once a wake or a write asks for one."""
        await self._order_wake.wait()
        self._order_wake = trio.Event()
        self._rounds += 1
        number = self._rounds
        for gone in [t for t in self._need if t.deleted]:
            del self._need[gone]  # (a write that never committed)
        names: set[str] = set()
        for topic in [*self._need, *self._held]:
            names |= self._partners(topic)
        moved: list[Topic] = []
        try:
            heads = await self.backend._call(self.store.stream_heads) if names else {}
            for name in sorted(names):
                other = self.engine.topics.get(name)
                if other is None or other.deleted:
                    continue
                if heads.get(self.store.sid(other.topic_id), 0) > other.head_seq:
                    moved.append(other)
            async with trio.open_nursery() as nursery:
                for other in moved:
                    nursery.start_soon(self._catch_up_partner, other)
        except Exception as exc:  # (a background loop: it must outlive any failure)
            log.warning("front %s: watch wakes released unordered: %s", self.front_id, exc)
        self._done = number
        self._release(number, moved)

    async def _catch_up_partner(self, topic: Topic) -> None:
        try:
            await self.refresh(topic)
        except Exception as exc:
            log.warning("front %s: topic %r not caught up: %s", self.front_id, topic.name, exc)

    def _release(self, done: int | None, moved: list[Topic]) -> None:
        """Mark the held wakes in their order, up to the first commit that waits for a
        round after `done` (None: all of them); the partners the round caught up
        (`moved`) go just before the first commit it served (their writes were
        acknowledged before its listing)."""
        held = self._held
        due: list[Topic] = []
        for topic, need in held.items():
            if done is not None and need > done:
                break
            if need and moved:
                due += [t for t in moved if t in held and t not in due]
                moved = []
            if topic not in due:
                due.append(topic)
        self._releasing = True
        try:
            for topic in due:
                del held[topic]
                self.engine.sched.mark_dirty(topic)
        finally:
            self._releasing = False

    async def catch_up_all(self) -> None:
        """Before a listing on this front: the poll's catch-up, now (concurrent listings
        share one)."""
        ticket = self._polls_begun
        async with self._poll_lock:
            if self._polls_done > ticket:
                await trio.lowlevel.checkpoint()
                return  # one that began after this call did has finished
            self._polls_begun += 1
            number = self._polls_begun
            await self.poll_once()
            # the owners' read times (a listing's priorities follow them)
            for subject in sorted(set(self.owner_subjects.values()) - {self.subject}):
                await self._exchange_reads(subject, {}, READS_WAIT_S, everything=True)
            self._polls_done = number

    async def poll_once(self) -> None:
        """The fallback for lost notices, and how topics created or deleted elsewhere
        reach this front's listing: the streams' last seqs and the registry's ids.

        Both listings are their leader's (current). Topics are dropped when their entry
        is gone; new ids come from both (a stream is created before its entry), and each
        is read from the registry's leader before it is installed.

        On the owner, it finds what a deposed owner did before it noticed (a topic it
        created, records it wrote): those were acknowledged, so they are taken in."""
        backend = self.backend
        engine = self.engine
        heads = await backend._call(self.store.stream_heads)  # (by stream id)
        ids = await backend._call(self.store.entry_ids)
        for topic in list(engine.by_id.values()):
            tid = topic.topic_id
            sid = self.store.sid(tid)
            if self.owns(topic.name):
                if heads.get(sid, 0) > topic.head_seq:
                    await backend.resync(topic)
            elif tid not in ids:
                await self._remove(topic)
            elif heads.get(sid, 0) > topic.head_seq or sid not in heads:
                # (new records; or its stream is gone: its records moved to another)
                await self.refresh(topic)
        for tid in sorted(self._unknown(ids, set(heads))):
            await self._install_id(tid)
        routers = engine.routers
        if isinstance(routers, JsRouters):
            await routers.tend()  # (a router notice this front missed)

    def _unknown(self, ids: set[int], streams: set[int]) -> set[int]:
        """The topic ids among the registry's `ids` and the `streams` (stream ids: a
        stream is made before its entry) that this front does not serve; the streams
        of its topics (their own ids, or where their records moved) are not topics."""
        engine = self.engine
        known = set(engine.by_id) | {self.store.sid(t) for t in engine.by_id}
        return (ids | streams) - known


def _live_seqs(topic: Topic, upto: int) -> list[int]:
    """The seqs of `topic`'s live records up to `upto`."""
    out: list[int] = []
    for run in topic.runs:
        encs, base = run.encs, run.base
        lo, hi = max(topic.earliest_seq, base), min(upto, run.end)
        out.extend(seq for seq in range(lo, hi + 1) if encs[seq - base] is not None)
    return out


def _gone(topic: Topic) -> bool:
    return topic.deleted


def _answered(raw: bytes | None, tid: int) -> bool:
    """Whether an answer to a `reads` request with a depth came from topic `tid`'s owner
    (which answers the head of every topic of its own asked about, a router destination
    brought up to date first)."""
    if raw is None:
        return False
    ok = orjson.loads(raw).get("ok")
    heads = ok.get("heads") if isinstance(ok, dict) else None
    return isinstance(heads, dict) and str(tid) in heads


def _answered_head(raw: bytes | None, tid: int) -> int:
    """The head of topic `tid` an owner's `reads` answer gives (a router destination it
    brought up to date), or 0."""
    if raw is None:
        return 0
    ok = orjson.loads(raw).get("ok")
    heads = ok.get("heads") if isinstance(ok, dict) else None
    head = heads.get(str(tid)) if isinstance(heads, dict) else None
    return head if isinstance(head, int) else 0


def _merge_read(topic: Topic, ts: int) -> None:
    """A read time from another front: the topic's is the newest of them."""
    if topic.last_read_ts is None or ts > topic.last_read_ts:
        topic.last_read_ts = ts
        topic.mark_changed()


def _figures_of(raw: bytes | None) -> JsonValue | None:
    """A front's answer to a `metrics` request (None: none, or an error)."""
    if raw is None:
        return None
    try:
        answer = orjson.loads(zlib.decompress(raw))
    except (zlib.error, orjson.JSONDecodeError):
        return None  # (an error body: not compressed)
    return answer.get("ok") if isinstance(answer, dict) else None


def _error_body(err: TopicdError) -> bytes:
    body = err.body()
    inner = body["error"]
    assert isinstance(inner, dict)
    inner["status"] = err.http_status
    inner["retry_after"] = err.retry_after_s()
    return orjson.dumps(body)
