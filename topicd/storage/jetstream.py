"""The jetstream storage backend: each topic is a stream on a NATS JetStream cluster.

`storage.backend = "jetstream"` runs topicd as a *front*: the engine, its caches and the
whole `/v0` surface stay in this process, and durable state lives in JetStream
(docs/jetstream.md has the design, the deltas and what is not supported yet):

* **Registry** — one key-value bucket `<prefix>_registry`: `topic.<id>` holds a topic
  instance's name, config, eviction floor, eviction runs and last record deletes (JSON);
  `meta.next_id` the next topic id (ids are never reused); `name.<hex>` the id of a
  name's live instance; `front.owner.<shard>` the owner leases, `front.members` the
  live fronts, `front.slots` the connection slots each front holds (`jsslots`),
  `meta.shards` the shard count, `meta.routers` the router graph. Writing
  the `topic.<id>` entry is the commit point of a topic create or config change;
  deleting it, of a topic delete.
* **Records** — topic id N is the stream `<prefix>_T<N>` with the subjects
  `<prefix>.t.<N>.*`; the last token encodes the record's tag (`_` untagged, `x` + hex
  of its UTF-8 otherwise) so exact-tag deletes are filtered purges. A record's `$seq` *is*
  its stream sequence: every publish carries `Nats-Expected-Last-Sequence` (the topic's
  head), so a write lands at exactly the seqs the engine reserved or not at all. The
  payload is the record's stored JSON (exactly what a diff returns); the per-record
  extras ride in headers. A write of n > 1 records is one atomic batch.
* **Floors** — cap/TTL eviction happens in memory as in the embedded backend; a
  background task then writes the new floor into the registry entry and purges the stream
  below it (floor first, so a restart never resurrects an evicted record).
* **Reads** — served from memory; records past the payload cache come back from the
  stream by batched direct get (`read_stored_range`).
* **Restart** — `open_jetstream_engine` rebuilds the engine from the registry and the
  streams through the same `Engine.apply_*` methods recovery uses.
* **Several fronts** — `topicd.storage.jsfronts`: the front holding the lease of a
  topic's shard runs its mutations through this backend; the others forward them to it
  and catch the topic up (`_install`, `_load_topic`) before reads. Registry writes are
  compare-and-set, so a deposed owner's fail like its fenced publishes.

Every client call runs on the asyncio loop of an `AsyncioBridge` (its own thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import signal
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Final, TypeVar

import orjson
import trio

from topicd.engine.engine import Engine
from topicd.engine.topic import Topic
from topicd.errors import (
    InvalidRequest,
    StorageUnavailable,
    Throttled,
    TopicdError,
    TopicNotFound,
)
from topicd.storage import frame as frames
from topicd.storage.jsbridge import AsyncioBridge
from topicd.storage.jsqueues import Journals
from topicd.storage.recovery import config_from_wire

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine

    import nats.aio.client
    import nats.js
    import nats.js.kv
    from nats.aio.msg import Msg

    from topicd.clock import WallClock
    from topicd.config import Config
    from topicd.engine.commit import AppendBatch, CommitHooks
    from topicd.errors import JsonValue
    from topicd.storage.jsfronts import Fronts
    from topicd.storage.jsslots import JsSlots

log = logging.getLogger("topicd.storage.jetstream")

_T = TypeVar("_T")

# JetStream's default ceiling on the messages of one atomic batch: a write is one batch
BATCH_MAX: Final = 1000
# the records one batched direct get asks for, and its byte budget
READ_PAGE: Final = 1000
READ_PAGE_BYTES: Final = 4 << 20
# the first connection gets this many request timeouts before the start is refused
CONNECT_ATTEMPTS: Final = 2
# the rebuild at start is retried for this many request timeouts (leader elections)
REBUILD_ATTEMPTS_TIMEOUTS: Final = 6
REBUILD_RETRY_S: Final = 0.5
# a router source's records its feeds have not copied yet stay in memory, this many at most
ROUTER_PIN_MAX: Final = 4096
# how often cap/TTL floors reach the registry and the streams (seconds)
FLOOR_INTERVAL_S: Final = 1.0

# the connection's keepalive: a ping every request timeout / this, the server left after
# this many unanswered (about 8 s at the default 5 s timeout)
PING_DIVISOR: Final = 2.5
PINGS_OUTSTANDING: Final = 3
# a direct get that a lagging replica answered short is retried this often, this far apart
READ_ATTEMPTS: Final = 20
READ_RETRY_S: Final = 0.05
_WRONG_LAST_SEQUENCE: Final = 10071  # JetStream's error code for a failed sequence fence
_WRONG_LAST_SEQUENCE_KV: Final = 10164  # the same, for a key's last revision
FORWARD_CHECK_S: Final = 0.25  # a forwarded request unanswered this long: is the owner alive?
PING: Final = b"ping"  # sent to a front's subject: answered by its client at once
ID_ATTEMPTS: Final = 16  # compare-and-set rounds for one topic id
ID_BACKOFF_S: Final = 0.002  # after the n-th lost round, wait about n times this
REV: Final = "_rev"  # (in entries read back: the key's revision, never stored)
# `<LEASE_KEY>.<shard>`: {"front": id, "subject": its request subject, "until_ms": wall ms}
LEASE_KEY: Final = "front.owner"
MEMBERS_KEY: Final = "front.members"  # {front id: until ms}: the fronts alive
# the answer to a forwarded request the owner has no room to queue
BUSY_REPLY: Final = (
    b'{"error":{"code":"storage_unavailable","status":503,"message":'
    b'"the owner front is busy; retry","detail":{"backend":"jetstream"}}}'
)

H_SIZE: Final = "Topicd-Size"  # the record's data+meta size (what caps count)
H_EXTRA: Final = "Topicd-Extra"  # ASCII JSON {"t": tag, "n": node, "p": prio, "s": shape}
H_COUNT: Final = "Topicd-Count"  # on a write's first record: its record count
H_KEY: Final = "Topicd-Key"  # on a write's first record: its idempotency key (ASCII JSON)
# router copies (`topicd.storage.jsrouters`): a destination seq with no record is a
# message with no payload and `Topicd-Slot: hole` or `trim`; a copy batch's first message
# carries the feed's cursors once it is stored, {router: [cursor, forwarded_total]}
H_SLOT: Final = "Topicd-Slot"
H_FEED: Final = "Topicd-Feed"
_TS: Final = re.compile(rb'\{"\$seq":\d+,"\$ts":(\d+)')


class JetStreamUnavailable(Exception):
    """The front cannot start on the JetStream cluster: unreachable, or it cannot hold
    what the configuration accepts (`topicd serve` exits 1 with this message)."""


def not_supported(feature: str, field_name: str | None = None) -> InvalidRequest:
    """`400 invalid_request` for what the jetstream backend does not do yet."""
    detail: dict[str, JsonValue] = {"backend": "jetstream", "unsupported": feature}
    if field_name is not None:
        detail["field"] = field_name
    return InvalidRequest(
        f"{feature} not supported on the jetstream storage backend yet (docs/jetstream.md)",
        detail,
    )


def tag_token(tag: str | None) -> str:
    """The subject token of a tag: `_` for none, else `x` + the hex of its UTF-8."""
    return "_" if tag is None else "x" + tag.encode().hex()


def name_key(name: str) -> str:
    """The registry key of a topic name's index entry (hex: any name, valid key chars)."""
    return "name." + name.encode().hex()


# a test's fault point (`TOPICD_JETSTREAM_FAULT=<name>`): the process kills itself
# (SIGKILL) there, so a crash at that exact step is reproducible with `topicd serve`
FAULT_ENV: Final = "TOPICD_JETSTREAM_FAULT"
# a stream move's filler messages (seqs the new stream must pass over): this subject token,
# purged before the move commits
FILLER: Final = "g"


def fault(point: str) -> None:
    """Die here (SIGKILL) when the fault point `point` is set in the environment."""
    if os.environ.get(FAULT_ENV) == point:
        log.warning("fault point %s: killing this process", point)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(eq=False, slots=True)
class CopyBatch:
    """Router copies bound for a destination's stream (`topicd.storage.jsrouters`): in
    the destination's lane, published in seq order with its writes and fenced like
    them; then `done(True)`, or `done(False)` when it failed (before the lane fails what
    is queued behind it and rewinds the topic)."""

    first_seq: int
    msgs: list[tuple[str, bytes, dict[str, str]]]
    done: Callable[[bool], None]

    @property
    def count(self) -> int:
        return len(self.msgs)


@dataclass
class _Lane:
    """One topic's writes in flight: published to its stream strictly in seq order."""

    topic: Topic
    pending: deque[AppendBatch | CopyBatch] = field(default_factory=deque)
    busy: bool = False
    diverged: bool = False  # the stream's head is not known to match memory: refuse writes
    resyncing: bool = False  # a task reads the stream back (`JetStreamBackend.resync`)
    resync_lock: trio.Lock = field(default_factory=trio.Lock)
    # accepted, not yet committed or failed (queued and in flight): the ingest bound
    accepted: int = 0
    accepted_bytes: int = 0
    room: trio.Event | None = None  # set when a write leaves (`wait_for_room`)
    idle: trio.Event | None = None  # set when the lane stops publishing (`wait_idle`)

    def full(self, nbytes: int, max_count: int, max_bytes: int) -> bool:
        return self.accepted >= max_count or (
            self.accepted_bytes > 0 and self.accepted_bytes + nbytes > max_bytes
        )

    def settled(self, batch: AppendBatch) -> None:
        self.accepted -= 1
        self.accepted_bytes -= batch.nbytes
        if self.room is not None:
            self.room.set()
            self.room = None

    registry_lock: trio.Lock = field(default_factory=trio.Lock)
    # held by the publishing task around each publish, and by a stream move for its
    # whole length (writes then queue up and go to the new stream)
    publish_lock: trio.Lock = field(default_factory=trio.Lock)
    # the id of the stream holding the records when not the topic's own (it moved), and
    # a move under way or not cleaned up yet: [from stream id, to stream id]
    sid: int = 0
    move: list[int] | None = None
    floor_written: int = 1  # the eviction floor the registry entry holds
    # an `ephemeral` topic's stream is R1 in server memory: a server restart empties it,
    # so the entry reserves seqs ahead of every publish (`reserved`), and a stream found
    # emptied resumes above the reservation (seqs are never handed out twice)
    memory: bool = False
    reserved: int = 0
    # a router destination: its feed's stored cursors, {router: [cursor, forwarded_total]}
    # (the entry carries them too, so a purge never takes the newest ones away)
    feed: dict[str, list[int]] = field(default_factory=dict)
    # the last record deletes, [number, before_seq, match, bound] (the registry entry
    # carries them to the other fronts), and the entry revision this front applied
    deletes: list[JsonValue] = field(default_factory=list)
    deletes_applied: int = 0
    entry_rev: int = 0
    # a follower's catch-ups of this topic: begun, the last one finished, the last one
    # finished that exchanged read times with the owner
    syncs_begun: int = 0
    syncs_done: int = 0
    reads_done: int = 0
    # a follower's read time not handed to the owner yet (the next catch-up takes it),
    # and the newest the owner has (the poll hands it newer ones: watch deliveries)
    read_pending: int | None = None
    read_sent: int = 0

    def entry(self) -> dict[str, JsonValue]:
        return _entry(self.topic, self.deletes, self)


@dataclass(frozen=True, slots=True)
class StoredMsg:
    seq: int
    data: bytes
    headers: dict[str, str]


def _write_failed(topic: Topic) -> TopicdError:
    """The error a failed publish gives its writes and those queued behind it: the
    topic is gone (deleted meanwhile), or the write failed (503)."""
    if topic.deleted:
        return TopicNotFound(topic.name)
    return StorageUnavailable(
        f"topic {topic.name!r}: the JetStream write failed",
        {"topic": topic.name, "backend": "jetstream"},
    )


class JetStreamStore:
    """The client half: coroutines that run on the bridge's asyncio loop."""

    def __init__(self, cfg: Config) -> None:
        js_cfg = cfg.storage.jetstream
        self.servers = [url.strip() for url in js_cfg.servers if url.strip()]
        self.prefix = js_cfg.prefix
        self.timeout = js_cfg.request_timeout_ms / 1000
        self.replicas = js_cfg.replicas
        self.bucket = f"{self.prefix}_registry"
        self.nc: nats.aio.client.Client | None = None
        self.js: nats.js.JetStreamContext | None = None
        self.kv: nats.js.kv.KeyValue | None = None
        self.last_error: Exception | None = None  # the last connection error NATS reported
        self.closing = False
        self.connected: asyncio.Event | None = None  # set while connected (loop side)
        self.notify = False  # publish a notice per committed write (an owner front)
        self.ignore_notices = False  # (a front owning every shard)
        self.requests: asyncio.Queue[Msg] | None = None  # forwarded to this front
        self.member_ids: tuple[str, ...] = ()  # the live fronts, as `members` last found them
        self.notices: tuple[dict[int, None], asyncio.Event] | None = None
        # one topic-id allocation at a time per front: the compare-and-set on
        # `meta.next_id` then only races other fronts, never this front's own creates
        self.id_lock = asyncio.Lock()
        # topic id -> the id of its stream, for topics whose records moved to another
        # stream (a durability change across `ephemeral`); absent: the topic's own id
        self.sids: dict[int, int] = {}

    # ---- names -------------------------------------------------------------------------

    def sid(self, topic_id: int) -> int:
        """The id of the stream holding `topic_id`'s records."""
        return self.sids.get(topic_id, topic_id)

    def stream(self, topic_id: int) -> str:
        return self.stream_name(self.sid(topic_id))

    def stream_name(self, sid: int) -> str:
        return f"{self.prefix}_T{sid}"

    def subject(self, topic_id: int, tag: str | None) -> str:
        return f"{self.prefix}.t.{self.sid(topic_id)}.{tag_token(tag)}"

    def retarget(self, topic_id: int, subject: str) -> str:
        """`subject` (a record's, of any stream the topic had) on its current stream."""
        return f"{self.prefix}.t.{self.sid(topic_id)}.{subject.rsplit('.', 1)[-1]}"

    # ---- connection --------------------------------------------------------------------

    async def connect(self) -> int:
        """Connect; return the servers' max payload."""
        import nats
        import nats.js.errors

        # reconnects never give up (-1); the first connection is bounded here instead
        self.nc = await asyncio.wait_for(
            nats.connect(
                servers=self.servers,
                connect_timeout=self.timeout,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                name="topicd",
                # a front never hears its own publishes (its notices to the others)
                no_echo=True,
                # a server that stops answering (stopped, partitioned) is left for another
                # within a few pings rather than after nats-py's default of minutes
                ping_interval=max(0.5, self.timeout / PING_DIVISOR),
                max_outstanding_pings=PINGS_OUTSTANDING,
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected,
            ),
            CONNECT_ATTEMPTS * self.timeout,
        )
        self.connected = asyncio.Event()
        self.connected.set()
        self.js = self.nc.jetstream(timeout=self.timeout)
        return int(self.nc.max_payload)

    async def open_registry(self) -> None:
        """Open the registry bucket, creating it on a cluster that has none."""
        import nats.js.errors
        from nats.js.kv import KeyValue

        assert self.js is not None
        try:
            await self.js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            await self.js.create_key_value(bucket=self.bucket, history=1, replicas=self.replicas)
        # reads of keys go to the bucket stream's leader: a direct get may be answered by
        # any replica, and a replica may not hold yet a write the leader acknowledged (a
        # follower front would then miss a config change, a record delete or a delete)
        self.kv = KeyValue(
            name=self.bucket,
            stream=f"KV_{self.bucket}",
            pre=f"$KV.{self.bucket}.",
            js=self.js,
            direct=False,
        )

    async def _on_error(self, exc: Exception) -> None:
        if str(exc) != str(self.last_error):  # one line per distinct error, no traceback
            log.warning("NATS: %s", str(exc) or type(exc).__name__)
        self.last_error = exc

    async def _on_disconnected(self) -> None:
        if self.connected is not None:
            self.connected.clear()
        if not self.closing:
            log.warning("NATS: disconnected; reconnecting")

    async def _on_reconnected(self) -> None:
        if self.connected is not None:
            self.connected.set()
        self.last_error = None
        nc = self.nc
        url = nc.connected_url if nc is not None else None
        log.warning("NATS: reconnected to %s", url.netloc if url is not None else "?")

    def is_connected(self) -> bool:
        """Whether the client is connected now (one flag the loop sets and clears: read
        from any thread)."""
        connected = self.connected
        return connected is not None and connected.is_set()

    async def wait_connected(self) -> None:
        """Until the client is connected (again)."""
        assert self.connected is not None
        await self.connected.wait()

    async def close(self) -> None:
        """Drain the connection (bounded by one request timeout), else just close it."""
        self.closing = True
        nc, self.nc = self.nc, None
        if nc is None:
            return
        try:
            await asyncio.wait_for(nc.drain(), self.timeout)
        except Exception:
            with contextlib.suppress(Exception):
                await nc.close()

    # ---- registry ----------------------------------------------------------------------

    async def create_key(self, key: str, value: bytes) -> int:
        """`kv.create`: write `key` unless it exists. A create that finds the key raises
        `KeyWrongLastSequenceError`, also when the key was purged between nats-py's
        failed write and the read it then makes (which raised `KeyNotFoundError`): the
        key existed when the create was decided, so the caller's conflict path applies."""
        import nats.js.errors

        assert self.kv is not None
        try:
            return int(await self.kv.create(key, value))
        except nats.js.errors.KeyNotFoundError as exc:
            raise nats.js.errors.KeyWrongLastSequenceError(
                description=f"{key} existed, then was removed: {exc}"
            ) from exc

    async def registry(self) -> tuple[int, dict[int, dict[str, object]]]:
        """(next topic id, every `topic.<id>` entry)."""
        import nats.js.errors

        assert self.kv is not None
        # (listed by the bucket stream's leader: `kv.keys()` may end its listing before
        # the keys its consumer was already sent, and return none)
        keys = ["meta.next_id", *(f"topic.{k}" for k in await self.keys_under("topic."))]
        next_id = 1
        entries: dict[int, dict[str, object]] = {}
        for k in keys:
            try:
                entry = await self.kv.get(k)
            except nats.js.errors.KeyNotFoundError:  # (deleted, or never written)
                continue
            if entry.value is None:
                continue
            if k == "meta.next_id":
                next_id = int(entry.value)
            elif k.startswith("topic."):
                obj = orjson.loads(entry.value)
                assert isinstance(obj, dict)
                obj[REV] = int(entry.revision or 0)
                entries[int(k[6:])] = obj
        return next_id, entries

    async def put_entry(self, topic_id: int, entry: dict[str, JsonValue], last: int | None) -> int:
        """Write `topic.<id>` by compare-and-set: created (`last` None: it must not exist)
        or replacing revision `last`. Returns the new revision; raises when another front
        wrote it first (a deposed owner's registry write fails, like its records)."""
        assert self.kv is not None
        key, value = f"topic.{topic_id}", orjson.dumps(entry)
        if last is None:
            rev = await self.create_key(key, value)
        else:
            rev = await self.kv.update(key, value, last=last)
        await self._notice(topic_id, 0)
        return int(rev)

    async def probe(
        self, topic_id: int, after: int, ask: tuple[str, bytes, float] | None = None
    ) -> tuple[dict[str, object] | None, bool, bytes | None]:
        """(the topic's registry entry or None when gone, whether its stream holds a record
        above seq `after`, the answer to `ask` or None): one round trip for all (the
        entry, the stream's last seq from its leader and the request `ask` =
        (subject, payload, wait) to a front, in parallel)."""
        entry_task = asyncio.ensure_future(self.entry(topic_id))
        ask_task = None if ask is None else asyncio.ensure_future(self.ask(*ask))
        sid = self.sid(topic_id)
        try:
            try:
                _, last = await self.bounds_of(sid)
            except Exception:
                entry, _ = await entry_task
                if entry is None:
                    return None, False, None  # (a deleted topic's stream is gone too)
                if int(str(entry.get("stream", topic_id))) == sid:
                    raise
                last = -1  # (its records moved to another stream: asked below)
            entry, _ = await entry_task
            if entry is not None and int(str(entry.get("stream", topic_id))) != sid:
                # the records moved to another stream since this front last looked
                _, last = await self.bounds_of(int(str(entry["stream"])))
            newer = last > after
            return entry, newer, None if ask_task is None else await ask_task
        finally:
            for task in (entry_task, ask_task):
                if task is not None and not task.done():
                    task.cancel()

    async def ask(self, subject: str, payload: bytes, wait_s: float) -> bytes | None:
        """One request to a front, answered within `wait_s`; None when it is not (no
        front there, slow, disconnected): for what a read may go on without."""
        nc = self.nc
        if nc is None:
            return None
        try:
            msg = await nc.request(subject, payload, wait_s)
        except Exception:
            return None
        if (msg.headers or {}).get("Status"):
            return None
        return bytes(msg.data)

    async def ask_all(self, requests: dict[str, bytes], wait_s: float) -> dict[str, bytes | None]:
        """`ask` each subject its payload, all in parallel: the answers by subject."""
        subjects = list(requests)
        got = await asyncio.gather(*(self.ask(s, requests[s], wait_s) for s in subjects))
        return dict(zip(subjects, got, strict=True))

    async def delete_entry(self, topic_id: int) -> None:
        """Remove `topic.<id>` with every message of its key (no delete marker left), so
        the key listing of `entry_ids` no longer names it."""
        assert self.js is not None
        await self.js.purge_stream(
            f"KV_{self.bucket}", subject=f"$KV.{self.bucket}.topic.{topic_id}"
        )
        await self._notice(topic_id, 0)

    async def allocate_id(self, at_least: int) -> int:
        """A topic id no front was given before: `meta.next_id` (at least `at_least`),
        advanced by compare-and-set, so two fronts never both get one (a deposed owner
        creating a topic included)."""
        async with self.id_lock:
            return await self._allocate_id(at_least)

    async def _allocate_id(self, at_least: int) -> int:
        import nats.js.errors

        assert self.kv is not None
        for attempt in range(ID_ATTEMPTS):
            if attempt:  # lost to another front: step aside a little, more each time
                await asyncio.sleep(ID_BACKOFF_S * attempt * random.uniform(0.5, 1.5))
            try:
                got = await self.kv.get("meta.next_id")
                current, rev = int(got.value or b"1"), int(got.revision or 0)
            except nats.js.errors.KeyNotFoundError:
                current, rev = 1, 0
            tid = max(current, at_least)
            value = str(tid + 1).encode()
            try:
                if rev == 0:
                    await self.create_key("meta.next_id", value)
                else:
                    await self.kv.update("meta.next_id", value, last=rev)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another front took one meanwhile
            return tid
        raise RuntimeError("no topic id after repeated conflicts on meta.next_id")

    async def entry(self, topic_id: int) -> tuple[dict[str, object] | None, int]:
        """(the `topic.<id>` entry or None when absent, its revision or 0)."""
        import nats.js.errors

        assert self.kv is not None
        try:
            got = await self.kv.get(f"topic.{topic_id}")
        except nats.js.errors.KeyNotFoundError:  # (KeyDeletedError too)
            return None, 0
        if got.value is None:
            return None, 0
        obj = orjson.loads(got.value)
        assert isinstance(obj, dict)
        obj[REV] = int(got.revision or 0)
        return obj, int(got.revision or 0)

    async def entry_ids(self) -> set[int]:
        """The ids of every `topic.<id>` key (`keys_under`). A key deleted by an older
        version may still hold its delete marker: its id is listed, and reading its
        entry finds none."""
        return {int(k) for k in await self.keys_under("topic.") if k.isdigit()}

    async def count_keys(self, prefix: str) -> int:
        """How many registry keys start with `prefix` (the total of `keys_under`'s
        listing, from its first page: listed by the bucket stream's leader)."""
        assert self.nc is not None
        msg = await self.nc.request(
            f"$JS.API.STREAM.INFO.KV_{self.bucket}",
            orjson.dumps({"subjects_filter": f"$KV.{self.bucket}.{prefix}*"}),
            timeout=self.timeout,
        )
        resp = orjson.loads(msg.data)
        if "error" in resp:
            raise RuntimeError(f"counting the registry keys {prefix}*: {resp['error']}")
        subjects = resp.get("state", {}).get("subjects") or {}
        return max(int(resp.get("total") or 0), len(subjects))

    async def keys_under(self, prefix: str) -> list[str]:
        """The rest of every registry key starting with `prefix`: the bucket stream's
        subjects, listed by its leader (a key listing through a consumer may be a
        lagging replica's, and miss a key written a moment ago)."""
        assert self.nc is not None
        pre = f"$KV.{self.bucket}.{prefix}"
        out: list[str] = []
        while True:  # (the server answers a long listing in pages)
            msg = await self.nc.request(
                f"$JS.API.STREAM.INFO.KV_{self.bucket}",
                orjson.dumps({"subjects_filter": pre + "*", "offset": len(out)}),
                timeout=self.timeout,
            )
            resp = orjson.loads(msg.data)
            if "error" in resp:
                raise RuntimeError(f"listing the registry keys {prefix}*: {resp['error']}")
            subjects = resp.get("state", {}).get("subjects") or {}
            out.extend(str(s)[len(pre) :] for s in subjects)
            if not subjects or len(out) >= int(resp.get("total") or 0):
                return out

    async def next_id(self) -> int:
        import nats.js.errors

        assert self.kv is not None
        try:
            got = await self.kv.get("meta.next_id")
        except nats.js.errors.KeyNotFoundError:
            return 1
        return int(got.value or b"1")

    async def claim_name(self, name: str, topic_id: int) -> bool:
        """Point the name index at `topic_id`, unless it names another instance whose
        entry exists (a live topic of that name: False). Compare-and-set, so of two
        fronts creating one name (a deposed owner and the new one) only one succeeds."""
        import nats.js.errors

        assert self.kv is not None
        key, value = name_key(name), str(topic_id).encode()
        for _ in range(ID_ATTEMPTS):
            try:
                got = await self.kv.get(key)
                current: int | None = int(got.value) if got.value else None
                rev = int(got.revision or 0)
            except nats.js.errors.KeyNotFoundError:
                current, rev = None, 0
            if current is not None and current != topic_id:
                live, _ = await self.entry(current)
                if live is not None:
                    return False
            try:
                if current is None:
                    await self.create_key(key, value)
                else:
                    await self.kv.update(key, value, last=rev)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            return True
        raise RuntimeError(f"no claim on the name index after repeated conflicts: {name!r}")

    async def put_name(self, name: str, topic_id: int) -> None:
        """The name index: `name.<hex of the name>` = the id of its live instance."""
        assert self.kv is not None
        await self.kv.put(name_key(name), str(topic_id).encode())

    async def delete_name(self, name: str, topic_id: int) -> None:
        """Drop the name index entry, if it still names `topic_id`."""
        import nats.js.errors

        assert self.kv is not None
        try:
            got = await self.kv.get(name_key(name))
        except nats.js.errors.KeyNotFoundError:
            return
        if got.value == str(topic_id).encode():
            with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
                await self.kv.delete(name_key(name), last=got.revision)

    async def lookup_name(self, name: str) -> int | None:
        import nats.js.errors

        assert self.kv is not None
        try:
            got = await self.kv.get(name_key(name))
        except nats.js.errors.KeyNotFoundError:
            return None
        return int(got.value) if got.value else None

    # ---- fronts: the owner lease, forwarding, notifications ---------------------------

    async def lease(self, shard: int = 0) -> tuple[dict[str, object] | None, int]:
        """(the owner lease of `shard`, `front.owner.<shard>`, its revision; 0 when absent)."""
        import nats.js.errors

        assert self.kv is not None
        try:
            got = await self.kv.get(f"{LEASE_KEY}.{shard}")
        except nats.js.errors.KeyNotFoundError:
            return None, 0
        if not got.value:
            return None, int(got.revision or 0)
        obj = orjson.loads(got.value)
        assert isinstance(obj, dict)
        return obj, int(got.revision or 0)

    async def write_lease(
        self, value: dict[str, JsonValue], last: int, shard: int = 0
    ) -> int | None:
        """Compare-and-set a shard's lease (`last` 0: create it); its new revision, or
        None when someone else changed it first."""
        return await self.cas_key(f"{LEASE_KEY}.{shard}", orjson.dumps(value), last)

    async def cas_key(self, key: str, value: bytes, last: int) -> int | None:
        """Compare-and-set `key` at revision `last` (0: create it); its new revision, or
        None when someone else changed it first."""
        import nats.js.errors

        assert self.kv is not None
        try:
            if last == 0:
                return await self.create_key(key, value)
            return int(await self.kv.update(key, value, last=last))
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyValueError):
            return None
        except nats.js.errors.APIError as exc:
            if exc.err_code in (_WRONG_LAST_SEQUENCE_KV, _WRONG_LAST_SEQUENCE):
                return None
            raise

    async def check_shards(self, shards: int) -> int:
        """The deployment's shard count (`meta.shards`): written by the first front,
        returned as found by the others (which refuse to start on another count)."""
        import nats.js.errors

        assert self.kv is not None
        try:
            await self.create_key("meta.shards", str(shards).encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            got = await self.kv.get("meta.shards")
            return int(got.value or b"1")
        return shards

    async def members(self, front: str, until_ms: int, now_ms: int, drop: str | None) -> int:
        """Renew this front's membership (`front.members`: {front id: until ms}), drop
        expired members (and `drop`, a front found gone), by compare-and-set; returns how
        many fronts are members. `until_ms` 0 leaves the membership."""
        import nats.js.errors

        assert self.kv is not None
        for _ in range(ID_ATTEMPTS):
            try:
                got = await self.kv.get(MEMBERS_KEY)
                table = orjson.loads(got.value) if got.value else {}
                rev = int(got.revision or 0)
            except nats.js.errors.KeyNotFoundError:
                table, rev = {}, 0
            assert isinstance(table, dict)
            table = {k: v for k, v in table.items() if int(v) > now_ms and k != drop}
            if until_ms:
                table[front] = until_ms
            else:
                table.pop(front, None)
            try:
                if rev == 0:
                    await self.create_key(MEMBERS_KEY, orjson.dumps(table))
                else:
                    await self.kv.update(MEMBERS_KEY, orjson.dumps(table), last=rev)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            self.member_ids = tuple(table)
            return max(1, len(table))
        raise RuntimeError("front membership: repeated conflicts")

    async def listen(self, subject: str, max_queued: int) -> None:
        """Queue the requests sent to `subject` for `next_requests` (beyond `max_queued`
        waiting, a request is answered at once with a retryable refusal)."""
        assert self.nc is not None
        if self.requests is not None:  # (a start retried after a failed rebuild)
            return
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.requests = queue

        async def got(msg: Msg) -> None:
            if msg.data == PING:  # a front asking whether this one is alive
                await msg.respond(PING)
            elif queue.qsize() >= max_queued:
                await msg.respond(BUSY_REPLY)
            else:
                queue.put_nowait(msg)

        await self.nc.subscribe(subject, cb=got)
        await self.nc.flush(max(1, round(self.timeout)))

    async def alive(self, subject: str, wait_s: float | None = None) -> bool:
        """Whether a front listens on `subject` (False only when the servers know of no
        subscriber: the front's connection is gone)."""
        import nats.errors

        assert self.nc is not None
        try:
            await self.nc.request(subject, PING, wait_s or self.timeout)
        except nats.errors.NoRespondersError:
            return False
        except Exception:
            return True  # slow or unreachable is not proof of death
        return True

    async def next_requests(self) -> list[Msg]:
        """The requests queued so far (waits for one)."""
        queue = self.requests
        assert queue is not None
        out = [await queue.get()]
        while not queue.empty():
            out.append(queue.get_nowait())
        return out

    async def respond(self, msg: Msg, payload: bytes) -> None:
        await msg.respond(payload)

    async def forward(self, subject: str, payload: bytes, wait_s: float = 0.0) -> bytes:
        """One request to the owner front; its answer. Raises on no answer within the
        request timeout plus `wait_s` (the longest the owner may hold the call on
        purpose: a bypassing write's waits, a claim's coalescing window), or as soon as
        the owner is found gone while waiting (a request sent as it was killed is lost
        with it: every `FORWARD_CHECK_S` without an answer, a ping asks whether anyone
        still listens)."""
        import nats.errors

        assert self.nc is not None
        nc = self.nc
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def got(msg: Msg) -> None:
            if (msg.headers or {}).get("Status") == "503":
                if not answer.done():
                    answer.set_exception(nats.errors.NoRespondersError())
            elif not answer.done():
                answer.set_result(bytes(msg.data))

        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=got, max_msgs=1)
        try:
            await nc.publish(subject, payload, reply=inbox)
            deadline = asyncio.get_running_loop().time() + self.timeout + wait_s
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise TimeoutError(f"no answer from {subject}")
                try:
                    return await asyncio.wait_for(
                        asyncio.shield(answer), min(left, FORWARD_CHECK_S)
                    )
                except TimeoutError:
                    if not await self.alive(subject, FORWARD_CHECK_S):
                        raise nats.errors.NoRespondersError() from None
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def follow_notices(self) -> None:
        """Collect the ids of topics the owner reports written (`next_notices`)."""
        assert self.nc is not None
        notified: dict[int, None] = {}  # (in the order they came: `next_notices`)
        wake = asyncio.Event()
        self.notices = (notified, wake)

        async def got(msg: Msg) -> None:
            if self.ignore_notices:  # this front owns every shard: its own notices
                return
            token = msg.subject.rsplit(".", 1)[-1]
            if token.isdigit():
                notified[int(token)] = None
                wake.set()

        await self.nc.subscribe(f"{self.prefix}.n.*", cb=got)

    async def next_notices(self) -> list[int]:
        """The topic ids reported written since the last call (waits for one), in the
        order their first notices came (a watch stream's frames across topics follow it)."""
        assert self.notices is not None
        notified, wake = self.notices
        while not notified:
            wake.clear()
            await wake.wait()
        out = list(notified)
        notified.clear()
        return out

    async def stream_heads(self) -> dict[int, int]:
        """{topic id: last seq} of every stream of this prefix (a listing by the metadata
        leader: current, unlike a replica's; one request per 256 streams)."""
        assert self.nc is not None
        head = f"{self.prefix}_T"
        out: dict[int, int] = {}
        offset = 0
        while True:
            req = {"offset": offset, "subject": f"{self.prefix}.t.>"}
            msg = await self.nc.request(
                "$JS.API.STREAM.LIST", orjson.dumps(req), timeout=self.timeout
            )
            resp = orjson.loads(msg.data)
            if "error" in resp:
                raise RuntimeError(f"listing the streams: {resp['error']}")
            streams = resp.get("streams") or []
            for info in streams:
                name = str(info["config"]["name"])
                if name.startswith(head) and name[len(head) :].isdigit():
                    out[int(name[len(head) :])] = int(info["state"]["last_seq"])
            offset += len(streams)
            if not streams or offset >= int(resp.get("total", 0)):
                return out

    # ---- streams -----------------------------------------------------------------------

    async def create_stream(
        self, topic_id: int, *, memory: bool = False, sid: int | None = None, first_seq: int = 1
    ) -> None:
        """The topic's stream (or stream `sid`): file-backed with `replicas` replicas, or
        (`memory`, an `ephemeral` topic) one replica in a server's memory; its first
        message gets seq `first_seq`."""
        from nats.js import api

        assert self.js is not None
        sid = self.sid(topic_id) if sid is None else sid
        await self.js.add_stream(
            api.StreamConfig(
                name=self.stream_name(sid),
                subjects=[f"{self.prefix}.t.{sid}.*"],
                storage=api.StorageType.MEMORY if memory else api.StorageType.FILE,
                num_replicas=1 if memory else self.replicas,
                allow_direct=True,
                allow_atomic=True,
                deny_delete=False,
                deny_purge=False,
                first_seq=first_seq if first_seq > 1 else None,
            )
        )

    async def delete_stream(self, topic_id: int, *, sid: int | None = None) -> None:
        import nats.js.errors

        assert self.js is not None
        name = self.stream(topic_id) if sid is None else self.stream_name(sid)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_stream(name)

    async def purge_subject(self, sid: int, token: str) -> None:
        """Remove every message of stream `sid` on its subject `token`."""
        assert self.js is not None
        await self.js.purge_stream(self.stream_name(sid), subject=f"{self.prefix}.t.{sid}.{token}")

    async def purge_sid(self, sid: int, below: int) -> None:
        assert self.js is not None
        await self.js.purge_stream(self.stream_name(sid), seq=below)

    async def state(self, topic_id: int) -> tuple[int, int, list[int]]:
        """(first seq, last seq, the seqs deleted between them) of the topic's stream,
        from its leader: which seqs the stream holds, without reading them."""
        assert self.nc is not None
        msg = await self.nc.request(
            f"$JS.API.STREAM.INFO.{self.stream(topic_id)}",
            orjson.dumps({"deleted_details": True}),
            timeout=self.timeout,
        )
        resp = orjson.loads(msg.data)
        if "error" in resp:
            raise RuntimeError(f"stream info of {self.stream(topic_id)}: {resp['error']}")
        st = resp["state"]
        return int(st["first_seq"]), int(st["last_seq"]), [int(s) for s in st.get("deleted") or []]

    async def stream_ids(self) -> list[int]:
        """The topic ids of every stream of this prefix."""
        return sorted(await self.stream_heads())

    async def bounds(self, topic_id: int) -> tuple[int, int]:
        """(first seq, last seq) of the topic's stream."""
        return await self.bounds_of(self.sid(topic_id))

    async def bounds_of(self, sid: int) -> tuple[int, int]:
        """(first seq, last seq) of stream `sid`."""
        assert self.js is not None
        info = await self.js.stream_info(self.stream_name(sid))
        return info.state.first_seq, info.state.last_seq

    async def publish(
        self,
        topic_id: int,
        expected_last: int,
        msgs: list[tuple[str, bytes, dict[str, str]]],
        notice: bool = True,
    ) -> int:
        """Publish `msgs` at seqs `expected_last + 1 ..`: one message, or an atomic batch
        (on the stream their subjects name). Returns the last seq the stream assigned."""
        import nats.js.errors

        assert self.nc is not None
        assert self.js is not None
        fence = str(expected_last)
        if len(msgs) == 1:
            subject, payload, headers = msgs[0]
            headers["Nats-Expected-Last-Sequence"] = fence
            ack = await self.js.publish(subject, payload, headers=headers)
            if notice:
                await self._notice(topic_id, int(ack.seq))
            return int(ack.seq)
        batch_id = self.nc.new_inbox()[7:]  # a unique token
        last = len(msgs)
        for i, (subject, payload, headers) in enumerate(msgs, 1):
            headers["Nats-Batch-Id"] = batch_id
            headers["Nats-Batch-Sequence"] = str(i)
            if i == 1:
                headers["Nats-Expected-Last-Sequence"] = fence
            if i < last:
                await self.nc.publish(subject, payload, headers=headers)
            else:
                headers["Nats-Batch-Commit"] = "1"
                reply = await self.nc.request(subject, payload, self.timeout, headers=headers)
        resp = json.loads(reply.data)
        if "error" in resp:
            raise nats.js.errors.APIError.from_error(resp["error"])
        if notice:
            await self._notice(topic_id, int(resp["seq"]))
        return int(resp["seq"])

    async def notify_topic(self, topic_id: int) -> None:
        """A notice for `topic_id` with no write behind it (its queue changed: the
        other fronts' `/work` streams on it refill)."""
        await self._notice(topic_id, 0)

    async def _notice(self, topic_id: int, seq: int) -> None:
        """Tell the other fronts a write committed (core NATS, buffered: no round trip;
        a notice lost with a crash is made up for by their periodic poll)."""
        nc = self.nc
        if self.notify and nc is not None:
            with contextlib.suppress(Exception):
                await nc.publish(f"{self.prefix}.n.{topic_id}", str(seq).encode())

    async def purge(self, topic_id: int, below: int, tag: str | None = None) -> None:
        """Remove the records below seq `below` (of `tag` only, when given)."""
        assert self.js is not None
        subject = self.subject(topic_id, tag) if tag is not None else None
        await self.js.purge_stream(self.stream(topic_id), seq=below, subject=subject)

    async def delete_msgs(self, topic_id: int, seqs: list[int]) -> None:
        import nats.js.errors

        assert self.js is not None
        name = self.stream(topic_id)
        for seq in seqs:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.js.delete_msg(name, seq)

    async def read(self, topic_id: int, lo: int, hi: int, max_bytes: int) -> list[StoredMsg]:
        """The stored messages of seqs `lo ..= hi` (a batched direct get: at most
        `READ_PAGE` records and about `max_bytes`; at least one if any exists).

        A direct get is answered by any replica, and a replica may lag behind the leader.
        An answer that ends below `hi` with nothing more on its server is checked with the
        leader (one message get of the next stored seq): if the leader holds a record
        there, the answer was a lagging replica's and the read is retried."""
        for _ in range(READ_ATTEMPTS):
            out, more = await self._read_once(topic_id, lo, hi, max_bytes)
            if more or hi >= 1 << 62:
                return out
            after = out[-1].seq + 1 if out else lo
            if after > hi or not await self._leader_has(topic_id, after, hi):
                return out
            await asyncio.sleep(READ_RETRY_S)  # (another replica, or this one caught up)
        raise RuntimeError(f"direct gets from {self.stream(topic_id)} stay behind its leader")

    async def _leader_has(self, topic_id: int, lo: int, hi: int) -> bool:
        """Whether the stream's leader holds a record in `lo ..= hi`."""
        import nats.js.errors

        assert self.js is not None
        try:
            msg = await self.js.get_msg(
                self.stream(topic_id),
                seq=lo,
                subject=f"{self.prefix}.t.{self.sid(topic_id)}.*",
                next=True,
            )
        except nats.js.errors.NotFoundError:
            return False
        return msg.seq is not None and int(msg.seq) <= hi

    async def _read_once(
        self, topic_id: int, lo: int, hi: int, max_bytes: int
    ) -> tuple[list[StoredMsg], bool]:
        """One batched direct get: (the messages of `lo ..= hi` it returned, whether its
        server holds more after them: a limit ended the batch, not the stream)."""
        assert self.nc is not None
        nc = self.nc
        out: list[StoredMsg] = []
        pending = [0]  # the server's messages after the last one returned
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def collect(msg: Msg) -> None:
            headers = msg.headers or {}
            status = headers.get("Status")
            if status is not None:  # 204: end of the batch; 404: nothing at or after lo
                if not done.done():
                    done.set_result(status)
                return
            seq = int(headers["Nats-Sequence"])
            pending[0] = int(headers.get("Nats-Num-Pending", 0))
            if seq <= hi:
                out.append(StoredMsg(seq, msg.data, headers))
            else:
                pending[0] += 1  # (a record past `hi`: the stream reaches past it)

        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=collect)
        try:
            req = {"seq": lo, "batch": min(hi - lo + 1, READ_PAGE), "max_bytes": max_bytes}
            await nc.publish(
                f"$JS.API.DIRECT.GET.{self.stream(topic_id)}", orjson.dumps(req), reply=inbox
            )
            status = await asyncio.wait_for(done, self.timeout)
        finally:
            with contextlib.suppress(Exception):  # (a draining connection at shutdown)
                await sub.unsubscribe()
        if status not in ("204", "404"):
            raise RuntimeError(f"direct get from {self.stream(topic_id)}: status {status}")
        return out, status == "204" and pending[0] > 0


def _encode_msgs(
    store: JetStreamStore, batches: list[AppendBatch]
) -> list[tuple[str, bytes, dict[str, str]]]:
    msgs: list[tuple[str, bytes, dict[str, str]]] = []
    for batch in batches:
        p = batch.prepared
        tid = batch.topic.topic_id
        for i, enc in enumerate(batch.encs):
            headers = {H_SIZE: str(p.sizes[i])}
            tag = p.tags.get(i) if p.tags else None
            extra: dict[str, object] = {}
            if tag is not None:
                extra["t"] = tag
            if p.nodes and i in p.nodes:
                extra["n"] = p.nodes[i]
            if p.prios and i in p.prios:
                extra["p"] = p.prios[i]
            if p.shapes and i in p.shapes:
                extra["s"] = list(p.shapes[i])
            if extra:
                headers[H_EXTRA] = json.dumps(extra, separators=(",", ":"))
            if i == 0:
                headers[H_COUNT] = str(batch.count)
                if batch.idem_key is not None:
                    headers[H_KEY] = json.dumps(batch.idem_key)
            msgs.append((store.subject(tid, tag), enc, headers))
    return msgs


# the record deletes a registry entry keeps, for the other fronts to apply
DELETES_KEPT: Final = 64


def _entry(
    topic: Topic, deletes: list[JsonValue] | None = None, lane: _Lane | None = None
) -> dict[str, JsonValue]:
    runs: list[JsonValue] = [[lo, hi, reason] for lo, hi, reason in topic.export_evictions()]
    out: dict[str, JsonValue] = {
        "id": topic.topic_id,
        "name": topic.name,
        "config": topic.config.to_wire(),
        "floor": topic.evict_floor,
        "runs": runs,
        "last_write_ts": topic.last_write_ts,
    }
    if deletes:
        out["deletes"] = list(deletes)
    if lane is not None and lane.memory:
        out["storage"] = "memory"
        out["reserved"] = lane.reserved
    if lane is not None and lane.feed:
        out["feed"] = {k: list(v) for k, v in lane.feed.items()}
    if lane is not None and lane.sid and lane.sid != topic.topic_id:
        out["stream"] = lane.sid
    if lane is not None and lane.move is not None:
        out["move"] = list(lane.move)
    return out


class JetStreamBackend:
    """`StorageBackend` on JetStream (see the module docstring)."""

    def __init__(self, cfg: Config, bridge: AsyncioBridge, store: JetStreamStore) -> None:
        self.cfg = cfg
        self.bridge = bridge
        self.store = store
        self._hooks: CommitHooks | None = None
        self.engine: Engine | None = None
        self._lanes: dict[int, _Lane] = {}
        self._nursery: trio.Nursery | None = None
        self._busy = 0  # lanes publishing
        self._idle: trio.Event | None = None  # set when the last busy lane finishes
        self.published_batches = 0  # JetStream publishes (several writes may share one)
        self.fronts: Fronts | None = None  # this front's role (set once rebuilt)
        self.slots: JsSlots | None = None  # the deployment's connection caps (`jsslots`)
        self.failures = 0
        # topic ids are taken one at a time per front: concurrent creates would otherwise
        # contend on `meta.next_id`'s compare-and-set and use up its retries
        self._id_lock = trio.Lock()
        self.journals = Journals(self)  # queue topics' journals (`storage/jsqueues.py`)

    async def _call(self, factory: Callable[[], Coroutine[object, object, _T]]) -> _T:
        """Run a client call; a failure is `503 storage_unavailable` (retryable)."""
        try:
            return await self.bridge.call(factory)
        except TopicdError:
            raise
        except Exception as exc:
            raise StorageUnavailable(
                f"JetStream: {str(exc) or type(exc).__name__}", {"backend": "jetstream"}
            ) from exc

    def lane(self, topic: Topic) -> _Lane:
        lane = self._lanes.get(topic.topic_id)
        if lane is None:
            lane = self._lanes[topic.topic_id] = _Lane(topic)
        return lane

    # ---- lifecycle ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await trio.sleep(FLOOR_INTERVAL_S)
                await self.write_floors()
                await self.compact_journals()

    async def drain(self) -> None:
        """Wait for every accepted write to be published or failed, then write floors."""
        while self._busy:
            self._idle = trio.Event()
            await self._idle.wait()
        await self.write_floors()

    # ---- CommitPath --------------------------------------------------------------------

    def attach(self, hooks: CommitHooks) -> None:
        self._hooks = hooks

    def admit(self, topic: Topic, nbytes: int, *, bypass: bool = False) -> None:
        lane = self._lanes.get(topic.topic_id)
        if lane is not None and lane.diverged:
            if not lane.resyncing and self._nursery is not None:
                lane.resyncing = True
                self._nursery.start_soon(self._resync_task, lane)
            raise StorageUnavailable(
                f"topic {topic.name!r}: its stream is being read back after a failed "
                "JetStream write; retry shortly",
                {"topic": topic.name, "backend": "jetstream"},
            )
        w = self.cfg.storage.wal
        if (
            not bypass
            and lane is not None
            and lane.full(nbytes, w.max_pending_per_topic, w.max_pending_bytes_per_topic)
        ):
            retry = self.engine.retry_hint_ms() if self.engine is not None else 100
            raise Throttled.pressure(retry, cause="wal_ingest", scope="topic")

    async def _resync_task(self, lane: _Lane) -> None:
        try:
            await self.resync(lane.topic)
        finally:
            lane.resyncing = False

    async def resync(self, topic: Topic) -> bool:
        """Make memory match the stream again after a write whose outcome was unknown or
        whose fence failed: records the stream holds above the topic's head (the lost
        write's, or another writer's) are read in, then writes resume. False (still
        refusing writes) when the stream cannot be read or is behind memory."""
        lane = self.lane(topic)
        async with lane.resync_lock:  # one read-back at a time (admit starts them too)
            return await self._resync(lane, topic)

    async def _resync(self, lane: _Lane, topic: Topic) -> bool:
        engine = self.engine
        assert engine is not None
        if lane.busy or lane.pending or topic.deleted:
            await trio.lowlevel.checkpoint()
            return False
        try:
            if lane.move is not None:  # a stream move whose outcome this front lost
                async with lane.registry_lock:
                    await self.finish_move(topic, lane)
            last = await self._last_seq(lane)
            if last < topic.head_seq and lane.memory:
                await self._lost(lane, topic, last)
            elif last < topic.head_seq:
                log.error(
                    "topic %r: its stream ends at %d, below the head %d in memory",
                    topic.name,
                    last,
                    topic.head_seq,
                )
                return False
            if last > topic.head_seq:
                loaded = await _load_topic(
                    engine, self, topic, engine.clock.now_ms, topic.head_seq + 1
                )
                engine.durable(topic, topic.head_seq)
                self._release(topic)
                log.warning("topic %r: %d records read back from its stream", topic.name, loaded)
        except Exception as exc:
            log.warning("topic %r: the stream cannot be read back yet: %s", topic.name, exc)
            return False
        topic.next_seq = topic.head_seq + 1
        lane.diverged = False
        return True

    async def _last_seq(self, lane: _Lane) -> int:
        """The last seq of the lane's stream. An `ephemeral` topic's stream missing (its
        server restarted on its own, not in a cluster, and forgot it) is created again,
        empty: last seq 0."""
        import nats.js.errors

        tid = lane.topic.topic_id
        try:
            _, last = await self._call(partial(self.store.bounds, tid))
        except StorageUnavailable as exc:
            if not lane.memory or not isinstance(exc.__cause__, nats.js.errors.NotFoundError):
                raise
            await self._call(partial(self.store.create_stream, tid, memory=True))
            return 0
        return last

    async def _lost(self, lane: _Lane, topic: Topic, last: int) -> None:
        """An `ephemeral` topic's stream ends below the head in memory: the server that
        held it in memory restarted and lost its records. They are gone, as the class
        allows, and their seqs are not handed out again: the head moves up to the
        reservation (every seq acknowledged lies at or below it), and the loss is a record
        delete below the head (purging the emptied stream up to it moves the stream's
        next seq there too), which the entry carries to the other fronts, so every front
        reads the same silent gap."""
        engine = self.engine
        assert engine is not None
        head = max(topic.head_seq, lane.reserved)
        log.warning(
            "topic %r: its in-memory stream lost its records (it ends at %d, the head is "
            "%d); resuming above seq %d",
            topic.name,
            last,
            topic.head_seq,
            head,
        )
        topic.skip_to(head)
        body: dict[str, object] = {"before_seq": head + 1, "match": None, "bound": head}
        await self._delete_records(
            topic,
            body,
            lambda: engine.apply_records_delete(topic, head + 1, None, head, engine.clock.now_ms()),
        )
        engine.durable(topic, topic.head_seq)

    def backlog_full(self, topic: Topic) -> bool:
        return False  # no checkpoint: nothing is pinned in memory waiting to be absorbed

    async def wait_backlog(self) -> None:
        await trio.lowlevel.checkpoint()

    def govern(self, pressure: float, commit_window_ms: float | None) -> None:
        return None

    def pool_loads(self, now: float) -> list[tuple[str, float, int]]:
        return []

    def backlog_ratio(self) -> float:
        return 0.0

    def check_stalls(self, now: float) -> None:
        return None

    async def wait_for_room(self, topic: Topic, nbytes: int) -> None:
        lane = self.lane(topic)
        w = self.cfg.storage.wal
        while lane.full(nbytes, w.max_pending_per_topic, w.max_pending_bytes_per_topic):
            if lane.room is None:
                lane.room = trio.Event()
            await lane.room.wait()
        await trio.lowlevel.checkpoint()

    def submit(self, batch: AppendBatch) -> None:
        if self.fronts is not None:
            self.fronts.submitted(batch.topic)  # (the order of live watch frames)
        lane = self.lane(batch.topic)
        lane.pending.append(batch)
        lane.accepted += 1
        lane.accepted_bytes += batch.nbytes
        if not lane.busy:
            lane.busy = True
            self._busy += 1
            assert self._nursery is not None
            self._nursery.start_soon(self._publish_lane, lane)

    async def _publish_lane(self, lane: _Lane) -> None:
        """Publish the lane's batches in seq order, several writes per JetStream batch."""
        hooks = self._hooks
        assert hooks is not None
        try:
            while lane.pending:
                async with lane.publish_lock:  # (a stream move holds it: wait for it)
                    if lane.pending:
                        await self._publish_next(lane, hooks)
        finally:
            lane.busy = False
            if lane.idle is not None:
                lane.idle.set()
                lane.idle = None
            self._busy -= 1
            if not self._busy and self._idle is not None:
                self._idle.set()

    async def wait_idle(self, lane: _Lane, wait_s: float) -> bool:
        """Wait until `lane` publishes nothing (its writes settled), `wait_s` at most;
        whether it is idle."""
        with trio.move_on_after(wait_s):
            while lane.busy or lane.pending:
                if lane.idle is None:
                    lane.idle = trio.Event()
                await lane.idle.wait()
        await trio.lowlevel.checkpoint()
        return not (lane.busy or lane.pending)

    async def _publish_next(self, lane: _Lane, hooks: CommitHooks) -> None:
        """Publish the next batch of router copies, or the next writes (as many as one
        JetStream batch holds)."""
        first = lane.pending.popleft()
        if isinstance(first, CopyBatch):
            await self._publish_copies(lane, first)
            return
        group = [first]
        total = first.count
        while lane.pending and total + lane.pending[0].count <= BATCH_MAX:
            nxt = lane.pending[0]
            if isinstance(nxt, CopyBatch):
                break
            total += nxt.count
            group.append(nxt)
            lane.pending.popleft()
        topic = lane.topic
        expected = group[0].first_seq - 1
        msgs = _encode_msgs(self.store, group)
        t0 = trio.current_time()
        reserved = True
        if lane.memory and expected + total > lane.reserved:
            try:
                await self._reserve(lane, expected + total, total)
            except TopicdError as exc:  # nothing was published
                log.warning("topic %r: no seq reservation: %s", topic.name, exc)
                reserved = False
        try:
            if not reserved:
                committed = False
            else:
                last = await self.bridge.call(  # raw errors: `_settle` tells them apart
                    partial(self.store.publish, topic.topic_id, expected, msgs)
                )
                committed = last == expected + total
                if not committed:
                    log.error(
                        "topic %r: JetStream stored seqs up to %d, expected %d",
                        topic.name,
                        last,
                        expected + total,
                    )
                    lane.diverged = True
        except Exception as exc:
            committed = await self._settle(lane, expected, msgs, exc)
        ms = (trio.current_time() - t0) * 1000
        self.published_batches += 1
        if committed:
            for batch in group:
                batch.wal_append_ms = ms
                lane.settled(batch)
                hooks.publish_append(batch)
            self._release(topic)
        else:
            self.failures += 1
            error = _write_failed(topic)
            for batch in group:
                lane.settled(batch)
                hooks.fail_append(batch, error)
            self._fail_queued(lane, error)
            hooks.rewind(topic)

    def _fail_queued(self, lane: _Lane, error: TopicdError) -> None:
        """A publish failed: what is queued behind it expected its seqs and fails too."""
        hooks = self._hooks
        assert hooks is not None
        queued = list(lane.pending)
        lane.pending.clear()
        for item in queued:
            if isinstance(item, CopyBatch):
                item.done(False)
            else:
                lane.settled(item)
                hooks.fail_append(item, error)

    def submit_copies(self, topic: Topic, batch: CopyBatch) -> None:
        """Queue router copies for `topic`'s stream (their seqs are reserved in memory)."""
        lane = self.lane(topic)
        lane.pending.append(batch)
        if not lane.busy:
            lane.busy = True
            self._busy += 1
            assert self._nursery is not None
            self._nursery.start_soon(self._publish_lane, lane)

    async def _publish_copies(self, lane: _Lane, batch: CopyBatch) -> None:
        """Publish one batch of router copies at its reserved seqs (fenced, settled and
        failed exactly as a write is)."""
        hooks = self._hooks
        assert hooks is not None
        topic = lane.topic
        expected = batch.first_seq - 1
        # (made before a stream move, published after it: the subjects of the new stream)
        batch.msgs = [(self.store.retarget(topic.topic_id, m[0]), m[1], m[2]) for m in batch.msgs]
        try:
            if lane.memory and expected + batch.count > lane.reserved:
                await self._reserve(lane, expected + batch.count, batch.count)
        except TopicdError as exc:  # nothing was published
            log.warning("topic %r: no seq reservation: %s", topic.name, exc)
            committed = False
        else:
            try:
                last = await self.bridge.call(
                    partial(self.store.publish, topic.topic_id, expected, batch.msgs)
                )
                committed = last == expected + batch.count
                if not committed:
                    lane.diverged = True
            except Exception as exc:
                committed = await self._settle(lane, expected, batch.msgs, exc)
        self.published_batches += 1
        if committed:
            batch.done(True)
            self._release(topic)
            return
        self.failures += 1
        batch.done(False)
        self._fail_queued(lane, _write_failed(topic))
        hooks.rewind(topic)

    async def _reserve(self, lane: _Lane, last: int, count: int) -> None:
        """Reserve the seqs of an `ephemeral` topic's publish up to `last` (and
        `storage.wal.ephemeral_head_reserve_ahead` more, or 4 × its `count`) in its
        registry entry before publishing: about one publish in 65536 waits for it. Its
        stream lives in one server's memory; if that server restarts, the seqs handed out
        are known only from here."""
        ahead = max(self.cfg.storage.wal.ephemeral_head_reserve_ahead, 4 * count)
        topic = lane.topic
        async with lane.registry_lock:
            if topic.deleted:
                raise TopicNotFound(topic.name)
            if last <= lane.reserved:
                return
            new = last + ahead
            await self._put_entry(topic, lane, lambda: lane.entry() | {"reserved": new})
            lane.reserved = max(lane.reserved, new)

    async def _settle(
        self,
        lane: _Lane,
        expected: int,
        msgs: list[tuple[str, bytes, dict[str, str]]],
        exc: Exception,
    ) -> bool:
        """A publish raised: decide whether it committed.

        A server's answer (an API error: wrong last sequence, no such stream, a refused
        batch) is final: not committed; a wrong last sequence means someone else moved
        the stream, so memory cannot be trusted for this topic any more. Anything else
        (a timeout, a lost connection) leaves the outcome open: the stream says whether
        our last record sits at the seq it was meant for."""
        import nats.js.errors

        topic = lane.topic
        if topic.deleted:
            return False
        if isinstance(exc, nats.js.errors.APIError):
            if exc.err_code == _WRONG_LAST_SEQUENCE:
                log.error("topic %r: the stream moved under this front: %s", topic.name, exc)
                lane.diverged = True
            else:
                log.warning("topic %r: JetStream refused a write: %s", topic.name, exc)
            return False
        target = expected + len(msgs)
        try:
            _, last = await self._call(partial(self.store.bounds, topic.topic_id))
            stored = (
                await self._call(partial(self.store.read, topic.topic_id, target, target, 1))
                if last >= target
                else []
            )
        except Exception as again:
            log.error(
                "topic %r: JetStream write failed (%s); its outcome is unknown (%s)",
                topic.name,
                exc,
                again,
            )
            lane.diverged = True
            return False
        if stored and stored[0].seq == target and stored[0].data == msgs[-1][1]:
            return True  # it landed: the answer was lost
        if last != expected:
            lane.diverged = True
        log.warning("topic %r: JetStream write failed: %s", topic.name, exc)
        return False

    def _release(self, topic: Topic) -> None:
        """Published records are in the stream: the payload cache may drop them. A router
        source keeps the records its feeds have not handled yet (up to `ROUTER_PIN_MAX`
        of them) in memory, so copies are made from memory, in arrival order, as on the
        embedded backend (whose unabsorbed records stay in memory); a feed further
        behind reads the rest back from the stream."""
        engine = self.engine
        if engine is None or topic.deleted:
            return
        upto = topic.head_seq
        routers = engine.routers
        dests = routers.by_source.get(topic)
        if dests:
            behind = min(r.cursor for d in dests for r in routers.feed(d))
            upto = max(min(upto, behind), upto - ROUTER_PIN_MAX)
        engine.payloads.release(topic, upto)

    async def control(
        self,
        topic: Topic,
        frame: bytes | None,
        apply: Callable[[], _T],
        *,
        sync: bool = True,
        abandoned: Callable[[], None] | None = None,
    ) -> _T:
        """Make a control mutation durable in JetStream, then `apply` it (see
        `CommitPath.control`). `apply` is always the last step, so anything raised here,
        a cancellation included, means the mutation will never be applied."""
        try:
            return await self._control(topic, frame, apply)
        except BaseException:
            if abandoned is not None:
                abandoned()
            raise

    async def _topic_keys(self) -> int:
        return await self.store.count_keys("topic.")

    async def _control(self, topic: Topic, frame: bytes | None, apply: Callable[[], _T]) -> _T:
        if frame is None:
            await trio.lowlevel.checkpoint()
            return apply()
        parsed = frames.read_frame(frame, 0, len(frame), len(frame) + 1)
        assert parsed is not None
        ftype = parsed.ftype
        body = parsed.control()
        tid = topic.topic_id
        if ftype == frames.TOPIC_CREATE:
            cap = self.cfg.limits.max_topics
            # other fronts create and delete topics too, and this front learns of
            # theirs only once their notices arrive: the deployment's count is the
            # registry's entries, read here (`Engine._create` leaves the cap to this).
            # A create racing one on another owner may still pass with it; creates one
            # after another, through any fronts, never do
            forwards = self.engine is not None and self.engine.forward is not None
            if cap and forwards and await self._call(self._topic_keys) >= cap:
                raise Throttled.limit("max_topics", cap)
            config = topic.config.to_wire()
            memory = config.get("durability") == "ephemeral"
            # the id comes from the registry (the engine's guess is its lower bound): the
            # topic is not registered anywhere yet, so it may still change. Its lane is
            # made once the id is the topic's (the guess may be another's id by then)
            async with self._id_lock:
                got = await self._call(partial(self.store.allocate_id, tid))
            topic.topic_id = tid = got
            lane = self.lane(topic)
            assert lane.topic is topic
            lane.memory = memory
            if self.engine is not None:
                self.engine.next_topic_id = max(self.engine.next_topic_id, tid + 1)
            async with lane.registry_lock:
                # the name first: a crash after it leaves an index entry naming an id with
                # no entry, which the next claim of the name replaces
                if not await self._call(partial(self.store.claim_name, topic.name, tid)):
                    raise StorageUnavailable(
                        f"topic {topic.name!r} was created by another front; retry",
                        {"topic": topic.name, "backend": "jetstream"},
                    )
                await self._call(partial(self.store.create_stream, tid, memory=memory))
                if topic.config.type == "queue":
                    await self.journals.create(tid)
                lane.entry_rev = await self._call(
                    partial(self.store.put_entry, tid, lane.entry(), None)
                )
            return apply()
        lane = self.lane(topic)
        if ftype == frames.TOPIC_CONFIG:
            wire = body["config"]
            assert isinstance(wire, dict)
            if topic.deleted:
                raise TopicNotFound(topic.name)
            if (wire.get("durability") == "ephemeral") != lane.memory:
                # `ephemeral` lives in an R1 memory stream, the rest in replicated file
                # streams: the records move to a new stream of the other kind
                return await self.move_stream(topic, lane, wire, apply)
            async with lane.registry_lock:
                # the new config with the current floor: evictions the new caps cause
                # are redone by a rebuild until the floor task stores them
                await self._put_entry(topic, lane, lambda: lane.entry() | {"config": wire})
                return apply()
        if ftype == frames.TOPIC_DELETE:
            async with lane.registry_lock:
                await self._call(partial(self.store.delete_entry, tid))
                try:
                    result = apply()
                except BaseException:  # `if_empty` and a write landed meanwhile
                    entry = lane.entry()
                    with trio.CancelScope(shield=True):
                        lane.entry_rev = await self._call(
                            partial(self.store.put_entry, tid, entry, None)
                        )
                    raise
            with contextlib.suppress(TopicdError):  # a stale index entry is harmless
                await self._call(partial(self.store.delete_name, topic.name, tid))
            self._lanes.pop(tid, None)
            assert self._nursery is not None
            self._nursery.start_soon(self._delete_stream, topic, lane.move)
            return result
        if ftype == frames.RECORDS_DELETE and "seqs" not in body:
            return await self._delete_records(topic, body, apply)
        if ftype == frames.RECORDS_DELETE:  # a queue's ack or dead-letter move
            seqs = body["seqs"]
            assert isinstance(seqs, list)
            return await self.journals.ack(topic, [int(s) for s in seqs], apply)
        if ftype == frames.LEASE:
            return await self.journals.lease(topic, body, apply)
        from topicd.storage.jsrouters import JsRouters

        routers = self.engine.routers if self.engine is not None else None
        if ftype in _ROUTER_FRAMES and isinstance(routers, JsRouters):
            return await routers.control(ftype, topic, body, apply)
        await trio.lowlevel.checkpoint()
        raise not_supported(_FEATURES.get(ftype, f"storage operation {ftype}"))

    async def _put_entry(
        self, topic: Topic, lane: _Lane, build: Callable[[], dict[str, JsonValue]]
    ) -> None:
        """Replace the topic's registry entry (revision `lane.entry_rev`) with `build()`.

        Another front wrote it since (a deposed owner that had not noticed yet): if this
        front still holds the lease, it adopts that write (the config, record deletes and
        floor it carries were acknowledged to a client) and writes its own on top once;
        otherwise the conflict stands (`503`: this front is the deposed one)."""
        tid = topic.topic_id
        try:
            lane.entry_rev = await self._call(
                partial(self.store.put_entry, tid, build(), lane.entry_rev)
            )
            return
        except StorageUnavailable:
            fronts = self.fronts
            if fronts is None or not await fronts.holds_lease(topic.name):
                raise
        entry, _ = await self._call(partial(self.store.entry, tid))
        if entry is None or topic.deleted:
            raise TopicNotFound(topic.name)
        fronts.adopt(topic, lane, entry)
        log.warning("topic %r: adopted a registry entry another front wrote", topic.name)
        lane.entry_rev = await self._call(
            partial(self.store.put_entry, tid, build(), lane.entry_rev)
        )

    # ---- stream moves (a durability change across `ephemeral`) -----------------------

    def set_sid(self, lane: _Lane, sid: int) -> None:
        """The topic's records are in stream `sid` from now on."""
        tid = lane.topic.topic_id
        lane.sid = 0 if sid == tid else sid
        if sid == tid:
            self.store.sids.pop(tid, None)
        else:
            self.store.sids[tid] = sid

    async def move_stream(
        self, topic: Topic, lane: _Lane, wire: dict[str, JsonValue], apply: Callable[[], _T]
    ) -> _T:
        """A config change whose durability crosses `ephemeral`: the records move to a new
        stream (R1 memory for `ephemeral`, else file-backed with `replicas` replicas) at
        their seqs, then the registry entry names it (the commit point), then the old
        stream goes (docs/jetstream.md, "Durability changes").

        Writes queue up meanwhile (the lane's publish lock) and go to the new stream;
        record deletes and floors (the registry lock) and a queue's acks (its journal
        lock, after those in flight finished) wait too, so the copy is exact. A crash
        at any step leaves the entry naming one stream, old or new, and recording the
        move (`move`): a restart or a takeover keeps the one named and deletes the
        other (`finish_move`)."""
        memory = wire.get("durability") == "ephemeral"
        tid = topic.topic_id
        async with lane.publish_lock, lane.registry_lock:
            if topic.deleted:
                raise TopicNotFound(topic.name)
            if lane.diverged:
                raise StorageUnavailable(
                    f"topic {topic.name!r}: its stream is being read back; retry shortly",
                    {"topic": topic.name, "backend": "jetstream"},
                )
            if lane.move is not None:  # (one left unsettled by an earlier failure)
                await self.finish_move(topic, lane)
            if (wire.get("durability") == "ephemeral") == lane.memory:
                await self._put_entry(topic, lane, lambda: lane.entry() | {"config": wire})
                return apply()
            if topic.queue is None:
                return await self._move(topic, lane, wire, memory, apply)
            async with self.journals.lock(tid):
                await self.journals.settled(tid)
                return await self._move(topic, lane, wire, memory, apply)

    async def _move(
        self,
        topic: Topic,
        lane: _Lane,
        wire: dict[str, JsonValue],
        memory: bool,
        apply: Callable[[], _T],
    ) -> _T:
        store = self.store
        engine = self.engine
        assert engine is not None
        tid = topic.topic_id
        old = store.sid(tid)
        async with self._id_lock:
            new = await self._call(partial(store.allocate_id, engine.next_topic_id))
        engine.next_topic_id = max(engine.next_topic_id, new + 1)
        # the intent first: a crash from here on leaves a move the entry records
        await self._put_entry(topic, lane, lambda: lane.entry() | {"move": [old, new]})
        lane.move = [old, new]
        fault("move.after_intent")
        try:
            await self._copy_stream(topic, lane, old, new, memory)
            fault("move.after_copy")
            entry = lane.entry() | {"config": wire, "stream": new}
            if memory:
                ahead = self.cfg.storage.wal.ephemeral_head_reserve_ahead
                entry["storage"] = "memory"
                entry["reserved"] = max(lane.reserved, topic.head_seq + ahead)
            else:
                entry.pop("storage", None)
                entry.pop("reserved", None)
            # the commit point (compare-and-set: a front that took the topic over or
            # settled the move since makes it fail)
            lane.entry_rev = await self._call(partial(store.put_entry, tid, entry, lane.entry_rev))
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(store.timeout * 4):
                try:
                    await self.finish_move(topic, lane)
                except Exception as exc:  # (settled at the next read-back or takeover)
                    log.warning("topic %r: stream move not settled yet: %s", topic.name, exc)
                    lane.diverged = True
            raise
        self.set_sid(lane, new)
        lane.memory = memory
        reserved = entry.get("reserved")
        if isinstance(reserved, int):
            lane.reserved = reserved
        fault("move.after_switch")
        result = apply()
        log.info("topic %r: records moved to stream %s", topic.name, store.stream_name(new))
        try:  # committed: what fails here, a read-back, restart or takeover finishes
            await self._call(partial(store.delete_stream, tid, sid=old))
            if topic.evict_floor > 1:  # (records copied, then evicted during the copy)
                await self._call(partial(store.purge, tid, topic.evict_floor))
            await self._put_entry(topic, lane, lambda: _without_move(lane.entry()))
            lane.move = None
        except TopicdError as exc:
            log.warning("topic %r: the old stream is not removed yet: %s", topic.name, exc)
        return result

    async def _copy_stream(
        self, topic: Topic, lane: _Lane, old: int, new: int, memory: bool
    ) -> None:
        """Create stream `new` and copy the topic's records from stream `old` at their
        seqs: every live record (its stored bytes and headers: tags, idempotency keys,
        router cursors), router hole and trim markers; a seq holding nothing gets a filler
        message, purged at the end, so the new stream ends at the topic's head."""
        store = self.store
        tid = topic.topic_id
        head = topic.head_seq
        first, last = await self._call(partial(store.bounds_of, old))
        if last != head:
            # another writer (a deposed owner), or a memory stream emptied by a server
            # restart: the read-back settles it first
            lane.diverged = True
            raise StorageUnavailable(
                f"topic {topic.name!r}: its stream ends at {last}, not at the head {head}; "
                "retry shortly",
                {"topic": topic.name, "backend": "jetstream"},
            )
        start = max(first, topic.evict_floor)
        await self._call(partial(store.create_stream, tid, memory=memory, sid=new, first_seq=start))
        fault("move.after_create")
        base = f"{store.prefix}.t.{new}."
        out: list[tuple[str, bytes, dict[str, str]]] = []
        kept: list[int] = []
        expected = start - 1
        at = start  # the new stream's next seq

        async def flush(all_of_it: bool) -> None:
            nonlocal expected
            while len(out) >= (1 if all_of_it else BATCH_MAX):
                chunk = out[:BATCH_MAX]
                del out[:BATCH_MAX]
                got = await self._call(partial(store.publish, tid, expected, chunk, False))
                if got != expected + len(chunk):
                    raise StorageUnavailable(
                        f"topic {topic.name!r}: the new stream took seqs up to {got}",
                        {"topic": topic.name, "backend": "jetstream"},
                    )
                expected = got

        seq = start
        while seq <= head:
            msgs = await self._call(partial(store.read, tid, seq, head, READ_PAGE_BYTES))
            if not msgs:
                break
            for m in msgs:
                out.extend((base + FILLER, b"", {}) for _ in range(m.seq - at))
                headers = {k: v for k, v in m.headers.items() if k.startswith("Topicd-")}
                if H_SLOT in headers or topic.live(m.seq):
                    if H_SLOT not in headers:
                        kept.append(m.seq)
                    token = tag_token(_extras(headers).get("t"))  # type: ignore[arg-type]
                    out.append((base + token, bytes(m.data), headers))
                elif H_FEED in headers:  # (a dead record carrying router cursors)
                    out.append((base + "_", b"", {H_SLOT: "hole", H_FEED: headers[H_FEED]}))
                else:
                    out.append((base + FILLER, b"", {}))
                at = m.seq + 1
                await flush(False)
            seq = msgs[-1].seq + 1
        while at <= head:
            n = min(head - at + 1, BATCH_MAX)
            out.extend((base + FILLER, b"", {}) for _ in range(n))
            at += n
            await flush(False)
        await flush(True)
        await self._call(partial(store.purge_subject, new, FILLER))
        # every record memory holds must be in the new stream (a memory stream that lost
        # them to a server restart would hand fewer)
        if sum(1 for s in kept if topic.live(s)) != topic.count:
            lane.diverged = True
            raise StorageUnavailable(
                f"topic {topic.name!r}: its stream does not hold every record; retry shortly",
                {"topic": topic.name, "backend": "jetstream"},
            )

    async def finish_move(self, topic: Topic, lane: _Lane) -> None:
        """Settle a stream move the registry entry records: the stream it names stays,
        the other is deleted. The entry is rewritten without the move first (compare-and
        -set, so a mover still at work fails its switch), then the stream goes. The
        entry's config, stream and the rest are taken as found (a switch whose answer
        was lost did commit)."""
        store = self.store
        tid = topic.topic_id
        entry, _ = await self._call(partial(store.entry, tid))
        if entry is None:
            raise TopicNotFound(topic.name)
        fronts = self.fronts
        assert fronts is not None
        fronts.adopt(topic, lane, entry)
        move = lane.move
        if move is None:
            return
        current = store.sid(tid)
        lane.move = None
        try:
            lane.entry_rev = await self._call(
                partial(store.put_entry, tid, lane.entry(), lane.entry_rev)
            )
        except BaseException:
            lane.move = move
            raise
        dead = move[0] if current == move[1] else move[1]
        log.warning(
            "topic %r: a stream move %s: stream %s removed",
            topic.name,
            "finished" if dead == move[0] else "rolled back",
            store.stream_name(dead),
        )
        await self._call(partial(store.delete_stream, tid, sid=dead))

    async def _delete_stream(self, topic: Topic, move: list[int] | None = None) -> None:
        """A deleted topic's stream goes after the answer (its registry entry is gone, so
        a stream left behind by a failure here is an orphan the next start removes),
        with the other stream of a move its entry still recorded."""
        try:
            await self._call(partial(self.store.delete_stream, topic.topic_id))
            for sid in move or ():
                await self._call(partial(self.store.delete_stream, topic.topic_id, sid=sid))
            if topic.config.type == "queue":
                await self.journals.delete(topic.topic_id)
        except Exception as exc:
            log.warning("topic %r: stream not deleted: %s", topic.name, exc)

    async def _delete_records(
        self, topic: Topic, body: dict[str, object], apply: Callable[[], _T]
    ) -> _T:
        lane = self.lane(topic)
        # (under the registry lock: a stream move never copies records a delete is
        # removing, and the delete reaches the stream that holds them)
        async with lane.registry_lock:
            if topic.deleted:
                raise TopicNotFound(topic.name)
            return await self._delete_records_locked(topic, lane, body, apply)

    async def _delete_records_locked(
        self, topic: Topic, lane: _Lane, body: dict[str, object], apply: Callable[[], _T]
    ) -> _T:
        before = body.get("before_seq")
        bound = body["bound"]
        match = body.get("match")
        assert isinstance(bound, int)
        below = bound + 1 if before is None else min(bound + 1, int(str(before)))
        tid = topic.topic_id
        if match is None:
            await self._call(partial(self.store.purge, tid, below))
        else:
            assert isinstance(match, list)
            op, value = str(match[0]), str(match[1])
            if op == "Eq":
                await self._call(partial(self.store.purge, tid, below, value))
            else:  # a tag prefix is no subject filter: delete the matching records one by one
                seqs = [
                    s for s, tag in list(topic.tags.items()) if s < below and tag.startswith(value)
                ]
                await self._call(partial(self.store.delete_msgs, tid, seqs))
        # the other fronts apply the same delete from the registry entry (written before
        # memory changes: a failure here is a 503 the client retries; purges are idempotent)
        record: list[JsonValue] = [0, before, match, bound]  # type: ignore[list-item]
        log_after: list[JsonValue] = []

        def build() -> dict[str, JsonValue]:
            record[0] = lane.deletes_applied + 1
            log_after[:] = [*lane.deletes, record][-DELETES_KEPT:]
            return _entry(topic, log_after, lane)

        await self._put_entry(topic, lane, build)
        lane.deletes = log_after
        lane.deletes_applied = int(str(record[0]))
        return apply()

    def status(self) -> dict[str, JsonValue] | None:
        return None

    def check_all(self) -> None:
        return None

    # ---- StorageBackend ----------------------------------------------------------------

    async def checkpoint(self, *, final: bool = False) -> bool:
        await trio.lowlevel.checkpoint()
        return True

    async def read_stored(self, topic: Topic, seq: int, min_visible: int) -> bytes | None:
        if seq < min_visible:
            await trio.lowlevel.checkpoint()
            return None
        got = await self.read_stored_range(topic, seq, seq, 1)
        return got.get(seq)

    async def read_stored_range(
        self, topic: Topic, lo: int, hi: int, max_bytes: int
    ) -> dict[int, bytes]:
        tid = topic.topic_id
        msgs = await self._call(
            partial(self.store.read, tid, lo, hi, max(1, min(max_bytes, READ_PAGE_BYTES)))
        )
        return {m.seq: m.data for m in msgs if topic.live(m.seq)}

    def storage_stats(self) -> dict[str, int]:
        return {}

    # ---- floors ------------------------------------------------------------------------

    async def write_floors(self) -> None:
        """Registry first, then purge: a floor never goes back after a restart."""
        engine = self.engine
        fronts = self.fronts
        if engine is None or (fronts is not None and not fronts.owned):
            await trio.lowlevel.checkpoint()
            return  # a front that owns nothing writes nothing
        for topic in list(engine.topics.values()):
            lane = self.lane(topic)
            floor = topic.evict_floor
            if floor <= lane.floor_written or topic.deleted:
                continue
            if fronts is not None and not fronts.owns(topic.name):
                continue
            tid = topic.topic_id
            try:
                async with lane.registry_lock:
                    if engine.by_id.get(tid) is not topic:  # deleted while we waited
                        continue
                    await self._put_entry(topic, lane, lane.entry)
                    lane.floor_written = floor
                await self._call(partial(self.store.purge, tid, floor))
            except Exception as exc:
                log.warning("topic %r: eviction floor not stored yet: %s", topic.name, exc)

    async def compact_journals(self) -> None:
        """Compact the journals of the queues this front owns that have grown enough
        since their last snapshot (`Journals.compact`)."""
        engine = self.engine
        fronts = self.fronts
        if engine is None or (fronts is not None and not fronts.owned):
            await trio.lowlevel.checkpoint()
            return
        for topic in list(engine.by_id.values()):
            if topic.deleted or not self.journals.compact_due(topic):
                continue
            if fronts is not None and not fronts.owns(topic.name):
                continue
            try:
                await self.journals.compact(topic)
            except Exception as exc:
                log.warning("queue %r: journal not compacted: %s", topic.name, exc)
        await trio.lowlevel.checkpoint()


_ROUTER_FRAMES: Final = (frames.ROUTER_CREATE, frames.ROUTER_DELETE, frames.ROUTER_CURSOR)
_FEATURES: Final = {
    frames.LOST_RANGE: "lost ranges",
    frames.HEAD_WATERMARK: "seq reservations",
    frames.EVICT_WATERMARK: "eviction watermarks",
}


# ---- rebuild ---------------------------------------------------------------------------


def _without_move(entry: dict[str, JsonValue]) -> dict[str, JsonValue]:
    entry.pop("move", None)
    return entry


def _extras(headers: dict[str, str]) -> dict[str, object]:
    raw = headers.get(H_EXTRA)
    if raw is None:
        return {}
    obj = json.loads(raw)
    assert isinstance(obj, dict)
    return obj


async def _rebuild(
    engine: Engine, backend: JetStreamBackend, now_ms: Callable[[], int], *, repair: bool = True
) -> tuple[int, int]:
    """Load every registered topic and its stream into `engine`; returns (topics, records).
    With `repair` (a front owning every shard), also remove orphan streams, create missing ones,
    finish purges below stored floors and write the name index."""
    store = backend.store
    next_id, entries = await backend.bridge.call(store.registry)
    streams = set(await backend.bridge.call(store.stream_ids))
    if streams - _named(entries):
        # (removing a stream is final: before any stream is called an orphan, every
        # entry is read again, then the entry of the topic whose id the stream has, in
        # case a write of the registry raced the listing)
        for tid in sorted(entries):
            entry, _ = await backend.bridge.call(partial(store.entry, tid))
            if entry is not None:
                entries[tid] = entry
        for tid in sorted(streams - _named(entries)):
            entry, _ = await backend.bridge.call(partial(store.entry, tid))
            if entry is not None:
                entries[tid] = entry
    if repair:
        # (a stream a recorded move names is settled by `finish_move` instead)
        for orphan in sorted(streams - _named(entries, moves=True)):
            log.warning("removing stream %s: no registry entry names it", store.stream(orphan))
            await backend.bridge.call(partial(store.delete_stream, orphan))
        await backend.journals.sweep(set(entries))
    engine.replaying = True
    records = 0
    for tid in sorted(entries):
        sid = _sid(tid, entries[tid])
        if sid not in streams and not repair:
            continue  # being created or deleted by the owner right now
        topic, loaded = await _install(
            engine, backend, tid, entries[tid], repair=repair, have_stream=sid in streams
        )
        records += loaded
        if repair and backend.lane(topic).move is not None:
            await backend.finish_move(topic, backend.lane(topic))
    engine.next_topic_id = max(engine.next_topic_id, next_id)
    engine.finish_replay(now_ms())
    for topic in engine.topics.values():
        engine.payloads.release(topic, topic.head_seq)
    return len(entries), records


def _sid(tid: int, entry: dict[str, object]) -> int:
    """The id of the stream entry `tid` names (its own unless its records moved)."""
    return int(str(entry.get("stream", tid)))


def _named(entries: dict[int, dict[str, object]], *, moves: bool = False) -> set[int]:
    """The stream ids the entries name (and, with `moves`, those of recorded moves)."""
    out = {_sid(tid, e) for tid, e in entries.items()}
    if moves:
        for e in entries.values():
            move = e.get("move")
            if isinstance(move, list):
                out.update(int(str(x)) for x in move)
    return out


async def _install(
    engine: Engine,
    backend: JetStreamBackend,
    tid: int,
    entry: dict[str, object],
    *,
    repair: bool,
    have_stream: bool = True,
    live: bool = False,
) -> tuple[Topic, int]:
    """Create topic `tid` in `engine` from its registry entry and load its stream.
    `live`: the engine is serving (a follower finding a topic), not rebuilding."""
    name = entry["name"]
    assert isinstance(name, str)
    topic = Topic(name, tid, config_from_wire(entry["config"]), name_json=orjson.dumps(name))
    lane = backend.lane(topic)
    # served while it loads (live): a read's catch-up waits for the load to finish
    lane.resync_lock.acquire_nowait()
    try:
        engine.apply_create(topic)
        loaded = await _fill(engine, backend, topic, entry, repair=repair, have_stream=have_stream)
    finally:
        lane.resync_lock.release()
    if live:
        engine.enforce(topic)
        topic.durable_head = topic.drained_to = topic.drained_strong = topic.head_seq
        engine.payloads.release(topic, topic.head_seq)
    return topic, loaded


async def _fill(
    engine: Engine,
    backend: JetStreamBackend,
    topic: Topic,
    entry: dict[str, object],
    *,
    repair: bool,
    have_stream: bool,
) -> int:
    store = backend.store
    tid = topic.topic_id
    lane = backend.lane(topic)
    lane.memory = entry.get("storage") == "memory"
    backend.set_sid(lane, _sid(tid, entry))
    move = entry.get("move")
    lane.move = [int(str(x)) for x in move] if isinstance(move, list) else None
    reserved = entry.get("reserved", 0)
    assert isinstance(reserved, int)
    lane.reserved = reserved
    feed = entry.get("feed")
    if isinstance(feed, dict):
        from topicd.storage.jsrouters import merge_feed

        merge_feed(lane.feed, feed)
    if repair and not have_stream:
        await backend._call(partial(store.create_stream, tid, memory=lane.memory))
    floor = entry.get("floor", 1)
    runs = entry.get("runs", [])
    assert isinstance(floor, int)
    assert isinstance(runs, list)
    if floor > 1:
        # below the stored floor everything is evicted, whatever the stream still
        # holds (a purge the last front did not get to): start above it
        topic.evictions.load([(int(a), int(b), str(c)) for a, b, c in runs])
        topic.evict_floor = floor
        topic.skip_to(floor - 1)
    loaded = await _load_topic(engine, backend, topic, engine.clock.now_ms, floor)
    if topic.config.type == "queue":
        await backend.journals.load(topic, repair=repair)
    if lane.memory and reserved > topic.head_seq and topic.count == 0:
        # an `ephemeral` topic whose stream holds nothing: if its server restarted, the
        # records are lost and the seqs they had are known only from the reservation.
        # Resume above it (seqs are never handed out twice; as after a crash of the
        # embedded backend, the topic comes back empty above its reservation); the
        # owner's first publish then finds the stream behind and moves it up (`_lost`)
        topic.skip_to(reserved)
        if repair:
            await backend._call(partial(store.purge, tid, reserved + 1))
    if repair:
        if floor > 1:
            await backend._call(partial(store.purge, tid, floor))  # finish that purge
        await backend._call(partial(store.put_name, topic.name, tid))
    lane.floor_written = floor
    deletes = entry.get("deletes") or []
    assert isinstance(deletes, list)
    lane.deletes = list(deletes)
    lane.deletes_applied = int(deletes[-1][0]) if deletes else 0
    lane.entry_rev = int(str(entry.get(REV, 0)))
    last_write = entry.get("last_write_ts")
    if topic.last_write_ts is None and isinstance(last_write, int):
        topic.last_write_ts = last_write
    engine.next_topic_id = max(engine.next_topic_id, tid + 1)
    return loaded


async def _load_topic(
    engine: Engine,
    backend: JetStreamBackend,
    topic: Topic,
    now_ms: Callable[[], int],
    from_seq: int = 1,
) -> int:
    """Publish the stored records of `topic` from `from_seq` on into memory, at their
    stream seqs (memory holds nothing at or above `from_seq`)."""
    store = backend.store
    tid = topic.topic_id
    first, last = await backend._call(partial(store.bounds, tid))
    loaded = 0
    seq = max(first, from_seq)
    keys: list[tuple[str, int, int, int]] = []  # (idempotency key, first seq, count, $ts)
    # a write's records, grouped back: (first seq, ts, key, count)
    while last and seq <= last:
        msgs = await backend._call(partial(store.read, tid, seq, last, READ_PAGE_BYTES))
        if not msgs:
            break
        after = msgs[-1].seq + 1
        if any(H_SLOT in m.headers or H_FEED in m.headers for m in msgs):
            from topicd.storage.jsrouters import materialized

            msgs = materialized(backend.lane(topic), topic, msgs)
        i = 0
        while i < len(msgs):
            # one contiguous run of one write (same $ts, consecutive seqs, no new write)
            j = i + 1
            ts = _ts(msgs[i].data)
            while (
                j < len(msgs)
                and msgs[j].seq == msgs[j - 1].seq + 1
                and H_COUNT not in msgs[j].headers
                and _ts(msgs[j].data) == ts
            ):
                j += 1
            run = msgs[i:j]
            start = run[0].seq
            if start > topic.head_seq + 1:
                topic.skip_to(start - 1)
            encs = [m.data for m in run]
            sizes = [int(m.headers.get(H_SIZE, len(m.data))) for m in run]
            tags: dict[int, str] = {}
            nodes: dict[int, str] = {}
            prios: dict[int, int] = {}
            shapes: dict[int, tuple[int, int]] = {}
            hops: dict[int, int] = {}
            for k, m in enumerate(run):
                extra = _extras(m.headers)
                if "h" in extra:
                    hops[start + k] = int(str(extra["h"]))
                if "t" in extra:
                    tags[k] = str(extra["t"])
                if "n" in extra:
                    nodes[k] = str(extra["n"])
                if "p" in extra:
                    prios[k] = int(str(extra["p"]))
                if "s" in extra:
                    s = extra["s"]
                    assert isinstance(s, list)
                    shapes[k] = (int(s[0]), int(s[1]))
            key_raw = run[0].headers.get(H_KEY)
            if key_raw is not None:
                count = int(run[0].headers.get(H_COUNT, len(run)))
                keys.append((str(json.loads(key_raw)), start, count, ts))
            engine.apply_records(
                topic,
                start,
                ts,
                encs,
                sizes,
                sum(sizes),
                tags,
                nodes,
                prios,
                shapes,
                now_ms(),
            )
            if not engine.replaying:
                engine.records_followed += len(run)  # (published by another front)
            if hops:  # (router copies on a cycle: their hop counts)
                if not topic.hops:
                    topic.hops = {}
                topic.hops.update(hops)
            loaded += len(run)
            i = j
        seq = after
    if last > topic.head_seq:
        topic.skip_to(last)
    topic.next_seq = topic.head_seq + 1
    _restore_keys(engine, topic, keys, now_ms())
    return loaded


def _restore_keys(
    engine: Engine, topic: Topic, keys: list[tuple[str, int, int, int]], now: int
) -> None:
    """Remember the idempotency keys whose window is still open, with their writes'
    results (a write's records may have been read in several pages)."""
    window = topic.config.idempotency_window_ms
    for key, first, count, ts in keys:
        if ts + window <= now or engine.idem.lookup(topic.topic_id, key, now) is not None:
            continue
        try:
            entry = engine.idem.begin(topic.topic_id, key, now)
        except Throttled:
            return  # the store is full of live entries: the rest are not remembered
        engine.idem.resolve(
            topic.topic_id,
            key,
            entry,
            first_seq=first,
            count=count,
            head_seq=first + count - 1,
            expires_ms=ts + window,
            now_ms=now,
        )


def _ts(data: bytes) -> int:
    m = _TS.match(data)
    if m is None:
        raise ValueError("a stored record without $seq/$ts")
    return int(m.group(1))


@asynccontextmanager
async def open_jetstream_engine(
    cfg: Config, clock: WallClock, *, bridge: AsyncioBridge | None = None
) -> AsyncIterator[Engine]:
    """Connect to JetStream, rebuild the engine from it, run it; drain on exit."""
    from topicd.config import record_frame_bound
    from topicd.engine.idempotency import IdempotencyStore
    from topicd.storage.jsfronts import Fronts
    from topicd.storage.jsrouters import JsRouters
    from topicd.storage.jsslots import JsSlots

    if cfg.protocol.max_batch_records > BATCH_MAX:
        log.info(
            "jetstream backend: protocol.max_batch_records %d lowered to %d (atomic batch ceiling)",
            cfg.protocol.max_batch_records,
            BATCH_MAX,
        )
        cfg = dataclasses.replace(
            cfg, protocol=dataclasses.replace(cfg.protocol, max_batch_records=BATCH_MAX)
        )
    own_bridge = bridge is None
    if bridge is None:
        bridge = AsyncioBridge()
        bridge.start()
    store = JetStreamStore(cfg)
    try:
        try:
            max_payload = await bridge.call(store.connect)
        except Exception as exc:
            reason = store.last_error if isinstance(exc, TimeoutError) else None
            reason = reason or exc
            raise JetStreamUnavailable(
                f"cannot use JetStream at {', '.join(store.servers)}: "
                f"{str(reason) or type(reason).__name__}"
            ) from exc
        need = record_frame_bound(cfg.protocol)
        if max_payload < need:
            raise JetStreamUnavailable(
                f"the NATS servers accept messages up to {max_payload} bytes; one record "
                f"the protocol limits accept can need {need}: set max_payload to at least "
                f"{need} in the servers' configuration, or lower protocol.max_record_bytes"
            )
        t0 = trio.current_time()
        # a cluster electing leaders (a server just stopped) answers with timeouts for a
        # few seconds: the rebuild starts over on a fresh engine until the bound
        deadline = t0 + REBUILD_ATTEMPTS_TIMEOUTS * store.timeout
        front_id = uuid.uuid4().hex[:12]  # (kept across attempts: its leases stay its own)
        while True:
            backend = JetStreamBackend(cfg, bridge, store)
            engine = Engine(cfg, clock, backend)
            engine.ephemeral_stored = True
            engine.routers = routers = JsRouters(engine, backend)
            backend.engine = engine
            backend.fronts = fronts = Fronts(engine, backend, clock, front_id)
            # the connection caps count the deployment's streams (`front.slots`)
            backend.slots = engine.watch.slots = slots = JsSlots(cfg, backend, clock, front_id)
            slots.reclaim = engine.watch.reclaim_idle  # (asked at another front's cap)
            # `max_total_bytes` and `max_idempotency_entries` are the deployment's: this
            # front's shares cover the bytes and entries of the topics it owns
            if "b" in slots.shares:
                engine.bytes_budget = share = slots.shares["b"]
                share.used = partial(_owned_bytes, engine, fronts)
            if "e" in slots.shares:
                engine.idem = IdempotencyStore(0)  # (the share counts: copies unbounded)
                engine.entry_budget = share = slots.shares["e"]
                share.used = partial(_owned_entries, engine, fronts, clock)
            try:
                await bridge.call(store.open_registry)
                owner = await fronts.start()
                topics, records = await _rebuild(engine, backend, clock.now_ms, repair=owner)
                # (the routers into this front's topics; `repair` when it owns every
                # shard: no other front may be creating one right now)
                await routers.rebuild(repair=owner)
                break
            except JetStreamUnavailable:
                raise
            except Exception as exc:
                if trio.current_time() + REBUILD_RETRY_S >= deadline:
                    raise JetStreamUnavailable(
                        f"cannot rebuild from JetStream at {', '.join(store.servers)}: "
                        f"{str(exc) or type(exc).__name__}"
                    ) from exc
                log.warning("rebuild from JetStream failed (%s); trying again", exc)
                await trio.sleep(REBUILD_RETRY_S)
        for topic in list(engine.by_id.values()):
            if fronts.owns(topic.name) and backend.lane(topic).move is not None:
                await backend.finish_move(topic, backend.lane(topic))
            if topic.queue is not None and fronts.owns(topic.name):
                await backend.journals.fence(topic, front_id)
        engine.recovery = {"duration_ms": (trio.current_time() - t0) * 1000}
        log.info(
            "rebuilt %d topics (%d records) from JetStream %s in %.3f s",
            topics,
            records,
            ", ".join(store.servers),
            trio.current_time() - t0,
        )
        fronts.begin()
        async with trio.open_nursery() as nursery:
            await nursery.start(backend.run)
            await nursery.start(engine.run)
            await nursery.start(fronts.run)
            await nursery.start(slots.run)
            try:
                yield engine
            finally:
                engine.closed = True
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(cfg.storage.snapshot.final_timeout_ms / 1000),
                ):
                    await backend.drain()
                    await slots.close()
                    await fronts.release()
                nursery.cancel_scope.cancel("storage closed")
    finally:
        with trio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await bridge.call(store.close)
            if own_bridge:
                await trio.to_thread.run_sync(bridge.close)


def _owned_bytes(engine: Engine, fronts: Fronts) -> int:
    """The bytes of the topics this front owns, those being written included (what its
    share of `limits.max_total_bytes` covers)."""
    return sum(t.bytes + t.pending_bytes for t in engine.topics.values() if fronts.owns(t.name))


def _owned_entries(engine: Engine, fronts: Fronts, clock: WallClock) -> int:
    """The live idempotency entries of the topics this front owns, those of writes in
    flight included (what its share of `limits.max_idempotency_entries` covers); the
    expired ones are dropped first, as one process drops them at its limit."""
    engine.idem.prune(clock.now_ms())
    return sum(
        engine.idem.entries_of(t.topic_id) for t in engine.topics.values() if fronts.owns(t.name)
    )
