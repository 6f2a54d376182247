"""Limits agree end to end: nothing the server accepts is unreadable after a restart.

Method: for each pair of limits where one bounds what the server acknowledges and the other
what recovery reads back, a test sits at the boundary — the largest input the first limit
lets through, with the second at the smallest value the configuration check accepts —
and proves the write survives a crash and restart (engine on `FakeDisk`, inline recovery),
or that the configuration check refuses the pair (exit 2 from `check-config`). Pairs:

- one record (`protocol.max_record_bytes`, with the largest node, tag, meta, priority and
  idempotency key) vs one WAL frame (`storage.wal.max_frame_bytes`);
- a whole write (`limits.max_body_bytes`, `protocol.max_batch_records`) vs one WAL frame:
  split across frames (also `tests/crash/test_large_writes.py`, real process, 15-63 MiB);
- a write vs the WAL ingest byte bounds (`storage.wal.max_pending_bytes_*`): admitted alone
  (`tests/storage/test_wal.py`);
- one record vs a snapshot piece (the largest record through a checkpoint and a restart
  from the snapshot);
- idempotency entries (`limits.max_idempotency_entries`) vs the snapshot and the replay.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import msgspec
import pytest

from topicd.config import ConfigError, load_config, record_frame_bound
from topicd.errors import Throttled
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import DiffIn, RecordIn, TopicConfigIn, WriteIn

MAX_RECORD = 1 << 16  # small enough that the matching frame limit is allowed (>= 64 KiB)


def _limits(max_frame: int, max_record: int = MAX_RECORD, **limits: int):
    cfg = durable_config(shards=1, wal={"max_frame_bytes": max_frame})
    return dataclasses.replace(
        cfg,
        protocol=dataclasses.replace(cfg.protocol, max_record_bytes=max_record),
        limits=dataclasses.replace(cfg.limits, **limits),
    )


def _worst_record(cfg) -> tuple[RecordIn, str]:
    """The largest record the protocol limits accept, with every optional part at its
    limit and escaped as long as JSON allows; and the longest idempotency key."""
    p = cfg.protocol
    meta = b'{"m":"' + b"m" * (p.max_meta_bytes - 8) + b'"}'
    data = b'"' + b"d" * (p.max_record_bytes - len(meta) - 2) + b'"'
    assert len(meta) + len(data) == p.max_record_bytes
    node = "\x01" * p.max_node_bytes  # JSON-escaped to \u0001: six bytes each
    tag = "t" * p.max_tag_bytes
    rec = RecordIn(
        data=msgspec.Raw(data), meta=msgspec.Raw(meta), tag=tag, node=node, priority=-(2**31)
    )
    return rec, "k" * p.max_idempotency_key_bytes


async def _read_all(engine, name: str) -> list[bytes]:
    _, res = await engine.diff(name, DiffIn(from_seq=0, limit=1000, max_batch_bytes=1 << 23))
    assert res.caught_up and res.tombstone is None
    return list(res.records)


@pytest.mark.parametrize("snapshot", [False, True], ids=["replay", "snapshot"])
async def test_the_largest_record_fits_the_smallest_accepted_frame_and_survives(snapshot):
    bound = record_frame_bound(_limits(1 << 20).protocol)
    cfg = _limits(bound)
    load_config(None, env={}, flags={})  # the defaults pass the check themselves
    rec, key = _worst_record(cfg)
    disk = FakeDisk()
    async with open_durable(disk, cfg) as engine:
        await engine.put_topic("t", TopicConfigIn(durability="fsync"))
        ack = await engine.append("t", WriteIn(records=[rec, rec], idempotency_key=key))
        assert ack.count == 2
        before = await _read_all(engine, "t")
        if not snapshot:
            disk.sync_all()
            disk.crash(power_off=True)  # no final snapshot: the restart replays the WAL
    if not snapshot:
        disk.reboot()
    else:
        assert disk.listdir("/data/meta"), "the clean stop wrote a snapshot"
    async with open_durable(disk, cfg) as engine:
        assert await _read_all(engine, "t") == before
        again = await engine.append("t", WriteIn(records=[rec, rec], idempotency_key=key))
        assert again.deduped and again.first_seq == ack.first_seq


def test_a_frame_limit_below_the_largest_record_is_refused(tmp_path):
    bound = record_frame_bound(_limits(1 << 20).protocol)
    conf = tmp_path / "t.toml"
    conf.write_text(
        f"[storage.wal]\nmax_frame_bytes = {bound - 1}\n"
        f"[protocol]\nmax_record_bytes = {MAX_RECORD}\n"
    )
    with pytest.raises(ConfigError, match=r"storage\.wal\.max_frame_bytes.*max_record_bytes"):
        load_config(conf, env={}, flags={})
    conf.write_text(conf.read_text().replace(str(bound - 1), str(bound)))
    load_config(conf, env={}, flags={})  # exactly the bound is accepted
    out = _check_config(conf)
    assert out.returncode == 0, out.stderr
    conf.write_text(conf.read_text().replace(f"= {bound}\n", f"= {bound - 1}\n", 1))
    out = _check_config(conf)
    assert out.returncode == 2 and "storage.wal.max_frame_bytes" in out.stderr


def _check_config(conf) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "topicd", "check-config", "--config", str(conf)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        cwd=conf.parent,
        check=False,
    )


@pytest.mark.parametrize("snapshot", [False, True], ids=["replay", "snapshot"])
async def test_idempotency_entries_at_the_limit_all_survive_a_restart(snapshot):
    n = 50
    cfg = _limits(1 << 20, max_idempotency_entries=n)
    disk = FakeDisk()
    async with open_durable(disk, cfg) as engine:
        await engine.put_topic("t", TopicConfigIn(durability="fsync"))
        acks = [
            await engine.append(
                "t",
                WriteIn(records=[RecordIn(data=msgspec.Raw(b"%d" % i))], idempotency_key=f"k{i}"),
            )
            for i in range(n)
        ]
        with pytest.raises(Throttled):  # the store is full
            await engine.append(
                "t", WriteIn(records=[RecordIn(data=msgspec.Raw(b"0"))], idempotency_key="extra")
            )
        if not snapshot:
            disk.sync_all()
            disk.crash(power_off=True)
    if not snapshot:
        disk.reboot()
    async with open_durable(disk, cfg) as engine:
        for i, ack in enumerate(acks):
            again = await engine.append(
                "t",
                WriteIn(records=[RecordIn(data=msgspec.Raw(b"%d" % i))], idempotency_key=f"k{i}"),
            )
            assert again.deduped and again.first_seq == ack.first_seq
        with pytest.raises(Throttled):
            await engine.append(
                "t", WriteIn(records=[RecordIn(data=msgspec.Raw(b"0"))], idempotency_key="extra")
            )
    # a lower limit at the next start drops the surplus entries, never the records
    lower = _limits(1 << 20, max_idempotency_entries=n // 2)
    async with open_durable(disk, lower) as engine:
        records = await _read_all(engine, "t")
        assert len(records) == n
