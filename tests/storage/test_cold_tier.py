"""The cold tier: sealed segments past the hot-retention bound move to `storage.cold_dir`.

Method: the bound itself (`tiering.to_relocate`) is checked on plain segment lists at
each edge: `hot_retain_segments` N keeps N sealed segments hot and relocates the N+1th,
`hot_retain_bytes` at exactly the bytes of the kept ones and one byte below, the stricter
of the two winning, and the hot set being the newest contiguous run. The rest runs a
durable engine on `FakeDisk` (inline offload and recovery, data in `/data`, cold tier in
`/cold`) with 4-record segments and 4-seq chunks in a payload cache of 0 bytes, so every read of an
absorbed record goes to its segment file: which files exist where after each checkpoint,
that reads (and `performance.cold_segments_read` over HTTP) come back byte-exact from the
cold tier and that restarts see the same state (`test_checkpoint.state`). Crash points:
the durable image before a relocating checkpoint is restored, `FakeDisk.crash_after(k)`
is armed for every mutating call k of that checkpoint and of the next one (which removes
the hot copies), power is cut, and recovery must yield the same state, also after one
more checkpoint and a second recovery; the same for two checkpoints that flip delete
flags in a cold file, drop cold segments below a cap and remove a deleted topic's cold
directory. The states in between are also built by hand: a
segment registered hot with only its cold copy (recovery finds it there), registered cold
with a stale hot copy (the cold one is used, the hot one removed). Corruption of a cold
segment: a serve-time read answers `500 internal` and counts
`topicd_segment_corruption_total`; a restart (which reads no sealed data) serves and the
read fails again; the full check (`topicd verify`) refuses naming the file. Drops (cap eviction)
and topic deletion remove cold files; unsetting `cold_dir` with cold segments refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import posixpath

import msgspec
import orjson
import pytest

from tests.storage.test_checkpoint import cp, state
from tests.storage.test_segments import _flip
from topicd.config import Config, TieringConfig
from topicd.engine import payloads
from topicd.engine.engine import Engine
from topicd.engine.topic import EVICTED
from topicd.errors import Internal
from topicd.storage import segments as segs
from topicd.storage import snapshot, tiering
from topicd.storage.recovery import RecoveryRefused, recover
from topicd.storage.segments import Segment
from topicd.storage.tiering import to_relocate
from topicd.testing.fake_clock import FakeWallClock
from topicd.testing.fake_fs import FakeDisk, PowerLoss
from topicd.testing.harness import durable_config, open_durable, open_durable_app
from topicd.wire import DeleteIn, DiffIn, RecordIn, TopicConfigIn, WriteIn

COLD = "/cold"


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(payloads, "CHUNK_SHIFT", 2)  # 4-seq chunks: evicted as they absorb


def config(
    retain: int = 2,
    retain_bytes: int = 0,
    *,
    cold_dir: str = COLD,
    max_events: int = 4,
    cache_bytes: int = 0,
) -> Config:
    cfg = durable_config(segments={"inline_max_bytes": 0})
    seg = dataclasses.replace(cfg.storage.segments, max_events=max_events)
    storage = dataclasses.replace(
        cfg.storage,
        segments=seg,
        payload_cache_bytes=cache_bytes,
        cold_dir=cold_dir,
        tiering=TieringConfig(hot_retain_segments=retain, hot_retain_bytes=retain_bytes),
    )
    return dataclasses.replace(cfg, storage=storage)


async def fill(engine: Engine, name: str, n: int, start: int = 0, tag: str | None = None) -> None:
    for i in range(start, start + n):
        rec = RecordIn(data=msgspec.Raw(b'"%d-%s"' % (i, b"c" * (i % 5))), tag=tag)
        await engine.append(name, WriteIn(records=[rec]))


def files(disk: FakeDisk, root: str, tid: int) -> list[str]:
    d = segs.topic_dir(root, tid)
    return sorted(disk.listdir(d)) if disk.exists(d) else []


def datas(disk: FakeDisk, root: str, tid: int) -> list[int]:
    return [int(n[4:24]) for n in files(disk, root, tid) if n.endswith(".data")]


def registry(disk: FakeDisk, name: str) -> list[tuple[int, bool, bool]]:
    """(first, sealed, cold) of the newest snapshot's segments of topic `name`."""
    _, path = snapshot.list_snapshots(disk, "/data")[0]
    body = snapshot.decode(disk.pending_bytes(path) or b"")
    (t,) = [t for t in body.topics if t.name == name]
    return [(s.first, s.sealed, s.cold) for s in t.segments]


# ---- the bound ------------------------------------------------------------------------


def segments(*sizes: int, active: bool = True, cold: int = 0) -> list[Segment]:
    """Sealed segments of these data sizes (oldest first; the `cold` oldest ones already
    cold), then an active one of 10 bytes."""
    out = [
        Segment(i * 10 + 1, i * 10 + 10, size, True, 0, cold=i < cold)
        for i, size in enumerate(sizes)
    ]
    if active:
        out.append(Segment(len(sizes) * 10 + 1, len(sizes) * 10 + 5, 10, False, 0))
    return out


def plan(segs_: list[Segment], n: int, b: int = 0) -> list[int]:
    return to_relocate(segs_, TieringConfig(hot_retain_segments=n, hot_retain_bytes=b))


def test_hot_retain_segments_keeps_exactly_n_sealed_segments_hot():
    five = segments(100, 100, 100, 100, 100)
    assert plan(five, 5) == []  # N sealed, N kept: nothing moves
    assert plan(five, 4) == [0]  # N + 1 sealed: the oldest moves
    assert plan(five, 2) == [0, 1, 2]
    assert plan(five, 0) == [0, 1, 2, 3, 4]  # 0: every sealed segment
    assert plan(segments(), 0) == []  # the active segment never moves
    assert plan(segments(100, 100, 100, cold=2), 1) == []  # already cold: not again
    assert plan(segments(100, 100, 100, cold=1), 1) == [1]


def test_hot_retain_bytes_keeps_the_newest_segments_that_fit():
    five = segments(100, 200, 300, 400, 500)  # newest last
    assert plan(five, 10, 900) == [0, 1, 2]  # 500 + 400 = 900 fit exactly
    assert plan(five, 10, 899) == [0, 1, 2, 3]  # one byte less: only 500
    assert plan(five, 10, 499) == [0, 1, 2, 3, 4]  # not even the newest
    assert plan(five, 10, 0) == []  # 0: no byte bound
    # the hot set is contiguous: 100 would fit after 300 is out, but stays behind it
    assert plan(segments(100, 300, 50), 10, 200) == [0, 1]


def test_the_stricter_bound_wins():
    five = segments(100, 100, 100, 100, 100)
    assert plan(five, 2, 10_000) == [0, 1, 2]  # the count is stricter
    assert plan(five, 4, 250) == [0, 1, 2]  # the bytes are stricter
    assert plan(five, 3, 300) == [0, 1]  # both at their edge together


# ---- relocation ---------------------------------------------------------------------


async def test_sealed_segments_past_the_bound_move_and_read_back_from_the_cold_dir():
    disk = FakeDisk()
    cfg = config(retain=2)
    async with open_durable(disk, cfg) as engine:
        await fill(engine, "t", 22)  # 5 sealed segments of 4, then 21..22 active
        expected = await state(engine)
        tid = engine.get("t").topic_id
        assert await cp(engine).checkpoint()
        assert registry(disk, "t") == [
            (1, True, True),
            (5, True, True),
            (9, True, True),
            (13, True, False),
            (17, True, False),
            (21, False, False),
        ]
        assert datas(disk, COLD, tid) == [1, 5, 9]
        assert all(
            disk.durable_bytes(posixpath.join(segs.topic_dir(COLD, tid), n)) is not None
            for n in files(disk, COLD, tid)
        )
        assert disk.durable_listdir(segs.topic_dir(COLD, tid)) is not None
        for first in (1, 5, 9):  # byte for byte, `.idx` included
            for path in (segs.data_path, segs.idx_path):
                hot = disk.pending_bytes(path("/data", tid, first))
                assert hot is not None and hot == disk.pending_bytes(path(COLD, tid, first))
        # the hot copies go one snapshot later (the older kept snapshot may name them)
        assert await cp(engine).checkpoint()
        assert datas(disk, "/data", tid) == [13, 17, 21]
        store = cp(engine).segments
        t = engine.get("t")
        assert t.enc(2) is EVICTED
        before = store.cold_reads
        _, res = await engine.diff("t", DiffIn(from_seq=0, limit=6))
        assert [orjson.loads(r)["data"] for r in res.records] == [
            f"{i}-{'c' * (i % 5)}" for i in range(6)
        ]
        assert res.cold_segments == 2  # seqs 1..6: segments 1 and 5
        assert store.cold_reads - before == 2
        _, res = await engine.diff("t", DiffIn(from_seq=14, limit=4))
        assert res.cold_segments == 0  # segments 13 and 17 are hot
        assert await state(engine) == expected
        stats = store.stats()
        assert (stats["cold_segments"], stats["relocated"]) == (3, 3)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected
        await fill(engine, "t", 8, start=22)  # 21..24 and 25..28 seal: 13 and 17 move
        assert await cp(engine).checkpoint()
        assert [f for f, _, cold in registry(disk, "t") if cold] == [1, 5, 9, 13, 17]
        expected = await state(engine)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected


async def test_hot_retain_bytes_bounds_the_hot_segments():
    disk = FakeDisk()
    async with open_durable(disk, config(retain=100)) as engine:
        await fill(engine, "t", 16)
        assert await cp(engine).checkpoint()
        tid = engine.get("t").topic_id
        lens = {s.first: s.data_len for s in cp(engine).segments.topics[tid].segments}
    assert lens[9] + lens[13] < lens[5] + lens[9] + lens[13]
    for below, cold in ((0, [1, 5]), (1, [1, 5, 9])):
        async with open_durable(
            disk, config(retain=100, retain_bytes=lens[9] + lens[13] - below)
        ) as engine:
            # nothing written since: the waiting relocation alone makes a checkpoint due
            assert cp(engine).segments.tier_due == {tid}
            assert await cp(engine).checkpoint()
            assert [f for f, _, c in registry(disk, "t") if c] == cold
            assert not cp(engine).segments.tier_due


async def test_a_checkpoint_is_due_with_nothing_written_when_segments_wait(autojump_clock):
    disk = FakeDisk()
    async with open_durable(disk, config(retain=10)) as engine:
        await fill(engine, "t", 12)
        assert await cp(engine).checkpoint()
        assert not cp(engine).due()
    async with open_durable(disk, config(retain=1)) as engine:
        checkpointer = cp(engine)
        assert checkpointer.segments.tier_due
        assert not checkpointer.due()  # not before interval_ms
        interval = engine.checkpointer.cfg.storage.snapshot.interval_ms  # type: ignore[union-attr]
        checkpointer._last_at -= interval / 1000
        assert checkpointer.due()
        assert await checkpointer.checkpoint()
        assert not checkpointer.due()
        assert [f for f, _, c in registry(disk, "t") if c] == [1, 5]


async def test_reads_over_http_report_cold_segments_read():
    disk = FakeDisk()
    async with open_durable_app(disk, config(retain=0)) as h:
        await fill(h.engine, "t", 9)
        assert await cp(h.engine).checkpoint()
        client = h.app.test_client()
        r = await client.post("/v0/topics/t/diff", json={"from_seq": 0, "limit": 8})
        body = await r.get_json()
        assert r.status_code == 200 and len(body["records"]) == 8
        assert body["performance"]["cold_segments_read"] == 2
        r = await client.post("/v0/topics/t/diff", json={"from_seq": 8})
        body = await r.get_json()
        assert [rec["$seq"] for rec in body["records"]] == [9]
        assert "cold_segments_read" not in body["performance"]  # omitted when 0
        metrics = (await (await client.get("/v0/metrics")).get_data()).decode()
        assert "topicd_cold_segments_read_total 2.0" in metrics
        assert "topicd_cold_segments 2.0" in metrics
        assert "topicd_segments_relocated_total 2.0" in metrics


async def test_without_a_cold_dir_nothing_moves():
    disk = FakeDisk()
    async with open_durable(disk, config(retain=0, cold_dir="")) as engine:
        await fill(engine, "t", 12)
        assert await cp(engine).checkpoint()
        assert not any(c for _, _, c in registry(disk, "t"))
    assert not disk.exists(COLD)


# ---- deletes, drops, topic deletion ----------------------------------------------------


async def test_deletes_drops_and_topic_deletion_reach_the_cold_dir():
    disk = FakeDisk()
    cfg = config(retain=0)
    async with open_durable(disk, cfg) as engine:
        await fill(engine, "t", 2, tag="keep")
        await fill(engine, "t", 2, start=2, tag="a")
        await fill(engine, "t", 8, start=4, tag="keep")
        await fill(engine, "capped", 12)
        assert await cp(engine).checkpoint()
        tid = engine.get("t").topic_id
        cid = engine.get("capped").topic_id
        assert datas(disk, COLD, tid) == [1, 5, 9] == datas(disk, COLD, cid)
        # a delete flag flipped in a cold file
        await engine.delete_records("t", DeleteIn(match="a"))  # seqs 3 and 4
        assert await cp(engine).checkpoint()
        data = disk.pending_bytes(segs.data_path(COLD, tid, 1)) or b""
        assert segs.flagged_seqs(data, len(data)) == [3, 4]
        # a cap evicts 1..8: the two cold segments below it are dropped
        await engine.put_topic("capped", TopicConfigIn(cap_records=4))
        await fill(engine, "capped", 1, start=12)
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()
        assert datas(disk, COLD, cid) == [9]
        expected = await state(engine)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected
        _, res = await engine.diff("t", DiffIn(from_seq=0, limit=3))
        assert [orjson.loads(r)["$seq"] for r in res.records] == [1, 2, 5]
        await engine.delete_topic("t", False)
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()
    assert not disk.exists(segs.topic_dir(COLD, tid))
    assert not disk.exists(segs.topic_dir("/data", tid))


# ---- crashes -------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [2, 1])
async def test_crash_at_every_step_of_relocation_keeps_the_state(autojump_clock, keep):
    disk = FakeDisk()
    cfg = config(retain=1)
    cfg = dataclasses.replace(
        cfg,
        storage=dataclasses.replace(
            cfg.storage, snapshot=dataclasses.replace(cfg.storage.snapshot, keep=keep)
        ),
    )
    async with open_durable(disk, cfg) as engine:
        await fill(engine, "t", 6, tag="x")
        await fill(engine, "u", 3)
        assert await cp(engine).checkpoint()  # 1..4 sealed, hot (the newest one)
        await fill(engine, "t", 7, start=6)  # 5..8, 9..12 seal: 1 and 5 move
        await engine.delete_records("t", DeleteIn(before_seq=3))  # flips in a moving one
        expected = await state(engine)
        disk.sync_all()
        image = disk.snapshot()
        before = disk.mutations
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()  # the hot copies are removed here (keep 2)
        steps = disk.mutations - before
        tid = engine.get("t").topic_id
        assert datas(disk, COLD, tid) == [1, 5]
        assert datas(disk, "/data", tid) == [9, 13]
        disk.crash(power_off=True)
    disk.reboot()
    assert steps > 10
    for k in range(steps + 1):
        disk.restore(image)
        async with open_durable(disk, cfg, boot_id="boot-1") as engine:
            disk.crash_after(k)
            with contextlib.suppress(PowerLoss):
                await cp(engine).checkpoint()
                await cp(engine).checkpoint()
            disk.crash(power_off=True)
        disk.reboot()
        async with open_durable(disk, cfg, boot_id="boot-1") as engine:
            assert await state(engine) == expected, f"crash after mutating call {k} of {steps}"
            assert await cp(engine).checkpoint()
            assert await cp(engine).checkpoint()
            where = {s.first: s.cold for s in cp(engine).segments.topics[tid].segments}
            assert where == {1: True, 5: True, 9: False, 13: False}, k
        disk.crash(power_off=True)
        disk.reboot()
        async with open_durable(disk, cfg, boot_id="boot-1") as engine:
            assert await state(engine) == expected, f"(second recovery) crash after {k}"
        # each file in exactly one place, nothing else in either tree
        assert datas(disk, COLD, tid) == [1, 5], k
        assert datas(disk, "/data", tid) == [9, 13], k
        disk.crash(power_off=True)
        disk.reboot()


async def test_crash_at_every_step_of_flips_drops_and_deletion_in_the_cold_tier(autojump_clock):
    disk = FakeDisk()
    cfg = config(retain=0)
    async with open_durable(disk, cfg) as engine:
        await fill(engine, "t", 2, tag="keep")
        await fill(engine, "t", 2, start=2, tag="a")
        await fill(engine, "t", 8, start=4, tag="keep")
        await fill(engine, "capped", 12)
        await fill(engine, "gone", 12)
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()
        ids = {n: engine.get(n).topic_id for n in ("t", "capped", "gone")}
        assert all(datas(disk, COLD, tid) == [1, 5, 9] for tid in ids.values())
        await engine.delete_records("t", DeleteIn(match="a"))  # flags in a cold file
        await engine.put_topic("capped", TopicConfigIn(cap_records=4))
        await fill(engine, "capped", 1, start=12)  # 1..8 evicted: two cold drops
        await engine.delete_topic("gone", False)  # its cold directory goes
        expected = await state(engine)
        disk.sync_all()
        image = disk.snapshot()
        before = disk.mutations
        assert await cp(engine).checkpoint()
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
                await cp(engine).checkpoint()
            disk.crash(power_off=True)
        disk.reboot()
        async with open_durable(disk, cfg, boot_id="boot-1") as engine:
            assert await state(engine) == expected, f"crash after mutating call {k} of {steps}"
            assert await cp(engine).checkpoint()
            assert await cp(engine).checkpoint()
        disk.crash(power_off=True)
        disk.reboot()
        async with open_durable(disk, cfg, boot_id="boot-1") as engine:
            assert await state(engine) == expected, f"(second recovery) crash after {k}"
        assert datas(disk, COLD, ids["capped"]) == [9], k
        assert not disk.exists(segs.topic_dir(COLD, ids["gone"])), k
        data = disk.pending_bytes(segs.data_path(COLD, ids["t"], 1)) or b""
        assert len(segs.flagged_seqs(data, len(data))) == 2, k
        disk.crash(power_off=True)
        disk.reboot()


async def _relocated(disk: FakeDisk) -> tuple[int, dict[str, object]]:
    """A topic whose segment 1 was relocated and its hot copy removed."""
    async with open_durable(disk, config(retain=1)) as engine:
        await fill(engine, "t", 9)
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()
        tid = engine.get("t").topic_id
        assert datas(disk, COLD, tid) == [1] and datas(disk, "/data", tid) == [5, 9]
        return tid, await state(engine)


def _copy(disk: FakeDisk, src: str, dst: str) -> None:
    data = disk.pending_bytes(src)
    assert data is not None
    disk.mkdir(posixpath.dirname(dst))
    fd = disk.open(dst, create=True)
    disk.pwrite(fd, data, 0)
    disk.close(fd)


async def test_a_segment_registered_hot_is_found_in_the_cold_dir():
    # the state an older snapshot sees once the hot copy is gone, built by hand: the
    # segment is registered hot, only its cold copy exists
    disk = FakeDisk()
    cfg = config(retain=10)
    async with open_durable(disk, cfg) as engine:
        await fill(engine, "t", 9)
        assert await cp(engine).checkpoint()
        tid = engine.get("t").topic_id
        expected = await state(engine)
    for path in (segs.data_path, segs.idx_path):
        _copy(disk, path("/data", tid, 1), path(COLD, tid, 1))
        disk.unlink(path("/data", tid, 1))
    assert registry(disk, "t")[0] == (1, True, False)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected
        seg = cp(engine).segments.topics[tid].segments[0]
        assert seg.cold
        assert await cp(engine).checkpoint()
        assert registry(disk, "t")[0] == (1, True, True)  # the registry follows
    # without a cold dir it is simply missing
    disk_copy = disk
    with pytest.raises(RecoveryRefused, match="cold tier"):
        async with open_durable(disk_copy, config(cold_dir="")):
            pass


async def test_a_cold_registered_segment_ignores_a_stale_hot_copy():
    disk = FakeDisk()
    tid, expected = await _relocated(disk)
    # a stale hot copy (made before a delete flag was flipped in the cold one, say)
    _copy(disk, segs.data_path(COLD, tid, 1), segs.data_path("/data", tid, 1))
    stale = segs.data_path("/data", tid, 1)
    first = segs.load_segment(disk, COLD, tid, _reg(disk, 1), max_frame=1 << 24).segment
    _flip(disk, stale, first.offsets[0] + 45)  # garbage: would refuse if it were read
    async with open_durable(disk, config(retain=1)) as engine:
        assert await state(engine) == expected
    assert not disk.exists(stale)  # an orphan, removed once recovery succeeded


def _reg(disk: FakeDisk, first: int) -> segs.SegSnap:
    _, path = snapshot.list_snapshots(disk, "/data")[0]
    body = snapshot.decode(disk.pending_bytes(path) or b"")
    return next(s for t in body.topics for s in t.segments if s.first == first)


async def test_a_partial_cold_copy_of_a_hot_segment_is_an_orphan():
    disk = FakeDisk()
    cfg = config(retain=10)
    async with open_durable(disk, cfg) as engine:
        await fill(engine, "t", 9)
        assert await cp(engine).checkpoint()
        tid = engine.get("t").topic_id
        expected = await state(engine)
    half = (disk.pending_bytes(segs.data_path("/data", tid, 1)) or b"")[:30]
    disk.mkdir(segs.topic_dir(COLD, tid))
    fd = disk.open(segs.data_path(COLD, tid, 1), create=True)
    disk.pwrite(fd, half, 0)
    disk.close(fd)
    stray = segs.topic_dir(COLD, 0xABC)
    disk.mkdir(stray)
    async with open_durable(disk, cfg) as engine:
        assert await state(engine) == expected
    assert not disk.exists(segs.data_path(COLD, tid, 1)) and not disk.exists(stray)


async def test_unsetting_the_cold_dir_with_cold_segments_refuses_recovery():
    disk = FakeDisk()
    await _relocated(disk)
    before = disk.tree()
    with pytest.raises(RecoveryRefused, match=r"storage\.cold_dir is not set"):
        async with open_durable(disk, config(cold_dir="")):
            pass
    assert disk.tree() == before
    with pytest.raises(RecoveryRefused, match="registered segment is missing"):
        async with open_durable(disk, config(cold_dir="/elsewhere")):
            pass
    assert disk.tree() == before


# ---- corruption ----------------------------------------------------------------------


async def test_a_corrupt_cold_segment_is_a_500_counted_and_refused_by_the_full_check(caplog):
    disk = FakeDisk()
    cfg = config(retain=0)
    async with open_durable_app(disk, cfg) as h:
        engine = h.engine
        await fill(engine, "t", 9)
        assert await cp(engine).checkpoint()
        t = engine.get("t")
        seg = cp(engine).segments.topics[t.topic_id].find(2)
        assert seg is not None and seg.cold and t.enc(2) is EVICTED
        path = segs.data_path(COLD, t.topic_id, seg.first)
        at = seg.offsets[1] + 45
        _flip(disk, path, at)
        client = h.app.test_client()
        r = await client.post("/v0/topics/t/diff", json={"from_seq": 0})
        assert r.status_code == 500
        assert (await r.get_json())["error"]["code"] == "internal"
        assert t.enc(2) is EVICTED  # never served, never cached
        with pytest.raises(Internal):
            await engine.commit.read_stored(t, 2, 1)  # type: ignore[union-attr]
        metrics = (await (await client.get("/v0/metrics")).get_data()).decode()
        assert "topicd_segment_corruption_total 2.0" in metrics
        assert "segment corruption" in caplog.text
        assert posixpath.basename(path) in caplog.text
        # records of other segments still read
        r = await client.post("/v0/topics/t/diff", json={"from_seq": 4})
        assert r.status_code == 200 and len((await r.get_json())["records"]) == 5
        tid = t.topic_id
    # a start reads no sealed data: it serves, and the read fails again
    async with open_durable(disk, cfg) as engine:
        with pytest.raises(Internal):
            await engine.diff("t", DiffIn(from_seq=0, limit=10))
        assert cp(engine).segments.corruptions == 1
    # the full check (`topicd verify`) refuses, naming the cold file, modifying nothing
    before = disk.tree()
    with pytest.raises(RecoveryRefused, match="in the cold tier") as exc:
        recover(cfg, disk, FakeWallClock(), boot_id="boot-1", check_sealed=True)
    assert posixpath.relpath(segs.data_path(COLD, tid, 1), COLD) in str(exc.value)
    assert disk.tree() == before


async def test_a_read_that_raced_a_relocation_finds_the_cold_copy():
    disk = FakeDisk()
    async with open_durable(disk, config(retain=1)) as engine:
        await fill(engine, "t", 9)
        assert await cp(engine).checkpoint()
        assert await cp(engine).checkpoint()  # the hot copy of segment 1 is gone
        store = cp(engine).segments
        tid = engine.get("t").topic_id
        st = store.topics[tid]
        # the index as a read that began before the relocation was installed saw it
        stale = dataclasses.replace(st.segments[0], cold=False)
        st.segments[0] = stale
        assert not disk.exists(segs.data_path("/data", tid, 1))
        got = store.read_range(tid, 1, 4, 1 << 20)
        assert [orjson.loads(v)["data"] for v in got.values()] == ["0-", "1-c", "2-cc", "3-ccc"]
        assert got.cold == 1
        rec = store.read_record(tid, 2)
        assert rec is not None and orjson.loads(rec.enc)["data"] == "1-c"
        st.segments[0] = dataclasses.replace(stale, cold=True)


async def test_a_cold_dir_of_another_data_dir_is_never_touched(caplog):
    disk = FakeDisk()
    await _relocated(disk)
    own = disk.pending_bytes("/cold/COLD_ID")
    assert own is not None and own == disk.pending_bytes("/data/COLD_ID")
    # a second data directory pointed at the same cold directory: refused, nothing removed
    other = dataclasses.replace(
        config(retain=1), storage=dataclasses.replace(config(retain=1).storage, data_dir="/data2")
    )
    before = disk.tree()
    with pytest.raises(RecoveryRefused, match="belongs to another data directory"):
        async with open_durable(disk, other):
            pass
    assert disk.tree() == before
    # relocation refuses too: the foreign id appears while a server runs
    disk2 = FakeDisk()
    async with open_durable(disk2, config(retain=1)) as engine:
        disk2.mkdir(COLD)
        fd = disk2.open(COLD + "/COLD_ID", create=True)
        disk2.pwrite(fd, b"someone-else\n", 0)
        disk2.close(fd)
        await fill(engine, "t", 9)
        assert not await cp(engine).checkpoint()
        assert "belongs to another data directory" in caplog.text
        assert not disk2.exists(segs.topic_dir(COLD, engine.get("t").topic_id))
        disk2.unlink(COLD + "/COLD_ID")
        assert await cp(engine).checkpoint()
        assert registry(disk2, "t")[0] == (1, True, True)


async def test_a_relocation_backlog_moves_within_a_budget_per_checkpoint(monkeypatch):
    disk = FakeDisk()
    async with open_durable(disk, config(retain=10)) as engine:
        await fill(engine, "t", 20)  # 5 sealed segments, none past the bound
        await fill(engine, "u", 8)  # 2
        assert await cp(engine).checkpoint()
        expected = await state(engine)
    # a checkpoint relocates until it copied this much (checked before each segment, so
    # always at least one): 1 byte moves one segment per checkpoint
    monkeypatch.setattr(tiering, "RELOCATE_BYTES", 1)
    async with open_durable(disk, config(retain=0)) as engine:
        checkpointer = cp(engine)
        moved = []
        while checkpointer.due() or not moved:
            assert await checkpointer.checkpoint()
            moved.append(checkpointer.segments.stats()["cold_segments"])
        assert moved == [1, 2, 3, 4, 5, 6, 7]  # each due at once, oldest first
        assert not checkpointer.segments.tier_backlog and not checkpointer.segments.tier_due
        assert await state(engine) == expected
    async with open_durable(disk, config(retain=0)) as engine:
        assert await state(engine) == expected
