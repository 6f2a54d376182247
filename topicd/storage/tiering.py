"""The cold tier: which sealed segments leave the hot data directory, and how they move.

With `storage.cold_dir` set, a checkpoint relocates every sealed segment past the topic's
hot-retention bound from `<data_dir>/topics/<id>/` to the same place under the cold
root (`<cold_dir>/topics/<id>/`). The bound (`storage.tiering`): the newest
`hot_retain_segments` sealed segments of a topic stay hot, and with `hot_retain_bytes`
> 0 only as many of those as fit in that many data bytes (the stricter bound wins). The
hot set is always the newest ones: once a segment falls outside it, every older one does
too. The active (unsealed) segment is always hot and counts against neither bound.
Relocation is one way: relaxing the bound later leaves cold segments where they are.

A relocation is crash-safe by its order (docs/storage.md, "Cold tier"):

1. copy `.data` (and `.idx`) to the cold root, `fdatasync` each, fsync the cold
   directories (offloaded, in the checkpoint's absorb step);
2. the checkpoint's snapshot records the segment as cold (the registry is
   authoritative);
3. only then is the hot copy unlinked (with the checkpoint's other reclaimed files, one
   snapshot later).

A crash before 2 leaves the registry saying hot and the hot copy intact (a partial cold
copy is an orphan, removed by recovery); after 2, the cold copy is complete and durable
(a leftover hot copy is the orphan). Recovery looks for a hot-registered segment in both
places (an older snapshot may name as hot a segment whose hot copy is already gone), and
for a cold-registered one only in the cold tier: a hot copy may predate delete flags
flipped in the cold one, so serving it could resurrect deleted records.

**Ownership.** Recovery removes files under the cold root that its registry does not
name, so a cold directory shared by two data directories (one config copied to two
hosts over a shared mount, say) would lose segments. The first relocation gives the pair
an identity: a random id written to `<data_dir>/COLD_ID`, then to `<cold_dir>/COLD_ID`
(each atomically and durably, in that order). A cold directory whose `COLD_ID` is not the
data directory's (or exists while the data directory has none) belongs to another data
directory: recovery refuses and relocation fails, and nothing in it is touched.

Everything here is blocking and runs offloaded or in the recovery thread.
"""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING, Final, Protocol

from topicd.storage.fs import drop_synced, replace_file, write_all

if TYPE_CHECKING:
    from collections.abc import Sequence

    from topicd.config import TieringConfig
    from topicd.storage.fs import Fs

# a relocation copies (and syncs) in pieces of this size (a segment may be 64 MiB)
COPY_CHUNK: Final = 8 << 20
OWNER_FILE: Final = "COLD_ID"
# segment bytes one checkpoint relocates at most: a backlog (a newly set cold_dir over a
# large data directory, a lowered bound) moves over several checkpoints, taken one after
# the other (`Checkpointer.due`), instead of one checkpoint holding the WAL untrimmed for
# as long as the whole copy takes (and the final one at shutdown running past its bound)
RELOCATE_BYTES: Final = 256 << 20


def _read_id(fs: Fs, root: str) -> str | None:
    path = posixpath.join(root, OWNER_FILE)
    if not fs.exists(path):
        return None
    return fs.read(path).decode("ascii", "replace").strip()


def owner_problem(fs: Fs, data_root: str, cold_root: str) -> str | None:
    """Why the cold directory is not this data directory's (None when it is, or when
    it has no owner yet)."""
    if not fs.exists(cold_root):
        return None
    cold_id = _read_id(fs, cold_root)
    if cold_id is None:
        return None
    data_id = _read_id(fs, data_root)
    if data_id == cold_id:
        return None
    return (
        f"{posixpath.join(cold_root, OWNER_FILE)}: the cold directory belongs to another data "
        f"directory (its id {cold_id!r}, this data directory's "
        f"{'none' if data_id is None else repr(data_id)}); point storage.cold_dir at this "
        "data directory's cold tier, or at an empty directory"
    )


def claim(fs: Fs, data_root: str, cold_root: str) -> None:
    """Make the cold directory this data directory's (see the module docstring). Raises
    `OSError` if it belongs to another one."""
    problem = owner_problem(fs, data_root, cold_root)
    if problem is not None:
        raise OSError(17, problem)
    data_id = _read_id(fs, data_root)
    if data_id is None:
        data_id = os.urandom(8).hex()
        replace_file(fs, posixpath.join(data_root, OWNER_FILE), (data_id + "\n").encode())
    if _read_id(fs, cold_root) is None:
        ensure_dir(fs, cold_root)
        replace_file(fs, posixpath.join(cold_root, OWNER_FILE), (data_id + "\n").encode())


class Placed(Protocol):
    """What the plan needs to know of a segment."""

    @property
    def sealed(self) -> bool: ...

    @property
    def cold(self) -> bool: ...

    @property
    def data_len(self) -> int: ...


def to_relocate(segments: Sequence[Placed], tiering: TieringConfig) -> list[int]:
    """Indexes (ascending) of the hot sealed segments past the hot-retention bound.
    `segments` are one topic's, ascending by seq."""
    keep_n = tiering.hot_retain_segments
    keep_bytes = tiering.hot_retain_bytes
    kept = kept_bytes = 0
    full = False  # the hot set ended: every older sealed segment is past the bound
    out: list[int] = []
    for i in range(len(segments) - 1, -1, -1):
        seg = segments[i]
        if not seg.sealed:
            continue
        if (
            not full
            and kept < keep_n
            and (not keep_bytes or kept_bytes + seg.data_len <= keep_bytes)
        ):
            kept += 1
            kept_bytes += seg.data_len
            continue
        full = True
        if not seg.cold:
            out.append(i)
    out.reverse()
    return out


def copy_file(fs: Fs, src: str, dst: str, length: int | None = None) -> None:
    """Write the first `length` bytes of `src` (all of it for None) to `dst`, replacing
    whatever `dst` held, and `fdatasync` it. The caller fsyncs `dst`'s directory.

    Synced every `COPY_CHUNK` bytes, and the synced bytes of both files are dropped from
    the page cache: a WAL sync meanwhile never waits behind a whole segment's dirty pages
    (as with snapshots), and moving old data does not push recent data out of memory."""
    size = fs.size(src) if length is None else length
    sfd = fs.open(src)
    try:
        dfd = fs.open(dst, create=True)
        try:
            fs.ftruncate(dfd, 0)
            at = 0
            while at < size:
                piece = fs.pread(sfd, min(COPY_CHUNK, size - at), at)
                if not piece:
                    raise OSError(5, f"{src}: shorter than {size} bytes")
                write_all(fs, dfd, piece, at)
                fs.fdatasync(dfd)
                drop_synced(fs, dfd, at, at + len(piece))
                drop_synced(fs, sfd, at, at + len(piece))
                at += len(piece)
            if not size:
                fs.fdatasync(dfd)
        finally:
            fs.close(dfd)
    finally:
        fs.close(sfd)


def ensure_dir(fs: Fs, path: str) -> bool:
    """Create `path` (and missing parents) if needed, syncing the parents of what was
    created. True if anything was created."""
    if fs.exists(path):
        return False
    missing = [path]
    parent = posixpath.dirname(path)
    while parent and parent != "/" and not fs.exists(parent):
        missing.append(parent)
        parent = posixpath.dirname(parent)
    fs.mkdir(path)
    for made in reversed(missing):
        fs.fsync_dir(posixpath.dirname(made) or ".")
    return True
