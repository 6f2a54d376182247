#!/usr/bin/env python
"""Long retention: memory, checkpoints, restart and reads as retained data grows.

    python bench/retention.py [--gib 1 3 10] [--topics 100000] [--dir DIR]

Against `topicd serve` (a child process on a fresh data directory under `--dir`, the
data disk's file system; default the system temp dir), with the default config:

**Fill** (per `--gib` size, a fresh directory each): 1 KiB records in 1000-record
batches on one keep-alive HTTP/1.1 connection, `disk` class, half of the bytes into one
topic (`big`) and half round-robin over 1,000 topics (`small-N`). Reported: the write
rate of the first and of the last 64 MiB (records/s; a `429` — the checkpoint backlog is
full — is retried after its hint and counted; the first 64 MiB run before any checkpoint,
so the second 64 MiB, the first beside a checkpoint's absorb, is reported too, and the
last 64 MiB's rate as a share of it: the rate at 0 retained in the steady state, where
every 64 MiB written meets about one checkpoint, as the last 64 MiB do; and the rate
over each tenth of the fill, which tells a trend with retention from one slow spell), the
server's RSS at the end and its largest sample while filling (every 0.5 s), the
checkpoints' duration (the median and the longest of those the server's log reported
while filling, and the last one, `topicd_checkpoint_duration_ms`; the 10 GiB fill logs
ten times the 1 GiB fill's checkpoints, so compare medians: the longest of more draws is
longer by itself) and the longest `GET /v0/health` of a probe
every 20 ms on its own connection (an upper bound on the event-loop stalls,
checkpoints' included: a stall delays the probe's answer; the probe also waits behind
the filler's requests, never behind the `/v0/metrics` scrape its own thread makes
after it every 0.5 s), split into the probes that overlapped a checkpoint (its span from
the server's log line) and those that overlapped none: the longest and the p99 of each.
These *probe* numbers are what a client sees, and include the wait behind the filler's
1 MiB writes. Next to them, the server's own measure of each checkpoint (its log line,
`topicd_checkpoint_loop_stall_ms`): the **checkpoint's stall**, the longest single loop
step of the checkpoint's own work (the issue's "checkpoint loop stall"), and the longest
step of any other task meanwhile (typically a write handler), each the largest over
every checkpoint while filling, with the loop thread's CPU time and the collector's time
in it, where it ran (`from A to B`: the awaits that began and ended it; for the other
step, `task at B`); and the longest garbage collection during any checkpoint.
**Reads**: `big` from 100,000 records below its head (the cached tail, pages of 1000),
then from its oldest record after the segment files were dropped from the page cache
(`posix_fadvise(DONTNEED)`), records/s each and their ratio (the tail is read before and
after; the faster run counts). Measurements start after the checkpoint that follows the
fill, so everything written is in segments.
**Restart**: `SIGKILL`, start again, seconds to the first `200` from `/v0/ready`, and the
RSS once ready.

**Many topics** (`--topics N`, 0 to skip): N topics of 3 records of about 100 bytes
(one write each, which creates the topic), then — after the next checkpoint finished (up
to 20 minutes: the first one creates a segment file per topic) — the RSS, the checkpoint
duration, loop lag (probe) and checkpoint stall (server-measured), and the restart to
ready. (bench/many_topics.py measures the same
case in one process: heap per topic by allocation site, and the loop gap during a
checkpoint itself.)

Results print as a table; nothing is asserted (the issue's targets are judged by
reading them). Runs are long at 3 and 10 GiB: the default is `--gib 1`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import durable
import http_core as hc
import loadgen

HOST = hc.HOST
RECORD = 1024
BATCH = 1000
SMALL_TOPICS = 1000
MIB = 1 << 20


class Server:
    """One `topicd serve` child with a metrics sampler."""

    def __init__(self, data_dir: Path, tmp: Path, args: argparse.Namespace) -> None:
        self.data_dir = data_dir
        self.port_file = tmp / "retention.port"
        self.args = args
        self.srv: durable.TimedServer | None = None
        self.conn: loadgen.BlockingConn | None = None
        self.max_lag_ms = 0.0
        self.probes: list[tuple[float, float]] = []  # (monotonic start, ms) of each probe
        self.max_rss_mib = 0.0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def start(self) -> dict[str, Any]:
        self.srv = durable.topicd_server("topicd", self.data_dir, self.port_file, self.args)
        timing = durable.timed_start(self.srv, self.port_file, None)
        self.conn = loadgen.BlockingConn(HOST, self.srv.port)
        self._stop.clear()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return timing

    def kill9(self) -> None:
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(5)
        if self.conn is not None:
            self.conn.close()
        assert self.srv is not None
        self.srv.kill9()

    def stop(self) -> None:
        self._stop.set()
        if self.srv is not None:
            self.srv.stop()

    def rss_mib(self) -> float:
        assert self.srv is not None
        return self.srv.rss_mib()

    def metrics(self, conn: loadgen.BlockingConn | None = None) -> dict[str, float]:
        assert self.srv is not None
        conn = conn or self.conn
        assert conn is not None
        req = loadgen.build_request(HOST, self.srv.port, "/v0/metrics", b"", method="GET")
        _, body = conn.request(req)
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            m = re.match(r"^(topicd_[a-z_]+) ([0-9.e+-]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    @property
    def max_checkpoint_ms(self) -> float:
        """The longest checkpoint the server's log reported (every one of them)."""
        assert self.srv is not None
        return max((ms for _, ms in self.srv.checkpoints), default=0.0)

    @property
    def median_checkpoint_ms(self) -> float:
        """The median checkpoint of those the server's log reported (the typical cost: the
        longest of 165 checkpoints at 10 GiB is the largest of ten times the draws of the
        1 GiB run's 16, so the two maxima do not compare like for like)."""
        assert self.srv is not None
        durations = [ms for _, ms in self.srv.checkpoints]
        return statistics.median(durations) if durations else 0.0

    def _sample(self) -> None:
        """Every 20 ms time a `GET /v0/health` (its latency includes any loop stall);
        every 0.5 s read the RSS (from `/proc`) and scrape `/v0/metrics` (on the same
        connection, after the probe: with 1,001 topics the Prometheus text is itself a
        20-35 ms loop step, which delays the filler's writes but never the probe)."""
        assert self.srv is not None
        conn = loadgen.BlockingConn(HOST, self.srv.port)
        health = loadgen.build_request(HOST, self.srv.port, "/v0/health", b"", method="GET")
        n = 0
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError, ConnectionError):
                t0 = time.monotonic()
                conn.request(health)
                lag_ms = (time.monotonic() - t0) * 1000
                self.max_lag_ms = max(self.max_lag_ms, lag_ms)
                self.probes.append((t0, lag_ms))
                n += 1
                if n % 25 == 0:
                    self.max_rss_mib = max(self.max_rss_mib, self.rss_mib())
                    self.metrics(conn)  # (as a scraper would; the sampler waits for it)
        conn.close()

    def lag_split(self) -> dict[str, float]:
        """The probes that overlapped a checkpoint (from its start, its log line's
        arrival less its duration, to that arrival) and those that overlapped none: the
        longest and the p99 of each, and how many (whether the worst stall is a
        checkpoint's or the loop's other work; the probe also queues behind the filler's
        1 MiB writes)."""
        assert self.srv is not None
        spans = [(t - ms / 1000, t) for t, ms in self.srv.checkpoints]
        during: list[float] = []
        outside: list[float] = []
        for t0, ms in self.probes:
            t1 = t0 + ms / 1000
            (during if any(a < t1 and t0 < b for a, b in spans) else outside).append(ms)
        out: dict[str, float] = {}
        for name, lags in (("checkpoint", during), ("other", outside)):
            lags.sort()
            out[f"lag_{name}_ms"] = lags[-1] if lags else 0.0
            out[f"lag_{name}_p99_ms"] = (
                lags[min(len(lags) - 1, len(lags) * 99 // 100)] if lags else 0.0
            )
            out[f"lag_{name}_n"] = len(lags)
        return out

    def step_max(self) -> dict[str, Any]:
        """The longest loop step the server measured during any checkpoint, its own and
        other tasks' (from each checkpoint's log line), and where each ended."""
        assert self.srv is not None
        steps = self.srv.checkpoint_steps
        own = max(steps, default=(0.0, "-", 0.0, "-"), key=lambda st: st[0])
        other = max(steps, default=(0.0, "-", 0.0, "-"), key=lambda st: st[2])
        return {
            "step_own_ms": own[0],
            "step_own_at": own[1],
            "step_other_ms": other[2],
            "step_other_at": other[3],
            "step_n": len(steps),
            "gc_max": max(self.srv.checkpoint_gcs, default=(0.0, "-")),
            "steps_own_top": sorted(steps, reverse=True)[:5],
            "steps_other_top": sorted(steps, key=lambda st: -st[2])[:3],
        }

    def post(self, path: str, body: bytes, method: str = "POST") -> tuple[int, Any]:
        assert self.srv is not None
        assert self.conn is not None
        req = loadgen.build_request(HOST, self.srv.port, path, body, method=method)
        status, raw = self.conn.request(req)
        return status, orjson.loads(raw) if raw else None


def settle(s: Server, timeout_s: float = 75) -> bool:
    """Wait (at most `timeout_s`) for one more checkpoint: then everything written so far
    is in segments and the payload cache holds what it will. False if none finished."""
    before = s.metrics().get("topicd_checkpoints_total", 0.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.25)
        if s.metrics().get("topicd_checkpoints_total", 0.0) > before:
            return True
    return False


def write_body(n: int, size: int) -> bytes:
    data = b'"' + b"x" * (size - 2) + b'"'
    return b'{"records":[' + b",".join([b'{"data":' + data + b"}"] * n) + b"]}"


def diff_rate(s: Server, topic: str, from_seq: int, records: int) -> float:
    cursor, got = from_seq, 0
    t0 = time.perf_counter()
    while got < records:
        status, res = s.post(f"/v0/topics/{topic}/diff", b'{"from_seq":%d,"limit":1000}' % cursor)
        assert status == 200, res
        got += len(res["records"])
        cursor = res["next_from_seq"]
        if cursor >= res["head_seq"]:
            break
    return got / (time.perf_counter() - t0)


def drop_page_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fill_case(gib: float, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    data_dir = tmp / f"data-{gib}"
    s = Server(data_dir, tmp, args)
    s.start()
    out: dict[str, Any] = {"gib": gib}
    try:
        s.post("/v0/topics/big", b'{"durability":"disk"}', method="PUT")
        for i in range(SMALL_TOPICS):
            s.post(f"/v0/topics/small-{i}", b'{"durability":"disk"}', method="PUT")
        body = write_body(BATCH, RECORD)
        total = int(gib * 1024) * MIB
        written = 0
        i = 0
        window: list[tuple[float, int]] = []
        t_first = None
        throttled = 0
        while written < total:
            topic = "big" if i % 2 == 0 else f"small-{(i // 2) % SMALL_TOPICS}"
            status, res = s.post(f"/v0/topics/{topic}", body)
            if status == 429:  # the checkpoint backlog is full: retry after the hint
                throttled += 1
                time.sleep(res["error"]["detail"]["retry_after_ms"] / 1000)
                continue
            assert status == 200, res
            written += BATCH * RECORD
            i += 1
            window.append((time.perf_counter(), written))
            if t_first is None and written >= 64 * MIB:
                t_first = (window[-1][0] - window[0][0], written)
        first_s, first_b = t_first or (window[-1][0] - window[0][0], written)
        last = [w for w in window if w[1] >= written - 64 * MIB]
        # the second 64 MiB: the first window with a checkpoint absorbing beside the writes
        second = [w for w in window if 64 * MIB <= w[1] <= 128 * MIB]
        out["write_first_rps"] = first_b / RECORD / first_s
        out["write_second_rps"] = (
            (second[-1][1] - second[0][1]) / RECORD / (second[-1][0] - second[0][0])
            if len(second) > 1
            else math.nan
        )
        out["write_last_rps"] = (last[-1][1] - last[0][1]) / RECORD / (last[-1][0] - last[0][0])
        # the rate over each tenth of the fill: a trend with retention, or one slow spell
        tenths = []
        for k in range(10):
            part = [w for w in window if k * total / 10 <= w[1] <= (k + 1) * total / 10]
            if len(part) > 1:
                tenths.append((part[-1][1] - part[0][1]) / RECORD / (part[-1][0] - part[0][0]))
        out["write_tenths_rps"] = tenths
        out["throttled"] = throttled
        settle(s)
        m = s.metrics()
        out["rss_mib"] = s.rss_mib()
        out["rss_max_mib"] = max(s.max_rss_mib, out["rss_mib"])
        out["checkpoint_last_ms"] = m.get("topicd_checkpoint_duration_ms", 0.0)
        out["checkpoint_max_ms"] = s.max_checkpoint_ms
        out["checkpoint_median_ms"] = s.median_checkpoint_ms
        out["loop_lag_max_ms"] = s.max_lag_ms
        out.update(s.lag_split())
        out.update(s.step_max())
        out["cache_mib"] = m.get("topicd_payload_cache_bytes", 0.0) / MIB
        _, st = s.post("/v0/topics/big", b"", method="GET")
        head = st["head_seq"]
        tail = diff_rate(s, "big", max(0, head - 100_000), 100_000)
        drop_page_cache(data_dir / "topics")
        out["diff_oldest_rps"] = diff_rate(s, "big", 0, 100_000)
        tail = max(tail, diff_rate(s, "big", max(0, head - 100_000), 100_000))
        out["diff_tail_rps"] = tail
        s.kill9()
        timing = s.start()
        out["restart_ready_s"] = timing["to_ready_s"]
        out["rss_after_restart_mib"] = s.rss_mib()
    finally:
        s.stop()
    return out


def topics_case(n: int, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    s = Server(tmp / "data-topics", tmp, args)
    s.start()
    out: dict[str, Any] = {"topics": n}
    try:
        rss0 = s.rss_mib()
        body = write_body(3, 100)
        t0 = time.perf_counter()
        for i in range(n):
            status, res = s.post(f"/v0/topics/t{i}", body)
            assert status in (200, 201), res
        out["create_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # (the first checkpoint creates a segment file per topic: minutes at 100,000)
        out["settled"] = settle(s, 1200)
        out["settle_s"] = time.perf_counter() - t0
        m = s.metrics()
        out["rss_mib"] = s.rss_mib()
        out["rss_idle_mib"] = rss0
        out["checkpoint_last_ms"] = m.get("topicd_checkpoint_duration_ms", 0.0)
        out["checkpoint_max_ms"] = s.max_checkpoint_ms
        out["loop_lag_max_ms"] = s.max_lag_ms
        out.update(s.step_max())
        s.kill9()
        timing = s.start()
        out["restart_ready_s"] = timing["to_ready_s"]
        out["rss_after_restart_mib"] = s.rss_mib()
    finally:
        s.stop()
    return out


def print_steps(r: dict[str, Any]) -> None:
    """The checkpoints with the longest own loop steps, and with the longest other ones."""
    for own_ms, own_at, _, _ in r["steps_own_top"]:
        print(f"    checkpoint's own step {own_ms:5.1f} ms {own_at}")
    for _, _, other_ms, other_at in r["steps_other_top"]:
        print(f"    other task's step     {other_ms:5.1f} ms {other_at}")
    gc_ms, gc_what = r["gc_max"]
    print(f"    longest garbage collection during a checkpoint {gc_ms:.1f} ms ({gc_what})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, nargs="*", default=[1.0], help="sizes to fill")
    ap.add_argument("--topics", type=int, default=100_000, help="many-topics case (0: skip)")
    ap.add_argument("--dir", default=None, help="parent of the temporary data directories")
    ap.add_argument("--topicd-src", type=Path, default=hc.REPO_DIR, help=argparse.SUPPRESS)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmpdir:
        tmp = Path(tmpdir)
        for gib in args.gib:
            r = fill_case(gib, tmp, args)
            print(
                f"{r['gib']:5.2f} GiB: write {r['write_first_rps']:,.0f} -> "
                f"{r['write_last_rps']:,.0f} rec/s (second 64 MiB "
                f"{r['write_second_rps']:,.0f}, last / second "
                f"{r['write_last_rps'] / r['write_second_rps']:.2f}x; {r['throttled']} 429s); RSS "
                f"{r['rss_mib']:.0f} MiB, max {r['rss_max_mib']:.0f} MiB while filling "
                f"(cache {r['cache_mib']:.0f} MiB); checkpoint last {r['checkpoint_last_ms']:.0f}"
                f" ms, median {r['checkpoint_median_ms']:.0f} ms, max "
                f"{r['checkpoint_max_ms']:.0f} ms; loop lag max "
                f"{r['loop_lag_max_ms']:.1f} ms (during checkpoints "
                f"{r['lag_checkpoint_ms']:.1f}, p99 {r['lag_checkpoint_p99_ms']:.1f} of "
                f"{r['lag_checkpoint_n']:.0f} probes; outside {r['lag_other_ms']:.1f}, p99 "
                f"{r['lag_other_p99_ms']:.1f} of {r['lag_other_n']:.0f}); checkpoint "
                f"stall (longest own loop step, server-measured, of {r['step_n']} "
                f"checkpoints) {r['step_own_ms']:.1f} ms {r['step_own_at']}, other "
                f"tasks' longest step {r['step_other_ms']:.1f} ms ({r['step_other_at']}); "
                "diff tail "
                f"{r['diff_tail_rps']:,.0f} rec/s, "
                f"oldest (page cache dropped) {r['diff_oldest_rps']:,.0f} rec/s "
                f"({r['diff_oldest_rps'] / r['diff_tail_rps']:.2f}x); restart to ready "
                f"{r['restart_ready_s']:.1f} s, RSS then {r['rss_after_restart_mib']:.0f} MiB",
                flush=True,
            )
            print(
                "    write rate by tenth of the fill (rec/s): "
                + ", ".join(f"{x:,.0f}" for x in r["write_tenths_rps"])
            )
            print_steps(r)
        if args.topics:
            r = topics_case(args.topics, tmp, args)
            settled = (
                f"a checkpoint finished {r['settle_s']:.0f} s later"
                if r["settled"]
                else "no checkpoint finished within 1200 s"
            )
            print(
                f"{r['topics']} topics x 3 records: created in {r['create_s']:.0f} s, "
                f"{settled}; RSS "
                f"{r['rss_mib']:.0f} MiB (idle {r['rss_idle_mib']:.0f}); checkpoint last "
                f"{r['checkpoint_last_ms']:.0f} ms, max {r['checkpoint_max_ms']:.0f} ms; loop "
                f"lag max {r['loop_lag_max_ms']:.1f} ms; checkpoint stall (own longest "
                f"step) {r['step_own_ms']:.1f} ms {r['step_own_at']}, other tasks' "
                f"{r['step_other_ms']:.1f} ms ({r['step_other_at']}); restart to ready "
                f"{r['restart_ready_s']:.1f} s, RSS then {r['rss_after_restart_mib']:.0f} MiB",
                flush=True,
            )
            print_steps(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
