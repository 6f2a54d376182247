"""A data directory written before segments existed opens and is migrated.

Method: `tests/fixtures/datadir-v2` (snapshot version 2 with the records inside, a WAL
tail after it, no `topics/`) is copied to `tmp_path` and opened on the real filesystem.
Everything it held must read back; the first checkpoint moves the records into segments
(the new snapshot carries no payloads), and a restart from the migrated directory reads
back the same. With the default `storage.segments.inline_max_bytes` the fixture's
topics, a few records each, stay inline instead: the snapshot keeps carrying their
records, and no segment file is made.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.storage.test_checkpoint import cp, state, write
from topicd.storage import snapshot
from topicd.storage.fs import RealFs
from topicd.testing.harness import durable_config, open_durable

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "datadir-v2"


@pytest.mark.parametrize("inline", [0, 2048])
async def test_a_version_2_directory_opens_and_migrates_at_the_first_checkpoint(tmp_path, inline):
    root = tmp_path / "data"
    shutil.copytree(FIXTURE, root)
    cfg = durable_config(str(root), wal={"file_bytes": 4096}, segments={"inline_max_bytes": inline})
    fs = RealFs()
    async with open_durable(fs, cfg, boot_id="fixture-boot") as engine:
        got = await state(engine)
        records = {name: [bytes(r) for r in v[0]] for name, v in got.items()}  # type: ignore[index]
        assert len(records["capped"]) == 5
        assert len(records["plain"]) == 3  # 2, 3 and the tail's "after"
        assert [r.split(b'"data":')[1] for r in records["durable"]] == [b'"c"}', b'"d"}']
        assert records["eph"] == []
        assert not (root / "topics").exists()
        assert await cp(engine).checkpoint()
        assert (root / "topics").is_dir() == (not inline)
        body = snapshot.decode(fs.read(snapshot.list_snapshots(fs, str(root))[0][1]))
        assert body.version == 3
        for topic in body.topics:
            carried = sum(r.blob_len for r in topic.runs)
            assert bool(carried) == (bool(inline) and topic.name != "eph"), topic.name
            assert bool(topic.segments) == (not inline and topic.name != "eph"), topic.name
        again = await write(engine, "keyed", b"1", idempotency_key="k1")
        assert again.deduped
        expected = await state(engine)
    async with open_durable(fs, cfg, boot_id="fixture-boot") as engine:
        assert await state(engine) == expected
