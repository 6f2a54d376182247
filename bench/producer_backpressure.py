#!/usr/bin/env python
"""Producer backpressure: SDK producers with the delay law on and off against an
overloaded server.

    python bench/producer_backpressure.py [--quick] [--pin] [--producers N] [--clients N]
                                          [--rounds N] [--window S] [--warmup S]
                                          [--batch N] [--overload X] [--bounds auto|N]
                                          [--inflight N] [--waiters-per-permit K]
                                          [--server-tree PATH]
                                          [--json PATH [--trace]]
                                          [--chart PATH | --no-chart]

Each window starts `python -m topicd serve --port 0` on a fresh data directory, from
`--server-tree` (default: the checkout this script is in, whose `topicd` that command
imports ahead of `PYTHONPATH`; `PYTHONPATH` reaches only the producers' child)
(bench/http_core.py's `Server`; no window pays for the data an earlier one left) and
drives it from one child process running `topicd.client.Client` under Trio. With
`--pin`, topicd runs on CPU 0, the producers and the prober on CPU 1.

Method:

1. **Bounds and saturation.** With `--bounds auto` (the default) a closed-loop ramp of
   1, 2, 4, 8 and 16 producers (`--ramp-window` s each, delay law off, the default
   admission bounds) finds the peak concurrency C*: the smallest within 5 % of the best
   rate. `classes.client_permits` then becomes C* (never above 32) and
   `classes.client_waiters` `--waiters-per-permit` (24) × C*: the defaults (32 permits and
   4096 waiters) are sized to a bigger machine, and the producers here never fill them.
   The best ramp rate is the saturation rate S. `--bounds N` sets the permits to N
   instead (S from `4N` closed-loop producers); `--bounds 0` keeps the defaults.
   **Why 24 waiters per permit:** the gate then holds 25 C* requests (permits and
   waiters), about 0.78 of the 32 C* writes the producers below can have in flight. A
   producer whose delay law reads green sends every write it has room for, and the law
   gives no delay at or below `soft`; so a room smaller than the writes a green
   population can send at once refuses law-on producers after every episode in which
   they read green together, and a room at least that large refuses law-off producers
   never. At 1 to 16 waiters per permit (1 until 2026-11-28: 2 C* against 32 C* in
   flight) the law-on producers got 1.2–2.6× fewer `429`s than the law-off ones (twice
   4.6–4.8×); at 31 (32 C*) the law-off producers got none. See docs/PERFORMANCE.md.
2. **Overload, delay law off and on.** `--producers` tasks (4 × C*, as bench/overload.py's
   4 × C*), each with its own client
   by default (`--clients`), send `--batch`-record (1000) batches to `--topics` (8)
   `disk`-class topics on a fixed schedule adding up to `--overload` (4) × S records/s,
   each keeping up to `--inflight` (8) writes in flight: a task whose writes are all in
   flight sends its next batch as soon as one finishes, so the offered load is kept as
   far as 4 × C* × 8 writes in flight allow. (With one write in flight per task the
   producers were a closed loop that sent no faster than the server answered: the
   "4×" reached the server as about 1×.) With `BackpressurePolicy(enabled=False)` and
   with the defaults. In both modes the server's hints and the client's retries
   apply (`Retry-After`, `max_retries` 8, jitter); only the delay law differs. Each
   window has `--warmup` s (2) of load that is not counted. `--rounds` (3) off/on pairs
   alternate their order; medians are reported.

Measured per window: records/s sent (first tries begun in the window: the load the
producers managed to offer) and accepted (writes acknowledged within the window), `429`s
and `503`s received (every answer is counted by a transport wrapper, retries and pause
probes included), writes that failed after the retries or were still unfinished 5 s
after the window, write latency p50/p99 (one `write_batch` call: delay law, retries and
waits included), the server's health latency p99 (`GET /v0/health` every 20 ms from a
thread of the parent, on its own connection), the pressure the producers read, their
mean delay, and the CPU seconds per second of the producers and of topicd. The targets
(issue 17) are printed, with the server's own `429` count by cause
(`topicd_throttled_total`, warm-up included); so is a note when topicd used under 0.85
CPU s/s at saturation
(something else was the bottleneck) or no law-off window got a `429`. A chart of the
medians, each round a dot, goes to `--chart` (`docs/producer_backpressure.png`).
Under each round: the producers' refusals by the zone of the pressure their client had
last read when it sent the refused request (and that reading's median age), by cause,
the most in one 100 ms slot, the pauses, the zone changes and the most pause ends in one
100 ms slot (how bunched the resumptions were).
With `--trace`, the `--json` file also holds, per overload window, every answer the
producers got (time in the window, status, pressure header, producer), every
delay-law decision (time, zone, delay ms, pressure read, producer) and every refusal
(time sent, status, cause, the pressure read and its age, producer); every window
prints the governor's pressure and input signals sampled from `/v0/metrics` every
100 ms (their means, and which signal was the largest in how many samples).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_core as hc  # a sibling module of this script

if TYPE_CHECKING:
    from topicd.client.backpressure import Signals

SERVER_CPU, CLIENT_CPU = 0, 1
RAMP = (1, 2, 4, 8, 16)  # closed-loop concurrencies of the saturation ramp
PEAK_WITHIN = 0.95  # C*: the smallest concurrency within this share of the best rate
GRACE_S = 5.0  # after the window: how long a write still in flight may finish
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------
# The producer child
# --------------------------------------------------------------------------------------


def child_main(job: dict[str, Any]) -> dict[str, Any]:
    import trio

    from topicd.client import BackpressurePolicy, Client, ClientError, ZoneReport

    class Tally:
        """Every answer (retries and pause probes included) while `measuring`."""

        def __init__(self) -> None:
            self.measuring = False
            self.statuses: dict[int, int] = {}
            self.pressure: list[float] = []
            # with --trace: (time since the window began, status, pressure header) of
            # every answer, and (time, zone, delay ms, pressure read) of every decision
            self.answers: list[tuple[float, int, float | None, int]] | None = None
            self.decisions: list[tuple[float, str, float, float | None, int]] | None = None
            self.begin = 0.0
            # every refusal (429/503): (time since the window began, status, cause, the
            # pressure its client had read when it sent the request or None, that
            # reading's age in ms or None, client)
            self.refused: list[tuple[float, int, str, float | None, float | None, int]] = []

    class Counting(httpx.AsyncHTTPTransport):
        def __init__(self, tally: Tally, connections: int, index: int) -> None:
            super().__init__(limits=httpx.Limits(max_connections=connections))
            self.tally = tally
            self.index = index  # the client's, in traces
            self.signals: Signals | None = None  # its client's, once built

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            obs = self.signals.pressure if self.signals is not None else None
            sent_at = trio.current_time()
            resp = await super().handle_async_request(request)
            t = self.tally
            if t.measuring and resp.status_code in (429, 503):
                # what the client knew when it sent the request that was refused
                cause = "-"
                with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                    detail = json.loads(await resp.aread())["error"].get("detail") or {}
                    cause = detail.get("cause") or ("retry_after" if detail else "-")
                t.refused.append(
                    (
                        sent_at - t.begin,
                        resp.status_code,
                        str(cause),
                        obs.value if obs is not None else None,
                        1000 * (sent_at - obs.at) if obs is not None else None,
                        self.index,
                    )
                )
            if t.measuring:
                t.statuses[resp.status_code] = t.statuses.get(resp.status_code, 0) + 1
                p: float | None = None
                with contextlib.suppress(KeyError, ValueError):
                    p = float(resp.headers["x-topicd-pressure"])
                    t.pressure.append(p)
                if t.answers is not None:
                    t.answers.append(
                        (trio.current_time() - t.begin, resp.status_code, p, self.index)
                    )
            return resp

    records = [{"data": {"i": i, "pad": "x" * 40}} for i in range(job["batch"])]
    topics = [f"bp-{i}" for i in range(job["topics"])]

    async def run() -> dict[str, Any]:
        transport = Tally()
        if job.get("trace"):
            transport.answers, transport.decisions = [], []
        policy = BackpressurePolicy(enabled=job["policy"])
        latencies: list[float] = []
        sent = 0  # write_batch calls begun in the window
        accepted = 0
        failed = 0
        unfinished = 0
        zones = {"green": 0, "amber": 0, "red": 0}
        delayed_ms = 0.0

        last_zone: dict[int, str] = {}
        transitions: dict[str, int] = {}  # "green>amber" etc., per client, in the window
        resumes: list[float] = []  # when a client's pause ended (time in the window)

        def on_zone(report: ZoneReport, index: int) -> None:
            nonlocal delayed_ms
            prev = last_zone.get(index)
            last_zone[index] = report.zone
            if transport.measuring and prev is not None and prev != report.zone:
                key = f"{prev}>{report.zone}"
                transitions[key] = transitions.get(key, 0) + 1
                if prev == "red":
                    resumes.append(trio.current_time() - transport.begin)
            # one report per batch decision (a pause reports again at each poll)
            if transport.measuring and report.zone != "red":
                zones[report.zone] += 1
                delayed_ms += report.delay_ms
            if transport.measuring and transport.decisions is not None:
                t = trio.current_time() - transport.begin
                transport.decisions.append(
                    (t, report.zone, report.delay_ms, report.pressure, index)
                )

        n_clients = min(job["clients"], job["producers"])
        # writes in flight per client at most, rounded up
        per_client = -(-job["producers"] // n_clients) * job["inflight"]
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    Client(
                        job["url"],
                        policy=policy,
                        transport=Counting(transport, per_client + 2, i),
                        on_zone=functools.partial(on_zone, index=i),
                    )
                )
                for i in range(n_clients)
            ]
            for c in clients:
                c.http._transport.signals = c.signals  # type: ignore[attr-defined]
            start = trio.current_time()
            begin = start + job["warmup"]  # the measured window: [begin, end)
            transport.begin = begin
            end = begin + job["window"]
            marks: dict[str, float] = {}

            async def measure() -> None:
                await trio.sleep_until(begin)
                transport.measuring = True
                marks["cpu0"], marks["wall0"] = time.process_time(), time.time()
                await trio.sleep_until(end)
                transport.measuring = False
                marks["cpu1"], marks["wall1"] = time.process_time(), time.time()

            async def one_write(topic: str, client: Client, t0: float) -> None:
                nonlocal accepted, failed, unfinished
                counted = t0 >= begin  # a write sent in the window
                try:
                    with trio.move_on_at(end + GRACE_S) as scope:
                        res = await client.write_batch(topic, records)
                    if scope.cancelled_caught:
                        unfinished += counted
                    elif begin <= trio.current_time() < end:
                        accepted += res.count  # acknowledged in the window
                except ClientError:
                    failed += counted
                if counted:
                    latencies.append(trio.current_time() - t0)

            async def producer(k: int) -> None:
                nonlocal sent
                topic = topics[k % len(topics)]
                client = clients[k % len(clients)]
                period = job["producers"] / job["batches_per_s"] if job["batches_per_s"] else 0
                due = start + (k / job["producers"]) * period
                # at most `inflight` writes of this producer at once: one that falls
                # behind its schedule sends its next batch as soon as a write finishes
                slots = trio.Semaphore(job["inflight"])
                async with trio.open_nursery() as writes:
                    while True:
                        if period:
                            await trio.sleep_until(due)
                            due += period
                        await slots.acquire()
                        t0 = trio.current_time()
                        if t0 >= end:
                            return
                        sent += begin <= t0

                        async def write(t0: float = t0) -> None:
                            try:
                                await one_write(topic, client, t0)
                            finally:
                                slots.release()

                        writes.start_soon(write)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(measure)
                for k in range(job["producers"]):
                    nursery.start_soon(producer, k)
        latencies.sort()
        batches = sum(zones.values())
        # refusals by the zone their client's last pressure reading was in when it sent
        # the refused request ("none": no reading yet; "stale": older than the TTL)
        policy_ = BackpressurePolicy()
        by_zone: dict[str, int] = {}
        by_cause: dict[str, int] = {}
        for _, _, cause, p, age, _ in transport.refused:
            if p is None or age is None:
                z = "none"
            elif age > policy_.signal_ttl_ms:
                z = "stale"
            elif p >= policy_.pressure_hard:
                z = "red"
            elif p > policy_.pressure_soft:
                z = "amber"
            else:
                z = "green"
            by_zone[z] = by_zone.get(z, 0) + 1
            by_cause[cause] = by_cause.get(cause, 0) + 1
        ages = sorted(a for *_, a, _ in transport.refused if a is not None)

        # how bunched the refusals and the pause ends were: the most in one 100 ms slot
        def most_in_a_slot(times: list[float]) -> int:
            slots: dict[int, int] = {}
            for x in times:
                slots[int(x * 10)] = slots.get(int(x * 10), 0) + 1
            return max(slots.values(), default=0)

        return {
            "accepted_rps": accepted / job["window"],
            # the load the producers managed to send (first tries; the schedule's is
            # `batches_per_s` × `batch`)
            "sent_rps": sent * job["batch"] / job["window"],
            "accepted": accepted,
            "failed": failed,
            "unfinished": unfinished,
            "writes": len(latencies),
            "statuses": transport.statuses,
            "lat_p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
            "lat_p99_ms": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else None,
            "pressure_mean": statistics.fmean(transport.pressure) if transport.pressure else None,
            "pressure_max": max(transport.pressure, default=None),
            "producer_cpu_per_s": (marks["cpu1"] - marks["cpu0"]) / job["window"],
            "zones": zones,
            "delay_mean_ms": delayed_ms / batches if batches else None,
            "wall": (marks["wall0"], marks["wall1"]),
            "refused_by_zone_at_send": by_zone,
            "refused_by_cause_seen": by_cause,
            "refused_reading_age_p50_ms": ages[len(ages) // 2] if ages else None,
            "refused_most_per_100ms": most_in_a_slot([r[0] for r in transport.refused]),
            "transitions": transitions,
            "pauses": sum(v for k, v in transitions.items() if k.endswith(">red")),
            "resumes_most_per_100ms": most_in_a_slot(resumes),
            "trace": (
                {
                    "answers": transport.answers,
                    "decisions": transport.decisions,
                    "refused": transport.refused,
                }
                if transport.answers is not None
                else None
            ),
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
        self.samples: list[tuple[float, float]] = []  # (wall time, latency s)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            nxt = time.monotonic()
            while not self.stop.is_set():
                t0 = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    http.get("/v0/health")
                    self.samples.append((time.time(), time.monotonic() - t0))
                nxt += 0.02
                now = time.monotonic()
                while nxt < now:
                    nxt += 0.02
                time.sleep(nxt - now)

    def p99_ms(self, wall: tuple[float, float]) -> tuple[float | None, int]:
        """p99 of the probes sent in the wall-clock window `wall`, and their count."""
        s = sorted(lat for at, lat in self.samples if wall[0] <= at - lat < wall[1])
        return (1000 * s[int(len(s) * 0.99)] if s else None), len(s)


class SignalSampler(threading.Thread):
    """With `--trace`: the governor's pressure and its input signals
    (`topicd_pressure`, `topicd_pressure_signal`) from `/v0/metrics` every 100 ms, the
    governor's own sample interval, on its own connection."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.samples: list[tuple[float, float, dict[str, float]]] = []  # (wall, p, signals)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self.stop.wait(0.1):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    pressure, signals = None, {}
                    for line in http.get("/v0/metrics").text.splitlines():
                        if line.startswith("topicd_pressure "):
                            pressure = float(line.rpartition(" ")[2])
                        elif line.startswith('topicd_pressure_signal{signal="'):
                            name = line.partition('"')[2].partition('"')[0]
                            signals[name] = float(line.rpartition(" ")[2])
                    if pressure is not None:
                        self.samples.append((time.time(), pressure, signals))

    def summary(self, wall: tuple[float, float]) -> dict[str, Any]:
        """Per signal over the window: its mean, in how many samples it was the largest
        (the one pressure follows), and every sample (`series`)."""
        inside = [(p, sig) for at, p, sig in self.samples if wall[0] <= at < wall[1]]
        out: dict[str, Any] = {"samples": len(inside)}
        if not inside:
            return out
        out["pressure_mean"] = statistics.fmean(p for p, _ in inside)
        names = sorted({n for _, sig in inside for n in sig})
        out["mean"] = {n: statistics.fmean(sig.get(n, 0.0) for _, sig in inside) for n in names}
        top: dict[str, int] = {}
        for _, sig in inside:
            if sig:
                name = max(sig, key=lambda n: sig[n])
                top[name] = top.get(name, 0) + 1
        out["largest"] = top
        # every sample: (seconds since the window began, pressure, signals)
        out["series"] = [
            (round(at - wall[0], 3), p, sig)
            for at, p, sig in self.samples
            if wall[0] <= at < wall[1]
        ]
        return out


def window(job: dict[str, Any], url: str, pin: bool) -> dict[str, Any]:
    prober = Prober(url)
    prober.start()
    sampler = SignalSampler(url) if job.get("trace") else None
    if sampler is not None:
        sampler.start()
    try:
        out = run_child(job, pin)
    finally:
        prober.stop.set()
        prober.join()
        if sampler is not None:
            sampler.stop.set()
            sampler.join()
    out["health_p99_ms"], out["health_samples"] = prober.p99_ms(out["wall"])
    if sampler is not None:
        out["governor"] = sampler.summary(out["wall"])
    return out


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,.3f}" if isinstance(v, float) and v < 10 else f"{v:,.0f}"


def chart(
    path: Path, off: dict[str, Any], on: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
    title: str,
) -> None:  # fmt: skip
    """Bars: the medians; dots: each round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("accepted records/s", "accepted_rps"),
        ("429s received", "n429"),
        ("write latency p99 (ms)", "lat_p99_ms"),
        ("health p99 (ms)", "health_p99_ms"),
        ("producer CPU (s/s)", "producer_cpu_per_s"),
        ("topicd CPU (s/s)", "server_cpu_per_s"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 3.4))
    for ax, (name, key) in zip(axes, panels, strict=True):
        values = [off.get(key) or 0, on.get(key) or 0]
        ax.bar(["policy off", "policy on"], values, color=["#c0504d", "#4f81bd"], alpha=0.8)
        for i, mode in enumerate(("off", "on")):
            dots = [r.get(key) or 0 for r in runs[mode]]
            ax.plot([i] * len(dots), dots, "k.", markersize=5)
        ax.set_title(name, fontsize=10)
        for i, v in enumerate(values):
            ax.annotate(f"{v:,.0f}" if v >= 10 else f"{v:.2f}", (i, v), ha="center", va="bottom")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def start_server(tmp: Path, args: argparse.Namespace, bounds: int) -> hc.Server:
    """A fresh `topicd serve` on its own data directory, with the bench's topics;
    `bounds` > 0 sets its client permits and waiters."""
    server = hc.topicd_server(tmp, Path(args.server_tree) if args.server_tree else REPO)
    if bounds:
        # the admission bounds sized to this machine: the permits as bench/overload.py
        # sizes them, the waiters below what the producers can have in flight, so an
        # overloaded server refuses (`429 client_waiters`) instead of queueing them all
        server.env["TOPICD_CLASSES_CLIENT_PERMITS"] = str(bounds)
        server.env["TOPICD_CLASSES_CLIENT_WAITERS"] = str(bounds * args.waiters_per_permit)
    server.start(cpu=SERVER_CPU if args.pin else None)
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as http:
        for i in range(args.topics):
            http.put(f"/v0/topics/bp-{i}", json={"durability": "disk"}).raise_for_status()
    return server


def refusals(url: str) -> dict[str, float]:
    """The server's `429`s so far by cause (`topicd_throttled_total`), warm-up included."""
    with httpx.Client(base_url=url, timeout=30) as http:
        text = http.get("/v0/metrics").text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("topicd_throttled_total{"):
            labels, _, value = line.rpartition(" ")
            cause = labels.partition('cause="')[2].partition('"')[0]
            if float(value):
                out[cause] = float(value)
    return out


def fresh_window(job: dict[str, Any], args: argparse.Namespace, bounds: int) -> dict[str, Any]:
    """One measured window against a server started for it (a fresh data directory, so
    no window pays for the data an earlier one left: checkpoints grow with it)."""
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), args, bounds)
        url = f"http://127.0.0.1:{server.port}"
        try:
            cpu0, t0 = server.cpu_s(), time.monotonic()
            out = window(job | {"url": url}, url, args.pin)
            out["server_cpu_per_s"] = (server.cpu_s() - cpu0) / (time.monotonic() - t0)
            out["refused_by_cause"] = refusals(url)
        finally:
            server.stop()
    out["n429"] = out["statuses"].get("429", 0)
    out["n503"] = out["statuses"].get("503", 0)
    return out


COLS = (
    "sent_rps",
    "accepted_rps",
    "n429",
    "n503",
    "failed",
    "unfinished",
    "lat_p50_ms",
    "lat_p99_ms",
    "health_p99_ms",
    "pressure_mean",
    "delay_mean_ms",
    "producer_cpu_per_s",
    "server_cpu_per_s",
)


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in COLS:
        vals = [r[c] for r in runs if r.get(c) is not None]
        out[c] = statistics.median(vals) if vals else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="5 s windows, 2 rounds")
    ap.add_argument("--window", type=float, help="seconds per window (default 10)")
    ap.add_argument(
        "--warmup", type=float, default=2.0, help="seconds of load before each window (default 2)"
    )
    ap.add_argument("--rounds", type=int, help="off/on pairs, alternating order (default 3)")
    ap.add_argument(
        "--producers",
        type=int,
        default=0,
        help="producer tasks in overload (default: 4 x the scaled bounds, so the offered "
        "concurrency is twice what the admission gate holds, as bench/overload.py's 4x C*; "
        "32 with the default bounds)",
    )
    ap.add_argument(
        "--clients",
        type=int,
        default=0,
        help="topicd.client.Client instances the producers are spread over (default: one "
        "per producer, as independent programs; 1: every producer shares one client)",
    )
    ap.add_argument(
        "--inflight",
        type=int,
        default=8,
        help="writes each producer keeps in flight at most in overload (default 8): with "
        "one, the producers are a closed loop that offers no more than the server answers",
    )
    ap.add_argument("--topics", type=int, default=8, help="topics written (default 8)")
    ap.add_argument("--batch", type=int, default=1000, help="records per write (default 1000)")
    ap.add_argument("--overload", type=float, default=4.0, help="offered load ÷ saturation")
    ap.add_argument("--pin", action="store_true", help="topicd on CPU 0, producers on CPU 1")
    ap.add_argument(
        "--bounds",
        default="auto",
        help="the server's classes.client_permits: 'auto' (default) the peak concurrency "
        "C* of a closed-loop ramp, as bench/overload.py sizes it; N sets it; the waiters "
        "are --waiters-per-permit times it; 0 keeps the defaults, 32 and 4096, which "
        "queue 32 producers rather than refuse",
    )
    ap.add_argument(
        "--waiters-per-permit",
        type=int,
        default=24,
        help="client waiters per scaled permit (default 24: the gate holds 25 C*, about "
        "0.78 of the 32 C* writes the default producers can have in flight)",
    )
    ap.add_argument(
        "--ramp-window", type=float, default=3.0, help="seconds per ramp step (default 3)"
    )
    ap.add_argument(
        "--server-tree",
        help="run `topicd serve` from this checkout instead of this script's (an A/B of "
        "two server trees with the same producers)",
    )
    ap.add_argument("--chart", default=str(REPO / "docs" / "producer_backpressure.png"))
    ap.add_argument("--no-chart", action="store_true")
    ap.add_argument("--json", help="write every window's numbers to this file")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="with --json: every answer's (time, status, pressure header) and every "
        "delay-law decision's (time, zone, delay, pressure) in each overload window",
    )
    args = ap.parse_args()
    if args.child:
        sys.stdout.write(json.dumps(child_main(json.loads(args.child))))
        return 0
    win = args.window or (5.0 if args.quick else 10.0)
    rounds = args.rounds or (2 if args.quick else 3)
    if args.pin:
        os.sched_setaffinity(0, {CLIENT_CPU})
    base = {
        "topics": args.topics,
        "batch": args.batch,
        "window": win,
        "warmup": args.warmup,
        "clients": args.clients or 1 << 30,  # at most one per producer
        "inflight": 1,  # the saturation ramp: closed loop, one write per producer
    }
    load0 = os.getloadavg()
    if args.bounds == "auto":
        # bench/overload.py's sizing: a closed-loop ramp on the default bounds finds the
        # peak concurrency C* (the smallest within 5 % of the best rate); the admission
        # bounds become C* permits and C* waiters, as 32 and 4096 are sized to a larger
        # machine, and the best rate is the saturation rate S
        ramp = {}
        for c in RAMP:
            job = base | {"producers": c, "policy": False, "batches_per_s": 0}
            ramp[c] = fresh_window(job | {"window": args.ramp_window}, args, 0)
            print(f"ramp c={c}: {ramp[c]['accepted_rps']:,.0f} records/s", flush=True)
        best = max(r["accepted_rps"] for r in ramp.values())
        c_star = min(c for c, r in ramp.items() if r["accepted_rps"] >= PEAK_WITHIN * best)
        bounds = min(c_star, 32)
        sat = max(ramp.values(), key=lambda r: r["accepted_rps"])
        sat_label = f"closed-loop ramp {list(RAMP)}, C* = {c_star}"
    else:
        bounds = int(args.bounds)
        # closed loop with as many producers as the bounds admit without refusing
        sat_producers = 4 * bounds if bounds else args.producers or 32
        job = base | {"producers": sat_producers, "policy": False, "batches_per_s": 0}
        sat = fresh_window(job, args, bounds)
        sat_label = f"{sat_producers} closed-loop producers"
    # 4 × C*, as bench/overload.py: with `--inflight` 8, 32 C* writes in flight at most,
    # against a gate that holds (1 + waiters per permit) × C*
    producers = args.producers or (4 * bounds if bounds else 32)
    offered = args.overload * sat["accepted_rps"]
    paced = base | {
        "producers": producers,
        "batches_per_s": offered / args.batch,
        "inflight": args.inflight,
    }
    paced["trace"] = args.trace
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            out = fresh_window(paced | {"policy": mode == "on"}, args, bounds)
            runs[mode].append(out)
            print(
                f"round {r + 1} policy {mode:<3}: sent {out['sent_rps']:>9,.0f}, accepted "
                f"{out['accepted_rps']:>9,.0f} records/s, "
                f"{out['n429']:>5} 429s, health p99 {fmt(out['health_p99_ms'])} ms, "
                f"zones {out['zones']}, refused by cause {out['refused_by_cause']}",
                flush=True,
            )
            print(
                f"    producers' refusals by the zone of the pressure they had read when "
                f"they sent ({out['refused_by_zone_at_send']}; its age p50 "
                f"{fmt(out['refused_reading_age_p50_ms'])} ms; causes "
                f"{out['refused_by_cause_seen']}; most in 100 ms "
                f"{out['refused_most_per_100ms']}); pauses {out['pauses']}, zone changes "
                f"{out['transitions']}, most pause ends in 100 ms "
                f"{out['resumes_most_per_100ms']}",
                flush=True,
            )
            if out.get("governor", {}).get("samples"):
                gov = out["governor"]
                print(
                    f"    server pressure (every 100 ms) mean {gov['pressure_mean']:.3f}; "
                    "its signals' means "
                    + ", ".join(f"{n} {v:.2f}" for n, v in gov["mean"].items() if v >= 0.005)
                    + f"; the largest in {gov['largest']} of {gov['samples']} samples",
                    flush=True,
                )
    load1 = os.getloadavg()
    off, on = median_of(runs["off"]), median_of(runs["on"])
    print(
        f"window {win:g} s, {rounds} rounds, {producers} producers, {args.batch}-record "
        f"batches, {args.inflight} in flight per producer, bounds {bounds or 'default'} "
        f"(waiters × {args.waiters_per_permit}), "
        f"pin={'yes' if args.pin else 'no'}, "
        f"load average {load0[0]:.1f} -> {load1[0]:.1f}"
    )
    print(
        f"saturation ({sat_label}): {sat['accepted_rps']:,.0f} "
        f"records/s accepted; offered in overload: {offered:,.0f} records/s "
        f"({args.overload:g}×)"
    )
    print(f"{'median':<12}" + "".join(f"{c:>20}" for c in COLS))
    for name, r in (("saturation", sat), ("policy off", off), ("policy on", on)):
        print(f"{name:<12}" + "".join(f"{fmt(r.get(c)):>20}" for c in COLS))
    ratio = lambda a, b: (a / b) if b else float("inf") if a else float("nan")  # noqa: E731
    fewer = ratio(off["n429"], on["n429"])
    acc = ratio(on["accepted_rps"], off["accepted_rps"])
    health = ratio(on["health_p99_ms"] or 0, off["health_p99_ms"] or 0)
    paired = [
        ratio(b["accepted_rps"], a["accepted_rps"])
        for a, b in zip(runs["off"], runs["on"], strict=True)
    ]
    print(
        f"429s off/on: {fewer:.1f}× (target ≥ 10)   accepted on/off: {acc:.3f} (≥ 0.95; "
        f"per round {', '.join(f'{x:.2f}' for x in paired)})   health p99 on/off: "
        f"{health:.3f} (≤ 1.1)"
    )
    if not off["n429"]:
        print("NOTE no 429 with the policy off: the server was not overloaded at its bounds")
    if (sat.get("server_cpu_per_s") or 0) < 0.85:
        print(
            f"NOTE topicd used {sat['server_cpu_per_s']:.2f} CPU s/s at saturation: "
            "something else (the producers, other work on the machine) was the bottleneck"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "saturation": sat, "runs": runs}, indent=1)
        )
    if not args.no_chart:
        title = (
            f"SDK producers at {args.overload:g}× the saturation rate, delay law off vs on "
            f"(medians of {rounds} rounds, dots: each round; load average {load1[0]:.1f})"
        )
        chart(Path(args.chart), off, on, runs, title)
        print(f"chart: {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
