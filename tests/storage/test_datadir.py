"""The data-directory lock: a `flock` on the directory itself, adding nothing to it.

Method: the lock functions run in this process against real temporary directories.
`flock` locks belong to an open file description, so a second `lock_existing` in the same
process conflicts exactly as a second topicd process would; an earlier version's lock is
imitated by taking `flock` on `<dir>/.topicd.lock` directly. Every case checks that no
entry appeared where nothing may be created. The address in a bind error is checked on
`bind_error` directly (IPv6 literals get brackets).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import socket

import pytest

from topicd.config import DEFAULT
from topicd.daemon import bind_error
from topicd.storage.datadir import (
    LEGACY_LOCK_FILE,
    DataDirError,
    DataDirLocked,
    create_and_lock,
    hold_lock,
    lock_existing,
)


def test_a_missing_directory_is_not_created_by_locking(tmp_path):
    assert lock_existing(tmp_path / "absent") is None
    with pytest.raises(DataDirError, match="does not exist"), hold_lock(str(tmp_path / "absent")):
        pass
    assert list(tmp_path.iterdir()) == []


def test_the_lock_adds_nothing_and_excludes_a_second_holder(tmp_path):
    lock = lock_existing(tmp_path)
    assert lock is not None
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataDirLocked, match="locked by another topicd process"):
        lock_existing(tmp_path)
    lock.release()
    lock.release()  # idempotent
    again = lock_existing(tmp_path)
    assert again is not None
    again.release()


def test_a_file_is_not_a_data_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataDirError, match="is not a directory"):
        lock_existing(tmp_path / "f")


def test_an_earlier_versions_lock_file_is_honoured_both_ways(tmp_path):
    legacy = tmp_path / LEGACY_LOCK_FILE
    legacy.write_text("123\n")
    fd = os.open(legacy, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an earlier topicd is running
        with pytest.raises(DataDirLocked):
            lock_existing(tmp_path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        lock = lock_existing(tmp_path)
        assert lock is not None
        # ...and an earlier topicd started now would find its lock file taken
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.release()
    finally:
        os.close(fd)
    assert legacy.read_text() == "123\n"
    assert [p.name for p in tmp_path.iterdir()] == [LEGACY_LOCK_FILE]


def test_create_and_lock_makes_missing_parents(tmp_path):
    lock = create_and_lock(tmp_path / "a" / "b")
    try:
        assert (tmp_path / "a" / "b").is_dir()
        assert list((tmp_path / "a" / "b").iterdir()) == []
        with pytest.raises(DataDirLocked):
            create_and_lock(tmp_path / "a" / "b")
    finally:
        lock.release()


def test_create_and_lock_under_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataDirError, match="cannot create data directory"):
        create_and_lock(tmp_path / "f" / "d")


@pytest.mark.parametrize(
    ("host", "address"), [("127.0.0.1", "127.0.0.1:4000"), ("::1", "[::1]:4000")]
)
def test_a_bind_error_names_the_address(host, address):
    cfg = dataclasses.replace(DEFAULT, server=dataclasses.replace(DEFAULT.server, host=host))
    taken = OSError(errno.EADDRINUSE, "Address already in use")
    group = ExceptionGroup("serve", [ExceptionGroup("lifespan", [taken])])
    assert str(bind_error(cfg, group)) == f"cannot bind {address}: address already in use"
    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert str(bind_error(cfg, unknown)) == f"cannot bind {address}: name or service not known"
