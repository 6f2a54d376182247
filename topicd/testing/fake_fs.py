"""Filesystem doubles for the `Fs` seam: a disk that can lose power, faults, an order monitor.

* `FakeDisk` is an in-memory `Fs` that knows what a power loss keeps. Each file has a
  *pending* image (what `pread`/`read`/`size` see: the OS page cache) and a *durable*
  image (what is on the platter). Each directory has pending and durable entry sets
  (name → node). What becomes durable, and when:

  ==========================  ===============================================================
  call                        effect
  ==========================  ===============================================================
  `pwrite`                    pending bytes only (a zero-length write changes nothing)
  `fallocate`, `ftruncate`    pending length only (`fallocate` extends with zeros, never
                              shrinks)
  `fdatasync(fd)`             the file's durable image := its pending image (data *and*
                              length); says nothing about the file's names
  `open(create)`, `mkdir`,    pending entries of the parent directory only
  `rename`, `unlink`
  `fsync_dir(d)`              `d`'s durable entries := its pending entries (every create,
                              rename in or out, and unlink in `d` at once)
  ==========================  ===============================================================

  `crash()` is a power loss: every directory's entries revert to its durable set, every
  file's bytes and length to its durable image, and all handles become invalid (`EBADF`).
  So a created file whose entry was never made durable vanishes even if its data was
  synced; a rename whose directories were not synced reverts (the old target reappears
  with its old durable bytes); an unlink not synced reverts. Directory durability is per
  directory: a rename across directories with only the target directory synced leaves the
  file under both names after a crash (a hard link), which real journaling filesystems
  avoid but a correct program must not rely on either way.

  `crash(torn=True)` models a write that was in flight when the power went: for each
  file whose pending image differs from its durable image and that had a `pwrite` since
  its last `fdatasync`, the durable image gets a damaged copy of that *last* write laid
  over it at its offset (every earlier unsynced write, truncate and allocation is still
  lost). The damage is one of, chosen by a `random.Random(seed)`:

  * ``"prefix"``: only the first `k` bytes of the write land, `0 <= k < len`;
  * ``"zero"``: the whole write lands but one 512-byte sector (aligned to file offsets)
    that overlaps it reads back as zeros, clipped to the write's range;
  * ``"garble"``: the whole write lands with 1 to 8 distinct bytes XORed with a non-zero
    value.

  So bytes change only inside the last write's range, and the file may grow up to that
  range's end (a gap between the old durable end and the write reads as zeros). Files are
  visited in node-creation order, so the same seed and the same history give the same
  damage. `last_damage` lists what was applied.

  `snapshot()`/`restore()` copy the durable image (for crash-point sweeps), `mutations`
  counts mutating calls, and `crash_after(k)` crashes right after the k-th mutating call
  from now and powers the disk off: that call and every later call raise `PowerLoss`
  (an `OSError(EIO)`, so storage code treats it like a dead device) until `reboot()`.

* `FaultFs(inner)` wraps any `Fs` and fails, shortens or stalls chosen calls by rule.
* `MonitorFs(inner)` records call order and checks persistence-ordering rules live.

Paths are plain strings normalised with `posixpath.normpath`; in `FakeDisk` a relative
path is taken from the root (``"data/x" == "/data/x"``), and the root always exists.
Errors are the `OSError` subclasses the OS raises (`FileNotFoundError`, `FileExistsError`,
`IsADirectoryError`, `NotADirectoryError`, plain `OSError` with `EBADF`, `EINVAL`,
`ENOTEMPTY`). As on Linux, `exclusive` without `create` is ignored.

`FakeDisk` takes a lock around every call, so worker threads cannot corrupt it, but
deterministic tests drive it from the loop thread through `InlineOffload`.
"""

from __future__ import annotations

import abc
import errno as errno_codes
import os
import posixpath
import random
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from topicd.storage.fs import Fs

__all__ = [
    "FS_OPS",
    "MUTATING_OPS",
    "Call",
    "DirSyncBeforeUnlink",
    "DiskImage",
    "FakeDisk",
    "FaultFs",
    "MonitorFs",
    "MonitorState",
    "OrderingRule",
    "OrderingViolation",
    "PowerLoss",
    "SyncBeforeRename",
    "TornKind",
    "TornWrite",
]

FS_OPS = frozenset(
    {
        "open",
        "pwrite",
        "pread",
        "fdatasync",
        "fallocate",
        "drop_cache",
        "ftruncate",
        "close",
        "size",
        "read",
        "exists",
        "listdir",
        "mkdir",
        "rename",
        "unlink",
        "rmdir",
        "fsync_dir",
    }
)
"""Every `Fs` method name (the `op` of `FaultFs` rules)."""

MUTATING_OPS = frozenset(
    {
        "open",
        "pwrite",
        "fdatasync",
        "fallocate",
        "ftruncate",
        "mkdir",
        "rename",
        "unlink",
        "rmdir",
        "fsync_dir",
    }
)
"""Calls `FakeDisk.mutations` counts when they succeed (`open` and `mkdir` only when they
create something)."""

SECTOR_BYTES = 512

TornKind = Literal["prefix", "zero", "garble"]
TORN_KINDS: tuple[TornKind, ...] = ("prefix", "zero", "garble")


def _oserror(code: int, *paths: str) -> OSError:
    """`OSError(code, strerror, path[, path2])`: Python picks the subclass
    (`FileNotFoundError` for `ENOENT`, ...), as for a real syscall."""
    msg = os.strerror(code)
    if len(paths) == 2:
        return OSError(code, msg, paths[0], None, paths[1])
    if len(paths) == 1:
        return OSError(code, msg, paths[0])
    return OSError(code, msg)


class PowerLoss(OSError):
    """Raised by every call on a powered-off `FakeDisk` (after `crash_after` fired or
    `crash(power_off=True)`), until `reboot()`. Its errno is `EIO`, so storage code takes
    it for a dead device; tests can tell it apart by type."""

    def __init__(self, message: str = "power lost") -> None:
        super().__init__(errno_codes.EIO, message)


# --- FakeDisk ---------------------------------------------------------------------------


@dataclass(eq=False)
class _File:
    id: int
    data: bytearray = field(default_factory=bytearray)  # pending image
    durable: bytes = b""
    last_write: tuple[int, bytes] | None = None  # the last pwrite since the last fdatasync


@dataclass(eq=False)
class _Dir:
    id: int
    entries: dict[str, int] = field(default_factory=dict)  # pending
    durable: dict[str, int] = field(default_factory=dict)


_Node = _File | _Dir


@dataclass(frozen=True)
class DiskImage:
    """A durable image of a `FakeDisk` (from `snapshot()`, for `restore()`). Opaque;
    compare images with `FakeDisk.tree(durable=True)` rather than `==`, which also
    compares internal node ids."""

    dirs: Mapping[int, Mapping[str, int]]
    files: Mapping[int, bytes]
    next_id: int


@dataclass(frozen=True)
class TornWrite:
    """Damage `crash(torn=True)` applied to one file: `landed` (the damaged write) was laid
    over the durable image at `offset`; the original write was `length` bytes."""

    paths: tuple[str, ...]
    kind: TornKind
    offset: int
    length: int
    landed: bytes


_ROOT = 0


def _parts(path: str) -> list[str]:
    if path == "":
        raise _oserror(errno_codes.ENOENT, path)
    norm = posixpath.normpath(path)
    return [p for p in norm.split("/") if p not in ("", ".", "..")]


class FakeDisk:
    """An in-memory `Fs` with pending and durable views and a `crash()` (module doc)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._nodes: dict[int, _Node] = {_ROOT: _Dir(_ROOT)}
        self._next_id = _ROOT + 1
        self._handles: dict[int, int] = {}  # fd -> node id
        self._next_fd = 3  # never reused, so a stale handle is always EBADF
        self._powered = True
        self._crash_countdown: int | None = None
        self._crash_args: tuple[int | None, bool, TornKind | None] = (None, False, None)
        self.mutations = 0
        """Successful mutating calls so far (see `MUTATING_OPS`)."""
        self.last_damage: list[TornWrite] = []
        """What the last `crash(torn=True)` did, one entry per damaged file."""
        self.drops = 0
        """`drop_cache` calls so far (advisory, no effect on contents)."""

    # --- Fs ------------------------------------------------------------------------------

    def open(self, path: str, *, create: bool = False, exclusive: bool = False) -> int:
        with self._lock:
            self._check_power()
            parent, name, child = self._lookup(path)
            created = False
            if child is None:
                if not create:
                    raise _oserror(errno_codes.ENOENT, path)
                if path.endswith("/"):
                    raise _oserror(errno_codes.EISDIR, path)
                child = self._new_file().id
                parent.entries[name] = child
                created = True
            else:
                if create and exclusive:
                    raise _oserror(errno_codes.EEXIST, path)
                if isinstance(self._nodes[child], _Dir):
                    raise _oserror(errno_codes.EISDIR, path)
                if path.endswith("/"):
                    raise _oserror(errno_codes.ENOTDIR, path)
            fd = self._next_fd
            self._next_fd += 1
            self._handles[fd] = child
            if created:
                self._mutated()
            return fd

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        with self._lock:
            self._check_power()
            f = self._file(fd)
            if offset < 0:
                raise _oserror(errno_codes.EINVAL)
            chunk = bytes(data)
            if chunk:
                if len(f.data) < offset:
                    f.data.extend(bytes(offset - len(f.data)))
                f.data[offset : offset + len(chunk)] = chunk
                f.last_write = (offset, chunk)
            self._mutated()
            return len(chunk)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        with self._lock:
            self._check_power()
            f = self._file(fd)
            if offset < 0 or size < 0:
                raise _oserror(errno_codes.EINVAL)
            return bytes(f.data[offset : offset + size])

    def fdatasync(self, fd: int) -> None:
        with self._lock:
            self._check_power()
            f = self._file(fd)
            f.durable = bytes(f.data)
            f.last_write = None
            self._mutated()

    def drop_cache(self, fd: int, offset: int, length: int) -> None:
        """Advisory: no effect on contents (the fake has no page cache); counted."""
        with self._lock:
            self._check_power()
            self._file(fd)
            if offset < 0 or length < 0:
                raise _oserror(errno_codes.EINVAL)
            self.drops += 1

    def fallocate(self, fd: int, length: int) -> None:
        with self._lock:
            self._check_power()
            f = self._file(fd)
            if length <= 0:
                raise _oserror(errno_codes.EINVAL)
            if len(f.data) < length:
                f.data.extend(bytes(length - len(f.data)))
            self._mutated()

    def ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self._check_power()
            f = self._file(fd)
            if length < 0:
                raise _oserror(errno_codes.EINVAL)
            if len(f.data) < length:
                f.data.extend(bytes(length - len(f.data)))
            else:
                del f.data[length:]
            self._mutated()

    def close(self, fd: int) -> None:
        with self._lock:
            self._check_power()
            if self._handles.pop(fd, None) is None:
                raise _oserror(errno_codes.EBADF)
            self._gc()

    def size(self, path: str) -> int:
        with self._lock:
            self._check_power()
            node = self._node(path)
            return len(node.data) if isinstance(node, _File) else 0

    def read(self, path: str) -> bytes:
        with self._lock:
            self._check_power()
            node = self._node(path)
            if isinstance(node, _Dir):
                raise _oserror(errno_codes.EISDIR, path)
            return bytes(node.data)

    def exists(self, path: str) -> bool:
        with self._lock:
            self._check_power()
            try:
                self._node(path)
            except OSError:
                return False
            return True

    def listdir(self, path: str) -> list[str]:
        with self._lock:
            self._check_power()
            node = self._node(path)
            if isinstance(node, _File):
                raise _oserror(errno_codes.ENOTDIR, path)
            return list(node.entries)

    def mkdir(self, path: str) -> None:
        with self._lock:
            self._check_power()
            d = self._root()
            created = False
            for i, name in enumerate(parts := _parts(path)):
                child = d.entries.get(name)
                if child is None:
                    new = _Dir(self._alloc_id())
                    self._nodes[new.id] = new
                    d.entries[name] = new.id
                    created = True
                    d = new
                    continue
                node = self._nodes[child]
                if isinstance(node, _File):
                    last = i == len(parts) - 1
                    raise _oserror(errno_codes.EEXIST if last else errno_codes.ENOTDIR, path)
                d = node
            if created:
                self._mutated()

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            self._check_power()
            if not _parts(src) or not _parts(dst):
                raise _oserror(errno_codes.EBUSY, src, dst)
            sparent, sname, sid = self._lookup(src)
            dparent, dname, did = self._lookup(dst)  # a bad parent wins over a missing src
            if sid is None:
                raise _oserror(errno_codes.ENOENT, src, dst)
            if sid != did:
                snode = self._nodes[sid]
                s_parts, d_parts = _parts(src), _parts(dst)
                if d_parts[: len(s_parts)] == s_parts:  # into itself
                    raise _oserror(errno_codes.EINVAL, src, dst)
                if s_parts[: len(d_parts)] == d_parts:  # onto its own ancestor
                    raise _oserror(errno_codes.ENOTEMPTY, src, dst)
                if did is not None:
                    dnode = self._nodes[did]
                    if isinstance(snode, _File) and isinstance(dnode, _Dir):
                        raise _oserror(errno_codes.EISDIR, src, dst)
                    if isinstance(snode, _Dir) and isinstance(dnode, _File):
                        raise _oserror(errno_codes.ENOTDIR, src, dst)
                    if isinstance(dnode, _Dir) and dnode.entries:
                        raise _oserror(errno_codes.ENOTEMPTY, src, dst)
                del sparent.entries[sname]
                dparent.entries[dname] = sid
            self._mutated()

    def unlink(self, path: str) -> None:
        with self._lock:
            self._check_power()
            parent, name, child = self._lookup(path)
            if child is None:
                raise _oserror(errno_codes.ENOENT, path)
            if isinstance(self._nodes[child], _Dir):
                raise _oserror(errno_codes.EISDIR, path)
            del parent.entries[name]
            self._mutated()

    def rmdir(self, path: str) -> None:
        with self._lock:
            self._check_power()
            parent, name, child = self._lookup(path)
            if child is None:
                raise _oserror(errno_codes.ENOENT, path)
            node = self._nodes[child]
            if not isinstance(node, _Dir):
                raise _oserror(errno_codes.ENOTDIR, path)
            if node.entries:
                raise _oserror(errno_codes.ENOTEMPTY, path)
            del parent.entries[name]
            self._mutated()

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            self._check_power()
            node = self._node(path)
            if isinstance(node, _File):
                raise _oserror(errno_codes.ENOTDIR, path)
            node.durable = dict(node.entries)
            self._gc()
            self._mutated()

    # --- power loss --------------------------------------------------------------------

    def crash(
        self,
        seed: int | None = None,
        torn: bool = False,
        *,
        kind: TornKind | None = None,
        power_off: bool = False,
    ) -> None:
        """Lose power now (module doc): every file and directory reverts to its durable
        image and every handle becomes invalid (`EBADF`).

        `torn` damages each file's last unsynced write as it lands, with a
        `random.Random(seed)` (`None` means seed 0, so a crash is always reproducible);
        `kind` forces one damage kind instead of a random one. `power_off` keeps the disk
        off (every call raises `PowerLoss`) until `reboot()`, for when the process that
        "lost power" is still running code in the test."""
        with self._lock:
            rng = random.Random(0 if seed is None else seed)
            for node in self._nodes.values():
                if isinstance(node, _Dir):
                    node.entries = dict(node.durable)
            self._handles.clear()
            self._gc()
            self.last_damage = []
            for node in sorted(self._nodes.values(), key=lambda n: n.id):
                if not isinstance(node, _File):
                    continue
                durable = node.durable
                if torn and node.last_write is not None and bytes(node.data) != durable:
                    durable = self._tear(node, node.last_write, rng, kind)
                node.durable = durable
                node.data = bytearray(durable)
                node.last_write = None
            self._crash_countdown = None
            if power_off:
                self._powered = False

    def crash_after(
        self,
        calls: int | None,
        *,
        seed: int | None = None,
        torn: bool = False,
        kind: TornKind | None = None,
    ) -> None:
        """Arm a crash right after the `calls`-th successful mutating call from now: that
        call takes effect, then `crash(seed, torn, kind=kind, power_off=True)` runs and the
        call raises `PowerLoss`. `0` crashes (and powers off) now; `None` disarms.

        A crash-point sweep::

            image = disk.snapshot()
            before = disk.mutations; op(disk); m = disk.mutations - before
            for k in range(m + 1):
                disk.restore(image)
                disk.crash_after(k)
                with contextlib.suppress(PowerLoss):
                    op(disk)
                disk.reboot()
                check(recover(disk))
        """
        with self._lock:
            if calls is not None and calls < 0:
                raise ValueError("calls must be >= 0")
            self._crash_args = (seed, torn, kind)
            self._crash_countdown = calls
            if calls == 0:
                self.crash(seed, torn, kind=kind, power_off=True)

    def reboot(self) -> None:
        """Power the disk back on after a crash that powered it off (the durable image is
        kept; old handles stay invalid)."""
        with self._lock:
            self._powered = True

    @property
    def powered(self) -> bool:
        return self._powered

    def snapshot(self) -> DiskImage:
        """A copy of the durable image (pending bytes and entries are not included)."""
        with self._lock:
            dirs: dict[int, Mapping[str, int]] = {}
            files: dict[int, bytes] = {}
            for node in self._nodes.values():
                if isinstance(node, _Dir):
                    dirs[node.id] = dict(node.durable)
                else:
                    files[node.id] = node.durable
            image = DiskImage(dirs=dirs, files=files, next_id=self._next_id)
            return self._durable_subset(image)

    def restore(self, image: DiskImage) -> None:
        """Replace the whole disk with `image`, as after a crash: pending = durable, all
        handles invalid, powered on, any `crash_after` disarmed. `mutations` keeps
        counting."""
        with self._lock:
            nodes: dict[int, _Node] = {}
            for nid, entries in image.dirs.items():
                nodes[nid] = _Dir(nid, entries=dict(entries), durable=dict(entries))
            for nid, data in image.files.items():
                nodes[nid] = _File(nid, data=bytearray(data), durable=data)
            self._nodes = nodes
            self._next_id = image.next_id
            self._handles.clear()
            self._powered = True
            self._crash_countdown = None
            self.last_damage = []

    # --- inspection (bug-catching helpers; not part of `Fs`, never counted) -------------

    def durable_bytes(self, path: str) -> bytes | None:
        """The bytes `path` would hold after a (non-torn) crash now; `None` if it would
        not exist or would be a directory."""
        with self._lock:
            node = self._resolve(path, durable=True)
            return node.durable if isinstance(node, _File) else None

    def pending_bytes(self, path: str) -> bytes | None:
        """The bytes `path` holds now as the OS sees them; `None` if it does not exist or
        is a directory."""
        with self._lock:
            node = self._resolve(path, durable=False)
            return bytes(node.data) if isinstance(node, _File) else None

    def durable_listdir(self, path: str) -> list[str] | None:
        """The entries of directory `path` that would survive a crash now."""
        with self._lock:
            node = self._resolve(path, durable=True)
            return list(node.durable) if isinstance(node, _Dir) else None

    def tree(self, *, durable: bool = False) -> dict[str, bytes]:
        """Every file reachable from the root as ``{"/a/b": bytes}``, in the pending view
        or (with `durable`) the view a crash now would leave."""
        with self._lock:
            return {
                path: (node.durable if durable else bytes(node.data))
                for path, node in self._walk(durable=durable)
                if isinstance(node, _File)
            }

    def unsynced(self) -> list[str]:
        """Pending-view paths whose state a crash would change: files whose bytes differ
        from their durable image, and directories (with a trailing ``/``) whose entries
        differ from their durable entries. Empty after a complete, correct sync."""
        with self._lock:
            out: list[str] = []
            for path, node in self._walk(durable=False):
                if isinstance(node, _File):
                    if bytes(node.data) != node.durable:
                        out.append(path)
                elif node.entries != node.durable:
                    out.append(path.rstrip("/") + "/")
            return sorted(out)

    def sync_all(self) -> None:
        """Make everything durable at once (test setup; not a counted call)."""
        with self._lock:
            for node in self._nodes.values():
                if isinstance(node, _Dir):
                    node.durable = dict(node.entries)
                else:
                    node.durable = bytes(node.data)
                    node.last_write = None
            self._gc()

    @property
    def open_handles(self) -> int:
        """Handles opened and not yet closed (a leak detector)."""
        return len(self._handles)

    # --- internals -----------------------------------------------------------------------

    def _check_power(self) -> None:
        if not self._powered:
            raise PowerLoss("disk is powered off (crashed); call reboot()")

    def _mutated(self) -> None:
        self.mutations += 1
        if self._crash_countdown is not None:
            self._crash_countdown -= 1
            if self._crash_countdown <= 0:
                seed, torn, kind = self._crash_args
                self.crash(seed, torn, kind=kind, power_off=True)
                raise PowerLoss("crash_after fired")

    def _alloc_id(self) -> int:
        nid = self._next_id
        self._next_id += 1
        return nid

    def _new_file(self) -> _File:
        f = _File(self._alloc_id())
        self._nodes[f.id] = f
        return f

    def _root(self) -> _Dir:
        root = self._nodes[_ROOT]
        assert isinstance(root, _Dir)
        return root

    def _file(self, fd: int) -> _File:
        nid = self._handles.get(fd)
        if nid is None:
            raise _oserror(errno_codes.EBADF)
        node = self._nodes[nid]
        assert isinstance(node, _File)
        return node

    def _lookup(self, path: str) -> tuple[_Dir, str, int | None]:
        """The parent directory of `path` (pending view), the last name, and the node id
        it names (or `None`). Raises `ENOENT`/`ENOTDIR` for a bad parent."""
        parts = _parts(path)
        if not parts:
            # the root names itself; callers treat it as an existing directory
            return self._root(), "", _ROOT
        d = self._root()
        for name in parts[:-1]:
            child = d.entries.get(name)
            if child is None:
                raise _oserror(errno_codes.ENOENT, path)
            node = self._nodes[child]
            if isinstance(node, _File):
                raise _oserror(errno_codes.ENOTDIR, path)
            d = node
        return d, parts[-1], d.entries.get(parts[-1])

    def _node(self, path: str) -> _Node:
        _, _, child = self._lookup(path)
        if child is None:
            raise _oserror(errno_codes.ENOENT, path)
        node = self._nodes[child]
        if path.endswith("/") and isinstance(node, _File):
            raise _oserror(errno_codes.ENOTDIR, path)
        return node

    def _resolve(self, path: str, *, durable: bool) -> _Node | None:
        node: _Node = self._root()
        for name in _parts(path):
            if not isinstance(node, _Dir):
                return None
            child = (node.durable if durable else node.entries).get(name)
            if child is None or child not in self._nodes:
                return None
            node = self._nodes[child]
        return node

    def _walk(self, *, durable: bool) -> Iterator[tuple[str, _Node]]:
        stack: list[tuple[str, _Node]] = [("/", self._root())]
        seen: set[int] = set()
        while stack:
            path, node = stack.pop()
            if node.id in seen:  # a file under two names (partial cross-dir rename)
                yield path, node
                continue
            seen.add(node.id)
            yield path, node
            if isinstance(node, _Dir):
                entries = node.durable if durable else node.entries
                for name, child in sorted(entries.items(), reverse=True):
                    if child in self._nodes:
                        stack.append((posixpath.join(path, name), self._nodes[child]))

    def _gc(self) -> None:
        """Drop nodes no pending or durable entry and no handle can reach."""
        live: set[int] = {_ROOT, *self._handles.values()}
        stack = [_ROOT]
        while stack:
            node = self._nodes.get(stack.pop())
            if isinstance(node, _Dir):
                for child in (*node.entries.values(), *node.durable.values()):
                    if child not in live:
                        live.add(child)
                        stack.append(child)
        for nid in [n for n in self._nodes if n not in live]:
            del self._nodes[nid]

    def _durable_subset(self, image: DiskImage) -> DiskImage:
        """`image` without nodes unreachable through durable entries."""
        keep: set[int] = set()
        stack = [_ROOT]
        while stack:
            nid = stack.pop()
            if nid in keep:
                continue
            keep.add(nid)
            stack.extend(image.dirs.get(nid, {}).values())
        return DiskImage(
            dirs={n: e for n, e in image.dirs.items() if n in keep},
            files={n: b for n, b in image.files.items() if n in keep},
            next_id=image.next_id,
        )

    def _paths_of(self, nid: int) -> tuple[str, ...]:
        return tuple(p for p, n in self._walk(durable=True) if n.id == nid)

    def _tear(
        self, f: _File, write: tuple[int, bytes], rng: random.Random, kind: TornKind | None
    ) -> bytes:
        offset, data = write
        chosen: TornKind = kind if kind is not None else rng.choice(TORN_KINDS)
        landed = bytearray(data)
        if chosen == "prefix":
            del landed[rng.randrange(len(data)) :]
        elif chosen == "zero":
            sector = rng.randint(offset // SECTOR_BYTES, (offset + len(data) - 1) // SECTOR_BYTES)
            lo = max(offset, sector * SECTOR_BYTES) - offset
            hi = min(offset + len(data), (sector + 1) * SECTOR_BYTES) - offset
            landed[lo:hi] = bytes(hi - lo)
        else:
            for i in rng.sample(range(len(data)), rng.randint(1, min(len(data), 8))):
                landed[i] ^= rng.randint(1, 255)
        out = bytearray(f.durable)
        if landed:
            if len(out) < offset:
                out.extend(bytes(offset - len(out)))
            out[offset : offset + len(landed)] = landed
        self.last_damage.append(
            TornWrite(self._paths_of(f.id), chosen, offset, len(data), bytes(landed))
        )
        return bytes(out)


# --- shared by the wrappers -------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One `Fs` call as the wrappers see it: `op` (method name), `paths` (the path
    arguments, or for handle calls the path the handle was opened under, as far as the
    wrapper knows; renames update it) and the raw `args`."""

    op: str
    paths: tuple[str, ...]
    args: tuple[object, ...]

    @property
    def path(self) -> str:
        """The first path (`""` if unknown)."""
        return self.paths[0] if self.paths else ""

    def describe(self) -> tuple[str, ...]:
        return (self.op, *self.paths)


def _norm(path: str) -> str:
    return posixpath.normpath(path)


def _parent(path: str) -> str:
    """The normalised directory holding `path` (``"."`` for a bare relative name)."""
    return posixpath.dirname(_norm(path)) or "."


def _under(path: str, directory: str) -> bool:
    """`path` is strictly inside `directory` (lexically, after normalisation)."""
    p, d = _norm(path), _norm(directory)
    if d in (".", "/"):
        return p not in (".", "/")
    return p.startswith(d + "/")


class _Forwarding:
    """Forwards every `Fs` call to `inner`, tracking handle → path, logging each call as
    `(op, *paths)` in `calls`, with `_before`/`_after` hooks for subclasses."""

    def __init__(self, inner: Fs) -> None:
        self.inner = inner
        self.calls: list[tuple[str, ...]] = []
        self._fd_paths: dict[int, str] = {}

    def _before(self, call: Call) -> None:
        """Runs before the inner call (may raise)."""

    def _after(self, call: Call) -> None:
        """Runs after the inner call succeeded."""

    def _begin(self, op: str, paths: tuple[str, ...], args: tuple[object, ...]) -> Call:
        call = Call(op, paths, args)
        self.calls.append(call.describe())
        self._before(call)
        return call

    def _fd(self, fd: int) -> tuple[str, ...]:
        path = self._fd_paths.get(fd)
        return (path,) if path is not None else ()

    def open(self, path: str, *, create: bool = False, exclusive: bool = False) -> int:
        call = self._begin("open", (_norm(path),), (path, create, exclusive))
        fd = self.inner.open(path, create=create, exclusive=exclusive)
        self._fd_paths[fd] = _norm(path)
        self._after(call)
        return fd

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        call = self._begin("pwrite", self._fd(fd), (fd, data, offset))
        n = self.inner.pwrite(fd, data, offset)
        self._after(call)
        return n

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        call = self._begin("pread", self._fd(fd), (fd, size, offset))
        out = self.inner.pread(fd, size, offset)
        self._after(call)
        return out

    def fdatasync(self, fd: int) -> None:
        call = self._begin("fdatasync", self._fd(fd), (fd,))
        self.inner.fdatasync(fd)
        self._after(call)

    def fallocate(self, fd: int, length: int) -> None:
        call = self._begin("fallocate", self._fd(fd), (fd, length))
        self.inner.fallocate(fd, length)
        self._after(call)

    def drop_cache(self, fd: int, offset: int, length: int) -> None:
        call = self._begin("drop_cache", self._fd(fd), (fd, offset, length))
        self.inner.drop_cache(fd, offset, length)
        self._after(call)

    def ftruncate(self, fd: int, length: int) -> None:
        call = self._begin("ftruncate", self._fd(fd), (fd, length))
        self.inner.ftruncate(fd, length)
        self._after(call)

    def close(self, fd: int) -> None:
        call = self._begin("close", self._fd(fd), (fd,))
        self.inner.close(fd)
        self._fd_paths.pop(fd, None)
        self._after(call)

    def size(self, path: str) -> int:
        call = self._begin("size", (_norm(path),), (path,))
        out = self.inner.size(path)
        self._after(call)
        return out

    def read(self, path: str) -> bytes:
        call = self._begin("read", (_norm(path),), (path,))
        out = self.inner.read(path)
        self._after(call)
        return out

    def exists(self, path: str) -> bool:
        call = self._begin("exists", (_norm(path),), (path,))
        out = self.inner.exists(path)
        self._after(call)
        return out

    def listdir(self, path: str) -> list[str]:
        call = self._begin("listdir", (_norm(path),), (path,))
        out = self.inner.listdir(path)
        self._after(call)
        return out

    def mkdir(self, path: str) -> None:
        call = self._begin("mkdir", (_norm(path),), (path,))
        self.inner.mkdir(path)
        self._after(call)

    def rename(self, src: str, dst: str) -> None:
        call = self._begin("rename", (_norm(src), _norm(dst)), (src, dst))
        self.inner.rename(src, dst)
        s, d = _norm(src), _norm(dst)
        for fd, p in self._fd_paths.items():
            if p == s:
                self._fd_paths[fd] = d
            elif _under(p, s):
                self._fd_paths[fd] = d + p[len(s) :]
        self._after(call)

    def unlink(self, path: str) -> None:
        call = self._begin("unlink", (_norm(path),), (path,))
        self.inner.unlink(path)
        self._after(call)

    def rmdir(self, path: str) -> None:
        call = self._begin("rmdir", (_norm(path),), (path,))
        self.inner.rmdir(path)
        self._after(call)

    def fsync_dir(self, path: str) -> None:
        call = self._begin("fsync_dir", (_norm(path),), (path,))
        self.inner.fsync_dir(path)
        self._after(call)


# --- FaultFs ----------------------------------------------------------------------------


@dataclass(eq=False)
class _Rule:
    op: str
    action: Literal["fail", "short", "stall"]
    skip: int  # matching calls still to let through before the rule fires
    always: bool
    predicate: Callable[[Call], bool] | None
    errno: int = errno_codes.EIO
    nbytes: int | None = None
    seconds: float = 0.0

    def matches(self, call: Call) -> bool:
        return call.op == self.op and (self.predicate is None or self.predicate(call))


class FaultFs(_Forwarding):
    """Wraps any `Fs` and injects faults by rule.

    A rule names an `op` (an `Fs` method, see `FS_OPS`) and which of its calls it hits:
    calls are counted from when the rule is added, and only calls for which `predicate`
    (if given) returns true count. `nth=n` hits the n-th such call; `always=True` hits
    every such call from the n-th on (from the first if `nth` is `None`); with neither,
    the next such call is hit once. A hit of a `fail` rule raises
    `OSError(errno, message)` *before* the inner call, so the inner `Fs` is untouched
    (an `fdatasync` that fails leaves the data pending; a `rename` that fails does not
    happen); the exception is `close`, which releases the handle and then raises, as
    close(2) does. Rules count calls independently; when several hit one call, stalls are
    recorded first, then the first `fail` raises, else a short write applies.

    A write that lands partly and then hits `ENOSPC` is `short_write(1)` plus
    `fail("pwrite", nth=2, errno=ENOSPC)`.

    `calls` logs every call as `(op, *paths)` (handle calls show the path the handle
    was opened under), failed ones included; `injected` logs each fault that fired as
    `(op, what, *paths)` with `what` an errno name, ``"short"`` or ``"stall"``.
    """

    def __init__(self, inner: Fs, *, on_stall: Callable[[Call, float], None] | None = None) -> None:
        super().__init__(inner)
        self._rules: list[_Rule] = []
        self.injected: list[tuple[str, ...]] = []
        self.stalls: list[tuple[str, float]] = []
        """`(op, seconds)` for each call a stall rule hit."""
        self.on_stall = on_stall
        """Called as `on_stall(call, seconds)` when a stall rule hits, before the inner
        call (e.g. to move a `MockClock`, or to tell an offload delay what to do)."""

    def fail(
        self,
        op: str,
        *,
        nth: int | None = None,
        always: bool = False,
        errno: int = errno_codes.EIO,
        predicate: Callable[[Call], bool] | None = None,
    ) -> None:
        """Make matching calls of `op` raise `OSError(errno)` (`EIO`, `ENOSPC`, `EROFS`,
        `EDQUOT`, ...). See the class doc for `nth`/`always`/`predicate`."""
        self._add(_Rule(op, "fail", self._skip(nth), always, predicate, errno=errno))

    def short_write(
        self,
        nth: int = 1,
        *,
        nbytes: int | None = None,
        always: bool = False,
        predicate: Callable[[Call], bool] | None = None,
    ) -> None:
        """Make the `nth` `pwrite` from now write only its first `nbytes` bytes (default
        half, at least 1) and return that count, as a real short write does; the caller
        must retry the rest (`topicd.storage.fs.write_all` does). `nbytes=0` makes the
        write return 0, which `write_all` reports as `EIO`."""
        if nbytes is not None and nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        self._add(_Rule("pwrite", "short", self._skip(nth), always, predicate, nbytes=nbytes))

    def stall(
        self,
        op: str,
        seconds: float,
        *,
        nth: int | None = None,
        always: bool = False,
        predicate: Callable[[Call], bool] | None = None,
    ) -> None:
        """Mark matching calls of `op` as stalling for `seconds`. Nothing sleeps here
        (`Fs` calls are synchronous): a hit is appended to `stalls` and passed to
        `on_stall`; `next_stall_s(op)` tells an `InlineOffload` delay function, which runs
        before the call, how long the next call of `op` would stall."""
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        self._add(_Rule(op, "stall", self._skip(nth), always, predicate, seconds=seconds))

    def next_stall_s(self, op: str) -> float:
        """The stall the next call of `op` would hit (predicates are not evaluated: a rule
        with a predicate counts if its turn has come). 0.0 if none."""
        for rule in self._rules:
            if rule.op == op and rule.action == "stall" and rule.skip == 0:
                return rule.seconds
        return 0.0

    def clear(self) -> None:
        """Remove every rule (the logs are kept)."""
        self._rules.clear()

    @property
    def rules(self) -> int:
        """Rules still armed (a once-rule disappears when it fires)."""
        return len(self._rules)

    def _skip(self, nth: int | None) -> int:
        if nth is None:
            return 0
        if nth < 1:
            raise ValueError("nth counts from 1 (the next call)")
        return nth - 1

    def _add(self, rule: _Rule) -> None:
        if rule.op not in FS_OPS:
            raise ValueError(f"unknown Fs op {rule.op!r}; one of {sorted(FS_OPS)}")
        self._rules.append(rule)

    def _hits(self, call: Call) -> list[_Rule]:
        hits: list[_Rule] = []
        for rule in list(self._rules):
            if not rule.matches(call):
                continue
            if rule.skip > 0:
                rule.skip -= 1
                continue
            hits.append(rule)
            if not rule.always:
                self._rules.remove(rule)
        return hits

    def _apply(self, call: Call) -> _Rule | None:
        """Fire the rules hit by `call`: record stalls, raise a failure, or return the
        short-write rule to apply."""
        hits = self._hits(call)
        for rule in hits:
            if rule.action == "stall":
                self.stalls.append((call.op, rule.seconds))
                self.injected.append((call.op, "stall", *call.paths))
                if self.on_stall is not None:
                    self.on_stall(call, rule.seconds)
        for rule in hits:
            if rule.action == "fail":
                name = errno_codes.errorcode.get(rule.errno, str(rule.errno))
                self.injected.append((call.op, name, *call.paths))
                where = f" on {call.path}" if call.paths else ""
                if call.op == "close":
                    # like close(2): the handle is released even when an error is reported
                    fd = call.args[0]
                    assert isinstance(fd, int)
                    self.inner.close(fd)
                    self._fd_paths.pop(fd, None)
                raise OSError(rule.errno, f"{os.strerror(rule.errno)} (injected: {call.op}{where})")
        for rule in hits:
            if rule.action == "short":
                return rule
        return None

    def _before(self, call: Call) -> None:
        if call.op != "pwrite":
            self._apply(call)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        call = Call("pwrite", self._fd(fd), (fd, data, offset))
        self.calls.append(call.describe())
        short = self._apply(call)
        if short is not None:
            n = short.nbytes if short.nbytes is not None else max(1, len(data) // 2)
            data = data[: min(n, len(data))]
            self.injected.append(("pwrite", "short", *call.paths))
        return self.inner.pwrite(fd, data, offset)


# --- MonitorFs --------------------------------------------------------------------------


class OrderingViolation(AssertionError):
    """A persistence-ordering rule was broken (a bug in the code under test)."""


@dataclass
class MonitorState:
    """What `MonitorFs` knows about durability so far, by normalised path: files with
    writes (`pwrite`/`ftruncate`/`fallocate`) not yet covered by an `fdatasync`, and, per
    directory, names added (create, rename in, mkdir) not yet covered by an
    `fsync_dir`."""

    unsynced_files: set[str] = field(default_factory=set)
    unsynced_adds: dict[str, set[str]] = field(default_factory=dict)

    def file_synced(self, path: str) -> bool:
        return _norm(path) not in self.unsynced_files

    def dir_synced(self, path: str) -> bool:
        return not self.unsynced_adds.get(_norm(path))


class OrderingRule(abc.ABC):
    """A check run before each call; returns a violation message or `None`. Subclass and
    pass to `MonitorFs.add_rule` for new rules."""

    name = "rule"

    @abc.abstractmethod
    def check(self, call: Call, state: MonitorState) -> str | None:
        """The violation `call` would commit given `state`, or None."""


class SyncBeforeRename(OrderingRule):
    """A rename whose target is inside `into` needs its source fully `fdatasync`ed (a
    snapshot temp file is synced before it replaces the snapshot)."""

    name = "sync-before-rename"

    def __init__(self, into: str) -> None:
        self.into = _norm(into)

    def check(self, call: Call, state: MonitorState) -> str | None:
        if call.op != "rename" or not _under(call.paths[1], self.into):
            return None
        src, dst = call.paths
        if state.file_synced(src):
            return None
        return f"rename {src} -> {dst} before an fdatasync of {src} covered its writes"


class DirSyncBeforeUnlink(OrderingRule):
    """An unlink inside `under` needs every name added to that file's directory to be
    durable first (the new snapshot's entry is synced before the old one is removed).
    Unlinks and renames out of a directory do not need a sync before the next unlink."""

    name = "dir-sync-before-unlink"

    def __init__(self, under: str) -> None:
        self.under = _norm(under)

    def check(self, call: Call, state: MonitorState) -> str | None:
        if call.op != "unlink" or not _under(call.path, self.under):
            return None
        parent = _parent(call.path)
        if state.dir_synced(parent):
            return None
        added = sorted(state.unsynced_adds.get(parent, set()))
        return f"unlink {call.path} before fsync_dir({parent}) made {added} durable"


class MonitorFs(_Forwarding):
    """Wraps any `Fs`, records the order of calls and checks ordering rules.

    `require_synced_before_rename(into)` and `require_dir_synced_before_unlink(under)` add
    the two built-in rules; `add_rule` adds others. Rules run before each call is
    forwarded; a violation is appended to `violations` and, if `live` (the default),
    raised as `OrderingViolation` from that call, so the violating call never reaches the
    disk. State updates only after a call succeeds (a failed `fdatasync` covers nothing).

    The state is kept by path and is conservative: `open(create=True)` counts as adding
    the name even if the file existed, and `mkdir` as adding its last component.
    `calls` logs `(op, *paths)`; `assert_before` checks an order on that log.
    """

    def __init__(self, inner: Fs, *, live: bool = True) -> None:
        super().__init__(inner)
        self.live = live
        self.state = MonitorState()
        self.violations: list[str] = []
        self._rules: list[OrderingRule] = []

    def add_rule(self, rule: OrderingRule) -> None:
        self._rules.append(rule)

    def require_synced_before_rename(self, into: str) -> None:
        self.add_rule(SyncBeforeRename(into))

    def require_dir_synced_before_unlink(self, under: str) -> None:
        self.add_rule(DirSyncBeforeUnlink(under))

    def assert_ok(self) -> None:
        """Raise `OrderingViolation` listing every violation recorded so far."""
        if self.violations:
            raise OrderingViolation("; ".join(self.violations))

    def assert_before(self, earlier: tuple[str, ...], later: tuple[str, ...]) -> None:
        """Every logged call starting with `later` (e.g. ``("rename", tmp)``) has a call
        starting with `earlier` before it, and `later` happened at least once."""
        seen_earlier = False
        seen_later = False
        for entry in self.calls:
            if entry[: len(later)] == later:
                seen_later = True
                if not seen_earlier:
                    raise OrderingViolation(f"{later} happened without {earlier} before it")
            if entry[: len(earlier)] == earlier:
                seen_earlier = True
        if not seen_later:
            raise OrderingViolation(f"{later} never happened")

    def _before(self, call: Call) -> None:
        for rule in self._rules:
            msg = rule.check(call, self.state)
            if msg is None:
                continue
            msg = f"{rule.name}: {msg}"
            self.violations.append(msg)
            if self.live:
                raise OrderingViolation(msg)

    def _after(self, call: Call) -> None:
        st = self.state
        op = call.op
        if op in ("pwrite", "ftruncate", "fallocate") and call.paths:
            st.unsynced_files.add(call.path)
        elif op == "fdatasync" and call.paths:
            st.unsynced_files.discard(call.path)
        elif (op == "open" and call.args[1] is True) or op == "mkdir":
            self._added(call.path)
        elif op == "rename":
            src, dst = call.paths
            self._removed(src)
            self._added(dst)
            moved = {p for p in st.unsynced_files if p == src or _under(p, src)}
            st.unsynced_files -= moved
            st.unsynced_files |= {dst + p[len(src) :] for p in moved}
        elif op in ("unlink", "rmdir"):
            st.unsynced_files.discard(call.path)
            self._removed(call.path)
        elif op == "fsync_dir":
            st.unsynced_adds.pop(call.path, None)

    def _added(self, path: str) -> None:
        parent, name = _parent(path), posixpath.basename(path)
        self.state.unsynced_adds.setdefault(parent, set()).add(name)

    def _removed(self, path: str) -> None:
        parent, name = _parent(path), posixpath.basename(path)
        adds = self.state.unsynced_adds.get(parent)
        if adds is not None:
            adds.discard(name)
            if not adds:
                del self.state.unsynced_adds[parent]


if TYPE_CHECKING:
    # the doubles satisfy the seam
    _fake_disk: Fs = FakeDisk()
    _fault_fs: Fs = FaultFs(_fake_disk)
    _monitor_fs: Fs = MonitorFs(_fault_fs)
