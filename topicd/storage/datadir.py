"""The data directory and its lock: one topicd process per directory.

The lock is an exclusive, non-blocking `flock` on the directory itself (a read-only
descriptor of the directory), so taking it adds nothing to the directory: `verify`, a
refused start and a start whose listener cannot bind leave the directory exactly as they
found it. The lock lives as long as the descriptor; the kernel releases it when the process
dies, however it dies, so a `kill -9` never leaves a stale lock behind.

Earlier versions locked a `.topicd.lock` file inside the directory instead. Where that
file exists it is locked as well (opened read-only: never created, written or removed),
so a process of an earlier version still running on the directory is seen (exit 5), and
one started later sees this process. A leftover file is harmless and may stay.

A missing directory is not created when it is locked: `serve` binds its listener first
and only then calls `create_data_dir`, so a start that fails before that leaves nothing
on disk. `flock` on a directory needs a local filesystem; where it is refused (some
network filesystems) the start fails with the reason rather than running unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Final

import trio

if TYPE_CHECKING:
    from collections.abc import Iterator

LEGACY_LOCK_FILE: Final = ".topicd.lock"
_BUSY: Final = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class DataDirLocked(Exception):
    """Another process holds the data directory (the command exits 5)."""


class DataDirError(Exception):
    """The data directory cannot be created, opened or locked."""


class DataDirLock:
    """The held lock: the directory's descriptor (and the earlier lock file's, if any)."""

    def __init__(self, path: Path, fds: list[int]) -> None:
        self.path = path
        self._fds = fds

    def release(self) -> None:
        """Drop the lock (synchronous: closing an fd does not block). Idempotent."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def _flock(fd: int, path: Path, what: Path) -> None:
    """Lock `fd` exclusively or raise (the caller closes `fd` on failure)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _BUSY:
            raise DataDirLocked(
                f"data directory {path} is locked by another topicd process"
            ) from None
        raise DataDirError(f"cannot lock {what}: {exc.strerror}") from None


def lock_existing(path: Path) -> DataDirLock | None:
    """Lock `path` without adding anything to it; None if it does not exist.

    Raises:
        DataDirLocked: another process holds it.
        DataDirError: it is not a directory, or cannot be opened or locked.
    """
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise DataDirError(f"data directory {path} is not a directory") from None
    except OSError as exc:
        raise DataDirError(f"cannot open data directory {path}: {exc.strerror}") from None
    fds = [dir_fd]
    try:
        _flock(dir_fd, path, path)
        legacy = path / LEGACY_LOCK_FILE
        try:
            fds.append(os.open(legacy, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise DataDirError(f"cannot open {legacy}: {exc.strerror}") from None
        else:
            _flock(fds[-1], path, legacy)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return DataDirLock(path, fds)


def _make_dirs(path: Path) -> None:
    """`mkdir -p`, each new entry made durable by syncing the directory that holds it."""
    missing: list[Path] = []
    at = path.absolute()
    while not at.exists():
        missing.append(at)
        at = at.parent
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:
            continue  # made meanwhile (another start on the same path): the lock decides
        fd = os.open(new.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def create_and_lock(path: Path) -> DataDirLock:
    """Create `path` (and missing parents) if needed, then lock it (`serve`, once bound).

    Raises:
        DataDirLocked: another process holds it (it may have created it first).
        DataDirError: it cannot be created, or is not a directory.
    """
    try:
        _make_dirs(path)
    except OSError as exc:
        raise DataDirError(f"cannot create data directory {path}: {exc.strerror}") from None
    lock = lock_existing(path)
    if lock is None:
        raise DataDirError(f"data directory {path} disappeared while it was being created")
    return lock


async def open_data_dir(path: Path) -> DataDirLock | None:
    """`lock_existing` in a worker thread (file syscalls never run on the loop)."""
    return await trio.to_thread.run_sync(lock_existing, path)


async def create_data_dir(path: Path) -> DataDirLock:
    """`create_and_lock` in a worker thread."""
    return await trio.to_thread.run_sync(create_and_lock, path)


@contextmanager
def hold_lock(path: str) -> Iterator[DataDirLock]:
    """The lock on an existing directory, held for a block of synchronous code (offline
    tools: never creates anything). Raises `DataDirError` if the directory is missing."""
    lock = lock_existing(Path(path))
    if lock is None:
        raise DataDirError(f"data directory {path} does not exist")
    try:
        yield lock
    finally:
        lock.release()
