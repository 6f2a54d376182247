"""Per-topic segments: absorb, seal, `.idx`, delete flags, drop, WAL trim, recovery.

Method: a durable engine on `FakeDisk` (inline offload, inline recovery) with small
segment triggers, checkpoints taken explicitly, and recovery compared with the live
state (`test_checkpoint.state`: every record a reader sees, watermarks, counts). Crash
points: the pre-checkpoint durable image is restored, `FakeDisk.crash_after(k)` is armed
for every mutating call k of one checkpoint that absorbs, seals, flips delete flags,
drops segments and trims the WAL, and recovery must yield the same state each time.
Corruption: a byte of a segment is changed. In the active segment's last frame (which
recovery decodes, decoding all the frames when it does not match), recovery must refuse
naming the file and offset without modifying anything. A start reads no other segment
data (a segment is checked for presence, length and a usable `.meta`: the tests watch
which files recovery opens and which bytes it reads), so damage elsewhere starts, and
the first read of an affected record fails with `500`, is counted and logged, never
served; the full check
(`check_sealed`, what `topicd verify` runs) and a start that must decode the frames (no
usable `.meta`) refuse naming file and offset, modifying nothing. A serve-time read of
bytes damaged after the start must fail and be counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import posixpath
from array import array

import pytest

from tests.storage.test_checkpoint import cp, populate, state, wal_files, write
from topicd.config import Config
from topicd.errors import Internal
from topicd.storage import segments as segs
from topicd.storage import snapshot
from topicd.storage.recovery import RecoveryRefused, recover
from topicd.storage.wal import WalCommitPath
from topicd.testing.fake_clock import FakeWallClock
from topicd.testing.fake_fs import FakeDisk, PowerLoss
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import DeleteIn, DiffIn, TopicConfigIn


def seg_config(max_events: int = 4, max_bytes: int = 1 << 20, **wal: int) -> Config:
    cfg = durable_config(wal={"file_bytes": 4096, **wal}, segments={"inline_max_bytes": 0})
    seg = dataclasses.replace(cfg.storage.segments, max_events=max_events, max_bytes=max_bytes)
    return dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, segments=seg))


def seg_files(disk: FakeDisk) -> list[str]:
    return sorted(p for p in disk.tree() if "/topics/" in p)


def newest_body(disk: FakeDisk) -> snapshot.SnapshotBody:
    _, path = snapshot.list_snapshots(disk, "/data")[0]
    return snapshot.decode(disk.pending_bytes(path) or b"")


async def test_a_checkpoint_absorbs_records_into_segments_and_the_snapshot_drops_them():
    disk = FakeDisk()
    cfg = seg_config()
    async with open_durable(disk, cfg) as engine:
        await populate(engine)
        for i in range(10):
            await write(engine, "bulk", b'"%d"' % i, tag=f"g{i % 2}")
        assert await cp(engine).checkpoint()
        body = newest_body(disk)
        bulk = next(t for t in body.topics if t.name == "bulk")
        assert bulk.absorbed == 10 and bulk.tags == {}
        assert sum(r.blob_len for r in bulk.runs) == 0
        assert [(s.first, s.last, s.sealed) for s in bulk.segments] == [
            (1, 4, True),
            (5, 8, True),
            (9, 10, False),
        ]
        tid = engine.get("bulk").topic_id
        files = seg_files(disk)
        assert posixpath.join(segs.topic_dir("/data", tid), "seg-00000000000000000001.idx") in files
        assert not any(p.endswith("seg-00000000000000000009.idx") for p in files)
        eph = next(t for t in body.topics if t.name == "eph")
        assert eph.segments == []
        # deletes after the absorb: flags flipped by the next checkpoint
        await engine.delete_records("bulk", DeleteIn(match="g1"))
        await write(engine, "bulk", b'"after"')
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()  # trims the WAL behind the previous one
        expected = await state(engine)
        expected.pop("eph")
    async with open_durable(disk, cfg) as engine:
        got = await state(engine)
        got.pop("eph")
        assert got == expected


async def test_deletes_outlive_wal_trimming():
    disk = FakeDisk()
    cfg = seg_config(max_events=100)
    async with open_durable(disk, cfg) as engine:
        for i in range(20):
            await write(
                engine, "t", b'"%d-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"' % i, tag=f"k{i}"
            )
        assert await cp(engine).checkpoint()
        await engine.delete_records("t", DeleteIn(match="k7"))
        await engine.delete_records("t", DeleteIn(match="k12"))
        for _ in range(3):  # absorb the flags, then trim every WAL file that held the deletes
            for i in range(40):
                await write(
                    engine, "other", b'"%d-yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"' % i
                )
            assert await cp(engine).checkpoint()
        expected = await state(engine)
        tid = engine.get("t").topic_id
    data = disk.pending_bytes(posixpath.join(segs.topic_dir("/data", tid), f"seg-{1:020d}.data"))
    assert data is not None and len(segs.flagged_seqs(data, len(data))) >= 2
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected
        seqs = [r for r in (await state(engine))["t"][0]]  # type: ignore[index]
        assert len(seqs) == 18


async def test_sealed_segments_below_the_floor_are_dropped_one_snapshot_later():
    disk = FakeDisk()
    cfg = seg_config(max_events=5)
    async with open_durable(disk, cfg) as engine:
        await engine.put_topic("capped", TopicConfigIn(cap_records=3))
        for i in range(12):
            await write(engine, "capped", b"%d" % i)
        assert await cp(engine).checkpoint()
        tid = engine.get("capped").topic_id
        body = newest_body(disk)
        (capped,) = [t for t in body.topics if t.name == "capped"]
        # 1..9 were evicted before the absorb: seqs 10..12 only
        assert [(s.first, s.last) for s in capped.segments] == [(10, 12)]
        for i in range(12):
            await write(engine, "capped", b"%d" % (100 + i))
        assert await cp(engine).checkpoint()
        firsts = [s.first for s in newest_body(disk).topics[0].segments]
        for i in range(3):
            await write(engine, "capped", b"%d" % (200 + i))
        assert await cp(engine).checkpoint()
        remaining = {p.rsplit("/", 1)[1] for p in seg_files(disk) if f"{tid:016x}" in p}
        live = {
            f"seg-{f:020d}.data" for f in (s.first for s in newest_body(disk).topics[0].segments)
        }
        assert live <= remaining
        assert f"seg-{10:020d}.data" not in remaining, (firsts, remaining)
        expected = await state(engine)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected


async def test_a_deleted_topic_leaves_no_segment_directory():
    disk = FakeDisk()
    cfg = seg_config()
    async with open_durable(disk, cfg) as engine:
        await write(engine, "gone", b"1", b"2")
        assert await cp(engine).checkpoint()
        tid = engine.get("gone").topic_id
        await engine.delete_topic("gone", False)
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()
    assert not disk.exists(segs.topic_dir("/data", tid))


@pytest.mark.parametrize("absorb_first", [False, True])
async def test_crash_at_every_step_of_an_absorbing_checkpoint_keeps_the_state(
    autojump_clock, absorb_first
):
    disk = FakeDisk()
    cfg = seg_config(max_events=6)
    async with open_durable(disk, cfg) as engine:
        await populate(engine)
        await engine.put_topic("capped2", TopicConfigIn(cap_records=8))
        for i in range(14):
            await write(engine, "bulk", b'"%d-zzzzzzzzzzzzzzzzzz"' % i, tag=f"t{i % 4}")
            await write(engine, "capped2", b"%d" % i)
        if absorb_first:
            assert await cp(engine).checkpoint()
            await engine.delete_records("bulk", DeleteIn(match="t1"))  # flips
            for i in range(10):  # evicts capped2's first sealed segment: a drop
                await write(engine, "capped2", b"%d" % (50 + i))
            assert await cp(engine).checkpoint()
        for i in range(9):
            await write(engine, "bulk", b'"%d-wwwwwwwwwwwwwwwwwwww"' % i)
        await engine.delete_records("bulk", DeleteIn(match="t2"))
        expected = await state(engine)
        expected.pop("eph")
        disk.sync_all()
        image = disk.snapshot()
        before = disk.mutations
        assert await cp(engine).checkpoint()
        steps = disk.mutations - before
        disk.crash(power_off=True)
    disk.reboot()
    assert steps > 10
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
            # and after one more checkpoint from the recovered state
            assert await cp(engine).checkpoint()
        disk.crash(power_off=True)
        disk.reboot()
        async with open_durable(disk, cfg, boot_id="boot-1") as engine:
            got = await state(engine)
            got.pop("eph")
            assert got == expected, f"(second recovery) crash after call {k} of {steps}"
        disk.crash(power_off=True)
        disk.reboot()


async def _sealed_segment(disk: FakeDisk, cfg: Config) -> tuple[str, int]:
    async with open_durable(disk, cfg) as engine:
        for i in range(8):
            await write(engine, "t", b'"%d"' % i)
        assert await cp(engine).checkpoint()
        tid = engine.get("t").topic_id
    return segs.data_path("/data", tid, 1), tid


async def _start_refused(disk: FakeDisk, cfg: Config, path: str, offset: int) -> None:
    """A start on `disk` refuses, naming the segment `path` and `offset`, and modifies
    nothing."""
    before = disk.tree()
    with pytest.raises(RecoveryRefused) as exc:
        async with open_durable(disk, cfg):
            pass
    msg = str(exc.value)
    assert posixpath.relpath(path, "/data") in msg and f"offset {offset}" in msg, msg
    assert disk.tree() == before  # nothing modified


def _flip(disk: FakeDisk, path: str, offset: int) -> None:
    data = bytearray(disk.pending_bytes(path) or b"")
    data[offset] ^= 0x5A
    fd = disk.open(path)
    disk.pwrite(fd, bytes(data), 0)
    disk.close(fd)


def _opened(disk: FakeDisk, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths recovery opens or reads whole from now on (appended as it goes)."""
    seen: list[str] = []
    open_, read = disk.open, disk.read

    def opening(path: str, *, create: bool = False, exclusive: bool = False) -> int:
        seen.append(path)
        return open_(path, create=create, exclusive=exclusive)

    def reading(path: str) -> bytes:
        seen.append(path)
        return read(path)

    monkeypatch.setattr(disk, "open", opening)
    monkeypatch.setattr(disk, "read", reading)
    return seen


async def test_a_start_reads_no_sealed_segment_data_and_the_full_check_reads_all(monkeypatch):
    disk = FakeDisk()
    cfg = seg_config()
    path, tid = await _sealed_segment(disk, cfg)
    assert _reg(disk, path).sealed and _reg(disk, path).meta_len > 0
    seen = _opened(disk, monkeypatch)
    clock = FakeWallClock()
    result = recover(cfg, disk, clock, boot_id="boot-1")
    assert result.segment_metas == []  # (every segment loaded from its `.meta`)
    assert segs.meta_path("/data", tid, 1) in seen
    assert path not in seen  # the sealed segment's data: not read at start
    seen.clear()
    recover(cfg, disk, clock, boot_id="boot-1", check_sealed=True)
    assert path in seen  # the offline check reads it


async def test_a_corrupt_sealed_segment_starts_fails_its_reads_and_is_refused_by_verify(caplog):
    disk = FakeDisk()
    cfg = seg_config()
    path, tid = await _sealed_segment(disk, cfg)
    data = disk.pending_bytes(path) or b""
    loaded = segs.load_segment(disk, "/data", tid, _reg(disk, path), max_frame=1 << 24)
    assert loaded.rewrite is None  # (loaded from its `.meta`)
    second = loaded.segment.offsets[1]
    assert len(data) > second
    _flip(disk, path, second + 45)  # inside the second record's body
    # the start checks presence, length and the `.meta`, not the data: it serves, and
    # the first read of the damaged frame's records fails, counted and logged
    async with open_durable(disk, cfg) as engine:
        assert engine.get("t").count == 8
        with pytest.raises(Internal) as err:
            await engine.diff("t", DiffIn(from_seq=0, limit=10))
        assert err.value.http_status == 500
        assert cp(engine).segments.corruptions == 1
        assert "segment corruption" in caplog.text
        assert posixpath.relpath(path, "/data") in caplog.text
        _, page = await engine.diff("t", DiffIn(from_seq=4, limit=10))  # other segments read
        assert len(page.records) == 4 and page.next_from_seq == 8
    # the full check (`topicd verify`) reads every sealed byte: it refuses, naming file
    # and offset; so does a start without a usable `.meta` (it decodes the frames)
    before = disk.tree()
    with pytest.raises(RecoveryRefused) as exc:
        recover(cfg, disk, FakeWallClock(), boot_id="boot-1", check_sealed=True)
    msg = str(exc.value)
    assert posixpath.relpath(path, "/data") in msg and f"offset {second}" in msg, msg
    assert disk.tree() == before  # nothing modified
    disk.unlink(segs.meta_path("/data", tid, 1))
    await _start_refused(disk, cfg, path, second)


async def test_a_segment_damaged_while_serving_is_found_by_its_read_and_never_served():
    disk = FakeDisk()
    cfg = seg_config()
    path, tid = await _sealed_segment(disk, cfg)
    loaded = segs.load_segment(disk, "/data", tid, _reg(disk, path), max_frame=1 << 24)
    second = loaded.segment.offsets[1]
    async with open_durable(disk, cfg) as engine:  # (recovered: payloads only on disk)
        _flip(disk, path, second + 45)
        with pytest.raises(Internal) as err:
            await engine.diff("t", DiffIn(from_seq=0, limit=10))
        assert err.value.http_status == 500
        assert cp(engine).segments.corruptions == 1


async def test_a_damaged_end_of_the_active_segment_refuses_recovery_naming_file_and_offset():
    disk = FakeDisk()
    cfg = seg_config(max_events=100)
    async with open_durable(disk, cfg) as engine:
        for i in range(8):
            await write(engine, "t", b'"%d"' % i, tag=f"k{i % 4}")
        assert await cp(engine).checkpoint()
        await engine.delete_records("t", DeleteIn(match="k3"))
        assert await cp(engine).checkpoint()  # deletes flipped: the last record's tail too
        tid = engine.get("t").topic_id
        expected = await state(engine)
    path = segs.data_path("/data", tid, 1)
    reg = _reg(disk, path)
    assert not reg.sealed and reg.meta_len > 0
    # a flipped tail is not damage (the last frame is checked without its tail)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected
    loaded = segs.load_segment(disk, "/data", tid, _reg(disk, path), max_frame=1 << 24)
    assert loaded.rewrite is None  # (from the `.meta`, its end verified)
    assert loaded.segment.flags[7] == 1
    last = loaded.segment.offsets[7]
    # damage in its last frame (the end of the active segment): recovery decodes the
    # frames and refuses
    _flip(disk, path, last + 45)
    await _start_refused(disk, cfg, path, last)


async def test_a_start_reads_only_the_last_frame_of_the_active_segment(monkeypatch, caplog):
    disk = FakeDisk()
    cfg = seg_config(max_events=100)
    async with open_durable(disk, cfg) as engine:
        for i in range(8):
            await write(engine, "t", b'"%d"' % i)
        assert await cp(engine).checkpoint()  # the segment's first chunk: records 1..8
        for i in range(8, 12):
            await write(engine, "t", b'"%d"' % i)
        assert await cp(engine).checkpoint()  # its second: 9..12
        tid = engine.get("t").topic_id
        expected = await state(engine)
    path = segs.data_path("/data", tid, 1)
    reg = _reg(disk, path)
    assert not reg.sealed
    loaded = segs.load_segment(disk, "/data", tid, reg, max_frame=1 << 24)
    assert loaded.rewrite is None  # (from the `.meta`)
    first, last = loaded.segment.offsets[0], loaded.segment.offsets[11]
    assert first < last < reg.data_len
    # what a start reads of the data: the last frame, whatever else is retained
    reads: list[tuple[int, int]] = []
    fds: set[int] = set()
    open_, pread = disk.open, disk.pread

    def opening(name: str, *, create: bool = False, exclusive: bool = False) -> int:
        fd = open_(name, create=create, exclusive=exclusive)
        if name == path:
            fds.add(fd)
        return fd

    def preading(fd: int, length: int, offset: int) -> bytes:
        if fd in fds:
            reads.append((offset, length))
        return pread(fd, length, offset)

    monkeypatch.setattr(disk, "open", opening)
    monkeypatch.setattr(disk, "pread", preading)
    assert recover(cfg, disk, FakeWallClock(), boot_id="boot-1").segment_metas == []
    assert reads == [(last, reg.data_len - last)]
    reads.clear()
    recover(cfg, disk, FakeWallClock(), boot_id="boot-1", check_sealed=True)
    assert min(offset for offset, _ in reads) == first  # the offline check reads it all
    monkeypatch.undo()
    # damage before the last frame: the start serves; the first read of the damaged run
    # fails (500, counted, logged), never served; the full check refuses
    _flip(disk, path, first + 45)
    async with open_durable(disk, cfg) as engine:
        assert engine.get("t").count == 12
        with pytest.raises(Internal) as err:
            await engine.diff("t", DiffIn(from_seq=0, limit=10))
        assert err.value.http_status == 500
        assert cp(engine).segments.corruptions == 1
        assert "segment corruption" in caplog.text
        assert posixpath.relpath(path, "/data") in caplog.text
        _, page = await engine.diff("t", DiffIn(from_seq=8, limit=10))  # the last run
        assert len(page.records) == 4
    before = disk.tree()
    with pytest.raises(RecoveryRefused) as exc:
        recover(cfg, disk, FakeWallClock(), boot_id="boot-1", check_sealed=True)
    msg = str(exc.value)
    assert posixpath.relpath(path, "/data") in msg and f"offset {first}" in msg, msg
    assert disk.tree() == before  # nothing modified
    _flip(disk, path, first + 45)  # (undone)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected


async def test_reader_threads_recover_what_one_reader_does_and_refuse_in_snapshot_order():
    disk = FakeDisk()
    cfg = seg_config()  # (4 records a segment: most of them sealed)
    async with open_durable(disk, cfg) as engine:
        for t in range(70):  # (more than one group of topics loaded ahead)
            for i in range(t % 9 + 1):
                await write(engine, f"t{t}", b'"%d-%d"' % (t, i), tag=f"k{i % 2}")
        await engine.delete_records("t8", DeleteIn(match="k1"))
        assert await cp(engine).checkpoint()
        ids = {name: engine.get(name).topic_id for name in ("t3", "t60")}

    def summary(workers: int) -> dict[str, object]:
        result = recover(cfg, disk, FakeWallClock(), boot_id="boot-1", read_workers=workers)
        assert result.segments is not None
        return {
            t.name: (
                t.count,
                t.bytes,
                t.head_seq,
                t.earliest_seq,
                dict(t.tags),
                [
                    (seg.first, seg.last, seg.data_len, bytes(seg.offsets), bytes(seg.flags))
                    for seg in result.segments.topics[t.topic_id].segments
                ],
            )
            for t in result.engine.topics.values()
        }

    inline = summary(1)
    assert len(inline) == 70 and inline["t8"][0] == 5  # (4 of its 9 deleted)
    assert summary(4) == inline
    # two missing segments: the threads may load the later one first, the start still
    # refuses naming the first in snapshot order, as one reader does
    names = sorted(ids, key=lambda name: ids[name])
    for name in names:
        disk.unlink(segs.data_path("/data", ids[name], 1))
    messages = []
    for workers in (1, 4):
        with pytest.raises(RecoveryRefused, match="missing") as exc:
            recover(cfg, disk, FakeWallClock(), boot_id="boot-1", read_workers=workers)
        messages.append(str(exc.value))
    assert messages[0] == messages[1] and repr(names[0]) in messages[0], messages


def test_has_absent_finds_only_whole_absent_slots():
    assert not segs.has_absent(array("I"))
    assert not segs.has_absent(array("I", [0, 1, 2]))
    assert segs.has_absent(array("I", [0, segs.ABSENT, 2]))
    assert segs.has_absent(array("I", [7, 9, segs.ABSENT]))
    # four 0xFF bytes across two slots are not an absent slot
    assert not segs.has_absent(array("I", [0xFFFFFF00, 0x000000FF, 0x00FFFFFF, 0xFF]))
    assert segs.has_absent(array("I", [0xFFFFFF00, 0x000000FF, segs.ABSENT]))


def _reg(disk: FakeDisk, path: str) -> segs.SegSnap:
    body = newest_body(disk)
    first = int(path.rsplit("seg-", 1)[1][:20])
    for t in body.topics:
        for s in t.segments:
            if s.first == first and path.startswith(segs.topic_dir("/data", t.id)):
                return s
    raise AssertionError(path)


async def test_a_missing_or_short_segment_refuses_recovery():
    disk = FakeDisk()
    cfg = seg_config()
    path, _ = await _sealed_segment(disk, cfg)
    fd = disk.open(path)
    disk.ftruncate(fd, 30)
    disk.close(fd)
    with pytest.raises(RecoveryRefused, match="shorter"):
        async with open_durable(disk, cfg):
            pass
    disk.unlink(path)
    with pytest.raises(RecoveryRefused, match="missing"):
        async with open_durable(disk, cfg):
            pass


async def test_a_serve_time_segment_read_verifies_its_checksum(caplog):
    disk = FakeDisk()
    cfg = seg_config()
    async with open_durable(disk, cfg) as engine:
        for i in range(8):
            await write(engine, "t", b'"%d"' % i, tag="x")
        assert await cp(engine).checkpoint()
        store = cp(engine).segments
        tid = engine.get("t").topic_id
        rec = store.read_record(tid, 2)
        assert rec is not None and rec.enc == engine.get("t").enc(2) and rec.tag == "x"
        backend = engine.commit
        assert isinstance(backend, WalCommitPath)
        assert await backend.read_stored(engine.get("t"), 2, 1) == rec.enc
        assert await backend.read_stored(engine.get("t"), 2, 3) is None  # below min visible
        seg = store.topics[tid].find(2)
        assert seg is not None
        _flip(disk, segs.data_path("/data", tid, 1), seg.offsets[1] + 50)
        with pytest.raises(segs.SegmentCorruption) as exc:
            store.read_record(tid, 2)
        assert exc.value.offset == seg.offsets[1]
        with pytest.raises(Internal) as err:  # the seam's answer: 500 internal
            await backend.read_stored(engine.get("t"), 2, 1)
        assert err.value.http_status == 500
        assert store.corruptions == 2
        assert backend.storage_stats()["corruptions"] == 2
        assert "segment corruption" in caplog.text
        _flip(disk, segs.data_path("/data", tid, 1), seg.offsets[1] + 50)  # repair for shutdown


async def test_excess_bytes_and_orphans_are_removed_after_a_successful_recovery():
    disk = FakeDisk()
    cfg = seg_config(max_events=100)
    async with open_durable(disk, cfg) as engine:
        await write(engine, "t", b"1", b"2")
        assert await cp(engine).checkpoint()
        tid = engine.get("t").topic_id
        expected = await state(engine)
    path = segs.data_path("/data", tid, 1)
    registered = len(disk.pending_bytes(path) or b"")
    fd = disk.open(path)
    disk.pwrite(fd, b"junk from an uncommitted absorb", registered)
    disk.close(fd)
    orphan = posixpath.join(segs.topic_dir("/data", tid), f"seg-{99:020d}.data")
    fd = disk.open(orphan, create=True)
    disk.close(fd)
    stray_dir = segs.topic_dir("/data", 0xABC)
    disk.mkdir(stray_dir)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected
    assert len(disk.pending_bytes(path) or b"") >= registered
    assert not disk.exists(orphan) and not disk.exists(stray_dir)


async def test_wal_files_holding_only_absorbed_records_are_trimmed():
    disk = FakeDisk()
    cfg = seg_config(max_events=1000)
    async with open_durable(disk, cfg) as engine:
        for i in range(200):
            await write(engine, "t", b'"%d-yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"' % i)
        before = len(wal_files(disk))
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()
        assert len(wal_files(disk)) < before
        body = newest_body(disk)
        assert sum(r.blob_len for r in body.topics[0].runs) == 0  # no payloads
        cap = snapshot.capture(engine, [(0, 0)] * 2, 0, segments=cp(engine).segments)
        assert sum(map(len, snapshot.encode(cap))) < 1000
