"""Tidy checks (STYLE §6): grep the package for calls that break topicd's seams.

Method: a plain text scan of `topicd/**/*.py`. Each rule names the pattern, where it is
allowed and why: wall/monotonic time only through `topicd/clock.py` (MockClock must drive
every timer), no unbounded channels, no stray prints, and file I/O only in the storage
seam (never on the event loop from engine, HTTP or scheduler code).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "topicd"

RULES = [
    (r"\btime\.(time|monotonic|sleep|time_ns|perf_counter)\(", {"clock.py"}, "time seam"),
    (r"\bdatetime\.now\(", {"clock.py"}, "time seam"),
    (r"math\.inf|float\(['\"]inf", set(), "unbounded buffers"),
    (r"open_memory_channel\(\s*(math\.)?inf", set(), "unbounded channel"),
    (r"^\s*print\(", {"cli.py"}, "use logging"),
    (r"\bos\.(fsync|fdatasync|pwrite|pread|read|write)\(", {"storage/"}, "fs seam"),
]

NO_FILE_IO_DIRS = ("engine/", "http/", "sched/")


def _files():
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text("utf-8")


@pytest.mark.parametrize(("pattern", "allowed", "why"), RULES)
def test_banned_calls(pattern, allowed, why):
    rx = re.compile(pattern, re.MULTILINE)
    offenders = []
    for rel, text in _files():
        if any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in allowed):
            continue
        for m in rx.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            offenders.append(f"{rel}:{line}")
    assert not offenders, f"{why}: {offenders}"


def test_no_file_io_in_engine_http_or_scheduler():
    rx = re.compile(r"(?<![\w.])open\(|\.read_text\(|\.write_text\(|\.read_bytes\(")
    offenders = [
        rel for rel, text in _files() if rel.startswith(NO_FILE_IO_DIRS) and rx.search(text)
    ]
    assert not offenders, offenders


def test_engine_never_imports_quart():
    offenders = [
        rel
        for rel, text in _files()
        if not rel.startswith(("http/", "testing/"))
        and re.search(r"^\s*(from|import) quart", text, re.M)
    ]
    assert not offenders, offenders
