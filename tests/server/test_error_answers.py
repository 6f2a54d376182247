"""Every answer is a JSON answer, on both server paths.

Method: a real in-process server on port 0, once with the direct HTTP/1.1 path on (the
default) and once with every request given to Hypercorn (`server.direct_http1` and
`sse.direct_write` off). Raw trio sockets send exact bytes (oversized and malformed heads,
`OPTIONS`, encoded slashes, WebSocket handshakes, `HEAD`, chunked bodies) and the answer
is checked byte for byte where it matters: the status line carries its reason phrase,
every answer carries `X-Topicd-Pressure`, and every non-2xx answer the canonical error
body. The gate's per-path request counts show which path served what.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

import orjson
import pytest
import trio

from tests.server.helpers import Reader, served
from topicd.http.app import gate_of
from topicd.testing.harness import make_config

PRESSURE = re.compile(rb"x-topicd-pressure: (?:0\.\d{3}|1\.000)\r\n")
H = b"Host: x\r\n"
UPGRADE = (
    b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)


@pytest.fixture(params=["direct", "hypercorn"])
async def server(request):
    if request.param == "direct":
        cfg = make_config(server={"port": 0})
    else:
        cfg = make_config(server={"port": 0, "direct_http1": False}, sse={"direct_write": False})
    async with served(cfg) as (engine, app, host, port):
        yield request.param, engine, app, host, port


def status_line(head: bytes) -> bytes:
    return head[: head.index(b"\r\n")]


def check_answer(head: bytes, status: int) -> None:
    """Reason phrase and pressure header (`head` as received, not lowercased)."""
    assert status_line(head) == b"HTTP/1.1 %d %s" % (status, HTTPStatus(status).phrase.encode())
    assert PRESSURE.search(head.lower()), head


def canonical(head: bytes, body: bytes, status: int, code: str) -> dict:
    """The canonical error body (`{"error": {code, message, detail?}}`); returns `error`."""
    check_answer(head, status)
    assert b"\r\ncontent-type: application/json\r\n" in head.lower()
    doc = orjson.loads(body)
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert {"code", "message"} <= set(err) <= {"code", "message", "detail"}, err
    assert err["code"] == code, err
    assert err.get("detail", {"x": 1}), "an empty detail is omitted"
    return err


async def exchange(host: str, port: int, raw: bytes) -> tuple[bytes, bytes]:
    """Send `raw` on a new connection; (head as received, body) of the answer."""
    stream = await trio.open_tcp_stream(host, port)
    try:
        await stream.send_all(raw)
        r = Reader(stream)
        head = await r.head()
        _status, _, body = await r.raw()
        return head, body
    finally:
        await stream.aclose()


BIG_NAME = b"a" * 100_000

# (case, request, status); the code follows from the status (CODES)
ERRORS = [
    ("100 KB topic name", b"PUT /v0/topics/" + BIG_NAME + b" HTTP/1.1\r\n" + H + b"\r\n", 431),
    (
        "oversized header",
        b"GET /v0/topics HTTP/1.1\r\n" + H + b"X-Pad: " + b"p" * 100_000 + b"\r\n\r\n",
        431,
    ),
    ("malformed head", b"GET /v0/topics HTTP/1.1\r\nHost x\r\n\r\n", 400),
    (
        "unknown transfer coding",
        b"POST /v0/topics/t HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip\r\n\r\n",
        400,
    ),
    ("bad boolean", b"DELETE /v0/topics/t?if_empty=yes HTTP/1.1\r\n" + H + b"\r\n", 400),
    ("encoded slash", b"PUT /v0/topics/a%2Fb HTTP/1.1\r\n" + H + b"Content-Length: 0\r\n\r\n", 400),
    ("OPTIONS", b"OPTIONS /v0/topics/t HTTP/1.1\r\n" + H + b"\r\n", 405),
    ("OPTIONS unknown path", b"OPTIONS /v0/nowhere HTTP/1.1\r\n" + H + b"\r\n", 404),
    (
        "chunked to an unknown path",
        b"POST /v0/nowhere HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        404,
    ),
    (
        "WebSocket handshake without a key",
        b"GET /v0/ws HTTP/1.1\r\n" + H + UPGRADE.replace(b"Sec-WebSocket-Key", b"X-Key") + b"\r\n",
        400,
    ),
    ("WebSocket upgrade to a topic", b"GET /v0/topics/t HTTP/1.1\r\n" + H + UPGRADE + b"\r\n", 404),
]
CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    431: "invalid_request",
}


@pytest.mark.parametrize(("case", "raw", "status"), ERRORS, ids=[e[0] for e in ERRORS])
async def test_every_error_has_the_canonical_body_reason_and_pressure(server, case, raw, status):
    mode, _engine, app, host, port = server
    head, body = await exchange(host, port, raw)
    canonical(head, body, status, CODES[status])
    if mode == "hypercorn":
        assert gate_of(app).requests_by_path["direct"] == 0


async def test_an_oversized_head_is_431_naming_the_bound_and_closes(server):
    _mode, _engine, _app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(b"PUT /v0/topics/" + BIG_NAME + b" HTTP/1.1\r\n" + H + b"\r\n")
    r = Reader(stream)
    head = await r.head()
    _, lowered, body = await r.raw()
    err = canonical(head, body, 431, "invalid_request")
    assert err["detail"] == {"max": 16384}
    assert b"connection: close" in lowered
    assert await r.eof()
    await stream.aclose()


async def test_options_on_a_known_path_is_405_with_allow(server):
    _mode, _engine, _app, host, port = server
    cases = {
        "/v0/topics/t": {"DELETE", "GET", "HEAD", "POST", "PUT"},
        "/v0/topics/t/diff": {"POST"},
        "/v0/topics": {"GET", "HEAD"},
        "/v0/health": {"GET", "HEAD"},
        "/v0/watch": {"POST"},
    }
    stream = await trio.open_tcp_stream(host, port)
    r = Reader(stream)
    for path, allowed in cases.items():
        await stream.send_all(b"OPTIONS %s HTTP/1.1\r\n%s\r\n" % (path.encode(), H))
        head = await r.head()
        _, lowered, body = await r.raw()
        canonical(head, body, 405, "method_not_allowed")
        allow = re.search(rb"\r\nallow: ([^\r]*)\r\n", lowered)
        assert allow is not None, head
        assert {m.strip().upper() for m in allow.group(1).decode().split(",")} == allowed
    await stream.aclose()


@pytest.mark.parametrize(
    ("method", "target", "name"),
    [
        (b"PUT", b"/v0/topics/a%2Fb", "a/b"),
        (b"GET", b"/v0/topics/a%2fb", "a/b"),
        (b"DELETE", b"/v0/topics/x%2F", "x/"),
        (b"POST", b"/v0/topics/a%2Fb/diff", "a/b"),
        (b"POST", b"/v0/topics/%2F%2F/delete", "//"),
    ],
)
async def test_an_encoded_slash_in_a_topic_name_is_400_naming_it(server, method, target, name):
    _mode, engine, _app, host, port = server
    raw = b"%s %s HTTP/1.1\r\n%sContent-Length: 0\r\n\r\n" % (method, target, H)
    head, body = await exchange(host, port, raw)
    err = canonical(head, body, 400, "invalid_request")
    assert err["detail"] == {"topic": name}
    assert name in err["message"]
    assert not engine.topics


async def test_a_websocket_upgrade_elsewhere_is_404_without_a_traceback(server, caplog):
    mode, _engine, app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    r = Reader(stream)
    # a plain request first: on the direct path the upgrade is handed over mid-connection
    await stream.send_all(b"GET /v0/topics HTTP/1.1\r\n" + H + b"\r\n")
    head = await r.head()
    check_answer(head, 200)
    await r.raw()
    with caplog.at_level(logging.INFO):
        await stream.send_all(b"GET /v0/topics HTTP/1.1\r\n" + H + UPGRADE + b"\r\n")
        head = await r.head()
        _, lowered, body = await r.raw()
    canonical(head, body, 404, "not_found")
    assert b"sec-websocket-accept" not in lowered
    assert [rec for rec in caplog.records if rec.levelno >= logging.WARNING] == []
    assert await r.eof()
    await stream.aclose()
    counts = gate_of(app).requests_by_path
    assert (counts["direct"], counts["hypercorn"]) == ((1, 0) if mode == "direct" else (0, 1))


async def test_hypercorn_served_answers_have_reason_phrases_and_pressure(server):
    """HEAD and chunked bodies are Hypercorn's on both paths."""
    _mode, _engine, _app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    r = Reader(stream)
    for path, status in ((b"/v0/health", 200), (b"/v0/topics/nope", 404), (b"/v0/nowhere", 404)):
        await stream.send_all(b"HEAD %s HTTP/1.1\r\n%s\r\n" % (path, H))
        head = await r.head()
        check_answer(head, status)
        r.buf = r.buf[len(head) :]  # no body after a HEAD
    chunk = b'{"records":[{"data":1}]}'
    await stream.send_all(
        b"POST /v0/topics/c HTTP/1.1\r\n" + H + b"Content-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk)
    )
    head = await r.head()
    check_answer(head, 201)
    await stream.aclose()


async def test_the_direct_path_bounds_a_head_that_arrives_whole():
    """h11 alone bounds only a head still incomplete in its buffer; the direct path
    answers `431` to any head over the bound, however its bytes arrive."""
    async with served(make_config(server={"port": 0})) as (_engine, app, host, port):
        raw = b"GET /v0/topics HTTP/1.1\r\n" + H + b"X-Pad: " + b"p" * 20_000 + b"\r\n\r\n"
        head, body = await exchange(host, port, raw)
        canonical(head, body, 431, "invalid_request")
        assert gate_of(app).requests_by_path == {"direct": 0, "hypercorn": 0}


async def test_an_h2c_upgrade_answer_has_its_reason_phrase(server):
    _mode, _engine, _app, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(
        b"GET /v0/health HTTP/1.1\r\n" + H + b"Connection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
    )
    head = await Reader(stream).head()
    assert status_line(head) == b"HTTP/1.1 101 Switching Protocols"
    await stream.aclose()


async def test_a_bug_in_the_gate_is_a_canonical_500_and_a_logged_traceback(server, caplog):
    _mode, _engine, app, host, port = server

    def broken_probe(path: str) -> dict:
        raise RuntimeError("probe bug")

    gate_of(app).probe = broken_probe
    with caplog.at_level(logging.ERROR):
        head, body = await exchange(host, port, b"GET /v0/health HTTP/1.1\r\n" + H + b"\r\n")
    err = canonical(head, body, 500, "internal")
    assert "probe bug" not in err["message"]
    logged = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(logged) == 1 and logged[0].exc_info is not None
