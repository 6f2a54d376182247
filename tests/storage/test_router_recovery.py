"""Routers across restarts: definitions and cursors survive, copies come back at the same
seqs, none is lost or duplicated, also with direct writes to the destination in between.

Method: an engine on a `FakeDisk` (`open_durable`: inline offload and recovery, the
test's loop) creates routers and writes through `Engine` calls; catch-up runs through
`diff`, so nothing waits on the sweep. A *process crash* is modelled by capturing the
disk as the page cache holds it (`sync_all()` then `snapshot()`: written bytes survive a
killed process) in the middle of the run and restoring that image after the engine
exits, so neither the final drain nor the final snapshot are in it. A *clean restart*
just reopens. After a restart every destination must read back exactly the same
records (`$seq`, payload) as before, and new writes must keep forwarding.
"""

from __future__ import annotations

import msgspec
import pytest

from topicd.engine.engine import Engine
from topicd.storage.checkpoint import Checkpointer
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import open_durable
from topicd.wire import DiffIn, RecordIn, RouterIn, TopicConfigIn, WriteIn


async def write(engine: Engine, name: str, *datas: str, tag: str | None = None):
    recs = [RecordIn(data=msgspec.Raw(b'"%s"' % d.encode()), tag=tag) for d in datas]
    return await engine.append(name, WriteIn(records=recs))


async def dump(engine: Engine, name: str) -> list[tuple[int, object]]:
    out: list[tuple[int, object]] = []
    cursor = 0
    while True:
        _, res = await engine.diff(name, DiffIn(from_seq=cursor, limit=1000))
        out.extend((r["$seq"], r["data"]) for r in map(msgspec.json.decode, res.records))
        cursor = res.next_from_seq
        if res.caught_up:
            return out


async def tombstones(engine: Engine, name: str) -> list[tuple[int, int, str]]:
    out = []
    cursor = 0
    while True:
        _, res = await engine.diff(name, DiffIn(from_seq=cursor, limit=1000))
        if res.tombstone is not None:
            t = res.tombstone
            out.append((t.gap_from, t.gap_to, t.reason))
        cursor = res.next_from_seq
        if res.caught_up and res.tombstone is None:
            return out


def process_image(disk: FakeDisk):
    """The disk as a killed process leaves it (the page cache survives)."""
    disk.sync_all()
    return disk.snapshot()


async def setup(engine: Engine, src_cls: str, dst_cls: str) -> None:
    await engine.put_topic("s", TopicConfigIn(durability=src_cls))
    await engine.put_topic("d", TopicConfigIn(durability=dst_cls))
    await write(engine, "d", "pre")  # dest_base 1
    await engine.routers.put("s->d", RouterIn(source="s", dest="d"))


CLASSES = ["memory", "disk", "fsync"]


@pytest.mark.parametrize("src_cls", CLASSES)
@pytest.mark.parametrize("dst_cls", CLASSES)
async def test_a_crash_keeps_every_copy_at_its_seq_with_direct_writes_between(src_cls, dst_cls):
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await setup(engine, src_cls, dst_cls)
        await write(engine, "s", "c1", "c2")
        await dump(engine, "d")  # catch-up: c1 c2 at 2 3
        await write(engine, "d", "x1")  # 4
        await write(engine, "s", "c3")
        await dump(engine, "d")  # c3 at 5
        await write(engine, "d", "x2", "x3")  # 6 7
        await write(engine, "s", "c4", "c5")  # not forwarded before the crash
        before = await dump(engine, "d")
        image = process_image(disk)
    disk.restore(image)
    async with open_durable(disk) as engine:
        after = await dump(engine, "d")
        assert after == before
        assert [d for _, d in after] == ["pre", "c1", "c2", "x1", "c3", "x2", "x3", "c4", "c5"]
        r = engine.routers.get("s->d")
        assert r.cursor == engine.get("s").head_seq
        await write(engine, "s", "c6")
        more = await dump(engine, "d")
        assert more[:-1] == after
        assert more[-1][1] == "c6"
        image = process_image(disk)
    disk.restore(image)  # a second crash: the re-anchored cursor places c6 again
    async with open_durable(disk) as engine:
        assert await dump(engine, "d") == more


async def test_copies_before_a_snapshot_and_after_it_both_come_back():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await setup(engine, "disk", "disk")
        await write(engine, "s", "a", "b")
        await write(engine, "d", "x")
        await dump(engine, "d")
        ckpt = engine.checkpointer
        assert isinstance(ckpt, Checkpointer)
        assert await ckpt.checkpoint()
        await write(engine, "s", "c")
        await write(engine, "d", "y")
        await write(engine, "s", "e")
        before = await dump(engine, "d")
        image = process_image(disk)
    disk.restore(image)
    async with open_durable(disk) as engine:
        assert await dump(engine, "d") == before
        assert engine.routers.get("s->d").d.source == "s"


async def test_a_clean_restart_keeps_definitions_cursors_and_totals():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await setup(engine, "disk", "disk")
        await engine.routers.put(
            "s->d", RouterIn(source="s", dest="d", preserve_tag=False, filter="eu:*")
        )
        await write(engine, "s", "a", tag="eu:1")
        await write(engine, "s", "b", tag="us")
        before = await dump(engine, "d")
        total = engine.routers.get("s->d").forwarded_total
    async with open_durable(disk) as engine:
        r = engine.routers.get("s->d")
        assert (r.d.preserve_tag, r.d.filter) == (False, ("Glob", "eu:"))
        assert r.forwarded_total == total == 2
        assert await dump(engine, "d") == before == [(1, "pre"), (2, "a")]


async def test_deleted_routers_stay_deleted_and_their_copies_stay():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await setup(engine, "disk", "disk")
        await write(engine, "s", "a")
        await dump(engine, "d")
        assert await engine.routers.delete("s->d")
        await write(engine, "s", "b")
        await write(engine, "d", "x")
        before = await dump(engine, "d")
        image = process_image(disk)
    disk.restore(image)
    async with open_durable(disk) as engine:
        assert "s->d" not in engine.routers.routers
        assert await dump(engine, "d") == before == [(1, "pre"), (2, "a"), (3, "x")]


async def test_a_chain_is_rederived_in_order():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await engine.routers.put("a->b", RouterIn(source="a", dest="b"))
        await engine.routers.put("b->c", RouterIn(source="b", dest="c"))
        await write(engine, "a", "1", "2")
        await write(engine, "c", "direct")
        await write(engine, "a", "3")
        before = {t: await dump(engine, t) for t in "bc"}
        image = process_image(disk)
    disk.restore(image)
    async with open_durable(disk) as engine:
        assert {t: await dump(engine, t) for t in "bc"} == before


async def test_an_ephemeral_end_gets_no_copies_back():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await setup(engine, "disk", "ephemeral")
        await write(engine, "s", "a")
        assert [d for _, d in await dump(engine, "d")] == ["pre", "a"]
        await engine.put_topic("s2", TopicConfigIn(durability="ephemeral"))
        await engine.routers.put("s2->d2", RouterIn(source="s2", dest="d2"))
        await write(engine, "s2", "b")
        assert [d for _, d in await dump(engine, "d2")] == ["b"]
        image = process_image(disk)
    disk.restore(image)
    async with open_durable(disk) as engine:
        assert await dump(engine, "d") == []  # ephemeral records are RAM-only
        assert await dump(engine, "d2") == []  # the source record was never persisted
        await write(engine, "s2", "c")
        assert [d for _, d in await dump(engine, "d2")] == ["c"]  # forwarding resumes


async def test_a_copy_whose_source_was_evicted_before_the_restart_is_source_trim():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await engine.put_topic("s", TopicConfigIn(cap_records=1))
        await engine.routers.put("s->d", RouterIn(source="s", dest="d"))
        await write(engine, "s", "a")
        assert await dump(engine, "d") == [(1, "a")]
        await write(engine, "s", "b")  # evicts a at the source
        assert await dump(engine, "d") == [(1, "a"), (2, "b")]  # the copy stays readable
        image = process_image(disk)
    disk.restore(image)
    async with open_durable(disk) as engine:
        assert await dump(engine, "d") == [(2, "b")]
        assert await tombstones(engine, "d") == [(1, 1, "source_trim")]


async def test_two_routers_of_one_source_come_back_in_lockstep_with_direct_writes():
    disk = FakeDisk()
    async with open_durable(disk) as engine:
        await setup(engine, "disk", "disk")  # s->d at dest_base 1
        await write(engine, "s", "a1")
        await dump(engine, "d")
        await write(engine, "s", "a2", "a3")  # not forwarded yet: s->d lags
        await engine.routers.put("r2", RouterIn(source="s", dest="d", preserve_tag=False))
        await write(engine, "d", "x1")
        await write(engine, "s", "b1")
        await dump(engine, "d")
        await write(engine, "d", "x2")
        await write(engine, "s", "b2")
        assert await engine.routers.delete("r2")
        await write(engine, "s", "c1")
        before = await dump(engine, "d")
        image = process_image(disk)
    datas = [d for _, d in before]
    assert sorted(datas) == sorted(
        ["pre", "a1", "a2", "a3", "x1", "b1", "b1", "x2", "b2", "b2", "c1"]
    )
    assert [d for d in datas if d[0] in "abc"] == ["a1", "a2", "a3", "b1", "b1", "b2", "b2", "c1"]
    disk.restore(image)
    async with open_durable(disk) as engine:
        assert await dump(engine, "d") == before
        assert sorted(engine.routers.routers) == ["s->d"]
        await write(engine, "s", "e1")
        more = await dump(engine, "d")
        assert more[:-1] == before, (more, before)
        assert more[-1][1] == "e1"
        image = process_image(disk)
    disk.restore(image)
    async with open_durable(disk) as engine:
        assert await dump(engine, "d") == more


async def test_the_sweep_survives_a_storage_failure_and_logs_the_cursor_later(autojump_clock):
    """A cursor anchor that cannot be logged (the shard's breaker is open) is retried at
    a later sweep; the sweep task itself must not die (it would take the engine down)."""
    import errno

    import trio

    from topicd.testing.fake_fs import FaultFs
    from topicd.testing.harness import durable_config

    fs = FaultFs(FakeDisk())
    cfg = durable_config(shards=1)
    async with open_durable(fs, cfg) as engine:
        await setup(engine, "disk", "disk")
        await write(engine, "s", "c1", "c2")
        await dump(engine, "d")  # forwarded: the cursor moved, not logged yet
        r = engine.routers.routers["s->d"]
        assert r.logged != r.cursor
        fs.fail("fdatasync", always=True, errno=errno.EIO)
        await write(engine, "s", "c3")  # acknowledged before its sync, which fails
        await trio.sleep(1)
        assert engine.commit.status()["breakers"] == {"0": "open"}
        await trio.sleep(10 * cfg.routers.cursor_log_ms / 1000)  # several sweeps fail
        assert r.logged != r.cursor
        fs.clear()
        await trio.sleep(cfg.breaker.open_ms / 1000 * 4 + 10 * cfg.routers.cursor_log_ms / 1000)
        await write(engine, "s", "c4")  # storage works again
        await dump(engine, "d")
        await trio.sleep(2 * cfg.routers.cursor_log_ms / 1000)
        assert r.logged == r.cursor
