#!/usr/bin/env python
"""Router benchmark: forwarding rate, forward lag and the source's write cost, in one run.

    python bench/routers.py [--duration S] [--warmup S] [--repeat N] [--lag-seconds S]

Needs only what topicd itself needs (it runs `python -m topicd serve` from the checkout
it lives in, or `--topicd-src`), plus the sibling modules `http_core.py` (server start,
load-generator processes, percentiles, machine info) and `loadgen.py` (the raw-socket
HTTP/1.1 client). Installs nothing.

One topicd server (a `disk` data directory in a temporary folder), fresh topics per
scenario and round. Scenarios, each under sustained single-record `disk` writes to the
source at 16 connections (`b1`), and the same with 100-record batches (`b100`, reported
without a target):

* `none`: the source alone (the plain write rate of this run);
* `1to1`: one router source → dest;
* `1to10`: ten routers source → dest0..dest9 (fan-out);
* `10to1`: ten routers of the source into one dest (same-source fan-in, lockstep).

For each: the source's accepted records/s, and the forwarded records/s (copies that
appeared in the destinations during the measured window, read from the destinations'
heads with `GET /v0/topics/:t`, which makes no copy itself). Then the forward lag: one
writer paced at `--lag-rate` (1,000) records/s into a 1→1 router's source, and a reader
long-polling the destination; lag = time the copy is visible to the reader − time the
source write was acknowledged (p50/p99 over `--lag-seconds`).

Targets (issue 13): 1→1 forwards ≥ 0.9× the source's accepted rate; lag p99 < 50 ms at
1,000 records/s; the source with 10 routers accepts ≥ 0.8× the rate of the source alone.
The machine is shared and drifts: with `--repeat N` every scenario runs N times,
interleaved, and medians are reported; ratios compare scenarios of the same run.
Results are printed and written as JSON to bench/results/routers-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_core  # a sibling module of this script
import loadgen

HOST = http_core.HOST
SCENARIOS = {"none": (0, False), "1to1": (1, False), "1to10": (10, False), "10to1": (10, True)}


def call(conn: loadgen.BlockingConn, port: int, method: str, path: str, body: Any = None):
    raw = b"" if body is None else orjson.dumps(body)
    status, out = conn.request(loadgen.build_request(HOST, port, path, raw, method))
    if status >= 300:
        raise RuntimeError(f"{method} {path}: {status} {out[:300]!r}")
    return orjson.loads(out) if out else None


def head(conn: loadgen.BlockingConn, port: int, topic: str) -> int:
    return int(call(conn, port, "GET", f"/v0/topics/{topic}?touch=false")["head_seq"])


def setup(conn: loadgen.BlockingConn, port: int, tag: str, scenario: str) -> tuple[str, list[str]]:
    """Create the source, its destinations and routers; returns (source, dests)."""
    n, fan_in = SCENARIOS[scenario]
    src = f"src-{tag}"
    call(conn, port, "PUT", f"/v0/topics/{src}", {"durability": "disk"})
    dests = [f"dst-{tag}"] if fan_in else [f"dst-{tag}-{i}" for i in range(n)]
    for d in dests:
        call(conn, port, "PUT", f"/v0/topics/{d}", {"durability": "disk"})
    for i in range(n):
        d = dests[0] if fan_in else dests[i]
        call(conn, port, "PUT", f"/v0/routers/r{i}-{tag}", {"source": src, "dest": d})
    return src, dests


def forward_run(
    workers: http_core.Workers,
    server: http_core.Server,
    args: Any,
    scenario: str,
    batch: int,
    tag: str,
) -> dict[str, Any]:
    conn = loadgen.BlockingConn(HOST, server.port)
    src, dests = setup(conn, server.port, tag, scenario)
    n, _ = SCENARIOS[scenario]
    body = http_core.write_body(batch)
    req = loadgen.build_request(HOST, server.port, f"/v0/topics/{src}", body)
    heads: dict[str, list[int]] = {}

    def sample(which: int, at: float) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        for t in [src, *dests]:
            heads.setdefault(t, [0, 0])[which] = head(side, server.port, t)

    side = loadgen.BlockingConn(HOST, server.port)
    t0 = time.monotonic()
    # the heads are read at the window's edges by a side thread, while the load runs
    starts = t0 + 0.05 + args.warmup + 0.5  # run_throughput's t_start, roughly
    sampler = threading.Thread(
        target=lambda: (sample(0, starts), sample(1, starts + args.duration))
    )
    sampler.start()
    res = http_core.run_throughput(
        workers, server, lambda i: [req], "write", batch, args.concurrency, args
    )
    sampler.join()
    window = args.duration
    src_rate = (heads[src][1] - heads[src][0]) / window
    copies = sum(heads[d][1] - heads[d][0] for d in dests)
    per_router = copies / n / window if n else None
    conn.close()
    side.close()
    return {
        "scenario": scenario,
        "batch": batch,
        "accepted_rps": res["records_per_s"],
        "source_head_rps": src_rate,
        "forwarded_rps_per_router": per_router,
        "forward_ratio": per_router / src_rate if n and src_rate else None,
        "server_cpu_pct": res["server_cpu_pct"],
        "errors": res["errors"],
        "first_error": res["first_error"],
    }


def lag_run(server: http_core.Server, args: Any, tag: str) -> dict[str, Any]:
    """Paced writes into a 1→1 router's source; a long-polling reader of the dest."""
    conn = loadgen.BlockingConn(HOST, server.port)
    src, dests = setup(conn, server.port, tag, "1to1")
    dest = dests[0]
    base = head(conn, server.port, dest)
    acked: dict[int, float] = {}
    seen: dict[int, float] = {}
    total = int(args.lag_rate * args.lag_seconds)
    done = threading.Event()

    def reader() -> None:
        rc = loadgen.BlockingConn(HOST, server.port)
        cursor = base
        while not done.is_set() or len(seen) < len(acked):
            out = call(
                rc,
                server.port,
                "POST",
                f"/v0/topics/{dest}/diff",
                {"from_seq": cursor, "limit": 1000, "wait_ms": 200},
            )
            now = time.monotonic()
            for rec in out["records"]:
                seen.setdefault(int(rec["data"]), now)
            cursor = out["next_from_seq"]
            if done.is_set() and not out["records"] and len(seen) >= total:
                break
        rc.close()

    th = threading.Thread(target=reader)
    th.start()
    period = 1.0 / args.lag_rate
    t_next = time.monotonic()
    for i in range(total):
        time.sleep(max(0.0, t_next - time.monotonic()))
        t_next += period
        body = b'{"records":[{"data":%d}]}' % i
        status, _ = conn.request(
            loadgen.build_request(HOST, server.port, f"/v0/topics/{src}", body)
        )
        if status == 200:
            acked[i] = time.monotonic()
    done.set()
    th.join(30)
    lags = sorted(max(0.0, seen[i] - acked[i]) for i in acked if i in seen)
    conn.close()
    return {
        "offered_rps": args.lag_rate,
        "acked": len(acked),
        "seen": len(lags),
        "p50_ms": http_core.percentile(lags, 50) * 1e3 if lags else None,
        "p99_ms": http_core.percentile(lags, 99) * 1e3 if lags else None,
    }


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="measured window per run, s")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--lag-rate", type=float, default=1000.0)
    p.add_argument("--lag-seconds", type=float, default=5.0)
    p.add_argument("--topicd-src", type=Path, default=http_core.REPO_DIR)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    lags: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="topicd-bench-routers-") as tmp:
        tmpdir = Path(tmp)
        server = http_core.topicd_server(tmpdir, args.topicd_src)
        workers = http_core.Workers(args.client_procs, None)
        try:
            server.start()
            for r in range(args.repeat):
                order = list(SCENARIOS)
                order = order[r % len(order) :] + order[: r % len(order)]  # rotate
                for batch in (1, 100):
                    for sc in order:
                        row = forward_run(workers, server, args, sc, batch, f"{sc}-b{batch}-{r}")
                        row["round"] = r
                        rows.append(row)
                        print(orjson.dumps(row).decode(), flush=True)
                lag = lag_run(server, args, f"lag-{r}")
                lag["round"] = r
                lags.append(lag)
                print(orjson.dumps(lag).decode(), flush=True)
        finally:
            workers.close()
            server.stop()
    summary: dict[str, Any] = {}
    for batch in (1, 100):
        for sc in SCENARIOS:
            sel = [x for x in rows if x["scenario"] == sc and x["batch"] == batch]
            summary[f"{sc}_b{batch}"] = {
                "accepted_rps": med(sel, "accepted_rps"),
                "forwarded_rps_per_router": med(sel, "forwarded_rps_per_router"),
                "forward_ratio": med(sel, "forward_ratio"),
            }
    none_b1 = summary["none_b1"]["accepted_rps"] or 0
    ten_b1 = summary["1to10_b1"]["accepted_rps"] or 0
    ratio_10 = ten_b1 / none_b1 if none_b1 else None
    lag_p50 = med(lags, "p50_ms")
    lag_p99 = med(lags, "p99_ms")
    fwd = summary["1to1_b1"]["forward_ratio"]
    targets = [
        ("1→1 forwards ≥ 0.9× accepted (b1)", fwd, fwd is not None and fwd >= 0.9),
        ("lag p99 < 50 ms at 1,000 rec/s", lag_p99, lag_p99 is not None and lag_p99 < 50),
        (
            "10 routers: source ≥ 0.8× alone (b1)",
            ratio_10,
            ratio_10 is not None and ratio_10 >= 0.8,
        ),
    ]
    print("\nscenario        accepted rec/s   forwarded rec/s per router   forwarded/accepted")
    for key, v in summary.items():
        acc, per, ratio = v["accepted_rps"], v["forwarded_rps_per_router"], v["forward_ratio"]
        print(
            f"{key:14s} {acc or 0:15,.0f}   {per if per is not None else float('nan'):26,.0f}"
            f"   {ratio if ratio is not None else float('nan'):18.2f}"
        )
    print(f"forward lag at {args.lag_rate:,.0f} rec/s: p50 {lag_p50:.2f} ms, p99 {lag_p99:.2f} ms")
    print(f"source with 10 routers / alone (b1): {ratio_10:.2f}")
    for name, value, ok in targets:
        print(f"  {'MET ' if ok else 'MISS'} {name}: {value}")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=args.topicd_src
    ).stdout.strip()
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": http_core.machine_info(args.topicd_src),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "lags": lags,
        "summary": summary,
        "lag_p50_ms": lag_p50,
        "lag_p99_ms": lag_p99,
        "ratio_10_routers": ratio_10,
        "targets": [{"name": n, "value": v, "met": ok} for n, v, ok in targets],
    }
    http_core.RESULTS_DIR.mkdir(exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    (http_core.RESULTS_DIR / f"routers-{stamp}.json").write_bytes(
        orjson.dumps(out, option=orjson.OPT_INDENT_2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
