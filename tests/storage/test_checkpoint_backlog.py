"""Backpressure on the checkpoint backlog: records not yet absorbed are pinned in memory.

Method: a durable engine on `FakeDisk` with a tiny `wal_bytes_threshold` (MockClock,
autojump); checkpoints are held off (the checkpointer's lock is taken), so the WAL bytes
written since the last snapshot grow. The write that reaches `BACKLOG_THRESHOLDS ×
wal_bytes_threshold` is still accepted; the next durable write waits for a checkpoint,
and after `backpressure.bypass_wait_ms` without one gets `429 wal_ingest` (scope
`shard`, a retry hint); an `ephemeral` one and a `disable_backpressure` one are accepted
at once; the `checkpoint_backlog` queue reports the backlog at its bound. A write waiting
when a checkpoint commits goes through.
"""

from __future__ import annotations

import dataclasses

import pytest
import trio

from tests.storage.test_checkpoint import cp, write
from topicd.errors import Throttled
from topicd.storage.checkpoint import BACKLOG_THRESHOLDS
from topicd.testing.fake_clock import advance
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import TopicConfigIn

THRESHOLD = 8192


def config():
    cfg = durable_config()
    snap = dataclasses.replace(cfg.storage.snapshot, wal_bytes_threshold=THRESHOLD)
    return dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, snapshot=snap))


async def test_writes_get_429_while_the_checkpoint_backlog_is_at_its_bound(autojump_clock):
    disk = FakeDisk()
    async with open_durable(disk, config()) as engine:
        await engine.put_topic("eph", TopicConfigIn(durability="ephemeral"))
        checkpointer = cp(engine)
        bound = BACKLOG_THRESHOLDS * THRESHOLD
        assert checkpointer.backlog_bound() == bound
        done: list[int] = []

        async def waiting_write() -> None:
            res = await write(engine, "t", b'"waited"')
            done.append(res.first_seq)

        async with trio.open_nursery() as nursery:
            async with checkpointer._lock:  # no checkpoint can run meanwhile
                accepted = 0
                while not checkpointer.backlog_full:
                    before = checkpointer.backlog()
                    assert before < bound
                    await write(engine, "t", b'"%s"' % (b"x" * 500))
                    accepted += 1
                assert checkpointer.backlog() >= bound
                assert accepted > 2 * BACKLOG_THRESHOLDS
                t0 = trio.current_time()
                with pytest.raises(Throttled) as exc:
                    await write(engine, "t", b'"one too many"')
                waited = trio.current_time() - t0
                assert waited == pytest.approx(engine.cfg.backpressure.bypass_wait_ms / 1000)
                assert exc.value.http_status == 429
                assert exc.value.detail["cause"] == "wal_ingest"
                assert exc.value.detail["scope"] == "shard"
                assert exc.value.detail["retry_after_ms"] > 0
                await write(engine, "eph", b'"not pinned: ephemeral"')
                await write(engine, "t", b'"bypass"', disable_backpressure=True)
                assert trio.current_time() == t0 + waited  # (neither waited)
                queue = engine.saturation.queues["checkpoint_backlog"]
                assert queue.depth() >= queue.capacity() == bound
                assert queue.full is not None and queue.full() == 1
                nursery.start_soon(waiting_write)
                await advance(autojump_clock, 1.0)
                assert not done  # it waits for a checkpoint
            # the lock is free: the checkpointer (poked at the bound) takes one
            assert await checkpointer.checkpoint()
        assert done and not checkpointer.backlog_full
        await write(engine, "t", b'"accepted again"')
