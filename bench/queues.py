#!/usr/bin/env python
"""Queue benchmark: end-to-end jobs/s and claim latency against backlog and priorities.

    python bench/queues.py [--quick] [--duration S] [--workers N] [--claims N]

Needs what the project's dev install brings (orjson; topicd itself from this checkout);
installs nothing. One `topicd serve` on a temporary data directory (pinned to CPU 0 when
there are two or more, load generators on the others). In one run:

1. **c=64 single-record `disk` writes**: 64 closed-loop writers on one `disk` topic
   (bench/http_core.py's raw-socket load generator): records/s, the baseline of target 3.
2. **end to end, `disk` queue**: producers write jobs in 100-record batches (closed loop,
   held back while more than `--backlog-cap` jobs are waiting) while `--workers` (50)
   raw-socket workers (asyncio streams, one connection each, not httpx) each claim
   `max` 8 and ack every claimed batch in one call (with its fences). Reports acked jobs/s
   over the window, and produced jobs/s.
3. the same on an **`ephemeral` queue**.
   Steps 1-3 run `--repeat` (3) times in turn; each round's ratio (end-to-end `disk`
   jobs/s ÷ c=64 writes/s) compares neighbours in time, and the median round is reported.
4. **claim latency**: on `disk` queues pre-filled to backlogs of 1k, 100k and 1M jobs
   (`--quick`: 1k, 10k, 100k), once with every job at priority 0 and once with 100
   distinct priorities (0..99), one extra claimer at c=1 claims `max` 1, timed; after each
   timed claim it acks the job and writes one new job (same priority mix), untimed, so
   the backlog stays put. Meanwhile a background load runs below saturation on another
   `disk` queue: producers paced to `--bg-rate` jobs/s, 8 workers claiming 8 and acking.

Targets (issue 12): claim p50 at the largest backlog within 1.2x of the p50 at 1k, for 1
and for 100 priorities; the 100-priority p50 within 1.2x of the 1-priority p50 at the
same backlog; end-to-end `disk` jobs/s at least 3x the same run's c=64 single-record
`disk` write rate. Results are printed and written to bench/results/queue-<ts>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import http_core as hc
import loadgen
import orjson

HOST = hc.HOST
BG_WORKERS = 8
LEASE_MS = 60_000


# ------------------------------------------------------------------------------------------
# the queue load generator (a separate process, asyncio, raw sockets)


class _Conn:
    """One keep-alive HTTP/1.1 connection over asyncio streams, one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, req: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(req)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        low = head.lower()
        i = low.find(b"\r\ncontent-length:")
        j = low.find(b"\r\n", i + 17)
        body = await self.reader.readexactly(int(low[i + 17 : j]))
        if b"\r\nconnection: close" in low:
            self.writer.close()
            self.reader = self.writer = None
        return status, body


def _post(port: int, path: str, body: bytes) -> bytes:
    return loadgen.build_request(HOST, port, path, body)


def jobs_body(n: int, prios: int, start: int) -> bytes:
    """`n` jobs; with `prios` > 1 job i gets priority (start + i) % prios."""
    if prios <= 1:
        return orjson.dumps({"records": [{"data": {"job": start + i}} for i in range(n)]})
    return orjson.dumps(
        {
            "records": [
                {"data": {"job": start + i}, "priority": (start + i) % prios} for i in range(n)
            ]
        }
    )


async def _load(spec: dict[str, Any], backlog: Any, out: dict[str, Any]) -> None:
    port, topic = spec["port"], spec["topic"]
    t_start, t_end = spec["t_start"], spec["t_end"]
    base = f"/v0/topics/{topic}"
    stats = {"acked": 0, "produced": 0, "claims": 0, "empty": 0, "errors": 0, "first_error": ""}

    def error(what: str) -> None:
        stats["errors"] += 1
        stats["first_error"] = stats["first_error"] or what

    async def producer(k: int) -> None:
        conn = _Conn(HOST, port)
        req = _post(port, base, jobs_body(100, 1, k))
        pace = spec["producer_interval_s"]
        nxt = time.monotonic()
        while time.monotonic() < t_end:
            if pace:
                nxt += pace
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            elif backlog.value > spec["backlog_cap"]:
                await asyncio.sleep(0.002)
                continue
            status, body = await conn.request(req)
            if status != 200:
                error(f"write {status} {body[:200]!r}")
                await asyncio.sleep(0.01)
                continue
            with backlog.get_lock():
                backlog.value += 100
            if t_start <= time.monotonic() < t_end:
                stats["produced"] += 100

    async def worker(k: int) -> None:
        conn = _Conn(HOST, port)
        node = f"w{spec['id']}.{k}"
        claim = _post(
            port, base + "/claim", orjson.dumps({"node": node, "max": 8, "lease_ms": LEASE_MS})
        )
        while time.monotonic() < t_end:
            status, body = await conn.request(claim)
            if status != 200:
                error(f"claim {status} {body[:200]!r}")
                await asyncio.sleep(0.01)
                continue
            jobs = orjson.loads(body)["claimed"]
            stats["claims"] += 1
            if not jobs:
                stats["empty"] += 1
                await asyncio.sleep(spec["empty_backoff_s"])
                continue
            ack = {
                "node": node,
                "seqs": [j["$seq"] for j in jobs],
                "lease_ids": [j["lease_id"] for j in jobs],
            }
            status, body = await conn.request(_post(port, base + "/ack", orjson.dumps(ack)))
            if status != 200:
                error(f"ack {status} {body[:200]!r}")
                continue
            n = orjson.loads(body)["acked"]
            with backlog.get_lock():
                backlog.value -= n
            if t_start <= time.monotonic() < t_end:
                stats["acked"] += n

    tasks = [producer(k) for k in range(spec["producers"])]
    tasks += [worker(k) for k in range(spec["workers"])]
    await asyncio.gather(*tasks)
    out.update(stats)


def load_main(spec: dict[str, Any], backlog: Any, pipe: Any, cpu: int | None) -> None:
    if cpu is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})
    out: dict[str, Any] = {}
    c0 = time.process_time()
    try:
        asyncio.run(_load(spec, backlog, out))
    except Exception as exc:  # report it to the coordinator
        out["fatal"] = repr(exc)
    out["cpu_s"] = time.process_time() - c0
    pipe.send(out)


def run_queue_load(
    port: int,
    topic: str,
    *,
    workers: int,
    producers: int,
    duration: float,
    warmup: float,
    procs: int,
    cpus: list[int | None],
    backlog_cap: int = 20_000,
    producer_rate: float | None = None,
    empty_backoff_s: float = 0.002,
    during: Any = None,
) -> dict[str, Any]:
    """Run the claim/ack workload (plus `during()` in this process, if given)."""
    ctx = mp.get_context("spawn")
    backlog = ctx.Value("q", 0)
    t0 = time.monotonic() + 1.0  # the processes start meanwhile
    t_start, t_end = t0 + warmup, t0 + warmup + duration
    running = []
    for i in range(procs):
        here, there = ctx.Pipe()
        share = lambda n, i=i: n // procs + (1 if i < n % procs else 0)  # noqa: E731
        p_producers = share(producers)
        spec = {
            "id": i,
            "port": port,
            "topic": topic,
            "workers": share(workers),
            "producers": p_producers,
            "t_start": t_start,
            "t_end": t_end,
            "backlog_cap": backlog_cap,
            "producer_interval_s": (100 * producers / producer_rate) if producer_rate else 0.0,
            "empty_backoff_s": empty_backoff_s,
        }
        proc = ctx.Process(target=load_main, args=(spec, backlog, there, cpus[i % len(cpus)]))
        proc.start()
        running.append((proc, here))
    extra = None
    if during is not None:
        time.sleep(max(0.0, t_start - time.monotonic()))
        extra = during(t_end)
    results = []
    for proc, pipe in running:
        if not pipe.poll(duration + warmup + 120):
            raise RuntimeError("queue load generator silent")
        results.append(pipe.recv())
        proc.join(10)
    fatal = [r["fatal"] for r in results if "fatal" in r]
    if fatal:
        raise RuntimeError(f"queue load generator failed: {fatal[0]}")
    acked = sum(r["acked"] for r in results)
    produced = sum(r["produced"] for r in results)
    return {
        "jobs_per_s": acked / duration,
        "produced_per_s": produced / duration,
        "claims": sum(r["claims"] for r in results),
        "empty_claims": sum(r["empty"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "first_error": next((r["first_error"] for r in results if r["first_error"]), ""),
        "client_cpu_s": sum(r["cpu_s"] for r in results),
        "backlog_at_end": backlog.value,
        "probe": extra,
    }


# ------------------------------------------------------------------------------------------
# set-up and the c=1 claimer


def put_queue(conn: loadgen.BlockingConn, port: int, topic: str, **cfg: Any) -> None:
    body = orjson.dumps({"type": "queue", **cfg})
    status, text = conn.request(
        loadgen.build_request(HOST, port, f"/v0/topics/{topic}", body, "PUT")
    )
    if status not in (200, 201):
        raise RuntimeError(f"PUT {topic}: {status} {text[:300]!r}")


def fill(
    conn: loadgen.BlockingConn, port: int, topic: str, have: int, want: int, prios: int
) -> None:
    path = f"/v0/topics/{topic}"
    while have < want:
        n = min(1000, want - have)
        status, text = conn.request(_post(port, path, jobs_body(n, prios, have)))
        if status != 200:
            raise RuntimeError(f"fill {topic}: {status} {text[:300]!r}")
        have += n


def claim_probe(port: int, topic: str, prios: int, n: int) -> Any:
    """c=1 claims of one job, timed; each followed (untimed) by its ack and one new job."""

    def run(t_end: float) -> dict[str, Any]:
        conn = loadgen.BlockingConn(HOST, port)
        base = f"/v0/topics/{topic}"
        claim = _post(port, base + "/claim", b'{"node":"probe","max":1,"lease_ms":60000}')
        lat: list[float] = []
        k = 10_000_000
        for _ in range(n):
            if time.monotonic() > t_end:
                break
            t0 = time.perf_counter()
            status, body = conn.request(claim)
            lat.append((time.perf_counter() - t0) * 1000)
            jobs = orjson.loads(body)["claimed"] if status == 200 else []
            if not jobs:
                raise RuntimeError(f"probe claim on {topic}: {status} {body[:200]!r}")
            ack = {"node": "probe", "seqs": [jobs[0]["$seq"]], "lease_ids": [jobs[0]["lease_id"]]}
            conn.request(_post(port, base + "/ack", orjson.dumps(ack)))
            conn.request(_post(port, base, jobs_body(1, prios, k)))
            k += 1
        lat.sort()
        return {
            "claims": len(lat),
            "p50_ms": hc.percentile(lat, 50),
            "p99_ms": hc.percentile(lat, 99),
            "mean_ms": sum(lat) / len(lat),
        }

    return run


def c64_writes(server: hc.Server, args: Any, conn: loadgen.BlockingConn) -> dict[str, Any]:
    status, _ = conn.request(
        loadgen.build_request(
            HOST, server.port, "/v0/topics/w.disk", b'{"durability":"disk"}', "PUT"
        )
    )
    assert status in (200, 201), status
    workers = hc.Workers(args.load_procs, args.load_cpu)
    try:
        reqs = [loadgen.build_request(HOST, server.port, "/v0/topics/w.disk", hc.write_body(1))]
        return hc.run_throughput(workers, server, lambda _i: reqs, "write", 1, 64, args)
    finally:
        workers.close()


# ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short windows, backlogs 1k/10k/100k")
    p.add_argument("--duration", type=float, default=None, help="measured window, s (10)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up, s (2)")
    p.add_argument("--workers", type=int, default=50)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--backlog-cap", type=int, default=20_000)
    p.add_argument("--claims", type=int, default=None, help="timed probe claims (2000)")
    p.add_argument("--bg-rate", type=float, default=None, help="background jobs/s (1500)")
    p.add_argument("--load-procs", type=int, default=1)
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds of (c=64 writes, end to end disk, end to end ephemeral); the median "
        "round's ratio is the result",
    )
    p.add_argument(
        "--throughput-only",
        action="store_true",
        help="only the c=64 writes and the end-to-end runs (no claim-latency part)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.duration = args.duration or (3.0 if args.quick else 10.0)
    args.warmup = args.warmup or (1.0 if args.quick else 2.0)
    args.claims = args.claims or (500 if args.quick else 2000)
    args.bg_rate = args.bg_rate or 1500.0
    backlogs = [1000, 10_000, 100_000] if args.quick else [1000, 100_000, 1_000_000]
    cpus = sorted(os.sched_getaffinity(0))
    srv_cpu = cpus[0] if len(cpus) > 1 else None
    load_cpus: list[int | None] = list(cpus[1:]) if len(cpus) > 1 else [None]
    args.load_cpu = load_cpus[0]
    doc: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": hc.machine_info(hc.REPO_DIR),
    }
    with tempfile.TemporaryDirectory(prefix="topicd-bench-queue-") as tmp:
        tmpdir = Path(tmp)
        server = hc.topicd_server(tmpdir, hc.REPO_DIR, data="d")
        server.start(cpu=srv_cpu)
        try:
            conn = loadgen.BlockingConn(HOST, server.port)
            # the throughput ratio's two sides alternate, round after round (the host
            # drifts: each round's ratio compares neighbours, the median the rounds)
            doc["rounds"] = []
            for r in range(args.repeat):
                row: dict[str, Any] = {"round": r}
                print(
                    f"round {r + 1}/{args.repeat}: c=64 single-record disk writes ...", flush=True
                )
                w = c64_writes(server, args, conn)
                row["c64_disk_writes"] = {k: w[k] for k in ("records_per_s", "p50_ms", "p99_ms")}
                for durability in ("disk", "ephemeral"):
                    topic = f"e2e.{durability}.{r}"
                    put_queue(conn, server.port, topic, durability=durability, lease_ms=LEASE_MS)
                    print(
                        f"round {r + 1}/{args.repeat}: end to end, {durability} queue ...",
                        flush=True,
                    )
                    row[f"e2e_{durability}"] = run_queue_load(
                        server.port,
                        topic,
                        workers=args.workers,
                        producers=args.producers,
                        duration=args.duration,
                        warmup=args.warmup,
                        procs=args.load_procs,
                        cpus=load_cpus,
                        backlog_cap=args.backlog_cap,
                    )
                row["ratio"] = (
                    row["e2e_disk"]["jobs_per_s"] / row["c64_disk_writes"]["records_per_s"]
                )
                doc["rounds"].append(row)
            # the median round (by ratio) stands for the run
            mid = sorted(doc["rounds"], key=lambda x: x["ratio"])[len(doc["rounds"]) // 2]
            doc["c64_disk_writes"] = mid["c64_disk_writes"]
            doc["e2e_disk"] = mid["e2e_disk"]
            doc["e2e_ephemeral"] = mid["e2e_ephemeral"]
            put_queue(conn, server.port, "bg", durability="disk", lease_ms=LEASE_MS)
            doc["claim_latency"] = []
            for prios in () if args.throughput_only else (1, 100):
                topic = f"backlog.p{prios}"
                put_queue(conn, server.port, topic, durability="disk", lease_ms=LEASE_MS)
                have = 0
                for target in backlogs:
                    print(f"claim latency, {prios} priorities, backlog {target} ...", flush=True)
                    fill(conn, server.port, topic, have, target, prios)
                    have = target
                    res = run_queue_load(
                        server.port,
                        "bg",
                        workers=BG_WORKERS,
                        producers=2,
                        duration=args.duration,
                        warmup=0.5,
                        procs=1,
                        cpus=load_cpus,
                        producer_rate=args.bg_rate,
                        empty_backoff_s=0.005,
                        during=claim_probe(server.port, topic, prios, args.claims),
                    )
                    probe = res.pop("probe")
                    doc["claim_latency"].append(
                        {"priorities": prios, "backlog": target, **probe, "background": res}
                    )
            doc["server_rss_mib"] = server.rss_mib()
        finally:
            server.stop()
    report(doc, backlogs)
    hc.RESULTS_DIR.mkdir(exist_ok=True)
    out = hc.RESULTS_DIR / f"queue-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(doc, indent=2))
    print(f"\nwritten to {out}")
    return 0


def report(doc: dict[str, Any], backlogs: list[int]) -> None:
    c64 = doc["c64_disk_writes"]["records_per_s"]
    print("\n== queue benchmark", doc["started"], "|", doc["command"])
    m = doc["machine"]
    print(f"machine: {m['nproc']} CPUs ({m['cpu_model']}), Python {m['python']}")
    for row in doc["rounds"]:
        print(
            f"round {row['round'] + 1}: c=64 writes {row['c64_disk_writes']['records_per_s']:,.0f}"
            f" rec/s, e2e disk {row['e2e_disk']['jobs_per_s']:,.0f} jobs/s, e2e ephemeral "
            f"{row['e2e_ephemeral']['jobs_per_s']:,.0f} jobs/s, ratio {row['ratio']:.2f}"
        )
    print("the median round:")
    print(f"c=64 single-record disk writes: {c64:,.0f} rec/s")
    for d in ("disk", "ephemeral"):
        e = doc[f"e2e_{d}"]
        print(
            f"end to end, {d} queue: {e['jobs_per_s']:,.0f} jobs/s acked "
            f"({e['produced_per_s']:,.0f} produced/s, {e['claims']} claims, "
            f"{e['empty_claims']} empty, {e['errors']} errors {e['first_error'][:120]})"
        )
    print("claim latency at c=1 (ms):  priorities  backlog  p50  p99  [background jobs/s]")
    lat = {(r["priorities"], r["backlog"]): r for r in doc["claim_latency"]}
    for (p, b), r in sorted(lat.items()):
        bg = r["background"]["jobs_per_s"]
        print(f"  {p:>3}  {b:>9,}  {r['p50_ms']:.3f}  {r['p99_ms']:.3f}  [{bg:,.0f}]")
    e2e = doc["e2e_disk"]["jobs_per_s"]
    targets = [("e2e disk jobs/s >= 3x c=64 disk writes", e2e / c64, 3.0, ">=")]
    top = backlogs[-1]
    for p in (1, 100) if lat else ():
        targets.append(
            (
                f"p50 {top:,} / p50 1k, {p} prio",
                lat[(p, top)]["p50_ms"] / lat[(p, 1000)]["p50_ms"],
                1.2,
                "<=",
            )
        )
    for b in backlogs if lat else ():
        targets.append(
            (
                f"p50 100 prio / 1 prio at {b:,}",
                lat[(100, b)]["p50_ms"] / lat[(1, b)]["p50_ms"],
                1.2,
                "<=",
            )
        )
    doc["targets"] = []
    for name, value, limit, op in targets:
        met = value >= limit if op == ">=" else value <= limit
        doc["targets"].append({"target": name, "value": value, "limit": limit, "met": met})
        print(f"  {'MET ' if met else 'MISS'} {name}: {value:.2f} ({op} {limit})")


if __name__ == "__main__":
    raise SystemExit(main())
