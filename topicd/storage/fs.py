"""The filesystem seam: every file syscall topicd makes goes through an `Fs`.

`Fs` methods are synchronous and may block; the event loop never calls them directly but
through the offload seam (`topicd.offload`), which runs them in worker threads in
production and inline in deterministic tests. Recovery, which runs in one worker thread
before the engine starts, calls them directly.

`RealFs` maps each method to one or a few `os` calls. `topicd.testing.fake_fs` provides
`FakeDisk` (an in-memory disk that tells written bytes from synced ones and can `crash()`)
and `FaultFs` (injects errors into any `Fs`). Storage code translates `OSError` into
`StorageError` where it enters (STYLE §5); nothing above `storage/` sees an `OSError`.

Paths are plain `str`. File handles are opaque integers (file descriptors for `RealFs`).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import sys
from typing import Protocol


class Fs(Protocol):
    def open(self, path: str, *, create: bool = False, exclusive: bool = False) -> int:
        """Open for reading and writing; `create` makes a missing file, `exclusive` fails
        if it exists. Returns a handle."""
        ...

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        """Write at `offset`; returns the number of bytes written (may be short)."""
        ...

    def pread(self, fd: int, size: int, offset: int) -> bytes: ...

    def fdatasync(self, fd: int) -> None:
        """Make the file's written bytes durable (data, and the metadata needed to read
        them back)."""
        ...

    def fallocate(self, fd: int, length: int) -> None:
        """Reserve `length` bytes so later writes inside them never grow the file."""
        ...

    def drop_cache(self, fd: int, offset: int, length: int) -> None:
        """Advise that the file's synced bytes `offset .. offset + length` will not be read
        soon, so the OS may drop them from its page cache (advisory: dirty bytes stay; an
        error here is never a write error, callers ignore it)."""
        ...

    def ftruncate(self, fd: int, length: int) -> None: ...

    def close(self, fd: int) -> None: ...

    def size(self, path: str) -> int: ...

    def read(self, path: str) -> bytes:
        """The whole file."""
        ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]:
        """Entry names (not paths), any order."""
        ...

    def mkdir(self, path: str) -> None:
        """Create a directory (and missing parents); no error if it exists."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Atomic replace. Durable only after `fsync_dir` of the parent."""
        ...

    def unlink(self, path: str) -> None: ...

    def rmdir(self, path: str) -> None:
        """Remove an empty directory. Durable only after `fsync_dir` of the parent."""
        ...

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creates, renames, unlinks) durable."""
        ...


def drop_synced(fs: Fs, fd: int, offset: int, end: int) -> None:
    """`fs.drop_cache` over `offset .. end` (synced bytes), ignoring its errors.

    The WAL and snapshots are written once and read back only by recovery. Left in the
    page cache they pile up until the kernel must reclaim them inside later writes: on
    this project's machines a `pwrite` of 1.3 MB took 0.3 ms while the cache held under
    about 1 GB and 2.5-4.5 ms beyond (docs/decisions.md)."""
    if end > offset:
        with contextlib.suppress(OSError):
            fs.drop_cache(fd, offset, end - offset)


def write_all(fs: Fs, fd: int, data: bytes, offset: int) -> None:
    """`pwrite` until every byte is written (a short write is retried from where it
    stopped; a write that makes no progress raises `OSError(EIO)`)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        n = fs.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(5, "short write made no progress")
        done += n


def replace_file(fs: Fs, path: str, data: bytes | list[bytes], *, sync_every: int = 0) -> None:
    """Atomically and durably make `path` hold `data` (bytes, or pieces written in order):
    write `path.tmp`, fdatasync it, rename it over `path`, fsync the directory. A crash
    leaves the old or the new file.

    With `sync_every`, the file is also synced each time that many bytes were written
    since the last sync: a large file then never has more than that much dirty in the
    page cache, so a WAL `fdatasync` running meanwhile (whose journal commit may have to
    write this file's newly allocated blocks first) waits for at most that much."""
    tmp = path + ".tmp"
    fd = fs.open(tmp, create=True)
    try:
        fs.ftruncate(fd, 0)
        offset = 0
        unsynced = 0
        for piece in [data] if isinstance(data, bytes) else data:
            write_all(fs, fd, piece, offset)
            offset += len(piece)
            unsynced += len(piece)
            if sync_every and unsynced >= sync_every:
                fs.fdatasync(fd)
                drop_synced(fs, fd, offset - unsynced, offset)
                unsynced = 0
        fs.fdatasync(fd)
        drop_synced(fs, fd, offset - unsynced, offset)
    finally:
        fs.close(fd)
    fs.rename(tmp, path)
    fs.fsync_dir(posixpath.dirname(path))


class RealFs:
    """The operating system's filesystem."""

    def open(self, path: str, *, create: bool = False, exclusive: bool = False) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT
        if exclusive:
            flags |= os.O_EXCL
        return os.open(path, flags, 0o644)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def fdatasync(self, fd: int) -> None:
        if sys.platform == "darwin":  # pragma: no cover - fdatasync does not flush there
            import fcntl

            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
        else:
            os.fdatasync(fd)

    def fallocate(self, fd: int, length: int) -> None:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, length)
        else:  # pragma: no cover - macOS
            os.ftruncate(fd, length)

    def drop_cache(self, fd: int, offset: int, length: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def close(self, fd: int) -> None:
        os.close(fd)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def read(self, path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def mkdir(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
