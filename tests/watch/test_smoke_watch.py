from __future__ import annotations

import base64

import orjson

from topicd.testing.sse import open_stream


def decode_id(value: str) -> dict[str, int]:
    return orjson.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))


async def test_smoke(harness, client, nursery):
    await client.post("/v0/topics/a", json={"records": [{"data": 1}, {"data": 2}]})
    r = await client.post("/v0/watch", json={"topics": {"a": {}}})
    assert r.status_code == 200, await r.get_data()
    body = await r.get_json()
    wid = body["wid"]
    s = await open_stream(nursery, harness.app.asgi_app, wid)
    assert s.status == 200
    frames = await s.read_frames(4)
    print(frames)
    assert frames[0].retry == 2000
    assert frames[1].heartbeat
    assert frames[2].event == "record"
    assert frames[3].event == "caught-up"
    await client.post("/v0/topics/a", json={"records": [{"data": 3}]})
    frames = await s.read_frames(1)
    print(frames)
    assert frames[0].event == "record"
    assert decode_id(frames[0].id) == {"a": 3}
    s.disconnect()
    await s.wait_done()
    assert harness.engine.watch.sessions[wid].cursors == {"a": 3}
