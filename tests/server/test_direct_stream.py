"""The direct socket path for SSE streams (`topicd.http.server`), on a real server.

Method: the daemon's server runs in-process on port 0 (as in test_watch_socket.py);
clients speak raw HTTP/1.x over TCP so the tests control how the request head arrives
(split, pipelined after another request, HTTP/1.0) and see exactly what the server
writes. Which path served a stream is read from `topicd_sse_streams_opened_total{path}`.
Real clock and sockets: the tests assert behaviour, never timing.
"""

from __future__ import annotations

import re

import httpx
import orjson
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HyperConfig

from tests.server.helpers import served, served_with_topic
from topicd.http.app import gate_of
from topicd.http.head import Refusal
from topicd.http.server import Listener, sniff
from topicd.testing.harness import make_config
from topicd.testing.sse import RawSseClient, SseParser

IDLE_MS = 300


@pytest.fixture
async def server():
    cfg = make_config(server={"port": 0, "header_read_timeout_ms": IDLE_MS})
    async with served_with_topic(cfg) as running:
        yield running


async def new_watch(http: httpx.AsyncClient) -> str:
    r = await http.post("/v0/watch", json={"topics": {"d": {}}})
    assert r.status_code == 200, r.text
    return r.json()["wid"]


def opened(engine) -> tuple[int, int]:
    stats = engine.watch.stats
    return stats.streams_direct, stats.streams_opened - stats.streams_direct


async def expect_stream(engine, stream: trio.SocketStream, opened_as: tuple[int, int]) -> None:
    """The stream just requested on `stream` opens, catches up, and was served as said."""
    c = RawSseClient(stream)
    await c.read_head()
    assert c.status == 200
    await c.read_until(lambda f: f.event == "caught-up")
    assert opened(engine) == opened_as
    await c.aclose()


async def read_to_eof(stream: trio.SocketStream) -> bytes:
    out = b""
    with trio.fail_after(10):
        while data := await stream.receive_some(65536):
            out += data
    return out


def test_sniff_decides_as_early_as_the_bytes_allow():
    assert sniff(b"P") is False
    assert sniff(b"GET /v0/topicx") is False
    assert sniff(b"GET /v0/topics") is None  # may still be a `/work` stream
    assert sniff(b"GET /v0/topics/q/wo") is None  # the request line decides
    assert sniff(b"GET /v0/topics/q/work?node=a HTTP/1.1\r\n") is True
    assert sniff(b"GET /v0/topics/q HTTP/1.1\r\n") is False
    assert sniff(b"GET /v0/topics/q/diff/work HTTP/1.1\r\n") is False
    assert sniff(b"PRI * HTTP/2.0\r\n") is False
    assert sniff(b"GET /v0/wa") is None
    assert sniff(b"GET /v0/watch/wid_x HTTP/1.1\r\n") is True
    assert sniff(b"GET /v0/health HTTP/1.1\r\n") is True
    assert sniff(b"GET /v0/health?x=1 HTTP/1.1\r\n") is False
    assert sniff(b"GET /v0/metrics HTTP/1.1\r\n") is False


async def test_streams_are_direct_and_deliver(server):
    engine, http, host, port = server
    wid = await new_watch(http)
    c = await RawSseClient.connect(host, port, f"/v0/watch/{wid}")
    await c.read_head()
    assert c.status == 200
    assert c.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert "x-topicd-pressure" in c.headers
    assert "date" in c.headers
    await c.read_until(lambda f: f.event == "caught-up")
    await http.post("/v0/topics/d", json={"records": [{"data": {"n": 1.10}}]})
    got = await c.read_until(lambda f: f.event == "record")
    assert got[-1].data["records"][0]["data"] == {"n": 1.10}
    assert opened(engine) == (1, 0)
    await c.aclose()


async def test_a_head_split_across_reads_is_assembled_then_classified():
    # the reader is fed one piece at a time: each read returns only what was sent
    listener = Listener(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        lambda scope: False,
        HyperConfig(),
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        direct=True,
    )
    send, recv = trio.testing.memory_stream_one_way_pair()
    request = b"GET /v0/watch/wid_x HTTP/1.1\r\nHost: x\r\n\r\nGET /next"
    out: list[tuple[bytes, str]] = []

    async def read() -> None:
        deadline = trio.current_time() + 60
        out.append(await listener._read_head(recv, b"", deadline))  # type: ignore[arg-type]

    async with trio.open_nursery() as n:
        n.start_soon(read)
        for part in (request[:6], request[6:20], request[20:]):
            await send.send_all(part)
            await trio.testing.wait_all_tasks_blocked()  # the reader took this piece
    assert out == [(request, "head")]
    # every head is read to its end (to be parsed before anything serves it), but bytes
    # that can never make one are refused as soon as they arrive
    for garbage in (b"\x16\x03\x01\x02\x00\x01", b"GET / HTTP/1.1\nHo", b"GET /a\x00"):
        send, recv = trio.testing.memory_stream_one_way_pair()
        out.clear()
        async with trio.open_nursery() as n:
            n.start_soon(read)
            await send.send_all(garbage)
        assert len(out) == 1 and out[0][0] == garbage
        assert isinstance(out[0][1], Refusal), out
    # the h2c prior-knowledge preface is Hypercorn's
    send, recv = trio.testing.memory_stream_one_way_pair()
    out.clear()
    async with trio.open_nursery() as n:
        n.start_soon(read)
        await send.send_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert out == [(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "other")]


async def test_a_stream_open_sent_in_pieces_is_direct(server):
    engine, http, host, port = server
    wid = await new_watch(http)
    stream = await trio.open_tcp_stream(host, port)
    request = f"GET /v0/watch/{wid} HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n"
    for part in (request[:6], request[6:20], request[20:]):
        await stream.send_all(part.encode())
    await expect_stream(engine, stream, (1, 0))


async def test_errors_on_the_direct_path_use_the_canonical_body_and_close(server):
    engine, _http, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(b"GET /v0/watch/wid_nope HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = await read_to_eof(stream)  # the server closes after the answer
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 ")
    assert b"connection: close" in head.lower()
    length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
    assert len(body) == length
    doc = orjson.loads(body)
    assert doc["error"]["code"] == "not_found"
    assert opened(engine) == (0, 0)


async def stream_after_a_list(engine, host: str, port: int, wid: str, opened_as) -> None:
    """`GET /v0/topics`, then the stream open, on one connection."""
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(b"GET /v0/topics HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    with trio.fail_after(10):
        while not first.endswith(b"}}"):
            first += await stream.receive_some(65536)
    assert first.startswith(b"HTTP/1.1 200")
    await stream.send_all(f"GET /v0/watch/{wid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await expect_stream(engine, stream, opened_as)


async def test_a_stream_after_another_request_on_the_connection_stays_direct(server):
    engine, http, host, port = server
    wid = await new_watch(http)
    await stream_after_a_list(engine, host, port, wid, (1, 0))


async def test_without_direct_http1_a_stream_after_another_request_goes_through_hypercorn():
    cfg = make_config(server={"port": 0, "direct_http1": False})
    async with served_with_topic(cfg) as (engine, http, host, port):
        wid = await new_watch(http)
        # Hypercorn's from the first non-probe request
        await stream_after_a_list(engine, host, port, wid, (0, 1))


async def test_http10_stream_is_unchunked(server):
    engine, http, host, port = server
    wid = await new_watch(http)
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(f"GET /v0/watch/{wid} HTTP/1.0\r\n\r\n".encode())
    raw = b""
    with trio.fail_after(10):
        while b"event: caught-up" not in raw:
            raw += await stream.receive_some(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    parser = SseParser()
    frames = parser.feed(body)
    assert frames[0].retry == 2000
    assert any(f.event == "caught-up" for f in frames)
    assert opened(engine) == (1, 0)
    await stream.aclose()


async def test_an_idle_new_connection_is_closed_after_the_head_timeout(server):
    _engine, _http, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    assert await read_to_eof(stream) == b""


async def test_a_reconnect_after_a_direct_stream_resumes_on_its_session(server):
    engine, http, host, port = server
    wid = await new_watch(http)
    c = await RawSseClient.connect(host, port, f"/v0/watch/{wid}")
    await c.read_head()
    await c.read_until(lambda f: f.event == "caught-up")
    await http.post("/v0/topics/d", json={"records": [{"data": 1}]})
    first = await c.read_until(lambda f: f.event == "record")
    await c.aclose()
    await http.post("/v0/topics/d", json={"records": [{"data": 2}]})
    c = await RawSseClient.connect(
        host, port, f"/v0/watch/{wid}", {"Last-Event-ID": first[-1].id or ""}
    )
    await c.read_head()
    assert c.status == 200
    got = await c.read_until(lambda f: f.event == "caught-up")
    seqs = [r["$seq"] for f in got if f.event == "record" for r in f.data["records"]]
    assert seqs == [2]
    assert opened(engine) == (2, 0)
    await c.aclose()


async def test_probes_are_direct_and_keep_the_connection(server):
    engine, http, host, port = server
    wid = await new_watch(http)
    stream = await trio.open_tcp_stream(host, port)
    # two probes pipelined in one segment, then a stream open on the same connection
    await stream.send_all(
        b"GET /v0/health HTTP/1.1\r\nHost: x\r\n\r\nGET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    raw = b""
    with trio.fail_after(10):
        while raw.count(b"}}") < 2:
            raw += await stream.receive_some(65536)
    answers = raw.split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 2
    for answer, status in zip(answers, ("ok", "ready"), strict=True):
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"200 OK")
        assert b"connection: close" not in head.lower()
        assert b"x-topicd-pressure" in head.lower()
        doc = orjson.loads(body)
        assert doc["status"] == status
        assert "server_total_ms" in doc["performance"]
    await stream.send_all(f"GET /v0/watch/{wid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await expect_stream(engine, stream, (1, 0))


async def test_a_probe_asking_to_close_gets_its_connection_closed(server):
    _engine, _http, host, port = server
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await read_to_eof(stream)
    assert raw.startswith(b"HTTP/1.1 200 OK")
    assert b"connection: close" in raw.lower()


async def test_at_full_permits_writes_are_refused_before_the_framework_on_one_connection():
    cfg = make_config(server={"port": 0}, classes={"client_permits": 1, "client_waiters": 0})
    async with served(cfg) as (engine, app, host, port):
        pool = gate_of(app).permits
        assert pool is not None
        stream = await trio.open_tcp_stream(host, port)
        body = b'{"records": [{"data": 1}]}'
        post = (
            b"POST /v0/topics/t HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        ) + body

        async def answer() -> tuple[bytes, dict]:
            raw = b""
            with trio.fail_after(10):
                while b"\r\n\r\n" not in raw:
                    raw += await stream.receive_some(65536)
                head, _, rest = raw.partition(b"\r\n\r\n")
                n = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
                while len(rest) < n:
                    rest += await stream.receive_some(65536)
            return head, orjson.loads(rest[:n])

        held = await pool.admit()  # every permit taken, no waiter slot: full
        served_before = dict(gate_of(app).requests_by_path)
        for _ in range(2):  # pipelining-safe: the body is consumed, the connection kept
            await stream.send_all(post)
            head, doc = await answer()
            assert head.startswith(b"HTTP/1.1 429")
            assert b"retry-after: 1" in head.lower()
            assert b"connection: close" not in head.lower()
            assert doc["error"]["detail"]["cause"] == "client_waiters"
        assert pool.stats.rejected == 2
        assert engine.throttled.get("client_waiters") == 2
        # refused from a glance at the head: the gate's ASGI entry never ran
        assert gate_of(app).requests_by_path == served_before
        assert "t" not in engine.topics  # nothing was applied
        held.release()
        await stream.send_all(post)  # room again: the same connection is served normally
        head, doc = await answer()
        assert head.startswith(b"HTTP/1.1 201") or head.startswith(b"HTTP/1.1 200")
        assert doc["seqs"] == [1]
        await stream.aclose()


async def test_an_overloaded_loop_refuses_client_requests_from_a_glance_and_probes_still_pass():
    """While the governor finds the loop's own queue at its bound (`overloaded`), client
    requests get `429` cause `loop_lag` from a glance at their head, counted apart from
    `client_waiters`; probes are still answered, and the refusals end with the verdict."""
    cfg = make_config(server={"port": 0})
    async with served(cfg) as (engine, app, host, port):
        pool = gate_of(app).permits
        assert pool is not None
        verdict: dict[str, str | None] = {"overloaded": "loop_lag"}
        pool.overloaded = lambda: verdict["overloaded"]
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
            r = await http.post("/v0/topics/t", json={"records": [{"data": 1}]})
            assert r.status_code == 429
            detail = r.json()["error"]["detail"]
            assert detail["cause"] == "loop_lag" and detail["retry_after_ms"] >= 250
            assert int(r.headers["retry-after"]) >= 1 and "x-topicd-pressure" in r.headers
            assert (await http.get("/v0/topics/t")).status_code == 429  # reads too
            assert (await http.get("/v0/health")).status_code == 200  # probes: no permit
            assert pool.stats.overload_rejected == 2 and pool.stats.rejected == 0
            assert engine.throttled.get("loop_lag") == 2
            assert "t" not in engine.topics  # nothing was applied
            metrics = (await http.get("/v0/metrics")).text
            assert 'topicd_throttled_total{cause="loop_lag"} 2.0' in metrics
            verdict["overloaded"] = None
            r = await http.post("/v0/topics/t", json={"records": [{"data": 1}]})
            assert r.status_code in (200, 201) and r.json()["seqs"] == [1]


async def test_writes_served_directly_record_their_sojourn_and_nothing_else_does():
    """The governor's s6 reads client writes only, from their body in hand to their answer: a
    write on the direct path is recorded, a diff (which may long-poll), a read, a probe
    and a write refused from a glance (`write_delay`, the verdict s6 gives) are not."""
    cfg = make_config(server={"port": 0})
    async with served(cfg) as (engine, app, host, port):
        pool = gate_of(app).permits
        assert pool is not None
        soj = engine.sojourns
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
            assert (await http.put("/v0/topics/t", json={})).status_code in (200, 201)
            for i in range(2):
                r = await http.post("/v0/topics/t", json={"records": [{"data": i}]})
                assert r.status_code in (200, 201)
            assert soj.recorded == 2
            # (one after the other: each alone, so no median, test_direct_http1.py)
            assert soj.alone == 2 and soj.median_ms(trio.current_time()) is None
            assert (await http.post("/v0/topics/t/diff", json={"from_seq": 0})).status_code == 200
            assert (await http.get("/v0/topics/t")).status_code == 200
            assert (await http.get("/v0/health")).status_code == 200
            assert soj.recorded == 2
            verdict: dict[str, str | None] = {"overloaded": "write_delay"}
            pool.overloaded = lambda: verdict["overloaded"]
            r = await http.post("/v0/topics/t", json={"records": [{"data": 3}]})
            assert r.status_code == 429
            assert r.json()["error"]["detail"]["cause"] == "write_delay"
            assert int(r.headers["retry-after"]) >= 1
            assert soj.recorded == 2  # a refusal is not a served write
            assert engine.throttled.get("write_delay") == 1
            verdict["overloaded"] = None
            metrics = (await http.get("/v0/metrics")).text
            assert 'topicd_throttled_total{cause="write_delay"} 1.0' in metrics
            assert "topicd_write_sojourn_ms " in metrics
            assert 'topicd_pressure_signal{signal="sojourn"}' in metrics
