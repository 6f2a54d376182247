"""Recovery through the real command: `topicd verify`, refusals (exit 4), truncation, and
commands that must leave a data directory exactly as they found it.

Method: run `python -m topicd serve` as a subprocess on a temporary data directory, write
through HTTP, stop it with SIGKILL (so the WAL, not a final snapshot, carries the data),
damage a WAL file in the middle, then check that `verify` and `serve` refuse with exit 4,
name the file and offset, and leave every byte of the directory unchanged; and that
`--recovery-on-corruption=truncate` serves the valid prefix. A byte damaged in a sealed
segment (4-record segments, absorbed by the drain checkpoint of a clean stop): the next
start serves, the read of a damaged record answers `500 internal` and counts
`topicd_segment_corruption_total`, and `verify` (which reads every sealed byte) exits 4
naming the file and offset. Readiness is awaited by
reading the child's log for `listening on`, never by sleeping.

"Unchanged" is `tree_state` before and after: every entry's name, kind, mode and mtime,
every file's size and contents, so a file created (even if removed again) shows. It is
checked for `verify` on a healthy and on a corrupt directory, for refused starts (a
foreign directory, exit 4; a directory locked by another process, or by an earlier
version's `.topicd.lock`, exit 5) and for a start whose port is taken (exit 1). The lock
holder in the exit-5 cases is this test process, taking the same `flock` topicd takes, so
nothing else can write to the directory meanwhile.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import tree_state
from topicd.storage import frame as frames
from topicd.storage import segments as segs

pytestmark = pytest.mark.slow


def start(data: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    port_file = data.parent / "port"
    port_file.unlink(missing_ok=True)
    env = dict(os.environ, TOPICD_PORT_FILE=str(port_file), TOPICD_STORAGE_WAL_FILE_BYTES="65536")
    proc = subprocess.Popen(
        [sys.executable, "-m", "topicd", "serve", "--port", "0", "--data-dir", str(data), *extra],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "listening on" in line:
            return proc, f"http://127.0.0.1:{port_file.read_text().strip()}"
    proc.wait(timeout=10)
    raise AssertionError("server did not start:\n" + "".join(lines))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "topicd", *args], capture_output=True, text=True, timeout=60
    )


def fill(base: str) -> None:
    with httpx.Client(base_url=base) as c:
        c.put("/v0/topics/t", json={"durability": "fsync"}).raise_for_status()
        for i in range(30):
            c.post("/v0/topics/t", json={"records": [{"data": i}]}).raise_for_status()


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    if proc.stderr is not None:
        proc.stderr.close()


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    """A data directory with one topic of 30 records, cleanly stopped (shared: the tests
    using it prove they change nothing)."""
    data = tmp_path_factory.mktemp("healthy") / "data"
    proc, base = start(data)
    try:
        fill(base)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        if proc.stderr is not None:
            proc.stderr.close()
    return data


def serve_once(data: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`topicd serve` expected to exit on its own (a refusal)."""
    return run("serve", "--port", "0", "--data-dir", str(data), *extra)


def held(path: Path) -> int:
    """An fd holding the exclusive `flock` topicd takes on `path` (close it to release)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_verify_a_healthy_directory_changes_nothing(healthy):
    before = tree_state(healthy)
    res = run("verify", "--data-dir", str(healthy))
    assert res.returncode == 0, res.stderr
    assert "1 topics, 30 live records" in res.stdout
    assert re.search(r"WAL frames \((\d+) bytes\) replayed", res.stdout)  # not file sizes
    assert tree_state(healthy) == before
    assert not (healthy / ".topicd.lock").exists()


def test_a_start_that_cannot_bind_changes_nothing(healthy):
    before = tree_state(healthy)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run("serve", "--port", str(port), "--data-dir", str(healthy))
    assert res.returncode == 1, res.stderr
    assert f"topicd: cannot bind 127.0.0.1:{port}: address already in use\n" in res.stderr
    assert tree_state(healthy) == before


def test_a_locked_directory_is_refused_and_unchanged(healthy):
    before = tree_state(healthy)
    fd = held(healthy)
    try:
        serve, verify = serve_once(healthy), run("verify", "--data-dir", str(healthy))
    finally:
        os.close(fd)
    assert serve.returncode == 5, serve.stderr
    assert f"data directory {healthy} is locked by another topicd process" in serve.stderr
    assert verify.returncode == 5, verify.stderr
    assert "locked" in verify.stderr
    assert tree_state(healthy) == before


def test_an_earlier_versions_lock_file_is_respected_and_kept(healthy):
    """Earlier versions locked `<data_dir>/.topicd.lock`: held, it refuses the start
    (exit 5); left behind, it neither blocks a start nor is touched."""
    legacy = healthy / ".topicd.lock"
    legacy.write_text("12345\n")
    try:
        before = tree_state(healthy)
        fd = held(legacy)
        try:
            refused = serve_once(healthy)
        finally:
            os.close(fd)
        assert refused.returncode == 5, refused.stderr
        assert "locked by another topicd process" in refused.stderr
        assert tree_state(healthy) == before
        res = run("verify", "--data-dir", str(healthy))
        assert res.returncode == 0, res.stderr
        assert tree_state(healthy) == before
        assert legacy.read_text() == "12345\n"
    finally:
        legacy.unlink()


def test_mid_log_corruption_is_refused_and_truncate_recovers(tmp_path):
    data = tmp_path / "data"
    proc, base = start(data)
    try:
        fill(base)
    finally:
        kill(proc)
    wal = sorted((data / "wal").rglob("wal-*.log"), key=lambda p: p.stat().st_size)
    victim = next(p for p in wal if len(p.read_bytes().rstrip(b"\0")) > 1000)
    raw = bytearray(victim.read_bytes())
    offsets = []
    pos = frames.FILE_HEADER_LEN
    while (f := frames.read_frame(bytes(raw), pos, len(raw), 1 << 24)) is not None:
        offsets.append(f.offset)
        pos = f.end
    bad = offsets[len(offsets) // 2]
    raw[bad + 44] ^= 0x5A
    victim.write_bytes(bytes(raw))
    before = tree_state(data)

    res = run("verify", "--data-dir", str(data))
    assert res.returncode == 4, res.stderr
    assert f"offset {bad}" in res.stderr
    assert victim.name in res.stderr
    assert tree_state(data) == before  # verify is read-only
    conf = tmp_path / "truncate.toml"
    conf.write_text('[storage.recovery]\non_corruption = "truncate"\n')
    res = run("verify", "--data-dir", str(data), "--config", str(conf))
    assert res.returncode == 4 and "Discarding" not in res.stderr  # verify never truncates
    assert tree_state(data) == before

    proc = serve_once(data)
    assert proc.returncode == 4
    assert "recovery refused" in proc.stderr
    assert "mid-log corruption" in proc.stderr
    assert "--recovery-on-corruption=truncate" in proc.stderr
    assert tree_state(data) == before  # nothing was modified

    proc2, base = start(data, "--recovery-on-corruption", "truncate")
    try:
        with httpx.Client(base_url=base) as c:
            body = c.post("/v0/topics/t/diff", json={"limit": 1000}).json()
            assert 0 < len(body["records"]) < 30
            assert c.post("/v0/topics/t", json={"records": [{"data": "next"}]}).status_code == 200
    finally:
        kill(proc2)


def test_a_damaged_sealed_segment_starts_fails_its_read_and_verify_refuses(tmp_path):
    data = tmp_path / "data"
    conf = tmp_path / "segments.toml"
    conf.write_text("[storage.segments]\nmax_events = 4\ninline_max_bytes = 0\n")
    proc, base = start(data, "--config", str(conf))
    try:
        with httpx.Client(base_url=base) as c:
            c.put("/v0/topics/t", json={"durability": "fsync"}).raise_for_status()
            for i in range(12):
                c.post("/v0/topics/t", json={"records": [{"data": i}]}).raise_for_status()
    finally:
        proc.send_signal(signal.SIGTERM)  # the drain checkpoint absorbs and seals
        assert proc.wait(timeout=20) == 0
        if proc.stderr is not None:
            proc.stderr.close()
    (victim,) = data.glob("topics/*/seg-00000000000000000001.data")
    raw = bytearray(victim.read_bytes())
    first = segs.read_seg_frame(bytes(raw), 0, len(raw))
    assert first is not None and first.seq == 1
    raw[first.end // 2] ^= 0x5A  # inside the first frame (records 1..)
    victim.write_bytes(bytes(raw))

    # a start reads no sealed data: it serves; the read of a damaged record is a 500,
    # counted, and the records of the other segments still read
    proc, base = start(data, "--config", str(conf))
    try:
        with httpx.Client(base_url=base) as c:
            r = c.post("/v0/topics/t/diff", json={"from_seq": 0})
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "internal"
            assert "topicd_segment_corruption_total 1.0" in c.get("/v0/metrics").text
            r = c.post("/v0/topics/t/diff", json={"from_seq": 8})
            assert r.status_code == 200, r.text
            assert [x["data"] for x in r.json()["records"]] == [8, 9, 10, 11]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        if proc.stderr is not None:
            proc.stderr.close()

    # the offline check reads every sealed byte: it refuses, naming file and offset
    before = tree_state(data)
    res = run("verify", "--data-dir", str(data), "--config", str(conf))
    assert res.returncode == 4, res.stderr
    assert f"{victim.name} offset 0" in res.stderr, res.stderr
    assert tree_state(data) == before


def test_a_foreign_directory_is_refused_and_unchanged(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "precious.txt").write_text("not topicd")
    before = tree_state(data)
    proc = serve_once(data)
    assert proc.returncode == 4, proc.stderr
    assert "no FORMAT file" in proc.stderr
    assert tree_state(data) == before
    res = run("verify", "--data-dir", str(data))
    assert res.returncode == 4, res.stderr
    assert "no FORMAT file" in res.stderr
    assert tree_state(data) == before


def test_verify_of_a_missing_directory_creates_nothing(tmp_path):
    res = run("verify", "--data-dir", str(tmp_path / "absent" / "data"))
    assert res.returncode == 2, res.stderr
    assert (
        res.stderr
        == f"topicd: verify: data directory {tmp_path / 'absent' / 'data'} does not exist\n"
    )
    assert list(tmp_path.iterdir()) == []
