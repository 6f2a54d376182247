"""Minimal reproductions of bugs the `kill -9` tests found (storage spec §2, §6, §10).

Method: each test drives a real `topicd serve` child (see `tests/crash/harness.py`) to the
crash point of one bug and asserts the behaviour the spec requires. The crash point is
reached deterministically: either by killing the child the moment its stderr shows the
line that opens the faulty window (a window of hundreds of fsyncs, so the kill always lands
inside it), or, where the window is a few milliseconds wide, by creating the exact
directory entries that a real `SIGKILL` left behind there (observed with a kill sweep; the
test says which). A reboot is simulated the way topicd sees one: the data directory's
`BOOT_ID` no longer matches the kernel's boot id.

Each test failed before its bug was fixed and guards against its return.
"""

from __future__ import annotations

import pytest
import trio

from tests.crash.harness import JSON, client, dump_all, serving

pytestmark = pytest.mark.slow

TOPICS = 100


async def test_kill9_during_first_start_leaves_a_servable_directory(tmp_path):
    # A fresh data directory after a real SIGKILL 15 ms after the child logged "bound to
    # ...; recovering" (storage/recovery.py prepare_data_dir: mkdir wal/ + fsync, then
    # FORMAT.tmp written, synced, renamed): exactly these entries, FORMAT not yet renamed.
    # Nothing was ever acknowledged from it; spec §2: an empty data_dir is a fresh start.
    data = tmp_path / "data"
    (data / "wal").mkdir(parents=True)
    (data / ".topicd.lock").touch()
    (data / "FORMAT.tmp").write_bytes(b'{"storage_format":1,"checksum":"xxh3_64"}\n')
    with trio.fail_after(60):
        async with serving(tmp_path) as server, client(server) as c:  # was: exit 4
            r = await c.post("/v0/topics/t", json={"records": [{"data": 1}]})
            assert r.status_code == 201, r.text


@pytest.mark.parametrize("size", [0, 1 << 20])
async def test_kill9_while_creating_a_shards_first_wal_file(tmp_path, size):
    # wal.py _create_file: open(O_EXCL) -> fallocate -> header pwrite -> fdatasync. A
    # SIGKILL after the open (size 0) or the fallocate (zeros) leaves a file with no
    # header. It is the shard's only file at the first start and after every re-shard
    # (retire_wal removed the old ones), and nothing was ever written to it.
    with trio.fail_after(60):
        async with serving(tmp_path, env={"TOPICD_WAL_SHARDS": "1"}) as server:
            await server.kill()  # a clean first start: FORMAT, BOOT_ID, shard-00/wal-0
            shard = server.data_dir / "wal" / "shard-00"
            for f in shard.iterdir():
                f.unlink()
            (shard / "wal-0000000000000000.log").write_bytes(bytes(size))
            await server.start()  # was: exit 4, "file header checksum mismatch"
            async with client(server) as c:
                r = await c.post("/v0/topics/t", json={"records": [{"data": 1}]})
                assert r.status_code == 201, r.text


async def test_lost_ranges_survive_a_kill_while_they_are_logged(tmp_path):
    names = [f"d{i}" for i in range(TOPICS)]
    with trio.fail_after(120):
        async with serving(tmp_path) as server:
            # disk topics with one record each: each reserves 65536 seqs above its head
            async def fill(k: int) -> None:
                async with client(server) as c:
                    for name in names[k::4]:
                        r = await c.post(f"/v0/topics/{name}", json={"records": [{"data": 1}]})
                        assert r.status_code == 201, r.text

            async with trio.open_nursery() as nursery:
                for k in range(4):
                    nursery.start_soon(fill, k)
            await server.kill()
            # the machine "rebooted": recovery must now record 2..65537 of every topic as
            # a lost range (the unsynced tail may be gone) and announce it to readers
            (server.data_dir / "BOOT_ID").write_text("00000000-0000-4000-8000-000000000000\n")
            run = await server.spawn()
            # recovery logs every range, then writes one sync-gated LostRange per topic
            # (hundreds of fsyncs); BOOT_ID already holds this boot's id by then
            assert await run.wait_line("may have been lost"), server.log_tail()
            await server.kill()
            await server.start()  # same boot id: a plain process crash, as far as it knows
            dumps = await dump_all(server, names)
    silent = [
        n for n, d in dumps.items() if d is None or not any(t[2] == "crash" for t in d.tombstones)
    ]
    assert not silent, (
        f"{len(silent)}/{TOPICS} topics lost their crash tombstone (e.g. {silent[:3]}): "
        "seqs 2..65537 may hold acknowledged records lost at the machine crash, and readers "
        "now skip them silently"
    )


async def test_lost_ranges_after_a_reboot_are_announced(tmp_path):
    """Control for the test above: without the kill, every topic keeps its tombstone."""
    names = [f"d{i}" for i in range(20)]
    with trio.fail_after(60):
        async with serving(tmp_path) as server:
            async with client(server) as c:
                for name in names:
                    r = await c.post(
                        f"/v0/topics/{name}", content=b'{"records":[{"data":1}]}', headers=JSON
                    )
                    assert r.status_code == 201, r.text
            await server.kill()
            (server.data_dir / "BOOT_ID").write_text("00000000-0000-4000-8000-000000000000\n")
            await server.start()
            await server.restart()  # a process crash after the lost ranges were logged
            dumps = await dump_all(server, names)
    for name, d in dumps.items():
        assert d is not None
        assert [t for t in d.tombstones if t[2] == "crash"] == [(2, 65537, "crash")], name


async def test_kill9_during_wal_trim_leaves_a_servable_directory(tmp_path):
    no_checkpoints = {
        "TOPICD_WAL_SHARDS": "1",
        "TOPICD_STORAGE_SNAPSHOT_INTERVAL_MS": "3600000",
        "TOPICD_STORAGE_SNAPSHOT_WAL_BYTES_THRESHOLD": str(1 << 30),
    }
    with trio.fail_after(120):
        async with serving(tmp_path, env=no_checkpoints) as server:
            async with client(server) as c:  # ~4.5 MiB: WAL files 0..4 of 1 MiB
                for _ in range(45):
                    body = {"records": [{"data": "x" * 2000}] * 50}
                    r = await c.post("/v0/topics/t", json=body)
                    assert r.status_code in (200, 201), r.text
            before = await dump_all(server, ["t"])
            await server.kill()
            # one checkpoint: a snapshot at the last file; files 0..3 await trimming
            server.extra_env = {**no_checkpoints, "TOPICD_STORAGE_SNAPSHOT_INTERVAL_MS": "100"}
            await server.start()
            async with client(server) as c:
                r = await c.post("/v0/topics/u", json={"records": [{"data": 1}]})
                assert r.status_code == 201, r.text
            assert await server.run.wait_line("topicd.checkpoint: checkpoint"), server.log_tail()
            await server.kill()
            # The next checkpoint's trim_wal unlinks files 0..3 in os.listdir order, which
            # on ext4 here lists wal-...01 first. SIGKILL after that first unlink leaves:
            shard = server.data_dir / "wal" / "shard-00"
            (shard / "wal-0000000000000001.log").unlink()
            await server.start()  # must serve: the snapshot no longer needs files 0..3
            after = await dump_all(server, ["t"])
    # the kills moved the head above the seq reservation (legal); nothing else changed
    a, b = after["t"], before["t"]
    assert a is not None
    assert b is not None
    assert (a.records, a.tombstones) == (b.records, b.tombstones)
    assert {k: a.state[k] for k in ("earliest_seq", "count", "bytes")} == {
        k: b.state[k] for k in ("earliest_seq", "count", "bytes")
    }


async def test_ephemeral_retry_after_a_crash_is_not_deduped_to_nothing(tmp_path):
    # storage spec §8: "for classes that can lose records the window is as durable as the
    # records it points to". Without a checkpoint the retry appends (the WAL holds no
    # ephemeral Append frames); with one in between it answers deduped:true, seqs [1].
    body = {"records": [{"data": 1}], "idempotency_key": "k"}
    with trio.fail_after(60):
        async with serving(tmp_path) as server:
            async with client(server) as c:
                r = await c.put("/v0/topics/e", json={"durability": "ephemeral"})
                assert r.status_code == 201, r.text
                r = await c.post("/v0/topics/e", json=body)
                assert r.json()["seqs"] == [1]
            # the checkpoint of the next second (1 s interval) snapshots the entry
            assert await server.run.wait_line("topicd.checkpoint: checkpoint"), server.log_tail()
            await server.restart()
            async with client(server) as c:
                records = (await c.post("/v0/topics/e/diff", json={})).json()["records"]
                assert records == []  # ephemeral: gone by design
                r = await c.post("/v0/topics/e", json=body)
    assert r.status_code == 200, r.text
    assert not r.json()["deduped"], f"deduped to seqs {r.json()['seqs']} that hold nothing"
