"""The data directory and its lock: one topicd process per directory.

`lock_data_dir` creates the directory if needed and takes an exclusive, non-blocking
`flock` on `<data_dir>/.topicd.lock` (offloaded: file syscalls never run on the loop).
The lock lives as long as the returned file descriptor; the kernel releases it when the
process dies, however it dies, so a `kill -9` never leaves a stale lock behind.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class DataDirLocked(Exception):
    """Another process holds the data directory (the command exits 5)."""


class DataDirError(Exception):
    """The data directory cannot be created or opened."""


class DataDirLock:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (synchronous: closing an fd does not block)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _lock(path: Path) -> DataDirLock:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataDirError(f"cannot create data directory {path}: {exc.strerror}") from None
    lock_path = path / ".topicd.lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise DataDirError(f"cannot open {lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DataDirLocked(
                f"data directory {path} is locked by another topicd process"
            ) from None
        raise DataDirError(f"cannot lock {lock_path}: {exc.strerror}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return DataDirLock(path, fd)


async def lock_data_dir(path: Path) -> DataDirLock:
    return await trio.to_thread.run_sync(_lock, path)


@contextmanager
def hold_lock(path: str) -> Iterator[DataDirLock]:
    """The lock, held for a block of synchronous code (offline tools)."""
    lock = _lock(Path(path))
    try:
        yield lock
    finally:
        lock.release()
