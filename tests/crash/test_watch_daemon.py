"""The SSE watch against a real `topicd serve` child (SIGTERM, kill -9, test env knobs).

Method: `tests.crash.harness.serving` runs the daemon as a subprocess; the stream is read
with `RawSseClient` over a real socket. Waits are bounded with `trio.fail_after`, never
slept.
"""

from __future__ import annotations

import base64
import json
import signal

import trio

from tests.crash.harness import client, serving
from topicd.testing.sse import RawSseClient


def cursor_map(frame_id: str) -> dict[str, int]:
    return json.loads(base64.urlsafe_b64decode(frame_id + "=" * (-len(frame_id) % 4)))


async def open_watch(server, topics: dict, **body: object) -> RawSseClient:
    async with client(server) as http:
        r = await http.post("/v0/watch", json={"topics": topics, **body})
        assert r.status_code == 200, r.text
        wid = r.json()["wid"]
    c = await RawSseClient.connect("127.0.0.1", server.port, f"/v0/watch/{wid}")
    await c.read_head()
    assert c.status == 200
    return c


async def test_sigterm_ends_streams_with_server_shutting_down(tmp_path):
    async with serving(tmp_path) as server:
        async with client(server) as http:
            await http.post("/v0/topics/g", json={"records": [{"data": 1}, {"data": 2}]})
        c = await open_watch(server, {"g": {}})
        with trio.fail_after(10):
            await c.read_until(lambda f: f.event == "caught-up")
            server.run.proc.send_signal(signal.SIGTERM)
            frames = await c.read_until(lambda f: f.event == "error")
        last = frames[-1]
        assert last.data == {
            "code": "server_shutting_down",
            "error": "the server is shutting down",
            "message": "the server is shutting down",
        }
        assert cursor_map(last.id) == {"g": 2}
        with trio.fail_after(10):
            while not c.ended:
                await c.read_frames(1)
            assert await server.run.proc.wait() == 0


async def test_after_kill9_the_session_is_gone_and_a_reseeded_one_resumes(tmp_path):
    async with serving(tmp_path) as server:
        async with client(server) as http:
            await http.put("/v0/topics/k", json={"durability": "fsync"})
            await http.post("/v0/topics/k", json={"records": [{"data": i} for i in range(5)]})
        c = await open_watch(server, {"k": {}})
        with trio.fail_after(10):
            frames = await c.read_until(lambda f: f.event == "caught-up")
        last_id = frames[-1].id
        await c.aclose()
        async with client(server) as http:
            await http.post("/v0/topics/k", json={"records": [{"data": i} for i in range(5, 8)]})
        await server.restart()  # kill -9, then start again
        async with client(server) as http:
            # sessions live in memory: the old wid is unknown now
            r = await http.get("/v0/watch/wid_AAAAAAAAAAAAAAAAAAAAAA")
            assert r.status_code == 404
            seed = cursor_map(last_id)["k"]
            assert seed == 5
        c = await open_watch(server, {"k": {"from_seq": seed}})
        with trio.fail_after(10):
            frames = await c.read_until(lambda f: f.event == "caught-up")
        seqs = [r["$seq"] for f in frames if f.event == "record" for r in f.data["records"]]
        assert seqs == [6, 7, 8]
        await c.aclose()


async def test_test_heartbeat_floor_env_lowers_the_clamp(tmp_path):
    async with serving(tmp_path, env={"TOPICD_TEST_MIN_HEARTBEAT_MS": "50"}) as server:
        async with client(server) as http:
            await http.put("/v0/topics/h", json={})
        c = await open_watch(server, {"h": {}}, heartbeat_ms=50)
        with trio.fail_after(10):
            frames = await c.read_until(lambda f: f.event == "caught-up")
            beats = 0
            while beats < 3:
                for f in await c.read_frames(1):
                    assert f.heartbeat, f
                    beats += 1
        assert frames[0].retry == 2000
        await c.aclose()
