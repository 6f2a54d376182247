"""Routers: server-side copying of every record committed to a source topic into a dest.

A router is a definition plus a cursor (the last source seq it has *handled*). Forwarding
is asynchronous and off the write path. The unit of forwarding is a **feed**: every router
into one destination (they all share one source: the fan-in rule). Four things drive it:

* the delivery scheduler's drain of the source, in the source's band, after the source's
  own watchers are served (`RouterService.drain_source`); the drain yields between feeds
  at its delivery quantum and requeues the source when a feed had more than
  `routers.batch` seqs to handle. Under the governor's defer rung the source's drain makes
  no copies: it enqueues each destination one band lower and the destination's drain
  copies (the scheduler spec's demotion of router work);
* the drain of a destination, before it serves its watchers (`drain_dest`): a watch pass
  on a destination catches up the routers feeding it;
* a sweep every `routers.tick_ms` (`RouterService.run`), which also retries feeds held
  back by a full destination;
* read-path catch-up: a diff, long-poll or new watch of a destination first drains the
  routers feeding it (and theirs, upstream), so a read right after a source write sees
  the copy.

**Seq mapping.** Every handled source seq consumes exactly one destination seq per
router, in *lockstep* order: source seq first, router name second (two routers of one
source into one destination copy seq `s` in name order, then seq `s + 1`). Each slot is a
copy, a *hole* (filtered out, deleted at the source, or at the hop cap: nothing readable)
or a *trim* (the source evicted the record before it was copied: a `source_trim`
tombstone). Copies take `dest head + 1 ..` at forward time and a direct write takes the
next seq too, so copies and direct writes interleave in arrival order. A copy is never
placed while a direct write to the destination is in flight (it could still fail and
release its seqs); the feed is *held* instead, and the destination's next direct writes
wait at a gate until the held copies are placed, which happens synchronously when the
in-flight writes have published (`release`). So copies are never starved by a busy
destination, and nothing else waits on it.

**Derived, not logged.** Copies never go through the WAL. Recovery re-derives them, per
feed: from the routers' anchors (`RouterCreate`'s base, `RouterCursor` frames, the
snapshot: "source seq `cursor` handled, every later copy of the feed lies above
`floor`"), each next (source seq, router) pair in lockstep order takes the next
destination seq above the floor that no replayed direct write holds. That reproduces
the live placement exactly, because a gap between two replayed direct writes can only
have been filled by the feed's slots, in that order. Snapshots hold the destination's
records (copies included), so only copies made since the last snapshot are re-derived;
one whose source record is gone by then becomes a `source_trim` gap.
"""

from __future__ import annotations

import bisect
import logging
import re
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import orjson
import trio
import trio.lowlevel

from topicd.engine.payloads import LOAD_BYTES_MAX
from topicd.engine.topic import EVICTED, HOLE, DerivedSlot
from topicd.errors import (
    InvalidRequest,
    JsonValue,
    RouterCycle,
    RouterNotFound,
    StorageUnavailable,
    Throttled,
    TopicdError,
    TopicExistsIncompatible,
    TopicNotFound,
)
from topicd.model import META_KEY, offsets
from topicd.storage import frame as frames
from topicd.wire import check_router_name, check_topic_name

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from topicd.engine.engine import Engine
    from topicd.engine.topic import Topic
    from topicd.model import Shape
    from topicd.sched.classes import Budget
    from topicd.wire import RouterIn

log = logging.getLogger("topicd.routers")

_HEAD: Final = re.compile(rb'\{"\$seq":\d+,"\$ts":\d+')
_LOAD_PASSES: Final = 16  # batches a feed behind evicted records loads per sweep tick
TRIM: Final = DerivedSlot(None, size=-1)  # marker: the source lost the record first
_CATCH_UP_PASSES: Final = 64  # read-path catch-up: batches per feed before giving up
SOURCE_EPOCH: Final = 1  # topic ids are never reused, so every incarnation is epoch 1


@dataclass(frozen=True, slots=True)
class RouterDef:
    """A router's configuration (api: every field but `create_dest`)."""

    name: str
    source: str
    dest: str
    preserve_node: bool = True
    preserve_tag: bool = True
    filter: tuple[str, str] | None = None  # (op, value) as `parse_match` returns it
    allow_cycle: bool = False
    guarantee: str = "at_least_once"

    def fields(self) -> dict[str, JsonValue]:
        from topicd.engine.engine import canonical_match

        return {
            "router": self.name,
            "source": self.source,
            "dest": self.dest,
            "preserve_node": self.preserve_node,
            "preserve_tag": self.preserve_tag,
            "filter": None if self.filter is None else list(canonical_match(self.filter)),
            "allow_cycle": self.allow_cycle,
            "guarantee": self.guarantee,
        }

    def to_frame(self) -> dict[str, object]:
        body: dict[str, object] = dict(self.fields())
        body["filter"] = None if self.filter is None else list(self.filter)
        return body

    @classmethod
    def from_frame(cls, body: dict[str, object]) -> RouterDef:
        filt = body.get("filter")
        if filt is not None and not (
            isinstance(filt, list) and len(filt) == 2 and all(isinstance(x, str) for x in filt)
        ):
            raise frames.FrameError("bad router filter")
        values = {
            k: body[k]
            for k in ("preserve_node", "preserve_tag", "allow_cycle", "guarantee")
            if k in body
        }
        return cls(
            name=str(body["router"]),
            source=str(body["source"]),
            dest=str(body["dest"]),
            filter=None if filt is None else (str(filt[0]), str(filt[1])),
            **values,  # type: ignore[arg-type]
        )

    def matches(self, tag: str | None) -> bool:
        if self.filter is None:
            return True
        if tag is None:
            return False  # untagged records never match a filter
        op, value = self.filter
        return tag == value if op == "Eq" else tag.startswith(value)


@dataclass(eq=False, slots=True)
class Router:
    """A live router: its definition, endpoints and cursor."""

    d: RouterDef
    src: Topic
    dst: Topic
    src_base: int
    dest_base: int
    cursor: int  # last source seq handled
    forwarded_total: int = 0  # source seqs handled since creation
    copies_total: int = 0  # records actually appended to dest (topicd metric)
    logged: int = -1  # cursor of the last RouterCursor frame
    blocked: bool = False  # the destination refused room last time
    cyclic: bool = False  # on a directed cycle of routers: hop counts apply

    @property
    def lag(self) -> int:
        """Source head minus cursor (what is still to forward)."""
        return max(0, self.src.head_seq - self.cursor)

    def anchor(self) -> dict[str, object]:
        return {
            "router": self.d.name,
            "cursor": self.cursor,
            "floor": self.dst.head_seq,
            "forwarded_total": self.forwarded_total,
        }


@dataclass(slots=True)
class ReplayRouter:
    """A router as recovery sees it before both endpoints are known."""

    d: RouterDef
    src_id: int
    dst_id: int
    src_base: int
    dest_base: int
    cursor: int
    floor: int  # every copy of a seq above `cursor` lies above this dest seq
    forwarded_total: int
    anchors: list[tuple[int, int]] = field(default_factory=list)  # later (cursor, floor)
    final: int | None = None  # deleted: the cursor it stopped at


@dataclass
class RouterStats:
    copies: int = 0  # records appended to destinations
    trimmed: int = 0  # source seqs lost before they were copied
    blocked: int = 0  # passes held back by a full destination
    passes: int = 0


def mark_meta(
    enc: bytes, shape: Shape | None, size: int, marker: dict[str, JsonValue], max_keys: int
) -> tuple[bytes, Shape | None, int]:
    """`exactly_once`: the record's stored JSON with `meta._topics_router` set to `marker`.

    An object `meta` gets the key (replacing one an earlier hop set); a non-object
    `meta`, or an object already at `max_keys` keys without it, moves under
    `_topics_original_meta`; no `meta` becomes `{"_topics_router": marker}`. Returns the
    new text, shape and size (data + meta bytes)."""
    pre_len, data_off = offsets(enc, shape)
    old = enc[pre_len + len(META_KEY) : data_off] if data_off > pre_len else None
    new: JsonValue
    if old is None:
        new = {"_topics_router": marker}
    else:
        value = orjson.loads(old)
        if isinstance(value, dict) and ("_topics_router" in value or len(value) < max_keys):
            value["_topics_router"] = marker
            new = value
        else:
            new = {"_topics_router": marker, "_topics_original_meta": value}
    text = orjson.dumps(new)
    part = META_KEY + text
    out = enc[:pre_len] + part + enc[data_off:]
    return out, (shape[0] if shape else 0, len(part)), size - len(old or b"") + len(text)


def rewrite(
    enc: bytes, shape: Shape | None, node: str | None, keep_node: bool, seq: int, ts: int
) -> tuple[bytes, Shape | None]:
    """A source record's stored JSON as a copy: fresh `$seq`/`$ts`, `$node` kept or not."""
    m = _HEAD.match(enc)
    assert m is not None
    rest = enc[m.end() :]
    if node is not None and not keep_node:
        part = b',"$node":' + orjson.dumps(node)
        assert rest.startswith(part)
        rest = rest[len(part) :]
        assert shape is not None
        shape = (shape[0] - len(part), shape[1])
        if shape == (0, 0):
            shape = None
    return b'{"$seq":%d,"$ts":%d' % (seq, ts) + rest, shape


def _ranges(seqs: list[int]) -> list[tuple[int, int]]:
    """Ascending seqs as inclusive runs: a long `source_trim` stretch is one gap."""
    out: list[tuple[int, int]] = []
    for s in seqs:
        if out and out[-1][1] + 1 == s:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


@dataclass(eq=False, slots=True)
class _NameLock:
    lock: trio.Lock = field(default_factory=trio.Lock)
    users: int = 0


def cyclic_edges(edges: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """The edges lying on a directed cycle: both ends in one strongly connected component
    (iterative Tarjan, O(V + E))."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    comp: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, int]] = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            succ = graph[v]
            if i < len(succ):
                work.append((v, i + 1))
                w = succ[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp[w] = index[v]
                    if w == v:
                        break
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return {(a, b) for a, b in edges if comp[a] == comp[b]}


class RouterService:
    """The router registry and forwarder of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg.routers
        self.routers: dict[str, Router] = {}
        self.by_source: dict[Topic, dict[Topic, None]] = {}  # source -> its dests, ordered
        self.by_dest: dict[Topic, list[Router]] = {}  # the feed of a dest, by router name
        self.stats = RouterStats()
        self._names: dict[str, _NameLock] = {}  # PUT/DELETE of one name run one at a time
        self.held: dict[Topic, trio.Event] = {}  # feeds held by a direct write in flight
        # feeds stopped at a source record whose bytes are only in its segment: the
        # sweep loads them (offloaded) and forwards right after (dest -> source seq)
        self.wants: dict[Topic, int] = {}
        # recovery only: routers as the log tells them, resolved in `rederive`
        self.replay: dict[str, ReplayRouter] = {}
        self.retired: list[ReplayRouter] = []
        # copies handed to storage and not yet visible (a backend that stores them:
        # `settle`); 0 here, where copies are visible once made
        self.in_flight = 0
        engine.sched.routers = self

    # ---- registry -----------------------------------------------------------------------

    def get(self, name: str) -> Router:
        r = self.routers.get(name)
        if r is None:
            check_router_name(name)
            raise RouterNotFound(f"router {name!r} does not exist", {"router": name})
        return r

    def _attach(self, r: Router) -> None:
        self.routers[r.d.name] = r
        self.by_source.setdefault(r.src, {})[r.dst] = None
        feed = self.by_dest.setdefault(r.dst, [])
        feed.append(r)
        feed.sort(key=lambda x: x.d.name)
        self._recycle()

    def _detach(self, r: Router) -> None:
        del self.routers[r.d.name]
        feed = self.by_dest[r.dst]
        feed.remove(r)
        if not feed:
            del self.by_dest[r.dst]
            dests = self.by_source[r.src]
            dests.pop(r.dst, None)
            if not dests:
                del self.by_source[r.src]
            self._release_gate(r.dst)
        self._recycle()

    def _recycle(self) -> None:
        """Re-mark which routers lie on a cycle (only they carry hop counts)."""
        on = cyclic_edges(list(self.endpoints().values()))
        for r in self.routers.values():
            r.cyclic = (r.d.source, r.d.dest) in on

    def feed(self, dest: Topic) -> list[Router]:
        """The routers into `dest` (one source), in name order."""
        return self.by_dest.get(dest, [])

    def interested(self, topic: Topic) -> bool:
        """Whether the scheduler has router work for `topic` (a source or a dest)."""
        return topic in self.by_source or topic in self.by_dest

    def feeds_out(self, topic: Topic) -> bool:
        """Whether routers copy out of `topic` (its drain forwards them)."""
        return topic in self.by_source

    def touching(self, topic: Topic) -> list[str]:
        """Names of the routers whose source or dest is `topic`, sorted."""
        names = {r.d.name for d in self.by_source.get(topic, ()) for r in self.by_dest[d]}
        names |= {r.d.name for r in self.by_dest.get(topic, ())}
        return sorted(names)

    def topic_deleted(self, topic: Topic) -> list[str]:
        """Cascade: drop every router of `topic` (live apply and replay)."""
        names = self.touching(topic)
        for name in names:
            self._detach(self.routers[name])
        self._release_gate(topic)
        if self.engine.replaying:
            for rr in list(self.replay.values()):
                if topic.topic_id in (rr.src_id, rr.dst_id):
                    del self.replay[rr.d.name]
                    if rr.src_id == topic.topic_id:
                        rr.final = rr.cursor  # its copies cannot be re-derived any more
                        self.retired.append(rr)
        return names

    def endpoints(self) -> dict[str, tuple[str, str]]:
        """(source, dest) of every router of the deployment, by name (a backend whose
        routers run on several processes knows the others' too)."""
        return {name: (r.d.source, r.d.dest) for name, r in self.routers.items()}

    async def lookup(self, name: str) -> Router:
        """`get` for a read (`GET /v0/routers/:r`): on a backend whose routers run on
        several processes, a router run elsewhere comes back with its runner's state."""
        await trio.lowlevel.checkpoint()
        return self.get(name)

    async def definition(self, name: str) -> RouterDef | None:
        """The definition of router `name`, wherever it runs (None: there is none)."""
        await trio.lowlevel.checkpoint()
        r = self.routers.get(name)
        return None if r is None else r.d

    async def sync_listing(self) -> None:
        """Before `page`: learn the routers run elsewhere (nothing here)."""
        await trio.lowlevel.checkpoint()

    def listed(self) -> dict[str, Router]:
        """The routers `page` lists, by name."""
        return self.routers

    async def touching_all(self, topic: Topic) -> list[str]:
        """`touching`, counting the routers run elsewhere (a topic delete's cascade)."""
        await trio.lowlevel.checkpoint()
        return self.touching(topic)

    async def deleted_with(self, topic: Topic, names: list[str]) -> None:
        """After `topic`'s delete: the routers of `names` were removed with it (a backend
        keeping their definitions apart, or running some elsewhere, forgets them)."""
        await trio.lowlevel.checkpoint()

    @property
    def syncs_sources(self) -> bool:
        """Whether some feed's source is written by another process (`sync_sources`)."""
        return False

    async def sync_sources(self, dest: Topic) -> None:
        """Before a read of `dest`: bring the sources of its feed up to date when another
        process writes them (nothing here: every source is this process's)."""
        await trio.lowlevel.checkpoint()

    def _path(self, start: str, goal: str, skip: str | None) -> list[str] | None:
        """A topic path `start .. goal` over existing routers (BFS), or None."""
        edges: dict[str, list[str]] = {}
        for name, (source, dest) in self.endpoints().items():
            if name != skip:
                edges.setdefault(source, []).append(dest)
        parent: dict[str, str | None] = {start: None}
        queue = [start]
        for here in queue:
            if here == goal:
                path = [here]
                while (prev := parent[path[-1]]) is not None:
                    path.append(prev)
                return path[::-1]
            for nxt in sorted(edges.get(here, ())):
                if nxt not in parent:
                    parent[nxt] = here
                    queue.append(nxt)
        return None

    # ---- PUT / DELETE -------------------------------------------------------------------

    @asynccontextmanager
    async def _exclusive(self, name: str) -> AsyncIterator[None]:
        """PUT and DELETE of one router name, one at a time (a fair lock per name, kept
        only while someone holds or waits for it)."""
        entry = self._names.get(name)
        if entry is None:
            entry = self._names[name] = _NameLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if not entry.users:
                del self._names[name]

    async def put(self, name: str, req: RouterIn) -> tuple[Router, bool]:
        """Create or configure a router (checks in the API's order). Returns (router,
        created). The caller has checked scopes and prefixes."""
        d = self.definition_of(name, req)
        async with self._exclusive(name):
            return await self._put(d, req.create_dest)

    def definition_of(self, name: str, req: RouterIn) -> RouterDef:
        """The checks of a `PUT` that need no state (in the API's order), and the
        definition it asks for."""
        from topicd.engine.engine import parse_match

        check_router_name(name)
        check_topic_name(req.source, "source")
        check_topic_name(req.dest, "dest")
        if req.source == req.dest:
            raise InvalidRequest("source and dest must differ", {"dest": req.dest})
        filt = parse_match(req.filter)
        d = RouterDef(
            name,
            req.source,
            req.dest,
            req.preserve_node,
            req.preserve_tag,
            filt,
            req.allow_cycle,
            req.guarantee,
        )
        return d

    async def _put(self, d: RouterDef, create_dest: bool) -> tuple[Router, bool]:
        engine = self.engine
        name = d.name
        existing = self.routers.get(name)
        if d.dest not in engine.topics and not create_dest:
            raise TopicNotFound(d.dest)
        dest_topic = engine.topics.get(d.dest)
        if dest_topic is not None:
            for other in self.by_dest.get(dest_topic, ()):
                if other.d.source != d.source:
                    raise TopicExistsIncompatible(
                        f"topic {d.dest!r} is already the destination of router "
                        f"{other.d.name!r} from another source ({other.d.source!r})",
                        {"topic": d.dest, "reason": "router_dest_fan_in"},
                    )
        ends = self.endpoints()
        have = ends.get(name)
        if have is not None and have != (d.source, d.dest):
            raise TopicExistsIncompatible(
                f"router {name!r} exists with another source or dest; delete and recreate it "
                "to re-point",
                {
                    "router": name,
                    "reason": "router_repoint_forbidden",
                    "existing_source": have[0],
                    "existing_dest": have[1],
                },
            )
        cap = engine.cfg.limits.max_routers
        if have is None and cap and len(ends) >= cap:
            raise Throttled.limit("max_routers", cap)
        if not d.allow_cycle:
            path = self._path(d.dest, d.source, name)
            if path is not None:
                cycle = [d.source, *path]
                raise RouterCycle(
                    f"router {name!r} would close the cycle {' -> '.join(cycle)}",
                    {"cycle": list(cycle)},
                )
        if existing is not None and existing.d == d:
            await trio.lowlevel.checkpoint()
            return existing, False
        src = await self._ensure(d.source)
        dst = await self._ensure(d.dest)
        if src.deleted or dst.deleted:
            raise TopicNotFound(d.source if src.deleted else d.dest)
        engine.check_open()
        body = d.to_frame()
        body["dest_id"] = dst.topic_id
        body["src_base"] = src.head_seq
        body["dest_base"] = dst.head_seq
        frame = frames.encode_control(
            frames.ROUTER_CREATE, src.topic_id, engine.clock.now_ms(), body
        )
        r = await engine.commit.control(src, frame, lambda: self.apply_create(d, src, dst))
        return r, existing is None

    async def _ensure(self, name: str) -> Topic:
        """The live topic `name`, auto-created with defaults when absent."""
        engine = self.engine
        while True:
            topic = engine.topics.get(name)
            if topic is not None and topic.deleting is None:
                return topic
            if topic is not None and topic.deleting is not None:
                await topic.deleting.wait()
                continue
            created = await engine.create_default(name)
            if created is not None:
                return created

    def apply_create(self, d: RouterDef, src: Topic, dst: Topic) -> Router:
        """A committed RouterCreate: a new router at the source head, or a new config."""
        existing = self.routers.get(d.name)
        if existing is not None:
            existing.d = d
            self._recycle()
            return existing
        r = Router(d, src, dst, src.head_seq, dst.head_seq, src.head_seq)
        r.logged = r.cursor
        self._attach(r)
        return r

    async def delete(self, name: str) -> bool:
        """Delete a router (durably logged); False if there was none."""
        check_router_name(name)
        async with self._exclusive(name):
            return await self._delete(name)

    async def _delete(self, name: str) -> bool:
        engine = self.engine
        r = self.routers.get(name)
        if r is None:
            await trio.lowlevel.checkpoint()
            return False
        engine.check_open()
        frame = frames.encode_control(
            frames.ROUTER_DELETE, r.src.topic_id, engine.clock.now_ms(), r.anchor()
        )

        def apply() -> bool:
            if self.routers.get(name) is not r:
                return False
            self._detach(r)
            return True

        return await engine.commit.control(r.src, frame, apply)

    # ---- listing ----------------------------------------------------------------------

    def page(
        self,
        prefix: str,
        source: str | None,
        dest: str | None,
        after: str | None,
        page_size: int,
        allowed: object = None,
    ) -> tuple[list[Router], str | None]:
        listed = self.listed()
        names = sorted(listed)
        i = bisect.bisect_right(names, after) if after is not None else 0
        out: list[Router] = []
        while i < len(names):
            r = listed[names[i]]
            i += 1
            if not r.d.name.startswith(prefix):
                continue
            if (source is not None and r.d.source != source) or (
                dest is not None and r.d.dest != dest
            ):
                continue
            if callable(allowed) and not all(allowed(n) for n in (r.d.name, r.d.source, r.d.dest)):
                continue
            if len(out) == page_size:
                return out, out[-1].d.name
            out.append(r)
        return out, None

    # ---- scheduling -----------------------------------------------------------------------

    async def drain_source(self, topic: Topic, budget: Budget, defer: bool) -> bool:
        """The router part of `topic`'s drain, in its band: forward every feed out of it.
        Yields at the delivery quantum between feeds. Under `defer` no copy is made here:
        each destination is enqueued one band lower and copies in its own drain. Returns
        whether a feed has more than one batch left (the source is requeued)."""
        dests = self.by_source.get(topic)
        if not dests:
            return False
        more = False
        engine = self.engine
        sched = engine.sched
        now = engine.clock.now_ms()
        engine._enforce(topic, now)  # once for every feed out of it
        for dst in list(dests):
            if defer:
                if self.feed_lag(dst):
                    sched.mark_dirty(dst, demote=True)
                continue
            self.forward(dst, self.cfg.batch, now)
            if not self._stuck(dst) and self.feed_lag(dst):
                more = True
            if budget.due():
                await budget.pause()
        return more

    def drain_dest(self, topic: Topic) -> bool:
        """A drain (watch pass) of a destination first forwards its feed, one batch.
        Returns whether more is left (the destination is requeued)."""
        if topic not in self.by_dest:
            return False
        self.forward(topic, self.cfg.batch)
        return not self._stuck(topic) and self.feed_lag(topic) > 0

    def feed_lag(self, dest: Topic) -> int:
        """Source seqs the slowest router of `dest`'s feed has still to handle."""
        feed = self.by_dest.get(dest)
        if not feed:
            return 0
        return max(r.lag for r in feed)

    def _stuck(self, dest: Topic) -> bool:
        """Held by an in-flight direct write, refused room, or stopped at evicted source
        records (the sweep loads them): retried later, not now."""
        feed = self.by_dest.get(dest)
        return (
            dest in self.held
            or dest in self.wants
            or (feed is not None and any(r.blocked for r in feed))
        )

    # ---- the direct-write gate ------------------------------------------------------------

    def gate(self, dest: Topic) -> trio.Event | None:
        """What a direct write to `dest` waits on before taking seqs (None: nothing)."""
        return self.held.get(dest)

    def release(self, dest: Topic) -> None:
        """`dest` has no write in flight any more (a publish or a rewind): place the held
        copies now, synchronously, and open the gate."""
        if dest not in self.held or dest.next_seq != dest.head_seq + 1:
            return
        for _ in range(_CATCH_UP_PASSES):
            if not self.forward(dest, self.cfg.batch):
                break
        self._release_gate(dest)

    def _release_gate(self, dest: Topic) -> None:
        ev = self.held.pop(dest, None)
        if ev is not None:
            ev.set()

    # ---- forwarding ---------------------------------------------------------------------

    def forward(self, dst: Topic, limit: int, now: int | None = None) -> int:
        """Handle up to `limit` source seqs of `dst`'s feed, in lockstep (source seq, then
        router name); returns how many source seqs moved. Synchronous: the copies are
        published in one step. `now`: the caller read the clock and applied the source's
        TTL and caps at that instant (a source drain does it once for all its feeds)."""
        feed = self.by_dest.get(dst)
        if not feed:
            return 0
        src = feed[0].src
        if src.deleted or dst.deleted:
            return 0
        if len(feed) == 1:
            starts = [feed[0].cursor]
            lo = starts[0]
        else:
            starts = [r.cursor for r in feed]
            lo = min(starts)
        end = min(src.head_seq, lo + limit)
        if end <= lo:
            return 0
        if dst.next_seq != dst.head_seq + 1:
            # a direct write to dest is in flight: hold the feed; the next direct writes
            # wait at the gate until `release` places the copies
            if dst not in self.held:
                self.held[dst] = trio.Event()
            return 0
        engine = self.engine
        if now is None:
            now = engine.clock.now_ms()
            engine._enforce(src, now)
        ts = dst.stamp(now)
        slots: list[DerivedSlot] = []
        trims: list[int] = []
        copies = [0] * len(feed)
        blocked = False
        if len(feed) == 1 and not self._limited(dst):
            done = self._derive_run(feed[0], lo, end, dst.head_seq, ts, slots, trims, copies)
        else:
            done, blocked = self._derive_lockstep(
                feed, starts, lo, end, dst, ts, slots, trims, copies
            )
        for r in feed:
            r.blocked = blocked
        if dst in self.held and (blocked or done >= src.head_seq):
            self._release_gate(dst)  # the held copies are placed: direct writes go on
        if done == lo:
            return 0
        self._place(dst, feed, starts, done, ts, slots, trims, copies, blocked, now)
        return done - lo

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
        """Publish a forward's slots at `dst.head_seq + 1 ..` and move the feed's cursors
        from `starts` to `done` (the whole publication of derived copies here; a backend
        that stores copies overrides it to publish once they are stored)."""
        engine = self.engine
        src = feed[0].src
        if slots:
            engine.total_bytes += dst.publish_derived(ts, slots)
            if not engine.replaying:
                engine.records_appended += len(slots)
        if trims:
            for lo_t, hi_t in _ranges(trims):
                dst.add_trim(lo_t, hi_t)
            self.stats.trimmed += len(trims)
        total = sum(copies)
        if total:
            dst.last_write_ts = ts
        for i, r in enumerate(feed):
            if starts[i] < done:
                r.forwarded_total += done - starts[i]
                r.cursor = done
                r.copies_total += copies[i]
        self.stats.copies += total
        self.stats.passes += 1
        if slots:
            engine._enforce(dst, now)
            engine.sched.mark_copied(dst, more=not blocked and done < src.head_seq)
            dst.wake()

    def _limited(self, dst: Topic) -> bool:
        """Whether copies into `dst` must check for room (a `reject` cap or the quota)."""
        cfg = dst.config
        if cfg.discard == "reject" and (cfg.cap_records or cfg.cap_bytes):
            return True
        return bool(self.engine.cfg.limits.max_total_bytes)

    def _derive_run(
        self,
        r: Router,
        lo: int,
        end: int,
        seq: int,
        ts: int,
        slots: list[DerivedSlot],
        trims: list[int],
        copies: list[int],
    ) -> int:
        """The single-router feed with no room to check: every source seq `lo+1 .. end`
        becomes its slot (the common case, kept free of the lockstep bookkeeping), up to
        the first whose bytes are only in its segment (the sweep loads those). Returns
        the last source seq handled."""
        derive = self._derive
        cyclic = r.cyclic
        src = r.src
        evicted_to = src.absorbed_to
        n = 0
        done = lo
        for s in range(lo + 1, end + 1):
            if s <= evicted_to and src.enc(s) is EVICTED:
                self.wants[r.dst] = s  # the sweep loads it, then forwards on
                break
            done = s
            if cyclic and self._skips(r, s):
                continue
            seq += 1
            slot = derive(r, s, seq, ts)
            if slot is TRIM:
                trims.append(seq)
                slot = HOLE
            elif slot.enc is not None:
                n += 1
            slots.append(slot)
        copies[0] = n
        return done

    def _derive_lockstep(
        self,
        feed: list[Router],
        starts: list[int],
        lo: int,
        end: int,
        dst: Topic,
        ts: int,
        slots: list[DerivedSlot],
        trims: list[int],
        copies: list[int],
    ) -> tuple[int, bool]:
        """Several routers of one source into `dst` (or room to check): source seq by
        source seq, each router's slot in name order, stopping where room runs out.
        Returns (the last source seq every router has handled, whether room ran out)."""
        engine = self.engine
        cfg = dst.config
        room_records = room_bytes = -1
        if cfg.discard == "reject":
            if cfg.cap_records:
                room_records = cfg.cap_records - dst.count - dst.pending_records
            if cfg.cap_bytes:
                room_bytes = cfg.cap_bytes - dst.bytes - dst.pending_bytes
        quota = engine.cfg.limits.max_total_bytes
        room_total = quota - engine.total_bytes - engine.pending_bytes if quota else -1
        seq = dst.head_seq
        done = lo  # every router has handled every source seq <= max(start, done)
        src = feed[0].src
        evicted_to = src.absorbed_to
        for s in range(lo + 1, end + 1):
            if s <= evicted_to and src.enc(s) is EVICTED:
                self.wants[dst] = s  # the sweep loads it, then forwards on
                break
            step: list[tuple[int, DerivedSlot]] = []
            need_records = need_bytes = 0
            for i, r in enumerate(feed):
                if starts[i] < s and not self._skips(r, s):
                    slot = self._derive(r, s, seq + 1 + len(step), ts)
                    step.append((i, slot))
                    if slot.enc is not None:
                        need_records += 1
                        need_bytes += slot.size
            if need_records and (
                0 <= room_records < need_records
                or 0 <= room_bytes < need_bytes
                or 0 <= room_total < need_bytes
            ):
                self.stats.blocked += 1
                return done, True  # backpressure: the cursors wait, nothing is dropped
            if room_records > 0:
                room_records -= need_records
            if room_bytes >= 0:
                room_bytes -= need_bytes
            if room_total >= 0:
                room_total -= need_bytes
            for i, slot in step:
                seq += 1
                if slot is TRIM:
                    trims.append(seq)
                    slot = HOLE
                elif slot.enc is not None:
                    copies[i] += 1
                slots.append(slot)
            done = s
        return done, False

    def _skips(self, r: Router, s: int) -> bool:
        """A router on a cycle passes over, *without* taking a destination seq, every
        source seq that would only be a hole there (nothing readable, filtered out, at
        the hop cap): holes must not travel round a cycle, or forwarding would never
        end. Its copies and `source_trim` gaps take seqs as everywhere else."""
        if not r.cyclic:
            return False
        src = r.src
        if src.enc(s) is None:
            return not (s < src.evict_floor or any(lo <= s <= hi for lo, hi in src.lost_ranges))
        if not r.d.matches(src.tags.get(s) if src.tags else None):
            return True
        return (src.hops.get(s, 0) if src.hops else 0) + 1 > self.cfg.max_hops

    def _derive(self, r: Router, s: int, seq: int, ts: int) -> DerivedSlot:
        """What source seq `s` becomes at destination seq `seq` (a copy, hole or trim)."""
        src = r.src
        enc = src.enc(s)
        assert enc is not EVICTED, s  # `forward` loads evicted source records first
        if enc is None:
            evicted = s < src.evict_floor or any(lo <= s <= hi for lo, hi in src.lost_ranges)
            return TRIM if evicted else HOLE
        d = r.d
        tag = src.tags.get(s) if src.tags else None
        if d.filter is not None and not d.matches(tag):
            return HOLE
        hop = 0
        if r.cyclic:
            hop = (src.hops.get(s, 0) if src.hops else 0) + 1
            if hop > self.cfg.max_hops:
                return HOLE  # the hop cap: a looping record is not forwarded again
        node = src.nodes.get(s) if src.nodes else None
        shape = src.shapes.get(s) if src.shapes else None
        size = src.size(s)
        if d.guarantee == "exactly_once":
            enc, shape, size = mark_meta(
                enc, shape, size, self._marker(r, s), self.engine.cfg.protocol.max_meta_keys
            )
        if node is None and shape is None:
            m = _HEAD.match(enc)
            assert m is not None
            copy = b'{"$seq":%d,"$ts":%d' % (seq, ts) + enc[m.end() :]
        else:
            copy, shape = rewrite(enc, shape, node, d.preserve_node, seq, ts)
        return DerivedSlot(
            copy,
            size,
            tag if d.preserve_tag else None,
            node if d.preserve_node else None,
            src.prios.get(s, 0) if src.prios else 0,
            shape,
            hop,
        )

    @staticmethod
    def _marker(r: Router, s: int) -> dict[str, JsonValue]:
        src_id = r.src.topic_id
        return {
            "idempotency_key": f"router:{r.d.name}:{src_id}:{SOURCE_EPOCH}:{s}",
            "router": r.d.name,
            "source_topic": r.d.source,
            "source_topic_id": src_id,
            "source_epoch": SOURCE_EPOCH,
            "source_seq": s,
        }

    async def settle(self, dest: Topic) -> None:
        """Read-path catch-up for a backend whose copies are published once stored
        (`in_flight` counts them): until the copies the catch-up made are visible. Here
        copies are visible at once, and feeds stopped at evicted source records are
        left to the sweep, as before."""
        await trio.lowlevel.checkpoint()

    def catch_up(self, dest: Topic, depth: int = 0) -> None:
        """Read-path catch-up: drain the feed of `dest` (its source's feeds first)."""
        feed = self.by_dest.get(dest)
        if not feed:
            return
        if depth < self.cfg.max_hops:
            self.catch_up(feed[0].src, depth + 1)
        for _ in range(_CATCH_UP_PASSES):
            if not self.forward(dest, self.cfg.batch):
                break

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The sweep: every `routers.tick_ms` forward what the drains left (a feed held
        back by a full destination retries here, a gate whose writes all settled opens);
        every `routers.cursor_log_ms` log the cursors that moved (`RouterCursor`, not
        sync-gated)."""
        tick = self.cfg.tick_ms / 1000
        log_every = self.cfg.cursor_log_ms / 1000
        next_log = trio.current_time() + log_every
        task_status.started()
        while True:
            await trio.sleep(tick)
            for dst in list(self.held):
                self.release(dst)
            if self.wants:
                await self._load_wanted()
            for dst in list(self.by_dest):
                if self.feed_lag(dst):
                    self.forward(dst, self.cfg.batch)
                    await trio.lowlevel.checkpoint()
            if trio.current_time() >= next_log:
                next_log = trio.current_time() + log_every
                await self.log_cursors()

    async def _load_wanted(self) -> None:
        """Forward the feeds that stopped at evicted source records: load a batch of
        them from the segments (offloaded), then forward while they are held."""
        cache = self.engine.payloads
        for dst in list(self.wants):
            for _ in range(_LOAD_PASSES):  # (then the next tick goes on)
                s = self.wants.pop(dst, None)
                feed = self.by_dest.get(dst)
                if s is None or not feed or feed[0].src.deleted or dst.deleted:
                    break
                with cache.hold() as hold:
                    try:
                        await cache.load(feed[0].src, s, self.cfg.batch, LOAD_BYTES_MAX, hold)
                    except TopicdError as exc:  # corrupt or unreadable: counted, retried
                        log.error("router feed of %r: %s", dst.name, exc)
                        break
                    self.forward(dst, self.cfg.batch)

    async def log_cursors(self, *, sync: bool = False) -> None:
        """Write a `RouterCursor` anchor for every router whose cursor moved (`sync`:
        every router, synced — after recovery).

        Raises `StorageUnavailable` only with `sync`; the sweep's call stops at a shard
        that cannot log and leaves the rest for a later sweep (an anchor only shortens
        re-derivation at recovery, so a late one loses nothing, and the sweep task must
        outlive a storage failure)."""
        engine = self.engine
        for name in sorted(self.routers):
            r = self.routers.get(name)
            if r is None or (r.logged == r.cursor and not sync):
                continue
            if r.src.config.durability == "ephemeral" and not sync:
                continue
            frame = frames.encode_control(
                frames.ROUTER_CURSOR, r.src.topic_id, engine.clock.now_ms(), r.anchor()
            )
            cursor = r.cursor
            try:
                await engine.commit.control(r.src, frame, lambda: None, sync=sync)
            except TopicNotFound:
                continue
            except StorageUnavailable:
                if sync:
                    raise
                return  # (the breaker logged why; the next sweep retries)
            r.logged = cursor

    # ---- replay (recovery) ----------------------------------------------------------------

    def replay_create(self, src: Topic, body: dict[str, object]) -> None:
        d = RouterDef.from_frame(body)
        rr = self.replay.get(d.name)
        if rr is not None:
            rr.d = d
            return
        dest_id, dest_base = body["dest_id"], body["dest_base"]
        if not isinstance(dest_id, int) or not isinstance(dest_base, int):
            raise frames.FrameError("bad RouterCreate")
        # the logged base, not the replayed head: the source's own derived records (it
        # may be a router destination itself) are not replayed yet
        base = body.get("src_base", src.head_seq)
        if not isinstance(base, int):
            raise frames.FrameError("bad RouterCreate")
        self.replay[d.name] = ReplayRouter(
            d, src.topic_id, dest_id, base, dest_base, base, dest_base, 0
        )

    def replay_cursor(self, body: dict[str, object], *, delete: bool) -> None:
        name = str(body["router"])
        rr = self.replay.get(name)
        if rr is None:
            return
        cursor, floor, total = body["cursor"], body["floor"], body.get("forwarded_total", 0)
        if not isinstance(cursor, int) or not isinstance(floor, int):
            raise frames.FrameError("bad RouterCursor")
        rr.anchors.append((cursor, floor))
        if isinstance(total, int):
            rr.forwarded_total = max(rr.forwarded_total, total)
        if delete:
            del self.replay[name]
            rr.final = cursor
            self.retired.append(rr)

    def load(self, snaps: list[dict[str, object]]) -> None:
        """Routers from a snapshot (the replay continues from their anchors)."""
        for body in snaps:
            d = RouterDef.from_frame(body)
            ints = [body[k] for k in ("src_id", "dest_id", "src_base", "dest_base", "cursor")]
            floor, total = body["floor"], body["forwarded_total"]
            if not all(isinstance(v, int) for v in [*ints, floor, total]):
                raise frames.FrameError("bad router in snapshot")
            src_id, dst_id, src_base, dest_base, cursor = (int(v) for v in ints)  # type: ignore[call-overload]
            assert isinstance(floor, int)
            assert isinstance(total, int)
            self.replay[d.name] = ReplayRouter(
                d, src_id, dst_id, src_base, dest_base, cursor, floor, total
            )

    def export(self) -> list[dict[str, object]]:
        """Every router for a snapshot (taken in the same step as the topics)."""
        out: list[dict[str, object]] = []
        for name in sorted(self.routers):
            r = self.routers[name]
            body: dict[str, object] = dict(r.d.to_frame())
            body |= {
                "src_id": r.src.topic_id,
                "dest_id": r.dst.topic_id,
                "src_base": r.src_base,
                "dest_base": r.dest_base,
                "cursor": r.cursor,
                "floor": r.dst.head_seq,
                "forwarded_total": r.forwarded_total,
            }
            out.append(body)
        return out

    def rederive(
        self,
        snap_heads: dict[int, int],
        direct: dict[int, list[tuple[int, int]]],
        now_ms: int,
    ) -> set[int]:
        """Recovery, after every shard replayed: re-materialize the copies made since each
        feed's snapshot anchor and register the live routers. `snap_heads`: each topic's
        head as the snapshot left it; `direct`: the seq ranges of replayed direct writes.
        Returns the ids of every topic that is or was a router destination."""
        engine = self.engine
        by_id = engine.by_id
        work = [*self.retired, *self.replay.values()]
        dests = {rr.dst_id for rr in work}
        feeds: dict[tuple[int, int], list[ReplayRouter]] = {}
        live: list[ReplayRouter] = []
        for rr in work:
            src, dst = by_id.get(rr.src_id), by_id.get(rr.dst_id)
            if src is None or dst is None:
                continue  # an endpoint was deleted: the router went with it
            feeds.setdefault((rr.src_id, rr.dst_id), []).append(rr)
            if rr.final is None:
                live.append(rr)
        cyclic = cyclic_edges([(rr.d.source, rr.d.dest) for rr in live])

        # rounds until nothing moves: chains settle in order, cycles stop at the hop cap
        # upstream first: a feed waits while a feed into its source still has work (its
        # source's head may lie above seqs that are still to be re-derived); in a cycle
        # nothing is ready and every pending feed runs (best effort, as live)
        def pending(key: tuple[int, int]) -> bool:
            src = by_id[key[0]]
            return any(
                rr.cursor < (src.head_seq if rr.final is None else min(rr.final, src.head_seq))
                for rr in feeds[key]
            )

        progress = True
        rounds = 0
        while progress and rounds <= (len(work) + 1) * (self.cfg.max_hops + 1):
            progress = False
            rounds += 1
            todo = [key for key in sorted(feeds) if pending(key)]
            ready = [k for k in todo if not any(o[1] == k[0] for o in todo if o != k)]
            for key in ready or todo:
                if self._rederive_feed(feeds[key], cyclic, snap_heads, direct, now_ms):
                    progress = True
        for rr in live:
            src = by_id[rr.src_id]
            if rr.cursor > src.head_seq:
                # the source is itself a destination whose re-derivation placed fewer
                # seqs than it held before the crash (a router turned cyclic later: its
                # older holes are now passed over), yet this router had handled seqs up
                # to its cursor. Seqs are never reused: the head moves up to the cursor,
                # and the range is announced as possibly lost (`source_trim`)
                lo = src.head_seq + 1
                src.skip_to(rr.cursor)
                src.add_trim(lo, rr.cursor)
        for rr in live:
            src, dst = by_id[rr.src_id], by_id[rr.dst_id]
            r = Router(rr.d, src, dst, rr.src_base, rr.dest_base, rr.cursor, rr.forwarded_total)
            self._attach(r)
        self.replay = {}
        self.retired = []
        return dests

    def _rederive_feed(
        self,
        feed: list[ReplayRouter],
        cyclic: set[tuple[str, str]],
        snap_heads: dict[int, int],
        direct: dict[int, list[tuple[int, int]]],
        now_ms: int,
    ) -> bool:
        """Place one feed's slots past its anchors, in lockstep order (source seq, then
        router name), into the destination seqs no snapshot record or replayed direct
        write holds. Returns whether anything moved."""
        by_id = self.engine.by_id
        src, dst = by_id[feed[0].src_id], by_id[feed[0].dst_id]
        limits = [src.head_seq if rr.final is None else min(rr.final, src.head_seq) for rr in feed]
        if all(rr.cursor >= limit for rr, limit in zip(feed, limits, strict=True)):
            return False
        if "ephemeral" in (src.config.durability, dst.config.durability):
            # an ephemeral end keeps no records: nothing to re-derive (copies made before
            # the crash are gone by design); the routers resume at the source head
            for rr, limit in zip(feed, limits, strict=True):
                rr.cursor = max(rr.cursor, limit)
            return False
        order = sorted(range(len(feed)), key=lambda i: feed[i].d.name)  # stable: eras
        starts = [rr.cursor for rr in feed]
        anchors = sorted(
            [(rr.cursor, rr.floor) for rr in feed] + [a for rr in feed for a in rr.anchors]
        )
        snap_head = snap_heads.get(feed[0].dst_id, 0)
        ranges = direct.get(feed[0].dst_id, [])
        ai = ri = pos = 0
        placed: dict[int, tuple[int, DerivedSlot]] = {}
        trims: list[int] = []
        fakes = [
            Router(
                rr.d,
                src,
                dst,
                rr.src_base,
                rr.dest_base,
                rr.cursor,
                cyclic=(rr.d.source, rr.d.dest) in cyclic,
            )
            for rr in feed
        ]
        for s in range(min(starts) + 1, max(limits) + 1):
            while ai < len(anchors) and anchors[ai][0] < s:
                pos = max(pos, anchors[ai][1])
                ai += 1
            src_ts = src.ts_at(s) if src.enc(s) is not None else now_ms
            for i in order:
                if not starts[i] < s <= limits[i]:
                    continue
                rr = feed[i]
                if self._skips(fakes[i], s):
                    rr.cursor = s
                    rr.forwarded_total += 1
                    continue
                pos += 1
                while True:  # skip the seqs the snapshot or a replayed direct write holds
                    if pos <= snap_head:
                        pos = snap_head + 1
                        continue
                    while ri < len(ranges) and ranges[ri][1] < pos:
                        ri += 1
                    if ri < len(ranges) and ranges[ri][0] <= pos:
                        pos = ranges[ri][1] + 1
                        continue
                    break
                slot = self._derive(fakes[i], s, pos, src_ts)
                rr.cursor = s
                rr.forwarded_total += 1
                if slot is TRIM:
                    trims.append(pos)
                    slot = HOLE
                if pos >= dst.evict_floor:
                    placed[pos] = (src_ts, slot)
        for rr in feed:
            rr.floor = max(rr.floor, pos)
            rr.anchors = [a for a in rr.anchors if a[0] >= rr.cursor]
        if placed:
            self.engine.total_bytes += dst.insert_derived(placed)
        for lo_t, hi_t in _ranges(trims):
            dst.add_trim(lo_t, hi_t)
        return True

    def stragglers(self, dests: set[int], gaps: list[tuple[int, int, int]]) -> None:
        """Recovery: a gap in a router destination that no re-derived copy filled (its
        source is gone) is announced as `source_trim`, never left silent."""
        by_id = self.engine.by_id
        for tid, lo, hi in gaps:
            dst = by_id.get(tid)
            if dst is None or tid not in dests:
                continue
            missing = [s for s in range(lo, hi + 1) if dst._run(s) is None]
            for s in missing:
                dst.add_trim(s, s)
