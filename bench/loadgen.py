"""Load-generator processes for bench/http_core.py and bench/durable.py: a raw-socket
HTTP/1.1 keep-alive client.

Why not httpx: on this 2-core machine the server under test gets about one core and the
load generators share the other. httpx's per-request cost in Python (request/response
objects, header models, h11 state machine, anyio) is of the same order as the server's
own ≈ 320–400 µs per request (perf-baseline.md), so with httpx the client, not the
server, would set the pace at c=16 and inflate c=1 latency. This client pre-encodes every
request once and per response only finds the header end, the status and Content-Length,
and slices the body: a few µs of client CPU per request. Every worker reports its CPU
time over the measured window so the report can show that the client was not the
bottleneck.

Two job kinds, run by a persistent worker process (`worker_main`) driven over a Pipe:

* `latency` – one blocking socket, `warmup` requests, then `requests` timed round trips
  (concurrency 1). Sends "mark" to the coordinator when the timed part starts.
* `throughput` – `conns` asyncio-protocol connections, each with exactly one request in
  flight (closed loop). Sends "ready" once connected, receives `(t_warm, t_start, t_end)`
  on the system-wide monotonic clock, warms up until `t_start`, counts completions in
  `[t_start, t_end)`, then lets every connection finish its last request and closes.

Responses are checked: a non-2xx status is an error, and the first response of each
connection plus every `validate_every`-th one is parsed with orjson and its record count
compared with the expected one (`count` of a write, `len(records)` of a diff).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import traceback
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from collections.abc import Callable

_CRLF2 = b"\r\n\r\n"


def build_request(host: str, port: int, path: str, body: bytes, method: str = "POST") -> bytes:
    """One pre-encoded request; a GET or HEAD without a body carries no body headers."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    if body or method not in ("GET", "HEAD"):
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode("ascii") + body


def _parse_head(buf: bytearray, end: int) -> tuple[int, int, bool]:
    """(status, content_length, server_closes) of the header block `buf[:end]`.

    Hypercorn answers the `keep_alive_max_requests`-th (1000th) request of a connection
    with `connection: close`; the client then reconnects, as any HTTP/1.1 client would.
    """
    status = int(buf[9:12])
    head = bytes(buf[:end]).lower()
    i = head.find(b"\r\ncontent-length:")
    if i < 0:
        raise ValueError(f"response without Content-Length: {head[:300]!r}")
    j = head.find(b"\r\n", i + 17)
    return status, int(head[i + 17 : j if j >= 0 else None]), b"\r\nconnection: close" in head


def check_body(kind: str, body: bytes | bytearray, expect: int) -> str | None:
    """None if the response carries `expect` records, else a description of what it has."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return f"undecodable response: {exc}"
    got = obj.get("count") if kind == "write" else len(obj.get("records") or ())
    if got != expect:
        return f"{kind}: expected {expect} records, got {got}: {bytes(body[:200])!r}"
    return None


class BlockingConn:
    """One keep-alive connection, one request at a time (latency runs and set-up)."""

    def __init__(self, host: str, port: int, timeout: float = 60.0) -> None:
        self.addr = (host, port)
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.buf = bytearray()
        self.connects = 0
        self._connect()

    def ensure_connected(self) -> None:
        if self.sock is None:
            self._connect()

    def _connect(self) -> None:
        self.sock = socket.create_connection(self.addr, timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf.clear()
        self.connects += 1

    def request(self, req: bytes) -> tuple[int, bytes]:
        if self.sock is None:
            self._connect()
        sock, buf = self.sock, self.buf
        assert sock is not None
        sock.sendall(req)
        while (end := buf.find(_CRLF2)) < 0:
            chunk = sock.recv(262144)
            if not chunk:
                raise ConnectionError("server closed the connection")
            buf += chunk
        status, length, closes = _parse_head(buf, end)
        total = end + 4 + length
        while len(buf) < total:
            chunk = sock.recv(max(total - len(buf), 262144))
            if not chunk:
                raise ConnectionError("server closed the connection mid-response")
            buf += chunk
        body = bytes(buf[end + 4 : total])
        del buf[:total]
        if closes:
            self.close()
        return status, body

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


# ------------------------------------------------------------------------------------------
# throughput: closed-loop asyncio protocols


class _Run:
    def __init__(self, job: dict[str, Any]) -> None:
        self.requests: list[bytes] = job["requests"]
        self.records_per_request: int = job["records_per_request"]
        self.kind: str = job["kind"]
        self.validate_every: int = job.get("validate_every", 50)
        self.host: str = job["host"]
        self.port: int = job["port"]
        self.reconnects = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.t_start = float("inf")
        self.t_end = float("inf")
        self.stopping = False
        self.open = 0
        self.done: asyncio.Future[None] | None = None
        # measured window
        self.count = 0
        self.bytes_in = 0
        self.latencies: list[float] = []
        # whole run
        self.total = 0
        self.errors = 0
        self.first_error: str | None = None

    def error(self, msg: str) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = msg

    def conn_closed(self) -> None:
        self.open -= 1
        if self.open == 0 and self.done is not None and not self.done.done():
            self.done.set_result(None)


class _Proto(asyncio.Protocol):
    def __init__(self, run: _Run, offset: int, start: bool = False) -> None:
        self.run = run
        self.start = start
        self.server_closes = False
        self.i = offset
        self.buf = bytearray()
        self.total = -1
        self.hend = 0
        self.status = 0
        self.t0 = 0.0
        self.n = 0
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.start:
            self.send_next()

    def send_next(self) -> None:
        run = self.run
        t = time.monotonic()
        if run.stopping or t >= run.t_end:
            self.close()
            return
        reqs = run.requests
        req = reqs[self.i % len(reqs)]
        self.i += 1
        self.t0 = t
        assert self.transport is not None
        self.transport.write(req)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.total < 0:
            end = buf.find(_CRLF2)
            if end < 0:
                return
            self.status, length, self.server_closes = _parse_head(buf, end)
            self.hend = end + 4
            self.total = self.hend + length
        if len(buf) < self.total:
            return
        t = time.monotonic()
        run = self.run
        total = self.total
        run.total += 1
        if not 200 <= self.status < 300:
            run.error(f"HTTP {self.status}: {bytes(buf[self.hend : total][:300])!r}")
        elif self.n % run.validate_every == 0:
            err = check_body(run.kind, buf[self.hend : total], run.records_per_request)
            if err is not None:
                run.error(err)
        self.n += 1
        if run.t_start <= t < run.t_end:
            run.count += 1
            run.bytes_in += total
            run.latencies.append(t - self.t0)
        del buf[:total]
        self.total = -1
        if self.server_closes:
            self.reconnect()
        else:
            self.send_next()

    def reconnect(self) -> None:
        """Replace this connection by a new one that goes on from the same request index."""
        run = self.run
        self.closed = True  # not counted as closed: the replacement takes over its slot
        assert self.transport is not None
        self.transport.close()
        if run.stopping or time.monotonic() >= run.t_end:
            run.conn_closed()
            return
        run.reconnects += 1
        loop = asyncio.get_running_loop()

        async def connect() -> None:
            try:
                await loop.create_connection(
                    lambda: _Proto(run, self.i, start=True), run.host, run.port
                )
            except OSError as exc:
                run.error(f"reconnect failed: {exc!r}")
                run.conn_closed()

        task = loop.create_task(connect())
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            if not self.run.stopping and time.monotonic() < self.run.t_end:
                self.run.error(f"connection lost: {exc!r}")
            self.run.conn_closed()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self.run.conn_closed()


async def _throughput(job: dict[str, Any], ctl: Any) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    run = _Run(job)
    protos: list[_Proto] = []
    step = max(1, len(run.requests) // max(1, job["conns"]))
    for k in range(job["conns"]):
        offset = job.get("offset", 0) + k * step
        _, proto = await loop.create_connection(
            lambda off=offset: _Proto(run, off), job["host"], job["port"]
        )
        protos.append(proto)
    run.open = len(protos)
    run.done = loop.create_future()
    ctl.send("ready")
    t_warm, t_start, t_end = ctl.recv()  # the loop is idle: a blocking wait is fine
    run.t_start, run.t_end = t_start, t_end
    cpu: dict[str, float] = {}
    loop.call_at(t_start, lambda: cpu.__setitem__("start", time.process_time()))
    loop.call_at(t_end, lambda: cpu.__setitem__("end", time.process_time()))
    await asyncio.sleep(max(0.0, t_warm - time.monotonic()))
    for proto in protos:
        proto.send_next()
    try:
        await asyncio.wait_for(run.done, timeout=t_end - time.monotonic() + 60)
    except TimeoutError:
        run.error("connections did not finish within 60 s after the window")
        run.stopping = True
        for proto in protos:
            proto.close()
    await asyncio.sleep(0)  # let the last call_at fire if the window just ended
    cpu_s = cpu.get("end", time.process_time()) - cpu.get("start", 0.0)
    return {
        "count": run.count,
        "bytes": run.bytes_in,
        "latencies": run.latencies,
        "total": run.total,
        "errors": run.errors,
        "first_error": run.first_error,
        "reconnects": run.reconnects,
        "cpu_s": cpu_s,
        "window_s": t_end - t_start,
    }


# ------------------------------------------------------------------------------------------
# latency: one blocking connection


def _latency(job: dict[str, Any], ctl: Any) -> dict[str, Any]:
    conn = BlockingConn(job["host"], job["port"])
    reqs: list[bytes] = job["requests"]
    expect: int = job["records_per_request"]
    errors = 0
    first_error: str | None = None
    lat: list[float] = []
    try:
        n_warm, n = job["warmup"], job["requests_n"]
        for i in range(n_warm):
            status, body = conn.request(reqs[i % len(reqs)])
            if not 200 <= status < 300 or (i == 0 and check_body(job["kind"], body, expect)):
                errors += 1
                first_error = first_error or f"HTTP {status}: {body[:300]!r}"
        ctl.send("mark")
        perf = time.perf_counter
        cpu0, t0 = time.process_time(), perf()
        for i in range(n):
            req = reqs[i % len(reqs)]
            a = perf()
            status, body = conn.request(req)
            lat.append(perf() - a)
            conn.ensure_connected()  # a `connection: close` reconnect stays out of the timing
            if not 200 <= status < 300:
                errors += 1
                first_error = first_error or f"HTTP {status}: {body[:300]!r}"
        elapsed, cpu_s = perf() - t0, time.process_time() - cpu0
    finally:
        conn.close()
    return {
        "count": n,
        "latencies": lat,
        "errors": errors,
        "first_error": first_error,
        "reconnects": conn.connects - 1,
        "cpu_s": cpu_s,
        "window_s": elapsed,
    }


def serve_jobs(ctl: Any, cpu: int | None, handlers: dict[str, Callable[..., Any]]) -> None:
    """A client process's loop: pin to `cpu`, then run each job the coordinator sends
    (`handlers[job["mode"]](job, ctl)`) and send back its result, until it sends None.
    A failing job answers `{"fatal": ...}` instead of killing the process."""
    if cpu is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})
    while True:
        job = ctl.recv()
        if job is None:
            return
        try:
            handler = handlers.get(job["mode"])
            if handler is None:
                raise ValueError(f"unknown job {job['mode']!r}")
            result = handler(job, ctl)
        except Exception as exc:
            result = {"fatal": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"}
        ctl.send(result)


def worker_main(ctl: Any, cpu: int | None) -> None:
    """Serve latency and throughput jobs until the coordinator sends None."""
    serve_jobs(
        ctl,
        cpu,
        {
            "latency": _latency,
            "throughput": lambda job, c: asyncio.run(_throughput(job, c)),
        },
    )
