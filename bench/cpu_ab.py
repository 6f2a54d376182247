#!/usr/bin/env python
"""Server CPU per request, this checkout against another one, alternated in one run.

    python bench/cpu_ab.py --baseline DIR [--rounds N] [--duration S] [--what writes,queue]

On a busy machine the rates of `bench/peers.py` and `bench/queues.py` move with whatever
else runs (the server waits for a CPU), while the CPU the server spends per request moves
much less: this script measures that, from /proc, for two `topicd serve` processes (this
checkout, `hot`, and the one at DIR, `base`, e.g. a `git worktree` of main) pinned to
CPU 0, with every load generator on CPU 1, the two measured in turn, the first one
alternating round after round. Per round and system:

* `writes`: wrk, 64 connections, single-record writes to an `fsync` topic (bench/peers.py's
  record and wrk script; `--duration` s after 1 s of warm-up): requests/s and server
  CPU µs per request (user and system);
* `queue`: bench/queues.py's c=64 single-record `disk` writes (its raw-socket load
  generator) and its end-to-end `disk` queue workload (4 producers of 100-job batches, 50
  workers claiming 8 and acking each batch): server CPU µs per write and per acked job
  (the CPU over the measured window), and their quotient, the "CPU ratio": the
  end-to-end ratio of bench/queues.py that a server bound by its own CPU would reach.

Medians and each round's hot/base quotients are printed. Needs wrk for `writes`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import http_core as hc
import loadgen
import peers
import queues


def proc_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process `pid` so far, all threads."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) / hc.CLK_TCK, int(fields[12]) / hc.CLK_TCK


def writes_round(srv: hc.Server, body: Path, duration: float) -> dict[str, float]:
    assert srv.proc is not None
    url = f"http://{hc.HOST}:{srv.port}/v0/topics/w.fsync"
    peers.wrk(url, body, 64, 1.0)
    peers.settle(srv.cpu_s)
    u0, s0 = proc_cpu(srv.proc.pid)
    out, _ = peers.wrk(url, body, 64, duration)
    u1, s1 = proc_cpu(srv.proc.pid)
    n = max(1, out["requests"])
    return {
        "req_per_s": out["requests"] / (out["duration_us"] / 1e6),
        "user_us": 1e6 * (u1 - u0) / n,
        "sys_us": 1e6 * (s1 - s0) / n,
        "cpu_us": 1e6 * (u1 - u0 + s1 - s0) / n,
    }


def queue_round(srv: hc.Server, r: int, duration: float) -> dict[str, float]:
    args = argparse.Namespace(duration=duration, warmup=1.0, load_procs=1, load_cpu=1)
    conn = loadgen.BlockingConn(hc.HOST, srv.port)
    try:
        peers.settle(srv.cpu_s)
        w = queues.c64_writes(srv, args, conn)
        topic = f"e2e.{r}"
        queues.put_queue(conn, srv.port, topic, durability="disk", lease_ms=queues.LEASE_MS)
    finally:
        conn.close()
    peers.settle(srv.cpu_s)

    def during(t_end: float) -> tuple[float, float]:
        c0, t0 = srv.cpu_s(), time.monotonic()
        time.sleep(max(0.0, t_end - t0))
        return srv.cpu_s() - c0, time.monotonic() - t0

    e = queues.run_queue_load(
        srv.port, topic, workers=50, producers=4, duration=duration, warmup=1.0,
        procs=1, cpus=[1], during=during,
    )  # fmt: skip
    cpu, window = e["probe"]
    jobs = max(1.0, e["jobs_per_s"] * duration)
    job_us = 1e6 * cpu / jobs
    return {
        "writes_per_s": w["records_per_s"],
        "write_us": w["server_cpu_us_per_req"],
        "jobs_per_s": e["jobs_per_s"],
        "job_us": job_us,
        "server_cpu_pct": 100 * cpu / window,
        "ratio": e["jobs_per_s"] / max(1.0, w["records_per_s"]),
        "cpu_ratio": w["server_cpu_us_per_req"] / job_us,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--duration", type=float, default=3.0, help="seconds per window (3)")
    p.add_argument("--what", default="writes,queue", help="writes, queue or both")
    args = p.parse_args(argv)
    what = {w.strip() for w in args.what.split(",") if w.strip()}
    trees = {"hot": hc.REPO_DIR, "base": args.baseline.resolve()}
    results: dict[str, dict[str, list[dict[str, float]]]] = {k: {} for k in what}
    print(f"loadavg at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="topicd-bench-cpu-ab-") as tmp:
        tmpdir = Path(tmp)
        body = tmpdir / "body.json"
        body.write_bytes(b'{"records":[{"data":' + peers.record_string() + b"}]}")
        servers: dict[str, hc.Server] = {}
        try:
            for name, tree in trees.items():
                (tmpdir / name).mkdir()
                srv = hc.topicd_server(tmpdir / name, tree, data="data")
                srv.name = name
                srv.start(cpu=0)
                servers[name] = srv
                conn = loadgen.BlockingConn(hc.HOST, srv.port)
                try:
                    hc.put_durability(conn, srv.port, "w.fsync", "fsync")
                finally:
                    conn.close()
            with_affinity = hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1
            if with_affinity:
                os.sched_setaffinity(0, {1})
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for kind in sorted(what):
                    for name in order:
                        srv = servers[name]
                        if kind == "writes":
                            row = writes_round(srv, body, args.duration)
                            line = (
                                f"{row['req_per_s']:8,.0f} req/s, server "
                                f"{row['cpu_us']:6.1f} µs/req (user {row['user_us']:.1f}, "
                                f"sys {row['sys_us']:.1f})"
                            )
                        else:
                            row = queue_round(srv, r, args.duration)
                            line = (
                                f"writes {row['writes_per_s']:7,.0f}/s {row['write_us']:6.1f} "
                                f"µs/write | e2e {row['jobs_per_s']:7,.0f} jobs/s "
                                f"{row['job_us']:5.1f} µs/job (server "
                                f"{row['server_cpu_pct']:.0f} %)"
                                f" | ratio {row['ratio']:.2f}, CPU ratio {row['cpu_ratio']:.2f}"
                            )
                        results[kind].setdefault(name, []).append(row)
                        load = os.getloadavg()[0]
                        print(
                            f"round {r + 1} {kind:6} {name:4}  {line}  load {load:.1f}", flush=True
                        )
        finally:
            for srv in servers.values():
                srv.stop()
    print()
    for kind, by_name in results.items():
        keys = ["cpu_us", "req_per_s"] if kind == "writes" else ["write_us", "job_us", "cpu_ratio"]
        for name, rows in by_name.items():
            meds = ", ".join(f"{k} {statistics.median(x[k] for x in rows):.2f}" for k in keys)
            print(f"{kind:6} {name:4} medians: {meds}")
        hot, base = by_name.get("hot", []), by_name.get("base", [])
        for k in keys:
            quotients = [a[k] / b[k] for a, b in zip(hot, base, strict=False) if b[k]]
            text = " ".join(f"{q:.3f}" for q in quotients)
            print(f"{kind:6} hot/base {k} per round: {text}")
    print(f"loadavg at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
