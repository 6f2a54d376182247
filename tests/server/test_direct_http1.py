"""Plain HTTP/1.1 requests on the direct socket path (`server.direct_http1`).

Method: a real in-process server on port 0 and raw trio sockets, so the exact bytes on the
wire are under the test's control (pipelining, bodies split across segments, a client that
leaves mid-body). `topicd_http_requests_total{path}` (the gate's per-path counts) tells
which server path answered each request.
"""

from __future__ import annotations

import logging
import re
import socket

import orjson
import pytest
import trio
import trio.lowlevel
import trio.testing

from tests.server.helpers import Reader, permits_taken, served
from topicd.http.app import Gate, gate_of
from topicd.http.server import DirectExchange, _ready_bytes, send_answer
from topicd.testing.harness import make_config

MAX_BODY = 4096


FULL = {"client_permits": 1, "client_waiters": 0}  # with the permit held: full


@pytest.fixture
async def server():
    cfg = make_config(server={"port": 0}, limits={"max_body_bytes": MAX_BODY})
    async with served(cfg) as running:
        yield running


def by_path(app) -> dict[str, int]:
    return dict(gate_of(app).requests_by_path)


def post(path: str, doc: object, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    body = orjson.dumps(doc)
    return (
        b"POST %s HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n" % (path.encode(), version, len(body), extra)
    ) + body


async def test_a_keep_alive_connection_serves_every_route_directly_and_in_order(server):
    _engine, app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    r = Reader(stream)
    before = by_path(app)
    # five requests in one segment (pipelined): a PUT, three writes, a diff
    await stream.send_all(
        b"PUT /v0/topics/t HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
        + post("/v0/topics/t", {"records": [{"data": 1}]})
        + post("/v0/topics/t", {"records": [{"data": {"n": 2.50}}, {"data": 3}]})
        + post("/v0/topics/t", {"records": [{"data": 4}]})
        + post("/v0/topics/t/diff", {"from_seq": 0})
    )
    status, head, doc = await r.response()
    assert status in (200, 201) and doc["topic"] == "t"
    assert b"x-topicd-pressure: " in head
    seqs = []
    for _ in range(3):
        status, head, doc = await r.response()
        assert status in (200, 201), doc
        seqs += doc["seqs"]
    assert seqs == [1, 2, 3, 4]
    status, _, doc = await r.response()
    assert status == 200
    assert [rec["data"] for rec in doc["records"]] == [1, {"n": 2.50}, 3, 4]
    after = by_path(app)
    assert after["direct"] - before["direct"] == 5
    assert after["hypercorn"] == before["hypercorn"]
    await stream.aclose()


async def test_a_body_split_across_segments_is_assembled(server):
    _engine, app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    raw = post("/v0/topics/s", {"records": [{"data": "x" * 300}]})
    for i in range(0, len(raw), 37):
        await stream.send_all(raw[i : i + 37])
        await trio.lowlevel.checkpoint()
    status, _, doc = await Reader(stream).response()
    assert status == 201 and doc["seqs"] == [1]
    assert by_path(app)["hypercorn"] == 0
    await stream.aclose()


async def test_a_write_sojourn_counts_from_its_body_in_hand_not_its_head(server):
    """s6 reads the server's time: a client that sends a write's head, then its body
    later (a producer short of CPU), has its sojourn counted from the body. The server
    has read the head and waits for the body (every task blocked) before the body's
    moment is taken, so a sojourn counted from the head would start before it."""
    engine, _app, host, port = server
    soj = engine.sojourns
    stream = await trio.open_tcp_stream(host, port)
    raw = post("/v0/topics/slow", {"records": [{"data": 1}]})
    split = raw.index(b"\r\n\r\n") + 4
    await stream.send_all(raw[:split])  # the head alone
    await trio.testing.wait_all_tasks_blocked()  # the server holds the head, waits
    body_sent_at = trio.current_time()
    await stream.send_all(raw[split:])
    status, _, doc = await Reader(stream).response()
    assert status == 201 and doc["seqs"] == [1]
    assert soj.recorded == 1
    ((answered_at, took, _met),) = list(soj._done)
    assert answered_at - took >= body_sent_at - 1e-9  # stamped once the body was in hand
    await stream.aclose()


async def test_only_writes_that_met_another_make_the_sojourn_median():
    """A write alone in the server (no other write in hand when it came, none came before
    its answer) waited for no one's write: s6 keeps it out of its median, so one client
    writing batch after batch never raises it, whatever their size. Two writes held
    together at a taken permit met each other: both count."""
    cfg = make_config(server={"port": 0}, classes={"client_permits": 1, "client_waiters": 4})
    async with served(cfg) as (engine, app, host, port):
        soj = engine.sojourns
        stream = await trio.open_tcp_stream(host, port)
        r = Reader(stream)
        for i in range(3):  # one after the other: each alone
            await stream.send_all(post("/v0/topics/t", {"records": [{"data": i}]}))
            status, _, _ = await r.response()
            assert status in (200, 201)
        assert (soj.recorded, soj.alone) == (3, 3)
        assert soj.median_ms(trio.current_time()) is None
        other = await trio.open_tcp_stream(host, port)
        async with permits_taken(app):
            await stream.send_all(post("/v0/topics/t", {"records": [{"data": 3}]}))
            await trio.testing.wait_all_tasks_blocked()  # the first waits for the permit
            await other.send_all(post("/v0/topics/t", {"records": [{"data": 4}]}))
            await trio.testing.wait_all_tasks_blocked()  # and so does the second
        for s in (stream, other):
            status, _, _ = await Reader(s).response()
            assert status == 200
        assert (soj.recorded, soj.alone) == (5, 3)
        median = soj.median_ms(trio.current_time())
        assert median is not None and median > 0
        await stream.aclose()
        await other.aclose()


async def test_a_client_gone_mid_body_applies_nothing(server):
    engine, _app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    raw = post("/v0/topics/gone", {"records": [{"data": 1}]})
    await stream.send_all(raw[:-5])
    await stream.send_eof()
    assert await Reader(stream).eof()
    assert "gone" not in engine.topics


async def test_errors_keep_the_connection_and_use_the_canonical_body(server):
    _engine, app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    r = Reader(stream)
    await stream.send_all(
        b"POST /v0/topics/e HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
        b"Content-Length: 2\r\n\r\n{}"
        + post("/v0/topics/e", {"records": "nope"})
        + b"DELETE /v0/nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
        + post("/v0/topics/e", {"records": [{"data": 1}]})
    )
    status, _, doc = await r.response()
    assert (status, doc["error"]["code"]) == (415, "unsupported_media_type")
    status, _, doc = await r.response()
    assert (status, doc["error"]["code"]) == (400, "invalid_request")
    status, _, doc = await r.response()
    assert status in (404, 405) and "code" in doc["error"]
    status, _, doc = await r.response()
    assert status == 201 and doc["seqs"] == [1]
    assert by_path(app)["hypercorn"] == 0
    await stream.aclose()


async def test_connection_close_and_http10_end_the_connection_after_the_answer(server):
    engine, _app, host, port = server
    for req in (
        post("/v0/topics/c", {"records": [{"data": 1}]}, extra=b"Connection: close\r\n"),
        post("/v0/topics/c", {"records": [{"data": 2}]}, version=b"1.0"),
    ):
        stream = await trio.open_tcp_stream(host, port)
        r = Reader(stream)
        await stream.send_all(req)
        status, head, _ = await r.response()
        assert status in (200, 201)
        assert b"connection: close" in head
        assert await r.eof()
    assert engine.topics["c"].head_seq == 2


async def test_what_the_direct_path_leaves_to_hypercorn_still_works(server):
    """HEAD, a chunked body, `Expect: 100-continue` and a body over the limit go to
    Hypercorn, on the same connection after direct requests."""
    engine, app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    r = Reader(stream)
    await stream.send_all(post("/v0/topics/h", {"records": [{"data": 1}]}))
    assert (await r.response())[0] == 201
    assert by_path(app) == {"direct": 1, "hypercorn": 0}
    chunk = b'{"records":[{"data":2}]}'
    await stream.send_all(
        b"POST /v0/topics/h HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk)
    )
    status, _, doc = await r.response()
    assert status == 200 and doc["seqs"] == [2]
    assert by_path(app) == {"direct": 1, "hypercorn": 1}
    await stream.aclose()

    stream = await trio.open_tcp_stream(host, port)
    r = Reader(stream)
    await stream.send_all(b"HEAD /v0/topics/h HTTP/1.1\r\nHost: x\r\n\r\n")
    await r.head()
    assert r.buf.startswith(b"HTTP/1.1 200")
    assert r.buf.endswith(b"\r\n\r\n")  # no body after a HEAD
    await stream.aclose()

    stream = await trio.open_tcp_stream(host, port)
    big = post("/v0/topics/h", {"records": [{"data": "y" * MAX_BODY}]})
    await stream.send_all(big)
    status, _, doc = await Reader(stream).response()
    assert (status, doc["error"]["code"]) == (413, "payload_too_large")
    await stream.aclose()
    assert engine.topics["h"].head_seq == 2
    assert by_path(app)["hypercorn"] == 3


async def test_the_metric_reports_requests_by_server_path(server):
    _engine, _app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    r = Reader(stream)
    await stream.send_all(b"GET /v0/metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, body = await r.raw()
    assert status == 200
    text = body.decode()
    assert re.search(r'^topicd_http_requests_total\{path="direct"\} 1\.0$', text, re.M), text
    await stream.aclose()


def test_the_glance_reads_only_plain_heads():
    from topicd.http.server import _glance

    def g(raw: bytes):
        raw += b"\r\n"
        return _glance(raw, len(raw))

    head = b"POST /v0/topics/t?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n"
    assert g(head) == (b"POST", "/v0/topics/t", 12, True)
    assert g(head + b"Connection: close\r\n")[3] is False
    assert g(head.replace(b"HTTP/1.1", b"HTTP/1.0"))[3] is False
    assert g(b"GET /v0/topics HTTP/1.1\r\nHost: x\r\n") == (b"GET", "/v0/topics", 0, True)
    # anything unusual is left to the parser
    assert g(head + b"Transfer-Encoding: chunked\r\n") is None
    assert g(head + b"Expect: 100-continue\r\n") is None
    assert g(head + b"Upgrade: h2c\r\n") is None
    assert g(head + b"Content-Length: 13\r\n") is None
    assert g(head.replace(b"12", b"-1")) is None
    assert g(head.replace(b"12", b"1" * 16)) is None
    assert g(b"POST /v0/topics/t HTTP/2.0\r\nHost: x\r\n") is None
    assert g(b"POST  /v0/topics/t HTTP/1.1\r\nHost: x\r\n") is None


async def test_at_full_permits_with_auth_on_the_gate_still_answers_401_first():
    cfg = make_config(server={"port": 0}, auth={"api_keys": ("k1:rw",)}, classes=FULL)
    async with served(cfg) as (_engine, app, host, port), permits_taken(app):
        stream = await trio.open_tcp_stream(host, port)
        r = Reader(stream)
        await stream.send_all(post("/v0/topics/a", {"records": [{"data": 1}]}))
        status, _, doc = await r.response()
        assert (status, doc["error"]["code"]) == (401, "unauthorized")
        await stream.send_all(
            post("/v0/topics/a", {"records": [{"data": 1}]}, extra=b"Authorization: Bearer k1\r\n")
        )
        status, head, doc = await r.response()
        assert (status, doc["error"]["code"]) == (429, "throttled")
        assert b"retry-after: " in head
        await stream.aclose()


async def test_a_body_larger_than_the_head_limit_is_still_served_directly():
    """Only the head counts against `h11_max_incomplete_size`: a 1000-record batch sent
    in one segment with its head stays on the direct path."""
    async with served(make_config(server={"port": 0})) as (engine, app, host, port):
        stream = await trio.open_tcp_stream(host, port)
        doc = {"records": [{"data": {"i": i, "pad": "x" * 100}} for i in range(1000)]}
        raw = post("/v0/topics/big", doc)
        assert len(raw) > 100_000
        await stream.send_all(raw + raw)  # two, pipelined
        r = Reader(stream)
        status, _, first = await r.response()
        assert status == 201 and first["count"] == 1000
        status, _, second = await r.response()
        assert status == 200 and second["first_seq"] == 1001
        assert by_path(app) == {"direct": 2, "hypercorn": 0}
        assert engine.topics["big"].head_seq == 2000
        await stream.aclose()


async def test_a_quick_refusal_honours_connection_close_and_leaves_a_half_sent_body():
    cfg = make_config(server={"port": 0}, classes=FULL)
    async with served(cfg) as (engine, app, host, port), permits_taken(app) as pool:
        stream = await trio.open_tcp_stream(host, port)
        r = Reader(stream)
        await stream.send_all(
            post("/v0/topics/q", {"records": [{"data": 1}]}, extra=b"Connection: close\r\n")
        )
        status, head, doc = await r.response()
        assert (status, doc["error"]["detail"]["cause"]) == (429, "client_waiters")
        assert b"connection: close" in head
        assert await r.eof()
        stream = await trio.open_tcp_stream(host, port)
        raw = post("/v0/topics/q", {"records": [{"data": 2}]})
        await stream.send_all(raw[:-3])  # the body never completes
        await stream.send_eof()
        assert await Reader(stream).eof()  # closed without an answer
        assert pool.stats.rejected == 1
        assert "q" not in engine.topics


async def test_without_direct_http1_a_full_server_still_refuses_from_a_glance():
    cfg = make_config(server={"port": 0, "direct_http1": False}, classes=FULL)
    async with served(cfg) as (_engine, app, host, port), permits_taken(app) as pool:
        stream = await trio.open_tcp_stream(host, port)
        r = Reader(stream)
        for n in (1, 2):  # the connection stays usable
            await stream.send_all(post("/v0/topics/n", {"records": [{"data": n}]}))
            status, _, doc = await r.response()
            assert (status, doc["error"]["detail"]["cause"]) == (429, "client_waiters")
        assert pool.stats.rejected == 2
        assert by_path(app) == {"direct": 0, "hypercorn": 0}  # neither gate nor framework
        await stream.aclose()


_VOLATILE = (
    (rb"date: [^\r]*", b"date: -"),
    (rb"x-topicd-pressure: [0-9.]+", b"x-topicd-pressure: -"),
    (rb"content-length: \d+", b"content-length: -"),
    (rb'"(server_total_ms|fsync_ms|wal_append_ms)":[0-9.e-]+', rb'"\1":-'),
    (rb'"\$ts":\d+', b'"$ts":-'),
)


def _masked(raw: bytes) -> bytes:
    for pattern, repl in _VOLATILE:
        raw = re.sub(pattern, repl, raw)
    return raw


def _hot_requests(auth: bytes) -> list[bytes]:
    return [
        post("/v0/topics/h", {"records": [{"data": 1}]}, auth),  # 201
        post("/v0/topics/h", {"records": [{"data": {"n": 2}}, {"data": 3}]}, auth),
        post("/v0/topics/h", {"records": [{"data": 4}]}, auth + b"Idempotency-Key: k\r\n"),
        post("/v0/topics/h", {"records": [{"data": 4}]}, auth + b"Idempotency-Key: k\r\n"),
        post("/v0/topics/h", {"records": "nope"}, auth),  # 400
        post("/v0/topics/h", {"records": []}, auth + b"Content-Encoding: br\r\n"),  # 415
        post("/v0/topics/h", {"records": [{"data": 1}]}),  # 401: the gate refuses
        post("/v0/topics/h/diff", {"from_seq": 1, "limit": 2}, auth),
        post("/v0/topics/none/diff", {}, auth),  # 404
        post("/v0/topics/q/claim", {"node": "w", "max": 2}, auth),  # 404: no queue
        post("/v0/topics/h", {"records": [{"data": 5}]}, auth + b"Connection: close\r\n"),
    ]


async def _hot_answers(cfg, requests_of=_hot_requests) -> tuple[list[bytes], int]:
    """The raw answers to hot-endpoint requests (writes, diffs, queue verbs, their errors;
    `requests_of(auth)`) and to one other request, pipelined on one connection; and how
    many of them ran an ASGI exchange."""
    exchanges = 0
    real_run = DirectExchange.run

    async def counting_run(self, app):
        nonlocal exchanges
        exchanges += 1
        return await real_run(self, app)

    DirectExchange.run = counting_run
    try:
        async with served(cfg) as (_engine, _app, host, port):
            stream = await trio.open_tcp_stream(host, port)
            auth = b"Authorization: Bearer k1\r\n"
            requests = requests_of(auth)
            await stream.send_all(b"".join(requests))
            r = Reader(stream)
            answers = []
            for _ in requests:
                status, head, body = await r.raw()
                answers.append(_masked(head + b"\r\n\r\n" + body))
            assert await r.eof()
            await stream.aclose()
            stream = await trio.open_tcp_stream(host, port)  # one request that is not hot
            await stream.send_all(b"GET /v0/topics/h HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
            status, _, _ = await Reader(stream).raw()
            assert status == 200
            await stream.aclose()
    finally:
        DirectExchange.run = real_run
    return answers, exchanges


async def test_hot_endpoints_are_answered_without_an_exchange_and_alike(monkeypatch):
    """Writes, diffs and queue verbs on the direct path are answered by the gate itself
    (`Gate.serve_direct`: no ASGI exchange), byte for byte as the exchange answers them
    (timings, dates and the pressure value masked)."""
    cfg = make_config(server={"port": 0}, auth={"api_keys": ("k1:rw",)})
    direct, exchanges = await _hot_answers(cfg)
    assert exchanges == 1  # only the GET
    statuses = [int(a[9:12]) for a in direct]
    assert statuses == [201, 200, 200, 200, 400, 415, 401, 200, 404, 404, 200]
    assert b'"deduped":true' in direct[3]
    assert b"connection: close" in direct[-1]

    async def not_hot(self, scope, body):
        return None

    monkeypatch.setattr(Gate, "serve_direct", not_hot)  # every request takes the exchange
    via_exchange, exchanges = await _hot_answers(cfg)
    assert exchanges == len(via_exchange) + 1
    assert direct == via_exchange


def _seqs_requests(auth: bytes) -> list[bytes]:
    one = {"records": [{"data": 1}, {"data": 2}]}
    return [
        post("/v0/topics/h?return_seqs=false", one, auth),  # the client library's write
        post("/v0/topics/h?return_seqs=1", one, auth),
        post("/v0/topics/h?return_seqs=nope", one, auth),  # 400, from Quart
        post("/v0/topics/h?return_seqs=false&x=1", one, auth),  # another query: Quart
        post("/v0/topics/h?return_seqs=FALSE", one, auth),  # (Quart folds the case)
        post("/v0/topics/h/diff?return_seqs=false", {}, auth),  # Quart (unknown: ignored)
        post("/v0/topics/h?return_seqs=0", one, auth + b"Connection: close\r\n"),
    ]


async def test_a_write_with_return_seqs_alone_is_hot_and_answered_alike(monkeypatch):
    """The client library writes with `?return_seqs=false`: that query alone keeps a
    write on the gate's fast path (any other query, or that one on a diff, takes the
    exchange), and the answers are the exchange's byte for byte."""
    cfg = make_config(server={"port": 0}, auth={"api_keys": ("k1:rw",)})
    direct, exchanges = await _hot_answers(cfg, _seqs_requests)
    assert exchanges == 5  # =nope, the two-parameter query, =FALSE, the diff, the GET
    statuses = [int(a[9:12]) for a in direct]
    assert statuses == [201, 200, 400, 200, 200, 200, 200]
    assert b'"seqs"' not in direct[0] and b'"first_seq":1,"last_seq":2' in direct[0]
    assert b'"seqs":[3,4]' in direct[1]
    assert b'"seqs"' not in direct[-1]

    async def not_hot(self, scope, body):
        return None

    monkeypatch.setattr(Gate, "serve_direct", not_hot)
    via_exchange, exchanges = await _hot_answers(cfg, _seqs_requests)
    assert exchanges == len(via_exchange) + 1
    assert direct == via_exchange


async def test_a_hot_endpoint_on_the_direct_path_keeps_the_in_flight_cap():
    cfg = make_config(
        server={"port": 0}, auth={"api_keys": ("k1:rw",)}, limits={"max_inflight_per_key": 1}
    )
    async with served(cfg) as (_engine, app, host, port):
        gate = gate_of(app)
        key_id = gate.keys.authenticate("Bearer k1").key_id
        gate._inflight[key_id] = 1  # another request of k1 is in flight
        stream = await trio.open_tcp_stream(host, port)
        r = Reader(stream)
        auth = b"Authorization: Bearer k1\r\n"
        await stream.send_all(post("/v0/topics/a", {"records": [{"data": 1}]}, auth))
        status, _, doc = await r.response()
        assert (status, doc["error"]["code"]) == (429, "throttled")
        assert doc["error"]["detail"]["limit"] == "max_inflight_per_key"
        del gate._inflight[key_id]
        await stream.send_all(post("/v0/topics/a", {"records": [{"data": 1}]}, auth))
        status, _, doc = await r.response()
        assert status == 201
        assert gate._inflight == {}  # given back
        await stream.aclose()


def test_a_waiting_request_is_taken_without_a_wait():
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        assert _ready_bytes(a) == b""  # nothing yet: the stream's own read waits
        b.sendall(b"GET / HTTP/1.1\r\n")
        assert _ready_bytes(a) == b"GET / HTTP/1.1\r\n"
        b.close()
        assert _ready_bytes(a) == b""  # EOF: the stream's own read sees it
    finally:
        a.close()
        b.close()


async def test_an_answer_larger_than_the_socket_buffer_is_sent_whole():
    """`send_answer` sends what the socket takes at once and the rest through the
    stream, waiting for room: every byte arrives, in order."""
    a, b = trio.socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    stream = trio.SocketStream(a)
    data = bytes(range(256)) * 8192  # 2 MiB, far over the send buffer
    got = bytearray()

    async def read_all() -> None:
        while len(got) < len(data):
            chunk = await b.recv(65536)
            assert chunk
            got.extend(chunk)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await send_answer(stream, data)
    assert bytes(got) == data
    await stream.aclose()
    b.close()


async def test_a_hot_endpoint_on_the_direct_path_writes_its_access_log_line(caplog):
    cfg = make_config(server={"port": 0}, logging={"access_log": True})
    caplog.set_level(logging.INFO, logger="topicd.access")
    async with served(cfg) as (_engine, _app, host, port):
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(post("/v0/topics/logged", {"records": [{"data": 1}]}))
        status, _, _ = await Reader(stream).response()
        assert status == 201
        await stream.aclose()
    lines = [r.getMessage() for r in caplog.records if r.name == "topicd.access"]
    assert any(re.fullmatch(r"POST /v0/topics/:topic 201 [0-9.]+ms", line) for line in lines), lines
    assert not any("logged" in line for line in lines)  # names never reach the log
