"""The `/work` push-worker stream over real sockets: the daemon's server in-process on
port 0, a raw TCP client (`RawSseClient`, HTTP/1.1 chunked) for the stream and httpx for
producing and acking.

Method: three server set-ups — the direct socket path for every plain request (the
default), the direct path for streams only (`server.direct_http1 = false`: the stream is
recognised from its request line), and every request through Hypercorn
(`sse.direct_write = false`). The engine is in the same process, so the tests read the
lease table directly and wait for a release on the queue's own change signal, never on
time. Real clock: the tests assert behaviour, never timing.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from topicd.testing.harness import make_config, serve_in_process
from topicd.testing.sse import RawSseClient

SETUPS = {
    "direct": {},
    "direct-streams-only": {"server": {"port": 0, "direct_http1": False}},
    "hypercorn": {"sse": {"direct_write": False}},
}


@pytest.fixture(params=list(SETUPS))
async def server(request):
    sections = {"server": {"port": 0}, **SETUPS[request.param]}
    cfg = make_config(**sections)
    async with serve_in_process(cfg) as (engine, url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.put("/v0/topics/q", json={"type": "queue"})
            assert r.status_code == 201
            yield request.param, engine, http, host, int(port)


async def test_jobs_pushed_acked_and_released_on_close(server):
    setup, engine, http, host, port = server
    opened = engine.watch.stats.streams_direct
    c = await RawSseClient.connect(host, port, "/v0/topics/q/work?node=w1&max=2")
    await c.read_head()
    assert c.status == 200
    assert c.headers["content-type"] == "text/event-stream; charset=utf-8"
    first = await c.read_frames(2)
    assert first[0].retry == 2000 and first[1].heartbeat
    assert (engine.watch.stats.streams_direct > opened) == (setup != "hypercorn")
    r = await http.post("/v0/topics/q", json={"records": [{"data": i} for i in range(3)]})
    assert r.status_code == 200
    got = await c.read_frames(2)
    assert [(f.event, f.id, f.data["$seq"]) for f in got] == [("job", "1", 1), ("job", "2", 2)]
    r = await http.post(
        "/v0/topics/q/ack",
        json={"node": "w1", "seqs": [1], "lease_ids": [got[0].data["lease_id"]]},
    )
    assert r.json()["acked"] == 1
    (third,) = await c.read_frames(1)
    assert (third.event, third.data["$seq"], third.data["data"]) == ("job", 3, 2)
    q = engine.topics["q"].queue
    assert len(q.leases) == 2 and len(q.workers) == 1
    await c.aclose()
    with trio.fail_after(10):
        while q.workers or q.leases:
            await q.wait_changed()  # the release on disconnect changes the queue
    state = (await http.get("/v0/topics/q")).json()["queue"]
    assert state == {"ready": 2, "in_flight": 0, "dead_lettered": 0}
    r = await http.post("/v0/topics/q/claim", json={"node": "w2", "max": 5})
    assert [(j["$seq"], j["deliveries"]) for j in r.json()["claimed"]] == [(2, 2), (3, 2)]


async def test_refusals_are_canonical_error_answers(server):
    _setup, _engine, http, host, port = server
    for path, status, code in [
        ("/v0/topics/q/work", 400, "invalid_request"),
        ("/v0/topics/nope/work?node=w", 404, "topic_not_found"),
    ]:
        c = await RawSseClient.connect(host, port, path)
        await c.read_head()
        assert c.status == status
        while b"}}" not in c.raw:
            assert await c._fill()
        body = c.raw.split(b"\r\n\r\n")[-1] if b"\r\n\r\n" in c.raw else c.raw
        assert code.encode() in body
        await c.aclose()
    await http.post("/v0/topics/log", json={"records": [{"data": 1}]})
    r = await http.get("/v0/topics/log/work", params={"node": "w"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_a_queue"
