#!/usr/bin/env python
"""SSE fan-out benchmark: topicd's watch stream against a framework floor, in one run.

    python bench/sse_fanout.py [--quick] [--repeat N] [--only topicd|floor] [--ws]
                               [--scenario a|flood|b|all|a,flood] [--ns 1,100,1000]

Servers (subprocesses, started like bench/http_core.py does, with its `Server` class):

* topicd: `python -m topicd serve --port 0 --data-dir <tmp>/data` with
  `TOPICD_PORT_FILE`; the bench topics are created `ephemeral` first
  (`PUT /v0/topics/<t>` `{"durability": "ephemeral"}`) so no disk is measured;
* the floor (bench/sse_floor_app.py): quart-trio on Hypercorn's Trio worker with the same
  routes, which per write parses the body, encodes one frame of topicd's shape and
  `send_nowait`s it into every stream's bounded channel; each stream task forwards its
  channel to the ASGI `send`. It measures framework fan-out and nothing else.

Clients are separate processes (spawned once, driven over Pipes):

* **watchers** (`--watch-procs`, default 4): each holds its share of the N SSE
  connections (`POST /v0/watch` `{"topics": {t: {"tail": true}}}` then `GET
  /v0/watch/<wid>`) on raw non-blocking sockets under one `epoll` loop (no httpx: see
  bench/loadgen.py). It undoes the chunked transfer coding, splits SSE blocks at `\\n\\n`,
  parses every `record` frame's `data:` with orjson and stamps its receive time with
  `time.monotonic_ns()` right after `recv`. A measurement starts once every connection
  has had its `caught-up` frame;
* a **paced writer**: single-record `POST /v0/topics/<t>` on one keep-alive connection
  at a fixed rate on an absolute schedule (write i at `t0 + i / rate`: no drift, no
  jitter from the previous ack). Each record carries its send time, `"t":
  time.monotonic_ns()` taken just before the request is written;
* for the flood, bench/loadgen.py throughput workers (closed loop, max rate).

With `--ws`, scenario A also measures topicd's WebSocket plane (`ws` in the report),
against the same topicd server in the same rounds: each watcher connection is a
`GET /v0/ws` upgrade that sends `{"op": "subscribe", "topic": t, "tail": true}`; the
client (wsproto) decodes the frames and accounts `record` / `caught_up` / `tombstone`
messages exactly as the SSE ones. Reported: the ws/sse p50 and p99 ratios (median of
per-round ratios), with the target ws p50 ≤ 1.2 × sse p50 at 100 and 1000 watchers.

Clock: CLOCK_MONOTONIC is one system-wide clock on Linux, so write→deliver latency is
`receive time - t` for every (watcher, record) pair, with the sender and receiver in
different processes. Only records whose `t` falls in the measured window count (a warm-up
comes first); a watcher keeps reading for a grace period after the window.

Scenarios:

* **a** (fan-out latency): for N in `--ns` (1, 100, 1000) watchers of one topic the
  writer posts `--rate` writes/s for `--warmup` + `--duration` s. The default rate is
  20/s, but 2/s at N=1000 (`--rate 20,1000:2`): a fan-out costs the server one socket
  send per watcher per frame, and on this machine a Hypercorn server (the floor as much
  as topicd) tops out near 20,000 sends/s (see the flood), so 20 writes/s to 1000
  watchers saturates both servers and the "latency" becomes queueing (the writer falls
  behind its schedule: reported as `write_rate_pct` and warned about). `--rate 20`
  measures the issue's literal setting anyway. Reported per server:
  write→deliver p50/p90/p99/p99.9/max over all (watcher, record) pairs; the p50 of the
  *first* and of the *last* watcher to get each record (the spread of one fan-out);
  the write's own ack p50 (a publisher held up by the fan-out shows here); delivered
  pairs / expected pairs (N × records written in the window); and topicd/floor ratios.
* **flood** (fan-out throughput): 100 watchers (`--flood-watchers`) while
  `--flood-conc` (8) closed-loop connections write single records as fast as the server
  takes them: deliveries/s = records received, summed over watchers, with a receive time
  inside the window; writes/s; keep-up = deliveries / (N × writes).
* **b** (stalled watchers, topicd only: the floor has no lag handling): 100 healthy
  watchers, with and without 10 stalled ones (`SO_RCVBUF` `--stall-rcvbuf` set before
  connect; they read the response head and then never read the socket again), while the
  writer posts `--b-rate` (100) writes/s of `--b-record-bytes` (1024) B records for
  `--b-warmup` + `--b-duration` (8 + 20) s, long enough for the stalled connections'
  socket buffers and topicd's per-connection channel to fill. The topic has a
  `cap_records` (`--b-cap`) and is pre-filled to it so that retention itself is flat. Pairs
  run back to back (without, then with). Reported: the healthy watchers' p50/p99 without
  and with, and the server's RSS (`VmRSS` from /proc, sampled every 0.5 s) over each
  run, with the kernel bytes queued on the stalled connections (server `tx_queue` +
  client `rx_queue`, from /proc/net/tcp) to show that they did stall. At the end the
  stalled sockets are drained for 2 s to see what topicd does with them (closed? a
  tombstone for records evicted meanwhile?).

Every window also reports the server's CPU (/proc/<pid>/stat), every client process's own
CPU over the window (a watcher process near 100 % would be the bottleneck), and the CPU
used by anything else on the machine (it is shared). With `--repeat N` each measurement
is taken N times, the two servers back to back with the first one alternating; medians
are reported, and ratios are medians of the per-round ratios.

Results are printed and written as JSON to bench/results/sse_fanout-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import multiprocessing as mp
import os
import resource
import select
import shlex
import socket
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
import http_core as hc  # a sibling module: Server, Workers, CPU accounting, report helpers
import loadgen

HOST = hc.HOST
BENCH_DIR = hc.BENCH_DIR
REPO_DIR = hc.REPO_DIR
RESULTS_DIR = hc.RESULTS_DIR
percentile = hc.percentile

TOPIC_A = "bench"
TOPIC_B = "bench-stall"
HEARTBEAT_MS = 15000
BASE_DATA = b'"room":"lab-2","celsius":21.4'  # the record's payload next to its send time "t"

TARGET_RATIO = 1.25  # topicd p50 ≤ 1.25 × floor p50 at 100 and 1000 watchers
TARGET_WS_RATIO = 1.2  # WebSocket p50 ≤ 1.2 × SSE p50 at 100 and 1000 watchers
TARGET_P50_MS_100 = 10.0  # topicd p50 < 10 ms at 100 watchers
RSS_FLAT_MIB = 8.0  # heuristic: "flat" = grew less than this over the stalled run


# ==========================================================================================
# client side (runs in the spawned worker processes)


def create_watch(conn: loadgen.BlockingConn, port: int, topic: str) -> str:
    body = orjson.dumps({"topics": {topic: {"tail": True}}, "heartbeat_ms": HEARTBEAT_MS})
    status, resp = conn.request(loadgen.build_request(HOST, port, "/v0/watch", body))
    if status not in (200, 201):
        raise RuntimeError(f"POST /v0/watch: HTTP {status}: {resp[:300]!r}")
    return orjson.loads(resp)["wid"]


def open_stream(port: int, wid: str, rcvbuf: int = 0) -> tuple[socket.socket, bytes]:
    """Connect, send the GET and read the response head; (socket, bytes after the head)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect
    sock.settimeout(30)
    sock.connect((HOST, port))
    sock.sendall(
        f"GET /v0/watch/{wid} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        "Accept: text/event-stream\r\n\r\n".encode("ascii")
    )
    buf = b""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"stream {wid}: closed before the response head")
        buf += chunk
    head = buf[:end].lower()
    if buf[9:12] != b"200":
        sock.close()
        raise RuntimeError(f"GET /v0/watch/{wid}: {buf[:400]!r}")
    if b"\r\ntransfer-encoding: chunked" not in head:
        sock.close()
        raise RuntimeError(f"GET /v0/watch/{wid}: expected a chunked body: {head!r}")
    return sock, buf[end + 4 :]


def open_ws(port: int, topic: str) -> tuple[socket.socket, Any, bytes]:
    """Connect, upgrade `/v0/ws` and subscribe at the tail; (socket, wsproto connection,
    bytes after the handshake answer)."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, RejectConnection, Request, TextMessage

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect((HOST, port))
    ws = WSConnection(ConnectionType.CLIENT)
    sock.sendall(ws.send(Request(host=f"{HOST}:{port}", target="/v0/ws")))
    accepted = False
    while not accepted:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("/v0/ws: closed during the handshake")
        ws.receive_data(chunk)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                accepted = True
            elif isinstance(event, RejectConnection):
                raise RuntimeError(f"/v0/ws: refused with HTTP {event.status_code}")
    sub = orjson.dumps({"op": "subscribe", "topic": topic, "tail": True}).decode()
    sock.sendall(ws.send(TextMessage(data=sub)))
    return sock, ws, b""


class Tally:
    """What the connections of one process received; latencies of in-window records."""

    def __init__(self) -> None:
        self.t0 = self.t1 = 1 << 62  # the window (ns, monotonic); none until set
        self.lat = array("q")  # receive - send, ns
        self.seqs = array("q")
        self.window_records = 0  # records with a receive time in the window
        self.records = self.frames = self.bytes = 0
        self.heartbeats = self.caught_up = self.tombstones = self.error_frames = 0
        self.gaps = self.gap_records = self.dupes = self.closed = 0
        self.errors = 0
        self.first_error: str | None = None

    def error(self, msg: str) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = msg


class SseConn:
    """One stream: chunked-coding decoder + SSE block splitter + frame accounting."""

    __slots__ = ("caught_up", "chunk_left", "crlf", "ended", "last_seq", "raw", "sock", "sse")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.raw = bytearray()
        self.sse = bytearray()
        self.chunk_left = 0
        self.crlf = False
        self.ended = False
        self.caught_up = False
        self.last_seq: int | None = None

    def feed(self, data: bytes, now: int, tally: Tally) -> None:
        raw = self.raw
        raw += data
        sse = self.sse
        pos, n = 0, len(raw)
        while pos < n:
            if self.chunk_left:
                take = min(self.chunk_left, n - pos)
                sse += raw[pos : pos + take]
                pos += take
                self.chunk_left -= take
                if self.chunk_left:
                    break
                self.crlf = True
            if self.crlf:
                if n - pos < 2:
                    break
                pos += 2
                self.crlf = False
                continue
            nl = raw.find(b"\r\n", pos)
            if nl < 0:
                break
            size = int(raw[pos:nl].split(b";", 1)[0], 16)
            pos = nl + 2
            if size == 0:
                self.ended = True
                break
            self.chunk_left = size
        del raw[:pos]
        start = 0
        while (end := sse.find(b"\n\n", start)) >= 0:
            self.block(bytes(sse[start:end]), now, tally)
            start = end + 2
        if start:
            del sse[:start]

    def record(self, obj: dict[str, Any], nbytes: int, now: int, tally: Tally) -> None:
        """Account one `record` frame/message: the cursor chain, counts, latencies."""
        fs = obj["from_seq"]
        last = self.last_seq
        if last is not None and fs != last:
            if fs > last:
                tally.gaps += 1
                tally.gap_records += fs - last
            else:
                tally.dupes += 1
        self.last_seq = obj["to_seq"]
        recs = obj["records"]
        tally.frames += 1
        tally.records += len(recs)
        tally.bytes += nbytes
        t0, t1 = tally.t0, tally.t1
        if t0 <= now < t1:
            tally.window_records += len(recs)
        for r in recs:
            d = r.get("data")
            t = d.get("t", 0) if isinstance(d, dict) else 0
            if t0 <= t < t1:
                tally.lat.append(now - t)
                tally.seqs.append(r["$seq"])

    def block(self, blk: bytes, now: int, tally: Tally) -> None:
        if blk[:1] == b":":
            tally.heartbeats += 1
            return
        event = b"message"
        data = None
        for line in blk.split(b"\n"):
            if line[:6] == b"data: ":
                data = line[6:]
            elif line[:7] == b"event: ":
                event = line[7:]
            elif line[:1] == b":":
                tally.heartbeats += 1
        if data is None:
            return  # `retry:` alone
        if event == b"record":
            self.record(orjson.loads(data), len(blk), now, tally)
        elif event == b"caught-up":
            self.caught_up = True
            tally.caught_up += 1
            if self.last_seq is None:
                self.last_seq = orjson.loads(data)["head_seq"]
        elif event == b"tombstone":
            tally.tombstones += 1
            self.last_seq = orjson.loads(data)["gap_to"]
        else:
            tally.error_frames += 1
            tally.error(f"{event.decode()} frame: {data[:300]!r}")


class WsConn(SseConn):
    """One `/v0/ws` connection: wsproto decodes the frames; messages are accounted as
    the SSE frames are."""

    __slots__ = ("text", "ws")

    def __init__(self, sock: socket.socket, ws: Any) -> None:
        super().__init__(sock)
        self.ws = ws
        self.text: list[str] = []

    def feed(self, data: bytes, now: int, tally: Tally) -> None:
        from wsproto.events import CloseConnection, TextMessage

        self.ws.receive_data(data)
        for event in self.ws.events():
            if isinstance(event, TextMessage):
                self.text.append(event.data)
                if event.message_finished:
                    text, self.text = "".join(self.text), []
                    self.message(orjson.loads(text), len(text), now, tally)
            elif isinstance(event, CloseConnection):
                self.ended = True

    def message(self, obj: dict[str, Any], nbytes: int, now: int, tally: Tally) -> None:
        op = obj.get("op")
        if op == "record":
            self.record(obj, nbytes, now, tally)
        elif op == "caught_up":
            self.caught_up = True
            tally.caught_up += 1
            if self.last_seq is None:
                self.last_seq = obj["head_seq"]
        elif op == "tombstone":
            tally.tombstones += 1
            self.last_seq = obj["gap_to"]
        elif op != "subscribed":
            tally.error_frames += 1
            tally.error(f"{op} message: {str(obj)[:300]}")


def _watch(job: dict[str, Any], ctl: Any) -> dict[str, Any]:
    """Open `conns` streams, report "ready" once all are caught up, then read until t_stop."""
    port, topic = job["port"], job["topic"]
    tally = Tally()
    conns: dict[int, SseConn] = {}
    ep = select.epoll()
    t_setup = time.perf_counter()
    setup = loadgen.BlockingConn(HOST, port)
    websocket = job.get("proto") == "ws"
    try:
        for _ in range(job["conns"]):
            conn: SseConn
            if websocket:
                sock, ws, rest = open_ws(port, topic)
                sock.setblocking(False)
                conn = WsConn(sock, ws)
            else:
                sock, rest = open_stream(port, create_watch(setup, port, topic))
                sock.setblocking(False)
                conn = SseConn(sock)
            conns[sock.fileno()] = conn
            ep.register(sock.fileno(), select.EPOLLIN)
            if rest:
                conn.feed(rest, time.monotonic_ns(), tally)
    finally:
        setup.close()
    opened_s = time.perf_counter() - t_setup

    def pump(deadline: float, until_caught_up: bool = False) -> None:
        while (left := deadline - time.monotonic()) > 0:
            for fd, _ev in ep.poll(min(left, 0.05)):
                conn = conns.get(fd)
                if conn is None:
                    continue
                try:
                    data = conn.sock.recv(262144)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    data = b""
                    tally.error(f"recv: {exc!r}")
                now = time.monotonic_ns()
                if data:
                    conn.feed(data, now, tally)
                if not data or conn.ended:
                    tally.closed += 1
                    tally.error("the server ended a stream")
                    ep.unregister(fd)
                    del conns[fd]
                    conn.sock.close()
            if until_caught_up and all(c.caught_up for c in conns.values()):
                return

    try:
        pump(time.monotonic() + 60, until_caught_up=True)
        waiting = sum(not c.caught_up for c in conns.values())
        if waiting:
            raise RuntimeError(
                f"{waiting} of {job['conns']} streams had no caught-up frame after 60 s "
                f"({tally.caught_up} caught-up, {tally.heartbeats} heartbeats, "
                f"{tally.closed} closed, first error {tally.first_error})"
            )
        ctl.send({"ready": True, "setup_s": time.perf_counter() - t_setup, "open_s": opened_s})
        window = ctl.recv()
        if window is None:
            return {"aborted": True}
        t_start, t_end, t_stop = window
        tally.t0, tally.t1 = int(t_start * 1e9), int(t_end * 1e9)
        pre = {k: getattr(tally, k) for k in ("records", "frames", "heartbeats", "caught_up")}
        cpu: dict[str, float] = {}
        pump(t_start)
        cpu["start"] = time.process_time()
        pump(t_end)
        cpu["end"] = time.process_time()
        pump(t_stop)
        return {
            "conns": job["conns"],
            "open_at_end": len(conns),
            "setup_s": time.perf_counter() - t_setup,
            "lat": tally.lat,
            "seqs": tally.seqs,
            "window_records": tally.window_records,
            "records": tally.records - pre["records"],
            "frames": tally.frames - pre["frames"],
            "bytes": tally.bytes,
            "heartbeats": tally.heartbeats,
            "caught_up": tally.caught_up,
            "tombstones": tally.tombstones,
            "error_frames": tally.error_frames,
            "gaps": tally.gaps,
            "gap_records": tally.gap_records,
            "dupes": tally.dupes,
            "closed": tally.closed,
            "errors": tally.errors,
            "first_error": tally.first_error,
            "cpu_s": cpu["end"] - cpu["start"],
            "window_s": t_end - t_start,
        }
    finally:
        for conn in conns.values():
            conn.sock.close()
        ep.close()


def write_request(port: int, topic: str, t: int, pad: bytes) -> bytes:
    body = b'{"records":[{"data":{"t":%d,%s%s}}]}' % (t, BASE_DATA, pad)
    return (
        b"POST /v0/topics/%s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (topic.encode(), HOST.encode(), port, len(body))
    ) + body


def pad_for(record_bytes: int) -> bytes:
    """`,"pad":"xxx…"` making the record's `data` object about `record_bytes` long."""
    base = len(b'{"t":1000000000000000,%s}' % BASE_DATA)
    n = max(0, record_bytes - base - len(b',"pad":""'))
    return b',"pad":"' + b"x" * n + b'"' if record_bytes else b""


def _paced(job: dict[str, Any], ctl: Any) -> dict[str, Any]:
    """Single-record writes at `rate`/s on an absolute schedule from t_begin to t_end."""
    port, topic, rate = job["port"], job["topic"], job["rate"]
    pad = pad_for(job["record_bytes"])
    conn = loadgen.BlockingConn(HOST, port)
    sends, seqs, acks = array("q"), array("q"), array("q")
    errors, late = 0, 0
    first_error = None
    try:
        ctl.send("ready")
        window = ctl.recv()
        if window is None:
            return {"aborted": True}
        t_begin, t_end = window
        period = 1.0 / rate
        cpu0 = time.process_time()
        i = 0
        while (target := t_begin + i * period) < t_end:
            i += 1
            delay = target - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            elif delay < -period:
                late += 1
            t = time.monotonic_ns()
            status, body = conn.request(write_request(port, topic, t, pad))
            acks.append(time.monotonic_ns() - t)
            conn.ensure_connected()
            if status not in (200, 201):
                errors += 1
                first_error = first_error or f"HTTP {status}: {body[:300]!r}"
                continue
            sends.append(t)
            seqs.append(orjson.loads(body)["seqs"][0])
        cpu_s = time.process_time() - cpu0
    finally:
        conn.close()
    return {
        "sends": sends,
        "seqs": seqs,
        "acks": acks,
        "late": late,
        "errors": errors,
        "first_error": first_error,
        "cpu_s": cpu_s,
        "wall_s": t_end - t_begin,
    }


_STALLED: list[tuple[socket.socket, bytes]] = []


def _stall_open(job: dict[str, Any]) -> dict[str, Any]:
    """Open streams that read their response head and nothing more (kept until stall_close)."""
    port = job["port"]
    setup = loadgen.BlockingConn(HOST, port)
    try:
        for _ in range(job["conns"]):
            sock, rest = open_stream(port, create_watch(setup, port, job["topic"]), job["rcvbuf"])
            _STALLED.append((sock, rest))
    finally:
        setup.close()
    return {
        "ports": [s.getsockname()[1] for s, _ in _STALLED],
        "rcvbuf": _STALLED[0][0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) if _STALLED else 0,
    }


def _stall_close(job: dict[str, Any]) -> dict[str, Any]:
    """Drain the stalled streams for `drain_s`, see what they got, and close them."""
    import fcntl
    import termios

    tally = Tally()
    conns = []
    queued = []
    for sock, rest in _STALLED:
        buf = array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
        queued.append(buf[0])
        conn = SseConn(sock)
        conn.feed(rest, 0, tally)
        sock.setblocking(False)
        conns.append(conn)
    eof = 0
    deadline = time.monotonic() + job["drain_s"]
    live = list(conns)
    while live and time.monotonic() < deadline:
        progressed = False
        for conn in list(live):
            try:
                data = conn.sock.recv(262144)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                progressed = True
                conn.feed(data, 0, tally)
            if not data or conn.ended:
                eof += 1
                live.remove(conn)
        if not progressed:
            time.sleep(0.005)
    for conn in conns:
        conn.sock.close()
    _STALLED.clear()
    last = [c.last_seq for c in conns if c.last_seq is not None]
    return {
        "stalled": len(conns),
        "queued_client_bytes": sum(queued),
        "ended_by_server": eof,
        "drained_records": tally.records,
        "drained_tombstones": tally.tombstones,
        "drained_error_frames": tally.error_frames,
        "drained_gaps": tally.gaps,
        "drained_dupes": tally.dupes,
        "drained_first_error": tally.first_error,
        "last_seq_min": min(last) if last else None,
        "last_seq_max": max(last) if last else None,
    }


def client_main(ctl: Any, cpu: int | None) -> None:
    """Serve jobs from the coordinator until it sends None (loadgen.serve_jobs)."""
    loadgen.serve_jobs(
        ctl,
        cpu,
        {
            "watch": _watch,
            "paced": _paced,
            "stall_open": lambda job, _c: _stall_open(job),
            "stall_close": lambda job, _c: _stall_close(job),
        },
    )


# ==========================================================================================
# coordinator


def spawn_clients(n: int, cpu: int | None) -> hc.Workers:
    """`n` client_main processes, managed (recv with timeout, close) by hc.Workers."""
    workers = hc.Workers(0, cpu)
    ctx = mp.get_context("spawn")
    for _ in range(n):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=client_main, args=(there, cpu), daemon=True)
        proc.start()
        workers.pipes.append(here)
        workers.procs.append(proc)
    return workers


def request_json(server: hc.Server, method: str, path: str, body: Any) -> Any:
    conn = loadgen.BlockingConn(HOST, server.port)
    try:
        raw = orjson.dumps(body)
        status, resp = conn.request(loadgen.build_request(HOST, server.port, path, raw, method))
    finally:
        conn.close()
    if status not in (200, 201):
        raise RuntimeError(f"{server.name}: {method} {path}: HTTP {status}: {resp[:300]!r}")
    return orjson.loads(resp) if resp else None


def prepare_topics(server: hc.Server, args: Any, with_b: bool) -> None:
    request_json(server, "PUT", f"/v0/topics/{TOPIC_A}", {"durability": "ephemeral"})
    for _ in range(5):  # first writes: topic creation work, seq reservation
        request_json(server, "POST", f"/v0/topics/{TOPIC_A}", {"records": [{"data": {"t": 0}}]})
    if with_b:
        cfg = {"durability": "ephemeral", "cap_records": args.b_cap}
        request_json(server, "PUT", f"/v0/topics/{TOPIC_B}", cfg)
        pad = "x" * max(0, args.b_record_bytes - 60)
        for start in range(0, args.b_cap, 1000):
            n = min(1000, args.b_cap - start)
            recs = [{"data": {"t": 0, "room": "lab-2", "celsius": 21.4, "pad": pad}}] * n
            request_json(server, "POST", f"/v0/topics/{TOPIC_B}", {"records": recs})


def tcp_queues(server_port: int, client_ports: set[int]) -> tuple[int, int]:
    """(server tx_queue, client rx_queue) bytes summed over the given client ports."""
    tx = rx = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            lport = int(f[1].rsplit(":", 1)[1], 16)
            rport = int(f[2].rsplit(":", 1)[1], 16)
            txq, rxq = (int(x, 16) for x in f[4].split(":"))
            if lport == server_port and rport in client_ports:
                tx += txq
            elif lport in client_ports and rport == server_port:
                rx += rxq
    return tx, rx


WATCH_METRICS = {
    "topicd_sse_lagged_total": "lagged_total",
    "topicd_sse_slow_closed_total": "slow_closed_total",
    "topicd_sse_lagged": "lagged_now",
    "topics_sse_connections": "sse_connections",
}


def watch_metrics(server: hc.Server) -> dict[str, float]:
    """topicd's SSE series from `GET /v0/metrics` (empty if it has none)."""
    if server.name != "topicd":
        return {}
    conn = loadgen.BlockingConn(HOST, server.port, timeout=10)
    try:
        req = loadgen.build_request(HOST, server.port, "/v0/metrics", b"", method="GET")
        status, body = conn.request(req)
    except OSError:
        return {}
    finally:
        conn.close()
    out: dict[str, float] = {}
    if status != 200:
        return out
    for line in body.decode("utf-8", "replace").splitlines():
        name, _, value = line.partition(" ")
        if name in WATCH_METRICS:
            with contextlib.suppress(ValueError):
                out[WATCH_METRICS[name]] = float(value)
    return out


class Sampler:
    """Server RSS (and stalled-socket queues) every `period` s, topicd's SSE metrics every
    `metrics_every` samples, in a thread."""

    def __init__(
        self,
        server: hc.Server,
        stalled_ports: set[int],
        period: float = 0.5,
        metrics_every: int = 2,
    ) -> None:
        self.server = server
        self.ports = stalled_ports
        self.period = period
        self.metrics_every = metrics_every
        self.samples: list[tuple[float, float, int, int]] = []
        self.metrics: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        tx, rx = tcp_queues(self.server.port, self.ports) if self.ports else (0, 0)
        now = time.monotonic()
        if len(self.samples) % self.metrics_every == 0 or self._stop.is_set():
            self.metrics.append((now, watch_metrics(self.server)))
        self.samples.append((now, self.server.rss_mib(), tx, rx))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()


def split(n: int, parts: int) -> list[int]:
    parts = max(1, min(n, parts))
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def ms(values_ns: list[int], p: float) -> float:
    return percentile(values_ns, p) / 1e6


class Window:
    """Server and machine CPU over [t_start, t_end), measured from the coordinator."""

    def __init__(self, server: hc.Server, t_start: float, t_end: float) -> None:
        time.sleep(max(0.0, t_start - time.monotonic()))
        cpu0, sys0 = server.cpu_s(), hc.system_cpu()
        time.sleep(max(0.0, t_end - time.monotonic()))
        self.server_cpu = server.cpu_s() - cpu0
        sys1 = hc.system_cpu()
        self.busy, self.steal = sys1[0] - sys0[0], sys1[1] - sys0[1]
        self.rss_mib = server.rss_mib()


def start_watchers(
    clients: hc.Workers, server: hc.Server, topic: str, n: int, procs: int, proto: str = "sse"
) -> tuple[list[Any], dict[str, float]]:
    pipes = clients.pipes[: len(split(n, procs))]
    for pipe, k in zip(pipes, split(n, procs), strict=True):
        pipe.send(
            {"mode": "watch", "port": server.port, "topic": topic, "conns": k, "proto": proto}
        )
    setups = [clients.recv(pipe, 180) for pipe in pipes]
    return pipes, {"setup_s": max(s["setup_s"] for s in setups)}


def watch_summary(
    results: list[dict[str, Any]], n: int, window: Window, t_start: float, t_end: float
) -> dict[str, Any]:
    """Latency percentiles over all pairs, per-record first/last watcher, counters, CPU."""
    lat: list[int] = []
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for r in results:
        lat.extend(r["lat"])
        for seq, v in zip(r["seqs"], r["lat"], strict=True):
            if v < first.get(seq, 1 << 62):
                first[seq] = v
            if v > last.get(seq, -1):
                last[seq] = v
    lat.sort()
    span = t_end - t_start
    cli = [r["cpu_s"] for r in results]
    out: dict[str, Any] = {
        "watchers": n,
        "pairs": len(lat),
        "p50_ms": ms(lat, 50),
        "p90_ms": ms(lat, 90),
        "p99_ms": ms(lat, 99),
        "p999_ms": ms(lat, 99.9),
        "max_ms": lat[-1] / 1e6 if lat else math.nan,
        "mean_ms": statistics.fmean(lat) / 1e6 if lat else math.nan,
        "first_watcher_p50_ms": ms(sorted(first.values()), 50),
        "last_watcher_p50_ms": ms(sorted(last.values()), 50),
        "last_watcher_p99_ms": ms(sorted(last.values()), 99),
        "deliveries_per_s": sum(r["window_records"] for r in results) / span,
        "frames": sum(r["frames"] for r in results),
        "records_received": sum(r["records"] for r in results),
        "tombstones": sum(r["tombstones"] for r in results),
        "gaps": sum(r["gaps"] for r in results),
        "gap_records": sum(r["gap_records"] for r in results),
        "dupes": sum(r["dupes"] for r in results),
        "closed": sum(r["closed"] for r in results),
        "error_frames": sum(r["error_frames"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        "server_cpu_pct": 100 * window.server_cpu / span,
        "server_rss_mib": window.rss_mib,
        "client_procs": len(results),
        "client_cpu_pct": 100 * sum(cli) / span,
        "client_cpu_max_pct": 100 * max(cli) / span,
    }
    out["records_per_frame"] = out["records_received"] / out["frames"] if out["frames"] else 0
    return out


def paced_run(
    clients: hc.Workers,
    server: hc.Server,
    topic: str,
    n: int,
    rate: float,
    record_bytes: int,
    warmup: float,
    duration: float,
    grace: float,
    procs: int,
    sampler_ports: set[int] | None = None,
    proto: str = "sse",
) -> dict[str, Any]:
    """N watchers + the paced writer (the last client process): one measured window."""
    writer = clients.pipes[-1]
    pipes, setup = start_watchers(clients, server, topic, n, procs, proto)
    writer.send(
        {"mode": "paced", "port": server.port, "topic": topic, "rate": rate,
         "record_bytes": record_bytes}
    )  # fmt: skip
    assert clients.recv(writer, 60) == "ready"
    t_begin = time.monotonic() + 0.1
    t_start = t_begin + warmup
    t_end = t_start + duration
    t_stop = t_end + grace
    sampler = Sampler(server, sampler_ports or set()) if sampler_ports is not None else None
    with sampler or contextlib.nullcontext():
        for pipe in pipes:
            pipe.send((t_start, t_end, t_stop))
        writer.send((t_begin, t_end))
        window = Window(server, t_start, t_end)
        wres = clients.recv(writer, duration + warmup + 120)
        results = [clients.recv(pipe, grace + 120) for pipe in pipes]
    out = watch_summary(results, n, window, t_start, t_end)
    t0, t1 = int(t_start * 1e9), int(t_end * 1e9)
    in_window = sum(1 for t in wres["sends"] if t0 <= t < t1)
    acks = sorted(wres["acks"])
    out.update(
        {
            "rate": rate,
            "writes_in_window": in_window,
            "write_rate_pct": 100 * in_window / (rate * duration),
            "expected_pairs": in_window * n,
            "delivered_pct": 100 * out["pairs"] / (in_window * n) if in_window else math.nan,
            "write_ack_p50_ms": ms(acks, 50),
            "write_ack_p99_ms": ms(acks, 99),
            "writer_late": wres["late"],
            "writer_cpu_pct": 100 * wres["cpu_s"] / wres["wall_s"],
            "errors": out["errors"] + wres["errors"],
            "first_error": out["first_error"] or wres["first_error"],
            **setup,
            **hc.other_load(
                window.busy,
                window.steal,
                window.server_cpu,
                sum(r["cpu_s"] for r in results) + wres["cpu_s"] * duration / wres["wall_s"],
                duration,
            ),
        }
    )
    out["client_cpu_pct"] += out["writer_cpu_pct"]
    if sampler is not None:
        out["samples"] = sampler.samples
        out["metrics"] = sampler.metrics
        out["window_at"] = (t_start, t_end)
    return out


def flood_run(
    clients: hc.Workers, flooders: hc.Workers, server: hc.Server, args: Any
) -> dict[str, Any]:
    n = args.flood_watchers
    pipes, setup = start_watchers(clients, server, TOPIC_A, n, args.watch_procs)
    req = write_request(server.port, TOPIC_A, 0, b"")
    fpipes = flooders.pipes
    for pipe, conns in zip(fpipes, split(args.flood_conc, len(fpipes)), strict=False):
        pipe.send(
            {"mode": "throughput", "kind": "write", "host": HOST, "port": server.port,
             "requests": [req], "records_per_request": 1, "conns": conns, "validate_every": 50}
        )  # fmt: skip
    for pipe in fpipes:
        assert flooders.recv(pipe, 60) == "ready"
    t_warm = time.monotonic() + 0.1
    t_start = t_warm + args.flood_warmup
    t_end = t_start + args.flood_duration
    t_stop = t_end + 2.0
    for pipe in pipes:
        pipe.send((t_start, t_end, t_stop))
    for pipe in fpipes:
        pipe.send((t_warm, t_start, t_end))
    window = Window(server, t_start, t_end)
    fres = [flooders.recv(pipe, args.flood_duration + 120) for pipe in fpipes]
    results = [clients.recv(pipe, 120) for pipe in pipes]
    out = watch_summary(results, n, window, t_start, t_end)
    span = t_end - t_start
    writes = sum(r["count"] for r in fres) / span
    acks = sorted(x for r in fres for x in r["latencies"])
    fcpu = sum(r["cpu_s"] for r in fres)
    out.update(
        {
            "writes_per_s": writes,
            "keep_up_pct": 100 * out["deliveries_per_s"] / (writes * n) if writes else math.nan,
            "write_ack_p50_ms": percentile(acks, 50) * 1e3,
            "write_ack_p99_ms": percentile(acks, 99) * 1e3,
            "writer_cpu_pct": 100 * fcpu / span,
            "errors": out["errors"] + sum(r["errors"] for r in fres),
            "first_error": out["first_error"]
            or next((r["first_error"] for r in fres if r["first_error"]), None),
            **setup,
            **hc.other_load(
                window.busy,
                window.steal,
                window.server_cpu,
                sum(r["cpu_s"] for r in results) + fcpu,
                span,
            ),
        }
    )
    out["client_cpu_pct"] += out["writer_cpu_pct"]
    return out


def rss_stats(samples: list[tuple[float, float, int, int]], t_start: float) -> dict[str, Any]:
    before = [s for s in samples if s[0] < t_start] or samples[:1]
    during = [s for s in samples if s[0] >= t_start] or samples[-1:]
    rss = [s[1] for s in during]
    half = during[len(during) // 2 :]
    return {
        "rss_before_mib": before[-1][1],
        "rss_start_mib": rss[0],
        "rss_end_mib": rss[-1],
        "rss_max_mib": max(s[1] for s in samples),
        "rss_growth_mib": rss[-1] - rss[0],
        "rss_growth_2nd_half_mib": half[-1][1] - half[0][1],
        "stalled_server_txq_kib_end": during[-1][2] / 1024,
        "stalled_client_rxq_kib_end": during[-1][3] / 1024,
        "stalled_txq_kib_max": max(s[2] for s in samples) / 1024,
    }


def stall_run(clients: hc.Workers, server: hc.Server, stalled: int, args: Any) -> dict[str, Any]:
    """Scenario B, one half of a pair: healthy watchers (+ `stalled` stalled ones)."""
    writer = clients.pipes[-1]
    ports: set[int] = set()
    stall_info: dict[str, Any] = {}
    if stalled:
        writer.send(
            {"mode": "stall_open", "port": server.port, "topic": TOPIC_B, "conns": stalled,
             "rcvbuf": args.stall_rcvbuf}
        )  # fmt: skip
        opened = clients.recv(writer, 120)
        ports = set(opened["ports"])
        stall_info["stall_rcvbuf_effective"] = opened["rcvbuf"]
    res = paced_run(
        clients,
        server,
        TOPIC_B,
        args.b_healthy,
        args.b_rate,
        args.b_record_bytes,
        args.b_warmup,
        args.b_duration,
        1.5,
        args.watch_procs,
        sampler_ports=ports,
    )
    samples = res.pop("samples")
    metrics = res.pop("metrics")
    t_start, _t_end = res.pop("window_at")
    res.update(rss_stats(samples, t_start))
    if metrics and metrics[0][1]:
        first, last = metrics[0][1], metrics[-1][1]
        res["lagged_marked"] = last.get("lagged_total", 0) - first.get("lagged_total", 0)
        res["slow_closed"] = last.get("slow_closed_total", 0) - first.get("slow_closed_total", 0)
        res["lagged_max"] = max(m.get("lagged_now", 0) for _, m in metrics)
        first_lag = next((t for t, m in metrics if m.get("lagged_now")), None)
        res["lagged_after_s"] = None if first_lag is None else first_lag - (t_start - args.b_warmup)
        res["metrics_series"] = [(round(t - samples[0][0], 2), m) for t, m in metrics]
    res["rss_series"] = [
        (round(t - samples[0][0], 2), round(rss, 1), tx, rx) for t, rss, tx, rx in samples
    ]
    res["stalled"] = stalled
    if stalled:
        writer.send({"mode": "stall_close", "drain_s": 2.0})
        stall_info.update(clients.recv(writer, 60))
        stall_info["head_seq"] = request_json(
            server, "POST", f"/v0/topics/{TOPIC_B}/diff", {"from_seq": 0, "limit": 1}
        )["head_seq"]
    res.update(stall_info)
    return res


# ------------------------------------------------------------------------------------------
# report


def ratio(a: Any, b: Any) -> float | None:
    return a / b if a and b and not math.isnan(a) and not math.isnan(b) else None


def summarize(rounds: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for metric, per in rounds.items():
        summary[metric] = {}
        for name, rs in per.items():
            slim = [{k: v for k, v in r.items() if not k.endswith("_series")} for r in rs]
            summary[metric][name] = hc.median_of(slim)
        if "topicd" in per and "floor" in per:
            pairs = list(zip(per["topicd"], per["floor"], strict=False))
            for key in ("p50_ms", "p99_ms"):
                rr = [x for t, f in pairs if (x := ratio(t.get(key), f.get(key))) is not None]
                summary[metric][f"ratio_{key}"] = statistics.median(rr) if rr else None
            rr = [
                x
                for t, f in pairs
                if (x := ratio(f.get("deliveries_per_s"), t.get("deliveries_per_s"))) is not None
            ]
            summary[metric]["slowdown_deliveries"] = statistics.median(rr) if rr else None
        if "topicd" in per and "ws" in per:
            pairs = list(zip(per["ws"], per["topicd"], strict=False))
            for key in ("p50_ms", "p99_ms"):
                rr = [x for w, t in pairs if (x := ratio(w.get(key), t.get(key))) is not None]
                summary[metric][f"ws_ratio_{key}"] = statistics.median(rr) if rr else None
    return summary


def evaluate_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n in (100, 1000):
        s = summary.get(f"a_n{n}")
        if s is None:
            continue
        r = s.get("ratio_p50_ms")
        out.append(
            {
                "target": f"topicd p50 ≤ {TARGET_RATIO}× floor p50 at {n} watchers",
                "value": r,
                "shown": f"{r:.2f}×" if r is not None else "needs both servers",
                "met": None if r is None else r <= TARGET_RATIO,
            }
        )
    for n in (100, 1000):
        s = summary.get(f"a_n{n}")
        if s is None or s.get("ws_ratio_p50_ms") is None:
            continue
        r = s["ws_ratio_p50_ms"]
        out.append(
            {
                "target": f"WebSocket p50 ≤ {TARGET_WS_RATIO}× SSE p50 at {n} watchers",
                "value": r,
                "shown": f"{r:.2f}× (p99 {s['ws_ratio_p99_ms']:.2f}×)",
                "met": r <= TARGET_WS_RATIO,
            }
        )
    p50 = summary.get("a_n100", {}).get("topicd", {}).get("p50_ms")
    if p50 is not None:
        out.append(
            {
                "target": f"topicd p50 < {TARGET_P50_MS_100:g} ms at 100 watchers",
                "value": p50,
                "shown": f"{p50:.2f} ms",
                "met": p50 < TARGET_P50_MS_100,
            }
        )
    with_s = summary.get("b_with", {}).get("topicd")
    without = summary.get("b_without", {}).get("topicd")
    if with_s and without:
        r = summary["b_with"].get("ratio_vs_without_p50")
        out.append(
            {
                "target": "healthy watchers unaffected by stalled ones (p50 with / without)",
                "value": r,
                "shown": f"{r:.2f}× (p99 {summary['b_with'].get('ratio_vs_without_p99'):.2f}×)"
                if r is not None
                else "-",
                "met": None,
            }
        )
        g = with_s.get("rss_growth_mib")
        out.append(
            {
                "target": f"server RSS flat while watchers stall (growth < {RSS_FLAT_MIB:g} MiB "
                "over the window, heuristic)",
                "value": g,
                "shown": f"{g:+.1f} MiB ({with_s['rss_start_mib']:.0f} → "
                f"{with_s['rss_end_mib']:.0f} MiB, max {with_s['rss_max_mib']:.0f})",
                "met": None if g is None else g < RSS_FLAT_MIB,
            }
        )
    return out


def print_report(doc: dict[str, Any]) -> None:
    p = print
    info, s, settings = doc["machine"], doc["summary"], doc["settings"]
    servers = settings["servers"]
    p()
    p("== topicd SSE fan-out benchmark ==")
    p(f"command : {doc['command']}")
    p(
        f"machine : nproc={info['nproc']}, {info['cpu_model']}, {info['implementation']} "
        f"{info['python']}, loadavg at start {' '.join(info['loadavg_start'])}"
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
        f"run     : repeat {settings['repeat']} (median), {settings['watch_procs']} watcher "
        f"processes + 1 writer"
    )
    a_rows = [m for m in s if m.startswith("a_n")]
    if a_rows:
        p()
        p(
            f"A. write→deliver latency, single-record writes paced at w/s (offered; "
            f"wr% = achieved), window {settings['duration']:g} s after {settings['warmup']:g} "
            "s warm-up (ms; first/last = p50 of the first/last watcher to get each record)"
        )
        hdr = (
            f"{'N':>5} {'w/s':>4} {'server':<7}{'p50':>8}{'p90':>8}{'p99':>8}{'p99.9':>8}{'max':>8}"
            f"{'first':>8}{'last':>8}{'ack p50':>9}{'deliv%':>8}{'wr%':>5}{'srv%':>6}{'cli%':>6}"
            f"{'max/p%':>7}{'oth%':>6}"
        )
        p(hdr)
        p("-" * len(hdr))
        for m in a_rows:
            for name in servers:
                r = s[m].get(name)
                if r is None:
                    continue
                p(
                    f"{r['watchers']:>5.0f} {r['rate']:>4g} {name:<7}{r['p50_ms']:>8.2f}"
                    f"{r['p90_ms']:>8.2f}{r['p99_ms']:>8.2f}{r['p999_ms']:>8.2f}{r['max_ms']:>8.1f}"
                    f"{r['first_watcher_p50_ms']:>8.2f}{r['last_watcher_p50_ms']:>8.2f}"
                    f"{r['write_ack_p50_ms']:>9.2f}{r['delivered_pct']:>8.1f}"
                    f"{r['write_rate_pct']:>5.0f}{r['server_cpu_pct']:>6.0f}{r['client_cpu_pct']:>6.0f}"
                    f"{r['client_cpu_max_pct']:>7.0f}{r['other_cpu_pct']:>6.0f}"
                )
            if s[m].get("ratio_p50_ms") is not None:
                p(
                    f"{'':>10} {'ratio':<7}{s[m]['ratio_p50_ms']:>7.2f}×{'':>8}"
                    f"{s[m]['ratio_p99_ms']:>7.2f}×   (topicd/floor, median of per-round ratios)"
                )
            if s[m].get("ws_ratio_p50_ms") is not None:
                p(
                    f"{'':>10} {'ws/sse':<7}{s[m]['ws_ratio_p50_ms']:>7.2f}×{'':>8}"
                    f"{s[m]['ws_ratio_p99_ms']:>7.2f}×   (WebSocket/SSE on topicd, median of "
                    "per-round ratios)"
                )
    if "flood" in s:
        p()
        p(
            f"Flood: {settings['flood_watchers']} watchers, {settings['flood_conc']} writers "
            f"at max rate, window {settings['flood_duration']:g} s"
        )
        hdr = (
            f"{'server':<8}{'deliv/s':>10}{'writes/s':>10}{'keep-up%':>9}{'rec/frame':>10}"
            f"{'ack p50':>8}{'ack p99':>8}{'srv%':>6}{'cli%':>6}{'max/p%':>7}"
            f"{'oth%':>6}{'gaps':>6}"
        )
        p(hdr)
        p("-" * len(hdr))
        for name in servers:
            r = s["flood"].get(name)
            if r is None:
                continue
            p(
                f"{name:<8}{r['deliveries_per_s']:>10,.0f}{r['writes_per_s']:>10,.0f}"
                f"{r['keep_up_pct']:>9.1f}{r['records_per_frame']:>10.1f}"
                f"{r['write_ack_p50_ms']:>8.2f}{r['write_ack_p99_ms']:>8.2f}"
                f"{r['server_cpu_pct']:>6.0f}{r['client_cpu_pct']:>6.0f}"
                f"{r['client_cpu_max_pct']:>7.0f}{r['other_cpu_pct']:>6.0f}{r['gaps']:>6.0f}"
            )
        if s["flood"].get("slowdown_deliveries") is not None:
            p(f"floor/topicd deliveries/s: {s['flood']['slowdown_deliveries']:.2f}×")
    if "b_with" in s or "b_without" in s:
        p()
        p(
            f"B. stalled watchers (topicd): {settings['b_healthy']} healthy + "
            f"{settings['b_stalled']} stalled (SO_RCVBUF {settings['stall_rcvbuf']}), "
            f"{settings['b_rate']:g} writes/s of {settings['b_record_bytes']} B, "
            f"{settings['b_warmup']:g} s + {settings['b_duration']:g} s window, cap_records "
            f"{settings['b_cap']}"
        )
        hdr = (
            f"{'run':<9}{'p50':>8}{'p99':>8}{'max':>8}{'deliv%':>8}{'ack p50':>8}"
            f"{'RSS start':>10}{'end':>7}{'max':>7}{'growth':>8}{'stall txq KiB':>14}"
            f"{'srv%':>6}{'cli%':>6}{'oth%':>6}"
        )
        p(hdr)
        p("-" * len(hdr))
        for key, label in (("b_without", "without"), ("b_with", "with")):
            r = s.get(key, {}).get("topicd")
            if r is None:
                continue
            p(
                f"{label:<9}{r['p50_ms']:>8.2f}{r['p99_ms']:>8.2f}{r['max_ms']:>8.1f}"
                f"{r['delivered_pct']:>8.1f}{r['write_ack_p50_ms']:>8.2f}"
                f"{r['rss_start_mib']:>10.1f}{r['rss_end_mib']:>7.1f}{r['rss_max_mib']:>7.1f}"
                f"{r['rss_growth_mib']:>+8.1f}{r['stalled_txq_kib_max']:>14.0f}"
                f"{r['server_cpu_pct']:>6.0f}{r['client_cpu_pct']:>6.0f}{r['other_cpu_pct']:>6.0f}"
            )
        w = s.get("b_with", {}).get("topicd")
        if w:
            p(
                f"stalled at the end: client rx queue {w['stalled_client_rxq_kib_end']:.0f} KiB, "
                f"server tx queue {w['stalled_server_txq_kib_end']:.0f} KiB (all {w['stalled']:.0f}"
                f" stalled); after a 2 s drain: {w['ended_by_server']:.0f} ended by the server, "
                f"{w['drained_records']:.0f} records, {w['drained_tombstones']:.0f} tombstones, "
                f"{w['drained_gaps']:.0f} gaps, {w['drained_dupes']:.0f} duplicates, "
                f"last seq {w['last_seq_min']}–{w['last_seq_max']} of head {w['head_seq']}"
            )
            if "lagged_marked" in w:
                lag_at = w.get("lagged_after_s")
                p(
                    f"topicd metrics over the with-run: {w['lagged_marked']:.0f} streams marked "
                    f"lagged (max {w['lagged_max']:.0f} at once"
                    + (f", first after {lag_at:.1f} s of writes" if lag_at is not None else "")
                    + f"), {w['slow_closed']:.0f} closed by the slow-consumer timeout"
                )
            if w.get("drained_first_error"):
                p(f"stalled streams' first error frame: {w['drained_first_error']}")
    p()
    p("checks")
    warn = []
    for metric, per in s.items():
        for name in servers:
            r = per.get(name) if isinstance(per, dict) else None
            if not isinstance(r, dict):
                continue
            problems = []
            for key in ("gaps", "dupes", "closed", "error_frames", "tombstones", "errors"):
                if r.get(key):
                    problems.append(f"{key} {r[key]:.0f}")
            if r.get("delivered_pct") is not None and r["delivered_pct"] < 99.99:
                problems.append(f"delivered {r['delivered_pct']:.2f} %")
            if r.get("write_rate_pct", 100) < 95:
                warn.append(
                    f"{metric}/{name}: the writer reached only {r['write_rate_pct']:.0f} % of "
                    f"its {r['rate']:g} writes/s: the server was saturated, so the latency "
                    "includes queueing behind earlier fan-outs"
                )
            if problems:
                warn.append(
                    f"{metric}/{name}: " + ", ".join(problems) + f" (first: {r.get('first_error')})"
                )
            if r.get("client_cpu_max_pct", 0) > 70:
                warn.append(
                    f"{metric}/{name}: a watcher process used {r['client_cpu_max_pct']:.0f} % "
                    "of a core: the clients may be the bottleneck"
                )
            if r.get("other_cpu_pct", 0) > 25:
                warn.append(
                    f"{metric}/{name}: other processes used {r['other_cpu_pct']:.0f} % of a "
                    "core (shared machine: absolute numbers are low, compare ratios)"
                )
    for line in warn or ["no gaps, duplicates, closed streams, error frames or losses"]:
        p(f"  {line}")
    p()
    p("targets")
    for t in doc["targets"]:
        mark = {True: "MET   ", False: "MISSED", None: "info  "}[t["met"]]
        p(f"  [{mark}] {t['target']}: {t['shown']}")


# ------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="topicd vs framework-floor SSE fan-out benchmark")
    p.add_argument("--quick", action="store_true", help="short windows (a smoke run)")
    p.add_argument("--repeat", type=int, default=1, help="rounds; medians are reported")
    p.add_argument("--only", choices=("topicd", "floor"), help="measure one server")
    p.add_argument(
        "--ws", action="store_true", help="scenario A also over topicd's WebSocket (`ws`)"
    )
    p.add_argument(
        "--scenario", default="all", help="a, flood, b or all, or a comma list (a,flood)"
    )
    p.add_argument("--ns", default="1,100,1000", help="scenario A watcher counts")
    p.add_argument(
        "--rate",
        default="20,1000:2",
        help="scenario A writes/s: R, or R,N:R,... per watcher count (default 20,1000:2)",
    )
    p.add_argument("--warmup", type=float, help="scenario A warm-up s (default 2)")
    p.add_argument("--duration", type=float, help="scenario A window s (default 15)")
    p.add_argument("--watch-procs", type=int, default=4, help="watcher processes")
    p.add_argument("--flood-watchers", type=int, default=100)
    p.add_argument("--flood-conc", type=int, default=8, help="flood writer connections")
    p.add_argument("--flood-warmup", type=float, help="default 1")
    p.add_argument("--flood-duration", type=float, help="default 5")
    p.add_argument("--b-healthy", type=int, default=100)
    p.add_argument("--b-stalled", type=int, default=10)
    p.add_argument("--b-rate", type=float, default=100.0, help="scenario B writes/s")
    p.add_argument("--b-record-bytes", type=int, default=1024)
    p.add_argument("--b-warmup", type=float, help="default 8")
    p.add_argument("--b-duration", type=float, help="default 20")
    p.add_argument("--b-cap", type=int, default=5000, help="cap_records of the B topic")
    p.add_argument(
        "--channel-frames",
        type=int,
        help="topicd's sse.channel_frames for this run (default: its config default); "
        "a smaller channel makes scenario B's stalled watchers reach lagged sooner",
    )
    p.add_argument("--stall-rcvbuf", type=int, default=4096, help="stalled SO_RCVBUF bytes")
    p.add_argument("--pin", action="store_true", help="servers on CPU 0, clients on CPU 1")
    p.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    args = p.parse_args(argv)
    q = args.quick
    defaults = {
        "warmup": (1.0, 2.0),
        "duration": (3.0, 15.0),
        "flood_warmup": (0.5, 1.0),
        "flood_duration": (2.0, 5.0),
        "b_warmup": (2.0, 8.0),
        "b_duration": (4.0, 20.0),
    }
    for key, (quick, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if q else full)
    args.scenarios = {x.strip() for x in args.scenario.split(",") if x.strip()}
    if "all" in args.scenarios:
        args.scenarios = {"a", "flood", "b"}
    if not args.scenarios or args.scenarios - {"a", "flood", "b"}:
        p.error(f"--scenario: a, flood, b, all or a comma list of them, got {args.scenario!r}")
    args.ns = [int(x) for x in args.ns.split(",") if x.strip()]
    args.rates = {}
    try:
        for part in args.rate.split(","):
            n, _, r = part.strip().rpartition(":")
            args.rates[int(n) if n else 0] = float(r)
    except ValueError:
        p.error(f"--rate: expected R or R,N:R,..., got {args.rate!r}")
    if args.repeat < 1:
        p.error("--repeat must be ≥ 1")
    if args.watch_procs < 1:
        p.error("--watch-procs must be ≥ 1")
    return args


def rate_for(args: Any, n: int) -> float:
    """Scenario A's writes/s for `n` watchers (`--rate`; key 0 is the default)."""
    return args.rates.get(n, args.rates.get(0, 20.0))


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def log_line(tag: str, name: str, r: dict[str, Any]) -> None:
    extra = ""
    for key in ("gaps", "dupes", "closed", "error_frames", "errors"):
        if r.get(key):
            extra += f" {key}={r[key]}"
    if "writes_per_s" in r:
        head = (
            f"{r['deliveries_per_s']:,.0f} deliveries/s, {r['writes_per_s']:,.0f} writes/s, "
            f"keep-up {r['keep_up_pct']:.1f} %"
        )
    else:
        head = (
            f"p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms, delivered "
            f"{r['delivered_pct']:.2f} % of {r['expected_pairs']:,}, write ack p50 "
            f"{r['write_ack_p50_ms']:.2f} p99 {r['write_ack_p99_ms']:.2f} ms, "
            f"{r['writes_in_window']} writes ({r['writer_late']} late)"
        )
    if "rss_growth_mib" in r:
        head += f", RSS {r['rss_start_mib']:.0f}→{r['rss_end_mib']:.0f} MiB"
    print(
        f"{tag:<22} {name:<7} {head}  (server CPU {r['server_cpu_pct']:.0f} %, clients "
        f"{r['client_cpu_pct']:.0f} %, max/proc {r['client_cpu_max_pct']:.0f} %, other "
        f"{r['other_cpu_pct']:.0f} %, setup {r['setup_s']:.1f} s){extra}",
        flush=True,
    )
    if r.get("first_error"):
        print(f"{'':<22} first error: {r['first_error']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(sys.orig_argv)
    raise_nofile()
    info = hc.machine_info(REPO_DIR)
    names = [args.only] if args.only else ["topicd", "floor"]
    scen = set(args.scenarios)
    if "b" in scen and "topicd" not in names:
        print("scenario B runs against topicd only (the floor has no lag handling): skipped")
        scen.discard("b")
    if not scen:
        return 2
    if not scen & {"a", "flood"}:
        names = ["topicd"]  # scenario B alone: the floor is not needed
    srv_cpu, cli_cpu = (0, 1) if args.pin else (None, None)
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {}
    servers: dict[str, hc.Server] = {}
    clients = flooders = None
    with tempfile.TemporaryDirectory(prefix="topicd-sse-bench-") as tmp:
        tmpdir = Path(tmp)
        try:
            clients = spawn_clients(args.watch_procs + 1, cli_cpu)  # the last one writes
            if "flood" in scen:
                flooders = hc.Workers(2, cli_cpu)
            if "topicd" in names:
                servers["topicd"] = hc.Server(
                    "topicd",
                    [sys.executable, "-m", "topicd", "serve", "--port", "0",
                     "--data-dir", str(tmpdir / "data")],
                    dict(
                        os.environ,
                        TOPICD_PORT_FILE=str(tmpdir / "topicd.port"),
                        **(
                            {"TOPICD_SSE_CHANNEL_FRAMES": str(args.channel_frames)}
                            if args.channel_frames
                            else {}
                        ),
                    ),
                    tmpdir / "topicd.port",
                    REPO_DIR,
                )  # fmt: skip
            if "floor" in names:
                servers["floor"] = hc.Server(
                    "floor",
                    [sys.executable, str(BENCH_DIR / "sse_floor_app.py"), "--port", "0",
                     "--port-file", str(tmpdir / "floor.port")],
                    dict(os.environ),
                    tmpdir / "floor.port",
                    REPO_DIR,
                )  # fmt: skip
            for server in servers.values():
                server.start(cpu=srv_cpu)
                assert server.proc is not None
                print(f"{server.name} listening on {HOST}:{server.port} (pid {server.proc.pid})")
                prepare_topics(server, args, "b" in scen and server.name == "topicd")

            def record(metric: str, name: str, r: int, res: dict[str, Any]) -> None:
                res["round"] = r
                rounds.setdefault(metric, {}).setdefault(name, []).append(res)

            for r in range(args.repeat):
                tag = f"round {r + 1}/{args.repeat}"
                if "a" in scen:
                    variants = [(name, server, "sse") for name, server in servers.items()]
                    if args.ws and "topicd" in servers:
                        variants.insert(1, ("ws", servers["topicd"], "ws"))
                    for i, n in enumerate(args.ns):
                        order = list(variants)
                        if (r + i) % 2:
                            order.reverse()
                        for name, server, proto in order:
                            res = paced_run(
                                clients, server, TOPIC_A, n, rate_for(args, n), 0, args.warmup,
                                args.duration, 1.5, args.watch_procs, proto=proto,
                            )  # fmt: skip
                            record(f"a_n{n}", name, r, res)
                            log_line(f"{tag} A N={n}", name, res)
                            time.sleep(0.5)
                if "flood" in scen:
                    assert flooders is not None
                    order = list(servers.values())
                    if r % 2:
                        order.reverse()
                    for server in order:
                        res = flood_run(clients, flooders, server, args)
                        record("flood", server.name, r, res)
                        log_line(f"{tag} flood", server.name, res)
                        time.sleep(0.5)
            if "b" in scen:
                topicd = servers["topicd"]
                for r in range(args.repeat):
                    for metric, k in (("b_without", 0), ("b_with", args.b_stalled)):
                        res = stall_run(clients, topicd, k, args)
                        record(metric, "topicd", r, res)
                        log_line(f"round {r + 1}/{args.repeat} B {metric[2:]}", "topicd", res)
                        time.sleep(1.0)
        finally:
            for workers in (clients, flooders):
                if workers is not None:
                    workers.close()
            for server in servers.values():
                server.stop()

    summary = summarize(rounds)
    if "b_with" in rounds and "b_without" in rounds:
        pairs = list(zip(rounds["b_without"]["topicd"], rounds["b_with"]["topicd"], strict=False))
        for key in ("p50_ms", "p99_ms"):
            rr = [x for wo, w in pairs if (x := ratio(w[key], wo[key])) is not None]
            summary["b_with"][f"ratio_vs_without_{key.split('_')[0]}"] = (
                statistics.median(rr) if rr else None
            )
    targets = evaluate_targets(summary)
    info["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    info["trio_sleep0_per_s_end"] = hc.speed_probe()
    settings = {
        k: getattr(args, k)
        for k in (
            "repeat", "ns", "rate", "rates", "warmup", "duration", "watch_procs", "flood_watchers",
            "flood_conc", "flood_warmup", "flood_duration", "b_healthy", "b_stalled", "b_rate",
            "b_record_bytes", "b_warmup", "b_duration", "b_cap", "stall_rcvbuf", "pin", "quick",
            "channel_frames",
        )
    }  # fmt: skip
    settings["rates"] = {str(k or "default"): v for k, v in args.rates.items()}
    settings["servers"] = (
        [names[0], "ws", *names[1:]] if args.ws and "topicd" in names and "a" in scen else names
    )
    settings["scenarios"] = sorted(scen)
    doc = {
        "benchmark": "sse_fanout",
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command,
        "machine": info,
        "settings": settings,
        "summary": summary,
        "rounds": rounds,
        "targets": targets,
        "ratio_definition": "topicd/floor for latencies (median of per-round ratios); "
        "slowdown_deliveries = floor/topicd deliveries/s",
    }
    print_report(doc)
    if not args.no_json:
        RESULTS_DIR.mkdir(exist_ok=True)
        out = RESULTS_DIR / f"sse_fanout-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        print(f"\nresults written to {out.relative_to(REPO_DIR)}")
    errors = sum(
        r.get("errors", 0) for per in summary.values() for r in per.values() if isinstance(r, dict)
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
