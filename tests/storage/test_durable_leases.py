"""Durable leases (`leases_durable: true`): leases, delivery counters and nack delays
survive restarts; a lease event that cannot be logged changes nothing.

Method: an engine on a `FakeDisk` (`open_durable`: inline offload and recovery, so the
`autojump_clock` drives everything) with one `FakeWallClock` shared by every start, so
wall time runs on across restarts as it does on a real machine. Each test works a queue
through `engine.queues` and restarts on the same disk in one of three ways:

* *log replay*: the final snapshot is made to fail (`FaultFs` refuses the rename), so the
  next start rebuilds the lease table from the `Lease` frames alone (a process crash
  after the final sync);
* *power loss*: `FakeDisk.crash(power_off=True)` while the engine runs, then a new boot
  id: only synced bytes survive, and lease events are synced before their answer;
* *snapshot*: a checkpoint in the middle (the lease state in the snapshot, the rest in
  the log after it), and the clean shutdown's final snapshot.

After the restart the table must be the one before it: the same holders and fences
(an ack with a fence from before the restart works), the same deadlines (a recovered
lease expires when its wall-clock deadline passes, not before), delivery counters that
go on counting, nack delays that end when they would have. `FaultFs` fails the WAL write
or sync of a lease event to check the `503` answers that change nothing.
"""

from __future__ import annotations

import errno
import posixpath
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import msgspec
import pytest
import trio
import trio.testing

from topicd.errors import StorageUnavailable
from topicd.storage import frame as frames
from topicd.storage.checkpoint import Checkpointer
from topicd.testing.fake_clock import FakeWallClock, advance
from topicd.testing.fake_fs import FakeDisk, FaultFs
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import RecordIn, TopicConfigIn, WriteIn

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from topicd.engine.engine import Engine
    from topicd.engine.queues import JobQueue

N_JOBS = 10
LEASE_MS = 10_000


def queue_config(durability: str = "disk", **kw: object) -> TopicConfigIn:
    return TopicConfigIn(
        type="queue", durability=durability, leases_durable=True, lease_ms=LEASE_MS, **kw
    )


async def produce(engine: Engine, name: str = "q", n: int = N_JOBS) -> None:
    records = [RecordIn(data=msgspec.Raw(b"%d" % i)) for i in range(1, n + 1)]
    await engine.append(name, WriteIn(records=records))


async def claim(
    engine: Engine, want: int, node: str = "w", name: str = "q", lease_ms: int | None = None
) -> list[dict]:
    res = await engine.queues.claim(name, node, want, lease_ms)
    return [msgspec.json.decode(item) for item in res.items]


def table(engine: Engine, name: str = "q") -> JobQueue:
    q = engine.get(name).queue
    assert q is not None
    return q


def state(q: JobQueue) -> tuple[object, ...]:
    """What must survive a restart: leases (holder, fence, wall deadline), counters,
    which jobs wait out a nack delay, and the counts."""
    leases = sorted((s, ls.node, ls.lease_id, ls.deadline_ms) for s, ls in q.leases.items())
    c = q.counts()
    return leases, sorted(q.deliveries.items()), sorted(q.delayed), (c.ready, c.in_flight)


def lease_frames(disk: FakeDisk) -> list[frames.Frame]:
    """Every `Lease` frame in the WAL, in file order."""
    out = []
    for path, data in sorted(disk.tree().items()):
        if not (path.startswith("/data/wal/") and posixpath.basename(path).startswith("wal-")):
            continue
        pos = frames.FILE_HEADER_LEN
        while (f := frames.read_frame(data, pos, len(data), 1 << 24)) is not None:
            if f.ftype == frames.LEASE:
                out.append(f)
            pos = f.end
    return out


@asynccontextmanager
async def no_final_snapshot(disk: FakeDisk, clock: FakeWallClock) -> AsyncIterator[Engine]:
    """An engine whose shutdown cannot write its final snapshot: the next start replays
    the log (what a process crash after the last sync leaves)."""
    fs = FaultFs(disk)
    async with open_durable(fs, clock=clock) as engine:
        yield engine
        fs.fail("rename", always=True)


async def work(engine: Engine) -> dict[str, list[dict]]:
    """Claim 4 (seqs 1-4), nack 1 now and 2 for 5 s, claim 1 again (1, its 2nd delivery),
    extend 3 to 60 s. Leaves 1 and 3 leased, 4 leased as claimed, 2 delayed."""
    first = await claim(engine, 4)
    assert [j["$seq"] for j in first] == [1, 2, 3, 4]
    assert (await engine.queues.nack("q", "w", [1], [], 0)).done == 1
    assert (await engine.queues.nack("q", "w", [2], [], 5_000)).done == 1
    again = await claim(engine, 1)
    assert [(j["$seq"], j["deliveries"]) for j in again] == [(1, 2)]
    res = await engine.queues.extend("q", "w", [3], [first[2]["lease_id"]], 60_000)
    assert res.done == 1
    return {"first": first, "again": again}


async def check_restored(engine: Engine, before: tuple[object, ...], got: dict) -> None:
    q = table(engine)
    assert state(q) == before
    # a fence from before the restart still matches its lease
    fence = got["again"][0]["lease_id"]
    assert (await engine.queues.ack("q", "w", [1], [fence])).done == 1
    # fresh jobs are claimable, leased and delayed ones are not
    fresh = await claim(engine, 10, node="v", lease_ms=3_600_000)
    assert [(j["$seq"], j["deliveries"]) for j in fresh] == [(s, 1) for s in range(5, 11)]
    # the delay ends 5 s after the nack, the claimed lease 10 s after the claim, the
    # extended one 60 s after the extend: each job comes back with its counter going on
    hour = 3_600_000
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, trio.testing.MockClock)
    await advance(clock, 5)
    assert [(j["$seq"], j["deliveries"]) for j in await claim(engine, 10, lease_ms=hour)] == [
        (2, 2)
    ]
    await advance(clock, 5.01)  # a lease is expired once its deadline passed by a ms
    assert [(j["$seq"], j["deliveries"]) for j in await claim(engine, 10, lease_ms=hour)] == [
        (4, 2)
    ]
    await advance(clock, 50)
    assert [(j["$seq"], j["deliveries"]) for j in await claim(engine, 10, lease_ms=hour)] == [
        (3, 2)
    ]


@pytest.mark.parametrize("durability", ["memory", "disk", "fsync"])
async def test_leases_and_delivery_counts_are_rebuilt_from_the_log(autojump_clock, durability):
    disk, clock = FakeDisk(), FakeWallClock()
    async with no_final_snapshot(disk, clock) as engine:
        await engine.put_topic("q", queue_config(durability))
        await produce(engine)
        got = await work(engine)
        before = state(table(engine))
    async with open_durable(disk, clock=clock) as engine:
        await check_restored(engine, before, got)


async def test_lease_events_survive_a_power_loss(autojump_clock):
    disk, clock = FakeDisk(), FakeWallClock()
    async with open_durable(disk, clock=clock) as engine:
        await engine.put_topic("q", queue_config("fsync"))
        await produce(engine)
        got = await work(engine)
        before = state(table(engine))
        disk.crash(power_off=True)
    disk.reboot()
    async with open_durable(disk, clock=clock, boot_id="boot-2") as engine:
        await check_restored(engine, before, got)


@pytest.mark.parametrize("final_snapshot", [True, False])
async def test_lease_state_is_carried_by_snapshots(autojump_clock, final_snapshot):
    disk, clock = FakeDisk(), FakeWallClock()
    fs = FaultFs(disk)
    async with open_durable(fs, clock=clock) as engine:
        await engine.put_topic("q", queue_config())
        await produce(engine)
        first = await claim(engine, 4)
        assert (await engine.queues.nack("q", "w", [2], [], 5_000)).done == 1
        checkpointer = engine.checkpointer
        assert isinstance(checkpointer, Checkpointer)
        assert await checkpointer.checkpoint()  # leases 1, 3, 4 and 2's delay in it
        # after the snapshot, in the log only: 1 released and re-claimed, 3 extended
        assert (await engine.queues.nack("q", "w", [1], [], 0)).done == 1
        got = {"first": first, "again": await claim(engine, 1)}
        assert (await engine.queues.extend("q", "w", [3], [], 60_000)).done == 1
        before = state(table(engine))
        if not final_snapshot:
            fs.fail("rename", always=True)
    async with open_durable(disk, clock=clock) as engine:
        await check_restored(engine, before, got)


async def test_a_second_restart_changes_nothing(autojump_clock):
    disk, clock = FakeDisk(), FakeWallClock()
    async with no_final_snapshot(disk, clock) as engine:
        await engine.put_topic("q", queue_config())
        await produce(engine)
        await work(engine)
        before = state(table(engine))
    async with open_durable(disk, clock=clock) as engine:  # final snapshot this time
        assert state(table(engine)) == before
    async with open_durable(disk, clock=clock) as engine:
        assert state(table(engine)) == before


async def test_acks_and_deletes_end_recovered_leases(autojump_clock):
    disk, clock = FakeDisk(), FakeWallClock()
    async with no_final_snapshot(disk, clock) as engine:
        await engine.put_topic("q", queue_config())
        await produce(engine)
        await claim(engine, 3)
        assert (await engine.queues.ack("q", "w", [1], [])).done == 1
        await engine.queues._delete(
            engine.get("q"), engine.get("q").queue, [2]
        )  # a leased job deleted
    async with open_durable(disk, clock=clock) as engine:
        q = table(engine)
        assert sorted(q.leases) == [3]
        assert sorted(q.deliveries.items()) == [(3, 1)]
        assert (q.counts().ready, q.counts().in_flight) == (7, 1)


async def test_a_lease_counts_as_one_frame_per_call_and_ephemeral_queues_write_none(
    autojump_clock,
):
    disk, clock = FakeDisk(), FakeWallClock()
    async with open_durable(disk, clock=clock) as engine:
        await engine.put_topic("q", queue_config())
        await engine.put_topic("e", queue_config("ephemeral"))
        await engine.put_topic("p", TopicConfigIn(type="queue", durability="disk"))
        for name in ("q", "e", "p"):
            await produce(engine, name)
            jobs = await claim(engine, 3, name=name)
            assert (await engine.queues.nack(name, "w", [jobs[0]["$seq"]], [], 0)).done == 1
            assert (await engine.queues.extend(name, "w", [jobs[1]["$seq"]], [], 500)).done == 1
        tid = engine.get("q").topic_id
        found = lease_frames(disk)
        assert {f.topic_id for f in found} == {tid}
        events = [f.control()["events"] for f in found]
        q = table(engine)
        lid = {s: ls.lease_id for s, ls in q.leases.items()}
        assert len(events) == 3  # all of queue q: ephemeral and plain queues log nothing
        claimed, released, extended = events
        assert [e[:2] + e[4:] for e in claimed] == [
            ["claimed", s, clock.epoch0_ms + LEASE_MS, 1] for s in (1, 2, 3)
        ]
        assert released[0][:2] == ["released", 1] and released[0][4] == 0
        assert extended == [["extended", 2, "w", lid[2], q.leases[2].deadline_ms, 1]]


@pytest.mark.parametrize("op", ["pwrite", "fdatasync"])
async def test_a_failed_claim_event_is_503_and_changes_nothing(autojump_clock, op):
    disk, clock = FakeDisk(), FakeWallClock()
    fs = FaultFs(disk)
    async with open_durable(fs, clock=clock) as engine:
        await engine.put_topic("q", queue_config())
        await produce(engine)
        await claim(engine, 2, lease_ms=3_600_000)  # 1 and 2 leased
        before = state(table(engine))
        fs.fail(op, nth=1, errno=errno.EIO)
        with pytest.raises(StorageUnavailable):
            await claim(engine, 3)
        assert state(table(engine)) == before
        if op == "fdatasync":
            # the unsynced bytes of the failed batch are not fenced until the next file
            # exists: a power loss drops them (a process crash may let them surface, as
            # the storage docs say of any unacknowledged write)
            disk.crash(power_off=True)
    disk.reboot()
    async with open_durable(disk, clock=clock, boot_id="boot-2") as engine:
        assert state(table(engine))[:2] == before[:2]  # the failed claim never surfaces
        # the jobs it had picked are the next ones out, first delivery
        got = await claim(engine, 3)
        assert [(j["$seq"], j["deliveries"]) for j in got] == [(3, 1), (4, 1), (5, 1)]


@pytest.mark.parametrize("op", ["nack", "extend"])
async def test_a_failed_nack_or_extend_event_is_503_and_changes_nothing(autojump_clock, op):
    disk, clock = FakeDisk(), FakeWallClock()
    fs = FaultFs(disk)
    async with open_durable(fs, clock=clock) as engine:
        await engine.put_topic("q", queue_config())
        await produce(engine)
        await claim(engine, 2)
        before = state(table(engine))

        async def call() -> int:
            if op == "nack":
                return (await engine.queues.nack("q", "w", [1, 2], [], 1000)).done
            return (await engine.queues.extend("q", "w", [1, 2], [], 60_000)).done

        fs.fail("pwrite", nth=1, errno=errno.EIO)
        with pytest.raises(StorageUnavailable):
            await call()
        assert state(table(engine)) == before
        # the shard works on (a write error below the breaker's threshold): the same
        # call succeeds now
        assert await call() == 2


async def test_an_open_breaker_refuses_durable_lease_calls_only(autojump_clock):
    disk, clock = FakeDisk(), FakeWallClock()
    fs = FaultFs(disk)
    config = durable_config(shards=1)  # both queues on the shard whose breaker opens
    async with open_durable(fs, config, clock) as engine:
        await engine.put_topic("q", queue_config())
        await engine.put_topic("p", TopicConfigIn(type="queue", durability="disk"))
        await produce(engine, "q")
        await produce(engine, "p")
        held = await claim(engine, 1)
        fs.fail("fdatasync", nth=1, errno=errno.EIO)  # a sync error opens the breaker
        with pytest.raises(StorageUnavailable):
            await claim(engine, 1)
        before = state(table(engine))
        for call in (
            claim(engine, 1),
            engine.queues.nack("q", "w", [held[0]["$seq"]], [], 0),
            engine.queues.extend("q", "w", [held[0]["$seq"]], [], 1000),
        ):
            with pytest.raises(StorageUnavailable) as err:
                await call
            assert err.value.retry_after_s() >= 1
        assert state(table(engine)) == before
        # an ack's delete cannot be logged either: 503, and the job is claimable again
        with pytest.raises(StorageUnavailable):
            await engine.queues.ack("q", "w", [held[0]["$seq"]], [])
        assert table(engine).counts().in_flight == 0
        # a queue without durable leases claims, nacks and extends in memory meanwhile
        got = await claim(engine, 2, name="p")
        assert len(got) == 2
        assert (await engine.queues.nack("p", "w", [got[0]["$seq"]], [], 0)).done == 1
