"""Queues across restarts and storage faults: acked jobs never come back, nothing else
is lost.

Method: an engine on a `FakeDisk` (`open_durable`, inline offload and recovery) runs
claims and acks through `engine.queues`, then is reopened on the same disk: a *process
crash* by reopening without `crash()` (the page cache survives), a *power loss* by
`FakeDisk.crash(power_off=True)` with a new boot id, and a checkpoint in between to put
the deletes into a snapshot. Leases are not persisted, so after any restart every job
not acked must be claimable again, in claim order, with fresh delivery counters.
`FaultFs` fails the WAL write of an ack's delete to check the 503 path.
"""

from __future__ import annotations

import errno

import msgspec
import pytest
import trio

from topicd.engine.engine import Engine
from topicd.errors import StorageUnavailable
from topicd.offload import InlineOffload
from topicd.storage.checkpoint import Checkpointer
from topicd.testing.fake_clock import advance
from topicd.testing.fake_fs import FakeDisk, FaultFs
from topicd.testing.harness import open_durable
from topicd.wire import DiffIn, RecordIn, TopicConfigIn, WriteIn

PRIOS = [0, 3, 0, -1, 3, 0, 1, 0, 0, 2]  # jobs 1..10


async def produce(engine: Engine, name: str = "q") -> None:
    records = [
        RecordIn(data=msgspec.Raw(b"%d" % i), priority=p or None) for i, p in enumerate(PRIOS, 1)
    ]
    await engine.append(name, WriteIn(records=records))


def claim_order(seqs: set[int]) -> list[int]:
    return sorted(seqs, key=lambda s: (-PRIOS[s - 1], s))


async def live_seqs(engine: Engine, name: str = "q") -> list[int]:
    _, res = await engine.diff(name, DiffIn(limit=1000))
    return [msgspec.json.decode(r)["$seq"] for r in res.records]


async def claim_all(engine: Engine, name: str = "q") -> list[tuple[int, int]]:
    res = await engine.queues.claim(name, "w", 1000, None)
    return [(j["$seq"], j["deliveries"]) for j in map(msgspec.json.decode, res.items)]


async def work_some(engine: Engine, durability: str) -> set[int]:
    """Create the queue, claim 6 jobs, ack 3 of them, nack 1. Returns the acked seqs."""
    await engine.put_topic("q", TopicConfigIn(type="queue", durability=durability))
    await produce(engine)
    res = await engine.queues.claim("q", "w", 6, None)
    claimed = [msgspec.json.decode(j)["$seq"] for j in res.items]
    assert claimed == claim_order(set(range(1, 11)))[:6]
    acked = claimed[:2] + claimed[3:4]
    assert (await engine.queues.ack("q", "w", acked[:2], [])).done == 2
    assert (await engine.queues.ack("q", "w", acked[2:], [])).done == 1
    assert (await engine.queues.nack("q", "w", claimed[2:3], [], 0)).done == 1
    return set(acked)


async def check_after_restart(engine: Engine, acked: set[int]) -> None:
    left = set(range(1, 11)) - acked
    assert await live_seqs(engine) == sorted(left)
    q = engine.get("q").queue
    assert q is not None
    assert (q.counts().ready, q.counts().in_flight) == (7, 0)
    # every unacked job is claimable at once, in claim order, deliveries from 1 again
    assert await claim_all(engine) == [(s, 1) for s in claim_order(left)]


@pytest.mark.parametrize("durability", ["memory", "disk", "fsync"])
async def test_acked_jobs_never_reappear_after_a_process_crash(durability):
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        acked = await work_some(engine, durability)
    async with open_durable(disk) as engine:
        await check_after_restart(engine, acked)


@pytest.mark.parametrize("durability", ["memory", "disk", "fsync"])
async def test_acks_are_synced_before_the_answer_and_survive_a_power_loss(durability):
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await engine.put_topic("q", TopicConfigIn(type="queue", durability="fsync"))
        await produce(engine)  # fsync: the jobs themselves are on disk
        await engine.put_topic("q", TopicConfigIn(type="queue", durability=durability))
        res = await engine.queues.claim("q", "w", 3, None)
        claimed = [msgspec.json.decode(j)["$seq"] for j in res.items]
        assert (await engine.queues.ack("q", "w", claimed, [])).done == 3
        disk.crash(power_off=True)
    disk.reboot()
    async with open_durable(disk, boot_id="boot-2") as engine:
        assert not set(await live_seqs(engine)) & set(claimed)


async def test_acks_survive_a_snapshot_and_the_log_after_it():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        acked = await work_some(engine, "disk")
        checkpointer = engine.checkpointer
        assert isinstance(checkpointer, Checkpointer)
        assert await checkpointer.checkpoint()
        res = await engine.queues.claim("q", "w", 1, None)
        seq = msgspec.json.decode(res.items[0])["$seq"]
        assert (await engine.queues.ack("q", "w", [seq], [])).done == 1  # after the snapshot
        acked.add(seq)
    async with open_durable(disk) as engine:
        left = set(range(1, 11)) - acked
        assert await live_seqs(engine) == sorted(left)
        assert await claim_all(engine) == [(s, 1) for s in claim_order(left)]


async def test_priorities_are_recovered_from_the_log_and_from_snapshots():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await engine.put_topic("q", TopicConfigIn(type="queue"))
        await engine.put_topic("s", TopicConfigIn(type="queue"))
        await produce(engine, "s")
        checkpointer = engine.checkpointer
        assert isinstance(checkpointer, Checkpointer)
        assert await checkpointer.checkpoint()
        await produce(engine, "q")  # only in the log
    async with open_durable(disk) as engine:
        for name in ("q", "s"):
            assert [s for s, _ in await claim_all(engine, name)] == claim_order(set(range(1, 11)))


async def test_a_failed_ack_delete_is_503_and_the_job_is_claimable_again(autojump_clock):
    disk = FakeDisk()
    fs = FaultFs(disk)
    async with open_durable(fs) as engine:
        await engine.put_topic("q", TopicConfigIn(type="queue", durability="disk"))
        await produce(engine)
        res = await engine.queues.claim("q", "w", 2, None)
        claimed = [msgspec.json.decode(j)["$seq"] for j in res.items]
        fs.fail("pwrite", nth=1, errno=errno.EIO)
        with pytest.raises(StorageUnavailable):
            await engine.queues.ack("q", "w", claimed, [])
        q = engine.get("q").queue
        assert q is not None
        assert (q.counts().ready, q.counts().in_flight) == (10, 0)
        assert [s for s, _ in await claim_all(engine)][:2] == claimed
    async with open_durable(disk) as engine:
        assert len(await live_seqs(engine)) == 10  # the failed delete never surfaces


@pytest.mark.parametrize("fails", [False, True])
async def test_an_ack_cancelled_while_its_delete_commits_ends_as_the_commit_does(
    autojump_clock, fails
):
    """The acking request goes away (cancelled) while its delete waits for the WAL: the
    commit still decides. Committed: the jobs are gone. Failed: they are claimable again
    (nobody is left to release them but the commit path)."""
    disk = FakeDisk()
    fs = FaultFs(disk)
    slow = False
    offload = InlineOffload(lambda group: 1.0 if slow and group == "wal" else 0.0)
    async with open_durable(fs, offload=offload) as engine:
        await engine.put_topic("q", TopicConfigIn(type="queue", durability="disk"))
        await produce(engine)
        res = await engine.queues.claim("q", "w", 2, None)
        claimed = [msgspec.json.decode(j)["$seq"] for j in res.items]
        slow = True
        if fails:
            fs.fail("pwrite", nth=1, errno=errno.EIO)
        with trio.move_on_after(0.5) as scope:
            await engine.queues.ack("q", "w", claimed, [])
        assert scope.cancelled_caught
        q = engine.get("q").queue
        assert q is not None
        assert (q.counts().ready, q.counts().in_flight) == (8, 0)  # held meanwhile
        await advance(autojump_clock, 2)  # the WAL write resolves
        slow = False
        if fails:
            assert q.counts().ready == 10
            assert [s for s, _ in await claim_all(engine)][:2] == claimed
        else:
            assert q.counts().ready == 8
            assert sorted(set(await live_seqs(engine)) & set(claimed)) == []
