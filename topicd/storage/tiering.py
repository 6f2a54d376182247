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

Everything here is blocking and runs offloaded or in the recovery thread.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Final, Protocol

from topicd.storage.fs import drop_synced, write_all

if TYPE_CHECKING:
    from collections.abc import Sequence

    from topicd.config import TieringConfig
    from topicd.storage.fs import Fs

# a relocation copies (and syncs) in pieces of this size (a segment may be 64 MiB)
COPY_CHUNK: Final = 8 << 20


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
