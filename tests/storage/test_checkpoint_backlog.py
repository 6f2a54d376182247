"""Backpressure on the checkpoint backlog: records not yet absorbed are pinned in memory.

Method: a durable engine on `FakeDisk` with a tiny `wal_bytes_threshold`; checkpoints
are held off (the checkpointer's lock is taken), so the WAL bytes written since the last
snapshot grow. The write that reaches `BACKLOG_THRESHOLDS × wal_bytes_threshold` is
still accepted; the next durable write gets `429 wal_ingest` (scope `shard`, a retry
hint), an `ephemeral` one and a `disable_backpressure` one are accepted, the
`checkpoint_backlog` queue reports the backlog at its bound, and once a checkpoint
commits writes are accepted again.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.storage.test_checkpoint import cp, write
from topicd.errors import Throttled
from topicd.storage.checkpoint import BACKLOG_THRESHOLDS
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
        async with checkpointer._lock:  # no checkpoint can run meanwhile
            accepted = 0
            while not checkpointer.backlog_full:
                before = checkpointer.backlog()
                assert before < bound
                await write(engine, "t", b'"%s"' % (b"x" * 500))
                accepted += 1
            assert checkpointer.backlog() >= bound
            assert accepted > 2 * BACKLOG_THRESHOLDS
            with pytest.raises(Throttled) as exc:
                await write(engine, "t", b'"one too many"')
            assert exc.value.http_status == 429
            assert exc.value.detail["cause"] == "wal_ingest"
            assert exc.value.detail["scope"] == "shard"
            assert exc.value.detail["retry_after_ms"] > 0
            await write(engine, "eph", b'"not pinned: ephemeral"')
            await write(engine, "t", b'"bypass"', disable_backpressure=True)
            queue = engine.saturation.queues["checkpoint_backlog"]
            assert queue.depth() >= queue.capacity() == bound
            assert queue.full is not None and queue.full() == 1
        assert await checkpointer.checkpoint()
        assert not checkpointer.backlog_full and checkpointer.backlog() == 0
        await write(engine, "t", b'"accepted again"')
