"""Raw-socket fuzzing of topicd's own HTTP/1.1 path (the CI subset of `bench/fuzz.py`).

Method: a real in-process server on port 0, raw trio sockets sending exact bytes.
Invariants checked on every exchange: no `5xx` (none of these requests can meet a
documented `503`), every error answer is the canonical JSON body, no traceback or error in
the log, a request smuggled inside another is never executed (the engine never sees the
topic it would create), pipelined requests are answered in order or the connection
closes, and nothing waits past the configured timeouts.

"At once" is shown without wall-clock asserts: the header timeout is configured at an
hour, so an answer that arrives at all did not come from the timeout (the readers give up
after 10 s). The timeouts themselves are driven by Trio's `MockClock` (frozen, moved by
`advance`), so a slow-drip client is cut off exactly when virtual time passes the bound.
"""

from __future__ import annotations

import logging
import re
import socket
from contextlib import asynccontextmanager

import orjson
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.helpers import Reader, served
from topicd.http.app import gate_of
from topicd.testing.fake_clock import advance
from topicd.testing.harness import make_config

HOUR_MS = 3_600_000
MAX_BODY = 4096
H = b"Host: x\r\n"
JSON = b"Content-Type: application/json\r\n"
CANARY = (
    b"POST /v0/topics/smuggled HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b'Content-Length: 24\r\n\r\n{"records":[{"data":1}]}'
)
AFTER = b"PUT /v0/topics/after HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
CLIENT_HELLO = bytes.fromhex("1603010200010001fc0303") + bytes(range(32)) + b"\x00" * 64


def config(**server: object):
    return make_config(
        server={"port": 0, "header_read_timeout_ms": HOUR_MS, **server},
        limits={"max_body_bytes": MAX_BODY},
    )


@pytest.fixture(params=["direct", "handoff"])
async def server(request, caplog):
    """The default server, and one that hands every request but probes and streams to
    Hypercorn once its first head is read (`server.direct_http1 = false`)."""
    cfg = config() if request.param == "direct" else config(direct_http1=False)
    with caplog.at_level(logging.INFO):
        async with served(cfg) as running:
            yield (request.param, *running)
    assert_clean_log(caplog)


def assert_clean_log(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info is not None]
    assert bad == [], [r.getMessage() for r in bad]


@asynccontextmanager
async def connection(host: str, port: int):
    stream = await trio.open_tcp_stream(host, port)
    try:
        yield stream, Reader(stream)
    finally:
        await stream.aclose()


HANDED_OFF = (b"expect:", b"transfer-encoding:", b"upgrade:")


def canary_runs(engine) -> int:
    """How many times `CANARY` ran (each run writes one record)."""
    return engine.topics["smuggled"].head_seq if "smuggled" in engine.topics else 0


def check_error(status: int, head: bytes, body: bytes) -> dict:
    """An error answer: not a 5xx, the canonical body, the pressure header."""
    assert 400 <= status < 500, (status, body)
    assert b"x-topicd-pressure: " in head
    doc = orjson.loads(body)
    assert set(doc) == {"error"} and isinstance(doc["error"]["code"], str), doc
    return doc["error"]


async def answer_then_eof(r: Reader) -> tuple[int, bytes, bytes]:
    """The one answer on a connection the server must close after it."""
    status, head, body = await r.raw()
    assert b"connection: close" in head
    assert await r.eof()
    assert r.buf == b"", r.buf  # nothing after the answer: no second request was run
    return status, head, body


# ------------------------------------------------------------------------------------------
# request smuggling


def smuggle(framing: bytes) -> bytes:
    """A POST whose body, read as `Transfer-Encoding: chunked`, ends at `0\\r\\n\\r\\n` and
    leaves `CANARY` as a second request, while its `Content-Length` covers it all."""
    body = b"0\r\n\r\n" + CANARY
    framing = framing.replace(b"{n}", b"%d" % len(body))
    return b"POST /v0/topics/a HTTP/1.1\r\n" + H + JSON + framing + b"\r\n" + body + AFTER


SMUGGLING = {
    "CL.TE": b"Content-Length: {n}\r\nTransfer-Encoding: chunked\r\n",
    "TE.CL": b"Transfer-Encoding: chunked\r\nContent-Length: {n}\r\n",
    "CL.TE upper": b"Content-Length: {n}\r\nTRANSFER-ENCODING: CHUNKED\r\n",
    "CL.TE list": b"Content-Length: {n}\r\nTransfer-Encoding: identity, chunked\r\n",
    "CL.TE twice": b"Content-Length: {n}\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n",
    "CL.TE space colon": b"Content-Length: {n}\r\nTransfer-Encoding : chunked\r\n",
    "CL.TE tab value": b"Content-Length: {n}\r\nTransfer-Encoding:\tchunked\t\r\n",
    "CL.TE folded": b"Content-Length: {n}\r\nTransfer-Encoding:\r\n chunked\r\n",
    "CL.TE xchunked": b"Content-Length: {n}\r\nTransfer-Encoding: xchunked\r\n",
    "CL.CL": b"Content-Length: 5\r\nContent-Length: {n}\r\n",
    "CL list": b"Content-Length: 5, {n}\r\n",
    "CL.TE bare LF": b"Content-Length: {n}\nTransfer-Encoding: chunked\r\n",
    "TE 1.0-style": b"Transfer-Encoding: chunked, identity\r\n",
}


@pytest.mark.parametrize("framing", list(SMUGGLING.values()), ids=list(SMUGGLING))
async def test_ambiguous_framing_is_400_then_close_and_nothing_behind_it_runs(server, framing):
    _mode, engine, app, host, port = server
    raw = smuggle(framing)
    async with connection(host, port) as (stream, r):
        await stream.send_all(raw)
        status, head, body = await answer_then_eof(r)
        check_error(status, head, body)
    assert status == 400
    assert not {"a", "smuggled", "after"} & set(engine.topics)
    assert gate_of(app).requests_by_path == {"direct": 0, "hypercorn": 0}  # refused unparsed


@pytest.mark.parametrize(
    "framing", [SMUGGLING["CL.TE"], SMUGGLING["TE.CL"]], ids=["CL.TE", "TE.CL"]
)
async def test_after_a_hand_off_hypercorn_also_closes_on_cl_with_te(server, framing):
    """A `HEAD` hands the connection to Hypercorn; its next request is h11's to parse, and
    the gate refuses the framing conflict with `connection: close`."""
    _mode, engine, _app, host, port = server
    async with connection(host, port) as (stream, r):
        await stream.send_all(b"HEAD /v0/topics HTTP/1.1\r\n" + H + b"\r\n")
        await r.head()
        r.buf = r.buf[r.buf.index(b"\r\n\r\n") + 4 :]
        await stream.send_all(smuggle(framing))
        status, head, body = await answer_then_eof(r)
    assert check_error(status, head, body)["message"] == (
        "both Content-Length and Transfer-Encoding"
    )
    assert not {"a", "smuggled", "after"} & set(engine.topics)


async def test_a_chunked_body_then_a_pipelined_request_both_run_in_order(server):
    """Unambiguous chunked framing is not smuggling: the request after it is served."""
    _mode, engine, _app, host, port = server
    chunk = b'{"records":[{"data":1}]}'
    async with connection(host, port) as (stream, r):
        await stream.send_all(
            b"POST /v0/topics/c HTTP/1.1\r\n" + H + JSON + b"Transfer-Encoding: chunked\r\n\r\n"
            b"%x;ext=1\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk) + AFTER
        )
        assert (await r.response())[0] == 201
        assert (await r.response())[0] == 201
    assert {"c", "after"} <= set(engine.topics)


@pytest.mark.parametrize(
    "chunks",
    [
        b"zz\r\n{}\r\n0\r\n\r\n",  # not hex
        b"-1\r\n{}\r\n0\r\n\r\n",
        b"2\r\n{}0\r\n\r\n",  # no CRLF after the data
        b"2\n{}\n0\n\n",  # bare LF
        b"ffffffffffffffffffff\r\n",  # an absurd size
    ],
)
async def test_malformed_chunked_bodies_end_the_connection(server, chunks):
    _mode, engine, _app, host, port = server
    async with connection(host, port) as (stream, _r):
        await stream.send_all(
            b"POST /v0/topics/m HTTP/1.1\r\n"
            + H
            + JSON
            + b"Transfer-Encoding: chunked\r\n\r\n"
            + chunks
            + CANARY
        )
        await stream.send_eof()
        buf = b""
        with trio.fail_after(10):
            while data := await stream.receive_some(65536):
                buf += data
    assert len(re.findall(rb"HTTP/1\.1 \d{3} [A-Z]", buf)) <= 1, buf  # one answer at most
    if buf:
        status = int(buf[9:12])
        head, _, body = buf.partition(b"\r\n\r\n")
        check_error(
            status,
            head.lower(),
            body[: int(re.search(rb"(?i)content-length: (\d+)", head).group(1))],
        )
    assert "smuggled" not in engine.topics


# ------------------------------------------------------------------------------------------
# heads refused at once


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /v0/topics HTTP/1.1\nHost: x\n\n",
        b"POST /v0/topics/t HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
        b"GET /v0/topics HTTP/1.1\r\nHost: x\n",
        CLIENT_HELLO,
        CLIENT_HELLO[:5],
        b"\x00\x00\x00\x00",
        b"GET /v0/topics HTTP/1.1\r\nX: a\rb",
    ],
    ids=[
        "bare LF GET",
        "bare LF POST",
        "mixed",
        "ClientHello",
        "TLS record head",
        "NULs",
        "bare CR",
    ],
)
async def test_a_head_that_can_never_be_valid_is_answered_at_once(server, raw):
    _mode, engine, _app, host, port = server
    async with connection(host, port) as (stream, r):
        await stream.send_all(raw)  # (and nothing more: the connection stays open)
        status, head, body = await answer_then_eof(r)
    err = check_error(status, head, body)
    assert status == 400 and err["code"] == "invalid_request"
    if raw.startswith(b"\x16"):
        assert "TLS" in err["message"]
    assert not engine.topics


def examples(strategy: st.SearchStrategy, n: int) -> list:
    """`n` examples of `strategy`, the same ones every run (Hypothesis explores; the test
    replays them against one server, so a failure names its input, unshrunk)."""
    out: list = []

    @settings(
        max_examples=n,
        database=None,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: object) -> None:
        out.append(example)

    collect()
    return out


async def test_fuzzed_heads_never_5xx_never_hang_never_run_what_follows(server):
    """Valid heads, mutated: bytes flipped, inserted or deleted, fields repeated, lengths
    wrong, bodies short or long; each sent on its own connection, the client half-closes.
    The server answers in order (each answer complete) and closes, or closes at once."""
    for raw in examples(fuzzed_requests(), 150):
        try:
            await one_fuzzed_exchange(server, raw)
        except (AssertionError, ValueError) as e:
            raise AssertionError(f"request {raw!r}: {e}") from e


async def one_fuzzed_exchange(server, raw: bytes) -> None:
    mode, engine, _app, host, port = server
    before = canary_runs(engine)
    async with connection(host, port) as (stream, _r):
        await stream.send_all(raw + CANARY)
        await stream.send_eof()
        buf = b""
        with trio.fail_after(10):
            while more := await stream.receive_some(65536):
                buf += more
    while buf:
        head, sep, rest = buf.partition(b"\r\n\r\n")
        assert sep and head.startswith(b"HTTP/1.1 "), buf[:200]
        status = int(head[9:12])
        lowered = head.lower()
        m = re.search(rb"\r\ncontent-length: (\d+)", lowered)
        n = int(m.group(1)) if m else 0
        body, buf = rest[:n], rest[n:]
        assert status < 500, (raw, head, body)
        if len(body) < n:
            # cut short: Hypercorn takes the client's half-close for a disconnect and
            # drops the rest of an answer under way (the direct path never does)
            handed = mode == "handoff" or any(f in raw.lower() for f in HANDED_OFF)
            assert handed and not buf, (head, body)
            break
        if status >= 400:
            check_error(status, lowered, body)
    # the canary comes right after the fuzzed request: it may run only if that request's
    # framing was unambiguous (a plain Content-Length, or none)
    ran = canary_runs(engine) - before
    low = raw.lower()
    if low.count(b"content-length") > 1 or (b"content-length" in low and b"transfer-enc" in low):
        assert ran == 0, "a request behind an ambiguous framing ran"


VALID_LINES = [
    b"GET /v0/topics HTTP/1.1",
    b"GET /v0/health HTTP/1.1",
    b"POST /v0/topics/f HTTP/1.1",
    b"POST /v0/topics/f/diff HTTP/1.1",
    b"PUT /v0/topics/f HTTP/1.1",
    b"GET /v0/topics/f HTTP/1.0",
    b"DELETE /v0/nowhere HTTP/1.1",
]
EXTRA_FIELDS = [
    b"Host: x",
    b"Content-Length: 2",
    b"Content-Length: 0",
    b"Content-Length: 99",
    b"Transfer-Encoding: chunked",
    b"Connection: close",
    b"Expect: 100-continue",
    b"X-Pad: " + b"p" * 200,
    b" folded",
    b"Authorization: Bearer nope",
]


@st.composite
def fuzzed_requests(draw: st.DrawFn) -> bytes:
    lines = [draw(st.sampled_from(VALID_LINES)), b"Host: x", b"Content-Type: application/json"]
    lines += draw(st.lists(st.sampled_from(EXTRA_FIELDS), max_size=4))
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    body = draw(st.sampled_from([b"", b"{}", b'{"records":[{"data":1}]}', b"0\r\n\r\n", b"{"]))
    raw = bytearray(head + body)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(raw)))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        byte = draw(st.sampled_from([0x00, 0x0A, 0x0D, 0x20, 0x09, 0x3A, 0x7F, 0xFF, 0x16, 0x41]))
        if op == "insert":
            raw[at:at] = bytes([byte])
        elif at < len(raw):
            if op == "flip":
                raw[at] = byte
            else:
                del raw[at]
    return bytes(raw)


# ------------------------------------------------------------------------------------------
# pipelining, bodies, half-closed connections


async def test_pipelined_requests_are_answered_in_order(server):
    kinds = st.lists(st.sampled_from(["write", "get", "health", "bad"]), min_size=1, max_size=12)
    cuts = st.lists(st.integers(1, 2000), max_size=6)
    for example in examples(st.tuples(kinds, cuts), 25):
        await pipelined_exchange(server, *example)


async def pipelined_exchange(server, kinds: list[str], cuts: list[int]) -> None:
    _mode, engine, _app, host, port = server
    before = engine.topics["p"].head_seq if "p" in engine.topics else 0
    parts = []
    for kind in kinds:
        if kind == "write":
            body = b'{"records":[{"data":1}]}'
            parts.append(
                b"POST /v0/topics/p HTTP/1.1\r\n"
                + H
                + JSON
                + b"Content-Length: %d\r\n\r\n" % len(body)
                + body
            )
        elif kind == "get":
            parts.append(b"GET /v0/topics HTTP/1.1\r\n" + H + b"\r\n")
        elif kind == "health":
            parts.append(b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
        else:
            parts.append(
                b"POST /v0/topics/p HTTP/1.1\r\n"
                + H
                + b"Content-Type: text/plain\r\nContent-Length: 1\r\n\r\nx"
            )
    raw = b"".join(parts)
    async with connection(host, port) as (stream, r):
        at = 0
        for cut in [*sorted({c % len(raw) for c in cuts}), len(raw)]:
            if cut > at:
                await stream.send_all(raw[at:cut])
                await trio.lowlevel.checkpoint()
                at = cut
        seq = before
        for kind in kinds:
            status, _head, doc = await r.response()
            if kind == "write":
                assert status in (200, 201)
                assert doc["seqs"] == [seq + 1]  # in order: each write's seq follows
                seq += 1
            elif kind == "bad":
                assert (status, doc["error"]["code"]) == (415, "unsupported_media_type")
            elif kind == "get":
                assert status == 200 and "topics" in doc
            else:
                assert status == 200 and doc["status"] in ("ok", "degraded")


async def test_a_body_shorter_than_declared_then_half_close_runs_nothing(server):
    _mode, engine, _app, host, port = server
    async with connection(host, port) as (stream, r):
        await stream.send_all(
            b"POST /v0/topics/s HTTP/1.1\r\n" + H + JSON + b"Content-Length: 40\r\n\r\n"
            b'{"records":[{"data":1}]}'
        )
        await stream.send_eof()
        assert await r.eof()
    # the direct path closes without an answer; Hypercorn may say 400 first
    assert r.buf == b"" or r.buf.startswith(b"HTTP/1.1 400 "), r.buf
    assert "s" not in engine.topics


async def test_a_body_longer_than_declared_runs_once_and_the_rest_is_a_bad_head(server):
    _mode, engine, _app, host, port = server
    body = b'{"records":[{"data":1}]}'
    async with connection(host, port) as (stream, r):
        await stream.send_all(
            b"POST /v0/topics/l HTTP/1.1\r\n"
            + H
            + JSON
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
            + b'{"records":[{"data":2}]}\r\n\r\n'
        )
        status, _head, doc = await r.response()
        assert status == 201 and doc["seqs"] == [1]
        status, head, rest = await answer_then_eof(r)
        check_error(status, head, rest)
    assert engine.topics["l"].head_seq == 1


async def test_a_complete_request_then_half_close_is_answered_or_closed(server):
    """The direct path answers a request whose client then half-closes; Hypercorn takes
    the half-close for a disconnect and may close without the answer (never a 5xx)."""
    mode, _engine, _app, host, port = server
    async with connection(host, port) as (stream, r):
        await stream.send_all(b"GET /v0/topics HTTP/1.1\r\n" + H + b"\r\n")
        await stream.send_eof()
        assert await r.eof()
    if mode == "direct" or r.buf:
        assert r.buf.startswith(b"HTTP/1.1 200 OK\r\n"), r.buf[:100]
    if mode == "direct":
        _head, _, body = r.buf.partition(b"\r\n\r\n")
        assert "topics" in orjson.loads(body)


async def test_a_half_close_mid_head_closes_without_an_answer(server):
    _mode, _engine, _app, host, port = server
    async with connection(host, port) as (stream, r):
        await stream.send_all(b"GET /v0/topics HTTP/1.1\r\nHo")
        await stream.send_eof()
        assert await r.eof()
    assert r.buf == b""


# ------------------------------------------------------------------------------------------
# timeouts on a virtual clock


async def settle() -> None:
    """Let the server take what the client sent: every task blocked, and no socket
    event for a moment (Trio's idle cushion), so its timers start before virtual time
    moves. (A task waiting on a socket counts as blocked before the bytes reach it.)"""
    await trio.testing.wait_all_tasks_blocked(cushion=0.05)


def silent_and_open(stream: trio.SocketStream) -> bool:
    """Nothing to read and no EOF yet, asked without blocking."""
    with socket.fromfd(stream.socket.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
        try:
            dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
    return False


@pytest.mark.parametrize("mode", ["direct", "handoff"])
@pytest.mark.parametrize(
    "sent",
    [
        b"",  # idle from the start
        b"GET /v0/topics HTTP/1.1\r\nHo",  # slowloris: a head that never ends
        b"POST /v0/topics/d HTTP/1.1\r\nHost: x\r\n" + JSON + b"Content-Length: 40\r\n\r\n{",
    ],
    ids=["idle", "slow head", "slow body"],
)
async def test_slow_clients_are_cut_off_at_the_header_timeout(mock_clock, mode, sent):
    timeout_s = 5.0
    server = {"port": 0, "header_read_timeout_ms": int(timeout_s * 1000)}
    if mode == "handoff":
        server["direct_http1"] = False
    cfg = make_config(server=server, limits={"max_body_bytes": MAX_BODY})
    async with served(cfg) as (engine, _app, host, port):
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(sent)
        await settle()
        # dripping a byte a second does not extend the bound
        for _ in range(4):
            await advance(mock_clock, 1.0)
            assert silent_and_open(stream)
            if sent:
                await stream.send_all(b"x" if sent.endswith(b"{") else b"s")
                await settle()
        await advance(mock_clock, 0.9)
        assert silent_and_open(stream)
        await advance(mock_clock, 0.2)  # past the bound
        got = b""
        while data := await stream.receive_some(65536):
            got += data
        # closed; a body Hypercorn was reading is answered first (the framework's 400)
        assert got == b"" or (
            mode == "handoff" and got.startswith(b"HTTP/1.1 400 ") and b"in time" in got
        ), got
        await stream.aclose()
        assert "d" not in engine.topics


async def test_an_idle_keep_alive_connection_is_closed_at_the_timeout(mock_clock):
    cfg = make_config(server={"port": 0, "header_read_timeout_ms": 5000})
    async with served(cfg) as (_engine, _app, host, port):
        stream = await trio.open_tcp_stream(host, port)
        r = Reader(stream)
        await stream.send_all(b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
        assert (await r.response())[0] == 200
        await settle()
        await advance(mock_clock, 4.9)
        assert silent_and_open(stream)
        await advance(mock_clock, 0.2)
        assert await r.eof()
        await stream.aclose()


# ------------------------------------------------------------------------------------------
# many idle connections


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_a_thousand_idle_connections_leave_probes_answered_and_nothing_behind(caplog):
    cfg = config()
    with caplog.at_level(logging.INFO):
        async with served(cfg) as (_engine, _app, host, port):
            # one exchange first, so what the first request allocates is in the baseline
            async with connection(host, port) as (stream, r):
                await stream.send_all(b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
                await r.response()
            await trio.testing.wait_all_tasks_blocked()
            tasks0 = trio.lowlevel.current_statistics().tasks_living
            rss0 = rss_bytes()
            idle: list[trio.SocketStream] = []
            try:
                for i in range(1000):
                    stream = await trio.open_tcp_stream(host, port)
                    idle.append(stream)
                    if i % 3 == 1:
                        await stream.send_all(b"GET /v0/topics HTTP/1.1\r\nHo")  # a partial head
                    elif i % 3 == 2:
                        # served, then idle on keep-alive
                        await stream.send_all(b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
                for i in range(2, 1000, 3):
                    assert (await Reader(idle[i]).response())[0] == 200
                async with connection(host, port) as (stream, r):
                    for _ in range(3):
                        await stream.send_all(b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
                        status, _head, doc = await r.response()
                        assert status == 200 and doc["status"] in ("ok", "degraded")
            finally:
                for stream in idle:
                    await stream.aclose()
            # every connection's task ends once its client has gone (each wakes on its
            # EOF; the bound only stops a leak from hanging the test)
            with trio.move_on_after(10):
                while trio.lowlevel.current_statistics().tasks_living > tasks0:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            assert trio.lowlevel.current_statistics().tasks_living <= tasks0, (
                tasks0,
                trio.lowlevel.current_statistics().tasks_living,
            )
            assert rss_bytes() - rss0 < 64 * 2**20
    assert_clean_log(caplog)


async def test_a_connection_hypercorn_closes_leaves_no_task_behind():
    """With every request given to Hypercorn (`sse.direct_write = false`), clients that
    leave in the middle of a head make Hypercorn close their connections; its idle timer
    (an hour here) must not keep each connection's task alive until it fires."""
    cfg = make_config(
        server={"port": 0, "header_read_timeout_ms": HOUR_MS}, sse={"direct_write": False}
    )
    async with served(cfg) as (_engine, _app, host, port):
        await trio.testing.wait_all_tasks_blocked()
        tasks0 = trio.lowlevel.current_statistics().tasks_living
        for _ in range(20):
            async with connection(host, port) as (stream, _r):
                await stream.send_all(b"GET /v0/topics HTTP/1.1\r\nHo")  # then gone
        # the bound only stops a leak from hanging the test; each task ends on its own
        with trio.move_on_after(10):
            while trio.lowlevel.current_statistics().tasks_living > tasks0:
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        assert trio.lowlevel.current_statistics().tasks_living <= tasks0
