"""The app on a real Hypercorn Trio server in-process (port 0), spoken to over sockets.

Method: start `hypercorn.trio.serve` with the daemon's own Hypercorn settings via
`nursery.start`, which returns once the listener is bound, then talk HTTP/1.1 and HTTP/2
(h2c with prior knowledge) to it with httpx. These tests use the real clock and real
sockets, so they assert behaviour, never timing.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from topicd.testing.harness import make_config, serve_in_process


@pytest.fixture
async def base_url():
    async with serve_in_process(make_config(server={"port": 0})) as (_engine, url):
        yield url


async def test_http11_round_trip(base_url):
    async with httpx.AsyncClient(base_url=base_url) as c:
        r = await c.post(
            "/v0/topics/real",
            content=b'{"records": [{"data": {"n": 1.10}}]}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 201
        # the governor's pressure as the answer starts (a real clock: its samples may
        # already read some loop lag)
        pressure = r.headers["x-topicd-pressure"]
        assert len(pressure) == 5 and 0.0 <= float(pressure) <= 1.0, pressure
        r = await c.post("/v0/topics/real/diff", json={})
        assert r.http_version == "HTTP/1.1"
        assert b'"data":{"n":1.10}' in r.content


async def test_h2c_prior_knowledge(base_url):
    async with httpx.AsyncClient(base_url=base_url, http1=False, http2=True) as c:
        r = await c.post("/v0/topics/h2/diff", json={})
        assert r.http_version == "HTTP/2"
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "topic_not_found"
        r = await c.post("/v0/topics/h2", json={"records": [{"data": 1}]})
        assert (r.http_version, r.status_code) == ("HTTP/2", 201)


async def test_long_poll_is_woken_over_a_socket(base_url):
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as c:
        await c.post("/v0/topics/lp", json={"records": [{"data": 1}]})
        got = {}

        async def poll():
            got["r"] = await c.post("/v0/topics/lp/diff", json={"from_seq": 1, "wait_ms": 10000})

        async with trio.open_nursery() as n:
            n.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            await c.post("/v0/topics/lp", json={"records": [{"data": 2}]})
        body = got["r"].json()
        assert [rec["data"] for rec in body["records"]] == [2]


async def test_malformed_http_never_yields_500(base_url):
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(
            b"POST /v0/topics/x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5\r\n\r\n{nope"
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(4096)
        assert data.startswith(b"HTTP/1.1 400"), data[:40]


async def test_queue_lifecycle_over_a_socket(base_url):
    async with httpx.AsyncClient(base_url=base_url) as c:
        r = await c.put("/v0/topics/jobs", json={"type": "queue"})
        assert r.status_code == 201
        r = await c.post(
            "/v0/topics/jobs", json={"records": [{"data": 1}, {"data": 2, "priority": 3}]}
        )
        assert r.status_code == 200
        r = await c.post("/v0/topics/jobs/claim", json={"node": "w", "max": 8})
        claimed = r.json()["claimed"]
        assert [j["$seq"] for j in claimed] == [2, 1]
        fences = [j["lease_id"] for j in claimed]
        r = await c.post(
            "/v0/topics/jobs/ack", json={"node": "w", "seqs": [2, 1], "lease_ids": fences}
        )
        assert (r.json()["acked"], r.json()["ready"], r.json()["in_flight"]) == (2, 0, 0)
        r = await c.post("/v0/topics/real-log/claim", json={"node": "w"})
        assert r.status_code == 404
