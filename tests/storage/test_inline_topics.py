"""Inline topics: a topic that never outgrew `storage.segments.inline_max_bytes` keeps its
records in its snapshot entry, and moves into segment files exactly once when it grows.

Method: a durable engine on `FakeDisk` with a small bound (1,000 bytes: about four of
these records), checkpoints taken explicitly. What a reader sees is compared with what
recovery rebuilds after a power cut that keeps only durable bytes (no final checkpoint).
"Exactly once" is read off the disk: the topic's segment files hold each seq at most
once, every live record in exactly one of them, and no file the registry does not name.
The crash-point sweep restores the durable image before the checkpoint in which the
topic outgrows the bound and crashes after each of that checkpoint's mutating calls;
after every crash recovery must give the acknowledged state, and the next checkpoint
must complete the move.
"""

from __future__ import annotations

import contextlib
import gc
import posixpath

import pytest

from tests.storage.test_checkpoint import cp, state, write
from tests.storage.test_segments import newest_body
from topicd.engine.engine import Engine
from topicd.engine.topic import Topic
from topicd.sched.classes import Budget
from topicd.storage import segments as segs
from topicd.storage import snapshot
from topicd.testing.fake_fs import FakeDisk, FaultFs, PowerLoss
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import DeleteIn

BOUND = 1000


def config():
    return durable_config(wal={"file_bytes": 4096}, segments={"inline_max_bytes": BOUND})


def rec(i: int) -> bytes:
    return b'"%d-%s"' % (i, b"x" * 170)  # ~215 bytes stored: 4 stay inline, 5 do not


def entry(disk: FakeDisk, name: str) -> snapshot.TopicSnap:
    return next(t for t in newest_body(disk).topics if t.name == name)


def inline_bytes(snap: snapshot.TopicSnap) -> bytes:
    """The records the entry carries (their bytes trail the snapshot's body)."""
    assert all(run.blob_len == len(run.blob) for run in snap.runs)
    return b"".join(run.blob for run in snap.runs)


def segment_seqs(disk: FakeDisk, engine: Engine, name: str) -> list[int]:
    """The seqs of the records in the topic's segment files (in file order), checking that
    the directory holds only the files the registry names."""
    tid = engine.get(name).topic_id
    store = cp(engine).segments
    st = store.topics.get(tid)
    registered = [] if st is None else st.segments
    tdir = segs.topic_dir("/data", tid)
    names = sorted(disk.listdir(tdir)) if disk.exists(tdir) else []
    want = sorted(
        posixpath.basename(p(("/data"), tid, seg.first))
        for seg in registered
        for p in (segs.data_path, segs.meta_path)
    )
    assert [n for n in names if not n.endswith(".idx")] == want
    out = []
    for seg in registered:
        data = disk.pending_bytes(segs.data_path("/data", tid, seg.first)) or b""
        pos = 0
        while pos < seg.data_len:
            frame = segs.read_seg_frame(data, pos, seg.data_len)
            assert frame is not None
            out += range(frame.seq, frame.seq + frame.count)
            pos = frame.end
    return out


def live_seqs(engine: Engine, name: str) -> list[int]:
    t = engine.get(name)
    return [
        run.base + i
        for run in t.runs
        for i, enc in enumerate(run.encs)
        if enc is not None and run.base + i >= t.earliest_seq
    ]


def assert_moved_once(disk: FakeDisk, engine: Engine, name: str) -> None:
    seqs = segment_seqs(disk, engine, name)
    assert len(seqs) == len(set(seqs)), "a record was copied into segments twice"
    assert set(live_seqs(engine, name)) <= set(seqs)
    snap = entry(disk, name)
    assert snap.segments and snap.absorbed >= max(live_seqs(engine, name), default=0)
    assert inline_bytes(snap) == b""


async def test_a_small_topic_keeps_its_records_in_its_snapshot_entry():
    disk = FakeDisk()
    async with open_durable(disk, config()) as engine:
        await write(engine, "small", rec(1), rec(2), rec(3))
        assert await cp(engine).checkpoint()
        snap = entry(disk, "small")
        assert snap.segments == [] and snap.absorbed == 0
        assert inline_bytes(snap).count(b"-xxx") == 3
        assert not disk.exists(segs.topic_dir("/data", engine.get("small").topic_id))
        assert cp(engine).last_captured == 1
        assert await cp(engine).checkpoint()
        assert cp(engine).last_captured == 0  # its entry, records and all, is reused
        live = await state(engine)
        disk.sync_all()
        disk.crash(power_off=True)  # no final checkpoint: recovery starts from that one
    disk.reboot()
    async with open_durable(disk, config()) as engine:
        assert await state(engine) == live


async def test_a_growing_topic_moves_into_segments_once_and_stays_there():
    disk = FakeDisk()
    async with open_durable(disk, config()) as engine:
        await write(engine, "t", rec(1), rec(2), rec(3))
        assert await cp(engine).checkpoint()
        assert inline_bytes(entry(disk, "t"))
        await write(engine, "t", rec(4), rec(5))  # past the bound
        assert await cp(engine).checkpoint()
        assert_moved_once(disk, engine, "t")
        assert segment_seqs(disk, engine, "t") == [1, 2, 3, 4, 5]
        # small again: it stays in segments (only newer records are appended there)
        await engine.delete_records("t", DeleteIn(before_seq=5))
        await write(engine, "t", rec(6))
        assert await cp(engine).checkpoint()
        assert_moved_once(disk, engine, "t")
        assert segment_seqs(disk, engine, "t") == [1, 2, 3, 4, 5, 6]
        assert live_seqs(engine, "t") == [5, 6]
        live = await state(engine)
        disk.sync_all()
        disk.crash(power_off=True)
    disk.reboot()
    async with open_durable(disk, config()) as engine:
        assert await state(engine) == live
        assert engine.get("t").seg_tail == 6  # recovered as a segment topic
        res = await write(engine, "t", rec(7))  # (above the crash's reservation)
        assert await cp(engine).checkpoint()
        assert segment_seqs(disk, engine, "t") == [1, 2, 3, 4, 5, 6, res.first_seq]


async def test_a_failed_moving_checkpoint_moves_the_topic_at_the_next():
    disk = FakeDisk()
    fs = FaultFs(disk)
    async with open_durable(fs, config()) as engine:
        await write(engine, "t", rec(1), rec(2))
        assert await cp(engine).checkpoint()
        await write(engine, "t", rec(3), rec(4), rec(5))
        fs.fail("rename", nth=1)  # the segment is written, the snapshot is not
        assert not await cp(engine).checkpoint()
        assert inline_bytes(entry(disk, "t"))  # the old snapshot still holds the records
        assert await cp(engine).checkpoint()
        assert_moved_once(disk, engine, "t")
        live = await state(engine)
        disk.sync_all()
        disk.crash(power_off=True)
    disk.reboot()
    async with open_durable(disk, config()) as engine:
        assert await state(engine) == live
        assert_moved_once(disk, engine, "t")


@pytest.mark.parametrize("deleted", [False, True])
async def test_crash_at_every_step_of_the_moving_checkpoint(autojump_clock, deleted):
    """`deleted`: a record of the growing topic is deleted before the move (its slot is
    dead: not copied) and another one while inline records wait in the old snapshot."""
    disk = FakeDisk()
    cfg = config()
    async with open_durable(disk, cfg) as engine:
        await write(engine, "grow", rec(1), rec(2), rec(3), tag="a")
        await write(engine, "stay", rec(1))
        assert await cp(engine).checkpoint()
        if deleted:
            await engine.delete_records("grow", DeleteIn(before_seq=2))
        await write(engine, "grow", rec(4), rec(5), rec(6), rec(7), tag="b")
        if deleted:
            await engine.delete_records("grow", DeleteIn(match="b", before_seq=5))
        expected = await state(engine)
        disk.sync_all()  # the durable image before the checkpoint under test
        image = disk.snapshot()
        before = disk.mutations
        assert await cp(engine).checkpoint()
        assert_moved_once(disk, engine, "grow")
        assert inline_bytes(entry(disk, "stay"))
        steps = disk.mutations - before
        disk.crash(power_off=True)
    disk.reboot()
    assert steps > 5
    for k in range(steps + 1):
        disk.restore(image)
        async with open_durable(disk, cfg) as engine:
            disk.crash_after(k)
            with contextlib.suppress(PowerLoss):
                await cp(engine).checkpoint()
            disk.crash(power_off=True)
        disk.reboot()
        async with open_durable(disk, cfg) as engine:
            assert await state(engine) == expected, f"crash after mutating call {k} of {steps}"
            assert await cp(engine).checkpoint()
            assert_moved_once(disk, engine, "grow")
            assert await state(engine) == expected, k
            disk.sync_all()
            disk.crash(power_off=True)
        disk.reboot()
        async with open_durable(disk, cfg) as engine:
            assert await state(engine) == expected, k
            assert_moved_once(disk, engine, "grow")
        disk.crash(power_off=True)
        disk.reboot()


async def test_a_capture_of_inline_topics_keeps_no_tracked_object_per_topic():
    """What a capture holds until its checkpoint ends counts toward the next full garbage
    collection (which stops the loop for its whole length): an inline topic's capture
    keeps an untracked encoded entry and a tuple of bytes, nothing the collector scans."""
    disk = FakeDisk()
    async with open_durable(disk, config()) as engine:
        for i in range(500):
            await write(engine, f"t{i}", rec(i))
        step = snapshot._Stepwise(engine, 0, False, cp(engine).segments, True, None, None, BOUND)
        todo = step.first_todo()
        gc.collect()
        before = len(gc.get_objects())
        for t in todo:
            step.take(t)
        gc.collect()
        kept = len(gc.get_objects()) - before
        assert len(step.inline_raw) == 500
        assert kept < 50, kept  # (one dict or two, not ~10 objects a topic)
        step.finish([(0, 0)] * 2)


@pytest.mark.parametrize("every_step_yields", [False, True])
async def test_no_young_collection_during_a_checkpoint_walks_a_container_of_every_topic(
    monkeypatch, every_step_yields
):
    """A young garbage collection walks every container of the young generations whole
    (a memory access per element), holding the GIL — the loop — throughout: a young list,
    set or dict of 100,000 topics or ids made one ~4–12 ms long. What a checkpoint keeps
    per topic (the ids to take, the entries and records to reuse, the body's entries)
    therefore lives in arrays, untracked dicts or old containers. Checked here with the
    collector's young generation small (collections every 50 allocations), and in each
    collection that starts during the checkpoints: the full one after a fill, and two
    incremental ones after a write to every topic.

    With `every_step_yields`, every step of the checkpoint yields to the loop, as on a
    busy machine where each step outlasts its time quantum, and a young collection runs
    at each yield: no young container of every topic's `Topic` object may be alive
    across a yield (the changed topics' copy is dropped before its last step yields).
    The dict of the records of every inline topic captured now (`inline_records`) is
    young by construction while its checkpoint runs; it is only checked without forced
    yields."""
    n = 600
    if every_step_yields:
        real_pause = Budget.pause

        async def pause(self: Budget) -> None:
            gc.collect(0)  # a young collection at the yield: it sees what is alive across it
            await real_pause(self)

        monkeypatch.setattr(Budget, "due", lambda self: True)
        monkeypatch.setattr(Budget, "pause", pause)
    # (the records and body entries are handled in bounded chunks: smaller than `n` here)
    monkeypatch.setattr(snapshot, "CHUNK_RECORDS", 64)
    monkeypatch.setattr(snapshot, "CHUNK_TOPICS", 64)
    seen: list[tuple[str, int]] = []

    def census(phase: str, info: dict[str, int]) -> None:
        if phase != "start" or info["generation"] == 2:
            return
        for g in range(info["generation"] + 1):
            for o in gc.get_objects(generation=g):
                if isinstance(o, (list, tuple, dict, set, frozenset)) and len(o) >= n:
                    if every_step_yields and not isinstance(next(iter(o)), Topic):
                        continue
                    seen.append((type(o).__name__, len(o)))

    disk = FakeDisk()
    async with open_durable(disk, config()) as engine:
        for i in range(n):
            await write(engine, f"t{i}", rec(i))
        threshold = gc.get_threshold()
        for k in range(3):
            if k:
                for i in range(n):
                    await write(engine, f"t{i}", b'"%d"' % k)
            gc.collect()  # (what exists now is old)
            gc.set_threshold(50, 1, 1 << 30)
            gc.callbacks.append(census)
            try:
                assert await cp(engine).checkpoint()
            finally:
                gc.callbacks.remove(census)
                gc.set_threshold(*threshold)
            assert cp(engine).last_captured == n
            assert not seen, (k, seen)
        expected = await state(engine)
    async with open_durable(disk, config()) as engine:
        assert await state(engine) == expected
        assert len(newest_body(disk).topics) == n
