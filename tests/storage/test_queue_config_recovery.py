"""The queue config extensions across restarts: `depth_soft_limit`, `retry_backoff_ms`
and `retry_backoff_max_ms` are stored with the topic's config and recovered from the log
and from a snapshot, and a recovered queue with a soft limit is back in the saturation
registry (its depth levels work at once).

Method: an engine on a `FakeDisk` (`open_durable`) is reopened on the same disk (a
process crash: the page cache survives), with and without a checkpoint in between.
"""

from __future__ import annotations

import pytest

from topicd.storage.checkpoint import Checkpointer
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import open_durable
from topicd.wire import TopicConfigIn

EXT = {"depth_soft_limit": 50, "retry_backoff_ms": 250, "retry_backoff_max_ms": 9000}


@pytest.mark.parametrize("snapshot", [False, True], ids=["log", "snapshot"])
async def test_extensions_are_recovered(snapshot):
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await engine.put_topic("q", TopicConfigIn(type="queue"))
        await engine.put_topic("q", TopicConfigIn(type="queue", **EXT))  # a reconfigure
        await engine.put_topic("plain", TopicConfigIn(type="queue"))
        if snapshot:
            checkpointer = engine.checkpointer
            assert isinstance(checkpointer, Checkpointer)
            assert await checkpointer.checkpoint()
    async with open_durable(disk) as engine:
        cfg = engine.get("q").config
        got = {k: getattr(cfg, k) for k in EXT}
        assert got == EXT
        assert engine.get("q").config.to_wire()["depth_soft_limit"] == 50
        wire = engine.get("plain").config.to_wire()
        assert not set(EXT) & set(wire)
        assert "jobs.q" in engine.saturation.queues
        assert "jobs.plain" not in engine.saturation.queues
