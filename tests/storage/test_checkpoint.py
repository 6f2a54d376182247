"""Checkpoints on a fake disk: snapshots, WAL trimming, clean restarts, crash points.

Method: drive a durable engine on `FakeDisk`, take checkpoints explicitly
(`engine.checkpointer.checkpoint()`), and compare what recovery rebuilds (records, tags,
watermarks, idempotency) with what the live engine held. The crash-point sweep restores
the pre-checkpoint durable image, arms `FakeDisk.crash_after(k)` for every mutating call
k of one checkpoint, and checks that recovery always yields the same state, from either
the old or the new snapshot.
"""

from __future__ import annotations

import contextlib
import posixpath

import msgspec
import pytest
import trio
import trio.lowlevel

from topicd.engine.engine import Engine
from topicd.storage import snapshot
from topicd.storage.checkpoint import Checkpointer
from topicd.testing.fake_fs import FakeDisk, PowerLoss
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import DeleteIn, DiffIn, RecordIn, TopicConfigIn, WriteIn


def recs(*datas: bytes, tag: str | None = None) -> list[RecordIn]:
    return [RecordIn(data=msgspec.Raw(d), tag=tag) for d in datas]


async def write(engine: Engine, name: str, *datas: bytes, **kw):
    tag = kw.pop("tag", None)
    return await engine.append(name, WriteIn(records=recs(*datas, tag=tag), **kw))


def cp(engine: Engine) -> Checkpointer:
    assert isinstance(engine.checkpointer, Checkpointer)
    return engine.checkpointer


async def state(engine: Engine) -> dict[str, object]:
    """Everything a reader can observe, per topic."""
    out: dict[str, object] = {}
    for name in sorted(engine.topics):
        t = engine.get(name)
        records = []
        cursor = 0
        while True:
            _, res = await engine.diff(name, DiffIn(from_seq=cursor, limit=1000, include_tags=True))
            records.extend(res.records)
            cursor = res.next_from_seq
            if res.caught_up:
                break
        out[name] = (
            records,
            t.earliest_seq,
            t.evict_floor,
            t.count,
            t.bytes,
            t.config,
            t.lost_ranges,
        )
    return out


def wal_files(disk: FakeDisk) -> list[str]:
    return sorted(p for p in disk.tree() if "/wal/" in p)


async def populate(engine: Engine) -> None:
    await engine.put_topic("capped", TopicConfigIn(cap_records=5))
    for i in range(12):
        await write(engine, "capped", b"%d" % i, tag=f"t{i % 3}")
    await write(engine, "plain", b'{"exact":1.10}', b"2", b"3")
    await engine.delete_records("plain", DeleteIn(before_seq=2))
    await write(engine, "keyed", b"1", idempotency_key="k1")
    await engine.put_topic("eph", TopicConfigIn(durability="ephemeral"))
    await write(engine, "eph", b"1")


async def test_snapshot_plus_tail_equals_the_live_state():
    disk = FakeDisk()
    cfg = durable_config(wal={"file_bytes": 4096})
    async with open_durable(disk, cfg) as engine:
        await populate(engine)
        assert await cp(engine).checkpoint()
        await write(engine, "plain", b"after")  # the tail after the snapshot
        await engine.delete_records("capped", DeleteIn(match="t1"))
        live = await state(engine)
        live.pop("eph")
    async with open_durable(disk, cfg) as engine:  # process crash: replay the tail
        got = await state(engine)
        got.pop("eph")
        assert got == live
        again = await write(engine, "keyed", b"1", idempotency_key="k1")
        assert again.deduped


async def test_checkpoints_trim_the_wal():
    disk = FakeDisk()
    cfg = durable_config(wal={"file_bytes": 4096})
    async with open_durable(disk, cfg) as engine:
        for i in range(300):
            await write(engine, "t", b'"%d-yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"' % i)
        before = len(wal_files(disk))
        assert await cp(engine).checkpoint()
        for i in range(10):
            await write(engine, "t", b"%d" % i)
        assert await cp(engine).checkpoint()  # trims behind the previous snapshot
        after = len(wal_files(disk))
        assert after < before
        expected = await state(engine)
    snaps = snapshot.list_snapshots(disk, "/data")
    assert len(snaps) == 2  # keep = 2
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected


async def test_clean_restart_resumes_without_a_seq_gap():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        res = await write(engine, "t", b"1", b"2")
    async with open_durable(disk) as engine:
        res2 = await write(engine, "t", b"3")
        assert res2.first_seq == res.last_seq + 1


async def test_unreadable_newest_snapshot_falls_back_to_the_previous_one():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await populate(engine)
        assert await cp(engine).checkpoint()
        await write(engine, "plain", b"tail")
        assert await cp(engine).checkpoint()
        await write(engine, "plain", b"tail2")
        live = await state(engine)
        live.pop("eph")
        newest = snapshot.list_snapshots(disk, "/data")[0][1]
    # damage the newest snapshot (which the clean shutdown just wrote)
    data = bytearray(disk.pending_bytes(newest) or b"")
    data[100] ^= 0xFF
    fd = disk.open(newest)
    disk.pwrite(fd, bytes(data), 0)
    disk.close(fd)
    async with open_durable(disk) as engine:
        got = await state(engine)
        got.pop("eph")
        assert got == live


@pytest.mark.parametrize("inline", [0, 2048])
async def test_crash_at_every_step_of_a_checkpoint_keeps_the_state(autojump_clock, inline):
    """`inline` 0: every topic in segments; 2048 (the default): the small topics stay in
    the snapshot (tests/storage/test_inline_topics.py sweeps the checkpoint in which a
    topic outgrows it)."""
    disk = FakeDisk()
    cfg = durable_config(wal={"file_bytes": 4096}, segments={"inline_max_bytes": inline})
    async with open_durable(disk, cfg) as engine:
        await populate(engine)
        for i in range(50):
            await write(engine, "bulk", b'"%d-zzzzzzzzzzzzzzzzzzzzzzzzzz"' % i)
        assert await cp(engine).checkpoint()
        for i in range(50):
            await write(engine, "bulk", b'"%d-wwwwwwwwwwwwwwwwwwwwwwwwwwwwww"' % i)
        expected = await state(engine)
        expected.pop("eph")
        disk.sync_all()  # the durable image before the checkpoint under test
        image = disk.snapshot()
        before = disk.mutations
        assert await cp(engine).checkpoint()
        steps = disk.mutations - before
        disk.crash(power_off=True)
    disk.reboot()
    assert steps > 5
    for k in range(steps + 1):
        disk.restore(image)
        async with open_durable(disk, cfg, boot_id="boot-1") as engine:
            disk.crash_after(k)
            with contextlib.suppress(PowerLoss):
                await cp(engine).checkpoint()
            disk.crash(power_off=True)
        disk.reboot()
        async with open_durable(disk, cfg, boot_id="boot-1") as engine:
            got = await state(engine)
            got.pop("eph")
            assert got == expected, f"crash after mutating call {k} of {steps}"
            files = disk.tree()
            assert not any(p.endswith(".tmp") for p in files), k
        disk.crash(power_off=True)
        disk.reboot()


async def test_the_final_snapshot_is_written_on_clean_shutdown():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await write(engine, "t", b"1")
    snaps = snapshot.list_snapshots(disk, "/data")
    assert snaps
    body = snapshot.decode(disk.durable_bytes(snaps[0][1]) or b"")
    (topic,) = body.topics
    assert topic.reserved == topic.head == 1


def capture_of(*runs: snapshot.RunCopy) -> snapshot.Capture:
    topic = snapshot.TopicSnap(
        id=1, name="t", config={}, head=10, reserved=10, earliest=1, evict_floor=0,
        evictions=[], lost=[], last_ts=0, last_write_ts=None, last_read_ts=None, runs=[],
    )  # fmt: skip
    body = snapshot.SnapshotBody(2, 0, 2, 1, [(0, 64)], [topic], [])
    return snapshot.Capture(body, [list(runs)], fresh=[topic])


def run_copy(base: int, encs: list[bytes | None]) -> snapshot.RunCopy:
    from array import array

    n = len(encs)
    return snapshot.RunCopy(base, encs, array("q", range(n)), array("I", [7] * n))


async def test_records_trail_the_body_in_pieces_and_read_back_exactly(monkeypatch):
    monkeypatch.setattr(snapshot, "CHUNK_RECORDS", 3)
    first: list[bytes | None] = [b'{"a":%d}' % i if i % 4 else None for i in range(10)]
    second: list[bytes | None] = [b'"x"', b"1.10"]
    pieces = snapshot.encode(capture_of(run_copy(1, first), run_copy(11, second)))
    header, *rest = pieces
    assert len(header) == snapshot.HEADER.size
    length, k = snapshot.HEADER.unpack(header)[3], 0  # the body's pieces come first
    while length > 0:
        length -= len(rest[k])
        k += 1
    assert length == 0
    records = rest[k:]
    assert all(len(p) <= 3 * 8 for p in records)  # at most CHUNK_RECORDS records a piece
    assert b"".join(records) == b"".join(e for e in first + second if e is not None)
    body = snapshot.decode(b"".join(pieces))
    (topic,) = body.topics
    got = snapshot.restore_runs(topic)
    assert [(base, encs) for base, encs, _, _ in got] == [(1, first), (11, second)]
    assert list(got[0][2]) == list(range(10))


def test_a_version_1_snapshot_still_reads():
    import xxhash

    cap = capture_of()
    topic = cap.body.topics[0]
    topic.runs.append(
        snapshot.RunSnap(1, b"\x03\x00\x00\x00", b"\x00" * 8, b"\x01\x00\x00\x00", b"abc")
    )
    payload = msgspec.msgpack.encode(cap.body)
    data = snapshot.HEADER.pack(
        snapshot.MAGIC, 1, 1, len(payload), xxhash.xxh3_64_intdigest(payload)
    )
    body = snapshot.decode(data + payload)
    ((base, encs, _, _),) = snapshot.restore_runs(body.topics[0])
    assert (base, encs) == (1, [b"abc"])


@pytest.mark.parametrize("damage", ["short", "long", "flip"])
def test_record_bytes_after_the_body_are_checked(damage):
    data = bytearray(b"".join(snapshot.encode(capture_of(run_copy(1, [b"12", b"34"])))))
    if damage == "short":
        data = data[:-1]
    elif damage == "long":
        data += b"5"
    else:
        data[-1] ^= 1
    with pytest.raises(snapshot.SnapshotError):
        snapshot.decode(bytes(data))


@pytest.mark.parametrize("damage", ["header", "length", "body"])
def test_snapshot_decoder_rejects_damage(damage):
    cap = snapshot.Capture(snapshot.SnapshotBody(1, 0, 1, 1, [(0, 64)], [], []), [])
    data = bytearray(b"".join(snapshot.encode(cap)))
    if damage == "header":
        data[0] ^= 1
    elif damage == "length":
        data = data[:-1]
    else:
        data[-1] ^= 1
    with pytest.raises(snapshot.SnapshotError):
        snapshot.decode(bytes(data))


async def test_checkpoint_io_error_is_logged_and_retried(autojump_clock):
    from topicd.testing.fake_fs import FaultFs

    disk = FakeDisk()
    fs = FaultFs(disk)
    async with open_durable(fs) as engine:
        await write(engine, "t", b"1")
        fs.fail("rename", nth=1)
        assert not await cp(engine).checkpoint()
        assert cp(engine).failures == 1
        assert await cp(engine).checkpoint()
        meta = posixpath.join("/data", "meta")
        assert not any(n.endswith(".tmp") for n in disk.listdir(meta))
        await trio.lowlevel.checkpoint()


async def test_changing_the_shard_count_reshards_with_a_checkpoint():
    disk = FakeDisk()
    async with open_durable(disk, durable_config(shards=2)) as engine:
        await populate(engine)
        for i in range(20):
            await write(engine, f"t{i}", b"%d" % i)
        live = await state(engine)
        live.pop("eph")
    for shards in (4, 1, 3):
        async with open_durable(disk, durable_config(shards=shards)) as engine:
            from topicd.storage.wal import WalCommitPath

            assert isinstance(engine.commit, WalCommitPath)
            assert engine.commit.shard_count == shards
            got = await state(engine)
            got.pop("eph")
            assert got == live
            await write(engine, "t0", b"more")
            live = await state(engine)
            live.pop("eph")
        headers = [p for p in disk.tree() if "/wal/" in p and disk.size(p) > 0]
        assert all(int(p.split("shard-")[1][:2]) < shards for p in headers)


async def test_a_crash_between_the_reshard_snapshot_and_the_cleanup_is_safe():
    from topicd.testing.fake_fs import FaultFs

    disk = FakeDisk()
    async with open_durable(disk, durable_config(shards=2)) as engine:
        await populate(engine)
        for i in range(10):
            await write(engine, f"t{i}", b"%d" % i)
        live = await state(engine)
        live.pop("eph")
    fs = FaultFs(disk)
    fs.fail("unlink", always=True)  # the old layout's files cannot be removed
    with pytest.raises(BaseException):  # noqa: B017 - the start fails mid-re-shard
        async with open_durable(fs, durable_config(shards=3)):
            pass
    async with open_durable(disk, durable_config(shards=3)) as engine:
        got = await state(engine)
        got.pop("eph")
        assert got == live
