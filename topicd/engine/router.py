"""Routers: server-side copying of every record committed to a source topic into a dest.

A router is a definition plus a cursor (the last source seq it has *handled*). Forwarding
is asynchronous and off the write path; three things drive it, all through `forward()`:

* the delivery scheduler's drain of the source (`Topic.on_drain`, one hook per source);
* a sweep every `routers.tick_ms` (`RouterService.run`), which also retries routers
  held back by a full destination;
* read-path catch-up: a diff, long-poll or watch of a destination first drains the
  routers feeding it (and theirs, upstream), so a read right after a source write sees
  the copy.

**Seq mapping.** Every handled source seq consumes exactly one destination seq, in source
order: a copy, a *hole* (filtered out, deleted at the source, or at the hop cap: nothing
readable, silently skipped) or a *trim* (the source evicted the record before it was
copied: a `source_trim` tombstone). A copy always takes `dest head + 1` at forward time,
and a direct write to the destination takes the next seq too, so copies and direct
writes interleave in arrival order. Copies wait while a direct write to the destination
is in flight, so a copy never sits above an unpublished direct write.

**Derived, not logged.** Copies never go through the WAL. Recovery re-derives them: from
the router's last anchor (`RouterCreate`'s base, a `RouterCursor` frame or the
snapshot: "source seq `cursor` handled, every later copy lies above `floor`"), each next
source seq takes the next destination seq above the floor that no replayed direct write
holds. That reproduces the live placement exactly, because a gap between two replayed
direct writes can only have been filled by copies, in source order. Snapshots hold the
destination's records (copies included), so only copies made since the last snapshot
are re-derived; one whose source record is gone by then becomes a `source_trim` gap.

One destination is fed by one router (a second router into a topic that already is a
router destination is refused with `router_dest_fan_in`), which keeps the mapping a
function of that router alone.
"""

from __future__ import annotations

import bisect
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import orjson
import trio
import trio.lowlevel

from topicd.engine.topic import HOLE, DerivedSlot
from topicd.errors import (
    InvalidRequest,
    JsonValue,
    RouterCycle,
    RouterNotFound,
    Throttled,
    TopicExistsIncompatible,
    TopicNotFound,
)
from topicd.storage import frame as frames
from topicd.wire import check_router_name, check_topic_name

if TYPE_CHECKING:
    from topicd.engine.engine import Engine
    from topicd.engine.topic import Topic
    from topicd.model import Shape
    from topicd.wire import RouterIn

log = logging.getLogger("topicd.routers")

_HEAD: Final = re.compile(rb'\{"\$seq":\d+,"\$ts":\d+')
TRIM: Final = DerivedSlot(None, size=-1)  # marker: the source lost the record first
_CATCH_UP_PASSES: Final = 64  # read-path catch-up: batches per router before giving up


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


class RouterService:
    """The router registry and forwarder of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg.routers
        self.routers: dict[str, Router] = {}
        self.by_source: dict[Topic, list[Router]] = {}
        self.by_dest: dict[Topic, list[Router]] = {}
        self.stats = RouterStats()
        self._busy: set[str] = set()  # names with a PUT/DELETE being committed
        # recovery only: routers as the log tells them, resolved in `rederive`
        self.replay: dict[str, ReplayRouter] = {}
        self.retired: list[ReplayRouter] = []

    # ---- registry -----------------------------------------------------------------------

    def get(self, name: str) -> Router:
        r = self.routers.get(name)
        if r is None:
            check_router_name(name)
            raise RouterNotFound(f"router {name!r} does not exist", {"router": name})
        return r

    def _attach(self, r: Router) -> None:
        self.routers[r.d.name] = r
        srcs = self.by_source.setdefault(r.src, [])
        if not srcs:
            r.src.on_drain.append(self._on_drain)
        srcs.append(r)
        self.by_dest.setdefault(r.dst, []).append(r)

    def _detach(self, r: Router) -> None:
        del self.routers[r.d.name]
        srcs = self.by_source[r.src]
        srcs.remove(r)
        if not srcs:
            del self.by_source[r.src]
            if self._on_drain in r.src.on_drain:
                r.src.on_drain.remove(self._on_drain)
        dsts = self.by_dest[r.dst]
        dsts.remove(r)
        if not dsts:
            del self.by_dest[r.dst]

    def touching(self, topic: Topic) -> list[str]:
        """Names of the routers whose source or dest is `topic`, sorted."""
        names = {r.d.name for r in self.by_source.get(topic, ())}
        names |= {r.d.name for r in self.by_dest.get(topic, ())}
        return sorted(names)

    def topic_deleted(self, topic: Topic) -> list[str]:
        """Cascade: drop every router of `topic` (live apply and replay)."""
        names = self.touching(topic)
        for name in names:
            self._detach(self.routers[name])
        if self.engine.replaying:
            for rr in list(self.replay.values()):
                if topic.topic_id in (rr.src_id, rr.dst_id):
                    del self.replay[rr.d.name]
                    if rr.src_id == topic.topic_id:
                        rr.final = rr.cursor  # its copies cannot be re-derived any more
                        self.retired.append(rr)
        return names

    def _path(self, start: str, goal: str, skip: str | None) -> list[str] | None:
        """A topic path `start .. goal` over existing routers (BFS), or None."""
        edges: dict[str, list[str]] = {}
        for r in self.routers.values():
            if r.d.name != skip:
                edges.setdefault(r.d.source, []).append(r.d.dest)
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

    async def put(self, name: str, req: RouterIn) -> tuple[Router, bool]:
        """Create or configure a router (checks in the API's order). Returns (router,
        created). The caller has checked scopes and prefixes."""
        from topicd.engine.engine import parse_match

        engine = self.engine
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
        while name in self._busy:
            await trio.lowlevel.checkpoint()  # a concurrent PUT/DELETE of this name commits first
        existing = self.routers.get(name)
        if req.dest not in engine.topics and not req.create_dest:
            raise TopicNotFound(req.dest)
        dest_topic = engine.topics.get(req.dest)
        if dest_topic is not None:
            for other in self.by_dest.get(dest_topic, ()):
                if other.d.name != name:
                    raise TopicExistsIncompatible(
                        f"topic {req.dest!r} is already the destination of router "
                        f"{other.d.name!r} (source {other.d.source!r})",
                        {"topic": req.dest, "reason": "router_dest_fan_in"},
                    )
        if existing is not None and (existing.d.source, existing.d.dest) != (req.source, req.dest):
            raise TopicExistsIncompatible(
                f"router {name!r} exists with another source or dest; delete and recreate it "
                "to re-point",
                {
                    "router": name,
                    "reason": "router_repoint_forbidden",
                    "existing_source": existing.d.source,
                    "existing_dest": existing.d.dest,
                },
            )
        cap = engine.cfg.limits.max_routers
        if existing is None and cap and len(self.routers) >= cap:
            raise Throttled.limit("max_routers", cap)
        if not d.allow_cycle:
            path = self._path(req.dest, req.source, name)
            if path is not None:
                cycle = [req.source, *path]
                raise RouterCycle(
                    f"router {name!r} would close the cycle {' -> '.join(cycle)}",
                    {"cycle": list(cycle)},
                )
        if existing is not None and existing.d == d:
            await trio.lowlevel.checkpoint()
            return existing, False
        self._busy.add(name)
        try:
            src = await self._ensure(req.source)
            dst = await self._ensure(req.dest)
            if src.deleted or dst.deleted:
                raise TopicNotFound(req.source if src.deleted else req.dest)
            engine.check_open()
            body = d.to_frame()
            body["dest_id"] = dst.topic_id
            body["src_base"] = src.head_seq
            body["dest_base"] = dst.head_seq
            frame = frames.encode_control(
                frames.ROUTER_CREATE, src.topic_id, engine.clock.now_ms(), body
            )
            r = await engine.commit.control(
                src, frame, lambda: self.apply_create(d, src, dst, dst.head_seq)
            )
        finally:
            self._busy.discard(name)
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

    def apply_create(self, d: RouterDef, src: Topic, dst: Topic, dest_base: int) -> Router:
        """A committed RouterCreate: a new router at the source head, or a new config."""
        existing = self.routers.get(d.name)
        if existing is not None:
            existing.d = d
            return existing
        r = Router(d, src, dst, src.head_seq, dest_base, src.head_seq)
        r.logged = r.cursor
        self._attach(r)
        return r

    async def delete(self, name: str) -> bool:
        """Delete a router (durably logged); False if there was none."""
        engine = self.engine
        check_router_name(name)
        while name in self._busy:
            await trio.lowlevel.checkpoint()
        r = self.routers.get(name)
        if r is None:
            await trio.lowlevel.checkpoint()
            return False
        engine.check_open()
        self._busy.add(name)
        try:
            frame = frames.encode_control(
                frames.ROUTER_DELETE, r.src.topic_id, engine.clock.now_ms(), r.anchor()
            )

            def apply() -> bool:
                if self.routers.get(name) is not r:
                    return False
                self._detach(r)
                return True

            return await engine.commit.control(r.src, frame, apply)
        finally:
            self._busy.discard(name)

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
        names = sorted(self.routers)
        i = bisect.bisect_right(names, after) if after is not None else 0
        out: list[Router] = []
        while i < len(names):
            r = self.routers[names[i]]
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

    # ---- forwarding ---------------------------------------------------------------------

    def _on_drain(self, topic: Topic, start: int, end: int) -> None:
        for r in list(self.by_source.get(topic, ())):
            self.forward(r, self.cfg.batch)

    def forward(self, r: Router, limit: int) -> int:
        """Handle up to `limit` source seqs past the cursor; returns how many. Synchronous:
        the copies are published in one step."""
        src, dst = r.src, r.dst
        if src.deleted or dst.deleted or self.routers.get(r.d.name) is not r:
            return 0
        end = min(src.head_seq, r.cursor + limit)
        if end <= r.cursor or dst.next_seq != dst.head_seq + 1:
            return 0  # nothing new, or a direct write to dest is in flight: wait for it
        engine = self.engine
        now = engine.clock.now_ms()
        engine.enforce(src)
        cfg = dst.config
        room_records = room_bytes = -1
        if cfg.discard == "reject":
            if cfg.cap_records:
                room_records = cfg.cap_records - dst.count - dst.pending_records
            if cfg.cap_bytes:
                room_bytes = cfg.cap_bytes - dst.bytes - dst.pending_bytes
        quota = engine.cfg.limits.max_total_bytes
        room_total = quota - engine.total_bytes - engine.pending_bytes if quota else -1
        ts = dst.stamp(now)
        seq = dst.head_seq
        slots: list[DerivedSlot] = []
        trims: list[int] = []
        handled = 0
        for s in range(r.cursor + 1, end + 1):
            slot = self._derive(r, s, seq + 1, ts)
            if slot.enc is not None:
                size = slot.size
                if room_records == 0 or 0 <= room_bytes < size or 0 <= room_total < size:
                    r.blocked = True  # backpressure: the cursor waits, nothing is dropped
                    self.stats.blocked += 1
                    break
                if room_records > 0:
                    room_records -= 1
                if room_bytes >= 0:
                    room_bytes -= size
                if room_total >= 0:
                    room_total -= size
            seq += 1
            handled += 1
            if slot is TRIM:
                trims.append(seq)
                slot = HOLE
            slots.append(slot)
        if not slots:
            return 0
        r.blocked = handled < end - r.cursor
        nbytes = dst.publish_derived(ts, slots)
        engine.total_bytes += nbytes
        for t in trims:
            dst.add_trim(t, t)
        copies = sum(1 for slot in slots if slot.enc is not None)
        if copies:
            dst.last_write_ts = ts
        r.cursor += handled
        r.forwarded_total += handled
        r.copies_total += copies
        self.stats.copies += copies
        self.stats.trimmed += len(trims)
        self.stats.passes += 1
        engine.enforce(dst)
        engine.sched.mark_dirty(dst)
        dst.wake()
        return handled

    def _derive(self, r: Router, s: int, seq: int, ts: int) -> DerivedSlot:
        """What source seq `s` becomes at destination seq `seq` (a copy, hole or trim)."""
        src = r.src
        enc = src.enc(s)
        if enc is None:
            evicted = s < src.evict_floor or any(lo <= s <= hi for lo, hi in src.lost_ranges)
            return TRIM if evicted else HOLE
        tag = src.tags.get(s) if src.tags else None
        if not r.d.matches(tag):
            return HOLE
        hop = (src.hops.get(s, 0) if src.hops else 0) + 1
        if hop > self.cfg.max_hops:
            return HOLE  # the hop cap: a looping record is not forwarded again
        node = src.nodes.get(s) if src.nodes else None
        shape = src.shapes.get(s) if src.shapes else None
        copy, shape = rewrite(enc, shape, node, r.d.preserve_node, seq, ts)
        return DerivedSlot(
            copy,
            src.size(s),
            tag if r.d.preserve_tag else None,
            node if r.d.preserve_node else None,
            src.prios.get(s, 0) if src.prios else 0,
            shape,
            hop,
        )

    def catch_up(self, dest: Topic, depth: int = 0) -> None:
        """Read-path catch-up: drain every router feeding `dest` (their sources first)."""
        feeding = self.by_dest.get(dest)
        if not feeding:
            return
        for r in list(feeding):
            if depth < self.cfg.max_hops:
                self.catch_up(r.src, depth + 1)
            for _ in range(_CATCH_UP_PASSES):
                if not self.forward(r, self.cfg.batch):
                    break

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The sweep: every `routers.tick_ms` forward what the drains left (a router held
        back by a full destination retries here); every `routers.cursor_log_ms` log the
        cursors that moved (`RouterCursor`, not sync-gated)."""
        tick = self.cfg.tick_ms / 1000
        log_every = self.cfg.cursor_log_ms / 1000
        next_log = trio.current_time() + log_every
        task_status.started()
        while True:
            await trio.sleep(tick)
            for name in sorted(self.routers):
                r = self.routers.get(name)
                if r is not None and r.lag:
                    self.forward(r, self.cfg.batch)
                    await trio.lowlevel.checkpoint()
            if trio.current_time() >= next_log:
                next_log = trio.current_time() + log_every
                await self.log_cursors()

    async def log_cursors(self, *, sync: bool = False) -> None:
        """Write a `RouterCursor` anchor for every router whose cursor moved (`sync`:
        every router, synced — after recovery)."""
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
        base = src.head_seq
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
        router's snapshot anchor and register the live routers. `snap_heads`: each topic's
        head as the snapshot left it; `direct`: the seq ranges of replayed direct writes.
        Returns the ids of every topic that is or was a router destination."""
        engine = self.engine
        by_id = engine.by_id
        work = [*self.retired, *self.replay.values()]
        dests = {rr.dst_id for rr in work}
        live: list[ReplayRouter] = []
        for rr in work:
            src, dst = by_id.get(rr.src_id), by_id.get(rr.dst_id)
            if src is None or dst is None:
                continue  # an endpoint was deleted: the router went with it
            if rr.final is None:
                live.append(rr)
        # rounds until nothing moves: chains settle in order, cycles stop at the hop cap
        progress = True
        rounds = 0
        while progress and rounds <= (len(work) + 1) * self.cfg.max_hops:
            progress = False
            rounds += 1
            for rr in work:
                if self._rederive_one(rr, snap_heads, direct, now_ms):
                    progress = True
        for rr in live:
            src, dst = by_id[rr.src_id], by_id[rr.dst_id]
            r = Router(rr.d, src, dst, rr.src_base, rr.dest_base, rr.cursor, rr.forwarded_total)
            self._attach(r)
        self.replay = {}
        self.retired = []
        return dests

    def _rederive_one(
        self,
        rr: ReplayRouter,
        snap_heads: dict[int, int],
        direct: dict[int, list[tuple[int, int]]],
        now_ms: int,
    ) -> bool:
        by_id = self.engine.by_id
        src, dst = by_id.get(rr.src_id), by_id.get(rr.dst_id)
        if src is None or dst is None:
            return False
        limit = src.head_seq if rr.final is None else min(rr.final, src.head_seq)
        if rr.cursor >= limit:
            return False
        if "ephemeral" in (src.config.durability, dst.config.durability):
            # an ephemeral end keeps no records: nothing to re-derive (copies made before
            # the crash are gone by design); the router resumes at the source head
            rr.cursor = limit
            return False
        snap_head = snap_heads.get(rr.dst_id, 0)
        ranges = direct.get(rr.dst_id, [])
        anchors = sorted(rr.anchors)
        ai = 0
        pos = rr.floor
        ri = 0
        placed: dict[int, tuple[int, DerivedSlot]] = {}
        trims: list[int] = []
        fake = Router(rr.d, src, dst, rr.src_base, rr.dest_base, rr.cursor)
        while rr.cursor < limit:
            while ai < len(anchors) and anchors[ai][0] <= rr.cursor:
                pos = max(pos, anchors[ai][1])
                ai += 1
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
            s = rr.cursor + 1
            src_ts = src.ts_at(s) if src.enc(s) is not None else now_ms
            slot = self._derive(fake, s, pos, src_ts)
            rr.cursor = s
            rr.forwarded_total += 1
            if slot is TRIM:
                trims.append(pos)
                slot = HOLE
            if pos >= dst.evict_floor:
                placed[pos] = (src_ts, slot)
        rr.floor = pos
        if placed:
            self.engine.total_bytes += dst.insert_derived(placed)
        for t in trims:
            dst.add_trim(t, t)
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
