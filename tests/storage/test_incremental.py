"""Incremental checkpoints: a checkpoint re-captures only the topics that changed.

Method: a durable engine on `FakeDisk` with many topics; after a first checkpoint, one
topic changes (a write, a delete, a config change, a read) and the next checkpoint must
capture that topic only, reuse every other entry as it was, and still leave a snapshot
from which recovery rebuilds exactly the live state. Every test in the suite runs with
`snapshot.VERIFY_INCREMENTAL` (tests/conftest.py): each reused entry is compared with a
fresh capture of its topic; the last test shows that check catching a mutation that did
not mark its topic changed.
"""

from __future__ import annotations

import pytest

from tests.storage.test_checkpoint import cp, state, write
from topicd.storage import snapshot
from topicd.testing.fake_fs import FakeDisk, FaultFs
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import DeleteIn, DiffIn, TopicConfigIn


async def test_a_checkpoint_captures_only_the_topics_that_changed():
    disk = FakeDisk()
    cfg = durable_config()
    async with open_durable(disk, cfg) as engine:
        for i in range(40):
            await write(engine, f"t{i}", b"%d" % i, b"2")
        assert await cp(engine).checkpoint()
        assert cp(engine).last_captured == 40
        await write(engine, "t3", b"3")
        assert await cp(engine).checkpoint()
        assert cp(engine).last_captured == 1
        await engine.delete_records("t4", DeleteIn(before_seq=2))
        await engine.put_topic("t5", TopicConfigIn(cap_records=1))  # evicts: one change
        await engine.diff("t6", DiffIn(from_seq=0))  # a read moves last_read_ts
        assert await cp(engine).checkpoint()
        assert cp(engine).last_captured == 3
        assert await cp(engine).checkpoint()
        assert cp(engine).last_captured == 0
        expected = await state(engine)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected


async def test_a_failed_checkpoint_captures_its_topics_again():
    disk = FakeDisk()
    fs = FaultFs(disk)
    cfg = durable_config()
    async with open_durable(fs, cfg) as engine:
        await write(engine, "a", b"1")
        await write(engine, "b", b"1")
        assert await cp(engine).checkpoint()
        await write(engine, "a", b"2")
        fs.fail("rename", nth=1)
        assert not await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()
        assert cp(engine).last_captured == 1
        expected = await state(engine)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected


async def test_the_check_catches_a_change_that_did_not_mark_its_topic():
    disk = FakeDisk()
    async with open_durable(disk, durable_config()) as engine:
        await write(engine, "a", b"1")
        assert await cp(engine).checkpoint()
        engine.get("a").last_read_ts = 12345  # not marked changed: a stale entry
        with pytest.raises(AssertionError, match=r"changed without Topic\.changed"):
            snapshot.capture(
                engine, [(0, 0)], 0, segments=cp(engine).segments, reuse=cp(engine)._encoded
            )
        engine.get("a").changed = True
