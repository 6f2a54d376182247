"""Chaos runs of three jetstream fronts on a three-node JetStream cluster (loopback).

Each run starts a fresh deployment (a new `storage.jetstream.prefix`, R3 streams, three
owner shards) of three `topicd serve` fronts on one three-node cluster, and four writers
(threads), each sending idempotent batch writes (`--batch` records, one idempotency key
per write) to two topics through all three fronts in turn, retrying a write with the same
key on `503`, on a lost connection or on a timeout. The topics are capped
(`cap_records`), so writes evict and tombstones appear. Mid-run, one fault:

* `leader` — the JetStream leader of a written topic's stream is killed with SIGKILL
  (during batch writes), then restarted on its store after the writes;
* `stop` — one NATS node (the leader of a written topic's stream) gets SIGSTOP for
  `--stop-s` seconds (30) under the writes, then SIGCONT;
* `front` — the front owning a written topic is killed with SIGKILL during the retried
  idempotent writes (it stays down; its shards move to the others).

After the writers finish, on every live front and for each topic: every acknowledged
write is there once (its records at `first_seq ..` in order; no retried write stored
twice), no seq is used by two writes, the seqs left are exactly the last `cap_records`
of `1 .. head` with none missing, and the tombstone is exact (`cap`, from 1 to the seq
below the earliest record, the same on every front). Failover: from the fault to the
first acknowledgement of a write to the faulted topic that was first sent after it.

* `jobs` — kill a front that owns queues while jobs are leased. Two queues with durable
  leases (`qa`, `qb`, on different shards); two producers write idempotent 10-job batches
  to them through every front in turn (retried as above); three workers claim through
  every front in turn (`max` 8, 10 s leases) and ack each claim at once, with its lease
  ids, retrying on `503` or a lost connection. A quarter into the run a holder claims 6
  jobs of `qa` with 4 s leases and never acks them; then the front owning `qa`'s shard is
  killed with SIGKILL. The run ends once every acknowledged job was acked. Checked: every
  acknowledged write's jobs were handed out with their data at their seqs (no write lost,
  no retried write stored twice, no seq given to two writes); no two leases of one job
  overlap (each re-grant starts after the previous lease's deadline: no job held by two
  live leases), and delivery counts rise; every job acked (its ack answered) is gone and
  both queues are empty with nothing in flight on every live front (no ack lost); every
  job the holder kept was claimed again after its lease's deadline and acked (the dead
  front's leases claimable after expiry). Failover: from the kill to the first ack on
  `qa` of a job claimed after it.

    python bench/jetstream_chaos.py --scenario leader --runs 10
    python bench/jetstream_chaos.py --scenario stop --runs 10
    python bench/jetstream_chaos.py --scenario front --runs 10
    python bench/jetstream_chaos.py --scenario jobs --runs 10
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from jetstream_failover import Front

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import itertools

from tests.jetstream.conftest import (
    NatsServer,
    nats_server_binary,
    start_cluster,
    start_nats,
    stop_all,
    wait_placeable,
)
from topicd.storage.jetstream import name_key
from topicd.storage.jsfronts import Fronts

TOPICS = ("ca", "cb")  # (names whose shards differ for 3 shards)
WRITERS = 4
HTTP_TIMEOUT_S = 20.0


def post(port: int, path: str, body: dict, headers: dict[str, str] | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
        )
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def get(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def put(port: int, path: str, body: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("PUT", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


class Writes:
    """The writers' shared record: acknowledged writes, and what the fault is timed by."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # key -> (topic, first seq, records, first sent at, acknowledged at)
        self.acked: dict[str, tuple[str, int, int, float, float]] = {}
        self.retries = 0
        self.refusals: dict[int, int] = {}
        # key -> its attempts: (front, outcome, sent at, seconds to the outcome)
        self.trails: dict[str, list[tuple[str, str, float, float]]] = {}

    def write(self, fronts: list[Front], topic: str, key: str, n: int, start: int) -> None:
        records = [{"data": {"k": key, "j": j}} for j in range(n)]
        first_sent = time.perf_counter()
        attempt = start
        trail = self.trails.setdefault(key, [])
        while True:
            front = fronts[attempt % len(fronts)]
            attempt += 1
            if front.proc.poll() is not None:
                continue  # (a killed front: the client tries another)
            sent = time.perf_counter()
            try:
                status, body = post(
                    front.port,
                    f"/v0/topics/{topic}",
                    {"records": records},
                    {"Idempotency-Key": key},
                )
            except OSError as exc:
                trail.append((front.dir.name, type(exc).__name__, sent, time.perf_counter() - sent))
                with self.lock:
                    self.retries += 1
                time.sleep(0.05)  # the retry's pace, not a wait for a condition
                continue
            outcome = str(status)
            if status >= 400:  # (the refusal's message, shortened: why it was refused)
                err = body.get("error") if isinstance(body, dict) else None
                if isinstance(err, dict):
                    outcome += f" {str(err.get('message', ''))[:48]}"
            trail.append((front.dir.name, outcome, sent, time.perf_counter() - sent))
            if status in (503, 429):
                with self.lock:
                    self.retries += 1
                    self.refusals[status] = self.refusals.get(status, 0) + 1
                time.sleep(0.05)
                continue
            assert status in (200, 201), (status, body)
            with self.lock:
                self.acked[key] = (
                    topic,
                    int(body["first_seq"]),
                    n,
                    first_sent,
                    time.perf_counter(),
                )
            return


def writer(w: Writes, fronts: list[Front], who: int, count: int, batch: int) -> None:
    for i in range(count):
        topic = TOPICS[(who + i) % len(TOPICS)]
        w.write(fronts, topic, f"w{who}-{i}", batch, who + i)


def check(w: Writes, fronts: list[Front], cap: int) -> dict[str, int]:
    """The invariants (module docstring) on every live front; returns each topic's head."""
    heads = {}
    for topic in TOPICS:
        mine = {k: v for k, v in w.acked.items() if v[0] == topic}
        spans = sorted((first, first + n - 1, k) for k, (_, first, n, _, _) in mine.items())
        for (_a_lo, a_hi, a), (b_lo, _, b) in itertools.pairwise(spans):
            assert a_hi < b_lo, f"{topic}: writes {a} and {b} share seqs"
        seen_views = []
        for front in fronts:
            if front.proc.poll() is not None:
                continue
            pages: list[tuple[int, int, int]] = []
            records, tomb = read_all(front.port, topic, pages)
            try:
                seen_views.append(check_view(topic, records, tomb, mine, cap))
            except AssertionError as exc:
                # what the front answered, and what it answers now: a stale view or a
                # short page
                _, info = get(front.port, f"/v0/topics/{topic}")
                time.sleep(2)
                again, _ = read_all(front.port, topic)
                raise AssertionError(
                    f"{front.dir.name}: {exc}; its pages (from, records, next) {pages}, "
                    f"its topic {info}; 2 s later it reads {len(again)} records up to "
                    f"{again[-1]['$seq'] if again else None}"
                ) from exc
        assert seen_views, "no front is alive"
        assert len(set(seen_views)) == 1, f"{topic}: fronts disagree: {seen_views}"
        heads[topic] = seen_views[0][0]
    return heads


def check_view(
    topic: str,
    records: list[dict],
    tomb: dict | None,
    mine: dict[str, tuple[str, int, int, float, float]],
    cap: int,
) -> tuple[int, int | None, str]:
    """One front's view of `topic` checked against the acknowledged writes `mine`: its
    (head, earliest seq, tombstone)."""
    seqs = [r["$seq"] for r in records]
    by_seq = {r["$seq"]: r["data"] for r in records}
    top = seqs[-1] if seqs else 0
    # every seq from the earliest kept to the top is there (no deletes here)
    assert seqs == list(range(top - len(seqs) + 1, top + 1)), f"{topic}: gaps"
    assert len(seqs) == min(cap, top), (topic, len(seqs), top)
    # each key's records are contiguous, in order, at the acknowledged seqs
    keys_at: dict[str, list[int]] = {}
    for seq, data in by_seq.items():
        keys_at.setdefault(data["k"], []).append(seq)
    for k, at in keys_at.items():
        assert k in mine, f"{topic}: {k} stored but never acknowledged"
        _, first, n, _, _ = mine[k]
        assert at == [s for s in range(first, first + n) if s in by_seq], (k, at, first)
        assert [by_seq[s]["j"] for s in at] == [s - first for s in at]
    for k, (_, first, n, _, _) in mine.items():
        if first + n - 1 >= top - cap + 1:  # (not wholly evicted)
            assert k in keys_at, f"{topic}: acknowledged write {k} lost"
    # the stored seqs are exactly the acknowledged writes' (none reused, no duplicate)
    covered = sum(n for _, (_, _, n, _, _) in mine.items())
    assert covered == top, f"{topic}: {covered} records acknowledged, head {top}"
    if top > cap:
        assert tomb is not None, topic
        assert tomb["reason"] == "cap", (topic, tomb)
        assert (tomb["gap_from"], tomb["gap_to"]) == (1, top - cap), (topic, tomb)
    else:
        assert tomb is None, (topic, tomb)
    return (top, seqs[0] if seqs else None, json.dumps(tomb, sort_keys=True))


def read_all(
    port: int, topic: str, pages: list[tuple[int, int, int]] | None = None
) -> tuple[list[dict], dict | None]:
    """Every record of `topic` from seq 0 (paged), and the first page's tombstone; each
    page's (cursor, records, next_from_seq) is added to `pages`."""
    records: list[dict] = []
    tomb = None
    cursor = 0
    give_up = time.perf_counter() + 60
    while True:
        status, body = post(port, f"/v0/topics/{topic}/diff", {"from_seq": cursor, "limit": 1000})
        if status == 503 and time.perf_counter() < give_up:
            time.sleep(0.1)  # (the cluster settling after the fault; a client retries)
            continue
        assert status == 200, body
        if cursor == 0:
            tomb = body.get("tombstone")
        if pages is not None:
            pages.append((cursor, len(body["records"]), int(body["next_from_seq"])))
        records += body["records"]
        if not body["records"]:
            return records, tomb
        cursor = int(body["next_from_seq"])


async def _placement(urls: list[str], prefix: str, topic: str) -> tuple[str, str]:
    """(the server name of the leader of `topic`'s stream, the id of the front holding
    the lease of `topic`'s shard), from the registry and the stream's info."""
    import nats

    nc = await nats.connect(servers=urls)
    try:
        js = nc.jetstream(timeout=5)
        kv = await js.key_value(f"{prefix}_registry")
        tid = int((await kv.get(name_key(topic))).value or b"0")
        info = await js.stream_info(f"{prefix}_T{tid}")
        assert info.cluster is not None
        lease = json.loads((await kv.get(f"front.owner.{Fronts.shard_of_name(topic, 3)}")).value)
        return info.cluster.leader or "", str(lease["front"])
    finally:
        await nc.close()


def squeeze(trail: list[tuple[str, str, float, float]], t0: float) -> list[str]:
    """A write's attempts for a report, in s from `t0`: `front outcome @sent+took`, the
    quick alike ones in a row (under 0.5 s each, the same outcome) as one line `n×`."""
    out: list[str] = []
    run: list[tuple[str, str, float, float]] = []

    def flush() -> None:
        if len(run) > 1:
            _, o, t, _ = run[0]
            out.append(f"{len(run)}× {o} @{t - t0:.2f}..{run[-1][2] - t0:.2f}")
        elif run:
            f, o, t, d = run[0]
            out.append(f"{f} {o} @{t - t0:.2f}+{d:.2f}")
        run.clear()

    for step in trail:
        if run and (step[3] >= 0.5 or step[1] != run[-1][1]):
            flush()
        run.append(step)
        if step[3] >= 0.5:
            flush()
    flush()
    return out


def front_env(args: argparse.Namespace) -> dict[str, str]:
    """The fronts' settings given with `--env NAME=VALUE`."""
    out = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("TOPICD_"):
            raise SystemExit(f"--env wants TOPICD_NAME=VALUE, not {item!r}")
        out[name] = value
    return out


def one_run(
    k: int, root: Path, binary: str, servers: list[NatsServer], args: argparse.Namespace
) -> dict[str, object]:
    urls = [s.url for s in servers]
    prefix = f"chaos{args.scenario}{k}"
    env = {
        "TOPICD_STORAGE_BACKEND": "jetstream",
        "TOPICD_JETSTREAM_SERVERS": ",".join(urls),
        "TOPICD_STORAGE_JETSTREAM_REPLICAS": "3",
        "TOPICD_STORAGE_JETSTREAM_SHARDS": "3",
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": str(args.lease_ms),
        "TOPICD_STORAGE_JETSTREAM_REQUEST_TIMEOUT_MS": str(args.request_timeout_ms),
        "TOPICD_JETSTREAM_PREFIX": prefix,
        **front_env(args),
    }
    fronts: list[Front] = []
    run_root = root / f"run{k}"
    result: dict[str, object] = {}
    wait_placeable(urls, 3)  # (a node restarted by the last run is back in the cluster)
    try:
        for i in range(3):
            front = Front(run_root, f"f{i}", env)
            front.wait_ready()
            fronts.append(front)
        time.sleep(args.lease_ms / 1000)  # (the shards spread over the fronts: a settle)
        for topic in TOPICS:
            status = put(fronts[0].port, f"/v0/topics/{topic}", {"cap_records": args.cap})
            assert status in (200, 201), status
        w = Writes()
        threads = [
            threading.Thread(target=writer, args=(w, fronts, i, args.writes, args.batch))
            for i in range(WRITERS)
        ]
        for t in threads:
            t.start()
        while len(w.acked) < args.writes:  # about a quarter of the writes, then the fault
            time.sleep(0.05)
        target = TOPICS[0]
        stream_leader, owner_id = asyncio.run(_placement(urls, prefix, target))
        t_fault = time.perf_counter()
        victim: NatsServer | None = None
        if args.scenario in ("leader", "stop"):
            victim = next(s for s in servers if s.name == stream_leader)
            if args.scenario == "leader":
                os.kill(victim.pid, signal.SIGKILL)
                assert victim.proc is not None
                victim.proc.wait()
            else:
                os.kill(victim.pid, signal.SIGSTOP)
                time.sleep(args.stop_s)  # the fault's length, by definition
                os.kill(victim.pid, signal.SIGCONT)
        else:  # front: the one holding the lease of `target`'s shard
            owner = next(f for f in fronts if f"front {owner_id}" in f.text())
            owner.proc.send_signal(signal.SIGKILL)
            owner.proc.wait()
            result["killed_front"] = owner.dir.name
        for t in threads:
            t.join()
        after = [(v[4], k) for k, v in w.acked.items() if v[0] == target and v[3] >= t_fault]
        result["failover_s"] = (min(after)[0] - t_fault) if after else None
        # the writes acknowledged first after the fault: their attempts, timed from it
        result["trails"] = [(k, squeeze(w.trails[k], t_fault)) for _, k in sorted(after)[:2]]
        result["acked"] = len(w.acked)
        result["retries"] = w.retries
        result["refusals"] = dict(w.refusals)
        if victim is not None and args.scenario == "leader":
            restarted = restart(binary, victim)
            servers[servers.index(victim)] = restarted
        result["heads"] = check(w, fronts, args.cap)
        result["leader"] = stream_leader
        return result
    finally:
        for front in fronts:
            front.stop()


QUEUES = ("qa", "qb")  # (names whose shards differ for 3 shards)
JOB_LEASE_MS = 10_000  # the workers' leases
HOLD_LEASE_MS = 4_000  # the holder's leases (it never acks)
HOLD = 6


class Jobs(Writes):
    """The `jobs` scenario's shared record: writes (as `Writes`), every lease granted,
    every ack answered."""

    def __init__(self) -> None:
        super().__init__()
        # (queue, seq) -> [(deadline ms, lease ms, deliveries, node, lease id, data)]
        self.grants: dict[tuple[str, int], list[tuple[int, int, int, str, str, object]]] = {}
        self.acked_jobs: dict[tuple[str, int], float] = {}  # -> when the ack answered
        # jobs skipped by an ack that was retried (its first try may have acked them)
        self.maybe_acked: set[tuple[str, int]] = set()
        self.held: list[tuple[str, int, int]] = []  # the holder's (queue, seq, deadline)
        self.done = threading.Event()
        self.writers_done = threading.Event()

    def call(self, fronts: list[Front], at: int, path: str, body: dict) -> tuple[bool, dict]:
        """One queue call, retried on another front on `503`, `429` or a lost connection:
        (whether it was retried, the answer)."""
        retried = False
        while True:
            front = fronts[at % len(fronts)]
            at += 1
            if front.proc.poll() is not None:
                continue
            try:
                status, answer = post(front.port, path, body)
            except OSError:
                retried = True
                with self.lock:
                    self.retries += 1
                time.sleep(0.05)  # the retry's pace
                continue
            if status in (503, 429):
                retried = True
                with self.lock:
                    self.retries += 1
                    self.refusals[status] = self.refusals.get(status, 0) + 1
                time.sleep(0.05)
                continue
            assert status == 200, (path, status, answer)
            return retried, answer

    def claim(self, fronts: list[Front], at: int, q: str, node: str, n: int, lease_ms: int):
        body = {"node": node, "max": n, "lease_ms": lease_ms}
        _, answer = self.call(fronts, at, f"/v0/topics/{q}/claim", body)
        got = answer["claimed"]
        with self.lock:
            for job in got:
                self.grants.setdefault((q, job["$seq"]), []).append(
                    (
                        job["deadline"],
                        lease_ms,
                        job["deliveries"],
                        node,
                        job["lease_id"],
                        job["data"],
                    )
                )
        return got


def job_worker(j: Jobs, fronts: list[Front], who: int, give_up: float) -> None:
    at = who
    while not j.done.is_set():
        if time.perf_counter() > give_up:
            raise SystemExit("the workers did not finish the jobs in time")
        q = QUEUES[at % len(QUEUES)]
        at += 1
        got = j.claim(fronts, at, q, f"w{who}", 8, JOB_LEASE_MS)
        if not got:
            time.sleep(0.02)  # nothing ready: the poll's pace
            continue
        seqs = [job["$seq"] for job in got]
        body = {"node": f"w{who}", "seqs": seqs, "lease_ids": [job["lease_id"] for job in got]}
        retried, answer = j.call(fronts, at, f"/v0/topics/{q}/ack", body)
        now = time.time() * 1000
        with j.lock:
            for seq in seqs:
                if seq not in answer["skipped"]:
                    j.acked_jobs[(q, seq)] = now
                elif retried:
                    j.maybe_acked.add((q, seq))


def jobs_run(
    k: int, root: Path, binary: str, servers: list[NatsServer], args: argparse.Namespace
) -> dict[str, object]:
    urls = [s.url for s in servers]
    prefix = f"chaosjobs{k}"
    env = {
        "TOPICD_STORAGE_BACKEND": "jetstream",
        "TOPICD_JETSTREAM_SERVERS": ",".join(urls),
        "TOPICD_STORAGE_JETSTREAM_REPLICAS": "3",
        "TOPICD_STORAGE_JETSTREAM_SHARDS": "3",
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": str(args.lease_ms),
        "TOPICD_STORAGE_JETSTREAM_REQUEST_TIMEOUT_MS": str(args.request_timeout_ms),
        "TOPICD_JETSTREAM_PREFIX": prefix,
        **front_env(args),
    }
    fronts: list[Front] = []
    result: dict[str, object] = {}
    wait_placeable(urls, 3)
    try:
        for i in range(3):
            front = Front(root / f"jobs{k}", f"f{i}", env)
            front.wait_ready()
            fronts.append(front)
        time.sleep(args.lease_ms / 1000)  # (the shards spread over the fronts: a settle)
        for q in QUEUES:
            body = {"type": "queue", "leases_durable": True}
            status = put(fronts[0].port, f"/v0/topics/{q}", body)
            assert status in (200, 201), status
        j = Jobs()
        writes = args.writes // 2
        give_up = time.perf_counter() + 180

        def producer(who: int) -> None:
            for i in range(writes):
                q = QUEUES[(who + i) % len(QUEUES)]
                j.write(fronts, q, f"p{who}-{i}", 10, who + i)

        producers = [threading.Thread(target=producer, args=(i,)) for i in range(2)]
        workers = [
            threading.Thread(target=job_worker, args=(j, fronts, i, give_up)) for i in range(3)
        ]
        for t in producers + workers:
            t.start()
        while len(j.acked) < writes // 2:  # a quarter of the writes, then the fault
            time.sleep(0.05)
        target = QUEUES[0]
        held = j.claim(fronts, 0, target, "holder", HOLD, HOLD_LEASE_MS)
        j.held = [(target, job["$seq"], job["deadline"]) for job in held]
        _, owner_id = asyncio.run(_placement(urls, prefix, target))
        owner = next(f for f in fronts if f"front {owner_id}" in f.text())
        kill_ms = time.time() * 1000
        owner.proc.send_signal(signal.SIGKILL)
        owner.proc.wait()
        result["killed_front"] = owner.dir.name
        for t in producers:
            t.join()
        produced = {
            (topic, first + i) for topic, first, n, _, _ in j.acked.values() for i in range(n)
        }
        while True:
            with j.lock:
                done = set(j.acked_jobs) | j.maybe_acked
            if produced <= done or (produced <= done | set(j.grants) and empty(fronts)):
                break
            if time.perf_counter() > give_up:
                left = sorted(produced - done)[:20]
                raise SystemExit(f"jobs never acked: {left}")
            time.sleep(0.1)  # the workers' progress, checked at a pace
        j.done.set()
        for t in workers:
            t.join()
        firsts = []
        for (q, seq), acked_at in j.acked_jobs.items():
            deadline, lease_ms = j.grants[(q, seq)][-1][:2]
            if q == target and deadline - lease_ms >= kill_ms:  # claimed after the kill
                firsts.append(acked_at)
        result["failover_s"] = (min(firsts) - kill_ms) / 1000 if firsts else None
        check_jobs(j, fronts, produced)
        result["jobs"] = len(produced)
        result["grants"] = sum(len(g) for g in j.grants.values())
        result["regranted"] = len(j.held)
        result["retries"] = j.retries
        result["refusals"] = dict(j.refusals)
        return result
    finally:
        for front in fronts:
            front.stop()


def empty(fronts: list[Front]) -> bool:
    """Whether both queues hold no job, on the first live front."""
    front = next(f for f in fronts if f.proc.poll() is None)
    return all(not read_all(front.port, q)[0] for q in QUEUES)


def check_jobs(j: Jobs, fronts: list[Front], produced: set[tuple[str, int]]) -> None:
    """The `jobs` invariants (module docstring)."""
    # every acknowledged write's jobs were handed out, with their data, at their seqs
    for key, (q, first, n, _, _) in j.acked.items():
        for i in range(n):
            grants = j.grants.get((q, first + i))
            assert grants, f"{q}: job {first + i} of acknowledged write {key} never handed out"
            for g in grants:
                assert g[5] == {"k": key, "j": i}, (q, first + i, g)
    # nothing was handed out that no acknowledged write produced
    assert set(j.grants) <= produced, sorted(set(j.grants) - produced)[:10]
    # no two live leases of one job: each grant starts after the last one's deadline
    for (q, seq), grants in j.grants.items():
        grants.sort(key=lambda g: g[2])  # (by delivery count: the order they were made)
        for a, b in itertools.pairwise(grants):
            start_b = b[0] - b[1]
            assert start_b > a[0], f"{q}: job {seq} leased to {b[3]} while {a[3]} held it"
            assert b[2] > a[2], f"{q}: job {seq}: delivery count did not rise: {a} {b}"
    # the holder's jobs (leased through the killed owner) were claimed again after expiry
    for q, seq, deadline in j.held:
        later = [g for g in j.grants[(q, seq)] if g[3] != "holder"]
        assert later, f"{q}: held job {seq} never claimed again"
        assert later[0][0] - later[0][1] > deadline, (q, seq, deadline, later[0])
        assert (q, seq) in j.acked_jobs or (q, seq) in j.maybe_acked, (q, seq)
    # no ack lost: both queues empty, nothing in flight, on every live front
    for front in fronts:
        if front.proc.poll() is not None:
            continue
        for q in QUEUES:
            records, _ = read_all(front.port, q)
            left = [r["$seq"] for r in records]
            assert not left, f"{q} on {front.dir.name}: acked jobs still there: {left[:10]}"
            conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=HTTP_TIMEOUT_S)
            try:
                conn.request("GET", f"/v0/topics/{q}?touch=false")
                state = json.loads(conn.getresponse().read())
            finally:
                conn.close()
            assert state["queue"]["ready"] == 0, (q, front.dir.name, state)
            assert state["count"] == 0, (q, front.dir.name, state)


def restart(binary: str, server: NatsServer) -> NatsServer:
    """Start a killed node again on its store, ports and cluster settings."""
    node = server.store.parent
    listen = server.url.removeprefix("nats://")
    again = start_nats(binary, node, listen, include="extra.conf")
    again.name = server.name
    return again


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("leader", "stop", "front", "jobs"), required=True)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--writes", type=int, default=60, help="writes per writer (4 writers)")
    p.add_argument("--batch", type=int, default=20, help="records per write")
    p.add_argument("--cap", type=int, default=1500, help="cap_records of each topic")
    p.add_argument("--stop-s", type=float, default=30.0, help="the `stop` fault's length")
    p.add_argument("--lease-ms", type=int, default=3000)
    p.add_argument(
        "--request-timeout-ms", type=int, default=5000, help="the fronts' request timeout"
    )
    p.add_argument(
        "--slow-s",
        type=float,
        default=15.0,
        help="a failover longer than this prints its writes' attempts and keeps the logs",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of every front (repeatable), e.g. TOPICD_MAX_IDEMPOTENCY_ENTRIES=0",
    )
    args = p.parse_args()
    binary, why = nats_server_binary()
    if binary is None:
        raise SystemExit(why)
    root = Path(tempfile.mkdtemp(prefix="jschaos-"))
    servers = start_cluster(binary, root)
    times = []
    ok = False
    keep = False  # (a run's failover took longer than --slow-s)
    try:
        wait_placeable([s.url for s in servers], 3)
        for k in range(args.runs):
            run = jobs_run if args.scenario == "jobs" else one_run
            res = run(k, root, binary, servers, args)
            fo = res["failover_s"]
            assert isinstance(fo, float)
            times.append(fo * 1000)
            if args.scenario == "jobs":
                print(
                    f"run {k + 1} (jobs): first ack of a job claimed after the kill "
                    f"{fo * 1000:.0f} ms after it; {res['jobs']} jobs, {res['grants']} "
                    f"leases, {res['regranted']} held jobs claimed again after expiry, "
                    f"{res['retries']} retries {res['refusals']}; checks passed",
                    flush=True,
                )
            else:
                print(
                    f"run {k + 1} ({args.scenario}): first write {fo * 1000:.0f} ms after the "
                    f"fault; {res['acked']} writes acknowledged, {res['retries']} retries "
                    f"{res['refusals']}, heads {res['heads']}; checks passed",
                    flush=True,
                )
                if fo > args.slow_s:
                    # why: the attempts of the first writes acknowledged after the fault
                    # (front, outcome, sent at and its duration, in s from the fault);
                    # the run's logs are kept
                    keep = True
                    for key, trail in res["trails"]:  # type: ignore[attr-defined]
                        print(f"  {key}: {trail}", flush=True)
        ok = True
    finally:
        stop_all(servers)
        if ok and not keep:
            shutil.rmtree(root, ignore_errors=True)
        elif ok:
            print(f"the fronts' and servers' logs of the slow runs are in {root}", flush=True)
        else:
            print(f"failed: the fronts' and servers' logs are in {root}", flush=True)
    what = "ack of a job claimed after it" if args.scenario == "jobs" else "acknowledged write"
    print(
        f"{args.scenario}: {len(times)} runs in a row passed; failover to the first "
        f"{what}: median {statistics.median(times):.0f} ms, max {max(times):.0f} ms"
    )


if __name__ == "__main__":
    main()
