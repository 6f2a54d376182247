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
  several fronts, routers are served only by a front that owns every shard (docs).
"""

from __future__ import annotations

import contextlib
import json
import logging
from functools import partial
from typing import TYPE_CHECKING, Final, TypeVar

import orjson
import trio

from topicd.engine.router import Router, RouterDef, RouterService
from topicd.errors import InvalidRequest, TopicdError
from topicd.storage import frame as frames

if TYPE_CHECKING:
    from collections.abc import Callable

    from topicd.engine.engine import Engine
    from topicd.engine.topic import DerivedSlot, Topic
    from topicd.storage.jetstream import JetStreamBackend, JetStreamStore, StoredMsg, _Lane
    from topicd.wire import RouterIn

log = logging.getLogger("topicd.storage.jsrouters")

_T = TypeVar("_T")

ROUTER_PREFIX: Final = "router."


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


async def delete_router(store: JetStreamStore, name: str) -> None:
    import nats.js.errors

    assert store.js is not None
    try:
        await store.js.purge_stream(
            f"KV_{store.bucket}", subject=f"$KV.{store.bucket}.{router_key(name)}"
        )
    except nats.js.errors.NotFoundError:
        return


async def router_entries(store: JetStreamStore) -> dict[str, dict[str, object]]:
    """Every `router.*` entry, by router name."""
    import nats.js.errors

    assert store.kv is not None
    try:
        keys = await store.kv.keys()
    except nats.js.errors.NoKeysError:
        return {}
    out: dict[str, dict[str, object]] = {}
    for key in keys:
        if not key.startswith(ROUTER_PREFIX):
            continue
        got = await store.kv.get(key)
        if not got.value:
            continue
        body = orjson.loads(got.value)
        if isinstance(body, dict):
            out[bytes.fromhex(key[len(ROUTER_PREFIX) :]).decode()] = body
    return out


class JsRouters(RouterService):
    """`RouterService` whose copies are stored in the destination's stream before they
    are shown (module docstring)."""

    def __init__(self, engine: Engine, backend: JetStreamBackend) -> None:
        super().__init__(engine)
        self.backend = backend
        self.defs: dict[str, dict[str, object]] = {}  # the registry entries, by name
        self.waits: dict[Topic, trio.Event] = {}  # destinations with copies in flight

    async def put(self, name: str, req: RouterIn) -> tuple[Router, bool]:
        fronts = self.backend.fronts
        if fronts is not None and not fronts.owner:
            await trio.lowlevel.checkpoint()
            raise InvalidRequest(
                "routers are served only by a front that owns every shard on the jetstream "
                "storage backend yet (docs/jetstream.md)",
                {"backend": "jetstream", "unsupported": "routers on a front that is not the owner"},
            )
        return await super().put(name, req)

    # ---- forwarding ----------------------------------------------------------------------

    def forward(self, dst: Topic, limit: int, now: int | None = None) -> int:
        if dst in self.waits:
            return 0  # one copy batch in flight per destination
        fronts = self.backend.fronts
        if fronts is not None and not fronts.owner:
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
            await call(partial(put_router, store, name, stored))
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
        await call(partial(put_router, store, name, stored))
        self.defs[name] = stored
        return apply()

    def drop(self) -> None:
        """This front no longer owns every shard: its routers stop here (their entries
        stay; the front that owns them now attaches them)."""
        for name in sorted(self.routers):
            self._detach(self.routers[name])
        self.defs.clear()

    async def rebuild(self, *, repair: bool) -> int:
        """Attach every router of the registry whose topics exist and that is not
        attached yet, at its stored cursor (see the module docstring): at start, and when
        a front comes to own every shard (a takeover). With `repair`, remove the entries
        of routers whose topic is gone. Returns how many were attached."""
        engine = self.engine
        entries = await self.backend._call(partial(router_entries, self.backend.store))
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
        return attached
