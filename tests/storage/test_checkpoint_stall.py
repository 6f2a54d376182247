"""A checkpoint reports the longest loop step of its own work and of everything else.

Real time inside virtual time: a step of the checkpoint (its absorb, which the inline
offload runs on the loop) is made to hold the loop with a busy-wait of a known length,
and another task holds it for longer while the checkpoint runs; the checkpoint must
report at least each, on the right side, in its attributes, its log line and its
metrics, and leave no instrument installed, whether it succeeded or failed.
"""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import trio
import trio.lowlevel

from topicd.storage.checkpoint import Checkpointer
from topicd.testing.fake_fs import FakeDisk, FaultFs
from topicd.testing.harness import open_durable, open_durable_app
from topicd.wire import RecordIn, WriteIn


def hold(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def slow_absorb(cp: Checkpointer, ms: float, started: trio.Event) -> None:
    """Make the checkpoint's absorb hold the loop for `ms` (inline offload: on the
    loop, in the checkpoint's task)."""
    absorb = cp.segments.absorb

    def held(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.set()
        hold(ms)
        return absorb(*args, **kwargs)

    cp.segments.absorb = held  # type: ignore[method-assign]


async def test_a_checkpoint_step_holding_the_loop_is_reported(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="topicd.checkpoint")
    async with open_durable(FakeDisk()) as engine:
        cp = engine.checkpointer
        assert isinstance(cp, Checkpointer)
        await engine.append("t", WriteIn(records=[RecordIn(data=msgspec.Raw(b"1"))]))
        started = trio.Event()
        slow_absorb(cp, 30, started)

        async def hog() -> None:  # another task, holding the loop while the checkpoint runs
            await started.wait()
            hold(50)
            await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hog, name="hog")
            assert await cp.checkpoint()
        assert cp.last_stall_ms >= 30
        assert cp.last_other_stall_ms >= 50
        assert cp.last_other_task == "hog"
        line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint ")]
        assert len(line) == 1
        assert f"longest loop step {cp.last_stall_ms:.1f} ms" in line[0]
        assert f"other tasks' {cp.last_other_stall_ms:.1f} ms (CPU " in line[0]
        assert "; hog at test_checkpoint_stall.py:" in line[0]
        with pytest.raises(KeyError):  # the instrument is gone
            trio.lowlevel.remove_instrument(cp.meter)


async def test_a_failed_checkpoint_is_measured_and_removes_its_instrument(autojump_clock):
    fs = FaultFs(FakeDisk())
    async with open_durable(fs) as engine:
        cp = engine.checkpointer
        assert isinstance(cp, Checkpointer)
        await engine.append("t", WriteIn(records=[RecordIn(data=msgspec.Raw(b"1"))]))
        slow_absorb(cp, 20, trio.Event())
        fs.fail("rename", nth=1)  # the snapshot's rename: the checkpoint fails
        assert not await cp.checkpoint()
        assert cp.failures == 1
        assert cp.last_stall_ms >= 20
        with pytest.raises(KeyError):
            trio.lowlevel.remove_instrument(cp.meter)
        del cp.segments.absorb  # (the class's again)
        assert await cp.checkpoint()
        with pytest.raises(KeyError):
            trio.lowlevel.remove_instrument(cp.meter)


async def test_the_stalls_are_metrics(autojump_clock):
    async with open_durable_app(FakeDisk()) as h:
        cp = h.engine.checkpointer
        assert isinstance(cp, Checkpointer)
        client = h.app.test_client()
        r = await client.post("/v0/topics/t", json={"records": [{"data": 1}]})
        assert r.status_code == 201, await r.get_data()
        slow_absorb(cp, 25, trio.Event())
        assert await cp.checkpoint()
        text = (await (await client.get("/v0/metrics")).get_data()).decode()
        stall = [
            ln for ln in text.splitlines() if ln.startswith("topicd_checkpoint_loop_stall_ms ")
        ]
        assert len(stall) == 1 and float(stall[0].split()[1]) >= 25
        assert any(ln.startswith("topicd_checkpoint_other_stall_ms ") for ln in text.splitlines())
