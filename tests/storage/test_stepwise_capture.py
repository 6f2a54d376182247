"""A checkpoint's capture runs in steps that yield to the loop, yet is one consistent cut.

Method: a durable engine on `FakeDisk`; the checkpointer's yield budget is replaced by one
that, at chosen yields inside the capture, mutates the engine (writes to every topic —
some already captured, some not yet —, deletes a topic, creates one, deletes records,
tightens a cap). The snapshot that checkpoint writes is then the only thing recovery
starts from (the disk is made durable and the process "crashes" before the final
checkpoint): the rebuilt state must equal what the live engine held. A capture that took
its WAL positions before the mutations would replay them again (the created topic twice:
refused); one that kept a topic's copy from before its mutation would lose records.
"""

from __future__ import annotations

import pytest
import trio

from tests.storage.test_checkpoint import cp, state, write
from topicd.storage import checkpoint, snapshot
from topicd.storage import segments as segs
from topicd.testing.fake_fs import FakeDisk, FaultFs
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import DeleteIn, TopicConfigIn


class HookBudget:
    """A yield budget whose `tick` runs `hooks[n]` at its n-th call (and yields)."""

    def __init__(self, hooks: dict[int, object]) -> None:
        self.hooks = hooks
        self.calls = 0
        self.on_pause: object = None  # run at the first `pause` (the install's yields)

    async def tick(self) -> None:
        self.calls += 1
        hook = self.hooks.get(self.calls)
        if hook is not None:
            await hook()  # type: ignore[operator]
        await trio.lowlevel.checkpoint()

    async def pause(self) -> None:
        hook, self.on_pause = self.on_pause, None
        if hook is not None:
            await hook()  # type: ignore[operator]
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize("inline", [0, 2048])
@pytest.mark.parametrize("sync_topics", [256, 3])
async def test_topics_changing_between_the_steps_of_a_capture_are_captured_as_of_its_end(
    monkeypatch, sync_topics, inline
):
    """`inline` 0: every topic's records go into segments; 2048 (the default): they stay
    in the snapshot entries (inline topics)."""
    monkeypatch.setattr(snapshot, "_SYNC_TOPICS", sync_topics)  # 3: a second chunked pass
    monkeypatch.setattr(checkpoint, "_INSTALL_TOPICS", sync_topics)  # 3: installs in steps
    disk = FakeDisk()
    cfg = durable_config(segments={"inline_max_bytes": inline})
    async with open_durable(disk, cfg) as engine:
        for i in range(40):
            await write(engine, f"t{i}", b"%d" % i, b"1")
        assert await cp(engine).checkpoint()
        for i in range(40):
            await write(engine, f"t{i}", b"2")  # all 40 are captured in steps

        async def first() -> None:
            for i in range(40):
                await write(engine, f"t{i}", b"3")
            await engine.delete_topic("t7", False)
            await write(engine, "fresh", b"1")
            await engine.delete_records("t8", DeleteIn(before_seq=3))
            await engine.put_topic("t9", TopicConfigIn(cap_records=1))

        async def second() -> None:
            for i in range(0, 40, 2):
                if i != 7:
                    await write(engine, f"t{i}", b"4")
            await write(engine, "fresh", b"2")

        # pass 1 takes the 40 topics (yields 1-40); with `sync_topics` 3 the ~20 changed
        # at yield 20 are taken again in a chunked pass 2 (yields 41-), else at once
        late = 42 if sync_topics == 3 else 30
        budget = HookBudget({20: first, late: second})

        async def installing() -> None:  # a write while the new registry is installed
            await write(engine, "t1", b"5")
            await engine.delete_records("t2", DeleteIn(before_seq=2))

        budget.on_pause = installing
        monkeypatch.setattr(checkpoint.Budget, "for_class", lambda *a: budget)
        assert await cp(engine).checkpoint()
        budget.hooks = {}
        assert budget.calls >= late
        assert budget.on_pause is None
        live = await state(engine)
        disk.sync_all()
        disk.crash(power_off=True)  # no final checkpoint: recovery starts from that one
    disk.reboot()
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == live
        assert "t7" not in live
        assert len(live["fresh"][0]) == 2  # type: ignore[index]


async def test_a_deletion_a_failed_checkpoint_missed_is_taken_by_the_next():
    """Deleted topics reach the capture as a list (`Engine.deleted_ids`), not by comparing
    every id: a failed checkpoint gives its list back, so the next one still drops the
    entry and the segment directory."""
    disk = FakeDisk()
    fs = FaultFs(disk)
    cfg = durable_config(segments={"inline_max_bytes": 0})
    async with open_durable(fs, cfg) as engine:
        await write(engine, "a", b"1")
        await write(engine, "b", b"1")
        assert await cp(engine).checkpoint()
        tid = engine.get("a").topic_id
        assert disk.exists(segs.topic_dir("/data", tid))
        await engine.delete_topic("a", False)
        fs.fail("rename", nth=1)
        assert not await cp(engine).checkpoint()
        assert engine.deleted_ids == [tid]
        assert await cp(engine).checkpoint()
        assert engine.deleted_ids == []
        assert tid not in cp(engine)._encoded
        assert await cp(engine).checkpoint()  # the directory goes one snapshot later
        assert not disk.exists(segs.topic_dir("/data", tid))
        live = await state(engine)
        disk.sync_all()
        disk.crash(power_off=True)
    disk.reboot()
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == live
        assert "a" not in live
