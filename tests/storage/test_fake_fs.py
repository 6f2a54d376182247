"""Tests of the filesystem doubles: `FakeDisk`, `FaultFs`, `MonitorFs`.

Method: three layers.

* Parity: the same non-crash scenarios (results and error types/errnos) run against
  `RealFs` on a temporary directory, `FakeDisk`, and both wrapped in `FaultFs` and
  `MonitorFs` with no rules, so the fake matches the OS where a crash is not involved. A
  Hypothesis test drives random call sequences against `RealFs` and `FakeDisk` side by
  side and compares every outcome and the final tree.
* Power loss (FakeDisk only): each durability rule of the module doc is checked with a
  scenario that syncs some things and not others, crashes, and compares the survivors
  (file bytes and length, directory entries for create/rename/unlink/mkdir, handles
  `EBADF` afterwards). Torn crashes are checked over many seeds: damage lies inside the
  last unsynced write only, earlier unsynced writes are gone, and a seed reproduces the
  same damage. `snapshot`/`restore`, `mutations` and `crash_after` are checked with a
  full crash-point sweep of a small "write temp, sync, rename, sync dir" operation.
* Wrappers: `FaultFs` rules (`nth`, `always`, predicates, errnos, short writes retried by
  `write_all`, stalls, `clear`) and `MonitorFs` ordering rules, live and recorded,
  including the case where an injected `fdatasync` failure leaves a file unsynced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topicd.storage.fs import RealFs, write_all
from topicd.testing.fake_fs import (
    Call,
    FakeDisk,
    FaultFs,
    MonitorFs,
    OrderingRule,
    OrderingViolation,
    PowerLoss,
)

j = posixpath.join


# --- parity: RealFs, FakeDisk, and the wrappers ------------------------------------------

FS_KINDS = ["real", "fake", "fault(fake)", "monitor(real)", "monitor(fault(fake))"]


@pytest.fixture(params=FS_KINDS)
def env(request, tmp_path):
    """(fs, base directory) with the base directory existing and empty."""
    kind = request.param
    if "real" in kind:
        inner, base = RealFs(), str(tmp_path)
    else:
        inner, base = FakeDisk(), "/data"
        inner.mkdir(base)
    fs = inner
    if "fault" in kind:
        fs = FaultFs(fs)
    if "monitor" in kind:
        fs = MonitorFs(fs)
    return fs, base


def _write_file(fs, path, data):
    fd = fs.open(path, create=True)
    try:
        write_all(fs, fd, data, 0)
    finally:
        fs.close(fd)


def test_create_write_read(env):
    fs, base = env
    p = j(base, "f")
    assert not fs.exists(p)
    fd = fs.open(p, create=True)
    assert fs.exists(p)
    assert fs.size(p) == 0
    assert fs.pwrite(fd, b"hello", 0) == 5
    assert fs.pwrite(fd, memoryview(b"XY"), 1) == 2
    assert fs.pread(fd, 10, 0) == b"hXYlo"
    assert fs.pread(fd, 2, 3) == b"lo"
    assert fs.pread(fd, 4, 5) == b""
    assert fs.pread(fd, 4, 100) == b""
    fs.fdatasync(fd)
    fs.close(fd)
    assert fs.read(p) == b"hXYlo"
    assert fs.size(p) == 5
    assert sorted(fs.listdir(base)) == ["f"]


def test_write_past_end_fills_zeros(env):
    fs, base = env
    fd = fs.open(j(base, "f"), create=True)
    assert fs.pwrite(fd, b"", 10) == 0
    assert fs.size(j(base, "f")) == 0  # an empty write does not extend
    fs.pwrite(fd, b"ab", 4)
    assert fs.read(j(base, "f")) == b"\0\0\0\0ab"
    fs.close(fd)


def test_open_errors(env):
    fs, base = env
    with pytest.raises(FileNotFoundError):
        fs.open(j(base, "missing"))
    with pytest.raises(FileNotFoundError):
        fs.open(j(base, "nodir", "f"), create=True)
    _write_file(fs, j(base, "f"), b"x")
    with pytest.raises(FileExistsError):
        fs.open(j(base, "f"), create=True, exclusive=True)
    fs.close(fs.open(j(base, "f"), create=True))  # create without exclusive reopens
    fs.close(fs.open(j(base, "f"), exclusive=True))  # as on Linux: ignored without create
    with pytest.raises(NotADirectoryError):
        fs.open(j(base, "f", "g"), create=True)
    with pytest.raises(NotADirectoryError):
        fs.open(j(base, "f") + "/")
    fs.mkdir(j(base, "d"))
    with pytest.raises(IsADirectoryError):
        fs.open(j(base, "d"))
    with pytest.raises(IsADirectoryError):
        fs.open(j(base, "d"), create=True)
    with pytest.raises(FileExistsError):
        fs.open(j(base, "d"), create=True, exclusive=True)
    with pytest.raises(FileNotFoundError):
        fs.open("")


def test_bad_handles(env):
    fs, base = env
    fd = fs.open(j(base, "f"), create=True)
    fs.close(fd)
    for call in (
        lambda: fs.pwrite(fd, b"x", 0),
        lambda: fs.pread(fd, 1, 0),
        lambda: fs.fdatasync(fd),
        lambda: fs.fallocate(fd, 10),
        lambda: fs.ftruncate(fd, 0),
        lambda: fs.close(fd),
    ):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.EBADF


def test_invalid_arguments(env):
    fs, base = env
    fd = fs.open(j(base, "f"), create=True)
    for call in (
        lambda: fs.pwrite(fd, b"x", -1),
        lambda: fs.pread(fd, 1, -1),
        lambda: fs.pread(fd, -1, 0),
        lambda: fs.ftruncate(fd, -1),
        lambda: fs.fallocate(fd, 0),
        lambda: fs.fallocate(fd, -5),
    ):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.EINVAL
    fs.close(fd)


def test_fallocate_and_ftruncate(env):
    fs, base = env
    p = j(base, "f")
    fd = fs.open(p, create=True)
    fs.pwrite(fd, b"abc", 0)
    fs.fallocate(fd, 8)
    assert fs.read(p) == b"abc" + bytes(5)
    fs.fallocate(fd, 2)  # never shrinks
    assert fs.size(p) == 8
    fs.pwrite(fd, b"Z", 4)  # inside the allocation: no growth
    assert fs.size(p) == 8
    fs.ftruncate(fd, 2)
    assert fs.read(p) == b"ab"
    fs.ftruncate(fd, 4)
    assert fs.read(p) == b"ab\0\0"
    fs.ftruncate(fd, 0)
    assert fs.size(p) == 0
    fs.close(fd)


def test_directories(env):
    fs, base = env
    fs.mkdir(j(base, "a", "b", "c"))  # parents too
    fs.mkdir(j(base, "a", "b"))  # exists: fine
    assert fs.exists(j(base, "a", "b", "c"))
    assert fs.listdir(j(base, "a")) == ["b"]
    assert fs.listdir(j(base, "a", "b", "c")) == []
    _write_file(fs, j(base, "a", "f"), b"1")
    assert sorted(fs.listdir(j(base, "a"))) == ["b", "f"]
    with pytest.raises(FileExistsError):
        fs.mkdir(j(base, "a", "f"))
    with pytest.raises(NotADirectoryError):
        fs.mkdir(j(base, "a", "f", "x"))
    with pytest.raises(NotADirectoryError):
        fs.listdir(j(base, "a", "f"))
    with pytest.raises(FileNotFoundError):
        fs.listdir(j(base, "zz"))
    with pytest.raises(IsADirectoryError):
        fs.read(j(base, "a"))
    with pytest.raises(FileNotFoundError):
        fs.read(j(base, "zz"))
    with pytest.raises(FileNotFoundError):
        fs.size(j(base, "zz"))
    assert not fs.exists(j(base, "a", "f", "x"))
    fs.fsync_dir(j(base, "a"))
    fs.fsync_dir(base)
    with pytest.raises(NotADirectoryError):
        fs.fsync_dir(j(base, "a", "f"))
    with pytest.raises(FileNotFoundError):
        fs.fsync_dir(j(base, "zz"))
    assert fs.exists(j(base, "a", ".", "f"))  # normalised
    assert fs.read(j(base, "a", "b", "..", "f")) == b"1"


def test_rename(env):
    fs, base = env
    a, b = j(base, "a"), j(base, "b")
    _write_file(fs, a, b"new")
    _write_file(fs, b, b"old")
    fs.rename(a, b)  # atomic replace
    assert not fs.exists(a)
    assert fs.read(b) == b"new"
    fs.rename(b, b)  # same file: nothing happens
    assert fs.read(b) == b"new"
    with pytest.raises(FileNotFoundError):
        fs.rename(a, j(base, "c"))
    with pytest.raises(FileNotFoundError):
        fs.rename(b, j(base, "nodir", "c"))
    fs.mkdir(j(base, "d"))
    fs.rename(b, j(base, "d", "b"))  # across directories
    assert fs.listdir(j(base, "d")) == ["b"]
    fs.mkdir(j(base, "empty"))
    with pytest.raises(IsADirectoryError):
        fs.rename(j(base, "d", "b"), j(base, "empty"))
    with pytest.raises(OSError) as info:
        fs.rename(j(base, "d", "b"), j(base, "d"))  # onto its own ancestor
    assert info.value.errno == errno.ENOTEMPTY
    _write_file(fs, j(base, "file"), b"")
    with pytest.raises(NotADirectoryError):
        fs.rename(j(base, "d"), j(base, "file"))
    fs.mkdir(j(base, "e"))
    with pytest.raises(OSError) as info:
        fs.rename(j(base, "e"), j(base, "d"))  # onto a non-empty directory
    assert info.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as info:
        fs.rename(j(base, "d"), j(base, "d", "sub"))
    assert info.value.errno == errno.EINVAL
    fs.rename(j(base, "d"), j(base, "e"))  # onto an empty directory
    assert fs.read(j(base, "e", "b")) == b"new"


def test_rename_keeps_open_handles(env):
    fs, base = env
    fd = fs.open(j(base, "a"), create=True)
    fs.pwrite(fd, b"one", 0)
    fs.rename(j(base, "a"), j(base, "b"))
    fs.pwrite(fd, b"two", 3)
    assert fs.read(j(base, "b")) == b"onetwo"
    fs.close(fd)


def test_unlink(env):
    fs, base = env
    p = j(base, "f")
    fd = fs.open(p, create=True)
    fs.pwrite(fd, b"still here", 0)
    fs.unlink(p)
    assert not fs.exists(p)
    assert fs.listdir(base) == []
    assert fs.pread(fd, 100, 0) == b"still here"  # an open handle outlives its name
    fs.close(fd)
    with pytest.raises(FileNotFoundError):
        fs.unlink(p)
    fs.mkdir(j(base, "d"))
    with pytest.raises(IsADirectoryError):
        fs.unlink(j(base, "d"))


def test_write_all_writes_everything(env):
    fs, base = env
    fd = fs.open(j(base, "f"), create=True)
    write_all(fs, fd, b"0123456789" * 100, 5)
    assert fs.read(j(base, "f")) == bytes(5) + b"0123456789" * 100
    fs.close(fd)


# --- differential: random call sequences, RealFs vs FakeDisk ----------------------------

NAMES = ["a", "b", "d/a", "d/b", "d", "d/e"]

call_st = st.one_of(
    st.tuples(st.just("open"), st.sampled_from(NAMES), st.booleans(), st.booleans()),
    st.tuples(st.just("pwrite"), st.integers(0, 3), st.binary(max_size=20), st.integers(0, 40)),
    st.tuples(st.just("pread"), st.integers(0, 3), st.integers(0, 30), st.integers(0, 40)),
    st.tuples(st.just("ftruncate"), st.integers(0, 3), st.integers(0, 50)),
    st.tuples(st.just("fallocate"), st.integers(0, 3), st.integers(0, 50)),
    st.tuples(st.just("fdatasync"), st.integers(0, 3)),
    st.tuples(st.just("close"), st.integers(0, 3)),
    st.tuples(st.just("rename"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.tuples(st.just("unlink"), st.sampled_from(NAMES)),
    st.tuples(st.just("mkdir"), st.sampled_from(NAMES)),
    st.tuples(st.just("read"), st.sampled_from(NAMES)),
    st.tuples(st.just("size"), st.sampled_from(NAMES)),
    st.tuples(st.just("listdir"), st.sampled_from([*NAMES, "."])),
    st.tuples(st.just("exists"), st.sampled_from(NAMES)),
    st.tuples(st.just("fsync_dir"), st.sampled_from([*NAMES, "."])),
)


class _Side:
    def __init__(self, fs, base):
        self.fs, self.base, self.fds, self.closed = fs, base, [], set()

    def run(self, call):
        op, *args = call
        fs, p = self.fs, lambda name: j(self.base, name)
        try:
            if op == "open":
                self.fds.append(fs.open(p(args[0]), create=args[1], exclusive=args[2]))
                return ("fd", len(self.fds) - 1)
            if op in ("pwrite", "pread", "ftruncate", "fallocate", "fdatasync", "close"):
                slot = args[0]
                # the OS reuses a closed descriptor's number, the fake never does: a closed
                # or unknown slot maps to a number open on neither side
                open_ = slot < len(self.fds) and slot not in self.closed
                fd = self.fds[slot] if open_ else 10_000 + slot
                out = getattr(fs, op)(fd, *args[1:])
                if op == "close":
                    self.closed.add(slot)
                return out
            if op == "rename":
                return fs.rename(p(args[0]), p(args[1]))
            if op == "size" and fs.exists(p(args[0])):
                with contextlib.suppress(NotADirectoryError):
                    fs.listdir(p(args[0]))
                    return "dir"  # a directory's size is filesystem-specific; not compared
            out = getattr(fs, op)(p(args[0]))
            return sorted(out) if op == "listdir" else out
        except OSError as exc:
            return ("error", type(exc).__name__, exc.errno)

    def tree(self):
        out = {}
        for root, dirs, files in os.walk(self.base) if isinstance(self.fs, RealFs) else ():
            rel = os.path.relpath(root, self.base)
            for d in dirs:
                out[posixpath.normpath(j(rel, d))] = "dir"
            for f in files:
                out[posixpath.normpath(j(rel, f))] = self.fs.read(j(root, f))
        return out

    def close_all(self):
        for slot, fd in enumerate(self.fds):
            if slot not in self.closed:
                self.fs.close(fd)


def _fake_tree(disk, base):
    out = {}

    def walk(d, rel):
        for name in disk.listdir(d):
            path = j(d, name)
            key = posixpath.normpath(j(rel, name))
            try:
                out[key] = disk.read(path)
            except IsADirectoryError:
                out[key] = "dir"
                walk(path, key)

    walk(base, ".")
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(call_st, max_size=40))
def test_fake_matches_real_fs(calls):
    with tempfile.TemporaryDirectory() as tmp:
        real = _Side(RealFs(), tmp)
        disk = FakeDisk()
        disk.mkdir("/base")
        fake = _Side(disk, "/base")
        try:
            for call in calls:
                assert fake.run(call) == real.run(call), call
            assert _fake_tree(disk, "/base") == real.tree()
        finally:
            real.close_all()


# --- power loss ---------------------------------------------------------------------------


@pytest.fixture
def disk():
    d = FakeDisk()
    d.mkdir("/data")
    d.sync_all()
    return d


def test_unsynced_write_is_lost_synced_write_survives(disk):
    fd = disk.open("/data/f", create=True)
    disk.fsync_dir("/data")
    disk.pwrite(fd, b"durable", 0)
    disk.fdatasync(fd)
    disk.pwrite(fd, b"DURABLE-and-more", 0)
    assert disk.pending_bytes("/data/f") == b"DURABLE-and-more"
    assert disk.durable_bytes("/data/f") == b"durable"
    assert disk.unsynced() == ["/data/f"]
    disk.crash()
    assert disk.read("/data/f") == b"durable"
    assert disk.size("/data/f") == 7
    assert disk.unsynced() == []


def test_sync_makes_length_durable_too(disk):
    fd = disk.open("/data/f", create=True)
    disk.fsync_dir("/data")
    disk.pwrite(fd, b"abcdef", 0)
    disk.fdatasync(fd)
    disk.ftruncate(fd, 2)
    disk.crash()
    assert disk.read("/data/f") == b"abcdef"  # the truncate was not synced

    fd = disk.open("/data/f")
    disk.ftruncate(fd, 2)
    disk.fdatasync(fd)
    disk.fallocate(fd, 100)
    disk.crash()
    assert disk.read("/data/f") == b"ab"  # the allocation was not synced

    fd = disk.open("/data/f")
    disk.fallocate(fd, 16)
    disk.fdatasync(fd)
    disk.crash()
    assert disk.read("/data/f") == b"ab" + bytes(14)


def test_new_file_vanishes_unless_its_directory_is_synced(disk):
    fd = disk.open("/data/f", create=True)
    disk.pwrite(fd, b"x", 0)
    disk.fdatasync(fd)  # data durable, name not
    assert disk.durable_bytes("/data/f") is None
    assert disk.unsynced() == ["/data/"]
    disk.crash()
    assert not disk.exists("/data/f")
    assert disk.listdir("/data") == []

    fd = disk.open("/data/g", create=True)
    disk.pwrite(fd, b"y", 0)
    disk.fsync_dir("/data")  # name durable, data not
    disk.crash()
    assert disk.read("/data/g") == b""

    fd = disk.open("/data/h", create=True)
    disk.pwrite(fd, b"z", 0)
    disk.fdatasync(fd)
    disk.fsync_dir("/data")
    disk.crash()
    assert disk.read("/data/h") == b"z"


def test_mkdir_needs_each_parent_synced(disk):
    disk.mkdir("/data/a/b")
    disk.crash()
    assert not disk.exists("/data/a")

    disk.mkdir("/data/a/b")
    disk.fsync_dir("/data")
    disk.crash()
    assert disk.exists("/data/a")
    assert not disk.exists("/data/a/b")

    disk.mkdir("/data/a/b")
    disk.fsync_dir("/data/a")
    disk.crash()
    assert disk.exists("/data/a/b")
    assert disk.durable_listdir("/data/a") == ["b"]


def test_rename_reverts_unless_directory_synced(disk):
    _write_file(disk, "/data/snap", b"old")
    _write_file(disk, "/data/tmp", b"new")
    for path in ("/data/snap", "/data/tmp"):
        fd = disk.open(path)
        disk.fdatasync(fd)
        disk.close(fd)
    disk.fsync_dir("/data")

    disk.rename("/data/tmp", "/data/snap")
    assert disk.durable_bytes("/data/snap") == b"old"
    disk.crash()
    assert disk.read("/data/snap") == b"old"
    assert disk.read("/data/tmp") == b"new"

    disk.rename("/data/tmp", "/data/snap")
    disk.fsync_dir("/data")
    disk.crash()
    assert disk.read("/data/snap") == b"new"
    assert not disk.exists("/data/tmp")


def test_cross_directory_rename_is_durable_per_directory(disk):
    disk.mkdir("/data/a")
    disk.mkdir("/data/b")
    fd = disk.open("/data/a/f", create=True)
    disk.pwrite(fd, b"f", 0)
    disk.fdatasync(fd)
    disk.close(fd)
    disk.sync_all()
    disk.rename("/data/a/f", "/data/b/f")
    disk.fsync_dir("/data/b")
    disk.crash()
    # only the target directory was synced: the file is under both names (documented)
    assert disk.read("/data/a/f") == b"f"
    assert disk.read("/data/b/f") == b"f"


def test_unlink_reverts_unless_directory_synced(disk):
    _write_file(disk, "/data/f", b"keep")
    disk.sync_all()
    disk.unlink("/data/f")
    assert disk.durable_bytes("/data/f") == b"keep"
    disk.crash()
    assert disk.read("/data/f") == b"keep"
    disk.unlink("/data/f")
    disk.fsync_dir("/data")
    disk.crash()
    assert not disk.exists("/data/f")


def test_unlinked_open_file_is_collected(disk):
    _write_file(disk, "/data/f", b"x")
    disk.sync_all()
    fd = disk.open("/data/f")
    disk.unlink("/data/f")
    disk.fsync_dir("/data")
    assert disk.pread(fd, 1, 0) == b"x"
    nodes = len(disk._nodes)
    disk.close(fd)
    assert len(disk._nodes) == nodes - 1


def test_handles_are_invalid_after_crash(disk):
    fd = disk.open("/data/f", create=True)
    disk.fsync_dir("/data")
    assert disk.open_handles == 1
    disk.crash()
    assert disk.open_handles == 0
    for call in (
        lambda: disk.pwrite(fd, b"x", 0),
        lambda: disk.pread(fd, 1, 0),
        lambda: disk.fdatasync(fd),
        lambda: disk.ftruncate(fd, 0),
        lambda: disk.close(fd),
    ):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.EBADF
    fd2 = disk.open("/data/f")  # the disk itself works: recovery reopens files
    assert fd2 != fd  # handles are never reused
    disk.close(fd2)


def _torn_setup(disk, synced=b"S" * 1000, writes=((1000, b"a" * 300), (1300, b"b" * 1500))):
    fd = disk.open("/data/wal", create=True)
    disk.fsync_dir("/data")
    disk.pwrite(fd, synced, 0)
    disk.fdatasync(fd)
    for offset, data in writes:
        disk.pwrite(fd, data, offset)
    return fd


@pytest.mark.parametrize("seed", range(60))
def test_torn_damage_stays_inside_the_last_write(disk, seed):
    _torn_setup(disk)
    disk.crash(seed, torn=True)
    out = disk.read("/data/wal")
    (damage,) = disk.last_damage
    assert damage.paths == ("/data/wal",)
    assert (damage.offset, damage.length) == (1300, 1500)
    assert out[:1000] == b"S" * 1000  # the synced prefix is intact
    assert out[1000:1300] == bytes(len(out[1000:1300]))  # the earlier unsynced write is gone
    tail = out[1300:]
    assert len(tail) <= 1500
    assert tail == damage.landed
    if damage.kind == "prefix":
        assert len(tail) < 1500
        assert tail == b"b" * len(tail)
    elif damage.kind == "zero":
        assert len(tail) == 1500
        zeros = [i + 1300 for i, c in enumerate(tail) if c == 0]
        assert zeros
        assert len({z // 512 for z in zeros}) == 1  # one sector, aligned to file offsets
        assert all(c in (0, ord("b")) for c in tail)
    else:
        assert len(tail) == 1500
        changed = [i for i, c in enumerate(tail) if c != ord("b")]
        assert 1 <= len(changed) <= 8


def test_torn_damage_is_deterministic_per_seed():
    def run(seed):
        d = FakeDisk()
        for name in ("x", "y", "z"):
            fd = d.open(name, create=True)
            d.pwrite(fd, b"base", 0)
            d.fdatasync(fd)
            d.pwrite(fd, bytes(range(256)) * 5, 4)
        d.fsync_dir("/")
        d.crash(seed, torn=True)
        return d.tree(), d.last_damage

    assert run(7) == run(7)
    outcomes = {repr(run(s)) for s in range(20)}
    assert len(outcomes) > 10
    kinds = {dmg.kind for s in range(20) for dmg in run(s)[1]}
    assert kinds == {"prefix", "zero", "garble"}


@pytest.mark.parametrize("kind", ["prefix", "zero", "garble"])
def test_torn_kind_can_be_forced(disk, kind):
    _torn_setup(disk)
    disk.crash(3, torn=True, kind=kind)
    assert [d.kind for d in disk.last_damage] == [kind]


def test_torn_overwrite_inside_durable_bytes(disk):
    fd = disk.open("/data/f", create=True)
    disk.fsync_dir("/data")
    disk.pwrite(fd, b"." * 2048, 0)
    disk.fdatasync(fd)
    disk.pwrite(fd, b"#" * 600, 700)
    disk.crash(1, torn=True, kind="zero")
    out = disk.read("/data/f")
    assert len(out) == 2048
    assert out[:700] == b"." * 700
    assert out[1300:] == b"." * 748
    assert set(out[700:1300]) == {0, ord("#")}


def test_torn_leaves_synced_and_untouched_files_alone(disk):
    fd = disk.open("/data/synced", create=True)
    disk.pwrite(fd, b"abc", 0)
    disk.fdatasync(fd)
    fd2 = disk.open("/data/truncated", create=True)
    disk.pwrite(fd2, b"abcdef", 0)
    disk.fdatasync(fd2)
    disk.ftruncate(fd2, 1)  # no pwrite since the sync: nothing to tear, the truncate is lost
    disk.fsync_dir("/data")
    disk.crash(0, torn=True)
    assert disk.last_damage == []
    assert disk.read("/data/synced") == b"abc"
    assert disk.read("/data/truncated") == b"abcdef"


def test_plain_crash_never_damages(disk):
    _torn_setup(disk)
    disk.crash(5)
    assert disk.read("/data/wal") == b"S" * 1000
    assert disk.last_damage == []


def test_snapshot_restore(disk):
    _write_file(disk, "/data/f", b"one")
    disk.sync_all()
    image = disk.snapshot()
    fd = disk.open("/data/f")
    disk.pwrite(fd, b"two", 0)
    disk.fdatasync(fd)
    disk.unlink("/data/f")
    disk.open("/data/g", create=True)
    disk.fsync_dir("/data")
    assert disk.tree(durable=True) == {"/data/g": b""}
    disk.restore(image)
    assert disk.tree() == {"/data/f": b"one"}
    assert disk.tree(durable=True) == {"/data/f": b"one"}
    assert disk.open_handles == 0
    with pytest.raises(OSError) as info:
        disk.pread(fd, 1, 0)
    assert info.value.errno == errno.EBADF
    disk.restore(image)  # an image can be restored many times
    assert disk.read("/data/f") == b"one"


def test_snapshot_holds_only_the_durable_image(disk):
    _write_file(disk, "/data/f", b"pending")  # never synced
    image = disk.snapshot()
    disk.restore(image)
    assert disk.tree() == {}


def test_mutations_count_mutating_calls(disk):
    m0 = disk.mutations
    fd = disk.open("/data/f", create=True)  # 1
    disk.pwrite(fd, b"x", 0)  # 2
    disk.pread(fd, 1, 0)
    disk.fdatasync(fd)  # 3
    disk.fallocate(fd, 10)  # 4
    disk.ftruncate(fd, 1)  # 5
    disk.close(fd)
    disk.read("/data/f")
    disk.size("/data/f")
    disk.exists("/data/f")
    disk.listdir("/data")
    disk.close(disk.open("/data/f", create=True))  # exists already: not counted
    disk.mkdir("/data")  # exists already: not counted
    disk.mkdir("/data/d")  # 6
    disk.rename("/data/f", "/data/d/f")  # 7
    disk.fsync_dir("/data/d")  # 8
    disk.unlink("/data/d/f")  # 9
    with pytest.raises(FileNotFoundError):
        disk.unlink("/data/d/f")  # failed: not counted
    assert disk.mutations - m0 == 9


def _install(fs, data):
    """The snapshot protocol: write a temp file, sync it, rename it over the old one,
    sync the directory, remove the older generation."""
    fd = fs.open("/data/meta/snap.tmp", create=True)
    write_all(fs, fd, data, 0)
    fs.fdatasync(fd)
    fs.close(fd)
    fs.rename("/data/meta/snap.tmp", "/data/meta/snap")
    fs.fsync_dir("/data/meta")
    if fs.exists("/data/meta/snap.old"):
        fs.unlink("/data/meta/snap.old")
        fs.fsync_dir("/data/meta")


def test_crash_point_sweep(disk):
    disk.mkdir("/data/meta")
    _write_file(disk, "/data/meta/snap", b"v1")
    _write_file(disk, "/data/meta/snap.old", b"v0")
    disk.sync_all()
    image = disk.snapshot()
    before = disk.mutations
    _install(disk, b"v2")
    m = disk.mutations - before
    assert m == 7  # open(create), pwrite, fdatasync, rename, fsync_dir, unlink, fsync_dir
    seen = []
    for k in range(m + 1):
        disk.restore(image)
        disk.crash_after(k)
        with pytest.raises(PowerLoss):  # k = 0 crashes at once, so the first call raises
            _install(disk, b"v2")
        assert not disk.powered
        with pytest.raises(PowerLoss):
            disk.exists("/data")
        disk.reboot()
        snap = disk.read("/data/meta/snap")
        assert snap in (b"v1", b"v2")  # never torn, never missing
        seen.append(snap)
    assert seen[0] == b"v1"
    assert seen[-1] == b"v2"
    assert seen == sorted(seen)  # once v2 is durable it stays


def test_crash_after_beyond_the_operation_never_fires(disk):
    disk.crash_after(100)
    _write_file(disk, "/data/f", b"x")
    assert disk.powered
    disk.crash_after(None)
    with pytest.raises(ValueError, match=">= 0"):
        disk.crash_after(-1)


def test_crash_after_with_torn_damage(disk):
    fd = disk.open("/data/f", create=True)
    disk.fsync_dir("/data")
    disk.crash_after(1, seed=4, torn=True, kind="prefix")
    with pytest.raises(PowerLoss):
        disk.pwrite(fd, b"x" * 100, 0)
    disk.reboot()
    out = disk.read("/data/f")
    assert out == b"x" * len(out)
    assert len(out) < 100


def test_power_loss_is_an_eio(disk):
    disk.crash(power_off=True)
    with pytest.raises(OSError) as info:
        disk.listdir("/")
    assert info.value.errno == errno.EIO
    disk.reboot()
    assert disk.listdir("/") == ["data"]


def test_relative_and_absolute_paths_agree():
    d = FakeDisk()
    d.mkdir("data/x")
    assert d.exists("/data/x")
    assert d.listdir(".") == ["data"]
    assert d.listdir("/") == ["data"]
    with pytest.raises(IsADirectoryError):
        d.open("/")
    with pytest.raises(OSError) as info:
        d.rename("/", "/y")
    assert info.value.errno == errno.EBUSY


# --- FaultFs ------------------------------------------------------------------------------


@pytest.fixture
def faulty():
    d = FakeDisk()
    d.mkdir("/data")
    d.sync_all()
    return FaultFs(d), d


def test_fail_nth_once(faulty):
    fs, _ = faulty
    fd = fs.open("/data/f", create=True)
    fs.fail("fdatasync", nth=2)
    fs.fdatasync(fd)
    with pytest.raises(OSError) as info:
        fs.fdatasync(fd)
    assert info.value.errno == errno.EIO
    assert type(info.value) is OSError
    assert "injected: fdatasync on /data/f" in str(info.value)
    fs.fdatasync(fd)
    assert fs.rules == 0
    assert fs.injected == [("fdatasync", "EIO", "/data/f")]


def test_fail_default_is_the_next_call_once(faulty):
    fs, _ = faulty
    fs.fail("mkdir")
    with pytest.raises(OSError):
        fs.mkdir("/data/a")
    fs.mkdir("/data/a")


def test_fail_always_and_from_nth_on(faulty):
    fs, _ = faulty
    fd = fs.open("/data/f", create=True)
    fs.fail("fdatasync", always=True)
    for _ in range(3):
        with pytest.raises(OSError):
            fs.fdatasync(fd)
    fs.clear()
    fs.fdatasync(fd)
    fs.fail("fdatasync", nth=3, always=True)
    fs.fdatasync(fd)
    fs.fdatasync(fd)
    for _ in range(3):
        with pytest.raises(OSError):
            fs.fdatasync(fd)
    assert fs.rules == 1


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.EROFS, errno.EDQUOT])
def test_fail_errno_and_no_effect(faulty, code):
    fs, disk = faulty
    fd = fs.open("/data/f", create=True)
    fs.fail("pwrite", errno=code)
    with pytest.raises(OSError) as info:
        fs.pwrite(fd, b"data", 0)
    assert info.value.errno == code
    assert disk.pending_bytes("/data/f") == b""  # the failed call never reached the disk
    fs.fail("fdatasync", errno=code)
    fs.pwrite(fd, b"data", 0)
    with pytest.raises(OSError):
        fs.fdatasync(fd)
    assert disk.durable_bytes("/data/f") is None  # its name was never made durable
    assert disk.unsynced() == ["/data/", "/data/f"]


def test_fail_by_predicate(faulty):
    fs, _ = faulty
    fs.mkdir("/data/meta")
    for name in ("a", "b"):
        fs.close(fs.open(j("/data", name), create=True))
    fs.fail("rename", always=True, predicate=lambda c: c.paths[1].startswith("/data/meta/"))
    fs.rename("/data/a", "/data/c")
    with pytest.raises(OSError):
        fs.rename("/data/b", "/data/meta/b")
    with pytest.raises(OSError):
        fs.rename("/data/c", "/data/meta/c")


def test_nth_counts_only_matching_calls(faulty):
    fs, _ = faulty
    fa = fs.open("/data/a", create=True)
    fb = fs.open("/data/b", create=True)
    fs.fail("fdatasync", nth=2, predicate=lambda c: c.path == "/data/b")
    fs.fdatasync(fa)
    fs.fdatasync(fb)
    fs.fdatasync(fa)
    with pytest.raises(OSError):
        fs.fdatasync(fb)
    fs.fdatasync(fb)


def test_rules_are_validated(faulty):
    fs, _ = faulty
    with pytest.raises(ValueError, match="unknown Fs op"):
        fs.fail("fsync")
    with pytest.raises(ValueError, match="nth"):
        fs.fail("pwrite", nth=0)
    with pytest.raises(ValueError, match="nbytes"):
        fs.short_write(nbytes=-1)
    with pytest.raises(ValueError, match="seconds"):
        fs.stall("fdatasync", -1)


@pytest.mark.parametrize("kind", ["real", "fake"])
def test_short_write_is_retried_by_write_all(tmp_path, kind):
    inner = RealFs() if kind == "real" else FakeDisk()
    base = str(tmp_path) if kind == "real" else "/"
    fs = FaultFs(inner)
    p = j(base, "f")
    fd = fs.open(p, create=True)
    fs.short_write(2)
    fs.short_write(3, nbytes=1)
    write_all(fs, fd, b"0123456789", 0)
    write_all(fs, fd, b"abcdefgh", 10)
    assert fs.read(p) == b"0123456789abcdefgh"
    pwrites = [c for c in fs.calls if c[0] == "pwrite"]
    assert len(pwrites) == 4  # one whole, then 4 + 1 + 3
    assert fs.injected == [("pwrite", "short", p), ("pwrite", "short", p)]
    fs.close(fd)


def test_short_write_always_still_completes(faulty):
    fs, disk = faulty
    fd = fs.open("/data/f", create=True)
    fs.short_write(always=True)
    write_all(fs, fd, bytes(range(100)), 0)
    assert disk.read("/data/f") == bytes(range(100))


def test_zero_byte_write_is_no_progress(faulty):
    fs, _ = faulty
    fd = fs.open("/data/f", create=True)
    fs.short_write(nbytes=0)
    with pytest.raises(OSError) as info:
        write_all(fs, fd, b"abc", 0)
    assert info.value.errno == errno.EIO


def test_partial_write_then_enospc(faulty):
    fs, disk = faulty
    fd = fs.open("/data/f", create=True)
    fs.short_write(1, nbytes=2)
    fs.fail("pwrite", nth=2, errno=errno.ENOSPC)
    with pytest.raises(OSError) as info:
        write_all(fs, fd, b"abcdef", 0)
    assert info.value.errno == errno.ENOSPC
    assert disk.read("/data/f") == b"ab"


def test_stall_hook(faulty):
    fs, _ = faulty
    seen = []
    fs.on_stall = lambda call, s: seen.append((call.op, call.path, s))
    fd = fs.open("/data/f", create=True)
    assert fs.next_stall_s("fdatasync") == 0.0
    fs.stall("fdatasync", 2.5, nth=2)
    assert fs.next_stall_s("fdatasync") == 0.0
    fs.fdatasync(fd)
    assert fs.next_stall_s("fdatasync") == 2.5
    fs.fdatasync(fd)  # stalls do not fail
    fs.fdatasync(fd)
    assert fs.stalls == [("fdatasync", 2.5)]
    assert seen == [("fdatasync", "/data/f", 2.5)]


def test_calls_log_follows_handles_through_renames(faulty):
    fs, _ = faulty
    fd = fs.open("/data/tmp", create=True)
    fs.pwrite(fd, b"x", 0)
    fs.rename("/data/tmp", "/data/final")
    fs.fdatasync(fd)
    fs.close(fd)
    fs.fsync_dir("/data/")
    assert fs.calls == [
        ("open", "/data/tmp"),
        ("pwrite", "/data/tmp"),
        ("rename", "/data/tmp", "/data/final"),
        ("fdatasync", "/data/final"),
        ("close", "/data/final"),
        ("fsync_dir", "/data"),
    ]


def test_failed_close_still_releases_the_handle(faulty):
    fs, disk = faulty
    fd = fs.open("/data/f", create=True)
    fs.fail("close")
    with pytest.raises(OSError):
        fs.close(fd)
    assert disk.open_handles == 0
    with pytest.raises(OSError) as info:
        fs.close(fd)
    assert info.value.errno == errno.EBADF


def test_failed_calls_are_logged(faulty):
    fs, _ = faulty
    fs.fail("exists")
    with pytest.raises(OSError):
        fs.exists("/data")
    with pytest.raises(FileNotFoundError):
        fs.read("/nope")
    assert fs.calls == [("exists", "/data"), ("read", "/nope")]


def test_fault_on_top_of_a_crashing_disk(faulty):
    fs, disk = faulty
    fd = fs.open("/data/f", create=True)
    fs.fsync_dir("/data")
    fs.pwrite(fd, b"acked?", 0)
    fs.fail("fdatasync")
    with pytest.raises(OSError):
        fs.fdatasync(fd)
    disk.crash()
    assert fs.read("/data/f") == b""  # the failed sync made nothing durable


# --- MonitorFs ----------------------------------------------------------------------------


@pytest.fixture
def monitored():
    d = FakeDisk()
    d.mkdir("/data/meta")
    _write_file(d, "/data/meta/snap", b"v1")
    _write_file(d, "/data/meta/snap.old", b"v0")
    d.sync_all()
    m = MonitorFs(d)
    m.require_synced_before_rename("/data/meta")
    m.require_dir_synced_before_unlink("/data/meta")
    return m, d


def test_monitor_accepts_the_correct_protocol(monitored):
    fs, disk = monitored
    _install(fs, b"v2")
    fs.assert_ok()
    assert fs.violations == []
    assert disk.read("/data/meta/snap") == b"v2"
    fs.assert_before(("fdatasync", "/data/meta/snap.tmp"), ("rename", "/data/meta/snap.tmp"))
    fs.assert_before(("fsync_dir", "/data/meta"), ("unlink", "/data/meta/snap.old"))


def test_monitor_catches_rename_before_sync(monitored):
    fs, disk = monitored
    fd = fs.open("/data/meta/snap.tmp", create=True)
    fs.pwrite(fd, b"v2", 0)
    with pytest.raises(OrderingViolation, match="sync-before-rename"):
        fs.rename("/data/meta/snap.tmp", "/data/meta/snap")
    assert disk.read("/data/meta/snap") == b"v1"  # the violating call did not run
    with pytest.raises(OrderingViolation, match="without"):  # attempted calls are logged
        fs.assert_before(("fdatasync",), ("rename",))
    with pytest.raises(OrderingViolation, match="never happened"):
        fs.assert_before(("open",), ("unlink",))


def test_monitor_catches_unlink_before_dir_sync(monitored):
    fs, _ = monitored
    fd = fs.open("/data/meta/snap.tmp", create=True)
    fs.pwrite(fd, b"v2", 0)
    fs.fdatasync(fd)
    fs.close(fd)
    fs.rename("/data/meta/snap.tmp", "/data/meta/snap")
    with pytest.raises(OrderingViolation, match=r"fsync_dir\(/data/meta\)"):
        fs.unlink("/data/meta/snap.old")


def test_monitor_recording_mode(monitored):
    _, disk = monitored
    fs = MonitorFs(disk, live=False)
    fs.require_synced_before_rename("/data/meta")
    fs.require_dir_synced_before_unlink("/data/meta")
    fd = fs.open("/data/meta/snap.tmp", create=True)
    fs.pwrite(fd, b"v2", 0)
    fs.rename("/data/meta/snap.tmp", "/data/meta/snap")
    fs.unlink("/data/meta/snap.old")
    assert len(fs.violations) == 2
    with pytest.raises(OrderingViolation):
        fs.assert_ok()


def test_monitor_allows_consecutive_unlinks_and_ignores_other_dirs(monitored):
    fs, _ = monitored
    _install(fs, b"v2")
    _write_file(fs, "/data/meta/x", b"")
    fs.fsync_dir("/data/meta")
    fs.unlink("/data/meta/snap")
    fs.unlink("/data/meta/x")  # removals need no sync in between
    fd = fs.open("/data/other", create=True)
    fs.pwrite(fd, b"unsynced", 0)
    fs.rename("/data/other", "/data/other2")  # not into meta/
    fs.unlink("/data/other2")  # not under meta/
    fs.assert_ok()


def test_monitor_state_survives_renames(monitored):
    fs, _ = monitored
    fd = fs.open("/data/a", create=True)
    fs.pwrite(fd, b"x", 0)
    fs.rename("/data/a", "/data/b")  # still unsynced under its new name
    assert not fs.state.file_synced("/data/b")
    with pytest.raises(OrderingViolation):
        fs.rename("/data/b", "/data/meta/b")
    fs.fdatasync(fd)
    fs.rename("/data/b", "/data/meta/b")


def test_monitor_sees_injected_sync_failure(monitored):
    _, disk = monitored
    fault = FaultFs(disk)
    fs = MonitorFs(fault)
    fs.require_synced_before_rename("/data/meta")
    fd = fs.open("/data/meta/snap.tmp", create=True)
    fs.pwrite(fd, b"v2", 0)
    fault.fail("fdatasync")
    with pytest.raises(OSError):
        fs.fdatasync(fd)
    with pytest.raises(OrderingViolation):
        fs.rename("/data/meta/snap.tmp", "/data/meta/snap")


def test_monitor_with_relative_paths():
    d = FakeDisk()
    fs = MonitorFs(d)
    fs.require_dir_synced_before_unlink(".")
    _write_file(fs, "old", b"")
    fs.fsync_dir(".")
    _write_file(fs, "new", b"")
    with pytest.raises(OrderingViolation):
        fs.unlink("old")
    fs.fsync_dir(".")
    fs.unlink("old")


def test_custom_rule(monitored):
    fs, _ = monitored

    class NoWritesUnder(OrderingRule):
        name = "no-writes"

        def check(self, call: Call, state):
            if call.op == "pwrite" and call.path.startswith("/data/ro/"):
                return f"write to {call.path}"
            return None

    fs.add_rule(NoWritesUnder())
    fs.mkdir("/data/ro")
    fd = fs.open("/data/ro/f", create=True)
    with pytest.raises(OrderingViolation, match="no-writes: write to /data/ro/f"):
        fs.pwrite(fd, b"x", 0)


def test_replace_file_syncs_every_so_many_bytes_and_survives_a_crash_whole():
    from topicd.storage.fs import replace_file

    disk = FakeDisk()
    disk.mkdir("/d")
    disk.fsync_dir("/")
    mon = MonitorFs(disk)
    mon.require_synced_before_rename("/d")
    pieces = [b"a" * 6, b"b" * 6, b"c" * 6, b"d" * 2]
    replace_file(mon, "/d/f", pieces, sync_every=10)
    ops = [c[0] for c in mon.calls]
    # a sync after 12 bytes (≥ 10), none after the next 6, then the final one
    assert ops.count("fdatasync") == 2
    writes_before_first_sync = ops[: ops.index("fdatasync")].count("pwrite")
    assert writes_before_first_sync == 2
    # each sync is followed by the advice to drop what it synced from the page cache
    syncs = [i for i, op in enumerate(ops) if op == "fdatasync"]
    assert [ops[i + 1] for i in syncs] == ["drop_cache", "drop_cache"]
    assert disk.drops == 2
    mon.assert_ok()
    disk.crash()
    fd = disk.open("/d/f")
    assert disk.pread(fd, 100, 0) == b"".join(pieces)
