#!/usr/bin/env python
"""HTTP core benchmark: topicd against a framework floor, in one run.

    python bench/http_core.py [--duration S] [--quick] [--only topicd|floor] [--repeat N]

Starts two servers as subprocesses:

* topicd: `python -m topicd serve --port 0 --data-dir <tmp>/data` with
  `TOPICD_PORT_FILE=<tmp>/topicd.port` (ready once its stderr says "listening on");
* the floor (bench/floor_app.py): a bare quart-trio app on Hypercorn's Trio worker with
  the same two routes, which only parses the JSON body and answers (the write route with
  a seq counter, the diff route with a pre-built 1000-record response of topicd's shape),
  so it measures framework + parse + answer and nothing else.

Load comes from separate processes (bench/loadgen.py, a raw-socket HTTP/1.1 keep-alive
client; see its docstring for why not httpx). The server under test gets about one of the
machine's two cores. Metrics, against both servers:

* `write_c1`: single-record write-ack latency at concurrency 1 (p50/p99);
* `write_b{1,100,1000}_c16`: write throughput at concurrency 16 (records/s, requests/s);
* `diff_c1`, `diff_c16`: diff reads with `limit` 1000 and random `from_seq` against a topic
  pre-filled with `--diff-records` (≥ 100k) records, so every response is full.

Each throughput figure counts the responses completed in a fixed window after a warm-up.
With `--repeat N` every metric is measured N times, the two servers back to back with
the first one alternating, and the median is reported. Server CPU (from /proc) and
client CPU (each load process's own CPU time) over each window are reported too: the
client must stay well below one core per process or it is the bottleneck.

Results are printed and written as JSON to bench/results/http_core-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import math
import multiprocessing as mp
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # a sibling module of this script

HOST = "127.0.0.1"
BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

WRITE_RECORD = {"data": {"room": "lab-2", "celsius": 21.4}}
DIFF_TOPIC = "bench-diff"
DIFF_LIMIT = 1000
CLK_TCK = os.sysconf("SC_CLK_TCK")

TARGET_P50_RATIO = 1.5
TARGET_BATCH_RPS = 300_000
TARGET_DIFF_RPS = 400_000


def sample_data(i: int) -> dict[str, Any]:
    """The payload of pre-filled record `i` (also used for the floor's canned diff)."""
    return {"room": f"lab-{i % 8}", "celsius": round(18.0 + (i % 97) / 10, 1)}


def write_body(batch: int) -> bytes:
    return orjson.dumps({"records": [WRITE_RECORD] * batch})


def synth_diff_response(topic: str, first_seq: int, n: int, head: int) -> bytes:
    """A diff response laid out byte for byte like topicd's (api-topics §7.3)."""
    ts = int(time.time() * 1000)
    records = b",".join(
        orjson.dumps({"$seq": s, "$ts": ts, "data": sample_data(s - 1)})
        for s in range(first_seq, first_seq + n)
    )
    last = first_seq + n - 1
    tail = b'],"next_from_seq":%d,"head_seq":%d,"earliest_seq":1,"caught_up":false,' % (last, head)
    tail += b'"tombstone":null,"lag":%d,"performance":' % (head - last)
    tail += b'{"server_total_ms":0.5,"records_scanned":%d}}' % n
    return b'{"topic":' + orjson.dumps(topic) + b',"records":[' + records + tail


# ------------------------------------------------------------------------------------------
# servers


def topicd_server(tmpdir: Path, cwd: Path, data: str = "data") -> Server:
    """`topicd serve` on port 0 with its data in `tmpdir/data`, run from `cwd` (the
    checkout whose `topicd` is measured); the port comes back through a port file."""
    port_file = tmpdir / "topicd.port"
    argv = [sys.executable, "-m", "topicd", "serve", "--port", "0", "--data-dir"]
    env = dict(os.environ, TOPICD_PORT_FILE=str(port_file))
    return Server("topicd", [*argv, str(tmpdir / data)], env, port_file, cwd)


class Server:
    """A server subprocess, ready once its stderr says "listening on"."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], port_file: Path, cwd: Path
    ) -> None:
        self.name = name
        self.cwd = cwd
        self.argv = argv
        self.env = env
        self.port_file = port_file
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.tail: deque[str] = deque(maxlen=40)
        self._listening = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 60.0, cpu: int | None = None) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        if cpu is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.proc.pid, {cpu})
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} did not start (exit {self.proc.poll()}):\n" + "".join(self.tail)
                )
        while not self.port_file.exists() or not self.port_file.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no port file {self.port_file}")
            time.sleep(0.01)
        self.port = int(self.port_file.read_text())

    def _drain(self) -> None:
        assert self.proc is not None
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:  # keeps the pipe from filling up for the whole run
            line = raw.decode("utf-8", "replace")
            self.tail.append(line)
            if "listening on" in line:
                self._listening.set()

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process (all threads) so far."""
        assert self.proc is not None
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# ------------------------------------------------------------------------------------------
# load-generator processes


class Workers:
    def __init__(self, n: int, cpu: int | None) -> None:
        ctx = mp.get_context("spawn")
        self.pipes: list[Any] = []
        self.procs: list[Any] = []
        for _ in range(n):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=loadgen.worker_main, args=(there, cpu), daemon=True)
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)

    @staticmethod
    def recv(pipe: Any, timeout: float) -> Any:
        if not pipe.poll(timeout):
            raise RuntimeError(f"load generator silent for {timeout:.0f} s")
        msg = pipe.recv()
        if isinstance(msg, dict) and "fatal" in msg:
            raise RuntimeError(f"load generator failed: {msg['fatal']}")
        return msg

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def system_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, summed over all CPUs."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


def other_load(busy: float, steal: float, server: float, client: float, window: float) -> dict:
    """CPU % used during a window by neither the server nor the load generators."""
    return {
        "other_cpu_pct": max(0.0, 100 * (busy - server - client) / window),
        "steal_pct": 100 * steal / window,
    }


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return math.nan
    k = max(0, math.ceil(p / 100 * len(sorted_values)) - 1)
    return sorted_values[k]


def run_latency(
    workers: Workers, server: Server, reqs: list[bytes], kind: str, records: int, args: Any
) -> dict[str, Any]:
    pipe = workers.pipes[0]
    pipe.send(
        {
            "mode": "latency",
            "kind": kind,
            "host": HOST,
            "port": server.port,
            "requests": reqs,
            "records_per_request": records,
            "warmup": args.lat_warmup,
            "requests_n": args.lat_requests,
        }
    )
    msg = workers.recv(pipe, 120)
    assert msg == "mark", msg
    cpu0, sys0 = server.cpu_s(), system_cpu()
    res = workers.recv(pipe, 600)
    server_cpu = server.cpu_s() - cpu0
    sys1 = system_cpu()
    lat = sorted(res["latencies"])
    n, window = res["count"], res["window_s"]
    return {
        "requests": n,
        "p50_ms": percentile(lat, 50) * 1e3,
        "p99_ms": percentile(lat, 99) * 1e3,
        "p999_ms": percentile(lat, 99.9) * 1e3,
        "mean_ms": statistics.fmean(lat) * 1e3,
        "req_per_s": n / window,
        "records_per_s": n * records / window,
        "server_cpu_pct": 100 * server_cpu / window,
        "server_cpu_us_per_req": 1e6 * server_cpu / n,
        "client_cpu_pct": 100 * res["cpu_s"] / window,
        "client_cpu_max_pct": 100 * res["cpu_s"] / window,
        "reconnects": res["reconnects"],
        "errors": res["errors"],
        "first_error": res["first_error"],
        **other_load(
            sys1[0] - sys0[0], sys1[1] - sys0[1], server_cpu, res["cpu_s"], res["window_s"]
        ),
    }


def run_throughput(
    workers: Workers,
    server: Server,
    reqs_for: Any,
    kind: str,
    records: int,
    conc: int,
    args: Any,
) -> dict[str, Any]:
    nproc = min(len(workers.pipes), conc)
    pipes = workers.pipes[:nproc]
    for i, pipe in enumerate(pipes):
        conns = conc // nproc + (1 if i < conc % nproc else 0)
        pipe.send(
            {
                "mode": "throughput",
                "kind": kind,
                "host": HOST,
                "port": server.port,
                "requests": reqs_for(i),
                "records_per_request": records,
                "conns": conns,
                "validate_every": 50,
            }
        )
    for pipe in pipes:
        msg = workers.recv(pipe, 120)
        assert msg == "ready", msg
    t_warm = time.monotonic() + 0.05
    t_start = t_warm + args.warmup
    t_end = t_start + args.duration
    for pipe in pipes:
        pipe.send((t_warm, t_start, t_end))
    time.sleep(max(0.0, t_start - time.monotonic()))
    cpu0, sys0 = server.cpu_s(), system_cpu()
    time.sleep(max(0.0, t_end - time.monotonic()))
    server_cpu = server.cpu_s() - cpu0
    sys1 = system_cpu()
    results = [workers.recv(pipe, args.duration + 120) for pipe in pipes]
    count = sum(r["count"] for r in results)
    lat = sorted(x for r in results for x in r["latencies"])
    window = args.duration
    errors = sum(r["errors"] for r in results)
    first_error = next((r["first_error"] for r in results if r["first_error"]), None)
    return {
        "requests": count,
        "req_per_s": count / window,
        "records_per_s": count * records / window,
        "p50_ms": percentile(lat, 50) * 1e3,
        "p99_ms": percentile(lat, 99) * 1e3,
        "bytes_per_response": sum(r["bytes"] for r in results) / count if count else 0,
        "server_cpu_pct": 100 * server_cpu / window,
        "server_cpu_us_per_req": 1e6 * server_cpu / count if count else math.nan,
        "client_cpu_pct": 100 * sum(r["cpu_s"] for r in results) / window,
        "client_cpu_max_pct": 100 * max(r["cpu_s"] for r in results) / window,
        "client_procs": nproc,
        "reconnects": sum(r["reconnects"] for r in results),
        "errors": errors,
        "first_error": first_error,
        **other_load(
            sys1[0] - sys0[0],
            sys1[1] - sys0[1],
            server_cpu,
            sum(r["cpu_s"] for r in results),
            window,
        ),
    }


# ------------------------------------------------------------------------------------------
# metrics

# (name, label, mode, kind, batch, concurrency); concurrency None = --concurrency
METRICS: list[tuple[str, str, str, str, int, int | None]] = [
    ("write_c1", "write 1 rec, c=1", "latency", "write", 1, 1),
    ("write_b1_c16", "write 1 rec, c=16", "throughput", "write", 1, None),
    ("write_b100_c16", "write 100 rec, c=16", "throughput", "write", 100, None),
    ("write_b1000_c16", "write 1000 rec, c=16", "throughput", "write", 1000, None),
    ("diff_c1", "diff 1000, c=1", "throughput", "diff", DIFF_LIMIT, 1),
    ("diff_c16", "diff 1000, c=16", "throughput", "diff", DIFF_LIMIT, None),
]


def topic_for(metric: str, round_no: int) -> str:
    """Topic names are `[A-Za-z0-9][A-Za-z0-9._:-]*`: no underscores."""
    if metric.startswith("diff"):
        return DIFF_TOPIC
    return f"bench-{metric.replace('_', '-')}-r{round_no}"


def diff_requests(port: int, seed: int, n_records: int) -> list[bytes]:
    rng = random.Random(seed)
    path = f"/v0/topics/{DIFF_TOPIC}/diff"
    return [
        loadgen.build_request(
            HOST,
            port,
            path,
            orjson.dumps({"from_seq": rng.randrange(0, n_records - DIFF_LIMIT + 1), "limit": 1000}),
        )
        for _ in range(512)
    ]


def measure(
    workers: Workers, server: Server, metric: tuple[Any, ...], round_no: int, args: Any
) -> dict[str, Any]:
    name, _label, mode, kind, batch, conc = metric
    conc = conc or args.concurrency
    if kind == "write":
        path = f"/v0/topics/{topic_for(name, round_no)}"
        reqs = [loadgen.build_request(HOST, server.port, path, write_body(batch))]

        def reqs_for(i: int) -> list[bytes]:
            return reqs
    else:
        reqs = diff_requests(server.port, round_no * 1000, args.diff_records)

        def reqs_for(i: int) -> list[bytes]:
            return diff_requests(server.port, round_no * 1000 + i + 1, args.diff_records)

    if mode == "latency":
        return run_latency(workers, server, reqs, kind, batch, args)
    return run_throughput(workers, server, reqs_for, kind, batch, conc, args)


def prefill(server: Server, n_records: int, durability: str | None) -> dict[str, Any]:
    """Write `n_records` records to the diff topic in batches of 1000."""
    conn = loadgen.BlockingConn(HOST, server.port)
    try:
        if durability:
            put_durability(conn, server.port, DIFF_TOPIC, durability)
        path = f"/v0/topics/{DIFF_TOPIC}"
        t0 = time.perf_counter()
        for start in range(0, n_records, 1000):
            n = min(1000, n_records - start)
            body = orjson.dumps({"records": [{"data": sample_data(start + i)} for i in range(n)]})
            status, resp = conn.request(loadgen.build_request(HOST, server.port, path, body))
            if status not in (200, 201):
                raise RuntimeError(f"prefill of {server.name}: HTTP {status}: {resp[:300]!r}")
        elapsed = time.perf_counter() - t0
        probe = orjson.dumps({"from_seq": 0, "limit": DIFF_LIMIT})
        status, resp = conn.request(loadgen.build_request(HOST, server.port, path + "/diff", probe))
        obj = orjson.loads(resp)
        if status != 200 or len(obj["records"]) != DIFF_LIMIT or obj["head_seq"] < n_records:
            raise RuntimeError(f"prefill check of {server.name} failed: {resp[:300]!r}")
        return {"records": n_records, "seconds": elapsed, "records_per_s": n_records / elapsed}
    finally:
        conn.close()


def put_durability(conn: loadgen.BlockingConn, port: int, topic: str, durability: str) -> None:
    head = (
        f"PUT /v0/topics/{topic} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
    )
    body = orjson.dumps({"durability": durability})
    status, resp = conn.request(head.replace("{n}", str(len(body))).encode() + body)
    if status not in (200, 201):
        raise RuntimeError(f"PUT {topic}: HTTP {status}: {resp[:300]!r}")


# ------------------------------------------------------------------------------------------
# report


def speed_probe() -> float:
    """`trio.sleep(0)` per second in this process (perf-baseline.md measured ≈ 360k/s).

    A cheap check of how fast the (shared) machine is right now: absolute targets only
    mean something when this is near the baseline.
    """
    import trio

    async def spin() -> float:
        t0 = time.perf_counter()
        for _ in range(50_000):
            await trio.sleep(0)
        return 50_000 / (time.perf_counter() - t0)

    return trio.run(spin)


def machine_info(topicd_src: Path) -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for dist in ("topicd", "trio", "hypercorn", "quart", "quart-trio", "h11", "orjson"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    commit = dirty = None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(
            ["git", "-C", str(topicd_src), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(topicd_src), "status", "--porcelain", "--", "topicd"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
        "trio_sleep0_per_s_start": speed_probe(),
        "versions": versions,
        "git_commit": commit,
        "topicd_tree_dirty": dirty,
    }


# which number is the headline of each metric, and whether lower is better
HEADLINES: list[tuple[str, str, str, bool]] = [
    ("write_c1", "p50_ms", "write 1 rec c=1  p50 ms", True),
    ("write_c1", "p99_ms", "write 1 rec c=1  p99 ms", True),
    ("write_c1", "req_per_s", "write 1 rec c=1  req/s", False),
    ("write_b1_c16", "req_per_s", "write 1 rec c=16  req/s", False),
    ("write_b1_c16", "p50_ms", "write 1 rec c=16  p50 ms", True),
    ("write_b100_c16", "records_per_s", "write 100 rec c=16  rec/s", False),
    ("write_b100_c16", "req_per_s", "write 100 rec c=16  req/s", False),
    ("write_b1000_c16", "records_per_s", "write 1000 rec c=16  rec/s", False),
    ("write_b1000_c16", "req_per_s", "write 1000 rec c=16  req/s", False),
    ("diff_c1", "records_per_s", "diff 1000 c=1  rec/s", False),
    ("diff_c16", "records_per_s", "diff 1000 c=16  rec/s", False),
    ("diff_c16", "req_per_s", "diff 1000 c=16  req/s", False),
]


def fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int | float) and abs(value) >= 1000:
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of every number over the rounds; errors and reconnects are summed."""
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        if key == "round":
            continue
        if key in ("errors", "reconnects"):
            out[key] = sum(values)
        elif all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = next((v for v in values if v), values[0])
    return out


def evaluate_targets(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    def get(metric: str, server: str, key: str) -> float | None:
        value = summary.get(metric, {}).get(server, {}).get(key)
        return None if value is None else float(value)

    targets = []
    t, f = get("write_c1", "topicd", "p50_ms"), get("write_c1", "floor", "p50_ms")
    ratio = t / f if t is not None and f else None
    targets.append(
        {
            "target": f"write c=1 p50 ≤ {TARGET_P50_RATIO}× floor p50",
            "value": ratio,
            "shown": f"{ratio:.2f}×" if ratio is not None else "needs both servers",
            "met": None if ratio is None else ratio <= TARGET_P50_RATIO,
        }
    )
    for metric, goal, text in (
        ("write_b1000_c16", TARGET_BATCH_RPS, "batched writes (1000 rec, c=16)"),
        ("diff_c1", TARGET_DIFF_RPS, "diff reads, c=1"),
        ("diff_c16", TARGET_DIFF_RPS, "diff reads, c=16"),
    ):
        value = get(metric, "topicd", "records_per_s")
        targets.append(
            {
                "target": f"{text} ≥ {goal:,} records/s",
                "value": value,
                "shown": f"{value:,.0f} rec/s ({value / goal:.0%} of target)"
                if value is not None
                else "topicd not measured",
                "met": None if value is None else value >= goal,
            }
        )
    return targets


def print_report(
    info: dict[str, Any],
    command: str,
    summary: dict[str, dict[str, Any]],
    servers: list[str],
    targets: list[dict[str, Any]],
    extra: dict[str, Any],
) -> None:
    p = print
    p()
    p("== topicd HTTP core benchmark ==")
    p(f"command : {command}")
    p(
        f"machine : nproc={info['nproc']} (affinity {info['affinity']}), {info['cpu_model']}, "
        f"{info['implementation']} {info['python']}, kernel {info['kernel']}, "
        f"loadavg at start {' '.join(info['loadavg_start'])}"
    )
    p(
        f"speed   : trio.sleep(0) {info['trio_sleep0_per_s_start']:,.0f}/s at start, "
        f"{info['trio_sleep0_per_s_end']:,.0f}/s at end (perf-baseline.md: ≈ 360,000/s; "
        "well below it, absolute numbers are low)"
    )
    p("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    p(
        f"topicd  : {extra['topicd_src']} at {info['git_commit']}"
        + (" + uncommitted changes" if info["topicd_tree_dirty"] else "")
    )
    p(
        f"run     : duration {extra['duration']} s + warm-up {extra['warmup']} s per "
        f"throughput window, {extra['lat_requests']} latency requests after "
        f"{extra['lat_warmup']}, concurrency {extra['concurrency']} over "
        f"{extra['client_procs']} client processes, repeat {extra['repeat']} (median), "
        f"durability {extra['durability'] or 'server default'}"
    )
    if "prefill" in extra:
        pf = extra["prefill"]
        p(
            f"prefill : {pf['records']:,} records into {DIFF_TOPIC} in "
            f"{pf['seconds']:.2f} s ({pf['records_per_s']:,.0f} rec/s, 1 connection)"
        )
    p()
    both = "topicd" in servers and "floor" in servers
    header = f"{'metric':<28}" + "".join(f"{s:>14}" for s in servers)
    if both:
        header += f"{'slowdown':>11}"
    p(header)
    p("-" * len(header))
    for metric, key, label, lower_better in HEADLINES:
        if metric not in summary:
            continue
        vals = [summary[metric].get(s, {}).get(key) for s in servers]
        line = f"{label:<28}" + "".join(f"{fmt(v):>14}" for v in vals)
        if both:
            t, f = vals
            if t and f:
                ratio = t / f if lower_better else f / t
                line += f"{ratio:>10.2f}×"
        p(line)
    if both:
        p(
            "slowdown = how many times worse topicd is than the floor: topicd/floor for "
            "latencies,\n           floor/topicd for rates (1.00 = parity, > 1 = topicd slower)."
        )
    p()
    p("load check (CPU % of one core over each window; a client process near 100 % would be")
    p("the bottleneck; other% = CPU used on the machine by anything else: noise)")
    header = (
        f"{'metric':<18}{'server':>8}{'srv CPU%':>10}{'srv µs/req':>12}"
        f"{'cli CPU%':>10}{'max/proc%':>11}{'other%':>8}{'resp B':>9}{'reconn':>8}"
        f"{'errors':>8}"
    )
    p(header)
    p("-" * len(header))
    warn = []
    noisy: set[str] = set()
    for metric, per in summary.items():
        for s in servers:
            r = per.get(s)
            if r is None:
                continue
            p(
                f"{metric:<18}{s:>8}{r['server_cpu_pct']:>10.0f}"
                f"{fmt(r['server_cpu_us_per_req']):>12}{r['client_cpu_pct']:>10.0f}"
                f"{r['client_cpu_max_pct']:>11.0f}{r['other_cpu_pct']:>8.0f}"
                f"{fmt(r.get('bytes_per_response')):>9}"
                f"{r['reconnects']:>8}{r['errors']:>8}"
            )
            if r["errors"]:
                warn.append(f"{metric}/{s}: {r['errors']} errors, first: {r['first_error']}")
            if r["client_cpu_max_pct"] > 85 and metric != "write_c1":
                warn.append(f"{metric}/{s}: a client process used {r['client_cpu_max_pct']:.0f} %")
            if r["other_cpu_pct"] > 25:
                noisy.add(s)
    if noisy:
        warn.append(
            "other processes used > 25 % of a core during some windows: the machine was "
            "shared, absolute numbers are low; compare the back-to-back ratios"
        )
    for w in warn:
        p(f"WARNING {w}")
    p()
    p("targets")
    for t in targets:
        mark = {True: "MET   ", False: "MISSED", None: "n/a   "}[t["met"]]
        p(f"  [{mark}] {t['target']}: {t['shown']}")


# ------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="topicd vs framework-floor HTTP benchmark")
    p.add_argument("--duration", type=float, help="seconds per throughput window (default 5)")
    p.add_argument("--warmup", type=float, help="seconds of warm-up per window (default 1)")
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--only", choices=("topicd", "floor"), help="measure one server")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the median is reported")
    p.add_argument("--concurrency", type=int, default=16, help="connections for c=16 runs")
    p.add_argument("--client-procs", type=int, default=2, help="load-generator processes")
    p.add_argument("--lat-requests", type=int, help="timed c=1 requests (default 2000)")
    p.add_argument("--lat-warmup", type=int, help="c=1 warm-up requests (default 300)")
    p.add_argument("--diff-records", type=int, default=100_000, help="diff topic pre-fill")
    p.add_argument(
        "--durability",
        choices=("ephemeral", "memory", "disk", "fsync"),
        help="PUT this durability on topicd's bench topics first (default: server default)",
    )
    p.add_argument(
        "--pin", action="store_true", help="pin servers to CPU 0 and load generators to CPU 1"
    )
    p.add_argument(
        "--topicd-src",
        type=Path,
        default=REPO_DIR,
        metavar="DIR",
        help="directory holding the topicd package to run (its cwd for `python -m topicd`; "
        "default: this checkout), e.g. a `git worktree` of another commit",
    )
    p.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    args = p.parse_args(argv)
    quick = args.quick
    if args.duration is None:
        args.duration = 1.0 if quick else 5.0
    if args.warmup is None:
        args.warmup = 0.5 if quick else 1.0
    if args.lat_requests is None:
        args.lat_requests = 500 if quick else 2000
    if args.lat_warmup is None:
        args.lat_warmup = 100 if quick else 300
    if args.diff_records < DIFF_LIMIT:
        p.error(f"--diff-records must be at least {DIFF_LIMIT}")
    if args.repeat < 1:
        p.error("--repeat must be ≥ 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(sys.orig_argv)
    info = machine_info(args.topicd_src)
    names = [args.only] if args.only else ["topicd", "floor"]
    srv_cpu = 0 if args.pin else None
    cli_cpu = 1 if args.pin else None
    servers: dict[str, Server] = {}
    workers: Workers | None = None
    extra: dict[str, Any] = {
        k: getattr(args, k)
        for k in (
            "duration",
            "warmup",
            "lat_requests",
            "lat_warmup",
            "concurrency",
            "client_procs",
            "repeat",
            "durability",
            "diff_records",
            "pin",
        )
    }
    extra["topicd_src"] = str(args.topicd_src)
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="topicd-bench-") as tmp:
        tmpdir = Path(tmp)
        try:
            workers = Workers(args.client_procs, cli_cpu)
            if "topicd" in names:
                servers["topicd"] = topicd_server(tmpdir, args.topicd_src)
            if "floor" in names:
                canned = tmpdir / "diff-body.json"
                canned.write_bytes(
                    synth_diff_response(
                        DIFF_TOPIC, 50_001, DIFF_LIMIT, args.diff_records
                    )  # mid-topic page
                )
                servers["floor"] = Server(
                    "floor",
                    [
                        sys.executable,
                        str(BENCH_DIR / "floor_app.py"),
                        "--port",
                        "0",
                        "--port-file",
                        str(tmpdir / "floor.port"),
                        "--diff-body",
                        str(canned),
                    ],
                    dict(os.environ),
                    tmpdir / "floor.port",
                    REPO_DIR,
                )
            for server in servers.values():
                server.start(cpu=srv_cpu)
                print(f"{server.name} listening on {HOST}:{server.port} (pid {server.proc.pid})")
            if "topicd" in servers:
                topicd = servers["topicd"]
                print(f"pre-filling {DIFF_TOPIC} on topicd with {args.diff_records:,} records…")
                extra["prefill"] = prefill(topicd, args.diff_records, args.durability)
                if args.durability:
                    conn = loadgen.BlockingConn(HOST, topicd.port)
                    try:
                        for r in range(args.repeat):
                            for m in METRICS:
                                if m[3] == "write":
                                    put_durability(
                                        conn, topicd.port, topic_for(m[0], r), args.durability
                                    )
                    finally:
                        conn.close()
            for r in range(args.repeat):
                for mi, metric in enumerate(METRICS):
                    order = list(servers.values())
                    if (r + mi) % 2:
                        order.reverse()
                    for server in order:
                        res = measure(workers, server, metric, r, args)
                        res["round"] = r
                        res["server_rss_mib"] = server.rss_mib()
                        rounds.setdefault(metric[0], {}).setdefault(server.name, []).append(res)
                        headline = (
                            f"p50 {res['p50_ms']:.3f} ms p99 {res['p99_ms']:.3f} ms"
                            if metric[2] == "latency"
                            else f"{res['records_per_s']:,.0f} rec/s {res['req_per_s']:,.0f} req/s"
                        )
                        print(
                            f"round {r + 1}/{args.repeat} {metric[0]:<16} {server.name:<7} "
                            f"{headline}  (server CPU {res['server_cpu_pct']:.0f} %, "
                            f"client {res['client_cpu_pct']:.0f} %, errors {res['errors']})",
                            flush=True,
                        )
                        time.sleep(0.2)
        finally:
            if workers is not None:
                workers.close()
            for server in servers.values():
                server.stop()

    summary = {m: {s: median_of(rs) for s, rs in per.items()} for m, per in rounds.items()}
    targets = evaluate_targets(summary)
    info["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    info["trio_sleep0_per_s_end"] = speed_probe()
    print_report(info, command, summary, names, targets, extra)
    if not args.no_json:
        RESULTS_DIR.mkdir(exist_ok=True)
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = RESULTS_DIR / f"http_core-{stamp}.json"
        doc = {
            "benchmark": "http_core",
            "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": command,
            "machine": info,
            "settings": extra,
            "summary": summary,
            "rounds": rounds,
            "targets": targets,
            "slowdown_definition": "topicd/floor for latencies, floor/topicd for rates",
        }
        out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        print(f"\nresults written to {out.relative_to(REPO_DIR)}")
    errors = sum(r["errors"] for per in summary.values() for r in per.values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
