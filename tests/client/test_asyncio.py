"""The client runs under asyncio too (it is written against anyio).

Method: the server runs on this test's Trio loop (real sockets, port 0); the client runs
in a worker thread under `asyncio.run`, doing a write, a diff, a watch, a backpressure
delay (timed with the asyncio loop's clock) and a queue worker whose handler outlives
its lease, so only the heartbeats keep the jobs. Everything it saw is checked back on
the Trio side.
"""

from __future__ import annotations

import asyncio

import pytest
import trio

from tests.server.helpers import served
from topicd.client import CaughtUp, Client, Record, ZoneReport
from topicd.testing.harness import make_config

pytestmark = pytest.mark.slow


async def test_the_client_under_asyncio():
    async with served(make_config(server={"port": 0})) as (_e, _a, host, port):
        url = f"http://{host}:{port}"
        zones: list[ZoneReport] = []

        async def main():
            out = {}
            async with Client(url, on_zone=zones.append) as c:
                await c.write_batch("a", [{"data": i} for i in range(1, 4)])
                out["diff"] = [e.seq async for e in c.diff("a")]
                async with c.watch({"a": 0}) as w:
                    seen = []
                    async for e in w:
                        if isinstance(e, Record):
                            seen.append(e.seq)
                        if isinstance(e, CaughtUp):
                            break
                    out["watch"] = seen
                await c.write("a", 4)  # the client learns `a` is a log (no in-flight)
                # a pressure signal in the proportional band delays the next batch
                c.signals.observe_pressure("0.75")
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                await c.write("a", 5)
                out["delay_s"] = loop.time() - t0
                await c.put_topic("q", {"type": "queue"})
                await c.write_batch("q", [{"data": i} for i in range(3)])
                handled = []

                async def handler(job):
                    await asyncio.sleep(1.5)  # longer than the lease: heartbeats keep it
                    handled.append((job.seq, job.deliveries))

                stats = await c.run_worker(
                    "q", handler, node="aio", concurrency=3, lease_ms=600, stop_when_idle=True
                )
                out["handled"] = sorted(handled)
                out["acked"] = stats.acked
            return out

        with trio.fail_after(30):
            out = await trio.to_thread.run_sync(lambda: asyncio.run(main()))
    assert out["diff"] == [1, 2, 3]
    assert out["watch"] == [1, 2, 3]
    # the 250 ms delay is waited on asyncio's clock until the reading is 100 ms old; the
    # re-read then finds the real server calm, which ends the wait
    assert 0.09 <= out["delay_s"] < 0.24
    assert any(z.zone == "amber" and z.delay_ms == pytest.approx(250) for z in zones)
    assert any(z.zone == "amber" and z.delay_ms == pytest.approx(250) for z in zones)
    assert out["handled"] == [(1, 1), (2, 1), (3, 1)] and out["acked"] == 3
