"""Routers on the jetstream backend: copies stored in the destination's stream.

The engine's `RouterService` decides every copy as on the embedded backend (lockstep
feeds, holes, `source_trim` gaps, the direct-write gate, backpressure). What differs is
where copies live (docs/jetstream.md, "Routers"):

* **Copies are materialized.** A forward's slots are not made visible at once: their
  destination seqs are reserved, and they go to the destination's stream as one batch
  in its lane, in seq order with the topic's writes and fenced like them (the expected
  last sequence). Once stored they are published in memory and the feed's cursors move;
  if the publish fails, nothing was shown, the seqs are released and the feed derives
  the same seqs again. A destination seq that holds no record (a hole, or a
  `source_trim` gap) is a message with no payload and `Topicd-Slot: hole` or `trim`, so
  stream seqs stay the topic's seqs.
* **A copy and its cursor are one fenced step.** A copy batch's first message carries
  the feed's cursors as they are once it is stored (`Topicd-Feed`). A front rebuilding
  the routers takes each router's cursor from the newest of: its registry entry, the
  destination's registry entry (`feed`, written before every purge of the destination)
  and the newest `Topicd-Feed` in the destination's stream. A batch that was stored is
  never copied again and one that was not is copied again: exactly once across a crash.
* **Definitions and cursors are registry entries**, `router.<hex of the name>`: the
  definition, both topic ids, the bases, and the cursor and `forwarded_total` as the
  `RouterCursor` frames last logged them (every `routers.cursor_log_ms`).
* **The destination's owner runs the feed**: its stream is the one written. With
  several owner fronts, a router is attached (its feed run) only on the front that
  owns its destination's shard, catching the source up as a follower when another
  front owns that. Every other front forwards `PUT`/`DELETE` there, reads definitions
  from the registry and asks the runner for the cursor (`GET`, listings); a front
  taking a shard over attaches the routers into its topics, one losing it detaches
  them (docs: "Several fronts").
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from functools import partial
from typing import TYPE_CHECKING, Final, TypeVar

import msgspec
import orjson
import trio

from topicd.engine.router import Router, RouterDef, RouterService, cyclic_edges
from topicd.errors import (
    RouterNotFound,
    StorageUnavailable,
    TopicdError,
    TopicExistsIncompatible,
)
from topicd.storage import frame as frames
from topicd.wire import ROUTER_DECODER, check_router_name

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from topicd.engine.engine import Engine
    from topicd.engine.topic import DerivedSlot, Topic
    from topicd.storage.jetstream import JetStreamBackend, JetStreamStore, StoredMsg, _Lane
    from topicd.storage.jsfronts import Fronts
    from topicd.wire import RouterIn

log = logging.getLogger("topicd.storage.jsrouters")

_T = TypeVar("_T")

ROUTER_PREFIX: Final = "router."
# the router graph: `{name: [source, dest, ms]}`, rewritten by compare-and-set by every
# router create, configure and delete after its checks (docs/jetstream.md, "Routers
# across several fronts")
GRAPH_KEY: Final = "meta.routers"
# a graph member with no `router.*` entry this old was left by a front that stopped
# between the graph's write and the entry's: the next write of the graph drops it
GRAPH_STALE_MS: Final = 60_000
GRAPH_TRIES: Final = 16  # a PUT's checks redone after a lost compare-and-set, at most

Graph = dict[str, list[object]]

# the graph a `PUT` running in this task checked against: (its revision, the graph)
_CHECKED: contextvars.ContextVar[tuple[int, Graph] | None] = contextvars.ContextVar(
    "topicd_router_graph", default=None
)


class _GraphMoved(StorageUnavailable):
    """The router graph changed between a `PUT`'s checks and its write: check again."""


def router_key(name: str) -> str:
    """The registry key of a router (hex: any name, valid key characters)."""
    return ROUTER_PREFIX + name.encode().hex()


def merge_feed(into: dict[str, list[int]], got: dict[str, object]) -> None:
    """Keep, per router, the furthest stored cursor ([cursor, forwarded_total])."""
    for name, value in got.items():
        if not isinstance(value, list) or len(value) != 2:
            continue
        cursor, total = int(value[0]), int(value[1])
        have = into.get(name)
        if have is None or cursor > have[0]:
            into[name] = [cursor, total]


def materialized(lane: _Lane, topic: Topic, msgs: list[StoredMsg]) -> list[StoredMsg]:
    """A page of a destination's stream as records: the feed cursors its copy batches
    carry are noted in `lane.feed`, `trim` slots become `source_trim` gaps, and the
    slots that hold no record are dropped (their seqs read as gaps)."""
    from topicd.storage.jetstream import H_FEED, H_SLOT

    out: list[StoredMsg] = []
    for m in msgs:
        raw = m.headers.get(H_FEED)
        if raw is not None:
            got = json.loads(raw)
            if isinstance(got, dict):
                merge_feed(lane.feed, got)
        slot = m.headers.get(H_SLOT)
        if slot is None:
            out.append(m)
        elif slot == "trim" and m.seq >= topic.evict_floor:
            topic.add_trim(m.seq, m.seq)
    return out


def encode_copies(
    store: JetStreamStore,
    topic: Topic,
    first: int,
    slots: list[DerivedSlot],
    trims: list[int],
    feed: dict[str, list[int]],
) -> list[tuple[str, bytes, dict[str, str]]]:
    """The messages of a copy batch at `first ..` (see the module docstring)."""
    from topicd.storage.jetstream import H_COUNT, H_EXTRA, H_FEED, H_SIZE, H_SLOT

    tid = topic.topic_id
    trimmed = set(trims)
    msgs: list[tuple[str, bytes, dict[str, str]]] = []
    for i, slot in enumerate(slots):
        enc = slot.enc
        headers: dict[str, str]
        if enc is None:
            headers = {H_SLOT: "trim" if first + i in trimmed else "hole"}
            msgs.append((store.subject(tid, None), b"", headers))
            continue
        headers = {H_SIZE: str(slot.size)}
        extra: dict[str, object] = {}
        if slot.tag is not None:
            extra["t"] = slot.tag
        if slot.node is not None:
            extra["n"] = slot.node
        if slot.prio:
            extra["p"] = slot.prio
        if slot.shape is not None:
            extra["s"] = list(slot.shape)
        if slot.hop:  # (a copy on a cycle: the front loading it counts on from here)
            extra["h"] = slot.hop
        if extra:
            headers[H_EXTRA] = json.dumps(extra, separators=(",", ":"))
        msgs.append((store.subject(tid, slot.tag), enc, headers))
    head = msgs[0][2]
    head[H_COUNT] = str(len(msgs))
    head[H_FEED] = json.dumps(feed, separators=(",", ":"))
    return msgs


# ---- registry calls (run on the bridge's loop) -------------------------------------------


async def put_router(store: JetStreamStore, name: str, body: dict[str, object]) -> None:
    assert store.kv is not None
    await store.kv.put(router_key(name), orjson.dumps(body))


async def update_router(store: JetStreamStore, name: str, body: dict[str, object]) -> bool:
    """Rewrite an existing router entry (a cursor log): False when it is gone (the
    router was deleted with a topic by another front), so a cursor log never brings a
    deleted router back."""
    import nats.js.errors

    assert store.kv is not None
    for _ in range(3):
        try:
            got = await store.kv.get(router_key(name))
        except nats.js.errors.KeyNotFoundError:
            return False
        if not got.value:
            return False
        try:
            await store.kv.update(router_key(name), orjson.dumps(body), last=got.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
        return True
    return False


async def router_entry(store: JetStreamStore, name: str) -> dict[str, object] | None:
    """The `router.*` entry of `name`, or None."""
    import nats.js.errors

    assert store.kv is not None
    try:
        got = await store.kv.get(router_key(name))
    except nats.js.errors.KeyNotFoundError:
        return None
    if not got.value:
        return None
    body = orjson.loads(got.value)
    return body if isinstance(body, dict) else None


async def delete_router(store: JetStreamStore, name: str) -> None:
    import nats.js.errors

    assert store.js is not None
    try:
        await store.js.purge_stream(
            f"KV_{store.bucket}", subject=f"$KV.{store.bucket}.{router_key(name)}"
        )
    except nats.js.errors.NotFoundError:
        return


async def router_graph(store: JetStreamStore) -> tuple[Graph, int]:
    """The router graph and its revision (0: never written)."""
    import nats.js.errors

    assert store.kv is not None
    try:
        got = await store.kv.get(GRAPH_KEY)
    except nats.js.errors.KeyNotFoundError:
        return {}, 0
    body = orjson.loads(got.value) if got.value else {}
    graph = {str(k): v for k, v in body.items() if isinstance(v, list) and len(v) == 3}
    return graph, int(got.revision or 0)


async def put_graph(store: JetStreamStore, graph: Graph, last: int) -> int | None:
    """Write the router graph if its revision is still `last`: the new revision, or
    None when another front wrote it first."""
    import nats.js.errors

    assert store.kv is not None
    value = orjson.dumps(graph)
    try:
        if last == 0:
            return int(await store.create_key(GRAPH_KEY, value))
        return int(await store.kv.update(GRAPH_KEY, value, last=last))
    except nats.js.errors.KeyWrongLastSequenceError:
        return None


async def router_entries(store: JetStreamStore) -> dict[str, dict[str, object]]:
    """Every `router.*` entry, by router name. The keys are the bucket stream's subjects
    as its leader lists them (a key listing through a consumer may be a lagging
    replica's, and miss a router created a moment ago); each entry is read from the
    leader too."""
    import asyncio

    names = sorted(bytes.fromhex(key).decode() for key in await store.keys_under(ROUTER_PREFIX))
    got = await asyncio.gather(*(router_entry(store, name) for name in names))
    return {name: body for name, body in zip(names, got, strict=True) if body is not None}


class JsRouters(RouterService):
    """`RouterService` whose copies are stored in the destination's stream before they
    are shown (module docstring)."""

    def __init__(self, engine: Engine, backend: JetStreamBackend) -> None:
        super().__init__(engine)
        self.backend = backend
        self.defs: dict[str, dict[str, object]] = {}  # the registry entries, by name
        # several owner fronts: every router's registry entry as last read (by name), and
        # the routers run on other fronts as the last listing showed them
        self.known: dict[str, dict[str, object]] = {}
        self.views: dict[str, Router] = {}
        self.waits: dict[Topic, trio.Event] = {}  # destinations with copies in flight
        # the router graph as last read, and its revision (the `PUT` checks' snapshot)
        self.graph: Graph = {}
        self.graph_rev = 0
        # a fault point: awaited between a `PUT`'s checks and its graph write (tests
        # force two racing `PUT`s to interleave there)
        self.graph_hook: Callable[[], Awaitable[None]] | None = None

    # ---- several owner fronts -----------------------------------------------------------

    def _shared(self) -> Fronts | None:
        """The fronts, when this front does not own every shard (then routers run on
        several fronts: each on its destination's owner); else None."""
        fronts = self.backend.fronts
        return None if fronts is None or fronts.owner else fronts

    def runs(self, dest: str) -> bool:
        """Whether this front runs the routers into topic `dest` (owns its shard)."""
        fronts = self.backend.fronts
        return fronts is None or fronts.owns(dest)

    async def _snapshot(self) -> tuple[int, Graph, dict[str, dict[str, object]]]:
        """The router graph, its revision and every router's entry, read in that order:
        a router whose graph write a `PUT` lost to is in the graph read after it."""
        store = self.backend.store
        graph, rev = await self.backend._call(partial(router_graph, store))
        known = await self.backend._call(partial(router_entries, store))
        return rev, graph, known

    async def _load_known(self) -> dict[str, dict[str, object]]:
        self.graph_rev, self.graph, self.known = await self._snapshot()
        self._recycle()  # (a cycle may run through other fronts' routers)
        return self.known

    def endpoints(self) -> dict[str, tuple[str, str]]:
        out = {}
        if self._shared() is not None:
            # the registry's routers and those being written (graph members whose
            # entry is not stored yet)
            out = {n: (str(m[0]), str(m[1])) for n, m in self.graph.items()}
            out |= {n: (str(b.get("source")), str(b.get("dest"))) for n, b in self.known.items()}
        out.update(super().endpoints())
        return out

    async def tend(self) -> None:
        """The poll's step: re-read the routers' entries when the graph changed since
        this front last read it (a router notice it missed: a delete's cycle notice that
        failed, say), so whether each router lies on a cycle converges."""
        if self._shared() is None or not self.routers:
            await trio.lowlevel.checkpoint()
            return
        _, rev = await self.backend._call(partial(router_graph, self.backend.store))
        if rev != self.graph_rev:
            await self._load_known()

    async def _forget(self, names: list[str]) -> None:
        """Remove deleted routers (their entries gone) from the graph. A failure is only
        logged: the delete stands, and the next graph write a minute on drops members
        with no entry."""
        try:
            await self._graph_edit({}, names)
        except TopicdError as exc:
            log.warning("routers %s deleted; left in the router graph for now: %s", names, exc)

    def _pruned(self, graph: Graph) -> Graph:
        """`graph` without the members a stopped front left (module constant
        `GRAPH_STALE_MS`)."""
        now = self.engine.clock.now_ms()
        return {
            n: m
            for n, m in graph.items()
            if n in self.known or n in self.routers or now - int(str(m[2])) < GRAPH_STALE_MS
        }

    async def _graph_edit(self, add: Graph, remove: list[str]) -> None:
        """Add and remove graph members, whatever else changed (no check depends on
        it: a delete, a configure on one front, a topic delete's cascade)."""
        store = self.backend.store
        for _ in range(GRAPH_TRIES):
            graph, rev = await self.backend._call(partial(router_graph, store))
            new = {n: m for n, m in self._pruned(graph).items() if n not in remove} | add
            if new == graph and rev:
                return
            got = await self.backend._call(partial(put_graph, store, new, rev))
            if got is not None:
                self.graph, self.graph_rev = new, got
                return
        raise StorageUnavailable("the router graph kept changing; retry", {"backend": "jetstream"})

    def listed(self) -> dict[str, Router]:
        if self._shared() is None:
            return self.routers
        return self.views | self.routers

    async def put(self, name: str, req: RouterIn) -> tuple[Router, bool]:
        fronts = self._shared()
        if fronts is None:
            return await super().put(name, req)
        self.definition_of(name, req)  # (the checks that need no state, here)
        if not fronts.owns(req.dest):
            ok = await fronts.router_call("router_put", req.dest, name, msgspec.json.encode(req))
            await self._load_known()  # (reads of its destination here ask its runner)
            return await self._view(ok), bool(ok["created"])
        r, created = await super().put(name, req)  # (`_put`: checked against the graph)
        if r.cyclic:
            # the routers of the cycle run elsewhere learn it before the answer: their
            # copies carry hop counts from now on, so a record stops at the hop cap
            await self._tell_cycle(fronts, name)
        return r, created

    async def _tell_cycle(self, fronts: Fronts, name: str) -> None:
        await self._reload(fronts, name, cyclic_edges(list(self.endpoints().values())))

    async def _reload(self, fronts: Fronts, name: str, edges: set[tuple[str, str]]) -> None:
        """The runners of the routers of `edges` (routers on a cycle) that run on other
        fronts re-read the registry: whether a router lies on a cycle decides its hop
        counts and which source seqs it passes over, so every front must agree on it
        before the `PUT` or `DELETE` of router `name` that changed it is answered."""
        for dest in sorted({d for _, d in edges if not fronts.owns(d)}):
            await fronts.router_call("router_reload", dest, name, b"")

    async def _put(self, d: RouterDef, create_dest: bool) -> tuple[Router, bool]:
        """With several runners: the checks are made against one snapshot of the router
        graph (other fronts' routers: names, cycles, fan-in, the cap), and the write
        replaces that graph by compare-and-set; a `PUT` that loses to another front's
        write checks again, so of two conflicting `PUT`s one is refused as on one
        process."""
        if self._shared() is None:
            return await super()._put(d, create_dest)
        for _ in range(GRAPH_TRIES):
            snap = await self._snapshot()
            await self.engine.sync_topic(d.source)
            # (from here to the base checks, no await: they see exactly this snapshot)
            self.graph_rev, self.graph, self.known = snap
            self._recycle()
            self._fan_in(d, create_dest)
            token = _CHECKED.set((snap[0], snap[1]))
            try:
                return await super()._put(d, create_dest)
            except _GraphMoved:
                continue
            finally:
                _CHECKED.reset(token)
        raise StorageUnavailable(
            "the router graph kept changing; retry", {"backend": "jetstream", "router": d.name}
        )

    def _fan_in(self, d: RouterDef, create_dest: bool) -> None:
        """The fan-in check against every front's routers (a router into the same
        destination being created on this front's other task included)."""
        if d.dest not in self.engine.topics and not create_dest:
            return  # (the base check refuses it first)
        for other, (source, dest) in sorted(self.endpoints().items()):
            if dest == d.dest and source != d.source and other != d.name:
                raise TopicExistsIncompatible(
                    f"topic {d.dest!r} is already the destination of router "
                    f"{other!r} from another source ({source!r})",
                    {"topic": d.dest, "reason": "router_dest_fan_in"},
                )

    async def _ensure(self, name: str) -> Topic:
        fronts = self.backend.fronts
        if fronts is None or fronts.owns(name):
            return await super()._ensure(name)
        for _ in range(3):
            await self.engine.sync_topic(name)
            topic = self.engine.topics.get(name)
            if topic is not None and topic.deleting is None:
                return topic
            # created (with defaults) by its owner when absent, then caught up here
            await fronts.router_call("ensure", name, "", b"")
        return self.engine.get(name)

    def answer(self, r: Router, created: bool | None = None) -> dict[str, object]:
        """A router's state as the front running it answers another front."""
        return {
            "def": r.d.to_frame(),
            "src_base": r.src_base,
            "dest_base": r.dest_base,
            "cursor": r.cursor,
            "forwarded_total": r.forwarded_total,
            "created": created,
        }

    async def _view(self, ok: dict[str, object]) -> Router:
        """A router run by another front, as its answer `ok` shows it (not attached)."""
        body = ok["def"]
        assert isinstance(body, dict)
        d = RouterDef.from_frame(body)
        await self.engine.sync_topic(d.source)
        if d.dest not in self.engine.topics:
            await self.engine.sync_topic(d.dest)
        src, dst = self.engine.topics.get(d.source), self.engine.topics.get(d.dest)
        if src is None or dst is None:
            raise RouterNotFound(f"router {d.name!r} does not exist", {"router": d.name})
        src_base, dest_base, cursor, total = (
            int(str(ok[k])) for k in ("src_base", "dest_base", "cursor", "forwarded_total")
        )
        return Router(d, src, dst, src_base, dest_base, cursor, total)

    async def _entry_of(self, name: str) -> dict[str, object] | None:
        return await self.backend._call(partial(router_entry, self.backend.store, name))

    @property
    def syncs_sources(self) -> bool:
        return self._shared() is not None and bool(self.by_dest)

    async def sync_sources(self, dest: Topic, depth: int = 0) -> None:
        """Catch `dest`'s source up when another front owns it, and forward what it
        brought (before a read of `dest`, and before a direct write to it: copies and
        direct writes interleave in arrival order across fronts too).

        The source's owner is asked to bring it up to date first when it is itself a
        router destination (a chain), down to `max_hops` fronts; a feed on a cycle asks
        only from the read's own front (`depth` 0), which repeats the round until
        nothing moves (each round: the other front copies, then this one)."""
        feed = self.by_dest.get(dest)
        fronts = self.backend.fronts
        if not feed or fronts is None or fronts.owns(feed[0].src.name):
            await trio.lowlevel.checkpoint()
            return
        src = feed[0].src
        cyclic = any(r.cyclic for r in feed)
        onward = depth == 0 or (not cyclic and depth < self.cfg.max_hops)
        rounds = 2 * self.cfg.max_hops + 2 if cyclic and depth == 0 else 1
        for _ in range(rounds):
            before = (src.head_seq, dest.head_seq)
            await fronts.catch_up(src.name, depth=depth + 1 if onward else None)
            if dest.deleted or src.deleted:
                return
            self.catch_up(dest)
            if self.in_flight or self.wants:
                await self.settle(dest)
            if (src.head_seq, dest.head_seq) == before:
                break

    async def freshen(self, dest: Topic, depth: int = 0) -> None:
        """A read of `dest` (run here) on any front: its source caught up, its feed
        forwarded and the copies stored (read-your-writes through routers)."""
        await self.sync_sources(dest, depth)
        if dest.deleted:
            return
        self.catch_up(dest)
        if self.in_flight or self.wants:
            await self.settle(dest)

    async def lookup(self, name: str) -> Router:
        fronts = self._shared()
        r = self.routers.get(name)
        if r is not None or fronts is None:
            r = await super().lookup(name)
            if fronts is not None:
                await self.freshen(r.dst)
            return r
        check_router_name(name)
        body = await self._entry_of(name)
        if body is None:
            raise RouterNotFound(f"router {name!r} does not exist", {"router": name})
        dest = str(body.get("dest"))
        if fronts.owns(dest):  # (this front took the shard a moment ago)
            await self.rebuild(repair=False)
            r = await super().lookup(name)
            await self.freshen(r.dst)
            return r
        return await self._view(await fronts.router_call("router_get", dest, name, b""))

    async def definition(self, name: str) -> RouterDef | None:
        r = self.routers.get(name)
        if r is not None or self._shared() is None:
            return await super().definition(name)
        check_router_name(name)
        body = await self._entry_of(name)
        return None if body is None else RouterDef.from_frame(body)

    async def delete(self, name: str) -> bool:
        fronts = self._shared()
        if fronts is None:
            return await super().delete(name)
        r = self.routers.get(name)
        if r is not None:  # (run here)
            # the source records acknowledged before the delete (maybe by another
            # front, not caught up here yet) are copied first, as on one process
            await self.freshen(r.dst)
            was = cyclic_edges(list(self.endpoints().values())) if r.cyclic else set()
            deleted = await super().delete(name)
            self.known.pop(name, None)
            self._recycle()
            # the runners of the cycle it was on: their routers may be off every cycle now
            try:
                await self._reload(fronts, name, was)
            except TopicdError as exc:  # (deleted all the same: a retry finds it gone)
                log.warning("router %r deleted; a front on its cycle not told: %s", name, exc)
            return deleted
        check_router_name(name)
        body = await self._entry_of(name)
        if body is None:
            return False
        dest = str(body.get("dest"))
        if not fronts.owns(dest):
            ok = await fronts.router_call("router_delete", dest, name, b"")
            return bool(ok["deleted"])
        await self.rebuild(repair=False)  # (this front took the shard a moment ago)
        if name in self.routers:
            return await self.delete(name)
        # (a topic of it is gone, and the front that deleted it did not remove the
        # router, or has not yet: the entry and its member of the graph go here, or a
        # fan-in check would go on seeing the router)
        await self.backend._call(partial(delete_router, self.backend.store, name))
        self.known.pop(name, None)
        await self._forget([name])
        self._recycle()
        return True

    async def sync_listing(self) -> None:
        fronts = self._shared()
        if fronts is None:
            await trio.lowlevel.checkpoint()
            return
        engine = self.engine
        await engine.sync_listing()  # (every topic: a router's endpoints by id)
        entries = await self._load_known()
        views: dict[str, Router] = {}
        asks: dict[str, list[str]] = {}  # the runners' request subjects: their routers
        missing = False
        for name, body in entries.items():
            if name in self.routers:
                continue
            try:
                d = RouterDef.from_frame(body)
                nums = [
                    int(str(body.get(k, 0)))
                    for k in ("src_id", "dest_id", "src_base", "dest_base", "cursor")
                ]
                total = int(str(body.get("forwarded_total", 0)))
            except (ValueError, TypeError, KeyError, frames.FrameError):
                continue
            src, dst = engine.by_id.get(nums[0]), engine.by_id.get(nums[1])
            if src is None or dst is None:
                continue  # (a topic deleted with it: its entry goes with the delete)
            if fronts.owns(dst.name):
                missing = True
                continue
            views[name] = Router(d, src, dst, nums[2], nums[3], nums[4], total)
            subject = fronts.runner_of(dst)
            if subject is not None:
                asks.setdefault(subject, []).append(name)
        if missing:  # (a shard taken over a moment ago)
            await self.rebuild(repair=False)
        for subject, names in sorted(asks.items()):
            for name, (cursor, total) in (await fronts.router_totals(subject, names)).items():
                view = views.get(name)
                if view is not None:
                    view.cursor, view.forwarded_total = cursor, total
        self.views = views

    def totals(self, names: list[str]) -> dict[str, list[int]]:
        """The cursors and totals of the routers of `names` run here (a listing on
        another front asks)."""
        return {
            n: [r.cursor, r.forwarded_total]
            for n in names
            if (r := self.routers.get(n)) is not None
        }

    async def serve(self, op: str, name: str, body: bytes) -> dict[str, object]:
        """A router call forwarded by another front to this one, the destination's
        owner (`op`: `router_put`, `router_get`, `router_delete`, or `router_reload`:
        re-read every router's entry, a cycle changed; `router_drain`: copy what the
        source holds now, it is about to be deleted)."""
        if op == "router_put":
            req = ROUTER_DECODER.decode(body)
            r, created = await self.put(name, req)
            return self.answer(r, created)
        if op == "router_get":
            return self.answer(await self.lookup(name))
        if op == "router_reload":
            await self._load_known()
            return {}
        if op == "router_drain":  # (its source is about to be deleted by its owner)
            live = self.routers.get(name)
            if live is not None:
                await self.freshen(live.dst)
            return {}
        assert op == "router_delete", op
        return {"deleted": await self.delete(name)}

    async def touching_all(self, topic: Topic) -> list[str]:
        """Before `topic`'s delete: the routers of it, and the runners on other fronts
        of the routers from it copy what it holds first (the source records acknowledged
        before the delete are copied, as the drain after each write does on one
        process)."""
        names = set(self.touching(topic))
        fronts = self._shared()
        if fronts is not None:
            tid = topic.topic_id
            for name, body in sorted((await self._load_known()).items()):
                if tid not in (body.get("src_id"), body.get("dest_id")):
                    continue
                names.add(name)
                dest = str(body.get("dest"))
                if body.get("src_id") == tid and not fronts.owns(dest):
                    try:
                        await fronts.router_call("router_drain", dest, name, b"")
                    except TopicdError as exc:  # (its runner is gone: nothing copies now)
                        log.warning(
                            "router %r: not drained before its source's delete: %s", name, exc
                        )
        else:
            await trio.lowlevel.checkpoint()
        return sorted(names)

    async def deleted_with(self, topic: Topic, names: list[str]) -> None:
        # (the front running each detaches it when it drops `topic`, its source)
        was = cyclic_edges(list(self.endpoints().values()))
        for name in names:
            await self.backend._call(partial(delete_router, self.backend.store, name))
            self.known.pop(name, None)
        await self._forget(names)
        self._recycle()
        fronts = self._shared()
        if fronts is not None and names:
            try:
                await self._reload(fronts, names[0], was)
            except TopicdError as exc:  # (the topic is gone either way)
                log.warning("routers %s deleted; a front on their cycle not told: %s", names, exc)

    # ---- forwarding ----------------------------------------------------------------------

    def forward(self, dst: Topic, limit: int, now: int | None = None) -> int:
        if dst in self.waits:
            return 0  # one copy batch in flight per destination
        if not self.runs(dst.name):
            return 0  # (stepping down: `drop` detaches the routers)
        lane = self.backend._lanes.get(dst.topic_id)
        if lane is not None and lane.diverged:
            with contextlib.suppress(TopicdError):
                self.backend.admit(dst, 0, bypass=True)  # starts the read-back
            return 0
        feed = self.by_dest.get(dst)
        if not feed:
            return 0
        if lane is not None and lane.feed:
            # copies stored by another front (a deposed owner that had not noticed yet)
            # and read back from the stream: never copy those source seqs again
            for r in feed:
                got = lane.feed.get(r.d.name)
                if got is not None and got[0] > r.cursor:
                    r.cursor, r.forwarded_total = got
        from topicd.storage.jetstream import BATCH_MAX

        limit = max(1, min(limit, BATCH_MAX // len(feed)))
        return super().forward(dst, limit, now)

    def _stuck(self, dest: Topic) -> bool:
        return dest in self.waits or super()._stuck(dest)

    def _place(
        self,
        dst: Topic,
        feed: list[Router],
        starts: list[int],
        done: int,
        ts: int,
        slots: list[DerivedSlot],
        trims: list[int],
        copies: list[int],
        blocked: bool,
        now: int,
    ) -> None:
        if not slots:  # only seqs passed over (a router on a cycle): nothing to store
            super()._place(dst, feed, starts, done, ts, slots, trims, copies, blocked, now)
            return
        feed = list(feed)
        first = dst.head_seq + 1
        dst.next_seq = first + len(slots)  # reserved, as a write's seqs are
        cursors = {
            r.d.name: [done, r.forwarded_total + done - starts[i]]
            if starts[i] < done
            else [r.cursor, r.forwarded_total]
            for i, r in enumerate(feed)
        }
        msgs = encode_copies(self.backend.store, dst, first, slots, trims, cursors)
        ev = trio.Event()
        self.waits[dst] = ev
        self.in_flight += 1

        def stored(ok: bool) -> None:
            self.in_flight -= 1
            self.waits.pop(dst, None)
            ev.set()
            if ok and not dst.deleted:
                # shown now: the writes queued behind these copies keep their seqs
                behind = dst.next_seq
                dst.next_seq = dst.head_seq + 1
                try:
                    RouterService._place(
                        self, dst, feed, starts, done, ts, slots, trims, copies, blocked, now
                    )
                finally:
                    dst.next_seq = max(behind, dst.next_seq)
                merge_feed(self.backend.lane(dst).feed, dict(cursors))
                self.backend._release(feed[0].src)  # (copied: the cache may drop them)
            if ok and dst in self.held:
                self.release(dst)

        from topicd.storage.jetstream import CopyBatch

        self.backend.submit_copies(dst, CopyBatch(first, msgs, stored))

    async def settle(self, dest: Topic) -> None:
        """Read-path catch-up: until the copies into `dest` (and into the topics feeding
        it) that the catch-up made are stored and shown, and the source records its
        feeds stopped at (read back from the stream first: the payload cache had let
        them go) are copied, catching up again after each round."""
        for _ in range(2 * self.cfg.max_hops + 2):
            waits = []
            wanted = False
            topic: Topic | None = dest
            for _ in range(self.cfg.max_hops + 1):
                if topic is None:
                    break
                ev = self.waits.get(topic)
                if ev is not None:
                    waits.append(ev)
                wanted = wanted or topic in self.wants
                feed = self.by_dest.get(topic)
                topic = feed[0].src if feed else None
            lane = self.backend._lanes.get(dest.topic_id)
            diverged = lane is not None and lane.diverged  # (a copy batch's fence failed)
            if not waits and not wanted and not diverged:
                break
            if diverged and not await self.backend.resync(dest):
                break  # (the stream cannot be read back yet: the read shows what is here)
            if wanted:
                await self._load_wanted()
            for ev in waits:
                await ev.wait()
            self.catch_up(dest)
        await trio.lowlevel.checkpoint()

    # ---- the registry ----------------------------------------------------------------------

    async def control(
        self, ftype: int, topic: Topic, body: dict[str, object], apply: Callable[[], _T]
    ) -> _T:
        """A router frame made durable in the registry, then applied (`topic`: the
        router's source)."""
        name = str(body["router"])
        store = self.backend.store
        call = self.backend._call
        if ftype == frames.ROUTER_DELETE:
            await call(partial(delete_router, store, name))
            self.defs.pop(name, None)
            await self._forget([name])
            return apply()
        if ftype == frames.ROUTER_CURSOR:
            prev = self.defs.get(name)
            if prev is None:
                await trio.lowlevel.checkpoint()
                return apply()
            cursor, total = body.get("cursor"), body.get("forwarded_total")
            assert isinstance(cursor, int)
            assert isinstance(total, int)
            if cursor <= int(str(prev.get("cursor", 0))):
                await trio.lowlevel.checkpoint()
                return apply()
            stored = prev | {"cursor": cursor, "forwarded_total": total}
            if not await call(partial(update_router, store, name, stored)):
                await trio.lowlevel.checkpoint()
                return apply()  # (deleted with its source by another front)
            self.defs[name] = stored
            return apply()
        assert ftype == frames.ROUTER_CREATE
        live = self.routers.get(name)
        d = RouterDef.from_frame(body)
        stored = d.to_frame()
        if live is not None:  # a new config: the router keeps its bases and cursor
            stored |= {
                "src_id": live.src.topic_id,
                "dest_id": live.dst.topic_id,
                "src_base": live.src_base,
                "dest_base": live.dest_base,
                "cursor": live.cursor,
                "forwarded_total": live.forwarded_total,
            }
        else:
            src_base, dest_base, dest_id = body["src_base"], body["dest_base"], body["dest_id"]
            assert isinstance(src_base, int)
            assert isinstance(dest_base, int)
            assert isinstance(dest_id, int)
            stored |= {
                "src_id": topic.topic_id,
                "dest_id": dest_id,
                "src_base": src_base,
                "dest_base": dest_base,
                "cursor": src_base,
                "forwarded_total": 0,
            }
        member: Graph = {name: [d.source, d.dest, self.engine.clock.now_ms()]}
        checked = _CHECKED.get()
        if checked is None:
            await self._graph_edit(member, [])
        else:  # the graph the `PUT`'s checks saw, or none of it (check again)
            if self.graph_hook is not None:
                await self.graph_hook()
            rev, graph = checked
            new = self._pruned(graph) | member
            got = await call(partial(put_graph, store, new, rev))
            if got is None:
                raise _GraphMoved(
                    "the router graph changed meanwhile", {"backend": "jetstream", "router": name}
                )
            self.graph, self.graph_rev = new, got
        await call(partial(put_router, store, name, stored))
        self.defs[name] = stored
        return apply()

    def drop(self, shard: int | None = None) -> None:
        """This front no longer owns `shard` (None: any): the routers into its topics
        stop here (their entries stay; the front that owns it now attaches them)."""
        fronts = self.backend.fronts
        for name in sorted(self.routers):
            r = self.routers[name]
            if shard is None or fronts is None or fronts.shard_of(r.dst.name) == shard:
                self._detach(r)
                self.defs.pop(name, None)

    async def rebuild(self, *, repair: bool, taking: int | None = None) -> int:
        """Attach every router of the registry whose topics exist, whose destination's
        shard this front owns (or is taking over: shard `taking`) and that is not
        attached yet, at its stored cursor (see the module docstring): at start, and
        when a front takes a shard over. With `repair` (a front owning every shard),
        remove the entries of routers whose topic is gone. Returns how many were
        attached."""
        engine = self.engine
        entries = await self.backend._call(partial(router_entries, self.backend.store))
        self.known = entries
        attached = 0
        for name in sorted(entries):
            if name in self.routers:
                continue
            body = entries[name]
            ids = [body.get(k) for k in ("src_id", "dest_id", "src_base", "dest_base")]
            cursor, total = body.get("cursor"), body.get("forwarded_total", 0)
            if not all(isinstance(v, int) for v in [*ids, cursor, total]):
                log.error("router %r: a registry entry it cannot read; left alone", name)
                continue
            src_id, dst_id, src_base, dest_base = (int(str(v)) for v in ids)
            src, dst = engine.by_id.get(src_id), engine.by_id.get(dst_id)
            if src is None or dst is None:
                if repair:
                    await self.backend._call(partial(delete_router, self.backend.store, name))
                continue
            fronts = self.backend.fronts
            if not self.runs(dst.name) and (
                taking is None or fronts is None or fronts.shard_of(dst.name) != taking
            ):
                continue
            at, done = int(str(cursor)), int(str(total))
            got = self.backend.lane(dst).feed.get(name)
            if got is not None and got[0] > at:
                at, done = got
            d = RouterDef.from_frame(body)
            r = Router(d, src, dst, src_base, dest_base, at, done)
            r.logged = int(str(cursor))
            self.defs[name] = body
            self._attach(r)
            attached += 1
        self._recycle()  # (the cycles the registry's routers make)
        return attached
