"""The write-ahead log on a fake disk: durability classes, group commit, failures, recovery.

Method: the engine runs on `FakeDisk` through the real `WalCommitPath`, with inline
offload and inline recovery, so everything happens on the test's Trio loop (and
`autojump_clock` drives breaker windows and commit slices). A *process crash* is modelled
by reopening the same `FakeDisk` without `crash()` (the page cache survives, the boot id
is unchanged); a *power loss* by `FakeDisk.crash()` and a new boot id. `FaultFs` injects
I/O errors. Every acknowledged write is checked after recovery.
"""

from __future__ import annotations

import dataclasses
import errno
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.testing

from topicd.engine.engine import Engine
from topicd.errors import StorageUnavailable, Throttled
from topicd.offload import InlineOffload
from topicd.storage import frame as frames
from topicd.storage.breaker import BreakerState
from topicd.storage.recovery import RecoveryRefused
from topicd.storage.wal import WalCommitPath
from topicd.testing.fake_clock import FakeWallClock
from topicd.testing.fake_fs import FakeDisk, FaultFs
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import DeleteIn, DiffIn, RecordIn, TopicConfigIn, WriteIn


def recs(*datas: bytes, tag: str | None = None) -> list[RecordIn]:
    return [RecordIn(data=msgspec.Raw(d), tag=tag) for d in datas]


async def put(engine: Engine, name: str, **cfg):
    topic, _ = await engine.put_topic(name, TopicConfigIn(**cfg))
    return topic


async def write(engine: Engine, name: str, *datas: bytes, **kw):
    return await engine.append(name, WriteIn(records=recs(*datas), **kw))


async def dump(engine: Engine, name: str) -> tuple[list[bytes], object]:
    """Every record from seq 0, and the first tombstone seen."""
    out: list[bytes] = []
    cursor = 0
    first_tomb = None
    while True:
        _, res = await engine.diff(name, DiffIn(from_seq=cursor, limit=1000))
        if res.tombstone is not None and first_tomb is None:
            first_tomb = res.tombstone
        out.extend(res.records)
        cursor = res.next_from_seq
        if res.caught_up:
            return out, first_tomb


@asynccontextmanager
async def until_power_loss(disk: FakeDisk, *args, **kw):
    """Run an engine, then lose power at the end of the block (no clean shutdown)."""
    async with open_durable(disk, *args, **kw) as engine:
        yield engine
        disk.crash(power_off=True)
    disk.reboot()


def wal(engine: Engine) -> WalCommitPath:
    assert isinstance(engine.commit, WalCommitPath)
    return engine.commit


# ---- classes and recovery -------------------------------------------------------------


async def test_every_class_survives_a_process_crash():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        for cls in ("fsync", "disk", "memory", "ephemeral"):
            await put(engine, cls, durability=cls)
            await write(engine, cls, b"1", b'{"a":1.10}')
            await write(engine, cls, b"3")
        before = {cls: await dump(engine, cls) for cls in ("fsync", "disk", "memory")}
        heads = {cls: engine.get(cls).head_seq for cls in ("fsync", "disk", "memory", "ephemeral")}
    # process crash: no crash(), same boot
    async with open_durable(disk) as engine:
        for cls in ("fsync", "disk", "memory"):
            records, tomb = await dump(engine, cls)
            assert records == before[cls][0]
            assert tomb is None
        eph = engine.get("ephemeral")
        assert eph.count == 0  # records RAM-only by design
        assert eph.config.durability == "ephemeral"  # config persists
        for cls, head in heads.items():
            res = await write(engine, cls, b"9")
            assert res.first_seq > head  # never reuse an acknowledged seq


async def test_power_loss_keeps_fsync_acks_and_announces_the_disk_tail(autojump_clock):
    disk = FakeDisk()
    cfg = durable_config(wal={"disk_fsync_interval_ms": 1000})
    async with until_power_loss(disk, cfg) as engine:
        await put(engine, "f", durability="fsync")
        await put(engine, "d", durability="disk")
        await write(engine, "f", b"1")
        await write(engine, "d", b"1")  # the reservation syncs with this first write
        acked = [await write(engine, "d", b"%d" % i) for i in range(2, 6)]
        await write(engine, "f", b"2")
        await trio.sleep(1.5)  # the background tail sync (at 1.0 s) covers them
        late = await write(engine, "d", b"6")  # written; the next tail sync is due at 2.0 s
        assert late.fsync_ms == 0.0
        d_head = engine.get("d").head_seq
    async with open_durable(disk, cfg, boot_id="boot-2") as engine:
        records, tomb = await dump(engine, "f")
        assert [r.split(b'"data":')[1] for r in records] == [b"1}", b"2}"]
        records, tomb = await dump(engine, "d")
        assert len(records) == 1 + len(acked)  # everything synced survived
        assert tomb is not None
        assert tomb.reason == "crash"
        topic = engine.get("d")
        assert tomb.gap_from == len(records) + 1
        assert tomb.gap_to == topic.head_seq  # the whole reservation is announced
        assert d_head <= tomb.gap_to
        res = await write(engine, "d", b"7")
        assert res.first_seq == tomb.gap_to + 1
    # the lost range is itself durable: a second recovery announces the same range
    async with open_durable(disk, cfg, boot_id="boot-2") as engine:
        _, again = await dump(engine, "d")
        assert again is not None
        assert (again.gap_from, again.gap_to) == (tomb.gap_from, tomb.gap_to)


async def test_a_disk_write_is_durable_only_once_the_tail_sync_covers_it(autojump_clock):
    disk = FakeDisk()
    fs = FaultFs(disk)
    cfg = durable_config(wal={"disk_fsync_interval_ms": 1000})
    async with open_durable(fs, cfg) as engine:
        await put(engine, "d", durability="disk")
        await write(engine, "d", b"0")  # its reservation syncs with it
        topic = engine.get("d")
        assert topic.durable_head == 1
        syncs = sum(1 for c in fs.calls if c[0] == "fdatasync")
        async with trio.open_nursery() as n:  # several writes, one unsynced batch or more
            for i in range(1, 6):
                n.start_soon(write, engine, "d", b"%d" % i, b"x")
        assert topic.head_seq == 11
        shard = wal(engine).shard(topic)
        assert shard.unsynced_heads == {topic: 11}  # written and visible, not yet synced
        assert topic.durable_head == 1
        assert sum(1 for c in fs.calls if c[0] == "fdatasync") == syncs
        await trio.sleep(1.5)  # the background tail sync (at 1.0 s) covers them
        assert topic.durable_head == 11
        assert shard.unsynced_heads == {}
        assert sum(1 for c in fs.calls if c[0] == "fdatasync") == syncs + 1


async def test_process_crash_of_disk_class_makes_no_lost_range():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await write(engine, "d", b"1", b"2")
    async with open_durable(disk) as engine:  # same boot: the page cache kept the bytes
        records, tomb = await dump(engine, "d")
        assert len(records) == 2
        assert tomb is None
        assert engine.get("d").lost_ranges == ()


async def test_idempotency_survives_a_restart():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        first = await write(engine, "t", b"1", b"2", idempotency_key="k")
    async with open_durable(disk) as engine:
        again = await write(engine, "t", b"1", b"2", idempotency_key="k")
        assert again.deduped
        assert (again.first_seq, again.count, again.head_seq) == (first.first_seq, 2, 2)


async def test_deletes_configs_and_topic_deletes_are_restored():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await put(engine, "c", cap_records=2, ttl_ms=0)
        await write(engine, "c", b"1", b"2", b"3")
        await write(engine, "t", b"1", b"2", b"3")
        await engine.delete_records("t", DeleteIn(before_seq=3))
        await write(engine, "gone", b"1")
        await engine.delete_topic("gone", False)
        await write(engine, "gone", b"2")  # a new instance
        expected_c = await dump(engine, "c")
        expected_t = await dump(engine, "t")
    async with open_durable(disk) as engine:
        assert engine.get("c").config.cap_records == 2
        records, tomb = await dump(engine, "c")
        assert records == expected_c[0]
        assert (tomb.gap_from, tomb.gap_to, tomb.reason) == (1, 1, "cap")
        assert (await dump(engine, "t"))[0] == expected_t[0]
        assert engine.get("t").earliest_seq == 3
        records, _ = await dump(engine, "gone")
        assert [r.split(b'"data":')[1] for r in records] == [b"2}"]


async def test_recreated_topic_across_shards_replays_to_the_live_instance():
    disk = FakeDisk()
    async with open_durable(disk, durable_config(shards=4)) as engine:
        for _ in range(6):  # new instance ids land on different shards
            await write(engine, "x", b"1")
            await engine.delete_topic("x", False)
        await write(engine, "x", b"last")
        topic_id = engine.get("x").topic_id
    async with open_durable(disk, durable_config(shards=4)) as engine:
        assert engine.get("x").topic_id == topic_id
        assert engine.get("x").count == 1


async def test_rotation_keeps_everything():
    disk = FakeDisk()
    cfg = durable_config(wal={"file_bytes": 4096})
    async with open_durable(disk, cfg) as engine:
        await put(engine, "t", durability="fsync")
        for i in range(200):
            await write(engine, "t", b'"%d-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"' % i)
        assert sum(s.rotations for s in wal(engine).shards) > 3
        expected = await dump(engine, "t")
        disk.crash(power_off=True)
    disk.reboot()
    async with open_durable(disk, cfg, boot_id="boot-2") as engine:
        assert await dump(engine, "t") == expected


# ---- group commit ------------------------------------------------------------------


async def test_concurrent_fsync_writers_share_syncs(autojump_clock):
    disk = FakeDisk()
    fs = FaultFs(disk)
    async with open_durable(fs) as engine:
        await put(engine, "t", durability="fsync")
        await write(engine, "t", b"0")
        syncs_before = sum(1 for c in fs.calls if c[0] == "fdatasync")
        async with trio.open_nursery() as n:
            for i in range(40):
                n.start_soon(write, engine, "t", b"%d" % i)
        syncs = sum(1 for c in fs.calls if c[0] == "fdatasync") - syncs_before
        assert syncs < 10, syncs
        assert engine.get("t").head_seq == 41


def _window_config(**wal: int):
    """A wide group-commit window (50 ms, 10 ms slices), so waiting for company shows."""
    window = {"commit_window_min_ms": 50.0, "commit_window_max_ms": 50.0}
    return durable_config(wal={"gc_slice_us": 10_000, **wal}, governor=window)


async def _concurrent_fsync_writes(fs, sizes: list[int], **wal: int) -> tuple[float, int]:
    """Concurrent `fsync` writes of `sizes` records each: (seconds until every one is
    acknowledged, fdatasyncs they took)."""
    async with open_durable(fs, _window_config(**wal)) as engine:
        await put(engine, "t", durability="fsync")
        await write(engine, "t", b"0")
        syncs_before = sum(1 for c in fs.calls if c[0] == "fdatasync")
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for size in sizes:
                n.start_soon(write, engine, "t", *[b"%d" % i for i in range(size)])
        elapsed = trio.current_time() - t0
        assert engine.get("t").head_seq == 1 + sum(sizes)
        return elapsed, sum(1 for c in fs.calls if c[0] == "fdatasync") - syncs_before


async def test_small_concurrent_fsync_writes_wait_a_slice_for_company(autojump_clock):
    elapsed, syncs = await _concurrent_fsync_writes(FaultFs(FakeDisk()), [1, 1, 1])
    assert syncs == 1
    assert elapsed >= 0.010 - 1e-9  # one slice that brought nothing, then the sync


async def test_a_batch_with_enough_records_syncs_without_waiting(autojump_clock):
    """`gc_enough_records` reached: no slice is waited, later arrivals join the next sync
    (which the loop prepares while this one runs)."""
    elapsed, syncs = await _concurrent_fsync_writes(FaultFs(FakeDisk()), [64, 1])
    assert syncs == 1
    assert elapsed < 0.010
    # the same writes with a higher bar wait a slice, as small ones do
    elapsed, syncs = await _concurrent_fsync_writes(
        FaultFs(FakeDisk()), [64, 1], gc_enough_records=100
    )
    assert syncs == 1
    assert elapsed >= 0.010 - 1e-9


async def test_the_window_stops_once_arrivals_bring_enough_records(autojump_clock):
    """Arrivals taken during the window count: once the batch holds `gc_enough_records`
    it syncs, without one more slice."""
    disk = FakeDisk()
    fs = FaultFs(disk)
    async with open_durable(fs, _window_config(gc_enough_records=10)) as engine:
        await put(engine, "t", durability="fsync")
        await write(engine, "t", b"0")
        syncs_before = sum(1 for c in fs.calls if c[0] == "fdatasync")
        t0 = trio.current_time()
        done: list[float] = []

        async def writer(delay: float, size: int) -> None:
            await trio.sleep(delay)
            await write(engine, "t", *[b"%d" % i for i in range(size)])
            done.append(trio.current_time() - t0)

        async with trio.open_nursery() as n:
            n.start_soon(writer, 0.0, 1)
            n.start_soon(writer, 0.0, 1)
            n.start_soon(writer, 0.005, 9)  # arrives during the first slice: 11 records
        syncs = sum(1 for c in fs.calls if c[0] == "fdatasync") - syncs_before
        assert syncs == 1
        # the sync follows the slice that brought the 9 records (at 10 ms), not a second
        # slice (at 20 ms) that would have found nothing
        assert max(done) < 0.020
        assert max(done) >= 0.010 - 1e-9


async def test_fsync_ack_waits_for_the_sync(autojump_clock):
    disk = FakeDisk()
    slow = InlineOffload(lambda group: 0.05 if group == "wal" else 0.0)
    async with open_durable(disk, offload=slow) as engine:
        await put(engine, "f", durability="fsync")
        t0 = trio.current_time()
        res = await write(engine, "f", b"1")
        assert trio.current_time() - t0 >= 0.05 - 1e-9
        # acknowledged ⇒ durable: a power loss right now keeps it
        path_bytes = disk.tree(durable=True)
        assert any(b'"data":1}' in body for body in path_bytes.values())
        assert res.first_seq == 1


async def test_synced_wal_bytes_are_dropped_from_the_page_cache_and_errors_are_ignored():
    """After its syncs the WAL advises the OS to drop what is now synced from the page cache
    (docs/decisions.md); a failing advice fails nothing."""
    disk = FakeDisk()
    fs = FaultFs(disk)
    cfg = durable_config(wal={"file_bytes": 8192})
    async with open_durable(fs, cfg) as engine:
        await put(engine, "t", durability="fsync")
        fs.fail("drop_cache", always=True)
        for i in range(60):
            await write(engine, "t", b'"%d-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"' % i)
        assert fs.injected and all(c[0] == "drop_cache" for c in fs.injected)
        assert engine.get("t").head_seq == 60
        fs.clear()
        calls, dropped = len(fs.calls), disk.drops
        for i in range(60, 200):
            await write(engine, "t", b'"%d-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"' % i)
        assert sum(s.rotations for s in wal(engine).shards) > 2
        expected = await dump(engine, "t")
    drops = [c for c in fs.calls[calls:] if c[0] == "drop_cache"]
    syncs = [c for c in fs.calls[calls:] if c[0] == "fdatasync"]
    assert drops and len(drops) <= len(syncs)
    assert disk.drops - dropped == len(drops)
    disk.crash(power_off=True)  # advice never loses data: a power loss keeps every fsync ack
    disk.reboot()
    async with open_durable(disk, cfg, boot_id="boot-2") as engine:
        assert await dump(engine, "t") == expected


def test_drop_synced_advises_exactly_the_synced_range():
    from topicd.storage.fs import drop_synced

    disk = FakeDisk()
    fs = FaultFs(disk)
    fd = fs.open("/f", create=True)
    drop_synced(fs, fd, 10, 10)  # nothing new: no call
    drop_synced(fs, fd, 10, 4096)
    assert [c for c in fs.calls if c[0] == "drop_cache"] == [("drop_cache", "/f")]
    assert disk.drops == 1
    fs.fail("drop_cache", nth=1, errno=errno.EINVAL)
    drop_synced(fs, fd, 4096, 8192)  # swallowed


# ---- failures ------------------------------------------------------------------------


async def test_write_error_fails_the_batch_and_releases_its_seqs(autojump_clock):
    disk = FakeDisk()
    fs = FaultFs(disk)
    async with open_durable(fs) as engine:
        await put(engine, "t", durability="disk")
        await write(engine, "t", b"1")
        fs.fail("pwrite", nth=1, errno=errno.EIO)
        with pytest.raises(StorageUnavailable) as exc:
            await write(engine, "t", b"lost")
        assert exc.value.detail["reason"].startswith("write failed")
        assert exc.value.retry_after_s() >= 1
        topic = engine.get("t")
        assert (topic.head_seq, topic.next_seq, topic.count) == (1, 2, 1)
        res = await write(engine, "t", b"2")  # one write error is below the threshold
        assert res.first_seq == 2  # the failed batch's seq is reused: no gap
        expected = await dump(engine, "t")
    async with open_durable(disk) as engine:
        assert await dump(engine, "t") == expected  # the failed bytes never surface


async def test_fsync_error_opens_the_breaker_and_probes_close_it(autojump_clock):
    disk = FakeDisk()
    fs = FaultFs(disk)
    cfg = durable_config(
        breaker={"open_ms": 1000, "probe_interval_ms": 100, "success_threshold": 2}
    )
    async with open_durable(fs, cfg) as engine:
        await put(engine, "f", durability="fsync")
        await put(engine, "e", durability="ephemeral")
        fs.fail("fdatasync", nth=1, errno=errno.EIO)
        with pytest.raises(StorageUnavailable):
            await write(engine, "f", b"1")
        shard = wal(engine).shard(engine.get("f"))
        assert shard.breaker.state is BreakerState.OPEN
        with pytest.raises(StorageUnavailable) as exc:
            await write(engine, "f", b"2")  # refused at once while open
        assert exc.value.detail["shard"] == shard.index
        await write(engine, "e", b"ephemeral writes keep working")
        _, res = await engine.diff("f", DiffIn())
        assert res.records == []  # nothing of the failed batch is visible
        t0 = trio.current_time()
        await shard.breaker.changed.wait()  # → half-open after open_ms
        assert trio.current_time() - t0 == pytest.approx(1.0, abs=0.01)
        while shard.breaker.state is not BreakerState.CLOSED:
            await shard.breaker.changed.wait()
        res = await write(engine, "f", b"3")
        assert res.first_seq == 1


async def test_ingest_full_is_429_and_bypass_waits(autojump_clock):
    disk = FakeDisk()
    slow = InlineOffload(lambda group: 0.1 if group == "wal" else 0.0)
    cfg = durable_config(wal={"max_pending_per_topic": 2})
    async with open_durable(disk, cfg, offload=slow) as engine:
        await put(engine, "t", durability="fsync")
        errors = []

        async def one(i: int, bypass: bool = False):
            try:
                await write(engine, "t", b"%d" % i, disable_backpressure=bypass)
            except Throttled as exc:
                errors.append(exc)

        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(one, 99, True)  # waits for room instead of a 429
        assert errors
        assert all(e.detail["cause"] == "wal_ingest" for e in errors)
        assert {e.detail["scope"] for e in errors} == {"topic"}
        assert all(e.retry_after_s() >= 1 for e in errors)
        records, _ = await dump(engine, "t")
        assert any(r.endswith(b'"data":99}') for r in records)


async def test_an_io_stall_opens_the_breaker_and_the_stalled_write_still_completes(
    autojump_clock,
):
    stall = {"on": False}
    slow = InlineOffload(lambda group: 12.0 if group == "wal" and stall["on"] else 0.0)
    cfg = durable_config(shards=1)  # breaker.io_stall_ms = 10000
    async with open_durable(FakeDisk(), cfg, offload=slow) as engine:
        await put(engine, "f", durability="fsync")
        await put(engine, "e", durability="ephemeral")
        await write(engine, "e", b"0")  # its seq reservation is made before the stall
        shard = wal(engine).shards[0]
        await trio.sleep(1.0)  # background syncs done: the next WAL call is the write's
        assert not shard.unsynced
        done: list[float] = []

        async def stalled() -> None:
            await write(engine, "f", b"1")
            done.append(trio.current_time())

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            stall["on"] = True
            n.start_soon(stalled)
            await trio.sleep(9.9)
            assert shard.breaker.state is BreakerState.CLOSED  # not yet: 10 s is the limit
            await trio.sleep(0.3)  # the governor samples every 100 ms
            assert shard.breaker.state is BreakerState.OPEN
            assert shard.breaker.reason.startswith("io stall")
            stall["on"] = False
            with pytest.raises(StorageUnavailable) as exc:
                await write(engine, "f", b"2")  # refused at once while it is open
            assert exc.value.detail["reason"].startswith("io stall")
            await write(engine, "e", b"ephemeral writes keep working")
        # the stalled call finished by itself: its write was committed and acked
        assert done and done[0] - t0 == pytest.approx(12.0, abs=0.05)
        records, _ = await dump(engine, "f")
        assert len(records) == 1 and records[0].endswith(b'"data":1}')


# ---- corruption ----------------------------------------------------------------------


def _wal_file(shard: int) -> str:
    return f"/data/wal/shard-{shard:02d}/wal-0000000000000000.log"


async def test_mid_log_corruption_refuses_then_truncate_recovers_the_prefix():
    disk = FakeDisk()
    async with until_power_loss(disk) as engine:  # no final snapshot: recovery replays
        for i in range(5):
            await write(engine, "t", b"%d" % i)
        shard = wal(engine).shard(engine.get("t")).index
        disk.sync_all()
    path = _wal_file(shard)
    data = bytearray(disk.pending_bytes(path) or b"")
    # flip one byte inside the third frame's body
    pos, found = frames.FILE_HEADER_LEN, []
    while (f := frames.read_frame(bytes(data), pos, len(data), 1 << 24)) is not None:
        found.append(f)
        pos = f.end
    victim = found[-3]
    data[victim.offset + 45] ^= 0xFF
    fd = disk.open(path)
    disk.pwrite(fd, bytes(data), 0)
    disk.close(fd)
    with pytest.raises(RecoveryRefused, match=r"offset \d+.*mid-log corruption"):
        async with open_durable(disk):
            pass
    cfg = durable_config()
    cfg = dataclasses.replace(
        cfg,
        storage=dataclasses.replace(
            cfg.storage,
            recovery=dataclasses.replace(cfg.storage.recovery, on_corruption="truncate"),
        ),
    )
    async with open_durable(disk, cfg) as engine:
        assert 0 < engine.get("t").count < 5


async def test_torn_tail_after_power_loss_is_ignored():
    for seed in range(20):
        disk = FakeDisk()
        async with open_durable(disk) as engine:
            await put(engine, "f", durability="fsync")
            acked = [await write(engine, "f", b"%d" % i) for i in range(3)]
            await write(engine, "d", b"unsynced")  # the last write is in flight
            disk.crash(seed, torn=True, power_off=True)
        disk.reboot()
        async with open_durable(disk, boot_id="boot-2") as engine:
            records, _ = await dump(engine, "f")
            assert len(records) == len(acked)


async def test_a_non_topicd_directory_is_refused():
    disk = FakeDisk()
    disk.mkdir("/data")
    fd = disk.open("/data/something", create=True)
    disk.close(fd)
    with pytest.raises(RecoveryRefused, match="no FORMAT"):
        async with open_durable(disk):
            pass


async def test_ephemeral_topic_never_reuses_seqs_across_restarts():
    disk = FakeDisk()
    heads = []
    for _ in range(3):
        async with open_durable(disk) as engine:
            await put(engine, "e", durability="ephemeral")
            res = await write(engine, "e", b"1", b"2")
            heads.append(res.first_seq)
            assert res.first_seq > (heads[-2] + 1 if len(heads) > 1 else 0)
    assert heads == sorted(set(heads))


async def test_wall_clock_does_not_matter_for_replay():
    disk = FakeDisk()
    clock = FakeWallClock()
    async with open_durable(disk, clock=clock) as engine:
        await write(engine, "t", b"1")
    clock.jump(-10_000_000)
    async with open_durable(disk, clock=clock) as engine:
        assert engine.get("t").count == 1


async def test_breaker_state_shows_in_ready_and_can_make_it_unready(autojump_clock):
    from topicd.testing.harness import open_durable_app

    disk = FakeDisk()
    fs = FaultFs(disk)
    cfg = durable_config(shards=1, breaker={"unready_when_open": True})
    async with open_durable_app(fs, cfg) as h:
        client = h.app.test_client()
        r = await client.get("/v0/ready")
        assert r.status_code == 200
        assert (await r.get_json())["storage"] == {"wal_shards": 1, "breakers": {"0": "closed"}}
        await client.put("/v0/topics/f", json={"durability": "fsync"})
        fs.fail("fdatasync", nth=1)
        r = await client.post("/v0/topics/f", json={"records": [{"data": 1}]})
        assert r.status_code == 503
        body = await r.get_json()
        assert body["error"]["code"] == "storage_unavailable"
        assert int(r.headers["Retry-After"]) >= 1
        r = await client.get("/v0/ready")
        assert r.status_code == 503
        assert (await r.get_json())["error"]["code"] == "storage_unavailable"


# ---- writes larger than one frame ------------------------------------------------------

SMALL_FRAME = 1 << 16  # the smallest storage.wal.max_frame_bytes allowed


def _split_config(**wal: int):
    return durable_config(shards=1, wal={"max_frame_bytes": SMALL_FRAME, **wal})


def _frames_of(disk: FakeDisk, path: str) -> tuple[bytearray, list[frames.Frame]]:
    data = bytearray(disk.pending_bytes(path) or disk.read(path))
    found, pos = [], frames.FILE_HEADER_LEN
    while f := frames.read_frame(bytes(data), pos, len(data), frames.LEGACY_MAX_FRAME):
        found.append(f)
        pos = f.end
    return data, found


def _rewrite(disk: FakeDisk, path: str, data: bytes) -> None:
    fd = disk.open(path)
    disk.pwrite(fd, data, 0)
    disk.fdatasync(fd)
    disk.close(fd)


def _big(n: int, tag: str | None = None) -> list[RecordIn]:
    return [
        RecordIn(data=msgspec.Raw(b'"%05d-%s"' % (i, b"x" * 900)), tag=tag if i % 7 else None)
        for i in range(n)
    ]


async def test_a_write_larger_than_a_frame_is_split_and_survives_a_crash():
    disk = FakeDisk()
    cfg = _split_config()
    async with until_power_loss(disk, cfg) as engine:  # no final snapshot: replay
        acks = {}
        for cls in ("fsync", "disk", "memory"):
            await put(engine, cls, durability=cls)
            await write(engine, cls, b"0")
            acks[cls] = await engine.append(
                cls, WriteIn(records=_big(300, tag="t"), idempotency_key="big")
            )
            await write(engine, cls, b"1")
        before = {cls: await dump(engine, cls) for cls in acks}
        disk.sync_all()
    _, found = _frames_of(disk, _wal_file(0))
    assert sum(1 for f in found if f.flags & frames.FLAG_MORE) >= 3 * 4  # really split
    async with open_durable(disk, cfg) as engine:
        for cls, ack in acks.items():
            assert await dump(engine, cls) == before[cls]
            again = await engine.append(
                cls, WriteIn(records=_big(300, tag="t"), idempotency_key="big")
            )
            assert (again.first_seq, again.last_seq) == (ack.first_seq, ack.last_seq)
            assert again.deduped


async def test_a_split_write_missing_its_last_frame_is_dropped_whole():
    disk = FakeDisk()
    cfg = _split_config()
    async with until_power_loss(disk, cfg) as engine:
        await put(engine, "f", durability="fsync")
        await write(engine, "f", b"0")
        await engine.append("f", WriteIn(records=_big(300)))
    path = _wal_file(0)
    data, found = _frames_of(disk, path)
    last = found[-1]
    assert not last.flags & frames.FLAG_MORE and found[-2].flags & frames.FLAG_MORE
    data[last.offset : last.end] = bytes(last.end - last.offset)  # the last frame torn away
    _rewrite(disk, path, bytes(data))
    async with open_durable(disk, cfg) as engine:
        records, tomb = await dump(engine, "f")
        assert [r.rsplit(b":", 1)[1] for r in records] == [b"0}"] and tomb is None
        res = await write(engine, "f", b"2")
        assert res.first_seq == 2  # never acknowledged: its seqs were never handed out
        disk.sync_all()
        disk.crash(power_off=True)
    disk.reboot()
    async with open_durable(disk, cfg) as engine:  # the repaired tail replays cleanly
        records, tomb = await dump(engine, "f")
        assert [r.rsplit(b":", 1)[1] for r in records] == [b"0}", b"2}"] and tomb is None


async def test_a_split_write_interrupted_by_another_frame_is_mid_log_corruption():
    disk = FakeDisk()
    cfg = _split_config()
    async with until_power_loss(disk, cfg) as engine:
        await put(engine, "f", durability="fsync")
        await engine.append("f", WriteIn(records=_big(300)))
        await write(engine, "f", b"after")
    path = _wal_file(0)
    data, found = _frames_of(disk, path)
    last_of_big = next(
        i
        for i, f in enumerate(found)
        if i and found[i - 1].flags & frames.FLAG_MORE and not f.flags & frames.FLAG_MORE
    )
    cut = found[last_of_big]
    tail = bytes(data[cut.end : found[-1].end])
    data[cut.offset :] = tail + bytes(len(data) - cut.offset - len(tail))
    _rewrite(disk, path, bytes(data))
    with pytest.raises(RecoveryRefused, match=r"interrupted by another frame.*mid-log"):
        async with open_durable(disk, cfg):
            pass


async def test_a_write_over_an_ingest_byte_bound_is_admitted_when_alone(autojump_clock):
    disk = FakeDisk()
    slow = InlineOffload(lambda group: 0.1 if group == "wal" else 0.0)
    bound = 100_000  # below the 300-record write's ~280 KB
    cfg = _split_config(max_pending_bytes_per_topic=bound, max_pending_bytes_per_shard=bound)
    async with open_durable(disk, cfg, offload=slow) as engine:
        await put(engine, "t", durability="fsync")
        refused: list[Throttled] = []

        async def small() -> None:
            await write(engine, "t", b"1")

        async def big() -> None:
            try:
                await engine.append("t", WriteIn(records=_big(300)))
            except Throttled as exc:
                refused.append(exc)

        async with trio.open_nursery() as n:
            n.start_soon(small)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(big)  # not alone: the small write is still queued
        assert refused and refused[0].detail["cause"] == "wal_ingest"
        res = await engine.append("t", WriteIn(records=_big(300)))  # alone: admitted
        assert res.count == 300


# ---- what recovery reports --------------------------------------------------------------


async def test_the_start_up_line_reports_bytes_replayed_not_file_sizes(caplog):
    disk = FakeDisk()
    cfg = durable_config(shards=1)
    async with until_power_loss(disk, cfg) as engine:
        await put(engine, "f", durability="fsync")
        for i in range(10):
            await write(engine, "f", b"%d" % i)
        disk.sync_all()
    _, found = _frames_of(disk, _wal_file(0))
    logged = sum(f.end - f.offset for f in found)
    caplog.set_level("INFO", logger="topicd.storage")
    async with open_durable(disk, cfg):
        pass
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("recovered"))
    assert f"({logged} bytes)" in line, line  # the WAL file itself is 1 MiB preallocated


def test_replay_progress_is_logged_about_every_second(caplog):
    from topicd.storage.recovery import ReplayReport

    now = [0.0]
    report = ReplayReport(log_every_ms=1000.0, now=lambda: now[0])
    caplog.set_level("INFO", logger="topicd.recovery")
    report.file("wal/shard-00/wal-0000000000000000.log")
    for i in range(10_000):
        now[0] = i * 0.5  # 5 s in all, in steps of half a millisecond
        report.advance(100, 3)
    lines = [r.getMessage() for r in caplog.records if "replay in progress" in r.getMessage()]
    assert 4 <= len(lines) <= 5  # at most one a second, and never silent for long
    assert "frames" in lines[0] and "bytes" in lines[0] and "3 topics" in lines[0]
    assert "wal-0000000000000000.log" in lines[0]


async def test_a_single_frame_larger_than_the_limit_from_an_older_version_still_replays():
    """topicd 0.1 stored a write of any size as one frame; such a directory still opens
    with every record (earlier, recovery took the frame for corruption)."""
    disk = FakeDisk()
    old = durable_config(shards=1, wal={"max_frame_bytes": 1 << 24})
    async with until_power_loss(disk, old) as engine:
        await put(engine, "f", durability="fsync")
        await engine.append("f", WriteIn(records=_big(300)))  # ~280 KB: one frame here
        await write(engine, "f", b"after")
        before = await dump(engine, "f")
        disk.sync_all()
    _, found = _frames_of(disk, _wal_file(0))
    assert not any(f.flags & frames.FLAG_MORE for f in found)
    assert max(f.end - f.offset for f in found) > 1 << 16
    async with open_durable(disk, _split_config()) as engine:  # a 64 KiB frame limit
        assert await dump(engine, "f") == before


async def test_a_failed_probe_does_not_keep_the_breaker_open_once_storage_heals(autojump_clock):
    """A probe that fails after creating its fresh file (its sync fails) leaves that file
    behind; the next probe must still be able to start a file, so the breaker closes
    once storage works again instead of refusing writes until a restart."""
    disk = FakeDisk()
    fs = FaultFs(disk)
    cfg = durable_config(
        shards=1, breaker={"open_ms": 1000, "probe_interval_ms": 100, "success_threshold": 2}
    )
    async with open_durable(fs, cfg) as engine:
        await put(engine, "f", durability="fsync")
        fs.fail("fdatasync", always=True, errno=errno.EIO)
        with pytest.raises(StorageUnavailable):
            await write(engine, "f", b"1")
        shard = wal(engine).shard(engine.get("f"))
        await trio.sleep(5)  # several probes fail, each after creating its file
        assert shard.breaker.state is not BreakerState.CLOSED
        fs.clear()
        with trio.fail_after(60):
            while shard.breaker.state is not BreakerState.CLOSED:
                await shard.breaker.changed.wait()
        res = await write(engine, "f", b"2")
        assert res.first_seq == 1
        expected = await dump(engine, "f")
    async with open_durable(disk, cfg) as engine:
        assert await dump(engine, "f") == expected  # and recovery reads the files back
