"""Response compression: a whole JSON or metrics answer of at least 1024 bytes is gzipped
when `Accept-Encoding` allows it and always carries `Vary: Accept-Encoding`; 1023 bytes
is left alone; SSE streams never are.

Method: the in-process app through Quart's test client, with the handler clock
(`perf_ms`) frozen so `performance.server_total_ms` is always `0.0` and answers have an
exact, repeatable size; a topic name or a padding string is then sized to put an answer
exactly at 1023 or 1024 bytes. Both the framework's routes (`diff`) and the gate's fast
path (a write, a claim) are checked at the edge. One test goes over a real socket (the
direct HTTP/1.1 path) with a client that decodes gzip itself.
"""

from __future__ import annotations

import gzip

import httpx
import orjson
import pytest
import trio

from topicd.config import Config
from topicd.http.compress import GZIP_MIN_BYTES, Compressor, accepts_gzip, gzip_bytes
from topicd.testing.harness import open_app, serve_in_process
from topicd.testing.sse import open_stream

GZ = {"Accept-Encoding": "gzip"}


@pytest.fixture
def frozen_perf(monkeypatch):
    monkeypatch.setattr("topicd.http.app.perf_ms", lambda: 0.0)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("gzip", True),
        ("GZip", True),
        ("x-gzip", True),
        ("deflate, gzip;q=0.5", True),
        ("br;q=1.0, gzip; q=0.001", True),
        ("*", True),
        ("identity, *;q=0.1", True),
        ("gzip;q=0", False),
        ("gzip;q=0.000", False),
        ("gzip;q=0, *", False),  # gzip named and refused: `*` does not bring it back
        ("*;q=0", False),
        ("gzip;q=bogus", False),
        ("deflate, br", False),
        ("identity", False),
        ("", False),
        (None, False),
    ],
)
def test_accept_encoding_parsing(value, ok):
    assert accepts_gzip(value) is ok


async def sized(client, method: str, path: str, **kw) -> tuple[int, dict, bytes]:
    r = await client.open(path, method=method, **kw)
    return r.status_code, dict(r.headers.items()), await r.get_data()


def lower(headers: dict) -> dict:
    return {k.lower(): v for k, v in headers.items()}


def check_edge(size: int, headers: dict, body: bytes, *, gzip_sent: bool, identity: bytes):
    h = lower(headers)
    if size < GZIP_MIN_BYTES:
        assert "vary" not in h and "content-encoding" not in h, h
        assert body == identity
        return
    assert h["vary"] == "Accept-Encoding"
    if gzip_sent:
        assert h["content-encoding"] == "gzip"
        assert int(h["content-length"]) == len(body) < size
        assert gzip.decompress(body) == identity
    else:
        assert "content-encoding" not in h
        assert body == identity


async def test_diff_answers_at_the_threshold(frozen_perf):
    async with open_app() as h:
        c = h.app.test_client()
        await c.post("/v0/topics/base", json={"records": [{"data": ""}]})
        _, _, base = await sized(c, "POST", "/v0/topics/base/diff", json={})
        for size in (GZIP_MIN_BYTES - 1, GZIP_MIN_BYTES, GZIP_MIN_BYTES + 1):
            name = f"t{size}"[:4]  # same length as "base"
            pad = "x" * (size - len(base))
            await c.delete(f"/v0/topics/{name}")
            await c.post(f"/v0/topics/{name}", json={"records": [{"data": pad}]})
            _, hdrs, identity = await sized(c, "POST", f"/v0/topics/{name}/diff", json={})
            assert len(identity) == size
            check_edge(size, hdrs, identity, gzip_sent=False, identity=identity)
            _, hdrs, body = await sized(c, "POST", f"/v0/topics/{name}/diff", json={}, headers=GZ)
            check_edge(size, hdrs, body, gzip_sent=True, identity=identity)
            _, hdrs, body = await sized(
                c,
                "POST",
                f"/v0/topics/{name}/diff",
                json={},
                headers={"Accept-Encoding": "gzip;q=0"},
            )
            check_edge(size, hdrs, body, gzip_sent=False, identity=identity)


async def test_fast_path_write_answers_at_the_threshold(frozen_perf):
    """`POST /v0/topics/:topic` (served by the gate, not the framework): the answer's
    size is set by the topic name's length."""
    async with open_app() as h:
        c = h.app.test_client()
        records = {"records": [{"data": 0}] * 200}
        _, _, base = await sized(c, "POST", "/v0/topics/a", json=records)
        assert GZIP_MIN_BYTES - 250 < len(base) < GZIP_MIN_BYTES - 1
        for size in (GZIP_MIN_BYTES - 1, GZIP_MIN_BYTES):
            for headers, gz in (({}, False), (GZ, True)):
                name = "a" * (1 + size - len(base))
                await c.delete(f"/v0/topics/{name}")
                r = await c.post(f"/v0/topics/{name}", json=records, headers=headers)
                body = await r.get_data()
                identity = gzip.decompress(body) if gz and size >= GZIP_MIN_BYTES else body
                assert len(identity) == size
                check_edge(size, dict(r.headers.items()), body, gzip_sent=gz, identity=identity)


async def test_claim_of_many_jobs_is_compressed():
    async with open_app() as h:
        c = h.app.test_client()
        await c.put("/v0/topics/q", json={"type": "queue"})
        await c.post("/v0/topics/q", json={"records": [{"data": {"n": i}} for i in range(100)]})
        r = await c.post("/v0/topics/q/claim", json={"node": "w", "max": 100}, headers=GZ)
        assert r.headers["Content-Encoding"] == "gzip"
        assert r.headers["Vary"] == "Accept-Encoding"
        assert len(orjson.loads(gzip.decompress(await r.get_data()))["claimed"]) == 100


async def test_small_answers_and_errors_are_never_compressed():
    async with open_app() as h:
        c = h.app.test_client()
        for r in (
            await c.get("/v0/health", headers=GZ),
            await c.get("/v0/topics/nope", headers=GZ),
            await c.post("/v0/topics/t", json={"records": [{"data": 1}]}, headers=GZ),
            await c.post("/v0/topics/t/diff", json={}, headers=GZ),
            await c.get("/v0/topics/-" + "a" * 1100, headers=GZ),
            await c.post("/v0/topics/-" + "a" * 1100, json={"records": [{"data": 1}]}, headers=GZ),
        ):
            assert "Content-Encoding" not in r.headers
            assert "Vary" not in r.headers
            orjson.loads(await r.get_data())


async def test_error_answers_are_never_compressed_whatever_their_size():
    """Error bodies are bounded well below the threshold (names in messages are cut),
    so this is checked on the framework hook itself with a large one."""
    from quart import Response

    compressor = Compressor()
    for status in (400, 404, 503):
        resp = Response(b'{"error":{"code":"x","message":"' + b"m" * 4000 + b'"}}', status=status)
        resp.mimetype = "application/json"
        out = await compressor.finish(resp, "gzip")
        assert "Content-Encoding" not in out.headers and "Vary" not in out.headers
    ok = Response(b'{"a":"' + b"m" * 4000 + b'"}', status=200, content_type="application/json")
    out = await compressor.finish(ok, "gzip")
    assert out.headers["Content-Encoding"] == "gzip"
    assert out.headers["Vary"] == "Accept-Encoding"


async def test_metrics_text_and_json_are_compressed():
    async with open_app() as h:
        c = h.app.test_client()
        for i in range(10):  # per-queue entries make the JSON form larger than 1 KiB
            await c.put(f"/v0/topics/q{i}", json={"type": "queue"})
        r = await c.get("/v0/metrics", headers=GZ)
        assert r.headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(await r.get_data()).startswith(b"# HELP")
        r = await c.get("/v0/metrics", headers=GZ | {"Accept": "application/json"})
        assert r.headers["Content-Encoding"] == "gzip"
        assert "topics" in orjson.loads(gzip.decompress(await r.get_data()))


async def test_sse_streams_are_never_compressed():
    async with open_app() as h:
        c = h.app.test_client()
        await c.post("/v0/topics/t", json={"records": [{"data": "x" * 4000}]})
        r = await c.post("/v0/watch", json={"topics": {"t": {}}})
        wid = (await r.get_json())["wid"]
        async with trio.open_nursery() as nursery:
            s = await open_stream(nursery, h.app.asgi_app, wid, headers=GZ)
            frames = await s.read_until(lambda f: f.event == "record")
            assert s.status == 200
            assert "content-encoding" not in s.headers and "vary" not in s.headers
            record = next(f for f in frames if f.event == "record")
            assert record.data["records"][0]["data"] == "x" * 4000
            s.disconnect()


async def test_large_bodies_are_compressed_off_the_loop(monkeypatch):
    """At `offload_bytes` and above the work runs in a worker thread; the answer is the
    same gzip either way."""
    body = orjson.dumps([{"n": i, "text": "lorem ipsum"} for i in range(2000)])
    inline = Compressor(offload_bytes=len(body) + 1)
    threaded = Compressor(offload_bytes=len(body))
    used = []
    real = trio.to_thread.run_sync

    async def spy(fn, *args, **kw):
        used.append(fn)
        return await real(fn, *args, **kw)

    monkeypatch.setattr(trio.to_thread, "run_sync", spy)
    a = await inline.encode(body, "gzip")
    assert used == []
    b = await threaded.encode(body, "gzip")
    assert used == [gzip_bytes]
    assert a == b == gzip_bytes(body)
    assert gzip.decompress(a) == body


async def test_real_server_sends_gzip_on_the_direct_path():
    async with (
        serve_in_process(Config()) as (_, base),
        httpx.AsyncClient(base_url=base) as client,
    ):
        r = await client.get("/v0/metrics", headers={"Accept-Encoding": "gzip"})
        assert r.status_code == 200
        assert r.headers["content-encoding"] == "gzip"
        assert r.headers["vary"] == "Accept-Encoding"
        assert r.text.startswith("# HELP")  # httpx decoded it
        r = await client.get("/v0/metrics", headers={"Accept-Encoding": "identity"})
        assert "content-encoding" not in r.headers
        assert r.text.startswith("# HELP")
