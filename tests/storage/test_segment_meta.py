"""Segment `.meta` side files: recovery loads segments from them, falls back to the frames.

Method: a durable engine on `FakeDisk` with tiny segment triggers; its `.meta` files are
removed, cut short or damaged, and recovery must rebuild the same readable state by
decoding the frames, re-make the side file in its repair step (a crash at each of
those steps recovers the same state again), and load from the side file at the next
start. `tests/fixtures/datadir-v3-nometa` (written by the release before side files)
opens on the real filesystem and gets them. That recovery from side files rebuilds
exactly what decoding the frames does is checked by the Hypothesis model
(`test_segments_model`), after every restart.
"""

from __future__ import annotations

import dataclasses
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import xxhash

from tests.storage.test_checkpoint import cp, state, write
from tests.storage.test_segments import _flip, newest_body, seg_config
from topicd.config import Config
from topicd.storage import segments as segs
from topicd.storage.fs import Fs, RealFs
from topicd.storage.recovery import FORMAT_BODY, RecoveryRefused, recover
from topicd.testing.fake_clock import FakeWallClock
from topicd.testing.fake_fs import FakeDisk, PowerLoss
from topicd.testing.harness import open_durable
from topicd.wire import DeleteIn

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "datadir-v3-nometa"


def metas(disk: FakeDisk) -> list[str]:
    return sorted(p for p in disk.tree() if p.endswith(".meta"))


async def _populated(disk: FakeDisk, cfg: Config) -> dict[str, object]:
    async with open_durable(disk, cfg) as engine:
        for i in range(10):
            await write(engine, "t", b'"%d-%s"' % (i, b"m" * 40), tag=f"k{i % 3}")
        assert await cp(engine).checkpoint()
        await engine.delete_records("t", DeleteIn(match="k1"))  # flips in sealed segments
        await write(engine, "t", b'"late"', tag="k2")
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()
        return await state(engine)


def _recover(fs: Fs, cfg: Config) -> list[tuple[str, bytes]]:
    """The `.meta` files a recovery would have to re-make."""
    return recover(cfg, fs, FakeWallClock(), boot_id="boot-1").segment_metas


async def test_every_segment_gets_a_meta_and_recovery_loads_from_it():
    disk = FakeDisk()
    cfg = seg_config(max_events=4)
    expected = await _populated(disk, cfg)
    body = newest_body(disk)
    regs = [s for t in body.topics for s in t.segments]
    assert len(regs) == 3 and all(s.meta_len > 0 for s in regs)
    assert [s.sealed for s in regs] == [True, True, False]
    assert len(metas(disk)) == 3
    assert _recover(disk, cfg) == []  # nothing re-made: every segment loaded from its .meta
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected


@pytest.mark.parametrize("damage", ["missing", "short", "flipped", "junk_after"])
async def test_an_unusable_meta_falls_back_to_the_frames_and_is_remade(damage, caplog):
    disk = FakeDisk()
    cfg = seg_config(max_events=4)
    expected = await _populated(disk, cfg)
    path = metas(disk)[0]
    if damage == "missing":
        disk.unlink(path)
    elif damage == "short":
        fd = disk.open(path)
        disk.ftruncate(fd, len(disk.pending_bytes(path) or b"") - 3)
        disk.close(fd)
    elif damage == "flipped":
        _flip(disk, path, 60)
    else:  # bytes past the registered length (an uncommitted absorb's): ignored
        fd = disk.open(path)
        disk.pwrite(fd, b"junk", len(disk.pending_bytes(path) or b""))
        disk.close(fd)
    remade = _recover(disk, cfg)
    assert [p for p, _ in remade] == ([] if damage == "junk_after" else [path])
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected
    if damage != "junk_after":
        assert "decoding the segment's frames" in caplog.text
    # re-made by the repair step: the next recovery loads from it (the registry names
    # the new length from the first checkpoint on)
    assert _recover(disk, cfg) == []
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected


async def test_a_crash_at_each_step_of_remaking_the_meta_files_recovers_the_same_state():
    disk = FakeDisk()
    cfg = seg_config(max_events=4)
    expected = await _populated(disk, cfg)
    for path in metas(disk):
        disk.unlink(path)
    disk.sync_all()
    image = disk.snapshot()
    before = disk.mutations
    async with open_durable(disk, cfg):
        pass
    steps = disk.mutations - before
    assert steps > 6
    for k in range(steps + 1):
        disk.restore(image)
        disk.crash_after(k)
        try:
            async with open_durable(disk, cfg):
                pass
        except* (PowerLoss, RecoveryRefused):  # (k = 0: recovery finds the disk off)
            pass
        disk.crash(power_off=True)
        disk.reboot()
        async with open_durable(disk, cfg) as engine:
            assert await state(engine) == expected, f"crash after mutating call {k} of {steps}"
        assert _recover(disk, cfg) == []


async def test_a_directory_without_meta_files_opens_and_gets_them(tmp_path):
    root = tmp_path / "data"
    shutil.copytree(FIXTURE, root)
    (root / "README.md").unlink()
    base = seg_config(max_events=4)
    cfg = dataclasses.replace(base, storage=dataclasses.replace(base.storage, data_dir=str(root)))
    fs = RealFs()
    assert not list(root.rglob("*.meta"))
    assert len(_recover(fs, cfg)) == 5
    async with open_durable(fs, cfg, boot_id="fixture-boot") as engine:
        got = await state(engine)
        bulk = [bytes(r).split(b'"data":')[1] for r in got["bulk"][0]]  # type: ignore[index]
        assert bulk == [b'"0"}', b'"3"}', b'"6"}', b'"9"}', b'"tail"}']
        capped = [bytes(r).split(b'"data":')[1] for r in got["capped"][0]]  # type: ignore[index]
        assert capped == [b'"c%d"}' % i for i in range(4, 10)]
        expected = got
    assert len(list(root.rglob("*.meta"))) == 5
    assert _recover(fs, cfg) == []
    async with open_durable(fs, cfg, boot_id="fixture-boot") as engine:
        assert await state(engine) == expected


async def test_a_format_1_directory_upgrades_and_reads_both_frame_kinds(tmp_path):
    """The fixture's FORMAT says 1 and its segments hold one-record frames. After the
    start FORMAT says 2; new records are absorbed in run frames, where deletes flip
    their flags; the old frames' flags still read; restarts read everything back from
    the `.meta` files and, with those removed, by decoding the frames. (One segment
    holding both kinds is in `test_absorb_bulk`.)"""
    root = tmp_path / "data"
    shutil.copytree(FIXTURE, root)
    (root / "README.md").unlink()
    assert b'"storage_format":1' in (root / "FORMAT").read_bytes()
    base = seg_config(max_events=100)
    cfg = dataclasses.replace(base, storage=dataclasses.replace(base.storage, data_dir=str(root)))
    fs = RealFs()

    def kinds(tid: int, seg: segs.Segment) -> list[str]:
        data = fs.read(segs.data_path(str(root), tid, seg.first))
        out, pos = [], 0
        while pos < seg.data_len:
            frame = segs.read_seg_frame(data, pos, seg.data_len)
            assert frame is not None
            out.append("append" if frame.legacy is not None else f"run of {frame.count}")
            pos = frame.end
        return out

    async with open_durable(fs, cfg, boot_id="fixture-boot") as engine:
        assert (root / "FORMAT").read_bytes() == FORMAT_BODY
        assert b'"storage_format":2' in FORMAT_BODY
        for i in range(6):
            await write(engine, "bulk", b'"new%d"' % i, tag=f"n{i % 2}")
        assert await cp(engine).checkpoint()
        tid = engine.get("bulk").topic_id
        old, *_, new = cp(engine).segments.topics[tid].segments
        assert kinds(tid, old) == ["append"] * 4
        assert kinds(tid, new) == ["run of 6"]
        await engine.delete_records("bulk", DeleteIn(match="n1"))  # in the run
        assert await cp(engine).checkpoint()
        data = fs.read(segs.data_path(str(root), tid, old.first))
        assert segs.flagged_seqs(data, old.data_len) == [2, 3]  # (the old release's)
        data = fs.read(segs.data_path(str(root), tid, new.first))
        assert segs.flagged_seqs(data, new.data_len) == [new.first + k for k in (1, 3, 5)]
        expected = await state(engine)
        new_left = [b'"new0"}', b'"new2"}', b'"new4"}']
        bulk = [bytes(r).split(b'"data":')[1] for r in expected["bulk"][0]]  # type: ignore[index]
        assert bulk == [b'"0"}', b'"3"}', b'"6"}', b'"9"}', b'"tail"}', *new_left]
    assert _recover(fs, cfg) == []
    async with open_durable(fs, cfg, boot_id="fixture-boot") as engine:
        assert await state(engine) == expected
    for meta in root.rglob("*.meta"):
        meta.unlink()
    assert _recover(fs, cfg)  # (decoded, and re-made)
    async with open_durable(fs, cfg, boot_id="fixture-boot") as engine:
        assert await state(engine) == expected


async def test_a_directory_of_a_newer_format_is_refused(tmp_path):
    root = tmp_path / "data"
    shutil.copytree(FIXTURE, root)
    (root / "FORMAT").write_bytes(b'{"storage_format":3,"checksum":"xxh3_64"}\n')
    base = seg_config()
    cfg = dataclasses.replace(base, storage=dataclasses.replace(base.storage, data_dir=str(root)))
    with pytest.raises(RecoveryRefused, match="unsupported storage format"):
        _recover(RealFs(), cfg)


_ENCODE_CHUNK = segs.encode_chunk  # (this release's, before any test replaces it)


def _encode_chunk_v1(*args: Any) -> bytes:
    """`segs.encode_chunk` as the release before the size sum wrote it (`TSM1`: a 48-byte
    header without the sum)."""
    raw = _ENCODE_CHUNK(*args)
    magic, n, base, m, e, start, stop, data_digest, _, _ = segs._CHUNK.unpack_from(raw)
    assert magic == segs.META_MAGIC
    head = segs._CHUNK_V1.pack(segs.META_MAGIC_V1, n, base, m, e, start, stop, data_digest, 0)
    digest = xxhash.xxh3_64(head[:40])
    digest.update(raw[segs._CHUNK.size :])
    return head[:40] + struct.pack("<Q", digest.intdigest()) + raw[segs._CHUNK.size :]


def _loaded(disk: FakeDisk, cfg: Config) -> list[segs.LoadedSegment]:
    body = newest_body(disk)
    return [
        segs.load_segment(disk, cfg.storage.data_dir, t.id, reg, max_frame=1 << 20)
        for t in body.topics
        for reg in t.segments
    ]


async def test_meta_chunks_carry_their_size_sum():
    """A start takes each segment's record bytes from its chunks' sums instead of adding up
    every retained record's size; the checksum covers the sum."""
    disk = FakeDisk()
    cfg = seg_config(max_events=4)
    await _populated(disk, cfg)
    for path in metas(disk):
        assert disk.read(path)[:4] == segs.META_MAGIC
    loaded = _loaded(disk, cfg)
    assert len(loaded) == 3
    for one in loaded:
        assert one.size_sum == sum(one.sizes) > 0
    path = metas(disk)[0]
    bad = bytearray(disk.read(path))
    bad[40] ^= 1  # (the sum's low byte)
    fd = disk.open(path)
    disk.pwrite(fd, bytes(bad), 0)
    disk.close(fd)
    assert [p for p, _ in _recover(disk, cfg)] == [path]


async def test_meta_chunks_of_the_release_before_the_sum_are_read_and_summed(monkeypatch):
    """`.meta` files written before chunks carried their size sum load without being
    re-made, to the same state; a checkpoint appends new chunks after the old ones."""
    disk = FakeDisk()
    cfg = seg_config(max_events=4)
    monkeypatch.setattr(segs, "encode_chunk", _encode_chunk_v1)
    reference = await _populated(disk, cfg)
    monkeypatch.undo()
    assert all(disk.read(p)[:4] == segs.META_MAGIC_V1 for p in metas(disk))
    for one in _loaded(disk, cfg):
        assert one.size_sum == sum(one.sizes) > 0
    assert _recover(disk, cfg) == []
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == reference
        for i in range(3):
            await write(engine, "t", b'"after-%d"' % i, tag="k0")
        assert await cp(engine).checkpoint()
        expected = await state(engine)
    mixed = [disk.read(p) for p in metas(disk)]
    assert any(raw[:4] == segs.META_MAGIC_V1 and segs.META_MAGIC in raw for raw in mixed)
    assert _recover(disk, cfg) == []
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected
