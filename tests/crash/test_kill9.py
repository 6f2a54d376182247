"""`kill -9` crash tests against the real `topicd serve` process (storage spec §6, §7, §12).

Method: each test owns one temporary data directory and serves it with successive
`python -m topicd serve` children (`tests/crash/harness.py`: 1 MiB WAL files so the load
crosses rotations, a checkpoint every second or MiB so it crosses snapshots and WAL
trims). A child is ready when its stderr shows the `listening on` line, read under
`trio.fail_after` (never a sleep); children are killed in `finally` whatever happens.

Test 1, one *cycle*: eight concurrent writers (separate tasks, one httpx HTTP/1.1
keep-alive client each) over one topic of each durability class (`fsync`, `disk`,
`memory`, `ephemeral`) plus a capped `disk` topic, with batch sizes 1..50, some
idempotency keys and some `before_seq` record deletes; every acknowledged response goes
into an oracle. After a random delay (50-1500 ms, from a seeded `random.Random`) the
server gets `SIGKILL` (one cycle in four: `SIGTERM`, then `SIGKILL` 0-100 ms into the
drain and final checkpoint). The next start is killed too, 0-60 ms after it bound its port
(in replay, re-shard, repair or the FORMAT/BOOT_ID writes), and the WAL shard count varies
from start to start (1-3: a change re-shards). The start after that must serve; everything
is read back with diff loops until `caught_up`, payloads compared as raw JSON text
(`msgspec.Raw`), never as parsed values. The oracle then asserts (a process crash keeps
the page cache, so `disk` and `memory` records survive it exactly like `fsync` ones):

- every acknowledged record of `fsync`, `disk` and `memory` topics is present with its seq
  and exact bytes, unless an acknowledged delete or the cap removed it (a delete still in
  flight at the kill may have happened: it removes a seq prefix or nothing); no `crash`
  tombstone anywhere; the capped topic holds at most its cap;
- every record read back was sent (to that topic, byte-identical), no payload appears
  twice or at two seqs, no seq ever holds two payloads (across all cycles), nothing
  deleted, evicted or refused (`429`, or `503` while draining) comes back; per topic the
  seqs ascend strictly;
- a write in flight at the kill is all there (contiguous seqs in batch order) or not at
  all; `ephemeral` topics come back empty;
- a second restart without writes (again `SIGKILL`) yields an identical dump (records,
  `head_seq`, `earliest_seq`, counts, config, tombstones);
- the first write after the restart on every topic (every class, `ephemeral` included)
  gets a seq above every seq acknowledged before the kill, and so does every later one;
- retrying an acknowledged keyed write answers `deduped:true` with the original seqs; a
  keyed write in flight at the kill dedupes iff it survived (to where it was read back),
  else appends once.

Test 2 kills the server while topic `PUT`s (creations, re-creations of deleted names,
durability changes) and `DELETE`s are in flight, among writes: after the restart every
topic is fully there (the whole old or new config, every acknowledged record) or fully
gone, acknowledged creations, changes and deletions held, nothing else exists, a second
restart changes nothing, and a name deleted before the kill restarts at seq 1.

The seeds are fixed and parametrized (3 + 2 seeds x 3 cycles, about 60 s);
`TOPICD_KILL9_ITERATIONS=N` runs N seeds per test instead, and `TOPICD_KILL9_SEED_BASE`
moves them, for soak runs. Every failure names its seed and how to rerun it. Kill points
and in-flight counts are logged at INFO (`pytest --log-cli-level=INFO tests/crash`).
Bugs found this way have minimal reproductions in `test_kill9_repro.py`.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from tests.crash.harness import (
    JSON,
    client,
    diff_dumps,
    dump_all,
    list_topics,
    payload,
    serving,
)

if TYPE_CHECKING:
    from tests.crash.harness import Server, TopicDump

log = logging.getLogger(__name__)

pytestmark = pytest.mark.slow

CYCLES = 3  # kill/restart cycles per test
WRITERS = 8
KILL_AFTER_S = (0.05, 1.5)

_default_iterations = {"load": 3, "control": 2}
_ITER = os.environ.get("TOPICD_KILL9_ITERATIONS")
_BASE = int(os.environ.get("TOPICD_KILL9_SEED_BASE", "0"))


def seeds(kind: str) -> list[int]:
    n = int(_ITER) if _ITER else _default_iterations[kind]
    return [_BASE + 1 + i for i in range(n)]


# --------------------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------------------

LOAD_TOPICS = [
    ("k.fsync", {"durability": "fsync"}),
    ("k.disk", {"durability": "disk"}),
    ("k.memory", {"durability": "memory"}),
    ("k.ephemeral", {"durability": "ephemeral"}),
    ("k.capped", {"durability": "disk", "cap_records": 300}),
]


@dataclass(eq=False)
class Batch:
    topic: TopicModel
    ids: list[str]
    raws: list[bytes]
    body: bytes
    key: str | None
    seqs: list[int] | None = None
    status: str = "inflight"  # inflight | acked | refused


@dataclass(eq=False)
class Delete:
    before_seq: int
    acked: bool = False


@dataclass(eq=False)
class TopicModel:
    name: str
    durability: str
    cap: int = 0
    must: dict[int, str] = field(default_factory=dict)  # seq -> id that must be present
    history: dict[int, str] = field(default_factory=dict)  # every seq ever seen -> id
    floor: int = 1  # nothing below this may come back (deletes, cap eviction)
    max_acked: int = 0
    top_before_kill: int = 0
    batches: list[Batch] = field(default_factory=list)  # this cycle's writes
    deletes: list[Delete] = field(default_factory=list)  # this cycle's deletes

    @property
    def ephemeral(self) -> bool:
        return self.durability == "ephemeral"


class Oracle:
    """What the writers sent and what the server acknowledged (see module docstring)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.topics = {
            name: TopicModel(name, cfg["durability"], int(cfg.get("cap_records", 0)))
            for name, cfg in LOAD_TOPICS
        }
        self.sent: dict[str, bytes] = {}  # id -> raw JSON text of data
        self.topic_of: dict[str, str] = {}
        self.place: dict[str, tuple[str, int]] = {}  # id -> (topic, seq) once observed
        self.gone: set[str] = set()  # ids that must never be read again
        self.errors: list[str] = []
        self.cycle = 0
        self.acked_writes = 0
        self.acked_deletes = 0

    def error(self, message: str) -> None:
        self.errors.append(f"[cycle {self.cycle}] {message}")

    def new_batch(self, t: TopicModel, rng: random.Random, stem: str, key: bool) -> Batch:
        n = rng.choice([1, 1, 2, 3, 5, 8, 13, 21, 34, 50, rng.randint(1, 50)])
        ids = [f"s{self.seed}.{stem}.{i}" for i in range(n)]
        raws = [payload(pid, rng) for pid in ids]
        parts = []
        for i, raw in enumerate(raws):
            tag = b',"tag":"w%d"' % i if rng.random() < 0.3 else b""
            parts.append(b'{"data":' + raw + tag + b"}")
        k = f"s{self.seed}.{stem}" if key else None
        body = b'{"records":[' + b",".join(parts) + b"]"
        if k is not None:
            body += b',"idempotency_key":"' + k.encode() + b'"'
        body += b"}"
        for pid, raw in zip(ids, raws, strict=True):
            self.sent[pid] = raw
            self.topic_of[pid] = t.name
        b = Batch(t, ids, raws, body, k)
        t.batches.append(b)
        return b

    def acked(self, b: Batch, resp: dict[str, object]) -> None:
        """Record an acknowledged (non-deduped) write."""
        t = b.topic
        seqs = resp.get("seqs")
        first = resp.get("first_seq")
        if (
            not isinstance(seqs, list)
            or not isinstance(first, int)
            or seqs != list(range(first, first + len(b.ids)))
            or resp.get("last_seq") != first + len(b.ids) - 1
        ):
            self.error(f"{t.name}: malformed write response {resp!r} for {len(b.ids)} records")
            return
        b.seqs = seqs
        b.status = "acked"
        self.acked_writes += 1
        for seq, pid in zip(seqs, b.ids, strict=True):
            self.observe(t, seq, pid, "acknowledged")
            if not t.ephemeral:
                t.must[seq] = pid
        t.max_acked = max(t.max_acked, seqs[-1])

    def observe(self, t: TopicModel, seq: int, pid: str, how: str) -> None:
        old = t.history.get(seq)
        if old is not None and old != pid:
            self.error(f"{t.name}: seq {seq} holds two payloads: {old} and {pid} ({how})")
        where = self.place.get(pid)
        if where is not None and where != (t.name, seq):
            self.error(f"{t.name}: payload {pid} at seq {seq} ({how}) was at {where} before")
        t.history[seq] = pid
        self.place[pid] = (t.name, seq)

    def refused(self, b: Batch) -> None:
        b.status = "refused"
        self.gone.update(b.ids)


# --------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------


@dataclass
class Load:
    oracle: Oracle
    server: Server
    draining: bool = False  # SIGTERM sent: 503 shutting_down and closed connections are fine
    killed: bool = False

    def stopping(self) -> bool:
        return self.draining or self.killed


async def writer(load: Load, w: int, rng: random.Random) -> None:
    """One client: writes (some keyed) and occasional prefix deletes until the kill."""
    o = load.oracle
    topics = list(o.topics.values())
    async with client(load.server) as c:
        n = 0
        while not load.killed:
            n += 1
            t = rng.choice(topics)
            try:
                if not t.cap and t.max_acked and rng.random() < 0.03:
                    await delete_prefix(c, load, t, rng)
                else:
                    b = o.new_batch(t, rng, f"c{o.cycle}.w{w}.r{n}", rng.random() < 0.4)
                    r = await c.post(f"/v0/topics/{t.name}", content=b.body, headers=JSON)
                    if r.status_code == 429 or (r.status_code == 503 and load.stopping()):
                        o.refused(b)  # nothing appended (rejected before any seq)
                    elif r.status_code != 200:
                        o.error(f"{t.name}: write answered {r.status_code} {r.text[:300]}")
                        o.refused(b)
                    else:
                        body = r.json()
                        if body.get("deduped"):
                            o.error(f"{t.name}: first send of {b.key} deduped: {body}")
                        o.acked(b, body)
            except httpx.TransportError as exc:
                if not load.stopping():
                    o.error(f"writer {w}: {exc!r} before the kill")
                return


async def delete_prefix(
    c: httpx.AsyncClient, load: Load, t: TopicModel, rng: random.Random
) -> None:
    # every seq below before_seq was published when `max_acked` was acknowledged (per
    # topic, publish order is seq order), so an acknowledged delete removes all of them
    before = max(1, t.max_acked + 1 - rng.choice([0, 10, 100, 1000]))
    o = load.oracle
    d = Delete(before)
    t.deletes.append(d)
    r = await c.post(f"/v0/topics/{t.name}/delete", json={"before_seq": before})
    if r.status_code == 503 and load.stopping():
        return  # refused by the drain: stays "in flight" (either outcome is checked)
    if r.status_code != 200:
        o.error(f"{t.name}: delete before {before} answered {r.status_code} {r.text[:300]}")
        return
    d.acked = True
    o.acked_deletes += 1
    t.floor = max(t.floor, before)


# --------------------------------------------------------------------------------------
# Checks after a restart
# --------------------------------------------------------------------------------------


def check_restart(o: Oracle, dumps: dict[str, TopicDump | None]) -> dict[str, dict[int, str]]:
    """Compare the first dump after a kill with the oracle; return what is present."""
    seen_ids: set[str] = set()
    out: dict[str, dict[int, str]] = {}
    for t in o.topics.values():
        d = dumps[t.name]
        if d is None:
            o.error(f"{t.name}: topic missing after restart")
            out[t.name] = {}
            continue
        present = out[t.name] = read_back(o, t, d, seen_ids)
        for gap_from, gap_to, reason in d.tombstones:
            if not (reason == "cap" and t.cap):
                o.error(f"{t.name}: tombstone {reason} {gap_from}..{gap_to} after a process crash")
        head = d.state["head_seq"]
        assert isinstance(head, int)
        top = max(t.max_acked, max(t.history, default=0))
        if head < top:
            o.error(f"{t.name}: head_seq {head} after restart is below acknowledged seq {top}")
        if t.ephemeral:
            if present:
                o.error(f"{t.name}: ephemeral records survived a restart: {sorted(present)[:5]}")
            continue
        check_presence(o, t, present)
        check_inflight(o, t, present)
    return out


def read_back(o: Oracle, t: TopicModel, d: TopicDump, seen_ids: set[str]) -> dict[int, str]:
    present: dict[int, str] = {}
    prev = 0
    for seq, _ts, raw, _tag in d.records:
        if seq <= prev:
            o.error(f"{t.name}: seq {seq} read after {prev} (order or duplicate)")
        prev = seq
        try:
            pid = json.loads(raw)["id"]
        except (ValueError, KeyError, TypeError):
            o.error(f"{t.name}: seq {seq} holds a payload nobody sent: {raw[:120]!r}")
            continue
        sent = o.sent.get(pid)
        if sent is None or o.topic_of.get(pid) != t.name:
            o.error(f"{t.name}: seq {seq} holds {pid}, never sent to this topic")
            continue
        if raw != sent:
            o.error(f"{t.name}: seq {seq} ({pid}) bytes differ:\n sent {sent!r}\n read {raw!r}")
        if pid in seen_ids:
            o.error(f"{t.name}: payload {pid} read twice (seq {seq})")
        seen_ids.add(pid)
        if pid in o.gone:
            o.error(f"{t.name}: seq {seq}: {pid} came back (refused, or absent after a restart)")
        if seq < t.floor:
            o.error(f"{t.name}: seq {seq} came back below the delete/eviction floor {t.floor}")
        o.observe(t, seq, pid, "read back")
        present[seq] = pid
    return present


def check_presence(o: Oracle, t: TopicModel, present: dict[int, str]) -> None:
    required_from = t.floor
    if t.cap:
        if len(present) > t.cap:
            o.error(f"{t.name}: {len(present)} live records after restart, cap is {t.cap}")
        if len(present) >= t.cap:
            required_from = max(required_from, min(present))
    missing = sorted(s for s in t.must if s >= required_from and s not in present)
    pending = max((d.before_seq for d in t.deletes if not d.acked), default=0)
    lost = [s for s in missing if s >= pending]
    if lost:
        o.error(
            f"{t.name} ({t.durability}): {len(lost)} acknowledged records lost by a process "
            f"crash, seqs {lost[:8]}{'...' if len(lost) > 8 else ''} (head read back "
            f"{max(present, default=0)}, max acknowledged {t.max_acked})"
        )
    deleted = [s for s in missing if s < pending]
    if deleted:
        # an in-flight delete took effect: it removed a whole prefix
        below = [s for s in present if s < deleted[-1]]
        if below:
            o.error(f"{t.name}: seqs {below[:5]} survive below deleted seq {deleted[-1]}")
        t.floor = max(t.floor, deleted[-1] + 1)


def check_inflight(o: Oracle, t: TopicModel, present: dict[int, str]) -> None:
    """A write in flight at the kill is there whole (maybe minus a deleted prefix) or not."""
    seq_of = {pid: seq for seq, pid in present.items()}
    cuts = {d.before_seq for d in t.deletes}
    if t.cap and present:
        cuts.add(min(present))
    for b in t.batches:
        if b.status != "inflight":
            continue
        got = [seq_of.get(pid) for pid in b.ids]
        if all(s is None for s in got):
            continue
        k = next(i for i, s in enumerate(got) if s is not None)
        tail = got[k:]
        start = tail[0]
        assert start is not None
        if tail != list(range(start, start + len(tail))) or (k and start not in cuts):
            o.error(f"{t.name}: in-flight write {b.ids[0]}.. half there: seqs {got}")


def settle(o: Oracle, present: dict[str, dict[int, str]]) -> None:
    """The verified dump becomes the oracle's truth for the next cycle."""
    for t in o.topics.values():
        mine = present[t.name]
        found = set(mine.values())
        t.top_before_kill = max(t.max_acked, max(t.history, default=0))
        for b in t.batches:
            if b.status == "inflight" or t.ephemeral:
                o.gone.update(pid for pid in b.ids if pid not in found)
        if t.ephemeral:
            o.gone.update(pid for pid, (name, _) in o.place.items() if name == t.name)
        t.must = {} if t.ephemeral else dict(mine)
        if t.cap and len(mine) >= t.cap:
            t.floor = max(t.floor, min(mine))


async def after_restart_writes(
    o: Oracle, server: Server, present: dict[str, dict[int, str]], rng: random.Random
) -> None:
    """First writes (I4), then idempotent retries of acknowledged and in-flight writes."""
    async with client(server) as c:
        for t in o.topics.values():
            b = o.new_batch(t, rng, f"c{o.cycle}.first.{t.name}", False)
            r = await c.post(f"/v0/topics/{t.name}", content=b.body, headers=JSON)
            if r.status_code != 200:
                o.error(f"{t.name}: first write after restart: {r.status_code} {r.text[:300]}")
                continue
            body = r.json()
            if body["first_seq"] <= t.top_before_kill:
                o.error(
                    f"{t.name} ({t.durability}): first write after restart got seq "
                    f"{body['first_seq']}, but seq {t.top_before_kill} was used before the kill"
                )
            o.acked(b, body)
        keyed = [
            b
            for t in o.topics.values()
            if not t.ephemeral
            for b in t.batches
            if b.key is not None and b.status in ("acked", "inflight")
        ]
        acked = [b for b in keyed if b.status == "acked"]
        inflight = [b for b in keyed if b.status == "inflight"]
        for b in rng.sample(acked, min(len(acked), 25)):
            await retry_acked(o, c, b)
        for b in inflight:
            await retry_inflight(o, c, b, present[b.topic.name])


async def retry_acked(o: Oracle, c: httpx.AsyncClient, b: Batch) -> None:
    t = b.topic
    r = await c.post(f"/v0/topics/{t.name}", content=b.body, headers=JSON)
    body = r.json()
    if r.status_code != 200 or not body.get("deduped") or body.get("seqs") != b.seqs:
        o.error(
            f"{t.name} ({t.durability}): retry of acknowledged {b.key} (seqs "
            f"{b.seqs[0] if b.seqs else '?'}..) after restart: {r.status_code} {body}"
        )
        if r.status_code == 200 and not body.get("deduped"):
            o.acked(Batch(t, b.ids, b.raws, b.body, b.key), body)


async def retry_inflight(
    o: Oracle, c: httpx.AsyncClient, b: Batch, present: dict[int, str]
) -> None:
    t = b.topic
    seq_of = {pid: seq for seq, pid in present.items()}
    there = [seq_of.get(pid) for pid in b.ids]
    r = await c.post(f"/v0/topics/{t.name}", content=b.body, headers=JSON)
    body = r.json()
    if r.status_code != 200:
        o.error(f"{t.name}: retry of in-flight {b.key}: {r.status_code} {body}")
        return
    if body.get("deduped"):
        seqs = body.get("seqs")
        hidden = max([t.floor, *(d.before_seq for d in t.deletes), min(present, default=0)])
        ok = isinstance(seqs, list) and len(seqs) == len(b.ids)
        for i, s in enumerate(there):
            if not ok:
                break
            ok = seqs[i] == s if s is not None else (seqs[i] < hidden and seqs[i] not in present)
        if not ok:
            o.error(
                f"{t.name}: retry of in-flight {b.key} deduped to seqs {seqs}, but its "
                f"records read back at {there}"
            )
        b.status = "acked"
        b.seqs = seqs if isinstance(seqs, list) else None
        return
    if any(s is not None for s in there):
        o.error(f"{t.name}: retry of in-flight {b.key} appended again; it survived at {there}")
    o.gone.difference_update(b.ids)
    if body["first_seq"] <= t.top_before_kill:
        o.error(f"{t.name}: retry after restart got seq {body['first_seq']} (reused)")
    o.acked(b, body)


def fail_if_errors(o: Oracle, server: Server, what: str) -> None:
    problems = [f"{i}: {p}" for i, r in enumerate(server.runs) for p in r.problems()]
    if o.errors or problems:
        lines = o.errors[:40] + [f"server log: {p}" for p in problems[:10]]
        raise AssertionError(
            f"seed {o.seed} ({what}; rerun with TOPICD_KILL9_SEED_BASE={o.seed - 1} "
            f"TOPICD_KILL9_ITERATIONS=1): {len(o.errors)} violations\n"
            + "\n".join(lines)
            + f"\n--- server stderr tail ---\n{server.log_tail()}"
        )


async def create_topics(server: Server, topics: list[tuple[str, dict[str, object]]]) -> None:
    async with client(server) as c:
        for name, cfg in topics:
            r = await c.put(f"/v0/topics/{name}", json=cfg)
            assert r.status_code == 201, r.text


# --------------------------------------------------------------------------------------
# Test 1: writers of every class, killed at random moments
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", seeds("load"))
async def test_kill9_during_concurrent_writes(tmp_path, seed):
    rng = random.Random(seed)
    o = Oracle(seed)
    names = [name for name, _ in LOAD_TOPICS]
    with trio.fail_after(60 * CYCLES):
        async with serving(tmp_path, random.Random(f"{seed}/shards")) as server:
            await create_topics(server, LOAD_TOPICS)
            for cycle in range(CYCLES):
                o.cycle = cycle
                load = Load(o, server)
                delay = rng.uniform(*KILL_AFTER_S)
                # one cycle in four drains first (SIGTERM) and is killed mid-drain
                drain = rng.uniform(0, 0.1) if rng.random() < 0.25 else None
                async with trio.open_nursery() as nursery:
                    for w in range(WRITERS):
                        nursery.start_soon(writer, load, w, random.Random(f"{seed}/{cycle}/{w}"))
                    # the random delay is the point of the test: SIGKILL lands anywhere
                    # in the load (group commits, rotations, syncs, checkpoints, deletes)
                    await trio.sleep(delay)
                    if drain is None:
                        load.killed = True
                        await server.kill()
                    else:
                        load.draining = True
                        code = await server.term_then_kill(drain)
                        load.killed = True
                        how = f"exited {code}" if code is not None else "killed"
                        log.info("SIGTERM, %s after %.0f ms of drain", how, drain * 1000)
                inflight = sum(b.status == "inflight" for t in o.topics.values() for b in t.batches)
                log.info(
                    "seed %d cycle %d: %s at %.0f ms, %d writes and %d deletes "
                    "acknowledged so far, %d writes and %d deletes in flight",
                    seed,
                    cycle,
                    "SIGKILL" if drain is None else "SIGTERM",
                    delay * 1000,
                    o.acked_writes,
                    o.acked_deletes,
                    inflight,
                    sum(not d.acked for t in o.topics.values() for d in t.deletes),
                )
                fail_if_errors(o, server, f"load of cycle {cycle}")
                # kill the next start too, mid-recovery; the one after must serve
                where = await server.kill_during_startup(rng)
                log.info("seed %d cycle %d: SIGKILL during the restart, %s", seed, cycle, where)
                await server.start()
                first = await dump_all(server, names)
                present = check_restart(o, first)
                fail_if_errors(o, server, f"restart after kill {cycle}")
                settle(o, present)
                await server.restart()  # SIGKILL again, with no write in between
                second = await dump_all(server, names)
                o.errors.extend(diff_dumps(first, second))
                fail_if_errors(o, server, f"second restart after kill {cycle}")
                await after_restart_writes(o, server, present, rng)
                fail_if_errors(o, server, f"writes after restart {cycle}")
                for t in o.topics.values():
                    t.batches.clear()
                    t.deletes.clear()


# --------------------------------------------------------------------------------------
# Test 2: topic creations and deletions in flight
# --------------------------------------------------------------------------------------

CLASSES = ["fsync", "disk", "memory", "ephemeral"]
CONTROL_WORKERS = 6


@dataclass(eq=False)
class CTopic:
    """One topic name of the control test and what may be true of it."""

    name: str
    request: dict[str, object]
    # present | absent | creating (PUT creating it in flight) | deleting (DELETE in
    # flight) | reconfiguring (PUT changing its durability in flight)
    state: str
    config: dict[str, object] | None = None  # the stored config, once acknowledged
    old_config: dict[str, object] | None = None  # before a reconfiguration in flight
    must: dict[int, bytes] = field(default_factory=dict)  # acknowledged records
    sent: dict[str, bytes] = field(default_factory=dict)  # id -> raw, every write ever
    instance: int = 0  # bumped by each re-creation of the name


@dataclass
class Control:
    seed: int
    server: Server
    topics: dict[str, CTopic] = field(default_factory=dict)
    templates: dict[str, dict[str, object]] = field(default_factory=dict)  # request -> config
    errors: list[str] = field(default_factory=list)
    killed: bool = False
    cycle: int = 0

    def error(self, message: str) -> None:
        self.errors.append(f"[cycle {self.cycle}] {message}")


def request_key(req: dict[str, object]) -> str:
    return json.dumps(req, sort_keys=True)


async def ctl_write(cx: Control, c: httpx.AsyncClient, t: CTopic, stem: str) -> None:
    ids = [f"s{cx.seed}.{stem}.{i}" for i in range(3)]
    raws = [payload(pid, random.Random(pid)) for pid in ids]
    t.sent.update(zip(ids, raws, strict=True))
    instance = t.instance
    body = b'{"create":false,"records":[' + b",".join(b'{"data":%s}' % r for r in raws) + b"]}"
    r = await c.post(f"/v0/topics/{t.name}", content=body, headers=JSON)
    if r.status_code == 404:
        return  # deleted meanwhile: nothing appended
    if r.status_code != 200:
        cx.error(f"{t.name}: write answered {r.status_code} {r.text[:200]}")
        return
    if t.instance == instance:  # else: which instance got it is unknown (sent covers it)
        t.must.update(zip(r.json()["seqs"], raws, strict=True))


async def ctl_create(cx: Control, c: httpx.AsyncClient, t: CTopic) -> None:
    r = await c.put(f"/v0/topics/{t.name}", json=t.request)
    if r.status_code != 201:
        cx.error(f"{t.name}: PUT answered {r.status_code} {r.text[:200]}")
        return
    t.config = r.json()["config"]
    cx.templates.setdefault(request_key(t.request), t.config)
    t.state = "present"


async def ctl_reconfigure(cx: Control, c: httpx.AsyncClient, t: CTopic, durability: str) -> None:
    t.state, t.old_config = "reconfiguring", t.config
    t.request = {**t.request, "durability": durability}
    r = await c.put(f"/v0/topics/{t.name}", json=t.request)
    if r.status_code != 200:
        cx.error(f"{t.name}: reconfiguring PUT answered {r.status_code} {r.text[:200]}")
        return
    t.config = r.json()["config"]
    t.state, t.old_config = "present", None


async def ctl_delete(cx: Control, c: httpx.AsyncClient, t: CTopic) -> None:
    r = await c.delete(f"/v0/topics/{t.name}")
    if r.status_code != 200 or not r.json().get("deleted"):
        cx.error(f"{t.name}: DELETE answered {r.status_code} {r.text[:200]}")
        return
    t.state = "absent"


async def ctl_worker(cx: Control, w: int, rng: random.Random) -> None:
    """Create, delete and write at random until the kill (deletes pick any live topic)."""
    async with client(cx.server) as c:
        n = 0
        while not cx.killed:
            n += 1
            live = [t for t in cx.topics.values() if t.state == "present"]
            gone = [t for t in cx.topics.values() if t.state == "absent"]
            wal = [t for t in live if t.request["durability"] != "ephemeral"]
            op = rng.random()
            req = {"durability": rng.choice(CLASSES), "cap_records": rng.choice([0, 7])}
            try:
                if op < 0.3 or not live:
                    t = CTopic(f"n{cx.cycle}.{w}.{n}", req, "creating")
                    cx.topics[t.name] = t
                    await ctl_create(cx, c, t)
                elif op < 0.4 and gone:  # a new instance under a deleted name
                    t = rng.choice(gone)
                    t.state, t.request, t.config = "creating", req, None
                    t.instance += 1
                    t.must.clear()
                    await ctl_create(cx, c, t)
                elif op < 0.65:
                    t = rng.choice(live)
                    t.state = "deleting"
                    await ctl_delete(cx, c, t)
                elif op < 0.75 and wal:  # fsync/disk/memory, the cap kept
                    t = rng.choice(wal)
                    other = [d for d in CLASSES[:3] if d != t.request["durability"]]
                    await ctl_reconfigure(cx, c, t, rng.choice(other))
                else:
                    await ctl_write(cx, c, rng.choice(live), f"c{cx.cycle}.w{w}.{n}")
            except httpx.TransportError as exc:
                if not cx.killed:
                    cx.error(f"worker {w}: {exc!r} before the kill")
                return


async def check_control(cx: Control) -> dict[str, TopicDump | None]:
    """After a restart: every topic fully there or fully gone; nothing unexpected."""
    async with client(cx.server) as c:
        listed = await list_topics(c)
    dumps = await dump_all(cx.server, list(set(listed) | set(cx.topics)))
    async with client(cx.server) as c:
        for name in sorted(set(listed) - set(cx.topics)):
            cx.error(f"{name}: listed after restart, but nobody created it")
        for t in cx.topics.values():
            d = dumps[t.name]
            there = d is not None
            if there != (t.name in listed):
                cx.error(f"{t.name}: GET says {'present' if there else 'absent'}, list disagrees")
            if t.state == "present" and not there:
                cx.error(f"{t.name}: acknowledged topic ({t.request}) missing after restart")
            if t.state == "absent" and there:
                cx.error(f"{t.name}: acknowledged deletion undone by the restart")
            if d is None:
                r = await c.post(f"/v0/topics/{t.name}/diff", json={})
                if r.status_code != 404:
                    cx.error(f"{t.name}: absent from GET but diff answers {r.status_code}")
                continue
            check_whole(cx, t, d)
    return dumps


def check_whole(cx: Control, t: CTopic, d: TopicDump) -> None:
    """A present topic is whole: its exact config and every acknowledged record."""
    config = json.loads(str(d.state["config"]))
    if t.state == "reconfiguring" and config == t.old_config:
        pass  # the change in flight did not happen: all of the old config
    else:
        want = t.config if t.state != "reconfiguring" else None
        want = want or cx.templates.get(request_key(t.request))
        if want is not None and config != want:
            cx.error(f"{t.name}: half there? config {config} != {want} ({t.state} at the kill)")
        if any(config.get(k) != v for k, v in t.request.items()):
            cx.error(f"{t.name}: config {config} does not hold the request {t.request}")
    if d.tombstones and not (config.get("cap_records") and d.tombstones[0][2] == "cap"):
        cx.error(f"{t.name}: tombstones {d.tombstones} after a process crash")
    got = {seq: raw for seq, _ts, raw, _tag in d.records}
    if config.get("durability") == "ephemeral":
        if got:
            cx.error(f"{t.name}: ephemeral records survived a restart")
        t.must.clear()
        return
    cap = config.get("cap_records") or 0
    assert isinstance(cap, int)
    if cap and len(got) > cap:
        cx.error(f"{t.name}: {len(got)} records after restart, cap_records is {cap}")
    # at the cap, everything below the oldest survivor may have been evicted (by any
    # write, acknowledged or in flight)
    required_from = min(got) if cap and len(got) >= cap else 0
    lost = [s for s in sorted(t.must) if s >= required_from and got.get(s) != t.must[s]]
    if lost:
        cx.error(
            f"{t.name}: {t.state} at the kill, but acknowledged seqs {lost} are missing "
            f"(config {config}, read back seqs {sorted(got)}, state {d.state})"
        )
    sent = set(t.sent.values())
    odd = [s for s, raw in got.items() if raw not in sent]
    if odd:
        cx.error(f"{t.name}: records nobody wrote here at seqs {odd}")
    t.must = dict(got)  # in-flight writes that survived are facts from now on


def settle_control(cx: Control, dumps: dict[str, TopicDump | None]) -> None:
    for t in cx.topics.values():
        d = dumps[t.name]
        t.old_config = None
        if d is None:
            t.state = "absent"
            t.must.clear()
        else:
            t.state = "present"
            t.config = json.loads(str(d.state["config"]))
            t.request = {
                "durability": t.config["durability"],
                "cap_records": t.config["cap_records"],
            }


@pytest.mark.parametrize("seed", seeds("control"))
async def test_kill9_during_topic_create_and_delete(tmp_path, seed):
    rng = random.Random(seed)
    with trio.fail_after(60 * CYCLES):
        async with serving(tmp_path) as server:
            cx = Control(seed, server)
            for cycle in range(CYCLES):
                cx.cycle = cycle
                cx.killed = False
                async with client(server) as c:
                    for i in range(20 if cycle == 0 else 0):
                        req = {"durability": rng.choice(CLASSES)}
                        t = CTopic(f"v{i}", req, "creating")
                        cx.topics[t.name] = t
                        await ctl_create(cx, c, t)
                        await ctl_write(cx, c, t, f"setup.{i}")
                delay = rng.uniform(*KILL_AFTER_S)
                async with trio.open_nursery() as nursery:
                    for w in range(CONTROL_WORKERS):
                        rw = random.Random(f"{seed}/{cycle}/{w}")
                        nursery.start_soon(ctl_worker, cx, w, rw)
                    # the random delay is the point of the test: SIGKILL lands anywhere
                    await trio.sleep(delay)
                    cx.killed = True
                    await server.kill()
                log.info(
                    "seed %d cycle %d: SIGKILL at %.0f ms with %d creations, %d deletions and "
                    "%d reconfigurations in flight (%d topics known)",
                    seed,
                    cycle,
                    delay * 1000,
                    sum(t.state == "creating" for t in cx.topics.values()),
                    sum(t.state == "deleting" for t in cx.topics.values()),
                    sum(t.state == "reconfiguring" for t in cx.topics.values()),
                    len(cx.topics),
                )
                await server.start()
                first = await check_control(cx)
                settle_control(cx, first)
                fail_if_control_errors(cx, f"restart after kill {cycle}")
                await server.restart()  # SIGKILL again, with no mutation in between
                second = await dump_all(server, list(first))
                async with client(server) as c:
                    listed = await list_topics(c)
                cx.errors.extend(diff_dumps(first, second))
                if sorted(listed) != sorted(n for n, d in first.items() if d is not None):
                    cx.error("the topic list changed across a restart without writes")
                fail_if_control_errors(cx, f"second restart after kill {cycle}")
                await recreate_deleted(cx, rng)
                fail_if_control_errors(cx, f"after restart {cycle}")


async def recreate_deleted(cx: Control, rng: random.Random) -> None:
    """A name deleted before the kill starts a fresh instance at seq 1 when recreated."""
    gone = [t for t in cx.topics.values() if t.state == "absent"]
    async with client(cx.server) as c:
        for t in rng.sample(gone, min(len(gone), 5)):
            r = await c.put(f"/v0/topics/{t.name}", json=t.request)
            if r.status_code != 201:
                cx.error(f"{t.name}: recreating answered {r.status_code} {r.text[:200]}")
                continue
            t.state, t.config = "present", r.json()["config"]
            t.instance += 1
            t.must.clear()
            await ctl_write(cx, c, t, f"c{cx.cycle}.again")
            if t.must and min(t.must) != 1:
                cx.error(f"{t.name}: recreated topic's first seq is {min(t.must)}, not 1")


def fail_if_control_errors(cx: Control, what: str) -> None:
    problems = [f"{i}: {p}" for i, r in enumerate(cx.server.runs) for p in r.problems()]
    if cx.errors or problems:
        raise AssertionError(
            f"seed {cx.seed} ({what}; rerun with TOPICD_KILL9_SEED_BASE={cx.seed - 1} "
            f"TOPICD_KILL9_ITERATIONS=1): {len(cx.errors)} violations\n"
            + "\n".join(cx.errors[:40] + [f"server log: {p}" for p in problems[:10]])
            + f"\n--- server stderr tail ---\n{cx.server.log_tail()}"
        )
