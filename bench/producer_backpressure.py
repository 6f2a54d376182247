#!/usr/bin/env python
"""Producer backpressure: SDK producers with the delay law on and off against an
overloaded server.

    python bench/producer_backpressure.py [--quick] [--pin] [--producers N]
                                          [--window S] [--batch N] [--overload X]
                                          [--chart PATH | --no-chart]

Starts `python -m topicd serve --port 0` on a fresh data directory (bench/http_core.py's
`Server`) and drives it from one child process running `topicd.client.Client` under
Trio. With `--pin`, topicd runs on CPU 0 and the producers and the prober on CPU 1.

Method:

1. **Saturation.** `--producers` (32) tasks write `--batch`-record (1000) batches to
   `--topics` (8) `disk`-class topics closed-loop (each sends its next batch as soon as
   the last one returned) for one window, the delay law off: the accepted records/s of
   that window is the saturation rate S.
2. **Overload, policy off, then on.** The same tasks send batches open-loop on a fixed
   schedule at `--overload` (4) × S records/s in total (a task that falls behind sends
   its next batch at once: the offered load is kept as far as one request in flight per
   task allows), one window each, first with `BackpressurePolicy(enabled=False)`, then
   with the defaults. In both runs the server's hints and the client's retries apply
   (`Retry-After`, `max_retries` 8, jitter); only the delay law differs.

Measured per window: accepted records/s (records of successful writes), `429`s and
`503`s received (every answer is counted by a transport wrapper, retries included),
write latency p50/p99 (one `write_batch` call: delay law, retries and waits included),
writes that failed after the retries, the server's health latency p99 (`GET /v0/health`
every 20 ms from a thread of the parent, on its own connection), the server's pressure
as the producers saw it, and producer CPU seconds per second (the child's own
user+system time). A bar chart of the two overload windows goes to `--chart`
(`docs/producer_backpressure.png`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_core as hc  # a sibling module of this script

SERVER_CPU, CLIENT_CPU = 0, 1
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------
# The producer child
# --------------------------------------------------------------------------------------


def child_main(job: dict[str, Any]) -> dict[str, Any]:
    import trio

    from topicd.client import BackpressurePolicy, Client, ClientError

    class Counting(httpx.AsyncHTTPTransport):
        def __init__(self) -> None:
            super().__init__(limits=httpx.Limits(max_connections=job["producers"] + 4))
            self.statuses: dict[int, int] = {}
            self.pressure: list[float] = []

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            resp = await super().handle_async_request(request)
            self.statuses[resp.status_code] = self.statuses.get(resp.status_code, 0) + 1
            with contextlib.suppress(KeyError, ValueError):
                self.pressure.append(float(resp.headers["x-topicd-pressure"]))
            return resp

    records = [{"data": {"i": i, "pad": "x" * 40}} for i in range(job["batch"])]
    topics = [f"bp-{i}" for i in range(job["topics"])]

    async def run() -> dict[str, Any]:
        transport = Counting()
        policy = BackpressurePolicy(enabled=job["policy"])
        latencies: list[float] = []
        accepted = 0
        failed = 0
        async with Client(job["url"], policy=policy, transport=transport) as client:
            start = trio.current_time()
            end = start + job["window"]
            cpu0 = time.process_time()

            async def producer(k: int) -> None:
                nonlocal accepted, failed
                topic = topics[k % len(topics)]
                period = job["producers"] / job["batches_per_s"] if job["batches_per_s"] else 0
                due = start + (k / job["producers"]) * period
                while True:
                    if period:
                        await trio.sleep_until(due)
                        due += period
                    if trio.current_time() >= end:
                        return
                    t0 = trio.current_time()
                    try:
                        res = await client.write_batch(topic, records)
                        accepted += res.count
                    except ClientError:
                        failed += 1
                    latencies.append(trio.current_time() - t0)

            with trio.move_on_after(job["window"] + 30):  # a write in flight at the end
                async with trio.open_nursery() as nursery:
                    for k in range(job["producers"]):
                        nursery.start_soon(producer, k)
            elapsed = trio.current_time() - start
            cpu = time.process_time() - cpu0
        latencies.sort()
        return {
            "elapsed_s": elapsed,
            "accepted_rps": accepted / job["window"],
            "accepted": accepted,
            "failed": failed,
            "writes": len(latencies),
            "statuses": transport.statuses,
            "lat_p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
            "lat_p99_ms": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else None,
            "pressure_mean": statistics.fmean(transport.pressure) if transport.pressure else None,
            "pressure_max": max(transport.pressure, default=None),
            "producer_cpu_per_s": cpu / elapsed,
        }

    return trio.run(run)


def run_child(job: dict[str, Any], pin: bool) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(job)],
        capture_output=True,
        text=True,
        check=False,
        preexec_fn=(lambda: os.sched_setaffinity(0, {CLIENT_CPU})) if pin else None,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"producer child failed:\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


# --------------------------------------------------------------------------------------
# The health prober
# --------------------------------------------------------------------------------------


class Prober(threading.Thread):
    """`GET /v0/health` every 20 ms on its own connection (a missed slot is skipped)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.samples: list[float] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            nxt = time.monotonic()
            while not self.stop.is_set():
                t0 = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    http.get("/v0/health")
                    self.samples.append(time.monotonic() - t0)
                nxt += 0.02
                now = time.monotonic()
                while nxt < now:
                    nxt += 0.02
                time.sleep(nxt - now)

    def p99_ms(self) -> float | None:
        s = sorted(self.samples)
        return 1000 * s[int(len(s) * 0.99)] if s else None


def window(job: dict[str, Any], url: str, pin: bool) -> dict[str, Any]:
    prober = Prober(url)
    prober.start()
    try:
        out = run_child(job, pin)
    finally:
        prober.stop.set()
        prober.join()
    out["health_p99_ms"] = prober.p99_ms()
    out["health_samples"] = len(prober.samples)
    return out


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,.3f}" if isinstance(v, float) and v < 10 else f"{v:,.0f}"


def chart(path: Path, off: dict[str, Any], on: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("accepted records/s", "accepted_rps"),
        ("429s received", "n429"),
        ("write latency p99 (ms)", "lat_p99_ms"),
        ("health p99 (ms)", "health_p99_ms"),
        ("producer CPU (s/s)", "producer_cpu_per_s"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2))
    for ax, (title, key) in zip(axes, panels, strict=True):
        values = [off.get(key) or 0, on.get(key) or 0]
        ax.bar(["policy off", "policy on"], values, color=["#c0504d", "#4f81bd"])
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.annotate(f"{v:,.0f}" if v >= 10 else f"{v:.2f}", (i, v), ha="center", va="bottom")
    fig.suptitle("SDK producers at 4× the saturation rate: graduated backpressure off vs on")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="5 s windows (default: 15 s)")
    ap.add_argument("--window", type=float, help="seconds per window")
    ap.add_argument("--producers", type=int, default=32, help="producer tasks (default 32)")
    ap.add_argument("--topics", type=int, default=8, help="topics written (default 8)")
    ap.add_argument("--batch", type=int, default=1000, help="records per write (default 1000)")
    ap.add_argument("--overload", type=float, default=4.0, help="offered load ÷ saturation")
    ap.add_argument("--pin", action="store_true", help="topicd on CPU 0, producers on CPU 1")
    ap.add_argument("--chart", default=str(REPO / "docs" / "producer_backpressure.png"))
    ap.add_argument("--no-chart", action="store_true")
    args = ap.parse_args()
    if args.child:
        sys.stdout.write(json.dumps(child_main(json.loads(args.child))))
        return 0
    win = args.window or (5.0 if args.quick else 15.0)
    with tempfile.TemporaryDirectory() as tmp:
        server = hc.topicd_server(Path(tmp), REPO)
        server.start(cpu=SERVER_CPU if args.pin else None)
        if args.pin:
            os.sched_setaffinity(0, {CLIENT_CPU})
        url = f"http://127.0.0.1:{server.port}"
        try:
            with httpx.Client(base_url=url) as http:
                for i in range(args.topics):
                    http.put(f"/v0/topics/bp-{i}", json={"durability": "disk"}).raise_for_status()
            base = {
                "url": url,
                "producers": args.producers,
                "topics": args.topics,
                "batch": args.batch,
                "window": win,
            }
            sat = window(base | {"policy": False, "batches_per_s": 0}, url, args.pin)
            offered = args.overload * sat["accepted_rps"]
            paced = base | {"batches_per_s": offered / args.batch}
            off = window(paced | {"policy": False}, url, args.pin)
            on = window(paced | {"policy": True}, url, args.pin)
        finally:
            server.stop()
    for r in (sat, off, on):
        r["n429"] = r["statuses"].get("429", r["statuses"].get(429, 0))
        r["n503"] = r["statuses"].get("503", r["statuses"].get(503, 0))
    print(
        f"window {win:.0f} s, {args.producers} producers, {args.batch}-record batches, "
        f"pin={'yes' if args.pin else 'no'}"
    )
    print(
        f"saturation: {sat['accepted_rps']:,.0f} records/s accepted; offered in overload: "
        f"{offered:,.0f} records/s ({args.overload:g}×)"
    )
    cols = (
        "accepted_rps",
        "n429",
        "n503",
        "failed",
        "lat_p50_ms",
        "lat_p99_ms",
        "health_p99_ms",
        "pressure_mean",
        "pressure_max",
        "producer_cpu_per_s",
    )
    print(f"{'run':<12}" + "".join(f"{c:>20}" for c in cols))
    for name, r in (("saturation", sat), ("policy off", off), ("policy on", on)):
        cells = []
        for c in cols:
            cells.append(f"{fmt(r.get(c)):>20}")
        print(f"{name:<12}" + "".join(cells))
    ratio = lambda a, b: (a / b) if b else float("nan")  # noqa: E731
    print(
        f"429s off/on: {ratio(off['n429'], on['n429']):.1f}×   accepted on/off: "
        f"{ratio(on['accepted_rps'], off['accepted_rps']):.3f}   health p99 on/off: "
        f"{ratio(on['health_p99_ms'] or 0, off['health_p99_ms'] or 0):.3f}"
    )
    if not args.no_chart:
        chart(Path(args.chart), off, on)
        print(f"chart: {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
