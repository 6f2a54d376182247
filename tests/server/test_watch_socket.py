"""The SSE watch over real sockets: the app on a real Hypercorn Trio server (port 0).

Method: as in test_real_server.py, the daemon's server (`topicd.http.server.serve`)
serves the full app in-process with the daemon's settings, once with the direct socket
path for streams and once with every stream through Hypercorn's ASGI send; clients are
raw TCP sockets (`RawSseClient`, HTTP/1.1 chunked), so a stalled client is a real socket
whose kernel buffers fill until the server's writes block.
The engine is in the same process, so the tests assert the server-side bounds directly
on the connection. Real clock: the tests assert behaviour, never timing.
"""

from __future__ import annotations

import httpx
import pytest

from topicd.testing.harness import make_config, serve_in_process
from topicd.testing.sse import Frame, RawSseClient

CHANNEL_FRAMES = 32
CHANNEL_BYTES = 131072


@pytest.fixture(params=[True, False], ids=["direct", "asgi"])
async def server(request):
    cfg = make_config(
        server={"port": 0},
        sse={
            "channel_frames": CHANNEL_FRAMES,
            "channel_bytes": CHANNEL_BYTES,
            "direct_write": request.param,
        },
    )
    async with serve_in_process(cfg) as (engine, url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            yield engine, http, host, int(port)


def records(frames: list[Frame], topic: str) -> list[int]:
    out: list[int] = []
    for f in frames:
        if f.event == "record" and f.data["topic"] == topic:
            out.extend(r["$seq"] for r in f.data["records"])
    return out


async def new_watch(http: httpx.AsyncClient, topics: dict) -> str:
    r = await http.post("/v0/watch", json={"topics": topics})
    assert r.status_code == 200, r.text
    return r.json()["wid"]


async def test_resume_after_disconnect_delivers_exactly_the_missing_records(server):
    _engine, http, host, port = server
    await http.put("/v0/topics/r", json={})
    wid = await new_watch(http, {"r": {}})
    c = await RawSseClient.connect(host, port, f"/v0/watch/{wid}")
    await c.read_head()
    assert c.status == 200
    got = await c.read_until(lambda f: f.event == "caught-up")
    for i in range(1, 11):
        await http.post("/v0/topics/r", json={"records": [{"data": i}]})
    got = await c.read_until(lambda f: f.event == "record" and f.data["to_seq"] == 10)
    assert records(got, "r") == list(range(1, 11))
    last_id = got[-1].id
    await c.aclose()
    # written while nobody is connected
    for i in range(11, 21):
        await http.post("/v0/topics/r", json={"records": [{"data": i}]})
    # reconnect with the last id the client processed
    c = await RawSseClient.connect(host, port, f"/v0/watch/{wid}", {"Last-Event-ID": last_id})
    await c.read_head()
    got = await c.read_until(lambda f: f.event == "caught-up")
    assert records(got, "r") == list(range(11, 21))
    # a client that processed less rewinds with its older id: exactly from there
    await c.aclose()
    older = next(f.id for f in got if f.event == "record")  # the first frame of that stream
    c = await RawSseClient.connect(host, port, f"/v0/watch/{wid}", {"Last-Event-ID": older})
    await c.read_head()
    again = await c.read_until(lambda f: f.event == "caught-up")
    first_to = next(f.data["to_seq"] for f in got if f.event == "record")
    assert records(again, "r") == list(range(first_to + 1, 21))
    await c.aclose()


async def test_stalled_socket_isolated_bounded_and_lossless(server):
    engine, http, host, port = server
    await http.put("/v0/topics/s", json={"cap_records": 400})
    healthy_wid = await new_watch(http, {"s": {}})
    stalled_wid = await new_watch(http, {"s": {}})
    healthy = await RawSseClient.connect(host, port, f"/v0/watch/{healthy_wid}")
    await healthy.read_head()
    await healthy.read_until(lambda f: f.event == "caught-up")
    stalled = await RawSseClient.connect(host, port, f"/v0/watch/{stalled_wid}", rcvbuf=4096)
    await stalled.read_head()
    await stalled.read_until(lambda f: f.event == "caught-up")
    # from here the stalled client never reads until the end
    conn = engine.watch.sessions[stalled_wid].conn
    assert conn is not None
    blob = "x" * 1024
    n = 2000
    got: list[Frame] = []
    peak_frames = 0
    peak_bytes = 0
    for i in range(1, n + 1):
        r = await http.post("/v0/topics/s", json={"records": [{"data": [i, blob]}]})
        assert r.status_code in (200, 201)
        stats = conn.recv_ch.statistics()
        peak_frames = max(peak_frames, stats.current_buffer_used)
        peak_bytes = max(peak_bytes, conn.buffered_bytes)
        if i % 50 == 0:  # the healthy watcher keeps up while the stalled one is stuck
            got += await healthy.read_until(
                lambda f, i=i: f.event == "record" and f.data["to_seq"] >= i
            )
    assert records(got, "s") == list(range(1, n + 1))
    assert conn.lagged
    # on the direct path the drain sent it whole batches until its socket filled up
    assert (conn.batches_sent > 0) == engine.cfg.sse.direct_write
    assert peak_frames <= CHANNEL_FRAMES
    assert peak_bytes <= CHANNEL_BYTES
    # the stalled client finally reads: retained records in order plus exact tombstones
    late = await stalled.read_until(lambda f: f.event == "caught-up")
    seqs = records(late, "s")
    gaps = [(f.data["gap_from"], f.data["gap_to"]) for f in late if f.event == "tombstone"]
    assert gaps, "2000 writes into a 400-record cap must have evicted behind the cursor"
    covered: list[int] = []
    pos = 0
    for f in late:
        if f.event == "record":
            assert f.data["from_seq"] == pos
            covered.extend(r["$seq"] for r in f.data["records"])
            pos = f.data["to_seq"]
        elif f.event == "tombstone":
            assert f.data["reason"] == "cap"
            assert f.data["gap_from"] == pos + 1
            covered.extend(range(f.data["gap_from"], f.data["gap_to"] + 1))
            pos = f.data["gap_to"]
    assert covered == list(range(1, n + 1))  # every seq: delivered or announced, once
    assert seqs[-400:] == list(range(n - 399, n + 1))  # the whole retained tail
    await stalled.aclose()
    await healthy.aclose()
