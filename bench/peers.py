#!/usr/bin/env python
"""Side by side with Redis and NATS: topicd against its peers in one run, C clients on every side.

    python bench/peers.py [--repeat N] [--quick] [--metrics NAME,...] [--no-pin]
                          [--profile DIR] [--baseline DIR]

Needs (installs nothing): Debian packages `wrk` (HTTP load), `redis-server` (which brings
`redis-server` and `redis-benchmark`), `nats-server`, and `gcc` (the fan-out client in
bench/c/fanout.c is compiled into a temporary directory at the start of every run); plus
the project's dev install (orjson; topicd itself from this checkout). A peer whose binary
is missing is skipped with a message (topicd is still measured, the ratio is n/a); without
`wrk` the write metrics are skipped, without `gcc` the fan-out metrics.

Every system is started and stopped (by PID) by the script, bound to 127.0.0.1 on a free
port with its data in a temporary directory:

* topicd: `python -m topicd serve` from this checkout (bench/http_core.py's
  `topicd_server`, its port file);
* Redis: `redis-server` with `appendonly yes`, `appendfsync always`, no RDB snapshots and
  no automatic AOF rewrite (a rewrite forks in the middle of a window);
* NATS core: `nats-server` (no JetStream).

With two or more CPUs the servers run on CPU 0 and every client (wrk, redis-benchmark, the
C fan-out client, this script) on CPU 1, as the other benches do with `--pin`.

Metrics, each with the same 100-byte record (topicd: a record whose `data` is a 100-byte
JSON string; Redis: `XADD <key> * d <100 bytes>`; NATS: a 100-byte payload):

1. `write1_c64`: single-record writes to an `fsync` topic, 64 connections, wrk with
   bench/lua/post.lua, vs `redis-benchmark -c 64 -P 1` XADD: records/s.
2. `write1_c1`: the same at 1 connection (`wrk -c1 -t1`, its latency distribution) vs
   `redis-benchmark -c 1 -P 1`: p50.
3. `batch100_c16`: 100-record writes to an `fsync` topic, 16 connections, vs
   `redis-benchmark -c 16 -P 100` XADD: records/s.
4. `fanout_100` / `fanout_1000`: an `ephemeral` topic watched by 100 (1000) SSE streams
   (`POST /v0/watch` tail, `GET /v0/watch/<wid>`), single-record POSTs at 50 (5)
   events/s, vs NATS core with 100 (1000) subscriber connections and `PUB` at the same
   rate. Subscribers: one C epoll process holding every connection; publisher: a C
   process on an absolute schedule, stamping CLOCK_MONOTONIC into the record (one clock
   for every process on Linux). Latency = receipt - send, over every (subscriber,
   record) pair of the records published after the warm-up: p50/p99, and lost pairs.

Each write metric: a warm-up (`--warmup` s of wrk; for redis-benchmark a calibration run
that also sizes the timed run to about `--duration` s), then the timed window. Fan-out:
`--fan-warmup` s of publishing, then `--fan-duration` s measured, then `--fan-grace` s for
stragglers. Every metric runs `--repeat` (3) rounds, the two systems back to back with the
first one alternating round after round; medians are reported, and the ratio is the
median of the rounds' own ratios (each round's is printed too). Also reported: server CPU
per record (from /proc), the clients' CPU (% of their core), the CPU used by anything else
on the (shared) machine during each window, topicd's server CPU per record from the
window's start until it is idle again (what the checkpoint's background absorb of those
records costs included), topicd's records per `fdatasync` (its own
counter, `GET /v0/metrics`; a write window without one counts as an error), and an
`fdatasync` probe of the temporary directory's file system at the start and the end.
With `--profile DIR`, py-spy (in the `bench` extras) samples topicd during its windows
and the split per stage is printed; such a run is slower, its numbers are not the
reference.
With `--baseline DIR` (a checkout of another commit, e.g. a `git worktree`), a second
topicd server runs from DIR and is measured as a third system (`base`) in the same rounds,
in the rotated order, so an old-against-new comparison shares each round's machine state;
its own ratios to the peer are reported beside topicd's.
Before each measurement the server under test must be idle (below 10 % of a core over
0.5 s, waiting at most 30 s): after a write metric topicd keeps absorbing the committed
records into its segments in the background for a while, and a fan-out measured meanwhile
measured that (seen in a profile).

Targets (issue 14): topicd/Redis c=64 records/s ≥ 0.16; topicd/Redis c=1 p50 ≤ 2.6;
topicd/Redis 100-record batches ≥ 0.8; topicd fan-out p50 ≤ 1.5 × NATS core's, at both
sizes, with no delivery lost. Results are printed and written to
bench/results/peers-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import io
import math
import os
import re
import resource
import selectors
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import durable  # siblings of this script
import http_core as hc
import loadgen
import write_flood

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

HOST = hc.HOST
BENCH_DIR = hc.BENCH_DIR
REPO_DIR = hc.REPO_DIR
RECORD_BYTES = 100
SERVER_CPU, CLIENT_CPU = 0, 1

TARGET_C64 = 0.16  # topicd / Redis records/s, at least
TARGET_C1_P50 = 2.6  # topicd / Redis p50, at most
TARGET_BATCH = 0.8  # topicd / Redis records/s, at least
TARGET_FANOUT_P50 = 1.5  # topicd / NATS p50, at most


@dataclass(frozen=True)
class Metric:
    name: str
    label: str
    peer: str  # "redis" | "nats"
    conns: int = 0
    batch: int = 1
    watchers: int = 0
    rate: float = 0.0


METRICS = [
    Metric("write1_c64", "1-record `fsync` writes, 64 connections", "redis", conns=64),
    Metric("write1_c1", "1-record `fsync` write, 1 connection", "redis", conns=1),
    Metric("batch100_c16", "100-record `fsync` batches, 16 connections", "redis", 16, 100),
    Metric("fanout_100", "fan-out, 100 watchers at 50 events/s", "nats", watchers=100, rate=50),
    Metric("fanout_1000", "fan-out, 1000 watchers at 5 events/s", "nats", watchers=1000, rate=5),
]


def record_string(fill: str = "x") -> bytes:
    """The 100-byte record: a JSON string, quotes included."""
    return b'"' + fill.encode() * (RECORD_BYTES - 2) + b'"'


# ------------------------------------------------------------------------------------------
# processes


@contextlib.contextmanager
def on_cpu(cpu: int | None) -> Iterator[None]:
    """Run the block (a Popen) with this thread's affinity set to `cpu`: children inherit it."""
    if cpu is None:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def proc_cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / hc.CLK_TCK


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class Peer:
    """A peer server subprocess; ready once `ready(port)` answers."""

    def __init__(
        self, name: str, argv: list[str], port: int, ready: Callable[[int], bool], log: Path
    ) -> None:
        self.name, self.argv, self.port, self.ready, self.log = name, argv, port, ready, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, cpu: int | None, timeout: float = 20.0) -> None:
        with self.log.open("wb") as log, on_cpu(cpu):
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} did not start (exit {self.proc.poll()}):\n{tail}")
            with contextlib.suppress(OSError):
                if self.ready(self.port):
                    return
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # SIGTERM to this PID
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def redis_ready(port: int) -> bool:
    with socket.create_connection((HOST, port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")


def nats_ready(port: int) -> bool:
    with socket.create_connection((HOST, port), timeout=1) as s:
        return s.recv(4096).startswith(b"INFO ")


def redis_peer(tmpdir: Path) -> Peer:
    port = free_port()
    data = tmpdir / "redis"
    data.mkdir()
    argv = [
        "redis-server",
        "--bind", HOST,
        "--port", str(port),
        "--dir", str(data),
        "--appendonly", "yes",
        "--appendfsync", "always",
        "--save", "",
        "--auto-aof-rewrite-percentage", "0",
        "--protected-mode", "no",
        "--daemonize", "no",
        "--logfile", "",
    ]  # fmt: skip
    return Peer("redis", argv, port, redis_ready, tmpdir / "redis.log")


def nats_peer(tmpdir: Path) -> Peer:
    port = free_port()
    argv = ["nats-server", "-a", HOST, "-p", str(port)]
    return Peer("nats", argv, port, nats_ready, tmpdir / "nats.log")


def settle(cpu_s: Callable[[], float], timeout: float = 30.0) -> float:
    """Wait until a server is idle (below 10 % of a core over 0.5 s); seconds waited.

    topicd absorbs what a write metric committed into its segments in the background for
    a while after the load stops; a measurement that started meanwhile would measure that.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        c0 = cpu_s()
        time.sleep(0.5)
        if cpu_s() - c0 < 0.05:
            break
    return time.monotonic() - t0


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "missing"
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else "?"


@contextlib.contextmanager
def profiling(server: hc.Server, name: str, args: argparse.Namespace) -> Iterator[None]:
    """With --profile DIR: py-spy samples topicd over the block into DIR/<name>.txt."""
    if args.profile is None:
        yield
        return
    assert server.proc is not None
    out = args.profile / (f"{name}.txt" if server.name == "topicd" else f"{server.name}-{name}.txt")
    spy = subprocess.Popen(
        [shutil.which("py-spy") or "py-spy", "record", "--pid", str(server.proc.pid),
         "--format", "raw", "--rate", "997", "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output and exits
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
        args.profiles.append(out)


IDLE_LEAF = "get_events (trio/_core/_io_epoll.py"  # the loop waiting in epoll_wait


def by_topicd_frame(profile: Path, top: int = 12) -> list[tuple[str, float]]:
    """(function, share of busy samples): each sample charged to its leaf-most topicd
    frame; samples of the loop idle in `epoll_wait` are left out (their share is listed)."""
    shares: dict[str, int] = {}
    idle = 0
    for line in profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if IDLE_LEAF in frames[-1]:
            idle += int(count)
            continue
        ours = (f for f in reversed(frames) if "(topicd/" in f and "(topicd/cli.py" not in f)
        hit = next(ours, "")
        if not hit:
            trio = any("(trio/" in f for f in frames)
            hit = "trio scheduler (epoll, task switches)" if trio else "other (no topicd frame)"
        hit = re.sub(r":\d+\)$", ")", hit)
        shares[hit] = shares.get(hit, 0) + int(count)
    total = sum(shares.values()) or 1
    ranked = sorted(shares.items(), key=lambda kv: -kv[1])[:top]
    return [(f"(left out: {idle} idle samples in epoll_wait)", 0.0)] + [
        (name, n / total) for name, n in ranked
    ]


def print_profiles(paths: list[Path]) -> None:
    for path in paths:
        if not path.exists() or not path.stat().st_size:
            print(f"profile {path}: empty (is py-spy installed? `pip install py-spy`)")
            continue
        samples = sum(int(x.rpartition(" ")[2]) for x in path.read_text().splitlines())
        print(f"\nprofile {path} ({samples} samples; py-spy attached, so the run is slower)")
        fan = "fanout" in path.name
        rows = by_topicd_frame(path) if fan else write_flood.split(path)
        for stage, share in rows:
            print(f"{100 * share:5.1f} %  {stage}")


# ------------------------------------------------------------------------------------------
# write metrics


def run_client(argv: list[str], env: dict[str, str] | None, timeout: float) -> tuple[str, float]:
    """Run a client to completion; (stdout, its CPU seconds)."""
    cpu0 = children_cpu_s()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    cpu = children_cpu_s() - cpu0
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {out.returncode}: {out.stderr[-1500:]}")
    return out.stdout, cpu


def wrk(url: str, body: Path, conns: int, seconds: float) -> tuple[dict[str, Any], float]:
    argv = [
        "wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
        "-s", str(BENCH_DIR / "lua" / "post.lua"), url,
    ]  # fmt: skip
    stdout, cpu = run_client(argv, dict(os.environ, PEERS_BODY=str(body)), seconds + 60)
    for line in stdout.splitlines():
        if line.startswith("PEERS "):
            return orjson.loads(line[6:]), cpu
    raise RuntimeError(f"wrk printed no PEERS line:\n{stdout[-1500:]}")


def topicd_write(
    server: hc.Server, metric: Metric, topic: str, body: Path, args: argparse.Namespace
) -> dict[str, Any]:
    url = f"http://{HOST}:{server.port}/v0/topics/{topic}"
    wrk(url, body, metric.conns, args.warmup)
    conn = loadgen.BlockingConn(HOST, server.port)
    try:
        fsyncs0 = durable.wal_fsyncs(conn, server.port)
        with profiling(server, topic, args):
            cpu0, sys0, t0 = server.cpu_s(), hc.system_cpu(), time.monotonic()
            res, cli_cpu = wrk(url, body, metric.conns, args.duration)
            wall = time.monotonic() - t0  # wrk's whole life, for the CPU shares
            srv_cpu, sys1 = server.cpu_s() - cpu0, hc.system_cpu()
        fsyncs = durable.wal_fsyncs(conn, server.port) - fsyncs0
        # what the window's records cost in all: the checkpoint keeps absorbing them into
        # segments in the background after the load stops (and steals that CPU from
        # whatever runs next)
        settle(server.cpu_s)
        drained_cpu = server.cpu_s() - cpu0
    finally:
        conn.close()
    window = res["duration_us"] / 1e6  # wrk's own window, for the rates
    n = res["requests"]
    errors = sum(res["errors"].values())
    if n and not fsyncs:  # an `fsync` topic that was never synced measured something else
        errors += 1
        res["errors"]["no_fsync"] = 1
    return {
        "records_per_s": n * metric.batch / window,
        "req_per_s": n / window,
        "p50_ms": res["p50_us"] / 1e3,
        "p99_ms": res["p99_us"] / 1e3,
        "window_s": window,
        "fsyncs": fsyncs,
        "records_per_fsync": n * metric.batch / fsyncs if fsyncs else math.nan,
        "server_cpu_pct": 100 * srv_cpu / wall,
        "server_cpu_us_per_record": 1e6 * srv_cpu / max(1, n * metric.batch),
        "server_cpu_us_per_record_drained": 1e6 * drained_cpu / max(1, n * metric.batch),
        "client_cpu_pct": 100 * cli_cpu / wall,
        "errors": errors,
        "error_detail": res["errors"] if errors else None,
        **hc.other_load(sys1[0] - sys0[0], sys1[1] - sys0[1], srv_cpu, cli_cpu, wall),
    }


def redis_benchmark(port: int, metric: Metric, key: str, n: int) -> tuple[dict[str, Any], float]:
    argv = [
        "redis-benchmark", "-h", HOST, "-p", str(port), "-c", str(metric.conns),
        "-P", str(metric.batch), "-n", str(n), "--csv",
        "XADD", key, "*", "d", record_string().decode(),
    ]  # fmt: skip
    stdout, cpu = run_client(argv, None, 600)
    rows = list(csv.DictReader(io.StringIO(stdout)))
    if not rows or "rps" not in rows[-1]:
        raise RuntimeError(f"redis-benchmark printed no CSV row:\n{stdout[-1500:]}")
    return rows[-1], cpu


def redis_write(peer: Peer, metric: Metric, key: str, args: argparse.Namespace) -> dict[str, Any]:
    # redis-benchmark counts requests, not seconds: a short probe sizes the warm-up to
    # about --warmup seconds, and the warm-up sizes the timed run to about --duration
    guess = {1: 4_000, 64: 50_000}.get(metric.conns, 400_000) if metric.batch == 1 else 400_000
    probe, _ = redis_benchmark(peer.port, metric, key, max(500, guess // 4))
    warm_n = max(500, int(float(probe["rps"]) * args.warmup))
    warm, _ = redis_benchmark(peer.port, metric, key, warm_n)
    n = int(float(warm["rps"]) * args.duration)
    n = max(n - n % max(1, metric.batch * metric.conns), 1000)
    cpu0, sys0 = peer.cpu_s(), hc.system_cpu()
    t0 = time.monotonic()
    row, cli_cpu = redis_benchmark(peer.port, metric, key, n)
    window = time.monotonic() - t0  # the process's wall time, start-up included
    srv_cpu, sys1 = peer.cpu_s() - cpu0, hc.system_cpu()
    rps = float(row["rps"])
    return {
        "records_per_s": rps,
        "req_per_s": rps / metric.batch,
        "p50_ms": float(row["p50_latency_ms"]),
        "p99_ms": float(row["p99_latency_ms"]),
        "window_s": n / rps,
        "server_cpu_pct": 100 * srv_cpu / window,
        "server_cpu_us_per_record": 1e6 * srv_cpu / n,
        "client_cpu_pct": 100 * cli_cpu / window,
        "errors": 0,
        "requests": n,
        **hc.other_load(sys1[0] - sys0[0], sys1[1] - sys0[1], srv_cpu, cli_cpu, window),
    }


# ------------------------------------------------------------------------------------------
# fan-out


def fanout(
    exe: Path,
    kind: str,  # "sse" | "nats"
    port: int,
    server_cpu: Callable[[], float],
    topic: str,
    metric: Metric,
    tmpdir: Path,
    args: argparse.Namespace,
    topicd: hc.Server | None = None,
) -> dict[str, Any]:
    out = tmpdir / f"fan-{kind}-{topic}.txt"
    n = metric.watchers
    warm_n = round(metric.rate * args.fan_warmup)
    count = warm_n + round(metric.rate * args.fan_duration)
    cpu0 = children_cpu_s()
    sub = subprocess.Popen(
        [str(exe), "sub", kind, HOST, str(port), topic, str(n), str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert sub.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(sub.stdout, selectors.EVENT_READ)
        t_setup = time.monotonic()
        if not sel.select(120) or sub.stdout.readline().strip() != b"ready":
            sub.kill()
            err = sub.stderr.read().decode(errors="replace") if sub.stderr else ""
            raise RuntimeError(f"fan-out subscriber ({kind}, {n}) not ready: {err[-1500:]}")
        sel.close()
        setup_s = time.monotonic() - t_setup
        pub_kind = "http" if kind == "sse" else "nats"
        with profiling(topicd, topic, args) if topicd is not None else contextlib.nullcontext():
            srv0, t0, sys0 = server_cpu(), time.monotonic(), hc.system_cpu()
            sub0 = proc_cpu_s(sub.pid)
            pub_out, pub_cpu = run_client(
                [str(exe), "pub", pub_kind, HOST, str(port), topic, str(metric.rate), str(count)],
                None,
                count / metric.rate + 120,
            )
            pub_window = time.monotonic() - t0
            srv_cpu, sys1 = server_cpu() - srv0, hc.system_cpu()
            win_cli_cpu = pub_cpu + proc_cpu_s(sub.pid) - sub0
        time.sleep(args.fan_grace)
        raw_out, raw_err = sub.communicate(b"stop\n", timeout=60)  # its stdin: stop
        sub_out, sub_err = raw_out.decode(), raw_err.decode(errors="replace")
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    cli_cpu = children_cpu_s() - cpu0
    if sub.returncode != 0:
        raise RuntimeError(f"fan-out subscriber exited {sub.returncode}: {sub_err[-1500:]!r}")
    pub = orjson.loads(pub_out.strip().splitlines()[-1])
    counters = orjson.loads(sub_out.strip().splitlines()[-1])
    lat: list[float] = []
    pairs: set[tuple[int, int]] = set()
    received = 0
    with out.open() as f:
        for line in f:
            c, i, ns = line.split()
            if int(i) < warm_n:
                continue
            received += 1
            pairs.add((int(c), int(i)))
            lat.append(float(ns))
    out.unlink()
    lat.sort()
    measured = count - warm_n
    expected = n * measured
    return {
        "watchers": n,
        "events": measured,
        "p50_ms": hc.percentile(lat, 50) / 1e6,
        "p90_ms": hc.percentile(lat, 90) / 1e6,
        "p99_ms": hc.percentile(lat, 99) / 1e6,
        "max_ms": lat[-1] / 1e6 if lat else math.nan,
        "expected_pairs": expected,
        "delivered_pairs": len(pairs),
        "lost_pairs": expected - len(pairs),
        "duplicate_pairs": received - len(pairs),
        "publish_ack_p50_ms": pub["ack_p50_ms"] if kind == "sse" else None,
        "publisher_behind_max_ms": pub["behind_max_ms"],
        "setup_s": setup_s,
        "server_cpu_pct": 100 * srv_cpu / pub_window,
        "server_cpu_us_per_delivery": 1e6 * srv_cpu / max(1, n * count),
        "client_cpu_pct": 100 * cli_cpu / (pub_window + args.fan_grace + setup_s),
        "errors": pub["errors"] + counters["error_lines"] + counters["bad_markers"],
        "streams_closed": counters["closed"],
        **hc.other_load(sys1[0] - sys0[0], sys1[1] - sys0[1], srv_cpu, win_cli_cpu, pub_window),
    }


# ------------------------------------------------------------------------------------------
# report


def ratio_of(metric: Metric, topicd: dict[str, Any], peer: dict[str, Any]) -> float | None:
    key = "records_per_s" if metric.name in ("write1_c64", "batch100_c16") else "p50_ms"
    a, b = topicd.get(key), peer.get(key)
    if a is None or not b or (isinstance(a, float) and math.isnan(a)):
        return None
    return float(a) / float(b)


TARGETS = {
    "write1_c64": (TARGET_C64, ">="),
    "write1_c1": (TARGET_C1_P50, "<="),
    "batch100_c16": (TARGET_BATCH, ">="),
    "fanout_100": (TARGET_FANOUT_P50, "<="),
    "fanout_1000": (TARGET_FANOUT_P50, "<="),
}


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in rounds[0]:
        values = [r.get(key) for r in rounds]
        nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if key in ("errors", "lost_pairs", "duplicate_pairs", "streams_closed"):
            out[key] = sum(nums)
        elif nums and len(nums) == len(values):
            out[key] = statistics.median(nums)
        else:
            out[key] = next((v for v in values if v), values[0])
    return out


def fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}/s"


def fmt_ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.3f} ms"


def evaluate(
    summary: dict[str, dict[str, dict[str, Any]]], per_round: dict[str, list[float]]
) -> list[dict[str, Any]]:
    rows = []
    for m in METRICS:
        per = summary.get(m.name)
        if per is None:
            continue
        t, p = per.get("topicd"), per.get(m.peer)
        of_medians = ratio_of(m, t, p) if t and p else None
        rounds = per_round.get(m.name, [])
        # the headline: the median of the rounds' own ratios (each compares neighbours in
        # time; the host drifts between rounds)
        ratio = statistics.median(rounds) if rounds else None
        goal, op = TARGETS[m.name]
        met = None
        if ratio is not None:
            met = ratio >= goal if op == ">=" else ratio <= goal
            if m.watchers and (t or {}).get("lost_pairs", 0):
                met = False  # a lost delivery fails the fan-out target whatever the p50
        rows.append(
            {
                "metric": m.name,
                "label": m.label,
                "peer": m.peer,
                "ratio": ratio,
                "ratio_of_medians": of_medians,
                "round_ratios": per_round.get(m.name, []),
                "target": f"{op} {goal}",
                "met": met,
            }
        )
    return rows


def print_report(
    info: dict[str, Any],
    command: str,
    settings: dict[str, Any],
    summary: dict[str, dict[str, dict[str, Any]]],
    targets: list[dict[str, Any]],
    skipped: list[str],
) -> None:
    p = print
    p()
    p("== topicd side by side with Redis and NATS (C clients on every side) ==")
    p(f"command : {command}")
    p(
        f"machine : nproc={info['nproc']}, {info['cpu_model']}, {info['implementation']} "
        f"{info['python']}, kernel {info['kernel']}"
    )
    p(
        f"load    : loadavg at start {' '.join(info['loadavg_start'])}, at end "
        f"{' '.join(info['loadavg_end'])}; trio.sleep(0) {info['trio_sleep0_per_s_start']:,.0f}/s"
        " at start (≈ 360,000/s on a quiet machine)"
    )
    d0, d1 = info["fdatasync_p50_us_start"], info["fdatasync_p50_us_end"]
    p(
        f"disk    : fdatasync after a 100-byte append, p50 {d0:.0f} µs at start, {d1:.0f} µs "
        "at end (≈ 140 µs on a quiet machine)"
    )
    p("versions: " + ", ".join(f"{k}: {v}" for k, v in info["peer_versions"].items()))
    p(
        f"topicd  : this checkout at {info['git_commit']}"
        + (" + uncommitted changes" if info["topicd_tree_dirty"] else "")
    )
    p("run     : " + ", ".join(f"{k} {v}" for k, v in settings.items() if k not in ("metrics",)))
    for s in skipped:
        p(f"SKIPPED : {s}")
    p()
    header = f"{'work':<46}{'topicd':>14}{'peer':>22}{'ratio':>9}{'target':>9}  rounds"
    p(header)
    p("-" * len(header))
    by_name = {m.name: m for m in METRICS}
    for row in targets:
        m = by_name[row["metric"]]
        t = summary[m.name].get("topicd") or {}
        pr = summary[m.name].get(m.peer) or {}
        if m.name in ("write1_c64", "batch100_c16"):
            tv, pv = fmt_rate(t.get("records_per_s")), fmt_rate(pr.get("records_per_s"))
        else:
            tv, pv = fmt_ms(t.get("p50_ms")), fmt_ms(pr.get("p50_ms"))
        peer_label = {"redis": "Redis", "nats": "NATS"}[m.peer]
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        mark = {True: "met", False: "MISSED", None: "n/a"}[row["met"]]
        rounds = " ".join(f"{r:.3f}" for r in row["round_ratios"])
        p(
            f"{m.label:<46}{tv:>14}{peer_label + ' ' + pv:>22}{ratio:>9}"
            f"{row['target']:>9}  {rounds}  {mark}"
        )
    p("ratio = topicd / peer (records/s for rates, p50 for latencies): the median of the")
    p("rounds' own ratios (rounds, in order); topicd and peer columns: medians of the rounds.")
    p()
    p("detail (medians)")
    header = (
        f"{'metric':<14}{'system':>8}{'rec/s':>12}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'srv CPU%':>9}{'srv µs/rec':>11}{'cli CPU%':>9}{'other%':>8}{'errors':>7}"
    )
    p(header)
    p("-" * len(header))
    for m in METRICS:
        for system, r in summary.get(m.name, {}).items():
            per_rec = r.get("server_cpu_us_per_record", r.get("server_cpu_us_per_delivery"))
            rate = r.get("records_per_s")
            p(
                f"{m.name:<14}{system:>8}{'-' if rate is None else f'{rate:,.0f}':>12}"
                f"{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['server_cpu_pct']:>9.0f}"
                f"{per_rec:>11.1f}{r['client_cpu_pct']:>9.0f}{r['other_cpu_pct']:>8.0f}"
                f"{r['errors']:>7}"
            )
    per_sync = [
        f"{m.name} {summary[m.name]['topicd']['records_per_fsync']:.1f}"
        for m in METRICS
        if "records_per_fsync" in summary.get(m.name, {}).get("topicd", {})
    ]
    if per_sync:
        p("topicd records per fdatasync (its own counter): " + ", ".join(per_sync))
    drained = [
        f"{m.name} {system} {r['server_cpu_us_per_record_drained']:.2f}"
        for m in METRICS
        for system, r in summary.get(m.name, {}).items()
        if "server_cpu_us_per_record_drained" in r
    ]
    if drained:
        p(
            "server CPU µs per record from the window's start until idle again (the "
            "background absorb included): " + ", ".join(drained)
        )
    p("other% = CPU used by anything but the server and its clients during the window (% of")
    p("one core; the machine is shared): high values mean noise.")
    fan = [m for m in METRICS if m.watchers and m.name in summary]
    if fan:
        p("(fan-out rows: srv µs/rec = server CPU per delivery; rec/s not applicable)")
        p()
        p("fan-out detail (medians; lost and duplicate pairs summed over the rounds)")
        header = (
            f"{'metric':<14}{'system':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}"
            f"{'pairs/round':>12}{'lost':>6}{'dupes':>6}{'ack p50':>9}{'behind':>8}{'setup s':>8}"
        )
        p(header)
        p("-" * len(header))
        for m in fan:
            for system, r in summary[m.name].items():
                ack = r.get("publish_ack_p50_ms")
                p(
                    f"{m.name:<14}{system:>8}{r['p50_ms']:>9.3f}{r['p90_ms']:>9.3f}"
                    f"{r['p99_ms']:>9.3f}{r['max_ms']:>9.3f}{r['expected_pairs']:>12,.0f}"
                    f"{r['lost_pairs']:>6}{r['duplicate_pairs']:>6}"
                    f"{'-' if ack is None else f'{ack:.3f}':>9}"
                    f"{r['publisher_behind_max_ms']:>8.2f}{r['setup_s']:>8.2f}"
                )
        p("ack p50 = the publishing POST's round trip; behind = how late the publisher ran at")
        p("worst against its schedule (ms).")
    p()
    p("targets (issue 14)")
    for row in targets:
        mark = {True: "MET   ", False: "MISSED", None: "n/a   "}[row["met"]]
        ratio = "n/a (peer skipped)" if row["ratio"] is None else f"{row['ratio']:.3f}"
        p(f"  [{mark}] {row['label']}: topicd/{row['peer']} {ratio} (target {row['target']})")


# ------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="topicd vs Redis and NATS, C clients on every side")
    p.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported (3)")
    p.add_argument("--duration", type=float, help="seconds per write window (4)")
    p.add_argument("--warmup", type=float, help="seconds of warm-up per write window (1)")
    p.add_argument("--fan-duration", type=float, help="seconds of measured publishing (5)")
    p.add_argument("--fan-warmup", type=float, help="seconds of publishing before (1)")
    p.add_argument("--fan-grace", type=float, default=1.0, help="seconds for stragglers (1)")
    p.add_argument("--quick", action="store_true", help="a short smoke run (1 round, 1-2 s)")
    p.add_argument(
        "--metrics",
        default=",".join(m.name for m in METRICS),
        help="comma-separated subset of: " + ", ".join(m.name for m in METRICS),
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin servers and clients")
    p.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    p.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample topicd with py-spy (not a project dependency) during its windows into "
        "DIR/<topic>.txt and print the split per stage; the numbers of such a run are slower",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="also measure topicd run from DIR (another checkout) as system `base`, in the "
        "same rounds",
    )
    args = p.parse_args(argv)
    args.profiles = []
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    q = args.quick
    args.duration = args.duration or (1.0 if q else 4.0)
    args.warmup = args.warmup or 1.0
    args.fan_duration = args.fan_duration or (2.0 if q else 5.0)
    args.fan_warmup = args.fan_warmup or (0.5 if q else 1.0)
    if q and "--repeat" not in " ".join(argv or sys.argv[1:]):
        args.repeat = 1
    names = [n.strip() for n in args.metrics.split(",") if n.strip()]
    unknown = set(names) - {m.name for m in METRICS}
    if unknown:
        p.error(f"unknown metrics: {', '.join(sorted(unknown))}")
    args.metric_names = names
    if args.repeat < 1:
        p.error("--repeat must be ≥ 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(sys.orig_argv)
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    srv_cpu = SERVER_CPU if pin else None
    if pin:  # this script and every client it starts stay off the servers' CPU
        os.sched_setaffinity(0, {CLIENT_CPU})
    info = hc.machine_info(REPO_DIR)
    info["peer_versions"] = {
        "redis-server": tool_version(["redis-server", "--version"]),
        "nats-server": tool_version(["nats-server", "--version"]),
        "wrk": tool_version(["wrk", "-v"]),
        "gcc": tool_version(["gcc", "--version"]),
    }
    print(f"loadavg at start: {' '.join(info['loadavg_start'])}", flush=True)

    metrics = [m for m in METRICS if m.name in args.metric_names]
    skipped: list[str] = []
    have = {b: shutil.which(b) is not None for b in ("wrk", "redis-server", "redis-benchmark",
                                                      "nats-server", "gcc")}  # fmt: skip
    if not have["wrk"]:
        skipped.append("write metrics: `wrk` not found (Debian package wrk)")
        metrics = [m for m in metrics if m.watchers]
    if not have["gcc"]:
        skipped.append("fan-out metrics: `gcc` not found (Debian package gcc)")
        metrics = [m for m in metrics if not m.watchers]
    peers_wanted = {m.peer for m in metrics}
    use_redis = "redis" in peers_wanted and have["redis-server"] and have["redis-benchmark"]
    use_nats = "nats" in peers_wanted and have["nats-server"]
    if "redis" in peers_wanted and not use_redis:
        skipped.append(
            "Redis: `redis-server`/`redis-benchmark` not found (Debian package redis-server); "
            "topicd measured alone"
        )
    if "nats" in peers_wanted and not use_nats:
        skipped.append("NATS: `nats-server` not found (Debian package nats-server); topicd alone")
    for s in skipped:
        print(f"SKIPPED: {s}", flush=True)
    if not metrics:
        print("nothing to measure")
        return 1

    settings = {
        "repeat": args.repeat,
        "duration": args.duration,
        "warmup": args.warmup,
        "fan_duration": args.fan_duration,
        "fan_warmup": args.fan_warmup,
        "fan_grace": args.fan_grace,
        "pin": pin,
        "metrics": [m.name for m in metrics],
    }
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {}
    per_round: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="topicd-bench-peers-") as tmp:
        tmpdir = Path(tmp)
        info["fdatasync_p50_us_start"] = durable.fdatasync_probe(tmpdir, 300, False)["p50_us"]
        print(f"fdatasync p50 at start: {info['fdatasync_p50_us_start']:.0f} µs", flush=True)
        fan_exe = tmpdir / "fanout"
        if any(m.watchers for m in metrics):
            subprocess.run(
                ["gcc", "-O2", "-Wall", "-o", str(fan_exe), str(BENCH_DIR / "c" / "fanout.c")],
                check=True,
            )
        bodies = {}
        for batch in {m.batch for m in metrics if not m.watchers}:
            path = tmpdir / f"body-{batch}.json"
            rec = b'{"data":' + record_string() + b"}"
            path.write_bytes(b'{"records":[' + b",".join([rec] * batch) + b"]}")
            bodies[batch] = path
        topicd = hc.topicd_server(tmpdir, REPO_DIR, data="topicd-data")
        base: hc.Server | None = None
        if args.baseline is not None:
            (tmpdir / "base").mkdir()
            base = hc.topicd_server(tmpdir / "base", args.baseline.resolve(), data="data")
            base.name = "base"
        redis = redis_peer(tmpdir) if use_redis else None
        nats = nats_peer(tmpdir) if use_nats else None
        started: list[Any] = []
        try:
            for t in (topicd, base):
                if t is None:
                    continue
                t.start(cpu=srv_cpu)
                started.append(t)
                assert t.proc is not None
                print(f"{t.name} listening on {HOST}:{t.port} (pid {t.proc.pid})")
            for peer in (redis, nats):
                if peer is not None:
                    peer.start(srv_cpu)
                    started.append(peer)
                    print(f"{peer.name} listening on {HOST}:{peer.port} (pid {peer.pid})")
            for t in (topicd, base):
                if t is None:
                    continue
                conn = loadgen.BlockingConn(HOST, t.port)
                try:
                    for r in range(args.repeat):
                        for m in metrics:
                            durability = "ephemeral" if m.watchers else "fsync"
                            hc.put_durability(conn, t.port, topic_name(m, r), durability)
                finally:
                    conn.close()
            for r in range(args.repeat):
                for mi, m in enumerate(metrics):
                    peer = redis if m.peer == "redis" else nats
                    systems = ["topicd"] + (["base"] if base is not None else [])
                    systems += [m.peer] if peer is not None else []
                    shift = (r + mi) % len(systems)  # each system takes each place in turn
                    systems = systems[shift:] + systems[:shift]
                    got: dict[str, dict[str, Any]] = {}
                    for system in systems:
                        name = topic_name(m, r)
                        srv = {"topicd": topicd, "base": base, "redis": redis, "nats": nats}[system]
                        assert srv is not None
                        waited = settle(srv.cpu_s)
                        ours = system in ("topicd", "base")
                        if m.watchers:
                            if ours:
                                assert isinstance(srv, hc.Server)
                                res = fanout(fan_exe, "sse", srv.port, srv.cpu_s, name,
                                             m, tmpdir, args, srv)  # fmt: skip
                            else:
                                assert nats is not None
                                res = fanout(fan_exe, "nats", nats.port, nats.cpu_s, name,
                                             m, tmpdir, args)  # fmt: skip
                        elif ours:
                            assert isinstance(srv, hc.Server)
                            res = topicd_write(srv, m, name, bodies[m.batch], args)
                        else:
                            assert redis is not None
                            res = redis_write(redis, m, name.replace("-", ":"), args)
                        res["round"] = r
                        res["settle_s"] = waited
                        got[system] = res
                        rounds.setdefault(m.name, {}).setdefault(system, []).append(res)
                        extra = (
                            f"lost {res['lost_pairs']}"
                            if m.watchers
                            else f"{res['records_per_s']:,.0f} rec/s"
                        )
                        if "records_per_fsync" in res:
                            extra += f" ({res['records_per_fsync']:.1f} per fdatasync)"
                        print(
                            f"round {r + 1}/{args.repeat} {m.name:<13} {system:<7} {extra}, "
                            f"p50 {res['p50_ms']:.3f} ms, p99 {res['p99_ms']:.3f} ms "
                            f"(server CPU {res['server_cpu_pct']:.0f} %, client "
                            f"{res['client_cpu_pct']:.0f} %, errors {res['errors']}, "
                            f"settled {waited:.1f} s)",
                            flush=True,
                        )
                        time.sleep(0.2)
                    if "topicd" in got and m.peer in got:
                        ratio = ratio_of(m, got["topicd"], got[m.peer])
                        if ratio is not None:
                            per_round.setdefault(m.name, []).append(ratio)
                    if "base" in got and m.peer in got:
                        ratio = ratio_of(m, got["base"], got[m.peer])
                        if ratio is not None:
                            per_round.setdefault(m.name + ":base", []).append(ratio)
                    if "base" in got and "topicd" in got:
                        ratio = ratio_of(m, got["topicd"], got["base"])
                        if ratio is not None:
                            per_round.setdefault(m.name + ":new/base", []).append(ratio)
        finally:
            for s in reversed(started):
                s.stop()
        info["fdatasync_p50_us_end"] = durable.fdatasync_probe(tmpdir, 300, False)["p50_us"]

    summary = {m: {s: median_of(rs) for s, rs in per.items()} for m, per in rounds.items()}
    targets = evaluate(summary, per_round)
    info["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    print_report(info, command, settings, summary, targets, skipped)
    if args.baseline is not None:
        print_baseline(args.baseline, per_round)
    print_profiles(args.profiles)
    if not args.no_json:
        hc.RESULTS_DIR.mkdir(exist_ok=True)
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = hc.RESULTS_DIR / f"peers-{stamp}.json"
        doc = {
            "benchmark": "peers",
            "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": command,
            "machine": info,
            "settings": settings,
            "skipped": skipped,
            "summary": summary,
            "rounds": rounds,
            "targets": targets,
        }
        out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        print(f"\nresults written to {out.relative_to(REPO_DIR)}")
    errors = sum(r["errors"] for per in summary.values() for r in per.values())
    return 1 if errors else 0


def print_baseline(baseline: Path, per_round: dict[str, list[float]]) -> None:
    """The `--baseline` checkout's own ratios to the peer, and this checkout's to it."""
    commit = subprocess.run(
        ["git", "-C", str(baseline), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    print()
    print(f"baseline: topicd from {baseline} at {commit or '?'} (system `base`, same rounds)")
    for m in METRICS:
        for key, what in ((":base", f"base/{m.peer}"), (":new/base", "topicd/base")):
            rs = per_round.get(m.name + key)
            if rs:
                rounds = " ".join(f"{r:.3f}" for r in rs)
                print(f"  {m.name:<13} {what:<12} {statistics.median(rs):.3f}  ({rounds})")


def topic_name(m: Metric, r: int) -> str:
    """Topic names are `[A-Za-z0-9][A-Za-z0-9._:-]*`; NATS subjects take the same."""
    return f"peers-{m.name.replace('_', '-')}-r{r}"


if __name__ == "__main__":
    sys.exit(main())
