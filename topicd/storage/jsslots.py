"""The connection caps of a deployment of fronts, counted in the registry.

With several fronts, `limits.max_sse_connections`, `limits.max_sse_connections_per_key`
and `dashboard.max_viewers` bound the deployment, not each front: a stream opened on
any front takes a slot from one count (`topicd.engine.slots`; docs/jetstream.md,
"Connection caps across fronts").

* **The entry.** The registry key `front.slots` holds, per front, the slots it holds
  and the end of the term that keeps them counted:
  `{front id: {"until_ms", "n", "v", "k": {key id: n}, "r": {key id: n}}}` (`n` every
  stream, `v` dashboard feeds, `k` per key id, a digest prefix, when the per-key cap is
  on; `r` the requests running per key id, `limits.max_inflight_per_key`). Every
  change is a compare-and-set on the key's revision, so two fronts admitting the last
  slot at once cannot both succeed: the second's write fails, it reads the entry again
  and refuses.
* **One writer per front.** A front's opens and closes go through one task (`run`),
  which takes every request waiting, decides them in order against the entry, and
  writes this front's record once for all of them. It decides on the entry as this
  front last wrote it (one round trip: the write proves it current) unless another
  front's write beat one of its own within the last third of `lease_ms`, or the copy
  says refuse (a refusal is only ever decided on a fresh read): then it reads first
  (two). Each write another front beats costs a read and a write more. A close takes
  one write (closes at once share it). Nothing runs per frame.
* **This front's counts are its own truth.** `mine` changes in memory first (a close
  gives its slot back at once there) and every write of the record writes it whole; a
  write that fails or is lost (NATS unreachable, the call cancelled after it was sent)
  is made good by the next one, which comes at the latest at the next renewal.
* **Requests end without a write.** A request slot's release only lowers `mine`; the
  record follows with the writer's next round (the next admission writes it whole) or
  `RELEASE_FLUSH_S` later. A front about to refuse a request slot on a fresh read asks
  the fronts whose records count that key for their own counts (`live`) and decides
  again on the same revision, taking the lower of record and answer: every increase is
  a write of the entry, so the compare-and-set still catches any admission since.
* **Liveness.** A record counts while its `until_ms` lies ahead (by the reading front's
  wall clock): the writer renews it every third of `storage.jetstream.lease_ms` while
  the front holds slots, as a front renews its membership and leases. A front killed
  with its streams open stops counting once its term ends, or, if it held an owner
  lease, as soon as another front's lease check finds it gone (`forget`); the next
  write removes its record. A
  front cut off from NATS longer than its term is not counted meanwhile (as it loses
  its leases), and is counted again from its next renewal.
* **Shares of `limits.max_total_bytes`** (`b`) **and `limits.max_idempotency_entries`**
  (`e`), when each is on (`Share`): each owner front's record holds a share of the
  limit that covers the bytes (live entries) of the topics it owns; the
  shares' sum never passes the limit (every change is the entry's compare-and-set). A
  write within the share is admitted with no round trip (`fits`); past it, the writer
  takes a larger share from the part no front holds (`grow`: what the owned bytes and
  the writes waiting need, plus `1/SHARE_SLACK` of the limit), and when that part is
  short asks the holders to give back what they do not use (`live` with `shares`)
  before deciding again on the same revision: a write is refused only when every
  front's count (bytes, entries) and the write's pass the limit. A front whose term
  ended keeps its shares counted one term more (its topics' bytes and entries stay
  counted until a new owner counts them);
  a front found gone is forgotten at once, as its shards are taken.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Final

import orjson
import trio

from topicd.engine.slots import (
    INFLIGHT_LIMIT,
    MAX_SSE_LIMIT,
    MAX_VIEWERS_LIMIT,
    PER_KEY_LIMIT,
    SESSIONS_LIMIT,
    Slot,
)
from topicd.errors import StorageUnavailable, Throttled

if TYPE_CHECKING:
    from collections.abc import Callable

    from topicd.clock import WallClock
    from topicd.config import Config
    from topicd.errors import JsonValue, TopicdError
    from topicd.storage.jetstream import JetStreamBackend, JetStreamStore

log = logging.getLogger("topicd.storage.jsslots")

SLOTS_KEY: Final = "front.slots"
# compare-and-set rounds for one batch of opens and closes before it fails (`503`)
ATTEMPTS: Final = 32
# how long a request refused on other fronts' records waits for their own counts
LIVE_WAIT_S: Final = 0.5
# how long ended requests may stay in this front's record when no round writes it
RELEASE_FLUSH_S: Final = 0.05
BYTES_LIMIT: Final = "max_total_bytes"
ENTRIES_LIMIT: Final = "max_idempotency_entries"
# a share grows by what the writes need and this part of the limit
SHARE_SLACK: Final = 8
SHARES: Final = ("b", "e")  # the fields of a record's shares (`Tally`)


@dataclass
class Tally:
    """Slots held: every stream (`n`), dashboard feeds (`v`), per key id (`keys`),
    requests running per key id (`reqs`, `limits.max_inflight_per_key`) and watch
    sessions stored (`w`, `limits.max_watch_sessions`)."""

    n: int = 0
    v: int = 0
    keys: dict[str, int] = field(default_factory=dict)
    reqs: dict[str, int] = field(default_factory=dict)
    w: int = 0
    b: int = 0  # this front's share of `limits.max_total_bytes`
    e: int = 0  # this front's share of `limits.max_idempotency_entries`

    def empty(self) -> bool:
        return not self.n and not self.reqs and not self.w and not self.b and not self.e

    def add(self, slot: Slot, sign: int = 1) -> None:
        if slot.grow:  # (a share's size is set by the round that grants it)
            return
        if slot.session:
            self.w += sign
            assert self.w >= 0
            return
        if slot.request:
            assert slot.key is not None
            _count(self.reqs, slot.key, sign)
            return
        self.n += sign
        if slot.viewer:
            self.v += sign
        if slot.key is not None:
            _count(self.keys, slot.key, sign)
        assert self.n >= 0
        assert self.v >= 0

    def merge(self, other: Tally) -> None:
        self.n += other.n
        self.v += other.v
        for key, count in other.keys.items():
            self.keys[key] = self.keys.get(key, 0) + count
        for key, count in other.reqs.items():
            self.reqs[key] = self.reqs.get(key, 0) + count
        self.w += other.w
        self.b += other.b
        self.e += other.e

    def copy(self) -> Tally:
        return Tally(self.n, self.v, dict(self.keys), dict(self.reqs), self.w, self.b, self.e)

    def wire(self, until_ms: int) -> dict[str, JsonValue]:
        keys: dict[str, JsonValue] = dict(self.keys)
        out: dict[str, JsonValue] = {"until_ms": until_ms, "n": self.n, "v": self.v, "k": keys}
        if self.reqs:
            reqs: dict[str, JsonValue] = dict(self.reqs)
            out["r"] = reqs
        if self.w:
            out["w"] = self.w
        if self.b:
            out["b"] = self.b
        if self.e:
            out["e"] = self.e
        return out

    @staticmethod
    def parse(obj: object) -> tuple[Tally, int]:
        """(the tally, its `until_ms`) of one front's record; malformed: nothing, expired."""
        if not isinstance(obj, dict):
            return Tally(), 0
        n, v, w, until = obj.get("n"), obj.get("v"), obj.get("w"), obj.get("until_ms")
        b, e = obj.get("b"), obj.get("e")
        return (
            Tally(
                n if isinstance(n, int) else 0,
                v if isinstance(v, int) else 0,
                _counts(obj.get("k")),
                _counts(obj.get("r")),
                w if isinstance(w, int) else 0,
                b if isinstance(b, int) and b > 0 else 0,
                e if isinstance(e, int) and e > 0 else 0,
            ),
            until if isinstance(until, int) else 0,
        )


def _count(counts: dict[str, int], key: str, sign: int) -> None:
    left = counts.get(key, 0) + sign
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _counts(obj: object) -> dict[str, int]:
    """A record's `{key id: count}` (malformed entries left out)."""
    if not isinstance(obj, dict):
        return {}
    return {str(k): c for k, c in obj.items() if isinstance(c, int) and c > 0}


Table = dict[str, tuple[Tally, int]]  # front id -> (its slots, until_ms)


def _decode(raw: bytes | None) -> Table:
    obj = orjson.loads(raw) if raw else {}
    if not isinstance(obj, dict):
        return {}
    return {str(front): Tally.parse(rec) for front, rec in obj.items()}


def _encode(table: Table) -> bytes:
    return orjson.dumps({front: t.wire(until) for front, (t, until) in table.items()})


async def read_table(store: JetStreamStore) -> tuple[Table, int]:
    """(the `front.slots` entry, its revision; 0 when absent). On the asyncio loop."""
    import nats.js.errors

    assert store.kv is not None
    try:
        got = await store.kv.get(SLOTS_KEY)
    except nats.js.errors.KeyNotFoundError:
        return {}, 0
    return _decode(got.value), int(got.revision or 0)


async def write_table(store: JetStreamStore, table: Table, last: int) -> int | None:
    """Compare-and-set the entry (`last` 0: create it); its new revision, or None when
    another front changed it first. On the asyncio loop."""
    return await store.cas_key(SLOTS_KEY, _encode(table), last)


@dataclass(eq=False)
class _Ask:
    """One open waiting for the writer's decision."""

    slot: Slot
    done: trio.Event = field(default_factory=trio.Event)
    error: TopicdError | None = None
    abandoned: bool = False  # the opener was cancelled: nobody takes the answer


class JsSlots:
    """This front's desk for the deployment-wide connection caps (`ConnectionSlots`;
    see the module docstring)."""

    def __init__(
        self, cfg: Config, backend: JetStreamBackend, clock: WallClock, front_id: str
    ) -> None:
        limits = cfg.limits
        self.max_total = limits.max_sse_connections
        self.max_per_key = limits.max_sse_connections_per_key
        self.max_viewers = cfg.dashboard.max_viewers
        self.backend = backend
        self.store = backend.store
        self.clock = clock
        self.front_id = front_id
        js = cfg.storage.jetstream
        self.lease_ms = js.lease_ms
        self.renew_s = js.lease_ms / 3000
        # how long a close waits for its write before the stream's task goes on (the
        # slot then comes back with the writer's next successful write)
        self.release_wait_s = js.request_timeout_ms / 1000
        self.max_inflight = limits.max_inflight_per_key
        self.max_sessions = limits.max_watch_sessions
        # reclaims this front's idle-expired watch sessions (set by the engine's opener)
        self.reclaim: Callable[[], object] | None = None
        self.mine = Tally()  # the slots this front's streams (and requests) hold
        self._granting = Tally()  # the grants of the write in flight
        self._asks: list[_Ask] = []
        self._forget: set[str] = set()  # fronts found gone: their records go
        self._wake = trio.Event()
        self._round_done = trio.Event()
        self._gen = 0  # closes so far
        self._written_gen = 0  # ... that the record as last written counts
        self._settled_gen = 0  # ... that a round has tried to write
        self._cache: tuple[Table, int] | None = None  # the entry as this front wrote it
        # until then (Trio time) the cache is not tried: another front wrote the entry
        # lately, so it is likely stale (a write from it would fail and cost a round trip)
        self._contended_until = 0.0
        self._renew_at = 0.0  # Trio time of the next renewal while holding slots
        # Trio time by which ended requests are written if no round writes them first
        self._flush_at: float | None = None
        self._last_error = ""
        self.closed = False  # (the front is shutting down: its record is taken out)
        self.writes = 0  # records written (tests)
        # this front's shares of the limits that are on (`Share`; the engine's opener
        # sets what each must cover)
        self.shares: dict[str, Share] = {}
        if limits.max_total_bytes:
            self.shares["b"] = Share(self, "b", BYTES_LIMIT, limits.max_total_bytes)
        if limits.max_idempotency_entries:
            self.shares["e"] = Share(self, "e", ENTRIES_LIMIT, limits.max_idempotency_entries)
        self.grows = 0  # rounds that decided a larger share (tests, bench)
        self.conflicts = 0  # writes another front's write beat (tests)
        self.live_asks = 0  # refusals that asked other fronts' own counts (tests)

    # ---- the streams' side -------------------------------------------------------------

    def _applies(self, key: str | None, viewer: bool) -> bool:
        return viewer or self.max_total > 0 or (key is not None and self.max_per_key > 0)

    async def acquire(self, key: str | None, *, viewer: bool = False) -> Slot:
        """`ConnectionSlots.acquire`: one round of the writer (module docstring)."""
        if not self.max_per_key:
            key = None  # (no per-key count kept)
        if self.closed:
            await trio.lowlevel.checkpoint()
            raise StorageUnavailable("this front is shutting down", {"backend": "jetstream"})
        if not self._applies(key, viewer):
            await trio.lowlevel.checkpoint()
            return Slot(key, viewer, counted=False)
        return await self._round_for(Slot(key, viewer))

    async def acquire_request(self, key: str) -> Slot:
        """`ConnectionSlots.acquire_request`: one round of the writer, shared by the
        requests waiting meanwhile; refused at once, with no round trip, when this
        front's own requests of `key` fill the cap."""
        if self.closed:
            await trio.lowlevel.checkpoint()
            raise StorageUnavailable("this front is shutting down", {"backend": "jetstream"})
        if self.mine.reqs.get(key, 0) >= self.max_inflight:
            await trio.lowlevel.checkpoint()
            raise Throttled.limit(INFLIGHT_LIMIT, self.max_inflight)
        return await self._round_for(Slot(key, False, request=True))

    async def acquire_session(self) -> Slot:
        """`ConnectionSlots.acquire_session`: as `acquire_request`, for a watch session
        (the caller has reclaimed this front's idle sessions first); at the cap, the
        other fronts holding sessions are asked to reclaim theirs (`_ask_live`)."""
        if self.closed:
            await trio.lowlevel.checkpoint()
            raise StorageUnavailable("this front is shutting down", {"backend": "jetstream"})
        if self.mine.w >= self.max_sessions:
            await trio.lowlevel.checkpoint()
            raise Throttled.limit(SESSIONS_LIMIT, self.max_sessions)
        return await self._round_for(Slot(None, False, session=True))

    def release_session(self, slot: Slot) -> None:
        """`ConnectionSlots.release_session`: as `release_request`."""
        self.release_request(slot)

    def release_request(self, slot: Slot) -> None:
        """`ConnectionSlots.release_request`: the slot leaves this front's count at once
        and the writer writes the record in its next round; nobody waits for that write.
        Until it lands, another front's refusal on this front's record asks this front
        what it holds now (`live`), so a request ended here never makes another front
        refuse."""
        if slot.counted and not slot.released:
            slot.released = True
            self.mine.add(slot, -1)
            self._gen += 1
            # (no round of its own: the next round writes the whole record, an admission
            # of this front's next request included; at the latest `RELEASE_FLUSH_S` on)
            if self._flush_at is None:
                self._flush_at = trio.current_time() + RELEASE_FLUSH_S

    async def _round_for(self, slot: Slot) -> Slot:
        """`slot` taken by the writer's next round (or its refusal raised)."""
        ask = _Ask(slot)
        self._asks.append(ask)
        self._wake.set()
        answered = False
        try:
            await ask.done.wait()
            answered = True
        finally:
            if not answered:
                ask.abandoned = True  # (a slot granted meanwhile is given back)
        if ask.error is not None:
            raise ask.error
        return ask.slot

    async def release(self, slot: Slot) -> None:
        """`ConnectionSlots.release`: the slot leaves `mine` at once, then the writer
        writes the record; waits for that write (shielded, at most a request timeout).
        If it fails, the record is written again at the writer's next round (at the
        latest a third of `lease_ms` on), or it expires with the front."""
        if not slot.counted or slot.released:
            await trio.lowlevel.checkpoint()
            return
        slot.released = True
        self._give_back(slot)
        if self.closed:  # (the record is out already)
            await trio.lowlevel.checkpoint()
            return
        gen = self._gen
        with trio.move_on_after(self.release_wait_s, shield=True):
            while self._settled_gen < gen:
                await self._round_done.wait()

    def _give_back(self, slot: Slot) -> None:
        self.mine.add(slot, -1)
        self._gen += 1
        self._wake.set()

    def forget(self, front: str) -> None:
        """`front` was found gone (its connection closed): stop counting its slots and
        remove its record at the next write."""
        if front != self.front_id:
            self._forget.add(front)
            self._wake.set()

    def held(self) -> int:
        return self.mine.n

    # ---- the writer --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: a round whenever an open or a close waits, and the renewal."""
        task_status.started()
        while True:
            if not self.mine.empty() or self._gen != self._written_gen or self._forget:
                # (the renewal, the retry, or ended requests to write)
                flush = self._renew_at if self._flush_at is None else self._flush_at
                with trio.move_on_at(min(self._renew_at, flush)):
                    await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake = trio.Event()
            await self.round()

    async def round(self) -> None:
        """Decide the opens waiting, write this front's record if anything changed or
        its renewal is due; the opens get their answer (a `503` if the entry cannot be
        reached), and a failed write is retried at the next round."""
        asks = [a for a in self._asks if not a.abandoned]
        self._asks.clear()
        self._flush_at = None  # (this round writes the requests ended so far)
        gen = self._gen
        try:
            await self._settle(asks)
            self._last_error = ""
        except Exception as exc:
            why = str(exc) or type(exc).__name__
            if why != self._last_error:
                log.warning("front %s: the connection count: %s", self.front_id, why)
            self._last_error = why
            self._cache = None
            self._renew_at = trio.current_time() + self.renew_s  # (the retry)
            for a in asks:
                if not a.done.is_set():
                    a.error = StorageUnavailable(
                        f"JetStream: the deployment's connection count: {why}",
                        {"backend": "jetstream"},
                    )
                    a.done.set()
        finally:
            self._settled_gen = max(self._settled_gen, gen)
            self._round_done.set()
            self._round_done = trio.Event()

    async def _settle(self, asks: list[_Ask]) -> None:
        call = self.backend.bridge.call
        me = self.front_id
        again: tuple[Table, int] | None = None  # decide once more on this entry
        live: dict[str, Tally] = {}  # fronts' own counts (requests, sessions), asked at...
        live_rev = -1  # ... this revision of the entry (after reading it)
        for _ in range(ATTEMPTS):
            if again is not None:
                (table, rev), fresh, again = again, True, None
            else:
                if trio.current_time() < self._contended_until:
                    self._cache = None
                fresh = self._cache is None
                if self._cache is None:
                    table, rev = await call(partial(read_table, self.store))
                else:
                    table, rev = self._cache
            now = self.clock.now_ms()
            forget = set(self._forget)
            others: Table = {}
            for f, (tally, until) in table.items():
                if f == me or f in forget:
                    continue
                if until > now:
                    others[f] = (tally, until)
                elif (tally.b or tally.e) and now < until + self.lease_ms:
                    # a front whose term ended keeps its shares for one term more: its
                    # topics' bytes and entries count there until their new owner's do
                    others[f] = (Tally(b=tally.b, e=tally.e), until)
            total = self.mine.copy()
            for front, (tally, _) in others.items():
                if live_rev == rev and front in live:
                    # (what it holds now: its record may still count requests ended and
                    # sessions reclaimed)
                    tally = tally.copy()
                    now_held = live[front]
                    for key, count in now_held.reqs.items():
                        if count < tally.reqs.get(key, 0):
                            _count(tally.reqs, key, count - tally.reqs[key])
                    tally.w = min(tally.w, now_held.w)
                    tally.b = min(tally.b, now_held.b)
                    tally.e = min(tally.e, now_held.e)
                total.merge(tally)
            # the shares other fronts hold; what this front's share must cover now
            # (exact, at this decision), for the shares asked for; how much more
            held = {f: getattr(total, f) - getattr(self.mine, f) for f in SHARES}
            used = {
                f: s.used() for f, s in self.shares.items() if any(a.slot.share == f for a in asks)
            }
            grown = dict.fromkeys(SHARES, 0)
            granted: list[_Ask] = []
            refused: list[tuple[_Ask, Throttled]] = []
            for a in asks:
                if a.abandoned:
                    continue
                if a.slot.grow:
                    f, share = a.slot.share, self.shares[a.slot.share]
                    if held[f] + used[f] + grown[f] + a.slot.grow > share.limit:
                        refused.append((a, Throttled.limit(share.name, share.limit)))
                    else:
                        grown[f] += a.slot.grow
                        granted.append(a)
                    continue
                err = self._refusal(total, a.slot)
                if err is None:
                    total.add(a.slot)
                    granted.append(a)
                else:
                    refused.append((a, err))
            if refused and not fresh:
                self._cache = None  # (a refusal is decided on the entry as it is now)
                continue
            if refused and live_rev != rev:
                # a request refused on other fronts' records: those count requests that
                # have ended there until their next write (a request's end does not wait
                # for it), so ask those fronts what they hold now, and decide again; a
                # session refused: ask the fronts holding sessions to reclaim their idle
                # ones first (as one process reclaims on a create)
                # a share of bytes refused: ask the fronts holding shares to give back
                # what they do not use
                keys = {a.slot.key for a, _ in refused if a.slot.request}
                sessions = any(a.slot.session for a, _ in refused)
                shares = any(a.slot.grow for a, _ in refused)
                holders = [
                    f
                    for f, (t, _) in others.items()
                    if keys & t.reqs.keys() or (sessions and t.w) or (shares and (t.b or t.e))
                ]
                if holders:
                    asked = {k for k in keys if k is not None}
                    live = await self._ask_live(holders, asked, sessions, shares)
                    live_rev = rev
                    again = (table, rev)
                    continue
            gen = self._gen
            record = Tally() if self.closed else self.mine.copy()
            granting = Tally()
            for a in granted:
                record.add(a.slot)
                granting.add(a.slot)
            for f, more in grown.items():
                if more and not self.closed:
                    # what the writes need, and a part of what no front holds (so the
                    # next writes need no round), never less than the share held now
                    share = self.shares[f]
                    room = share.limit - held[f]
                    want = used[f] + more + max(1, share.limit // SHARE_SLACK)
                    setattr(record, f, max(getattr(self.mine, f), min(room, want)))
                    share.spent = used[f]
            renew = not self.mine.empty() and trio.current_time() >= self._renew_at
            had, _ = table.get(me, (Tally(), 0))
            if granted or renew or forget & table.keys() or had != record:
                new = dict(others)
                if live_rev == rev:
                    # the shares the fronts asked gave back (they hold no more now)
                    for front, now_held in live.items():
                        if front not in new:
                            continue
                        tally, until = new[front]
                        if now_held.b < tally.b or now_held.e < tally.e:
                            tally = tally.copy()
                            tally.b, tally.e = min(tally.b, now_held.b), min(tally.e, now_held.e)
                            new[front] = (tally, until)
                if not record.empty():
                    new[me] = (record, now + self.lease_ms)
                self._granting = granting  # (counted by `live` while the write runs)
                try:
                    got = await call(partial(write_table, self.store, new, rev))
                finally:
                    self._granting = Tally()
                if got is None:
                    self.conflicts += 1
                    self._cache = None
                    self._contended_until = trio.current_time() + self.renew_s
                    continue
                self.writes += 1
                if any(grown.values()) and not self.closed:
                    self.grows += 1
                    for f in SHARES:
                        if grown[f]:
                            setattr(self.mine, f, getattr(record, f))
                self._cache = (new, got)
                self._renew_at = trio.current_time() + self.renew_s
            self._forget -= forget  # (their records are out of the entry now)
            self._written_gen = gen
            for a in granted:
                self.mine.add(a.slot)
                if a.abandoned:
                    self._give_back(a.slot)
                else:
                    a.done.set()
            for a, err in refused:
                a.error = err
                a.done.set()
            return
        raise RuntimeError(f"{ATTEMPTS} conflicting writes in a row")

    async def _ask_live(
        self, fronts: list[str], keys: set[str], sessions: bool, shares: bool = False
    ) -> dict[str, Tally]:
        """What `fronts` hold now (`live`): their requests of `keys`, with `sessions`
        their watch sessions once they reclaimed the idle-expired ones, and their share
        of `max_total_bytes`, with `shares` once they gave back what they do not use;
        asked in parallel, `LIVE_WAIT_S` at most. A front that does not answer is left
        out (its record counts)."""
        self.live_asks += 1
        head = (
            orjson.dumps(
                {"op": "slots", "keys": sorted(keys), "sessions": sessions, "shares": shares}
            )
            + b"\n"
        )
        requests = {f"{self.store.prefix}.fwd.{front}": head for front in fronts}
        got: dict[str, bytes | None] = {}
        with trio.move_on_after(2 * LIVE_WAIT_S):
            got = await self.backend.bridge.call(partial(self.store.ask_all, requests, LIVE_WAIT_S))
        out: dict[str, Tally] = {}
        for front in fronts:
            raw = got.get(f"{self.store.prefix}.fwd.{front}")
            try:
                ok = orjson.loads(raw)["ok"] if raw else None
            except (orjson.JSONDecodeError, KeyError, TypeError):
                ok = None
            if not isinstance(ok, dict):
                continue
            reqs, w, b, e = ok.get("r"), ok.get("w"), ok.get("b"), ok.get("e")
            if (
                isinstance(reqs, dict)
                and all(isinstance(reqs.get(k), int) for k in keys)
                and isinstance(w, int)
                and isinstance(b, int)
                and isinstance(e, int)
            ):
                out[front] = Tally(reqs={k: int(reqs[k]) for k in keys}, w=w, b=b, e=e)
        return out

    def live(self, keys: list[str], sessions: bool, shares: bool = False) -> dict[str, JsonValue]:
        """What this front holds now, granted and not given back, those of a write in
        flight included (another front's `_ask_live`): its requests of `keys` (`r`), its
        watch sessions (`w`), with `sessions` after reclaiming its idle-expired ones
        (which gives their slots back), and its share of `max_total_bytes` (`b`), with
        `shares` after giving back what its owned topics do not use: from here on its
        writes past that need a round (`grow`), whose compare-and-set the asker's
        decision on the same revision excludes."""
        if sessions and self.reclaim is not None:
            self.reclaim()
        if shares and not self.closed:
            for f, share in self.shares.items():
                share.spent = share.used()
                if share.spent < getattr(self.mine, f):
                    setattr(self.mine, f, share.spent)
        mine, granting = self.mine.reqs, self._granting.reqs
        reqs: dict[str, JsonValue] = {k: mine.get(k, 0) + granting.get(k, 0) for k in keys}
        return {"r": reqs, "w": self.mine.w + self._granting.w, "b": self.mine.b, "e": self.mine.e}

    def _refusal(self, total: Tally, slot: Slot) -> Throttled | None:
        """The cap one more `slot` would pass, in the embedded backend's order."""
        if slot.session:
            if total.w >= self.max_sessions:
                return Throttled.limit(SESSIONS_LIMIT, self.max_sessions)
            return None
        if slot.request:
            assert slot.key is not None
            if total.reqs.get(slot.key, 0) >= self.max_inflight:
                return Throttled.limit(INFLIGHT_LIMIT, self.max_inflight)
            return None
        if slot.viewer and total.v >= self.max_viewers:
            return Throttled.limit(MAX_VIEWERS_LIMIT, self.max_viewers)
        if self.max_total and total.n >= self.max_total:
            return Throttled.limit(MAX_SSE_LIMIT, self.max_total)
        if (
            slot.key is not None
            and self.max_per_key
            and total.keys.get(slot.key, 0) >= self.max_per_key
        ):
            return Throttled.limit(PER_KEY_LIMIT, self.max_per_key)
        return None

    async def close(self) -> None:
        """At shutdown: take this front's record out (the caller bounds it; a record
        left behind expires with its term). Streams still open end with the front; their
        closes only count down here."""
        self.closed = True
        if not self.mine.empty() or self._gen != self._written_gen:
            await self.round()


@dataclass(eq=False)
class Share:
    """This front's share of one deployment-wide limit (`ShareBudget`): `limits.max_total_bytes`
    (`b`, in bytes) or `limits.max_idempotency_entries` (`e`, in entries); its size is
    the field of this front's record (`JsSlots.mine`)."""

    desk: JsSlots
    field: str  # "b" or "e" (`SHARES`)
    name: str  # the limit's name in a refusal's `detail`
    limit: int
    # what the share must cover: the bytes (entries) of the topics this front owns,
    # those being written included (set by the engine's opener)
    used: Callable[[], int] = lambda: 0
    spent: int = 0  # at least what the share covers now (`fits`)

    def fits(self, n: int) -> bool:
        """`ShareBudget.fits`: `n` more within the share. `spent` bounds what the share
        covers from above (every write admitted adds to it; deletes, caps, TTL and
        expiry do not take from it), so most writes decide on it alone; when it says
        no, what the owned topics hold is counted again (freed bytes and expired
        entries go back to the share)."""
        held = getattr(self.desk.mine, self.field)
        if self.spent + n <= held:
            self.spent += n
            return True
        self.spent = self.used()
        if self.spent + n <= held:
            self.spent += n
            return True
        return False

    async def grow(self, n: int) -> None:
        """`ShareBudget.grow`: one round of the writer (shared with the opens waiting)
        takes a share covering what this front holds and `n`, from the part of the limit
        no front holds; short of it, the fronts holding shares give back what they do
        not use (`JsSlots.live`) and the round decides again on the same revision,
        refusing only when the deployment's count and `n` pass the limit."""
        if self.desk.closed:
            await trio.lowlevel.checkpoint()
            raise StorageUnavailable("this front is shutting down", {"backend": "jetstream"})
        await self.desk._round_for(Slot(None, False, counted=False, grow=n, share=self.field))
