"""`consistency: "strong"` watchers see a record only once its WAL frame is fsynced
(api-routers-watch §2.2).

Method: a durable engine on a `FakeDisk` (inline offload, `MockClock`). A `disk` topic
acknowledges writes before `fdatasync` and syncs its tail in the background every
`storage.wal.disk_fsync_interval_ms`; an eventual watcher gets each record at once, a
strong one only after that sync — and never a record above the durable head. On an
`fsync` topic both get it together; `ephemeral` ignores the setting.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from topicd.testing.fake_clock import advance
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, open_durable_app
from topicd.testing.sse import AsgiStream, open_stream


async def collect(stream: AsgiStream, out: list[tuple[int, float]]) -> None:
    while not stream.ended:
        for f in await stream.read_frames(1):
            if f.event == "record":
                out.extend((r["$seq"], trio.current_time()) for r in f.data["records"])


@pytest.mark.parametrize("durability", ["disk", "memory"])
async def test_strong_waits_for_the_sync(autojump_clock, nursery, durability):
    cfg = durable_config(wal={"disk_fsync_interval_ms": 100})
    async with open_durable_app(FakeDisk(), cfg) as h:
        client = h.app.test_client()
        r = await client.put("/v0/topics/t", json={"durability": durability})
        assert r.status_code == 201, await r.get_data()
        streams = {}
        for mode in ("eventual", "strong"):
            r = await client.post("/v0/watch", json={"topics": {"t": {}}, "consistency": mode})
            wid = (await r.get_json())["wid"]
            streams[mode] = await open_stream(nursery, h.app.asgi_app, wid)
            await streams[mode].read_frames(3)  # retry, hb, caught-up
        got: dict[str, list[tuple[int, float]]] = {"eventual": [], "strong": []}
        durable_at_delivery: list[tuple[int, int]] = []

        async def strong_reader() -> None:
            s = streams["strong"]
            while not s.ended:
                for f in await s.read_frames(1):
                    if f.event == "record":
                        for rec in f.data["records"]:
                            got["strong"].append((rec["$seq"], trio.current_time()))
                            durable_at_delivery.append(
                                (rec["$seq"], h.engine.topics["t"].durable_head)
                            )

        nursery.start_soon(collect, streams["eventual"], got["eventual"])
        nursery.start_soon(strong_reader)
        written = {}
        for i in range(1, 6):
            await client.post("/v0/topics/t", json={"records": [{"data": i}]})
            written[i] = trio.current_time()
            await advance(autojump_clock, 0.03)  # writes 30 ms apart: they span syncs
        with trio.fail_after(1):
            while len(got["strong"]) < 5:  # the last ones wait for the next tail sync
                await advance(autojump_clock, 0.01)
        assert trio.current_time() - written[5] <= 0.1 + 0.01
        assert [s for s, _ in got["eventual"]] == [1, 2, 3, 4, 5]
        assert [s for s, _ in got["strong"]] == [1, 2, 3, 4, 5]
        for seq, at in got["eventual"]:
            assert at == written[seq]
        for seq, durable in durable_at_delivery:
            assert durable >= seq
        # strong deliveries wait for the background tail sync (at most one interval)
        delays = [at - written[seq] for seq, at in got["strong"]]
        assert max(delays) > 0
        assert max(delays) <= 0.1 + 0.01


async def test_fsync_topic_strong_is_immediate(autojump_clock, nursery):
    async with open_durable_app(FakeDisk(), durable_config()) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/f", json={"durability": "fsync"})
        r = await client.post("/v0/watch", json={"topics": {"f": {}}, "consistency": "strong"})
        s = await open_stream(nursery, h.app.asgi_app, (await r.get_json())["wid"])
        await s.read_frames(3)
        await client.post("/v0/topics/f", json={"records": [{"data": 1}]})
        t0 = trio.current_time()
        (f,) = await s.read_frames(1)
        assert f.event == "record" and trio.current_time() == t0


async def test_ephemeral_ignores_strong(autojump_clock, nursery):
    async with open_durable_app(FakeDisk(), durable_config()) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/e", json={"durability": "ephemeral"})
        r = await client.post("/v0/watch", json={"topics": {"e": {}}, "consistency": "strong"})
        s = await open_stream(nursery, h.app.asgi_app, (await r.get_json())["wid"])
        await s.read_frames(3)
        await client.post("/v0/topics/e", json={"records": [{"data": 1}]})
        t0 = trio.current_time()
        (f,) = await s.read_frames(1)
        assert f.event == "record" and trio.current_time() == t0


async def test_strong_catch_up_stops_at_the_durable_head(autojump_clock, nursery):
    cfg = durable_config(wal={"disk_fsync_interval_ms": 1000})
    async with open_durable_app(FakeDisk(), cfg) as h:
        client = h.app.test_client()
        await client.put("/v0/topics/t", json={"durability": "disk"})
        await client.post("/v0/topics/t", json={"records": [{"data": 1}]})
        await advance(autojump_clock, 1.0)  # one tail-sync interval
        assert h.engine.topics["t"].durable_head == 1
        await client.post("/v0/topics/t", json={"records": [{"data": 2}]})
        r = await client.post("/v0/watch", json={"topics": {"t": {}}, "consistency": "strong"})
        s = await open_stream(nursery, h.app.asgi_app, (await r.get_json())["wid"])
        frames = await s.read_frames(4)
        assert frames[2].event == "record"
        assert [x["$seq"] for x in frames[2].data["records"]] == [1]
        assert frames[3].event == "caught-up"
        (f,) = await s.read_frames(1)
        assert f.event == "record" and f.data["from_seq"] == 1 and f.data["to_seq"] == 2
