"""Recovery through the real command: `topicd verify`, refusals (exit 4), truncation.

Method: run `python -m topicd serve` as a subprocess on a temporary data directory, write
through HTTP, stop it with SIGKILL (so the WAL, not a final snapshot, carries the data),
damage a WAL file in the middle, then check that `verify` and `serve` refuse with exit 4,
name the file and offset, and leave every byte of the directory unchanged; and that
`--recovery-on-corruption=truncate` serves the valid prefix. Readiness is awaited by
reading the child's log for `listening on`, never by sleeping.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from topicd.storage import frame as frames

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


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".topicd.lock"
    }


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


def test_verify_a_healthy_directory(tmp_path):
    data = tmp_path / "data"
    proc, base = start(data)
    try:
        fill(base)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        if proc.stderr is not None:
            proc.stderr.close()
    res = run("verify", "--data-dir", str(data))
    assert res.returncode == 0, res.stderr
    assert "1 topics, 30 live records" in res.stdout


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
    before = digest(data)

    res = run("verify", "--data-dir", str(data))
    assert res.returncode == 4, res.stderr
    assert f"offset {bad}" in res.stderr
    assert victim.name in res.stderr

    proc = subprocess.run(
        [sys.executable, "-m", "topicd", "serve", "--port", "0", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 4
    assert "recovery refused" in proc.stderr
    assert "mid-log corruption" in proc.stderr
    assert "--recovery-on-corruption=truncate" in proc.stderr
    assert digest(data) == before  # nothing was modified

    proc2, base = start(data, "--recovery-on-corruption", "truncate")
    try:
        with httpx.Client(base_url=base) as c:
            body = c.post("/v0/topics/t/diff", json={"limit": 1000}).json()
            assert 0 < len(body["records"]) < 30
            assert c.post("/v0/topics/t", json={"records": [{"data": "next"}]}).status_code == 200
    finally:
        kill(proc2)


def test_a_foreign_directory_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "precious.txt").write_text("not topicd")
    proc = subprocess.run(
        [sys.executable, "-m", "topicd", "serve", "--port", "0", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 4
    assert "no FORMAT file" in proc.stderr
    assert (data / "precious.txt").read_text() == "not topicd"
