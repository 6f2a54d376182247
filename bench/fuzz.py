#!/usr/bin/env python
"""Long-running raw-socket fuzzing of topicd's HTTP/1.1 path, against a live server.

    python bench/fuzz.py [--duration S] [--idle N] [--workers N] [--header-timeout-ms MS]

Starts `topicd serve` (port 0, a temporary data directory) as a subprocess and fuzzes it
from this process (Trio, raw sockets), for `--duration` seconds (default 1800):

* `--idle` connections (default 10,000) held open the whole run: a third send nothing, a
  third half a head, a third one request and then idle on keep-alive. The server closes
  each at `server.header_read_timeout_ms` (`--header-timeout-ms`, default 60,000 as in
  the server); the holder checks when (never later than the timeout plus `SLACK_S`) and
  reconnects;
* `--workers` fuzzing loops (default 8), each sending one case after another on a new
  connection: mutated heads (bytes flipped, inserted, deleted; fields repeated or
  folded; lengths wrong), request-smuggling framings (Content-Length with
  Transfer-Encoding, repeated lengths, obfuscated codings) with a canary request behind
  them, pipelined writes, bodies shorter or longer than declared, slow-drip heads and
  bodies, half-closed connections, TLS ClientHellos and bare-LF heads;
* a prober process sending `GET /v0/health` every `PROBE_EVERY_S` on one keep-alive
  connection (a process of its own, so the fuzzer's busy loop is not counted as server
  latency).

Invariants (a broken one is printed as it happens; the exit status is 1 if any broke):

* no `5xx` answer but a documented `503`; every error answer is the canonical JSON body;
* no traceback and no `ERROR` line in the server's log;
* no connection kept open past the header timeout plus `SLACK_S` (slow drip, idle);
* pipelined writes answered in order (their seqs increase), or the connection closed;
* a request behind an ambiguous framing never runs (its canary topic never exists);
* `/v0/health` p99 under 100 ms in every `WINDOW_S` window (each window also records the
  server's CPU time and its wait for a CPU, so a window lost to other load shows as such);
* the server's RSS once every connection has closed within 64 MiB of its RSS before.

Results are printed and written as JSON to bench/results/fuzz-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import multiprocessing as mp
import os
import random
import re
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_core import REPO_DIR, RESULTS_DIR, Server  # a sibling module of this script

HOST = "127.0.0.1"
SLACK_S = 5.0  # past the header timeout, a connection still open is a hang
PROBE_EVERY_S = 0.05
WINDOW_S = 10.0
P99_LIMIT_MS = 100.0
RSS_LIMIT_MIB = 64.0
IO_TIMEOUT_S = 30.0  # any single read the fuzzer makes (a guard, never reached when well)
DOCUMENTED_503 = {"not_ready", "shutting_down", "storage_unavailable"}


class LoggedServer(Server):
    """`Server` that also counts tracebacks and error lines in the whole log."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.bad_lines: list[str] = []

    def _drain(self) -> None:
        assert self.proc is not None
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace")
            self.tail.append(line)
            if "listening on" in line:
                self._listening.set()
            if "Traceback" in line or re.search(r"\bERROR\b", line):
                self.bad_lines.append(line.rstrip())


class Stats:
    def __init__(self) -> None:
        self.cases: dict[str, int] = {}
        self.statuses: dict[int, int] = {}
        self.broken: list[str] = []
        self.probe_ms: list[float] = []
        self.windows: list[dict[str, float]] = []
        self.idle_reconnects = 0
        self.idle_closed_late = 0

    def fail(self, what: str) -> None:
        if len(self.broken) < 1000:
            self.broken.append(what)
        print(f"INVARIANT BROKEN: {what}", flush=True)


# ------------------------------------------------------------------------------------------
# reading answers


async def read_all(stream: trio.SocketStream, limit_s: float = IO_TIMEOUT_S) -> tuple[bytes, bool]:
    """Everything until EOF; (bytes, closed) where closed is False when `limit_s` passed."""
    buf = b""
    with trio.move_on_after(limit_s):
        try:
            while data := await stream.receive_some(65536):
                buf += data
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        return buf, True
    return buf, False


def split_answers(buf: bytes) -> tuple[list[tuple[int, bytes, bytes]], bool]:
    """(status, lowered head, body) of each complete answer in `buf`; and whether the
    bytes ended on an answer boundary (False: the last one was cut short)."""
    out = []
    while buf:
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if not sep or not head.startswith(b"HTTP/1.1 "):
            return out, False
        lowered = head.lower()
        m = re.search(rb"\r\ncontent-length: (\d+)", lowered)
        n = int(m.group(1)) if m else 0
        status = int(head[9:12])
        if status < 200:  # an interim answer (`100 Continue`): no body, the real one follows
            buf = rest
            continue
        if len(rest) < n:
            return out, False
        out.append((status, lowered, rest[:n]))
        buf = rest[n:]
    return out, True


def check_answer(stats: Stats, case: str, status: int, head: bytes, body: bytes) -> None:
    stats.statuses[status] = stats.statuses.get(status, 0) + 1
    if b"x-topicd-pressure: " not in head:
        stats.fail(f"{case}: an answer without the pressure header: {head[:120]!r}")
    if status < 400:
        return
    try:
        err = orjson.loads(body)["error"]
        code = err["code"]
        if not (isinstance(code, str) and isinstance(err["message"], str)):
            raise TypeError(code)
    except (ValueError, KeyError, TypeError):
        stats.fail(f"{case}: {status} without the canonical error body: {body[:200]!r}")
        return
    if status >= 500 and not (status == 503 and code in DOCUMENTED_503):
        stats.fail(f"{case}: {status} {code}: {body[:200]!r}")


# ------------------------------------------------------------------------------------------
# cases

H = b"Host: x\r\n"
JSON = b"Content-Type: application/json\r\n"
LINES = [
    b"GET /v0/topics HTTP/1.1",
    b"GET /v0/health HTTP/1.1",
    b"POST /v0/topics/fz HTTP/1.1",
    b"POST /v0/topics/fz/diff HTTP/1.1",
    b"PUT /v0/topics/fz HTTP/1.1",
    b"GET /v0/topics/fz HTTP/1.0",
    b"DELETE /v0/nowhere HTTP/1.1",
]  # (no HEAD: its answer's length says what a GET would send, and no body follows)
FIELDS = [
    b"Content-Length: 2",
    b"Content-Length: 0",
    b"Content-Length: 99",
    b"Transfer-Encoding: chunked",
    b"Connection: close",
    b"Expect: 100-continue",
    b"X-Pad: " + b"p" * 300,
    b" folded",
    b"Authorization: Bearer nope",
]
BODIES = [b"", b"{}", b'{"records":[{"data":1}]}', b'{"from_seq":0}', b"0\r\n\r\n", b"{"]
SMUGGLING = [
    b"Content-Length: {n}\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: {n}\r\n",
    b"Content-Length: {n}\r\nTransfer-Encoding: identity, chunked\r\n",
    b"Content-Length: {n}\r\nTransfer-Encoding : chunked\r\n",
    b"Content-Length: {n}\r\nTransfer-Encoding:\r\n chunked\r\n",
    b"Content-Length: {n}\r\nTransfer-Encoding: xchunked\r\n",
    b"Content-Length: 5\r\nContent-Length: {n}\r\n",
    b"Content-Length: 5, {n}\r\n",
    b"Content-Length: {n}\nTransfer-Encoding: chunked\r\n",
]
CLIENT_HELLO = bytes.fromhex("1603010200010001fc0303") + os.urandom(32) + b"\x00" * 64


def mutated(rng: random.Random) -> bytes:
    lines = [rng.choice(LINES), b"Host: x", b"Content-Type: application/json"]
    lines += rng.choices(FIELDS, k=rng.randint(0, 4))
    raw = bytearray(b"\r\n".join(lines) + b"\r\n\r\n" + rng.choice(BODIES))
    for _ in range(rng.randint(0, 3)):
        at = rng.randint(0, len(raw))
        byte = rng.choice([0x00, 0x0A, 0x0D, 0x20, 0x09, 0x3A, 0x7F, 0xFF, 0x16, 0x41])
        op = rng.choice(["flip", "insert", "delete"])
        if op == "insert":
            raw[at:at] = bytes([byte])
        elif at < len(raw):
            if op == "flip":
                raw[at] = byte
            else:
                del raw[at]
    return bytes(raw)


class Fuzzer:
    def __init__(self, port: int, stats: Stats, header_timeout_s: float, seed: int) -> None:
        self.port = port
        self.stats = stats
        self.header_timeout_s = header_timeout_s
        self.seed = seed
        self.canaries = 0

    async def connect(self) -> trio.SocketStream:
        return await trio.open_tcp_stream(HOST, self.port)

    async def exchange(self, case: str, raw: bytes, *, half_close: bool = True) -> list:
        """Send `raw` on a new connection (then half-close), read to EOF, check answers."""
        stream = await self.connect()
        try:
            try:
                await stream.send_all(raw)
                if half_close:
                    await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # refused before the client finished sending: the answer may follow
            buf, closed = await read_all(stream, self.header_timeout_s + SLACK_S)
        finally:
            await stream.aclose()
        if not closed:
            self.stats.fail(f"{case}: still open {self.header_timeout_s + SLACK_S:.0f} s on")
        answers, _whole = split_answers(buf)  # (a half-close may cut Hypercorn's last one)
        for status, head, body in answers:
            check_answer(self.stats, case, status, head, body)
        return answers

    async def case_mutated(self, rng: random.Random) -> None:
        await self.exchange("mutated", mutated(rng))

    async def case_smuggle(self, rng: random.Random) -> None:
        self.canaries += 1
        name = b"smuggled-%d-%d" % (self.seed, self.canaries)
        canary = b"PUT /v0/topics/%s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n" % name
        body = b"0\r\n\r\n" + canary
        framing = rng.choice(SMUGGLING).replace(b"{n}", b"%d" % len(body))
        raw = b"POST /v0/topics/fz HTTP/1.1\r\n" + H + JSON + framing + b"\r\n" + body + canary
        answers = await self.exchange("smuggle", raw, half_close=rng.random() < 0.5)
        if any(status < 400 for status, _h, _b in answers[:1]):
            self.stats.fail(f"smuggle: an ambiguous framing was served: {raw[:160]!r}")
        # the canary must not exist
        stream = await self.connect()
        try:
            await stream.send_all(b"GET /v0/topics/%s HTTP/1.1\r\n%s\r\n" % (name, H))
            await stream.send_eof()
            buf, _closed = await read_all(stream)
        finally:
            await stream.aclose()
        answers, _ = split_answers(buf)
        if not answers or answers[0][0] != 404:
            self.stats.fail(f"smuggle: the request behind {framing!r} ran")

    async def case_pipeline(self, rng: random.Random) -> None:
        n = rng.randint(2, 20)
        body = b'{"records":[{"data":1}]}'
        one = (
            b"POST /v0/topics/fzp HTTP/1.1\r\n"
            + H
            + JSON
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        raw = one * n
        stream = await self.connect()
        try:
            at = 0
            while at < len(raw):  # in random pieces
                cut = min(len(raw), at + rng.randint(1, 400))
                await stream.send_all(raw[at:cut])
                at = cut
            await stream.send_eof()
            buf, closed = await read_all(stream)
        finally:
            await stream.aclose()
        answers, _ = split_answers(buf)
        seqs = []
        for status, head, ans in answers:
            check_answer(self.stats, "pipeline", status, head, ans)
            if status in (200, 201):
                seqs.append(orjson.loads(ans)["seqs"][0])
        if seqs != sorted(seqs) or len(set(seqs)) != len(seqs):
            self.stats.fail(f"pipeline: answers out of order: {seqs}")
        if len(answers) > n or (not closed and len(answers) < n):
            self.stats.fail(f"pipeline: {len(answers)} answers to {n} requests")

    async def case_lengths(self, rng: random.Random) -> None:
        body = b'{"records":[{"data":1}]}'
        declared = len(body) + rng.choice([-5, -1, 1, 5, 100])
        raw = (
            b"POST /v0/topics/fzl HTTP/1.1\r\n"
            + H
            + JSON
            + b"Content-Length: %d\r\n\r\n" % max(declared, 0)
        )
        await self.exchange("lengths", raw + body)

    async def case_garbage(self, rng: random.Random) -> None:
        raw = rng.choice(
            [
                CLIENT_HELLO,
                b"GET /v0/topics HTTP/1.1\nHost: x\n\n",
                os.urandom(rng.randint(1, 200)),
                b"GET /v0/topics HTTP/1.1\r\nX-Big: " + b"b" * 20_000 + b"\r\n\r\n",
            ]
        )
        await self.exchange("garbage", raw, half_close=False)

    async def case_slow(self, rng: random.Random) -> None:
        """A head (or a body) dripped a byte a second: cut off by the header timeout."""
        if rng.random() < 0.5:
            start, drip = b"GET /v0/topics HTTP/1.1\r\nX-Slow: ", b"s"
        else:
            start = b"POST /v0/topics/fzs HTTP/1.1\r\n" + H + JSON + b"Content-Length: 900\r\n\r\n{"
            drip = b" "
        stream = await self.connect()
        t0 = trio.current_time()
        try:
            await stream.send_all(start)
            limit = self.header_timeout_s + SLACK_S
            with trio.move_on_after(limit) as scope:
                while True:
                    with trio.move_on_after(1.0):
                        data = await stream.receive_some(65536)
                        if not data:
                            break  # closed
                        continue  # an answer (a refusal or 400): the close follows
                    try:
                        await stream.send_all(drip)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        break
            if scope.cancelled_caught:
                self.stats.fail(f"slow: still open {trio.current_time() - t0:.1f} s on")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    async def worker(self, wid: int, until: float) -> None:
        rng = random.Random(self.seed * 1000 + wid)
        cases = [
            (self.case_mutated, 40),
            (self.case_smuggle, 15),
            (self.case_pipeline, 10),
            (self.case_lengths, 10),
            (self.case_garbage, 10),
            (self.case_slow, 1),
        ]
        funcs, weights = zip(*cases, strict=True)
        while trio.current_time() < until:
            case = rng.choices(funcs, weights)[0]
            name = case.__name__.removeprefix("case_")
            self.stats.cases[name] = self.stats.cases.get(name, 0) + 1
            try:
                await case(rng)
            except OSError as exc:
                self.stats.fail(f"{name}: could not connect: {exc}")
                await trio.sleep(1.0)

    async def idle_holder(self, kind: int, until: float, ready: trio.Semaphore | None) -> None:
        """One idle connection for the whole run, reopened whenever the server closes it."""
        first = True
        while trio.current_time() < until:
            try:
                stream = await self.connect()
            except OSError as exc:
                self.stats.fail(f"idle: could not connect: {exc}")
                await trio.sleep(1.0)
                continue
            t0 = trio.current_time()
            try:
                if kind == 1:
                    await stream.send_all(b"GET /v0/topics HTTP/1.1\r\nHo")
                elif kind == 2:
                    await stream.send_all(b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
                if first and ready is not None:
                    first = False
                    ready.release()
                with trio.move_on_after(max(0.0, until - trio.current_time())):
                    buf, closed = await read_all(stream, self.header_timeout_s + SLACK_S)
                    if not closed:
                        self.stats.idle_closed_late += 1
                        self.stats.fail(
                            f"idle: open {trio.current_time() - t0:.1f} s past its last request"
                        )
                    for status, head, body in split_answers(buf)[0]:
                        check_answer(self.stats, "idle", status, head, body)
                    self.stats.idle_reconnects += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                await stream.aclose()


def schedstat_ms(path: str) -> tuple[float, float]:
    """(CPU time, time runnable but waiting for a CPU) of a thread so far, in ms, from
    its `schedstat` file; zeros when it cannot be read."""
    try:
        with open(path) as f:
            cpu_ns, wait_ns, _slices = f.read().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(cpu_ns) / 1e6, int(wait_ns) / 1e6


def load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def probe_main(port: int, duration: float, server_pid: int, conn: Any) -> None:
    """The prober, in its own process (blocking sockets): `GET /v0/health` every
    `PROBE_EVERY_S` on one keep-alive connection; sends back (latencies in ms, one dict
    per `WINDOW_S` window, errors). Apart from the fuzzer, so a busy fuzzer loop never
    shows up as server latency.

    Each window records, besides its p99, how long the server's event-loop thread ran
    and how long it was runnable but waiting for a CPU (`/proc/<pid>/task/<pid>/schedstat`),
    the same wait for the prober itself, and the load average: a slow window in which the
    server waited seconds for a CPU says the machine was busy, not the server."""
    import socket

    latencies: list[float] = []
    windows: list[dict[str, float]] = []
    errors: list[str] = []
    window: list[float] = []
    server_stat = f"/proc/{server_pid}/task/{server_pid}/schedstat"
    own_stat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
    server0, own0 = schedstat_ms(server_stat), schedstat_ms(own_stat)
    until = time.monotonic() + duration
    window_end = time.monotonic() + WINDOW_S
    sock: socket.socket | None = None
    request = b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n"
    while time.monotonic() < until:
        t0 = time.perf_counter()
        try:
            if sock is None:
                sock = socket.create_connection((HOST, port), timeout=IO_TIMEOUT_S)
                t0 = time.perf_counter()
            sock.sendall(request)
            buf = b""
            while True:
                answers, whole = split_answers(buf)
                if answers and whole:
                    break
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("closed")
                buf += data
        except OSError as exc:
            errors.append(f"probe: {exc!r}")
            if sock is not None:
                sock.close()
            sock = None
            time.sleep(PROBE_EVERY_S)
            continue
        ms = (time.perf_counter() - t0) * 1000
        status, head, _body = answers[0]
        if status != 200 or b"x-topicd-pressure: " not in head:
            errors.append(f"probe: {status} {head[:100]!r}")
        latencies.append(ms)
        window.append(ms)
        if time.monotonic() >= window_end:
            server1, own1 = schedstat_ms(server_stat), schedstat_ms(own_stat)
            windows.append(
                {
                    "p99_ms": round(percentile(window, 99), 1),
                    "max_ms": round(max(window), 1),
                    "server_cpu_ms": round(server1[0] - server0[0]),
                    "server_runq_ms": round(server1[1] - server0[1]),
                    "prober_runq_ms": round(own1[1] - own0[1]),
                    "load1": load1(),
                }
            )
            server0, own0 = server1, own1
            window = []
            window_end = time.monotonic() + WINDOW_S
        time.sleep(PROBE_EVERY_S)
    if sock is not None:
        sock.close()
    conn.send((latencies, windows, errors))
    conn.close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


async def fuzz(args: argparse.Namespace, server: LoggedServer, stats: Stats) -> dict[str, Any]:
    fz = Fuzzer(server.port, stats, args.header_timeout_ms / 1000, args.seed)
    rss0 = server.rss_mib()
    until = trio.current_time() + args.duration
    print(f"server RSS at start {rss0:.1f} MiB; opening {args.idle} idle connections", flush=True)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    assert server.proc is not None
    prober = ctx.Process(
        target=probe_main, args=(server.port, args.duration, server.proc.pid, there), daemon=True
    )
    prober.start()
    async with trio.open_nursery() as nursery:
        ready = trio.Semaphore(0)
        for start in range(0, args.idle, 100):  # in batches: the listen backlog is finite
            batch = range(start, min(args.idle, start + 100))
            for i in batch:
                nursery.start_soon(fz.idle_holder, i % 3, until, ready)
            for _ in batch:
                await ready.acquire()
        print(
            f"{args.idle} idle connections open; server RSS {server.rss_mib():.1f} MiB", flush=True
        )
        for wid in range(args.workers):
            nursery.start_soon(fz.worker, wid, until)
        last = trio.current_time()
        while trio.current_time() < until:
            # (the prober's windows arrive at the end; this line shows the load so far)
            await trio.sleep(min(30.0, max(0.0, until - trio.current_time())))
            if trio.current_time() - last >= 30.0 or trio.current_time() >= until:
                last = trio.current_time()
                elapsed = args.duration - (until - trio.current_time())
                print(
                    f"t={elapsed:.0f}s cases={sum(stats.cases.values())} "
                    f"server CPU={server.cpu_s():.0f} s rss={server.rss_mib():.1f} MiB "
                    f"broken={len(stats.broken)}",
                    flush=True,
                )
    latencies, windows, errors = await trio.to_thread.run_sync(here.recv)
    prober.join(10)
    stats.probe_ms = latencies
    stats.windows = windows
    for err in errors:
        stats.fail(err)
    for i, w in enumerate(windows):
        if w["p99_ms"] >= P99_LIMIT_MS:
            stats.fail(
                f"probe: /v0/health p99 {w['p99_ms']:.1f} ms in window {i} ({WINDOW_S:.0f} s;"
                f" server ran {w['server_cpu_ms']:.0f} ms and waited {w['server_runq_ms']:.0f}"
                f" ms for a CPU, the prober waited {w['prober_runq_ms']:.0f} ms;"
                f" load {w['load1']:.1f})"
            )
    # every connection is closed now; let the server settle, then compare its RSS
    rss_peak = server.rss_mib()
    await trio.sleep(5.0)
    rss1 = server.rss_mib()
    if rss1 - rss0 > RSS_LIMIT_MIB:
        stats.fail(f"rss: {rss1:.1f} MiB after all connections closed, {rss0:.1f} at start")
    return {"rss_start_mib": rss0, "rss_end_mib": rss1, "rss_at_end_of_load_mib": rss_peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds (default 1800)")
    p.add_argument("--idle", type=int, default=10_000, help="idle connections (default 10000)")
    p.add_argument("--workers", type=int, default=8, help="fuzzing loops (default 8)")
    p.add_argument(
        "--header-timeout-ms", type=int, default=60_000, help="server.header_read_timeout_ms"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--topicd-src", type=Path, default=REPO_DIR, metavar="DIR", help="the checkout to run"
    )
    p.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    args = p.parse_args(argv)

    # both processes hold one descriptor per connection
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.idle + 1000
    if hard != resource.RLIM_INFINITY and hard < need:
        print(f"needs {need} file descriptors; the hard limit is {hard}", file=sys.stderr)
        return 2
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))

    stats = Stats()
    with tempfile.TemporaryDirectory(prefix="topicd-fuzz-") as tmp:
        tmpdir = Path(tmp)
        port_file = tmpdir / "topicd.port"
        env = dict(
            os.environ,
            TOPICD_PORT_FILE=str(port_file),
            TOPICD_HEADER_READ_TIMEOUT_MS=str(args.header_timeout_ms),
        )
        argv_ = [sys.executable, "-m", "topicd", "serve", "--port", "0", "--data-dir"]
        server = LoggedServer(
            "topicd", [*argv_, str(tmpdir / "data")], env, port_file, args.topicd_src
        )
        server.start()
        t0 = time.monotonic()
        try:
            rss = trio.run(fuzz, args, server, stats)
        finally:
            server.stop()
    for line in server.bad_lines:
        stats.fail(f"log: {line}")
    result = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "elapsed_s": round(time.monotonic() - t0, 1),
        "cases": stats.cases,
        "statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
        "idle_reconnects": stats.idle_reconnects,
        "probes": len(stats.probe_ms),
        "probe_p50_ms": round(percentile(stats.probe_ms, 50), 2),
        "probe_p99_ms": round(percentile(stats.probe_ms, 99), 2),
        "worst_window_p99_ms": max((w["p99_ms"] for w in stats.windows), default=math.nan),
        "windows": stats.windows,
        **{k: round(v, 1) for k, v in rss.items()},
        "broken": stats.broken,
    }
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    for i, w in enumerate(stats.windows):
        print(
            f"window {i:3d}: p99 {w['p99_ms']:7.1f} ms  max {w['max_ms']:7.1f} ms  server CPU"
            f" {w['server_cpu_ms']:5.0f} ms, waited {w['server_runq_ms']:5.0f} ms  prober waited"
            f" {w['prober_runq_ms']:5.0f} ms  load {w['load1']:5.2f}"
        )
    if not args.no_json:
        RESULTS_DIR.mkdir(exist_ok=True)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        (RESULTS_DIR / f"fuzz-{stamp}.json").write_bytes(
            orjson.dumps(result, option=orjson.OPT_INDENT_2)
        )
    print("OK: no invariant broken" if not stats.broken else f"{len(stats.broken)} BROKEN")
    return 1 if stats.broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
