#!/usr/bin/env python
"""Overload benchmark: the pressure governor's backpressure ladder under offered load.

    python bench/overload.py [--quick] [--repeat N] [--window S] [--warmup S]
                             [--multipliers 0.25,0.5,1,2,4] [--watchers 1000]
                             [--chart PATH | --no-chart] [--max-conc N]

Starts topicd like bench/http_core.py does (`python -m topicd serve --port 0 --data-dir
<tmp>/data` with `TOPICD_PORT_FILE`, its `Server` class) and drives it from separate
processes (spawned once, driven over Pipes):

* **writers** (`--writer-procs`, default 2): closed-loop single-record `POST
  /v0/topics/<t>` on raw keep-alive HTTP/1.1 connections (asyncio protocols, as in
  bench/loadgen.py; no httpx), spread over `--topics` (8) `disk`-class topics, each
  connection always one topic. A writer **ignores `Retry-After`**: whatever the answer,
  its connection sends the next request at once, so the offered load stays at the
  connection count. Every answer is classified: 2xx = accepted (its `seqs` are kept for
  the loss check, its latency is a write ack), `429` and `503` = refused (each must carry
  `Retry-After`; the `429`'s `detail.cause` or `detail.limit` is tallied), anything else,
  a dropped connection or no answer within `--timeout` = an **error** (a failure of the
  run). The `X-Topicd-Pressure` header of every answer is averaged too;
* a **prober**: `GET /v0/health` every 20 ms on its own connection (latency p50/p99/max;
  a missed slot is skipped, not made up) and, in a second thread on another connection,
  `GET /v0/metrics` (Prometheus text) every 250 ms, parsed afterwards for
  `topicd_pressure`, `topicd_coalesce_window_ms`, `topicd_commit_window_ms`,
  `topicd_defer_active`, `topicd_throttled_total{cause}`, `topicd_pressure_signal{signal}`
  and `topics_wal_queue_depth`. A series the server does not export is reported as `-`;
* for the fan-out step, bench/sse_fanout.py's clients: `--watchers` (1000) SSE streams of
  one more topic on raw sockets under `epoll` (`POST /v0/watch` then `GET
  /v0/watch/<wid>`), and its paced writer posting `--watch-rate` records/s that carry
  their send time (`time.monotonic_ns()`); delivery latency = receive time − send time
  over every (watcher, record) pair, as in that benchmark.

Method:

1. **Peak.** A short ramp of concurrencies (`--ramp`, 1…64) finds the peak of accepted
   writes/s; the peak concurrency C* is the smallest one within 5 % of the maximum
   (`--peak-conc` skips the ramp). With `--repeat N` the ramp runs N times, up and down
   in turn, and its medians decide.
2. **Bounds.** With `--bounds scaled` (the default) topicd is restarted on the same data
   directory with `classes.client_permits` = `classes.client_waiters` = min(C*, 32): the
   admission bounds sized to this machine's peak concurrency as the defaults (32 permits,
   4096 waiters) are sized to a larger one, so the top of the sweep (4× C*) passes them
   and the `429` rung can show. `--bounds default` keeps the defaults (no step then
   reaches a `429` on this machine: that needs over 4,128 connections).
3. **Sweep.** Offered load `--multipliers` × C* (0.25× to 4×, at least one connection,
   at most `--max-conc`), each step `--warmup` s (2) then a `--window` s (10) measured
   window; then one more step at the largest multiplier with the watchers connected and
   the paced writer running. `--repeat N` runs the sweep N times; medians are reported.
4. **Loss check.** At the end every topic is read from seq 0 with `POST
   /v0/topics/<t>/diff` (`limit` 1000, following `next_from_seq`), and every
   acknowledged seq must be there: no cap or TTL is configured, so a missing one is a
   lost acknowledged write.

**Pinning** (`--pin`, off by default): topicd and its threads run on CPU 0, the
coordinator and every client process on CPU 1. On this project's 2-CPU machines the
unpinned writers share the server's CPU. One pinned run (2026-11-25) came to 90.6 % of
the peak at 4× but with almost no `429`s, so the ladder's last rung did not show.
Unpinned runs at 7e208c9 met every target (docs/PERFORMANCE.md, "Overload").

Per step: accepted writes/s, 429/s and 429 %, 503 %, errors, ack p50/p99 (accepted writes
only), health p50/p99/max, pressure mean/max, the largest coalesce and commit windows,
the share of metric samples with defer active, 429s by cause, the server's CPU and
maximum RSS (`VmRSS`, sampled every 250 ms), the clients' CPU, CPU used by anything
else (the machine is shared), and for the fan-out step SSE delivery p50/p99.

Targets (the governor issue): the ladder shows **in order** — the first step at which
each rung appears (coalesce window > 0, commit window > 0.5 ms, defer active, 429s) never
goes down along the sweep; accepted throughput at 4× is at least 90 % of the peak; health
p99 under 100 ms at every step; zero lost acknowledged writes; and no errors.

The sweep is drawn with matplotlib (a bench-only dependency, imported only here) into
`--chart` (docs/overload.png). Results are printed and written as JSON to
bench/results/overload-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import math
import multiprocessing as mp
import os
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_core as hc  # sibling modules: Server, Workers, machine info, CPU accounting
import loadgen
import sse_fanout as sse

HOST = hc.HOST
REPO_DIR = hc.REPO_DIR
RESULTS_DIR = hc.RESULTS_DIR
DEFAULT_CHART = REPO_DIR / "docs" / "overload.png"
percentile = hc.percentile

WRITE_BODY = b'{"records":[{"data":{"room":"lab-2","celsius":21.4}}]}'
WATCH_TOPIC = "overload-watch"
PEAK_WITHIN = 0.95  # C* = the smallest concurrency within 5 % of the best throughput
SERVER_CPU, CLIENT_CPU = 0, 1  # with --pin: topicd and its threads / everything else
TARGET_4X_PCT = 90.0
TARGET_HEALTH_P99_MS = 100.0
METRIC_SERIES = frozenset(
    {
        "topicd_pressure",
        "topicd_coalesce_window_ms",
        "topicd_commit_window_ms",
        "topicd_defer_active",
        "topicd_throttled_total",
        "topicd_pressure_signal",
        "topics_wal_queue_depth",
    }
)
# rung name, what shows it, the step-summary key and its threshold ("above")
RUNGS: list[tuple[str, str, str, float]] = [
    ("coalesce", "coalesce window > 0", "coalesce_max_ms", 0.0),
    ("wider commits", "commit window > 0.5 ms", "commit_max_ms", 0.5),
    ("defer", "defer active", "defer_pct", 0.0),
    ("429", "429s answered", "n_429", 0.0),
]


# ==========================================================================================
# client side (runs in the spawned processes)


def parse_head(head: bytes) -> tuple[int, int, bool, bool, float | None]:
    """(status, content_length, server_closes, has_retry_after, x_topicd_pressure)."""
    status = int(head[9:12])
    low = head.lower()
    i = low.find(b"\r\ncontent-length:")
    if i < 0:
        raise ValueError(f"response without Content-Length: {head[:300]!r}")
    j = low.find(b"\r\n", i + 17)
    length = int(low[i + 17 : j if j >= 0 else None])
    pressure = None
    k = low.find(b"\r\nx-topicd-pressure:")
    if k >= 0:
        m = low.find(b"\r\n", k + 20)
        with contextlib.suppress(ValueError):
            pressure = float(low[k + 20 : m if m >= 0 else None])
    return status, length, b"\r\nconnection: close" in low, b"\r\nretry-after:" in low, pressure


def throttle_cause(body: bytes) -> str:
    """What a 429 says it is: `limit:<name>`, its `cause`, or `pressure`."""
    try:
        detail = orjson.loads(body)["error"].get("detail") or {}
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return "unparsable"
    if detail.get("limit"):
        return f"limit:{detail['limit']}"
    return str(detail.get("cause") or "pressure")


class WriteRun:
    """Shared state of one writer process's connections over one step."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.port: int = job["port"]
        self.timeout: float = job["timeout_s"]
        self.t_start = self.t_end = math.inf
        self.running = False
        self.slots = 0
        self.live: set[Writer] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.done: asyncio.Future[None] | None = None
        # answers completed in the measured window
        self.ok = self.n429 = self.n503 = self.other = 0
        self.lat = array("d")
        self.causes: dict[str, int] = {}
        self.pressure_sum = 0.0
        self.pressure_n = 0
        self.pressure_max: float | None = None
        # the whole step (warm-up and the last answers after the window included)
        self.acked: dict[str, array[int]] = {}
        self.errors = self.timeouts = self.reconnects = 0
        self.first_error: str | None = None

    def error(self, msg: str) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = msg

    def over(self) -> bool:
        return time.monotonic() >= self.t_end

    def answer(
        self, w: Writer, status: int, retry: bool, pressure: float | None, body: bytes
    ) -> None:
        t = time.monotonic()
        in_window = self.t_start <= t < self.t_end
        if 200 <= status < 300:
            try:
                seqs = orjson.loads(body)["seqs"]
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                self.error(f"HTTP {status} without seqs ({exc!r}): {body[:200]!r}")
                return
            if len(seqs) != 1:
                self.error(f"one record written, seqs {seqs!r}")
            self.acked.setdefault(w.topic, array("q")).extend(seqs)
            if in_window:
                self.ok += 1
                self.lat.append(t - w.t0)
        elif status in (429, 503):
            if not retry:
                self.error(f"HTTP {status} without Retry-After: {body[:200]!r}")
            if in_window:
                if status == 429:
                    self.n429 += 1
                    cause = throttle_cause(body)
                    self.causes[cause] = self.causes.get(cause, 0) + 1
                else:
                    self.n503 += 1
        else:
            self.error(f"HTTP {status}: {body[:300]!r}")
            if in_window:
                self.other += 1
        if in_window and pressure is not None:
            self.pressure_sum += pressure
            self.pressure_n += 1
            if self.pressure_max is None or pressure > self.pressure_max:
                self.pressure_max = pressure

    def slot_done(self) -> None:
        self.slots -= 1
        if self.slots == 0 and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def reconnect(self, topic: str, req: bytes) -> None:
        """A new connection for a slot whose connection ended (until the window is over)."""
        if self.over():
            self.slot_done()
            return
        self.reconnects += 1
        loop = asyncio.get_running_loop()

        async def connect() -> None:
            try:
                await loop.create_connection(lambda: Writer(self, topic, req), HOST, self.port)
            except OSError as exc:
                self.error(f"reconnect failed: {exc!r}")
                self.slot_done()

        task = loop.create_task(connect())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def watchdog(self) -> None:
        """Abort connections whose request has waited longer than `timeout` (an error)."""
        now = time.monotonic()
        for w in list(self.live):
            if w.inflight and now - w.t0 > self.timeout:
                self.timeouts += 1
                self.error(f"no answer within {self.timeout:g} s")
                w.replace(abort=True)
        if self.slots:
            asyncio.get_running_loop().call_later(0.25, self.watchdog)


class Writer(asyncio.Protocol):
    """One closed-loop connection: one request in flight, the next one sent at once."""

    def __init__(self, run: WriteRun, topic: str, req: bytes) -> None:
        self.run = run
        self.topic = topic
        self.req = req
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.total = -1
        self.hend = 0
        self.head: tuple[int, int, bool, bool, float | None] = (0, 0, False, False, None)
        self.t0 = 0.0
        self.inflight = False
        self.ended = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.run.live.add(self)
        if self.run.running:
            self.send_next()

    def send_next(self) -> None:
        if self.run.over():
            self.finish()
            return
        assert self.transport is not None
        self.t0 = time.monotonic()
        self.inflight = True
        self.transport.write(self.req)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.total < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head = parse_head(bytes(buf[:end]))
            self.hend = end + 4
            self.total = self.hend + self.head[1]
        if len(buf) < self.total:
            return
        status, _, closes, retry, pressure = self.head
        body = bytes(buf[self.hend : self.total])
        del buf[: self.total]
        self.total = -1
        self.inflight = False
        self.run.answer(self, status, retry, pressure, body)
        if closes:
            self.replace()
        else:
            self.send_next()

    def replace(self, abort: bool = False) -> None:
        """Close this connection and let a new one take over its slot."""
        if self.ended:
            return
        self.ended = True
        self.run.live.discard(self)
        assert self.transport is not None
        if abort:
            self.transport.abort()
        else:
            self.transport.close()
        self.run.reconnect(self.topic, self.req)

    def finish(self) -> None:
        if not self.ended:
            self.ended = True
            self.run.live.discard(self)
            if self.transport is not None:
                self.transport.close()
            self.run.slot_done()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.ended:
            return
        if self.inflight:
            self.run.error(f"connection lost with a request in flight: {exc!r}")
        self.replace()  # an idle keep-alive close is legal: just reconnect


async def _write(job: dict[str, Any], ctl: Any) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    run = WriteRun(job)
    reqs = {
        t: loadgen.build_request(HOST, run.port, f"/v0/topics/{t}", WRITE_BODY)
        for t in set(job["topics"])
    }

    def factory(topic: str) -> Any:
        return lambda: Writer(run, topic, reqs[topic])

    for topic in job["topics"]:
        await loop.create_connection(factory(topic), HOST, run.port)
    run.slots = len(job["topics"])
    run.done = loop.create_future()
    ctl.send("ready")
    t_warm, t_start, t_end = ctl.recv()  # the loop is idle: a blocking wait is fine
    run.t_start, run.t_end = t_start, t_end
    cpu: dict[str, float] = {}
    loop.call_at(t_start, lambda: cpu.__setitem__("start", time.process_time()))
    loop.call_at(t_end, lambda: cpu.__setitem__("end", time.process_time()))
    await asyncio.sleep(max(0.0, t_warm - time.monotonic()))
    run.running = True
    for w in list(run.live):  # a replacement connecting later starts itself
        w.send_next()
    loop.call_later(0.25, run.watchdog)
    try:
        await asyncio.wait_for(run.done, timeout=t_end - time.monotonic() + run.timeout + 30)
    except TimeoutError:
        run.error("connections did not finish after the window")
        for w in list(run.live):
            w.finish()
    await asyncio.sleep(0)
    return {
        "conns": len(job["topics"]),
        "ok": run.ok,
        "n429": run.n429,
        "n503": run.n503,
        "other": run.other,
        "lat": run.lat,
        "causes": run.causes,
        "pressure_sum": run.pressure_sum,
        "pressure_n": run.pressure_n,
        "pressure_max": run.pressure_max,
        "acked": run.acked,
        "errors": run.errors,
        "timeouts": run.timeouts,
        "reconnects": run.reconnects,
        "first_error": run.first_error,
        "cpu_s": cpu.get("end", time.process_time()) - cpu.get("start", 0.0),
    }


METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
METRIC_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """The wanted series of a Prometheus text page: `name` or `name{k=v,...}` → value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = METRIC_LINE.match(line)
        if m is None or m.group(1) not in METRIC_SERIES:
            continue
        key = m.group(1)
        if m.group(2):
            labels = ",".join(f"{k}={v}" for k, v in METRIC_LABEL.findall(m.group(2)))
            key += "{" + labels + "}"
        with contextlib.suppress(ValueError):
            out[key] = float(m.group(3))
    return out


def _probe(job: dict[str, Any], ctl: Any) -> dict[str, Any]:
    """Health every `health_s` and metrics every `metrics_s`, each on its own connection."""
    port, timeout = job["port"], job["timeout_s"]
    conns = {
        "health": loadgen.BlockingConn(HOST, port, timeout=timeout),
        "metrics": loadgen.BlockingConn(HOST, port, timeout=timeout),
    }
    health: list[tuple[float, float, int]] = []
    raw_metrics: list[tuple[float, float, int, bytes]] = []
    errors: list[str] = []

    def poll(name: str, period: float, t_begin: float, t_end: float) -> None:
        conn = conns[name]
        req = loadgen.build_request(HOST, port, f"/v0/{name}", b"", method="GET")
        i = 0
        while (target := t_begin + i * period) < t_end:
            delay = target - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            t = time.monotonic()
            a = time.perf_counter()
            try:
                status, body = conn.request(req)
                conn.ensure_connected()
            except (OSError, ValueError) as exc:
                status, body = 0, b""
                errors.append(f"{name}: {exc!r}")
                conn.close()  # the next request reconnects
            lat = time.perf_counter() - a
            if status != 200 and status:
                errors.append(f"{name}: HTTP {status}: {body[:200]!r}")
            if name == "health":
                health.append((t, lat, status))
            else:
                raw_metrics.append((t, lat, status, body))
            i = max(i + 1, math.ceil((time.monotonic() - t_begin) / period))  # skip, not catch up

    try:
        ctl.send("ready")
        window = ctl.recv()
        if window is None:
            return {"aborted": True}
        t_begin, t_end = window
        threads = [
            threading.Thread(target=poll, args=("health", job["health_s"], t_begin, t_end)),
            threading.Thread(target=poll, args=("metrics", job["metrics_s"], t_begin, t_end)),
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        for conn in conns.values():
            conn.close()
    metrics = [
        (t, lat, parse_metrics(body.decode("utf-8", "replace")) if status == 200 else {})
        for t, lat, status, body in raw_metrics
    ]
    return {"health": health, "metrics": metrics, "errors": len(errors), "error_list": errors[:5]}


def client_main(ctl: Any, cpu: int | None) -> None:
    """Serve jobs from the coordinator until it sends None (loadgen.serve_jobs)."""
    loadgen.serve_jobs(
        ctl,
        cpu,
        {
            "write": lambda job, c: asyncio.run(_write(job, c)),
            "probe": _probe,
        },
    )


# ==========================================================================================
# coordinator


def spawn(n: int, target: Any, cpu: int | None = None) -> hc.Workers:
    """`n` processes running `target`, managed (recv with timeout, close) by hc.Workers."""
    workers = hc.Workers(0, cpu)
    ctx = mp.get_context("spawn")
    for _ in range(n):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=target, args=(there, cpu), daemon=True)
        proc.start()
        workers.pipes.append(here)
        workers.procs.append(proc)
    return workers


class Bench:
    """The server, the client processes and everything acknowledged so far."""

    def __init__(self, server: hc.Server, args: argparse.Namespace) -> None:
        self.server = server
        self.args = args
        self.topics = [f"overload-{i}" for i in range(args.topics)]
        cpu = CLIENT_CPU if args.pin else None
        self.writers = spawn(args.writer_procs, client_main, cpu)
        self.prober = spawn(1, client_main, cpu)
        self.sse: hc.Workers | None = None
        if args.watchers:
            self.sse = sse.spawn_clients(args.watch_procs + 1, cpu)  # the last one writes
        self.acked: dict[str, list[int]] = {}

    def close(self) -> None:
        for workers in (self.writers, self.prober, self.sse):
            if workers is not None:
                workers.close()

    def keep_acks(self, topic: str, seqs: Any) -> None:
        self.acked.setdefault(topic, []).extend(seqs)

    def step(
        self, kind: str, mult: float | None, conc: int, warmup: float, window: float
    ) -> dict[str, Any]:
        """One measured step at `conc` writer connections (+ the fan-out if kind=fanout)."""
        args, server = self.args, self.server
        fan: dict[str, Any] = {}
        if kind == "fanout":
            assert self.sse is not None
            fan["pipes"], setup = sse.start_watchers(
                self.sse, server, WATCH_TOPIC, args.watchers, args.watch_procs
            )
            fan["setup_s"] = setup["setup_s"]
            paced = self.sse.pipes[-1]
            paced.send(
                {"mode": "paced", "port": server.port, "topic": WATCH_TOPIC,
                 "rate": args.watch_rate, "record_bytes": 0}
            )  # fmt: skip
            assert self.sse.recv(paced, 60) == "ready"
        shares = sse.split(conc, len(self.writers.pipes))
        pipes = self.writers.pipes[: len(shares)]
        k = 0
        for pipe, n in zip(pipes, shares, strict=True):
            topics = [self.topics[(k + i) % len(self.topics)] for i in range(n)]
            k += n
            pipe.send({"mode": "write", "port": server.port, "topics": topics,
                       "timeout_s": args.timeout})  # fmt: skip
        for pipe in pipes:
            assert self.writers.recv(pipe, 120) == "ready"
        probe = self.prober.pipes[0]
        probe.send({"mode": "probe", "port": server.port, "health_s": 0.02, "metrics_s": 0.25,
                    "timeout_s": args.timeout})  # fmt: skip
        assert self.prober.recv(probe, 60) == "ready"

        t_warm = time.monotonic() + 0.1
        t_start = t_warm + warmup
        t_end = t_start + window
        for pipe in pipes:
            pipe.send((t_warm, t_start, t_end))
        probe.send((t_warm, t_end))
        if fan:
            for pipe in fan["pipes"]:
                pipe.send((t_start, t_end, t_end + args.sse_grace))
            self.sse.pipes[-1].send((t_warm, t_end))  # type: ignore[union-attr]
        rss: list[float] = []
        cpu0 = sys0 = None
        while (now := time.monotonic()) < t_end:
            if cpu0 is None and now >= t_start:
                cpu0, sys0 = server.cpu_s(), hc.system_cpu()
            rss.append(server.rss_mib())
            time.sleep(min(0.25, max(0.0, (t_start if cpu0 is None else t_end) - now)) or 0.001)
        assert cpu0 is not None
        assert sys0 is not None
        server_cpu = server.cpu_s() - cpu0
        sys1 = hc.system_cpu()
        rss.append(server.rss_mib())

        wres = [self.writers.recv(pipe, args.timeout + 120) for pipe in pipes]
        pres = self.prober.recv(probe, args.timeout + 60)
        out = summarize_step(kind, mult, conc, wres, pres, t_start, t_end)
        for r in wres:
            for topic, seqs in r["acked"].items():
                self.keep_acks(topic, seqs)
        client_cpu = sum(r["cpu_s"] for r in wres)
        if fan:
            assert self.sse is not None
            paced_res = self.sse.recv(self.sse.pipes[-1], 120)
            watch_res = [self.sse.recv(pipe, args.sse_grace + 120) for pipe in fan["pipes"]]
            self.keep_acks(WATCH_TOPIC, paced_res["seqs"])
            out.update(summarize_fanout(watch_res, paced_res, args.watchers, t_start, t_end))
            out["sse_setup_s"] = fan["setup_s"]
            out["errors"] += out["sse_errors"]  # streams ended, recv failures (not error frames)
            if out["sse_errors"] and not out["first_error"]:
                out["first_error"] = out["sse_first_error"]
            client_cpu += sum(r["cpu_s"] for r in watch_res)
        out.update(
            {
                "rss_max_mib": max(rss),
                "server_cpu_pct": 100 * server_cpu / window,
                "client_cpu_pct": 100 * client_cpu / window,
                "client_cpu_max_pct": 100 * max(r["cpu_s"] for r in wres) / window,
                **hc.other_load(
                    sys1[0] - sys0[0], sys1[1] - sys0[1], server_cpu, client_cpu, window
                ),
            }
        )
        return out


def ms_of(sorted_s: list[float], p: float) -> float | None:
    return percentile(sorted_s, p) * 1e3 if sorted_s else None


def summarize_step(
    kind: str,
    mult: float | None,
    conc: int,
    wres: list[dict[str, Any]],
    pres: dict[str, Any],
    t_start: float,
    t_end: float,
) -> dict[str, Any]:
    span = t_end - t_start
    ok = sum(r["ok"] for r in wres)
    n429 = sum(r["n429"] for r in wres)
    n503 = sum(r["n503"] for r in wres)
    answered = ok + n429 + n503 + sum(r["other"] for r in wres)
    lat = sorted(x for r in wres for x in r["lat"])
    causes: dict[str, int] = {}
    for r in wres:
        for cause, n in r["causes"].items():
            causes[cause] = causes.get(cause, 0) + n
    p_n = sum(r["pressure_n"] for r in wres)
    p_max = [r["pressure_max"] for r in wres if r["pressure_max"] is not None]
    health = sorted(lat for t, lat, _ in pres["health"] if t_start <= t < t_end)
    errors = sum(r["errors"] for r in wres)
    out: dict[str, Any] = {
        "kind": kind,
        "multiplier": mult,
        "conc": conc,
        "client_procs": len(wres),
        "accepted_per_s": ok / span,
        "r429_per_s": n429 / span,
        "pct_429": 100 * n429 / answered if answered else 0.0,
        "pct_503": 100 * n503 / answered if answered else 0.0,
        "n_ok": ok,
        "n_429": n429,
        "n_503": n503,
        "errors": errors + pres["errors"],
        "write_errors": errors,
        "timeouts": sum(r["timeouts"] for r in wres),
        "reconnects": sum(r["reconnects"] for r in wres),
        "first_error": next((r["first_error"] for r in wres if r["first_error"]), None)
        or (pres["error_list"][0] if pres["error_list"] else None),
        "ack_p50_ms": ms_of(lat, 50),
        "ack_p99_ms": ms_of(lat, 99),
        "ack_max_ms": lat[-1] * 1e3 if lat else None,
        "health_n": len(health),
        "health_p50_ms": ms_of(health, 50),
        "health_p99_ms": ms_of(health, 99),
        "health_max_ms": health[-1] * 1e3 if health else None,
        "health_errors": pres["errors"],
        "causes_429": causes,
        "hdr_pressure_mean": sum(r["pressure_sum"] for r in wres) / p_n if p_n else None,
        "hdr_pressure_max": max(p_max) if p_max else None,
    }
    out.update(summarize_metrics(pres["metrics"], t_start, t_end))
    return out


def summarize_metrics(
    samples: list[tuple[float, float, dict[str, float]]], t_start: float, t_end: float
) -> dict[str, Any]:
    """Ladder state over the window from the sampled series (None where a series is missing)."""
    win = [m for t, _lat, m in samples if t_start <= t < t_end and m]

    def values(key: str) -> list[float]:
        return [m[key] for m in win if key in m]

    pressure = values("topicd_pressure")
    coalesce = values("topicd_coalesce_window_ms")
    commit = values("topicd_commit_window_ms")
    defer = values("topicd_defer_active")
    queue = values("topics_wal_queue_depth")
    signals: dict[str, float] = {}
    throttled: dict[str, float] = {}
    sig, thr = "topicd_pressure_signal{signal=", "topicd_throttled_total{cause="
    if win:
        for key in win[-1]:
            if key.startswith(sig):
                signals[key[len(sig) : -1]] = max(values(key))
            elif key.startswith(thr):
                first = next(m[key] for m in win if key in m)
                throttled[key[len(thr) : -1]] = win[-1][key] - first
    return {
        "metric_samples": len(win),
        "pressure_mean": statistics.fmean(pressure) if pressure else None,
        "pressure_max": max(pressure) if pressure else None,
        "coalesce_max_ms": max(coalesce) if coalesce else None,
        "commit_max_ms": max(commit) if commit else None,
        "defer_pct": 100 * sum(v >= 0.5 for v in defer) / len(defer) if defer else None,
        "wal_queue_max": max(queue) if queue else None,
        "signals_max": signals,
        "throttled_delta": throttled,
        "metrics_series": [
            (round(t - t_start, 2), {k: v for k, v in m.items() if "throttled" not in k})
            for t, _lat, m in samples
            if t_start <= t < t_end
        ],
    }


def summarize_fanout(
    watch: list[dict[str, Any]], paced: dict[str, Any], n: int, t_start: float, t_end: float
) -> dict[str, Any]:
    lat = sorted(x for r in watch for x in r["lat"])
    t0, t1 = int(t_start * 1e9), int(t_end * 1e9)
    writes = sum(1 for t in paced["sends"] if t0 <= t < t1)
    acks = sorted(paced["acks"])
    frame_errors = sum(r["error_frames"] for r in watch)
    return {
        "watchers": n,
        "sse_pairs": len(lat),
        "sse_p50_ms": percentile(lat, 50) / 1e6 if lat else None,
        "sse_p99_ms": percentile(lat, 99) / 1e6 if lat else None,
        "sse_max_ms": lat[-1] / 1e6 if lat else None,
        "sse_writes": writes,
        "sse_delivered_pct": 100 * len(lat) / (writes * n) if writes else None,
        "sse_gaps": sum(r["gaps"] for r in watch),
        "sse_dupes": sum(r["dupes"] for r in watch),
        "sse_closed": sum(r["closed"] for r in watch),
        "sse_tombstones": sum(r["tombstones"] for r in watch),
        "sse_error_frames": frame_errors,
        "sse_errors": sum(r["errors"] for r in watch) - frame_errors,
        "sse_first_error": next((r["first_error"] for r in watch if r["first_error"]), None),
        "paced_ack_p50_ms": percentile(acks, 50) / 1e6 if acks else None,
        "paced_ack_p99_ms": percentile(acks, 99) / 1e6 if acks else None,
        "paced_refused": paced["errors"],
        "paced_first_refusal": paced["first_error"],
        "paced_late": paced["late"],
    }


# ------------------------------------------------------------------------------------------
# set-up and the loss check


def request_json(conn: loadgen.BlockingConn, port: int, method: str, path: str, body: Any) -> Any:
    status, resp = conn.request(loadgen.build_request(HOST, port, path, orjson.dumps(body), method))
    conn.ensure_connected()
    if not 200 <= status < 300:
        raise RuntimeError(f"{method} {path}: HTTP {status}: {resp[:300]!r}")
    return orjson.loads(resp)


def prepare_topics(server: hc.Server, topics: list[str]) -> None:
    conn = loadgen.BlockingConn(HOST, server.port)
    try:
        for topic in topics:
            request_json(conn, server.port, "PUT", f"/v0/topics/{topic}", {"durability": "disk"})
    finally:
        conn.close()


def check_losses(server: hc.Server, acked: dict[str, list[int]]) -> dict[str, Any]:
    """Read every topic from seq 0; every acknowledged seq must be present."""
    conn = loadgen.BlockingConn(HOST, server.port)
    per: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    try:
        for topic, seqs in sorted(acked.items()):
            present: set[int] = set()
            tombstones = 0
            cursor = 0
            path = f"/v0/topics/{topic}/diff"
            while True:
                page = request_json(
                    conn, server.port, "POST", path, {"from_seq": cursor, "limit": 1000}
                )
                present.update(r["$seq"] for r in page["records"])
                tombstones += page.get("tombstone") is not None
                if page["caught_up"] or page["next_from_seq"] <= cursor:
                    break
                cursor = page["next_from_seq"]
            wanted = set(seqs)
            lost = sorted(wanted - present)
            per[topic] = {
                "acked": len(seqs),
                "duplicate_acks": len(seqs) - len(wanted),
                "read": len(present),
                "lost": len(lost),
                "lost_first": lost[:10],
                "tombstones": tombstones,
            }
    finally:
        conn.close()
    return {
        "acked": sum(p["acked"] for p in per.values()),
        "lost": sum(p["lost"] for p in per.values()),
        "duplicate_acks": sum(p["duplicate_acks"] for p in per.values()),
        "tombstones": sum(p["tombstones"] for p in per.values()),
        "seconds": time.perf_counter() - t0,
        "topics": per,
    }


# ------------------------------------------------------------------------------------------
# report


DEFAULT_PERMITS = 32  # classes.client_permits


def median_steps(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per step, the median over rounds (errors summed; see http_core.median_of)."""
    if len(rounds) == 1:
        return rounds[0]
    out = []
    for i, step in enumerate(rounds[0]):
        per = [r[i] for r in rounds]
        med = hc.median_of(per)
        for key, value in step.items():  # None in any round: keep the numbers that exist
            vals = [r.get(key) for r in per]
            nums = [v for v in vals if isinstance(v, int | float) and not isinstance(v, bool)]
            if key not in ("errors", "reconnects") and nums and len(nums) < len(vals):
                med[key] = statistics.median(nums)
            elif value is None and not nums:
                med[key] = None
            elif isinstance(value, dict):  # counts by cause / signal: median per key
                keys = {k for v in vals if isinstance(v, dict) for k in v}
                med[key] = {k: statistics.median(v.get(k, 0) for v in vals) for k in keys}
        out.append(med)
    return out


def rung_firsts(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each rung: the index of the first step that shows it (None: never / no series)."""
    out = []
    for name, shown, key, above in RUNGS:
        values = [s.get(key) for s in steps]
        first = next((i for i, v in enumerate(values) if v is not None and v > above), None)
        out.append(
            {
                "rung": name,
                "shown_by": shown,
                "first_step": first,
                "series_missing": all(v is None for v in values),
            }
        )
    return out


def ladder_verdict(rungs: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """Met: every rung reached, first steps non-decreasing in ladder order; None: only a
    prefix of the ladder was reached (in order); False: a rung before one that showed is
    missing or came later."""
    last = -1
    missing: list[str] = []
    for r in rungs:
        first = r["first_step"]
        if first is None:
            missing.append(r["rung"] + (" (series missing)" if r["series_missing"] else ""))
            continue
        if missing:
            return False, f"'{r['rung']}' showed but earlier rungs never did: {', '.join(missing)}"
        if first < last:
            return False, f"'{r['rung']}' showed before the rung below it"
        last = first
    if missing:
        return None, "not reached: " + ", ".join(missing)
    return True, "in order"


def step_label(s: dict[str, Any]) -> str:
    if s["kind"] == "ramp":
        return "ramp"
    tag = f"{s['multiplier']:g}×"
    return tag + "+SSE" if s["kind"] == "fanout" else tag


def evaluate_targets(
    steps: list[dict[str, Any]], peak: float, losses: dict[str, Any]
) -> list[dict[str, Any]]:
    targets = []
    rungs = rung_firsts(steps)
    met, why = ladder_verdict(rungs)
    order = ", ".join(
        f"{r['rung']} @ " + ("-" if r["first_step"] is None else step_label(steps[r["first_step"]]))
        for r in rungs
    )
    targets.append(
        {"target": "ladder in order (coalesce → wider commits → defer → 429)", "met": met,
         "shown": f"{why} ({order})", "rungs": rungs}
    )  # fmt: skip
    sweep = [s for s in steps if s["kind"] == "sweep"]
    top = max(sweep, key=lambda s: s["multiplier"])
    pct = 100 * top["accepted_per_s"] / peak if peak else None
    targets.append(
        {
            "target": f"accepted writes/s at {top['multiplier']:g}× ≥ {TARGET_4X_PCT:g} % of peak",
            "value": pct,
            "met": None if pct is None else pct >= TARGET_4X_PCT,
            "shown": f"{top['accepted_per_s']:,.0f} of {peak:,.0f}/s = {pct:.1f} %"
            if pct is not None
            else "no peak",
        }
    )
    fan = next((s for s in steps if s["kind"] == "fanout"), None)
    if fan is not None and peak:
        fpct = 100 * fan["accepted_per_s"] / peak
        targets.append(
            {"target": f"(info) accepted writes/s with the fan-out ≥ {TARGET_4X_PCT:g} % of peak",
             "value": fpct, "met": None, "shown": f"{fan['accepted_per_s']:,.0f}/s = {fpct:.1f} %"}
        )  # fmt: skip
    worst = max(steps, key=lambda s: s["health_p99_ms"] or math.inf)
    hp99 = worst["health_p99_ms"]
    targets.append(
        {
            "target": f"health p99 < {TARGET_HEALTH_P99_MS:g} ms at every step",
            "value": hp99,
            "met": hp99 is not None and hp99 < TARGET_HEALTH_P99_MS,
            "shown": f"worst {hp99:.1f} ms at {step_label(worst)}"
            if hp99 is not None
            else f"no health samples at {step_label(worst)}",
        }
    )
    targets.append(
        {
            "target": "zero lost acknowledged writes",
            "value": losses["lost"],
            "met": losses["lost"] == 0 and losses["duplicate_acks"] == 0,
            "shown": f"{losses['lost']} lost of {losses['acked']:,} acknowledged"
            + (
                f", {losses['duplicate_acks']} seqs acked twice" if losses["duplicate_acks"] else ""
            ),
        }
    )
    errors = sum(s["errors"] for s in steps)
    targets.append(
        {"target": "no errors (other statuses, timeouts, dropped connections, 429/503 without "
         "Retry-After)", "value": errors, "met": errors == 0, "shown": f"{errors} errors"}
    )  # fmt: skip
    return targets


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


COLUMNS: list[tuple[str, str, int, int]] = [  # header, key, width, digits
    ("conc", "conc", 5, 0),
    ("acc/s", "accepted_per_s", 8, 0),
    ("429/s", "r429_per_s", 8, 0),
    ("429%", "pct_429", 6, 1),
    ("503%", "pct_503", 5, 1),
    ("err", "errors", 4, 0),
    ("ack50", "ack_p50_ms", 7, 1),
    ("ack99", "ack_p99_ms", 7, 1),
    ("hl50", "health_p50_ms", 6, 1),
    ("hl99", "health_p99_ms", 6, 1),
    ("pr.avg", "pressure_mean", 7, 2),
    ("pr.max", "pressure_max", 7, 2),
    ("coal", "coalesce_max_ms", 6, 1),
    ("commit", "commit_max_ms", 7, 1),
    ("defer%", "defer_pct", 7, 0),
    ("sse50", "sse_p50_ms", 7, 1),
    ("sse99", "sse_p99_ms", 7, 1),
    ("RSS", "rss_max_mib", 6, 0),
    ("srv%", "server_cpu_pct", 5, 0),
    ("oth%", "other_cpu_pct", 5, 0),
]


def print_table(steps: list[dict[str, Any]], title: str) -> None:
    p = print
    p(title)
    header = f"{'step':<9}" + "".join(f"{h:>{w}}" for h, _k, w, _d in COLUMNS)
    p(header)
    p("-" * len(header))
    for s in steps:
        label = step_label(s) if s["kind"] != "ramp" else f"c={s['conc']}"
        p(f"{label:<9}" + "".join(f"{fmt(s.get(k), d):>{w}}" for _h, k, w, d in COLUMNS))


def print_report(doc: dict[str, Any]) -> None:
    p = print
    info, st = doc["machine"], doc["settings"]
    p()
    p("== topicd overload benchmark (pressure governor / backpressure ladder) ==")
    p(f"command : {doc['command']}")
    pinned = st.get("pin")
    p(f"pinning : {'topicd on CPU 0, clients on CPU 1' if pinned else 'none'}")
    p(
        f"machine : nproc={info['nproc']}, {info['cpu_model']}, {info['implementation']} "
        f"{info['python']}, kernel {info['kernel']}, loadavg at start "
        f"{' '.join(info['loadavg_start'])}"
    )
    p(
        f"speed   : trio.sleep(0) {info['trio_sleep0_per_s_start']:,.0f}/s at start, "
        f"{info['trio_sleep0_per_s_end']:,.0f}/s at end (perf-baseline.md: ≈ 360,000/s)"
    )
    p(
        f"topicd  : {info['git_commit']}"
        + (" + uncommitted changes" if info["topicd_tree_dirty"] else "")
    )
    p(
        f"run     : {st['topics']} disk topics, {st['writer_procs']} writer processes, window "
        f"{st['window']} s after {st['warmup']} s, repeat {st['repeat']}, fan-out "
        f"{st['watchers']} watchers at {st['watch_rate']:g} writes/s"
    )
    p()
    pk = doc["peak"]
    if doc["ramp"]:
        print_table(doc["ramp"], f"phase 1: peak search (window {st['ramp_window']} s)")
        p(
            f"peak: {pk['ramp_max_per_s']:,.0f} accepted writes/s in the ramp; C* = {pk['conc']} "
            f"(smallest concurrency within {100 * (1 - PEAK_WITHIN):.0f} % of it)"
        )
    else:
        p(f"phase 1 skipped: C* = {pk['conc']} (--peak-conc)")
    p(f"peak for the 4× target = best of ramp and sweep = {pk['peak_per_s']:,.0f} writes/s")
    p()
    print_table(doc["steps"], "phase 2: sweep (per step; medians over rounds)")
    p(
        "acc/s accepted writes/s; ack/hl/sse = write-ack, health and SSE-delivery "
        "p50/p99 ms;\npr = topicd_pressure (metrics); coal/commit = largest window ms; "
        "defer% = samples with defer active; RSS MiB max"
    )
    p()
    for s in doc["steps"]:
        extra = []
        extra.append(
            f"health n={s['health_n']:.0f} max {fmt(s['health_max_ms'])} ms"
            + (f", {s['health_errors']} failed" if s["health_errors"] else "")
        )
        if s["causes_429"]:
            extra.append("429 causes " + ", ".join(f"{k} {v}" for k, v in s["causes_429"].items()))
        if any(s["throttled_delta"].values()):
            counted = ", ".join(f"{k} {v:.0f}" for k, v in s["throttled_delta"].items() if v)
            extra.append(f"topicd_throttled_total over the window: {counted}")
        if s["signals_max"]:
            extra.append(
                "signals max " + ", ".join(f"{k} {v:.2f}" for k, v in s["signals_max"].items())
            )
        if s["hdr_pressure_max"] is not None:
            extra.append(
                f"X-Topicd-Pressure mean {s['hdr_pressure_mean']:.3f} "
                f"max {s['hdr_pressure_max']:.3f}"
            )
        if s["wal_queue_max"] is not None:
            extra.append(f"WAL queue max {s['wal_queue_max']:.0f}")
        extra.append(
            f"client CPU {s['client_cpu_pct']:.0f} % (max/proc {s['client_cpu_max_pct']:.0f} %)"
        )
        if s["kind"] == "fanout":
            extra.append(
                f"SSE {s['sse_pairs']:,} pairs, delivered {fmt(s['sse_delivered_pct'], 2)} %, "
                f"max {fmt(s['sse_max_ms'])} ms, gaps {s['sse_gaps']}, closed "
                f"{s['sse_closed']}, error frames {s['sse_error_frames']}; paced writer: "
                f"{s['sse_writes']} writes, ack p50 {fmt(s['paced_ack_p50_ms'])} ms, "
                f"{s['paced_refused']} refused"
            )
        if s["first_error"]:
            extra.append(f"first error: {s['first_error']}")
        p(f"  {step_label(s):<8} " + "; ".join(extra))
    lo = doc["losses"]
    p()
    p(
        f"loss check: {lo['acked']:,} acknowledged writes over {len(lo['topics'])} topics, "
        f"{lo['lost']} lost, {lo['duplicate_acks']} acked twice, {lo['tombstones']} "
        f"tombstones (read back in {lo['seconds']:.1f} s)"
    )
    p()
    p("targets")
    for t in doc["targets"]:
        mark = {True: "MET        ", False: "MISSED     ", None: "NOT REACHED"}[t["met"]]
        if t["target"].startswith("(info)"):
            mark = "info       "
        p(f"  [{mark}] {t['target']}: {t['shown']}")


def render_chart(doc: dict[str, Any], path: Path) -> Path | None:
    """The sweep as a PNG: throughput and pressure above, latencies below, rungs marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: chart skipped (it is a bench-only dependency: "
            "pip install matplotlib)"
        )
        return None
    steps = doc["steps"]
    xs = list(range(len(steps)))
    labels = [f"{step_label(s)}\nc={s['conc']}" for s in steps]

    def col(key: str) -> list[float]:
        return [math.nan if s.get(key) is None else s[key] for s in steps]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    top.plot(xs, col("accepted_per_s"), "o-", color="tab:blue", label="accepted writes/s")
    top.plot(xs, col("r429_per_s"), "s--", color="tab:red", label="429/s")
    top.axhline(doc["peak"]["peak_per_s"], color="tab:blue", lw=0.8, ls=":", label="peak")
    top.set_ylabel("per second")
    top.set_ylim(bottom=0)
    right = top.twinx()
    right.plot(xs, col("pressure_mean"), "^-", color="tab:purple", label="pressure mean")
    right.plot(xs, col("pressure_max"), "v:", color="tab:purple", label="pressure max")
    right.set_ylim(0, 1.05)
    right.set_ylabel("pressure")
    lines = top.get_legend_handles_labels()
    lines2 = right.get_legend_handles_labels()
    top.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    bottom.plot(xs, col("health_p99_ms"), "o-", color="tab:green", label="health p99")
    bottom.plot(xs, col("ack_p99_ms"), "s-", color="tab:orange", label="write ack p99")
    bottom.plot(xs, col("ack_p50_ms"), "s:", color="tab:orange", label="write ack p50")
    bottom.plot(xs, col("sse_p99_ms"), "*", ms=12, color="tab:brown", label="SSE delivery p99")
    bottom.axhline(TARGET_HEALTH_P99_MS, color="tab:green", lw=0.8, ls=":", label="health target")
    bottom.set_yscale("log")
    bottom.set_ylabel("ms")
    bottom.legend(loc="upper left", fontsize=8)
    rungs = next(t["rungs"] for t in doc["targets"] if "rungs" in t)
    placed: dict[int, int] = {}  # step → rung labels already drawn there
    for r in rungs:
        first = r["first_step"]
        if first is None:
            continue
        x = first + 0.13 * placed.get(first, 0)
        placed[first] = placed.get(first, 0) + 1
        for ax in (top, bottom):
            ax.axvline(x, color="grey", lw=0.8, ls="--")
        top.text(
            x + 0.02, 0.3, f"{r['rung']} from here", transform=top.get_xaxis_transform(),
            rotation=90, fontsize=8, color="dimgrey", va="bottom",
            bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1},
        )  # fmt: skip
    bottom.set_xticks(xs, labels)
    bottom.set_xlabel("offered load (multiple of the peak concurrency C*, closed-loop connections)")
    info = doc["machine"]
    top.set_title(
        f"topicd overload sweep — {doc['timestamp'][:10]}, commit {info['git_commit']}, "
        f"C* = {doc['peak']['conc']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------
# main


def parse_list(text: str, cast: Any) -> list[Any]:
    return [cast(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="topicd overload / backpressure-ladder benchmark")
    p.add_argument("--quick", action="store_true", help="short windows (a smoke run)")
    p.add_argument("--repeat", type=int, default=1, help="sweep rounds; medians are reported")
    p.add_argument("--window", type=float, help="measured seconds per step (default 10)")
    p.add_argument("--warmup", type=float, help="warm-up seconds per step (default 2)")
    p.add_argument("--multipliers", default="0.25,0.5,1,2,4", help="offered load × C*")
    p.add_argument("--ramp", default="1,2,4,8,16,32,64", help="peak-search concurrencies")
    p.add_argument("--peak-conc", type=int, help="use this C* and skip the peak search")
    p.add_argument("--max-conc", type=int, default=512, help="cap on writer connections")
    p.add_argument(
        "--bounds",
        choices=("scaled", "default"),
        default="scaled",
        help="sweep with client permits = client waiters = min(C*, 32) (default), or the "
        "defaults (32 and 4096)",
    )
    p.add_argument("--topics", type=int, default=8, help="disk topics the writers spread over")
    p.add_argument("--writer-procs", type=int, default=2, help="writer processes")
    p.add_argument("--timeout", type=float, default=10.0, help="no answer after S s = error")
    p.add_argument("--watchers", type=int, default=1000, help="fan-out step SSE watchers (0: none)")
    p.add_argument("--watch-procs", type=int, default=2, help="watcher processes")
    p.add_argument("--watch-rate", type=float, default=2.0, help="paced writes/s to watchers")
    p.add_argument("--sse-grace", type=float, default=2.0, help="watchers read on after window")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for topicd (e.g. TOPICD_GOVERNOR_...), repeatable",
    )
    p.add_argument(
        "--pin", action="store_true", help="pin topicd to CPU 0 and the load generators to CPU 1"
    )
    p.add_argument("--chart", type=Path, default=DEFAULT_CHART, help="PNG path (docs/overload.png)")
    p.add_argument("--no-chart", action="store_true", help="do not draw the chart")
    p.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    args = p.parse_args(argv)
    q = args.quick
    if args.window is None:
        args.window = 3.0 if q else 10.0
    if args.warmup is None:
        args.warmup = 1.0 if q else 2.0
    args.ramp_window, args.ramp_warmup = (1.5, 0.5) if q else (3.0, 1.0)
    try:
        args.multipliers = sorted(parse_list(args.multipliers, float))
        args.ramp = sorted(c for c in parse_list(args.ramp, int) if c <= args.max_conc)
    except ValueError as exc:
        p.error(f"--multipliers / --ramp: {exc}")
    if not args.multipliers or min(args.multipliers) <= 0:
        p.error("--multipliers: positive numbers")
    if not args.ramp and args.peak_conc is None:
        p.error("--ramp: no concurrency ≤ --max-conc")
    if args.repeat < 1 or args.writer_procs < 1 or args.topics < 1 or args.watch_procs < 1:
        p.error("--repeat, --writer-procs, --topics and --watch-procs must be ≥ 1")
    for item in args.env:
        if "=" not in item:
            p.error(f"--env: KEY=VALUE, got {item!r}")
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        args.pin = False  # one CPU: nothing to separate
    return args


def log_step(tag: str, s: dict[str, Any]) -> None:
    line = (
        f"{tag:<18} c={s['conc']:<4} {s['accepted_per_s']:8,.0f} acc/s {s['r429_per_s']:8,.0f} "
        f"429/s ack p99 {fmt(s['ack_p99_ms'])} ms, health p99 {fmt(s['health_p99_ms'])} ms, "
        f"pressure max {fmt(s['pressure_max'], 2)}, errors {s['errors']} (server CPU "
        f"{s['server_cpu_pct']:.0f} %, clients {s['client_cpu_pct']:.0f} %, other "
        f"{s['other_cpu_pct']:.0f} %)"
    )
    if s.get("sse_p50_ms") is not None:
        line += f", SSE p50 {fmt(s['sse_p50_ms'])} p99 {fmt(s['sse_p99_ms'])} ms"
    print(line, flush=True)
    if s["first_error"]:
        print(f"{'':<18} first error: {s['first_error']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(sys.orig_argv)
    sse.raise_nofile()  # 1000 watchers: the server and the watcher processes inherit it
    info = hc.machine_info(REPO_DIR)
    if args.pin:  # the coordinator and everything it spawns stay off the server's CPU
        os.sched_setaffinity(0, {CLIENT_CPU})
    server_cpu = SERVER_CPU if args.pin else None
    bench: Bench | None = None
    ramp: list[dict[str, Any]] = []
    rounds: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="topicd-overload-") as tmp:
        tmpdir = Path(tmp)
        env = dict(os.environ, TOPICD_PORT_FILE=str(tmpdir / "topicd.port"))
        env.update(item.split("=", 1) for item in args.env)

        def topicd(env: dict[str, str]) -> hc.Server:
            return hc.Server(
                "topicd",
                [sys.executable, "-m", "topicd", "serve", "--port", "0",
                 "--data-dir", str(tmpdir / "data")],
                env,
                tmpdir / "topicd.port",
                REPO_DIR,
            )  # fmt: skip

        server = topicd(env)
        try:
            server.start(cpu=server_cpu)
            assert server.proc is not None
            print(f"topicd listening on {HOST}:{server.port} (pid {server.proc.pid})", flush=True)
            bench = Bench(server, args)
            prepare_topics(server, [*bench.topics, WATCH_TOPIC])
            if args.peak_conc is None:
                ramp_rounds = []
                for r in range(args.repeat):  # medians: one noisy window must not set C*
                    order = args.ramp if r % 2 == 0 else args.ramp[::-1]
                    got = {}
                    for c in order:
                        got[c] = bench.step("ramp", None, c, args.ramp_warmup, args.ramp_window)
                        log_step(f"ramp {r + 1} c={c}", got[c])
                    ramp_rounds.append([got[c] for c in args.ramp])
                ramp = median_steps(ramp_rounds)
                best = max(s["accepted_per_s"] for s in ramp)
                near = [s["conc"] for s in ramp if s["accepted_per_s"] >= PEAK_WITHIN * best]
                c_star = int(min(near))
                if c_star == args.ramp[-1]:
                    print("NOTE the peak is at the end of the ramp: it may lie higher (--ramp)")
            else:
                best, c_star = math.nan, args.peak_conc
            if args.bounds == "scaled":
                # the admission bounds sized to this machine's peak, as 32 permits and 4096
                # waiters are to the reference one: restart on the same data directory
                # (never above the defaults, 32 and 4096)
                bound = min(c_star, DEFAULT_PERMITS)
                bounds = {"TOPICD_CLASSES_CLIENT_PERMITS": str(bound),
                          "TOPICD_CLASSES_CLIENT_WAITERS": str(bound)}  # fmt: skip
                server.stop()
                (tmpdir / "topicd.port").unlink(missing_ok=True)
                server = bench.server = topicd(env | bounds)
                server.start(cpu=server_cpu)
                print(f"restarted with client permits = client waiters = {bound}")
            concs = [min(args.max_conc, max(1, round(m * c_star))) for m in args.multipliers]
            print(f"C* = {c_star}: sweep at concurrencies {concs}", flush=True)
            for r in range(args.repeat):
                steps = []
                for m, c in zip(args.multipliers, concs, strict=True):
                    s = bench.step("sweep", m, c, args.warmup, args.window)
                    steps.append(s)
                    log_step(f"round {r + 1} {m:g}×", s)
                    time.sleep(0.5)
                if args.watchers:
                    s = bench.step("fanout", args.multipliers[-1], concs[-1], args.warmup,
                                   args.window)  # fmt: skip
                    steps.append(s)
                    log_step(f"round {r + 1} {args.multipliers[-1]:g}×+SSE", s)
                rounds.append(steps)
            time.sleep(0.5)
            print("reading every topic back…", flush=True)
            losses = check_losses(server, bench.acked)
        finally:
            if bench is not None:
                bench.close()
            server.stop()

    steps = median_steps(rounds)
    sweep_best = max(s["accepted_per_s"] for s in steps if s["kind"] == "sweep")
    peak = max(sweep_best, best) if not math.isnan(best) else sweep_best
    targets = evaluate_targets(steps, peak, losses)
    info["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    info["trio_sleep0_per_s_end"] = hc.speed_probe()
    settings = {
        k: getattr(args, k)
        for k in (
            "quick", "repeat", "window", "warmup", "ramp_window", "ramp_warmup", "multipliers",
            "ramp", "peak_conc", "max_conc", "bounds", "topics", "writer_procs", "timeout",
            "watchers", "watch_procs", "watch_rate", "sse_grace", "env", "pin",
        )
    }  # fmt: skip
    doc: dict[str, Any] = {
        "benchmark": "overload",
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command,
        "machine": info,
        "settings": settings,
        "peak": {
            "ramp_max_per_s": best if not math.isnan(best) else None,
            "conc": c_star,
            "peak_per_s": peak,
        },
        "ramp": ramp,
        "steps": steps,
        "rounds": rounds if args.repeat > 1 else None,
        "losses": losses,
        "targets": targets,
    }
    print_report(doc)
    if not args.no_chart:
        chart = render_chart(doc, args.chart)
        if chart is not None:
            shown = chart.resolve()
            with contextlib.suppress(ValueError):
                shown = shown.relative_to(REPO_DIR)
            print(f"\nchart written to {shown}")
            doc["chart"] = str(shown)
    if not args.no_json:
        RESULTS_DIR.mkdir(exist_ok=True)
        out = RESULTS_DIR / f"overload-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        print(f"results written to {out.relative_to(REPO_DIR)}")
    failed = losses["lost"] or sum(s["errors"] for s in steps)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
