"""The saturation registry and queue-depth levels (scheduler spec R4, R5).

Method: levels against the default `[levels]` bounds at and around each edge; then the
registry inside engines (in-memory and on a `FakeDisk` WAL) through `/v0/metrics`.
"""

from __future__ import annotations

import re

import pytest
import trio
import trio.testing

from tests.sched.helpers import live_conn, received, write_req
from topicd.sched.saturation import SaturationRegistry
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, make_config, open_app, open_durable

LEVELS_CFG = make_config().levels


@pytest.mark.parametrize(
    ("current", "ratio", "expected"),
    [
        (0, 0.0, 0),
        (0, 0.6999, 0),
        (0, 0.70, 1),  # warning from 0.70
        (0, 0.85, 2),  # critical from 0.85
        (0, 0.95, 2),  # overflow only above 0.95
        (0, 0.9501, 3),
        (0, 1.0, 3),
        (3, 0.95, 3),  # hysteresis: overflow is left below 0.90
        (3, 0.9001, 3),
        (3, 0.8999, 2),
        (2, 0.8001, 2),  # critical is left below 0.80
        (2, 0.7999, 1),
        (1, 0.6501, 1),  # warning is left below 0.65
        (1, 0.6499, 0),
        (3, 0.0, 0),  # straight down
        (1, 0.96, 3),  # straight up
    ],
)
def test_level_edges_and_hysteresis(current, ratio, expected):
    reg = SaturationRegistry(LEVELS_CFG)
    assert reg.level_for(current, ratio) == expected


def test_sample_tracks_peak_level_and_changes():
    reg = SaturationRegistry(LEVELS_CFG)
    box = {"depth": 0, "full": 0}
    reg.register("q", lambda: box["depth"], lambda: 100, full=lambda: box["full"])
    for depth, level in [(50, 0), (86, 2), (82, 2), (79, 1), (96, 3), (10, 0)]:
        box["depth"] = depth
        reg.sample(1.0)
        assert reg.queues["q"].level == level, depth
    q = reg.queues["q"]
    assert q.peak == 96
    assert q.changes == {2: 1, 1: 1, 3: 1, 0: 1}


async def test_engine_queues_are_exported(autojump_clock):
    async with open_app() as h:
        c = h.app.test_client()
        h.engine.saturation.sample(0.0)
        text = (await (await c.get("/v0/metrics")).get_data()).decode()
        for q in ("sched_ready.0", "sse_channel", "client_permits", "client_waiters"):
            assert f'topicd_queue_depth{{queue="{q}"}}' in text, q
        assert 'topicd_queue_capacity{queue="sse_channel"} 1024.0' in text
        assert 'topicd_queue_capacity{queue="client_waiters"} 4096.0' in text
        assert 'topicd_queue_level{queue="sse_channel"} 0.0' in text
        assert "# TYPE topicd_queue_full_total counter" in text


async def test_wal_ingest_queues_are_registered(autojump_clock):
    cfg = durable_config(shards=2)
    async with open_durable(FakeDisk(), cfg) as engine:
        names = set(engine.saturation.queues)
        assert {"wal_ingest.0", "wal_ingest.1"} <= names
        q = engine.saturation.queues["wal_ingest.0"]
        assert q.capacity() == cfg.storage.wal.max_pending_per_shard
        assert q.depth() == 0


async def test_the_sse_channel_gauge_is_the_fullest_stream_and_skips_idle_ones(autojump_clock):
    async with open_app() as h:
        engine = h.engine
        await engine.put_topic("t", None)
        busy = await live_conn(engine, "t")  # no pump: what is offered stays queued
        quiet = await live_conn(engine, "t")
        for i in range(3):
            await engine.append("t", write_req(i))
            await trio.testing.wait_all_tasks_blocked()
        received(quiet)  # drained by its reader
        c = h.app.test_client()

        async def depth() -> float:
            engine.saturation.sample(trio.current_time())
            text = (await (await c.get("/v0/metrics")).get_data()).decode()
            m = re.search(r'^topicd_queue_depth\{queue="sse_channel"\} (\S+)$', text, re.M)
            assert m is not None
            return float(m.group(1))

        queued = busy.recv_ch.statistics().current_buffer_used
        assert queued >= 1
        assert await depth() == queued
        # a parked pump's channel is empty by construction, so an idle stream is not
        # asked (forced here on a stream that has frames, to see that it is skipped)
        busy.idle = True
        assert await depth() == 0
        busy.idle = False
