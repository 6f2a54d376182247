"""`kill -9` during claim/ack storms on queues, against the real `topicd serve` process.

Method: one temporary data directory served by successive `python -m topicd serve`
children (`tests/crash/harness.py`: 1 MiB WAL files, a checkpoint every second or MiB).
Four queues, `disk` and `fsync`, each with and without `leases_durable`. Per cycle, over
one httpx keep-alive client per task:

- two producers append batches of 1..20 jobs to random queues (each job's payload names
  it), logging every acknowledged write with its seqs;
- six workers claim `max` 1..8 jobs from random queues (leases of 1 s, one claim in
  three 4 s) and, per claimed batch, ack most
  jobs in one fenced call, nack a few, extend a few (then ack them), and abandon a few
  (their leases expire and the jobs come back). Every claim answer is logged with its
  jobs' `lease_id`, `deadline` and `deliveries`, every extend with its new deadlines,
  every ack with what it acked, every nack with when it was sent.

After a random delay (200-1200 ms, seeded) the server gets `SIGKILL`, mid-storm; the
next start must serve. Then, read back with diff loops:

- no job acked before the kill is live, and no claim answer ever hands out a job whose
  ack was answered before that claim was sent;
- no job is lost: every job of an acknowledged write is live, or was acked, or had an ack
  in flight at the kill; every live job was sent by a producer;
- on a `leases_durable` queue every lease answered before the kill, not acked or nacked
  since and not expired by now, is counted in the queue's `in_flight` after the restart.

At the end, over every claim answer of the run (several incarnations): a job is never
held by two live leases — for two claims of one job, the later one's server time
(`deadline − lease_ms`) is after the earlier lease's last deadline (extends included),
or the earlier lease was nacked before. The check spans restarts on `leases_durable`
queues and stays within one server process on the others (a restart forgets their
leases by design). Delivery counts grow by at least one per answered claim of a job: on
`leases_durable` queues across restarts too; on the others they start at 1 again in each
process.

Seeds are fixed (2 per CI run, a few seconds each); `TOPICD_KILL9_ITERATIONS=N` runs N
seeds, `TOPICD_KILL9_SEED_BASE` moves them. Every failure names its seed.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import msgspec
import pytest
import trio

from tests.crash.harness import client, serving

if TYPE_CHECKING:
    from tests.crash.harness import Server

log = logging.getLogger(__name__)

pytestmark = pytest.mark.slow

LEASE_MS = 1000
LONG_LEASE_MS = 4000
CYCLES = 2  # kills per seed; a final load phase follows the last restart
KILL_AFTER_S = (0.2, 1.2)
FINAL_LOAD_S = 0.5
PRODUCERS = 2
WORKERS = 6
QUEUES = {
    "q.disk": {"durability": "disk"},
    "q.fsync": {"durability": "fsync"},
    "q.disk.durable": {"durability": "disk", "leases_durable": True},
    "q.fsync.durable": {"durability": "fsync", "leases_durable": True},
}

_ITER = os.environ.get("TOPICD_KILL9_ITERATIONS")
_BASE = int(os.environ.get("TOPICD_KILL9_SEED_BASE", "0"))
SEEDS = [_BASE + 101 + i for i in range(int(_ITER) if _ITER else 2)]


def wall_ms() -> int:
    """The machine's wall clock, as the server reads it (same clock, same process tree)."""
    return time.time_ns() // 1_000_000


# --------------------------------------------------------------------------------------
# What the clients saw
# --------------------------------------------------------------------------------------


@dataclass(eq=False)
class Lease:
    """One job of one claim answer."""

    queue: str
    seq: int
    lease_id: str
    deadline: int  # as claimed; extends move `end`
    deliveries: int
    lease_ms: int
    life: int  # server process it was answered by
    end: int = 0  # last known deadline (claim or extend)
    extend_sent: int | None = None  # wall ms an extend with no answer was sent
    nacked_at: int | None = None  # wall ms the nack was sent (answered as nacked)
    ack: str = ""  # "" | "inflight" | "acked" | "skipped"

    @property
    def claimed_at(self) -> int:
        return self.deadline - self.lease_ms


@dataclass
class QueueLog:
    name: str
    durable: bool
    produced: dict[int, str] = field(default_factory=dict)  # seq -> job id, writes answered
    sent: set[str] = field(default_factory=set)  # every job id ever sent
    acked: set[int] = field(default_factory=set)  # ack answered
    ack_inflight: set[int] = field(default_factory=set)  # ack sent, no answer
    leases: list[Lease] = field(default_factory=list)
    by_id: dict[str, Lease] = field(default_factory=dict)


@dataclass
class Run:
    seed: int
    queues: dict[str, QueueLog]
    life: int = 0
    errors: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def error(self, message: str) -> None:
        self.errors.append(f"[life {self.life}] {message}")

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


class _Job(msgspec.Struct):
    seq: int = msgspec.field(name="$seq")
    lease_id: str = ""
    deadline: int = 0
    deliveries: int = 0


class _Claim(msgspec.Struct):
    claimed: list[_Job]


_CLAIM = msgspec.json.Decoder(_Claim)


# --------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------


async def producer(run: Run, server: Server, rng: random.Random, stem: str) -> None:
    names = sorted(run.queues)
    n = 0
    async with client(server) as c:
        while True:
            q = run.queues[rng.choice(names)]
            ids = [f"{stem}.{n + i}" for i in range(rng.randint(1, 20))]
            n += len(ids)
            q.sent.update(ids)
            body = {"records": [{"data": {"id": pid}} for pid in ids]}
            try:
                r = await c.post(f"/v0/topics/{q.name}", json=body)
            except httpx.HTTPError:
                return  # the kill: this write may or may not have landed
            if r.status_code != 200:
                run.count(f"write {r.status_code}")
                continue
            q.produced.update(zip(r.json()["seqs"], ids, strict=True))
            run.count("jobs produced", len(ids))


async def post(c: httpx.AsyncClient, path: str, body: dict[str, object]) -> httpx.Response | None:
    try:
        return await c.post(path, json=body)
    except httpx.HTTPError:
        return None


async def worker(run: Run, server: Server, rng: random.Random, node: str) -> None:
    names = sorted(run.queues)
    async with client(server) as c:
        while True:
            q = run.queues[rng.choice(names)]
            acked_before = set(q.acked)
            # mostly short leases (abandoned jobs come back within the run), some long
            # ones (they are still live when the server restarts)
            lease_ms = rng.choice([LEASE_MS, LEASE_MS, LONG_LEASE_MS])
            r = await post(
                c,
                f"/v0/topics/{q.name}/claim",
                {"node": node, "max": rng.randint(1, 8), "lease_ms": lease_ms},
            )
            if r is None:
                return
            if r.status_code != 200:
                run.error(f"{q.name}: claim answered {r.status_code} {r.text[:200]}")
                return
            jobs = _CLAIM.decode(r.content).claimed
            if not jobs:
                await trio.sleep(0.005)  # pacing only: nothing to do on this queue
                continue
            run.count("jobs claimed", len(jobs))
            got: list[Lease] = []
            for j in jobs:
                if j.seq in acked_before:
                    run.error(f"{q.name}: claim handed out seq {j.seq}, acked before")
                lease = Lease(
                    q.name, j.seq, j.lease_id, j.deadline, j.deliveries, lease_ms, run.life
                )
                lease.end = j.deadline
                q.leases.append(lease)
                q.by_id[j.lease_id] = lease
                got.append(lease)
            fate = {ls.seq: rng.choices("aenx", weights=[80, 8, 6, 6])[0] for ls in got}
            extend = [ls for ls in got if fate[ls.seq] == "e"]
            if extend and not await do_extend(run, q, c, node, extend):
                return
            nack = [ls for ls in got if fate[ls.seq] == "n"]
            if nack and not await do_nack(run, q, c, node, nack):
                return
            ack = [ls for ls in got if fate[ls.seq] in "ae"]
            if ack and not await do_ack(run, q, c, node, ack):
                return


async def do_extend(
    run: Run, q: QueueLog, c: httpx.AsyncClient, node: str, ls: list[Lease]
) -> bool:
    # until the answer, the deadline may have moved (up or down): marked before sending,
    # since a kill or a cancellation can cut the call after the server got it
    sent = wall_ms()
    for x in ls:
        x.extend_sent = sent
    r = await post(
        c,
        f"/v0/topics/{q.name}/extend",
        {
            "node": node,
            "seqs": [x.seq for x in ls],
            "lease_ids": [x.lease_id for x in ls],
            "lease_ms": 2 * LEASE_MS,
        },
    )
    if r is None:
        return False
    if r.status_code != 200:
        run.error(f"{q.name}: extend answered {r.status_code} {r.text[:200]}")
        return False
    deadlines = r.json()["deadlines"]
    for x in ls:
        x.extend_sent = None
        d = deadlines.get(str(x.seq))
        if d is not None:
            x.end = d  # set, not added: a 4 s lease extended by 2 s may end sooner
    run.count("extends", len(deadlines))
    return True


async def do_nack(run: Run, q: QueueLog, c: httpx.AsyncClient, node: str, ls: list[Lease]) -> bool:
    sent = wall_ms()
    for x in ls:  # it may be released from now on (marked before sending, as above)
        x.nacked_at = sent
    r = await post(
        c,
        f"/v0/topics/{q.name}/nack",
        {"node": node, "seqs": [x.seq for x in ls], "lease_ids": [x.lease_id for x in ls]},
    )
    if r is None:
        return False
    if r.status_code != 200:
        run.error(f"{q.name}: nack answered {r.status_code} {r.text[:200]}")
        return False
    skipped = set(r.json()["skipped"])
    for x in ls:
        if x.seq in skipped:
            x.nacked_at = None  # it was not held: nothing released
    run.count("nacks", len(ls) - len(skipped))
    return True


async def do_ack(run: Run, q: QueueLog, c: httpx.AsyncClient, node: str, ls: list[Lease]) -> bool:
    seqs = [x.seq for x in ls]
    q.ack_inflight.update(seqs)
    for x in ls:
        x.ack = "inflight"
    r = await post(
        c,
        f"/v0/topics/{q.name}/ack",
        {"node": node, "seqs": seqs, "lease_ids": [x.lease_id for x in ls]},
    )
    if r is None:
        return False  # stays in flight: the delete may or may not have committed
    q.ack_inflight.difference_update(seqs)
    if r.status_code != 200:
        run.error(f"{q.name}: ack answered {r.status_code} {r.text[:200]}")
        return False
    skipped = set(r.json()["skipped"])
    for x in ls:
        x.ack = "skipped" if x.seq in skipped else "acked"
        if x.seq not in skipped:
            q.acked.add(x.seq)
    run.count("acks", len(ls) - len(skipped))
    run.count("acks skipped", len(skipped))
    return True


async def load(run: Run, server: Server, rng: random.Random, seconds: float, kill: bool) -> None:
    """Producers and workers for `seconds`, then SIGKILL (or just stop the clients)."""
    async with trio.open_nursery() as nursery:
        for i in range(PRODUCERS):
            nursery.start_soon(
                producer, run, server, random.Random(rng.random()), f"p{run.life}.{i}"
            )
        for i in range(WORKERS):
            nursery.start_soon(worker, run, server, random.Random(rng.random()), f"w{i}")
        await trio.sleep(seconds)  # the kill moment is the point of the test
        if kill:
            await server.kill()
        nursery.cancel_scope.cancel("load over")
    # cancelled requests have unknown outcomes, like those cut by the kill: acks stay
    # in flight; claims were never logged, so they play no part in the checks


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------


class _Rec(msgspec.Struct):
    seq: int = msgspec.field(name="$seq")
    data: dict[str, str] = msgspec.field(default_factory=dict)


class _Diff(msgspec.Struct):
    records: list[_Rec]
    next_from_seq: int
    caught_up: bool


_DIFF = msgspec.json.Decoder(_Diff)


async def live_jobs(c: httpx.AsyncClient, name: str) -> dict[int, str]:
    out: dict[int, str] = {}
    cursor = 0
    while True:
        r = await c.post(f"/v0/topics/{name}/diff", json={"from_seq": cursor, "limit": 1000})
        assert r.status_code == 200, r.text
        d = _DIFF.decode(r.content)
        out.update((x.seq, x.data.get("id", "")) for x in d.records)
        cursor = d.next_from_seq
        if d.caught_up:
            return out


async def check_state(run: Run, server: Server) -> None:
    """After a restart (or at the end): acked jobs gone, every other job there, and the
    leases of `leases_durable` queues recovered."""
    async with client(server) as c:
        for q in run.queues.values():
            live = await live_jobs(c, q.name)
            if back := sorted(q.acked & live.keys()):
                run.error(f"{q.name}: acked jobs are live again: {back[:10]}")
            lost = sorted(
                s for s in q.produced if s not in live and s not in q.acked | q.ack_inflight
            )
            if lost:
                run.error(f"{q.name}: jobs lost (neither acked nor live): {lost[:10]}")
            for seq, pid in live.items():
                if pid not in q.sent:
                    run.error(f"{q.name}: live seq {seq} holds {pid!r}, never sent")
                elif seq in q.produced and q.produced[seq] != pid:
                    run.error(f"{q.name}: seq {seq} holds {pid!r}, written as {q.produced[seq]}")
            if not q.durable:
                continue
            now = wall_ms()
            r = await c.get(f"/v0/topics/{q.name}", params={"touch": "false"})
            in_flight = r.json()["queue"]["in_flight"]
            held = current_leases(q, now + 200)
            if in_flight < len(held):
                run.error(
                    f"{q.name}: {in_flight} leases in flight after the restart, but "
                    f"{len(held)} answered leases run until after now: "
                    f"{[(x.seq, x.end - now) for x in held][:10]}"
                )
            run.count("leases recovered", len(held))


def current_leases(q: QueueLog, after: int) -> list[Lease]:
    """Answered leases not acked, nacked or superseded, whose last deadline is after
    `after` (wall ms)."""
    last: dict[int, Lease] = {}
    for x in q.leases:
        if x.seq not in last or x.claimed_at >= last[x.seq].claimed_at:
            last[x.seq] = x
    return [
        x
        for x in last.values()
        if x.end > after
        and x.extend_sent is None
        and x.nacked_at is None
        and x.ack == ""
        and x.seq not in q.acked | q.ack_inflight
    ]


def check_leases(run: Run) -> None:
    """Over every claim answer: never two live leases on one job; delivery counts grow."""
    for q in run.queues.values():
        by_seq: dict[int, list[Lease]] = {}
        for x in q.leases:
            by_seq.setdefault(x.seq, []).append(x)
        for seq, claims in by_seq.items():
            claims.sort(key=lambda x: (x.claimed_at, x.deliveries))
            for a, b in itertools.pairwise(claims):
                if not q.durable and a.life != b.life:
                    continue  # a restart forgot a's lease, by design
                released = a.nacked_at is not None and b.claimed_at >= a.nacked_at
                end = a.end  # the last deadline for sure, or the least an extend left
                if a.extend_sent is not None:
                    end = min(end, a.extend_sent + 2 * LEASE_MS)
                if b.claimed_at <= end and not released:
                    run.error(
                        f"{q.name}: seq {seq} leased twice at once: {a.lease_id} until "
                        f"{a.end} (life {a.life}) and {b.lease_id} from {b.claimed_at} "
                        f"(life {b.life})"
                    )
            seen = 0
            life = claims[0].life
            for x in claims:
                if not q.durable and x.life != life:
                    life, seen = x.life, 0
                    if x.deliveries != 1:
                        run.error(
                            f"{q.name}: seq {seq}: first claim after a restart counts "
                            f"{x.deliveries} deliveries (leases are not durable here)"
                        )
                if x.deliveries < seen + 1:
                    run.error(
                        f"{q.name}: seq {seq}: claim {x.lease_id} counts {x.deliveries} "
                        f"deliveries after {seen} answered claims"
                        + (" (delivery counts lost in a restart?)" if q.durable else "")
                    )
                seen = max(seen + 1, x.deliveries)
            run.count("jobs claimed more than once", len(claims) > 1)


def fail_if_errors(run: Run, server: Server, what: str) -> None:
    problems = [f"{i}: {p}" for i, r in enumerate(server.runs) for p in r.problems()]
    if run.errors or problems:
        raise AssertionError(
            f"seed {run.seed} ({what}; rerun with TOPICD_KILL9_SEED_BASE={run.seed - 101} "
            f"TOPICD_KILL9_ITERATIONS=1): {len(run.errors)} violations\n"
            + "\n".join(run.errors[:40] + [f"server log: {p}" for p in problems[:10]])
            + f"\n--- server stderr tail ---\n{server.log_tail()}"
        )


# --------------------------------------------------------------------------------------
# The test
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
async def test_kill9_during_claim_and_ack_storms(tmp_path, seed):
    rng = random.Random(seed)
    run = Run(
        seed,
        {name: QueueLog(name, bool(cfg.get("leases_durable"))) for name, cfg in QUEUES.items()},
    )
    with trio.fail_after(30 + 20 * CYCLES):
        async with serving(tmp_path) as server:
            async with client(server) as c:
                for name, cfg in QUEUES.items():
                    r = await c.put(
                        f"/v0/topics/{name}", json={"type": "queue", "lease_ms": LEASE_MS, **cfg}
                    )
                    assert r.status_code == 201, r.text
            for cycle in range(CYCLES):
                await load(run, server, rng, rng.uniform(*KILL_AFTER_S), kill=True)
                fail_if_errors(run, server, f"load of cycle {cycle}")
                run.life += 1
                await server.start()
                await check_state(run, server)
                fail_if_errors(run, server, f"restart after kill {cycle}")
            await load(run, server, rng, FINAL_LOAD_S, kill=False)
            await check_state(run, server)
            check_leases(run)
            fail_if_errors(run, server, "the end")
    log.info("seed %d: %s", seed, dict(sorted(run.counts.items())))
