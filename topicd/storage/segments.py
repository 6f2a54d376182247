"""Per-topic segment files: where a persistent topic's records live once the WAL is trimmed.

Layout (docs/storage.md)::

    <data_dir>/topics/<topic_id:016x>/seg-<first_seq:020d>.data   frames
                                      seg-<first_seq:020d>.idx    20 bytes per seq, at seal
                                      seg-<first_seq:020d>.meta   index columns per absorb

A `.data` file is a sequence of frames in the WAL's frame format (`topicd.storage.frame`):
checksummed and self-delimiting. Storage format 2 writes *run frames* (`encode_run`): up
to `RUN_MAX_RECORDS` consecutive records under one checksum, followed by one delete flag
per record outside the checksum, record k's at the frame's last byte minus k. Format 1
wrote one-record Append frames, whose `tail` byte is the same flag (k = 0); both are
read (`read_seg_frame`). A flag is `0xD5` = deleted, anything else live; flipping it is
one single-byte write, so a crash leaves the record live or deleted, never malformed.
The absorb frames runs straight from the captured slices of the log (C-level joins and
column copies), so it does no Python work per record.

A segment covers consecutive seqs `first .. last`. A seq whose record was already dead
when it was absorbed has no frame (`ABSENT` in the index). The active (unsealed) segment
is appended to; it is sealed on `storage.segments.max_events` slots, `max_bytes` data
bytes or `max_age_ms` of age, and then gets its `.idx`: per seq `offset u32, len u32,
ts i64, flags u8, 3 zero bytes` (flags: 1 deleted, 2 absent). Every index (in memory,
`.meta`, `.idx`) gives a seq its frame's offset and length, shared by a run's records
(`slot_frame` finds a record's place in its run).

With `storage.cold_dir` set, sealed segments past the topic's hot-retention bound live
under the same layout in the cold root instead (`cold` in the registry; relocation is a
step of the checkpoint's absorb: `topicd.storage.tiering`).

The *registry* — per segment `first`, `last`, `data_len`, sealed, created — is carried by
the snapshot and is authoritative: bytes past `data_len` are truncated at recovery (a
checkpoint that wrote them never committed) and files it does not name are orphans,
removed once recovery succeeded.

Verification: every read verifies the checksum of each frame it reads (`read_record`,
`read_range`: damage raises `SegmentCorruption`, counted and logged, never served). At
recovery (`load_segment`) a sealed segment with a usable `.meta` is checked for presence,
length and the `.meta` alone (its data is left to those reads, so a start reads no
sealed data byte); the active segment's data is checked against the `.meta` digests and
its last frame decoded; `check_data` (`topicd verify`) checks every segment's data.

Everything here that touches files is blocking and runs offloaded (checkpoint) or in the
recovery thread. The loop-side state (`SegmentStore`) changes only when a checkpoint
committed (`install`), so a failed checkpoint leaves it describing what the newest
snapshot says.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import logging
import posixpath
import re
import struct
import sys
from array import array
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Final, TypeAlias, TypeVar, cast

import msgspec
import xxhash

from topicd.storage import frame as frames
from topicd.storage import tiering
from topicd.storage.fs import drop_synced, write_all

if TYPE_CHECKING:
    from collections.abc import Iterable

    from topicd.config import SegmentsConfig, TieringConfig
    from topicd.storage.fs import Fs

log = logging.getLogger("topicd.segments")

TOPICS_DIR: Final = "topics"
DELETED: Final = 0xD5
ABSENT: Final = 0xFFFFFFFF
IDX: Final = struct.Struct("<IIqB3x")  # 20 bytes per seq
IDX_DELETED: Final = 1
IDX_ABSENT: Final = 2
_ABSENT_SLOT: Final = array("I", [ABSENT])
_SEG: Final = re.compile(r"seg-([0-9]{20})\.(data|idx|meta)")
_TOPIC_DIR: Final = re.compile(r"[0-9a-f]{16}")
# a run of absent seqs longer than this starts a new segment instead of padding the index
_MAX_PAD: Final = 4096
# `.meta` chunk header: magic, slots, base seq, flips, extras bytes, data start and end,
# XXH3-64 of those data bytes as absorbed (every tail 0x00), the sum of the slots' record
# sizes (so a start adds one number per chunk, not one per record), XXH3-64 of the
# chunk's other bytes (this header's first 48 bytes, then the columns, flips and extras)
META_MAGIC: Final = b"TSM2"
_CHUNK: Final = struct.Struct("<4sIQIIIIQQQ")  # 56 bytes
# the chunks the release before the size sum wrote (still read: their sizes are summed)
META_MAGIC_V1: Final = b"TSM1"
_CHUNK_V1: Final = struct.Struct("<4sIQIIIIQQ")  # 48 bytes
_LITTLE: Final = sys.byteorder == "little"
Extras: TypeAlias = tuple[
    dict[int, str], dict[int, str], dict[int, int], dict[int, tuple[int, int]]
]
_EXTRAS_ENC: Final = msgspec.msgpack.Encoder()
_EXTRAS_DEC: Final = msgspec.msgpack.Decoder(Extras)


class SegmentCorruption(Exception):
    """A segment read found bytes that fail their checksum (or a missing/short file)."""

    def __init__(self, path: str, offset: int, reason: str) -> None:
        super().__init__(f"{path} offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class SegSnap(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """A registry entry as the snapshot stores it."""

    first: int
    last: int
    data_len: int
    sealed: bool
    created_ms: int
    cold: bool = False  # relocated to the cold tier (`topicd.storage.tiering`)
    # the valid length of the `.meta` side file; -1: none (recovery decodes the frames)
    meta_len: int = -1


@dataclass(slots=True)
class Segment:
    """One segment file's index: per seq `first .. last`, where its frame is."""

    first: int
    last: int  # first - 1 while empty
    data_len: int
    sealed: bool
    created_ms: int
    offsets: array[int] = field(default_factory=lambda: array("I"))  # ABSENT: no frame
    lens: array[int] = field(default_factory=lambda: array("I"))
    ts: array[int] = field(default_factory=lambda: array("q"))  # empty once sealed
    flags: bytearray = field(default_factory=bytearray)  # 1: the tail says deleted
    cold: bool = False  # its files are under the cold root
    meta_len: int = -1  # the `.meta` bytes the registry names (-1: no side file)

    def copy(self) -> Segment:
        return Segment(
            self.first,
            self.last,
            self.data_len,
            self.sealed,
            self.created_ms,
            array("I", self.offsets),
            array("I", self.lens),
            array("q", self.ts),
            bytearray(self.flags),
            self.cold,
            self.meta_len,
        )

    def snap(self) -> SegSnap:
        return SegSnap(
            self.first,
            self.last,
            self.data_len,
            self.sealed,
            self.created_ms,
            self.cold,
            self.meta_len,
        )

    @property
    def slots(self) -> int:
        return self.last - self.first + 1

    def all_dead(self) -> bool:
        """No live frame left (every slot absent or flagged deleted)."""
        return all(f or o == ABSENT for f, o in zip(self.flags, self.offsets, strict=True))

    def add(self, seq: int, offset: int, length: int, ts: int) -> None:
        """Index `seq` (padding absent slots before it)."""
        while self.last + 1 < seq:
            self.last += 1
            self.offsets.append(ABSENT)
            self.lens.append(0)
            self.ts.append(ts)
            self.flags.append(0)
        assert seq == self.last + 1
        self.last = seq
        self.offsets.append(offset)
        self.lens.append(length)
        self.ts.append(ts)
        self.flags.append(0)


def topic_dir(root: str, topic_id: int) -> str:
    return posixpath.join(root, TOPICS_DIR, f"{topic_id:016x}")


def data_path(root: str, topic_id: int, first: int) -> str:
    return posixpath.join(topic_dir(root, topic_id), f"seg-{first:020d}.data")


def idx_path(root: str, topic_id: int, first: int) -> str:
    return posixpath.join(topic_dir(root, topic_id), f"seg-{first:020d}.idx")


def meta_path(root: str, topic_id: int, first: int) -> str:
    return posixpath.join(topic_dir(root, topic_id), f"seg-{first:020d}.meta")


def _le(arr: array[int]) -> bytes:
    if not _LITTLE:  # pragma: no cover
        arr = array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def _column(typecode: str, raw: bytes | memoryview) -> array[int]:
    arr = array(typecode)
    arr.frombytes(raw)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr


def _extend(arr: array[int], raw: bytes | memoryview) -> None:
    """Append the little-endian column `raw` to `arr` in place (one copy, no
    intermediate array: a start loads every retained record's index this way)."""
    if _LITTLE:
        arr.frombytes(raw)
    else:  # pragma: no cover
        arr.extend(_column(arr.typecode, raw))


def encode_chunk(
    base: int,
    offsets: array[int],
    lens: array[int],
    ts: array[int],
    sizes: array[int],
    flags: bytes | bytearray,
    flips: list[int],
    extras: Extras,
    data: tuple[int, int, int],
) -> bytes:
    """One `.meta` chunk: the index columns of the slots `base ..` (offset, frame length,
    `$ts`, record size, delete flag), seqs flipped to deleted, the slots' sparse extras,
    and `data` = (start, end, XXH3-64) of the data bytes those slots' frames were written
    to (every tail still 0x00)."""
    n = len(offsets)
    assert len(lens) == len(ts) == len(sizes) == len(flags) == n
    ex = _EXTRAS_ENC.encode(extras) if any(extras) else b""
    payload = b"".join(
        [
            _le(offsets),
            _le(lens),
            _le(ts),
            _le(sizes),
            bytes(flags),
            _le(array("Q", flips)),
            ex,
        ]
    )
    total = sum(sizes)  # (the absorb's own slots: a start then reads one number)
    head = _CHUNK.pack(
        META_MAGIC, n, base, len(flips), len(ex), data[0], data[1], data[2], total, 0
    )
    digest = xxhash.xxh3_64(head[:48])
    digest.update(payload)
    return head[:48] + struct.pack("<Q", digest.intdigest()) + payload


# ---- records ------------------------------------------------------------------------


@dataclass(slots=True)
class AbsorbRecord:
    """One live record to copy into a segment, with its sparse extras."""

    seq: int
    ts: int
    enc: bytes
    size: int
    tag: str | None = None
    node: str | None = None
    prio: int = 0
    shape: tuple[int, int] | None = None

    def frame(self, topic_id: int) -> bytes:
        extras = frames.Extras(
            None,
            {0: self.tag} if self.tag is not None else {},
            {0: self.node} if self.node is not None else {},
            {0: self.prio} if self.prio else {},
            {0: self.shape} if self.shape is not None else {},
        )
        return frames.encode_append(
            topic_id,
            self.seq,
            self.ts,
            [self.enc],
            [self.size],
            extras,
            fsync_class=False,
            max_frame=frames.LEGACY_MAX_FRAME,
        )


def decode_record(frame: frames.Frame) -> AbsorbRecord:
    """The record of a segment frame (raises `FrameError` on a malformed body)."""
    if frame.ftype != frames.APPEND or frame.count != 1:
        raise frames.FrameError("a segment frame must be a one-record Append")
    body = frames.decode_append(frame)
    ex = body.extras
    shape = ex.shapes.get(0)
    return AbsorbRecord(
        frame.seq,
        frame.ts_ms,
        body.encs[0],
        body.sizes[0],
        ex.tags.get(0),
        ex.nodes.get(0),
        ex.prios.get(0, 0),
        None if shape is None else (shape[0], shape[1]),
    )


# ---- run frames -----------------------------------------------------------------------
#
# A run frame holds consecutive records of one topic in one checksummed frame: the WAL's
# frame head (type `RUN`, `seq` = the first record's, `ts_ms` = its `$ts`, `count` = n),
# then the body
#
#     u32 extras_len | n × i64 ts | n × u32 size | extras | enc_0 0x00 enc_1 .. enc_{n-1}
#
# then the XXH3-64 of bytes [4, 40 + body_len) and n delete flags, record k's at the
# frame's last byte minus k (so a one-record Append frame's `tail` is its k = 0 flag:
# one formula for both kinds). The flags sit outside the checksum: flipping one is a
# one-byte write, as before. `frame_len` = 36 + body_len + 8 + n.

RUN: Final = 14  # the frame type (segments only; the WAL never holds one)
RUN_MAX_RECORDS: Final = 512  # records per run frame, at most (a format limit)
RUN_MAX_BYTES: Final = 128 << 10  # record text per run frame, about (a record may end past it)
_RUN_HEAD: Final = struct.Struct("<IBBHQQQIII")  # a frame head + the body's extras_len
_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_FRAME_EXTRAS_ENC: Final = msgspec.msgpack.Encoder()
_FRAME_EXTRAS_DEC: Final = msgspec.msgpack.Decoder(frames.Extras)
_NO_EXTRAS: Final = frames.Extras()


def encode_run(
    topic_id: int,
    first_seq: int,
    encs: list[bytes],
    ts: array[int],
    sizes: array[int],
    extras: frames.Extras = _NO_EXTRAS,
    joined: bytes | None = None,
) -> bytes | None:
    """The run frame of `len(encs)` (1 ..= `RUN_MAX_RECORDS`) consecutive records from
    `first_seq` on (every flag live), or None if a record holds a raw NUL byte (the
    caller frames those records one by one). Extras are indexed from 0 in the run.
    `joined`, if given, must be `b"\\x00".join(encs)`."""
    n = len(encs)
    assert 0 < n <= RUN_MAX_RECORDS
    assert len(ts) == len(sizes) == n
    if joined is None:
        joined = b"\x00".join(encs)
    if joined.count(0) != n - 1:
        return None
    blob = b"" if extras == _NO_EXTRAS else _FRAME_EXTRAS_ENC.encode(extras)
    ts_b, sizes_b = _le(ts), _le(sizes)
    body_len = 4 + 12 * n + len(blob) + len(joined)
    head = _RUN_HEAD.pack(
        36 + body_len + 8 + n, RUN, 0, 0, topic_id, first_seq, ts[0], n, body_len, len(blob)
    )
    digest = xxhash.xxh3_64(memoryview(head)[4:])
    digest.update(ts_b)
    digest.update(sizes_b)
    digest.update(blob)
    digest.update(joined)
    return b"".join((head, ts_b, sizes_b, blob, joined, _U64.pack(digest.intdigest()), bytes(n)))


@dataclass(slots=True)
class SegFrame:
    """A checksum-valid segment frame: a one-record Append (`legacy`) or a run."""

    seq: int  # the first record's
    count: int
    end: int  # offset past its last flag byte
    legacy: frames.Frame | None  # the one-record Append frame
    body: memoryview  # a run's body (empty for a legacy frame)

    def encs(self) -> list[bytes]:
        """Every record's stored JSON, in order (raises `FrameError` on a bad body)."""
        if self.legacy is not None:
            return [frames.single_enc(self.legacy)]
        body, n = self.body, self.count
        (elen,) = _U32.unpack_from(body, 0)
        at = 4 + 12 * n + elen
        if at > len(body):
            raise frames.FrameError("run body too short for its columns")
        encs = bytes(body[at:]).split(b"\x00")
        if len(encs) != n:
            raise frames.FrameError("run record count does not match its separators")
        return encs

    def records(self) -> list[AbsorbRecord]:
        """Every record with its `$ts`, size and extras (raises `FrameError`)."""
        if self.legacy is not None:
            return [decode_record(self.legacy)]
        body, n = self.body, self.count
        encs = self.encs()
        (elen,) = _U32.unpack_from(body, 0)
        ts = _column("q", body[4 : 4 + 8 * n])
        sizes = _column("I", body[4 + 8 * n : 4 + 12 * n])
        ex = _NO_EXTRAS
        if elen:
            try:
                ex = _FRAME_EXTRAS_DEC.decode(body[4 + 12 * n : 4 + 12 * n + elen])
            except msgspec.DecodeError as exc:
                raise frames.FrameError(f"run extras: {exc}") from None
        out = [
            AbsorbRecord(self.seq + k, t, e, z)
            for k, (e, t, z) in enumerate(zip(encs, ts, sizes, strict=True))
        ]
        for k, tag in ex.tags.items():
            out[k].tag = tag
        for k, node in ex.nodes.items():
            out[k].node = node
        for k, prio in ex.prios.items():
            out[k].prio = prio
        for k, shape in ex.shapes.items():
            out[k].shape = (shape[0], shape[1])
        return out


def read_seg_frame(buf: bytes | memoryview, offset: int, limit: int) -> SegFrame | None:
    """The valid segment frame at `offset` (within `buf[:limit]`), or None if the bytes
    there are not one (checksum mismatch, lengths that do not add up, cut short). Raises
    `FrameError` for a checksum-valid frame that a segment cannot hold."""
    if offset + frames.FRAME_HEAD_LEN > limit:
        return None
    frame_len, ftype, _flags, reserved, _tid, seq, _ts, count, body_len = (
        frames.FRAME_HEAD.unpack_from(buf, offset)
    )
    if ftype != RUN:
        frame = frames.read_frame(buf, offset, limit, frames.LEGACY_MAX_FRAME)
        if frame is None:
            return None
        if frame.ftype != frames.APPEND or frame.count != 1:
            raise frames.FrameError("a segment frame must be a one-record Append or a run")
        return SegFrame(frame.seq, 1, frame.end, frame, memoryview(b""))
    end = offset + 4 + frame_len
    if (
        reserved
        or not 0 < count <= RUN_MAX_RECORDS
        or frame_len != 36 + body_len + 8 + count
        or body_len < 4 + 12 * count
        or end > limit
    ):
        return None
    view = memoryview(buf)
    body_end = offset + frames.FRAME_HEAD_LEN + body_len
    (expected,) = _U64.unpack_from(buf, body_end)
    if xxhash.xxh3_64_intdigest(view[offset + 4 : body_end]) != expected:
        return None
    return SegFrame(seq, count, end, None, view[offset + frames.FRAME_HEAD_LEN : body_end])


def flagged_seqs(data: bytes, limit: int) -> list[int]:
    """The seqs whose delete flag is set in the frames of `data[:limit]` (a segment's
    bytes; raises `FrameError` where a frame does not verify)."""
    out: list[int] = []
    pos = 0
    while pos < limit:
        frame = read_seg_frame(data, pos, limit)
        if frame is None:
            raise frames.FrameError(f"no valid frame at {pos}")
        out += [frame.seq + k for k in range(frame.count) if data[frame.end - 1 - k] == DELETED]
        pos = frame.end
    return out


def slot_frame(seg: Segment, i: int) -> tuple[int, int, int]:
    """Slot `i`'s frame (offset, length) and the record's index k in it: the slots of
    one frame are consecutive and share its offset (the first of them is at most
    `RUN_MAX_RECORDS - 1` slots back; C-level search)."""
    off = seg.offsets[i]
    assert off != ABSENT
    return off, seg.lens[i], i - seg.offsets.index(off, max(0, i - RUN_MAX_RECORDS + 1), i + 1)


@dataclass(slots=True)
class _Appended:
    """What one absorb appended to one segment, for its `.meta` chunk."""

    before: int  # the segment's `last` before
    start: int  # its `data_len` before
    sizes: array[int] = field(default_factory=lambda: array("I"))  # per slot appended
    digest: int = 0  # XXH3-64 of the bytes appended (every flag 0x00)


def _chunk_of(seg: Segment, work: AbsorbWork, mark: _Appended | None, flips: list[int]) -> bytes:
    """The `.meta` chunk of one absorb into `seg` (b"" if it changed nothing there)."""
    if mark is not None and mark.before == seg.last:
        mark = None  # (sealed before anything was appended to it)
    if mark is None and not flips:
        return b""
    if mark is None:
        empty_i, empty_q = array("I"), array("q")
        return encode_chunk(
            0, empty_i, empty_i, empty_q, empty_i, b"", flips, ({}, {}, {}, {}), (0, 0, 0)
        )
    i = mark.before - seg.first + 1
    base = mark.before + 1
    assert len(mark.sizes) == seg.last - mark.before
    return encode_chunk(
        base,
        seg.offsets[i:],
        seg.lens[i:],
        seg.ts[i:],
        mark.sizes,
        seg.flags[i:],
        flips,
        work.extras_between(base, seg.last),
        (mark.start, seg.data_len, mark.digest),
    )


# ---- the per-topic state ----------------------------------------------------------------


@dataclass(slots=True)
class TopicSegments:
    topic_id: int
    segments: list[Segment] = field(default_factory=list)
    absorbed: int = 0  # every seq ≤ this was considered by an absorb (in a segment or dead)

    def find(self, seq: int) -> Segment | None:
        segs = self.segments
        i = bisect.bisect_right(segs, seq, key=lambda s: s.first) - 1
        if i < 0:
            return None
        seg = segs[i]
        return seg if seq <= seg.last else None


@dataclass(slots=True)
class AbsorbSlice:
    """Consecutive slots `base ..` of a topic's log as captured (C-level copies)."""

    base: int
    encs: list[bytes | None]
    ts: array[int]
    sizes: array[int]


@dataclass(slots=True)
class AbsorbWork:
    """What one checkpoint does to one topic's segments. Captured on the loop as slices
    of the log and copies of the sparse extras; the checkpoint's thread frames them
    straight from the slices, so neither side does per-record Python work."""

    topic_id: int
    slices: list[AbsorbSlice]  # the slots above the registered `absorbed`, ascending
    flips: list[int]  # seqs killed since the last checkpoint (flip their tail if present)
    earliest: int  # the topic's earliest live seq: sealed segments wholly below go
    absorbed_to: int  # the new `absorbed` mark (the captured head)
    tags: dict[int, str] = field(default_factory=dict)
    nodes: dict[int, str] = field(default_factory=dict)
    prios: dict[int, int] = field(default_factory=dict)
    shapes: dict[int, tuple[int, int]] = field(default_factory=dict)

    def has_extras(self) -> bool:
        return bool(self.tags or self.nodes or self.prios or self.shapes)

    def extras_between(self, lo: int, hi: int) -> Extras:
        """The sparse extras of the seqs `lo ..= hi`."""
        out: Extras = ({}, {}, {}, {})
        for src, dst in zip((self.tags, self.nodes, self.prios, self.shapes), out, strict=True):
            if src:
                dst.update({seq: v for seq, v in src.items() if lo <= seq <= hi})  # type: ignore[attr-defined]
        return out


class _Sparse:
    """A work's sparse extras, windowed per run frame (sorted keys: a bisect per run)."""

    def __init__(self, work: AbsorbWork) -> None:
        self.tags = (sorted(work.tags), work.tags)
        self.nodes = (sorted(work.nodes), work.nodes)
        self.prios = (sorted(work.prios), work.prios)
        self.shapes = (sorted(work.shapes), work.shapes)

    def window(self, lo: int, hi: int) -> frames.Extras:
        """The extras of the seqs `lo .. hi - 1`, indexed from 0 at `lo`."""
        return frames.Extras(
            None,
            _window(self.tags, lo, hi),
            _window(self.nodes, lo, hi),
            _window(self.prios, lo, hi),
            _window(self.shapes, lo, hi),
        )


_V = TypeVar("_V")


def _window(sparse: tuple[list[int], dict[int, _V]], lo: int, hi: int) -> dict[int, _V]:
    keys, values = sparse
    if not keys:
        return {}
    a, b = bisect.bisect_left(keys, lo), bisect.bisect_left(keys, hi)
    return {keys[j] - lo: values[keys[j]] for j in range(a, b)}


@dataclass(slots=True)
class TopicOutcome:
    state: TopicSegments  # the new state (copies; installed once the snapshot is durable)
    dropped: list[str]  # files of segments left out of the new registry
    flipped: int = 0
    sealed: int = 0
    # hot files of segments copied to the cold tier: removed once the snapshot naming the
    # cold copies is durable
    moved: list[str] = field(default_factory=list)
    relocated: int = 0


class StoredRange(dict[int, bytes]):
    """Records read back from segments (seq → stored JSON), and how many of the segments
    read were in the cold tier (`performance.cold_segments_read`)."""

    __slots__ = ("cold",)

    def __init__(self) -> None:
        super().__init__()
        self.cold = 0


@dataclass(slots=True)
class AbsorbOutcome:
    topics: dict[int, TopicOutcome] = field(default_factory=dict)
    gone_dirs: list[str] = field(default_factory=list)  # topics deleted since: their dirs
    records: int = 0
    bytes: int = 0
    relocated_bytes: int = 0  # segment bytes copied to the cold tier
    tier_backlog: bool = False  # segments left to relocate for want of budget
    tier_due: set[int] = field(default_factory=set)  # of `topics`: still one to relocate


class SegmentStore:
    """Every persistent topic's segments (registry + index); see the module docstring."""

    def __init__(
        self,
        fs: Fs,
        root: str,
        cfg: SegmentsConfig,
        *,
        write_idx: bool = True,
        cold_root: str = "",
        tiering: TieringConfig | None = None,
    ) -> None:
        self.fs = fs
        self.root = root
        self.cfg = cfg
        self.write_idx = write_idx
        self.cold_root = cold_root  # "" = no cold tier
        self.tiering = tiering
        self.tier_due: set[int] = set()  # topics with a sealed segment to relocate
        self.cold_reads = 0  # segment reads served from the cold tier (metric)
        self.relocated_total = 0
        self._claimed = False  # the cold root is known to be this data directory's
        self.tier_backlog = False  # the last checkpoint ran out of relocation budget
        self.topics: dict[int, TopicSegments] = {}
        self.corruptions = 0  # segment reads that failed their checksum (metric)
        self.sealed_total = 0
        self.dropped_total = 0
        self.flipped_total = 0
        self.absorbed_records = 0
        self._active: list[tuple[int, int]] | None = None  # (created_ms, topic id), a heap

    def state(self, topic_id: int) -> TopicSegments:
        st = self.topics.get(topic_id)
        if st is None:
            st = self.topics[topic_id] = TopicSegments(topic_id)
        return st

    def absorbed(self, topic_id: int) -> int:
        st = self.topics.get(topic_id)
        return 0 if st is None else st.absorbed

    def aged(self, now_ms: int) -> set[int]:
        """Topics whose active segment is due to seal by age (`max_age_ms`): a heap of
        active segments by creation time, so the cost follows the segments due."""
        max_age = self.cfg.max_age_ms
        if max_age <= 0:
            return set()
        heap = self._active
        if heap is None:
            heap = self._active = [
                (st.segments[-1].created_ms, tid)
                for tid, st in self.topics.items()
                if st.segments and not st.segments[-1].sealed
            ]
            heapq.heapify(heap)
        out: set[int] = set()
        limit = now_ms - max_age
        while heap and heap[0][0] <= limit:
            created, tid = heapq.heappop(heap)
            st = self.topics.get(tid)
            if st is None or not st.segments:
                continue
            last = st.segments[-1]
            if not last.sealed and last.created_ms == created:
                out.add(tid)
        for tid in out:  # still due until a checkpoint sealed them
            heapq.heappush(heap, (self.topics[tid].segments[-1].created_ms, tid))
        return out

    def registry(self, topic_id: int) -> list[SegSnap]:
        st = self.topics.get(topic_id)
        return [] if st is None else [s.snap() for s in st.segments]

    def stats(self) -> dict[str, int]:
        segs = [s for st in self.topics.values() for s in st.segments]
        cold = [s for s in segs if s.cold] if self.cold_root else []
        return {
            "segments": len(segs),
            "sealed": sum(s.sealed for s in segs),
            "bytes": sum(s.data_len for s in segs),
            "corruptions": self.corruptions,
            "cold_segments": len(cold),
            "cold_bytes": sum(s.data_len for s in cold),
            "cold_reads": self.cold_reads,
            "relocated": self.relocated_total,
        }

    def base(self, seg: Segment) -> str:
        """The root `seg`'s files are under (the data directory, or the cold root)."""
        return self.cold_root if seg.cold else self.root

    # ---- checkpoint: absorb (blocking, offloaded) -----------------------------------

    def absorb(self, works: list[AbsorbWork], gone_ids: set[int], now_ms: int) -> AbsorbOutcome:
        """Copy the captured records into segments, flip delete flags, seal, and sync
        every touched file and new directory. Never changes `self` (see `install`)."""
        out = AbsorbOutcome()
        topics_root = posixpath.join(self.root, TOPICS_DIR)
        if works and not self.fs.exists(topics_root):
            self.fs.mkdir(topics_root)
            self.fs.fsync_dir(self.root)
        for work in works:
            res = out.topics[work.topic_id] = self._absorb_topic(work, now_ms, out)
            if self.cold_root and self.tiering is not None:
                self._relocate(res, out)
        if self.cold_root and self.tiering is not None:
            # topics with nothing to absorb (a router feeds them now, say) still relocate
            for tid in sorted(self.tier_due - out.topics.keys() - gone_ids):
                old = self.topics.get(tid)
                if old is not None:
                    res = TopicOutcome(TopicSegments(tid, list(old.segments), old.absorbed), [])
                    self._relocate(res, out)
                    out.topics[tid] = res
            out.tier_due = {
                tid for tid, res in out.topics.items() if self._tier_due(res.state.segments)
            }
        for tid in sorted(gone_ids):
            if tid in self.topics:
                out.gone_dirs.append(topic_dir(self.root, tid))
                if self.cold_root:
                    out.gone_dirs.append(topic_dir(self.cold_root, tid))
        return out

    def _absorb_topic(self, work: AbsorbWork, now_ms: int, out: AbsorbOutcome) -> TopicOutcome:
        fs = self.fs
        cfg = self.cfg
        tid = work.topic_id
        old = self.topics.get(tid)
        state = TopicSegments(
            tid,
            list(old.segments) if old is not None else [],
            max(work.absorbed_to, old.absorbed if old is not None else 0),
        )
        result = TopicOutcome(state, [])
        segs = state.segments
        aged = (
            bool(segs)
            and not segs[-1].sealed
            and cfg.max_age_ms > 0
            and now_ms - segs[-1].created_ms >= cfg.max_age_ms
        )
        below = bool(segs) and segs[0].sealed and segs[0].last < work.earliest
        slots = any(sl.encs for sl in work.slices)
        if not (slots or work.flips or aged or below):
            return result  # nothing to do: most topics at most checkpoints
        tdir = topic_dir(self.root, tid)
        if not fs.exists(tdir):
            fs.mkdir(tdir)
            fs.fsync_dir(posixpath.dirname(tdir))
        owned: set[int] = set()  # segments copied (copy-on-write: the loop's index stays)
        touched: dict[int, int] = {}  # segment first → open handle
        new_files = False

        def own(i: int) -> Segment:
            if segs[i].first not in owned:
                segs[i] = segs[i].copy()
                owned.add(segs[i].first)
            return segs[i]

        def handle(seg: Segment, *, create: bool = False) -> int:
            fd = touched.get(seg.first)
            if fd is None:
                fd = fs.open(data_path(self.base(seg), tid, seg.first), create=create)
                touched[seg.first] = fd
            return fd

        # what each touched segment's `.meta` chunk records: the slots appended and the
        # seqs flipped
        appended: dict[int, _Appended] = {}
        flipped: dict[int, list[int]] = {}
        metas: dict[int, int] = {}  # segment first → open `.meta` handle
        try:
            # 1. delete flags of records killed since the last checkpoint
            firsts = [sg.first for sg in segs]
            for seq in sorted(set(work.flips)):
                i = bisect.bisect_right(firsts, seq) - 1
                if i < 0 or seq > segs[i].last:
                    continue
                j = seq - segs[i].first
                if segs[i].flags[j] or segs[i].offsets[j] == ABSENT:
                    continue
                seg = own(i)
                off, length, k = slot_frame(seg, j)
                fs.pwrite(handle(seg), bytes([DELETED]), off + length - 1 - k)
                seg.flags[j] = 1
                flipped.setdefault(seg.first, []).append(seq)
                result.flipped += 1
            # 2. append to the active segment in run frames, sealing on the triggers
            active: Segment | None = None
            if segs and not segs[-1].sealed:
                active = own(len(segs) - 1)
                if cfg.max_age_ms and active.slots and now_ms - active.created_ms >= cfg.max_age_ms:
                    self._seal(active, tid)
                    result.sealed += 1
                    active = None
                elif slots:
                    fs.ftruncate(handle(active), active.data_len)  # a failed attempt's bytes
                    appended[active.first] = _Appended(active.last, active.data_len)
            pending: list[bytes] = []
            pending_at = active.data_len if active is not None else 0
            sparse = _Sparse(work) if work.has_extras() else None
            max_events, max_bytes = cfg.max_events, cfg.max_bytes
            live = 0
            for sl in work.slices:
                encs, n = sl.encs, len(sl.encs)
                pos = 0
                while pos < n:  # a run frame at a time
                    if encs[pos] is None:  # dead before the checkpoint: no frame
                        pos += 1
                        continue
                    seq = sl.base + pos
                    if active is not None and (
                        seq - active.last - 1 > _MAX_PAD
                        or seq - active.first + 1 > max_events
                        or active.data_len >= max_bytes
                    ):
                        self._flush(handle(active), pending, pending_at, appended[active.first])
                        pending = []
                        self._seal(active, tid)
                        result.sealed += 1
                        active = None
                    if active is None:
                        active = Segment(seq, seq - 1, 0, False, now_ms, meta_len=0)
                        segs.append(active)
                        owned.add(active.first)
                        fs.ftruncate(handle(active, create=True), 0)  # an uncommitted attempt's
                        appended[active.first] = _Appended(active.last, 0)
                        new_files = True
                        pending_at = 0
                    mark = appended[active.first]
                    gap = seq - active.last - 1
                    if gap:  # absent slots (records dead before the checkpoint)
                        active.offsets.extend(_ABSENT_SLOT * gap)
                        active.lens.extend(array("I", bytes(4 * gap)))
                        active.ts.extend(array("q", [sl.ts[pos]]) * gap)
                        active.flags.extend(bytes(gap))
                        mark.sizes.extend(array("I", bytes(4 * gap)))
                    room = min(n - pos, max_events - (seq - active.first), RUN_MAX_RECORDS)
                    take = cast("list[bytes]", encs[pos : pos + room])
                    try:  # (no scan for dead slots unless the join meets one)
                        joined = b"\x00".join(take)
                    except TypeError:  # the run ends before the first dead slot
                        del take[take.index(cast("bytes", None)) :]
                        joined = b"\x00".join(take)
                    budget = min(RUN_MAX_BYTES, max_bytes - active.data_len)
                    if len(take) > 1 and len(joined) - len(take) + 1 >= budget:
                        # the record whose text reaches the budget ends the run
                        ends = list(accumulate(map(len, take)))
                        cut = bisect.bisect_left(ends, budget) + 1
                        if cut < len(take):
                            del take[cut:]
                            joined = joined[: ends[cut - 1] + cut - 1]
                    cut = len(take)
                    ts, sizes = sl.ts[pos : pos + cut], sl.sizes[pos : pos + cut]
                    extras = _NO_EXTRAS if sparse is None else sparse.window(seq, seq + cut)
                    frame = encode_run(tid, seq, take, ts, sizes, extras, joined)
                    if frame is not None:
                        at = active.data_len
                        active.offsets.extend(array("I", [at]) * cut)
                        active.lens.extend(array("I", [len(frame)]) * cut)
                        active.data_len += len(frame)
                        out.bytes += len(frame)
                        pending.append(frame)
                    else:  # a record holds a raw NUL: one-record frames
                        for k, enc in enumerate(take):
                            shape = extras.shapes.get(k)
                            data = AbsorbRecord(
                                seq + k,
                                ts[k],
                                enc,
                                sizes[k],
                                extras.tags.get(k),
                                extras.nodes.get(k),
                                extras.prios.get(k, 0),
                                None if shape is None else (shape[0], shape[1]),
                            ).frame(tid)
                            active.offsets.append(active.data_len)
                            active.lens.append(len(data))
                            active.data_len += len(data)
                            out.bytes += len(data)
                            pending.append(data)
                    active.last = seq + cut - 1
                    active.ts.extend(ts)
                    active.flags.extend(bytes(cut))
                    mark.sizes.extend(sizes)
                    live += cut
                    pos += cut
            out.records += live
            if active is not None:
                self._flush(handle(active), pending, pending_at, appended.get(active.first))
                if active.slots >= cfg.max_events or active.data_len >= cfg.max_bytes:
                    self._seal(active, tid)
                    result.sealed += 1
            data_ends = {seg.first: seg.data_len for seg in segs if seg.first in appended}
            # 3. the `.meta` chunks: what recovery loads instead of decoding the frames
            for seg in segs:
                if seg.first in owned and seg.meta_len >= 0:
                    chunk = _chunk_of(
                        seg, work, appended.get(seg.first), flipped.get(seg.first, [])
                    )
                    if chunk:
                        fd = fs.open(meta_path(self.base(seg), tid, seg.first), create=True)
                        metas[seg.first] = fd
                        fs.ftruncate(fd, seg.meta_len)  # an uncommitted attempt's bytes
                        write_all(fs, fd, chunk, seg.meta_len)
                        seg.meta_len += len(chunk)
                if seg.first in owned and seg.sealed:
                    seg.ts = array("q")  # (kept only while a segment may still be sealed)
            # 4. make everything touched durable; the appended bytes then leave the page
            # cache (what readers need of them is in the payload cache: `fs.drop_synced`)
            for first, fd in touched.items():
                fs.fdatasync(fd)
                synced = appended.get(first)
                if synced is not None:
                    drop_synced(fs, fd, synced.start, data_ends.get(first, synced.start))
            for fd in metas.values():
                fs.fdatasync(fd)
            if result.sealed and self.write_idx:
                for seg in segs:
                    if seg.first in owned and seg.sealed:
                        self._sync_idx(tid, seg.first)
            if new_files or result.sealed:
                fs.fsync_dir(tdir)
        finally:
            for fd in touched.values():
                fs.close(fd)
            for fd in metas.values():
                fs.close(fd)
        # 5. whole-segment drop: sealed, and wholly below the floors or wholly dead
        keep: list[Segment] = []
        for seg in segs:
            # (only segments this checkpoint touched can have become wholly dead)
            if seg.sealed and (seg.last < work.earliest or (seg.first in owned and seg.all_dead())):
                result.dropped.append(data_path(self.base(seg), tid, seg.first))
                result.dropped.append(idx_path(self.base(seg), tid, seg.first))
                result.dropped.append(meta_path(self.base(seg), tid, seg.first))
            else:
                keep.append(seg)
        state.segments = keep
        return result

    def _flush(self, fd: int, pending: list[bytes], at: int, mark: _Appended | None) -> None:
        """Write the frames appended to a segment; note their bytes' digest in `mark`
        (its `.meta` chunk's notes)."""
        blob = b"".join(pending)
        if blob:
            write_all(self.fs, fd, blob, at)
        if mark is not None:
            mark.digest = xxhash.xxh3_64_intdigest(blob)

    def _seal(self, seg: Segment, tid: int) -> None:
        seg.sealed = True  # (its `ts` column goes once the `.meta` chunk is written)
        if not self.write_idx:
            return
        entries = encode_idx(seg)
        path = idx_path(self.root, tid, seg.first)
        ifd = self.fs.open(path, create=True)
        try:
            self.fs.ftruncate(ifd, 0)
            write_all(self.fs, ifd, bytes(entries), 0)
        finally:
            self.fs.close(ifd)

    def _sync_idx(self, tid: int, first: int) -> None:
        path = idx_path(self.root, tid, first)
        if not self.fs.exists(path):
            return
        fd = self.fs.open(path)
        try:
            self.fs.fdatasync(fd)
        finally:
            self.fs.close(fd)

    # ---- cold tier (`topicd.storage.tiering`) -----------------------------------------

    def _open(self, topic_id: int, seg: Segment) -> tuple[int, str, bool]:
        """Open `seg`'s `.data` for a read: (handle, path, whether it is the cold copy).
        A read that began before a checkpoint installed its relocation may find the hot
        copy already removed: it reads the cold one."""
        path = data_path(self.base(seg), topic_id, seg.first)
        try:
            return self.fs.open(path), path, seg.cold
        except FileNotFoundError:
            if seg.cold or not self.cold_root:
                raise
        path = data_path(self.cold_root, topic_id, seg.first)
        return self.fs.open(path), path, True

    def _relocate(self, res: TopicOutcome, out: AbsorbOutcome) -> None:
        """Copy the topic's sealed segments past the hot-retention bound to the cold root
        and make the copies durable (blocking; part of the checkpoint's absorb), oldest
        first, within the checkpoint's budget (`tiering.RELOCATE_BYTES`). The new state
        names them cold; the hot copies go once the snapshot saying so is durable."""
        assert self.tiering is not None
        fs = self.fs
        segs = res.state.segments
        picks = tiering.to_relocate(segs, self.tiering) if self._tier_due(segs) else []
        if not picks:
            return
        if out.relocated_bytes >= tiering.RELOCATE_BYTES:
            out.tier_backlog = True
            return
        tid = res.state.topic_id
        if not self._claimed:
            tiering.claim(fs, self.root, self.cold_root)
            self._claimed = True
        hdir = topic_dir(self.root, tid)
        cdir = topic_dir(self.cold_root, tid)
        tiering.ensure_dir(fs, cdir)
        names = fs.listdir(hdir)
        for i in picks:
            if out.relocated_bytes >= tiering.RELOCATE_BYTES:
                out.tier_backlog = True
                break
            seg = segs[i]
            data_name = posixpath.basename(data_path(self.root, tid, seg.first))
            if data_name not in names:  # never registered cold without its copy
                raise FileNotFoundError(2, "segment file missing", posixpath.join(hdir, data_name))
            # the `.data` and every side file of the segment (`.idx`, ...)
            prefix = data_name.rsplit(".", 1)[0] + "."
            for name in sorted(n for n in names if n.startswith(prefix)):
                src = posixpath.join(hdir, name)
                length = seg.data_len if name == data_name else None
                tiering.copy_file(fs, src, posixpath.join(cdir, name), length)
                res.moved.append(src)
            # (a new object: the loop's index keeps the old one until `install`)
            segs[i] = dataclasses.replace(seg, cold=True)
            res.relocated += 1
            out.relocated_bytes += seg.data_len
        fs.fsync_dir(cdir)

    def _tier_due(self, segments: list[Segment]) -> bool:
        """Whether a topic with these segments has one to relocate (blocking side: run
        in a thread, it is Python work per topic)."""
        t = self.tiering
        assert t is not None
        if not t.hot_retain_bytes and len(segments) <= t.hot_retain_segments:
            return False  # (the common case, without a call)
        return bool(tiering.to_relocate(segments, t))

    def refresh_tiering(self, topic_ids: Iterable[int]) -> None:
        """Recompute whether these topics have a sealed segment to relocate (recovery)."""
        if not self.cold_root or self.tiering is None:
            return
        for tid in topic_ids:
            st = self.topics.get(tid)
            if st is not None and self._tier_due(st.segments):
                self.tier_due.add(tid)
            else:
                self.tier_due.discard(tid)

    # ---- checkpoint: commit (on the loop) and reclaim (offloaded) ---------------------

    def install(self, outcome: AbsorbOutcome) -> list[str]:
        """The snapshot naming `outcome` is durable: make it the current state. Returns
        what the new registry no longer references (files and topic directories)."""
        doomed: list[str] = []
        for tid, res in outcome.topics.items():
            old = self.topics.get(tid)
            segs = res.state.segments
            new_active = (
                segs
                and not segs[-1].sealed
                and (old is None or not old.segments or old.segments[-1].first != segs[-1].first)
            )
            if self._active is not None and new_active:
                heapq.heappush(self._active, (segs[-1].created_ms, tid))
            self.topics[tid] = res.state
            doomed += res.dropped
            doomed += res.moved
            self.sealed_total += res.sealed
            self.flipped_total += res.flipped
            self.dropped_total += sum(p.endswith(".data") for p in res.dropped)
            self.relocated_total += res.relocated
        if self.cold_root and self.tiering is not None:  # (set operations: C speed)
            self.tier_due.difference_update(outcome.topics.keys())
            self.tier_due |= outcome.tier_due
        self.tier_backlog = outcome.tier_backlog
        for path in outcome.gone_dirs:
            tid = int(posixpath.basename(path), 16)
            self.topics.pop(tid, None)
            self.tier_due.discard(tid)
            doomed.append(path)
        self.absorbed_records += outcome.records
        return doomed

    def reclaim(self, paths: list[str]) -> int:
        """Remove files and topic directories no kept snapshot references (blocking)."""
        return remove_paths(self.fs, paths)

    # ---- reads ----------------------------------------------------------------------

    def read_record(self, topic_id: int, seq: int) -> AbsorbRecord | None:
        """The record `seq` from its segment, verified (blocking: run offloaded). None if
        no segment holds a live frame for it. Raises `SegmentCorruption` (and counts it)
        when the bytes fail their checksum: never served, never truncated."""
        st = self.topics.get(topic_id)
        seg = None if st is None else st.find(seq)
        if seg is None:
            return None
        i = seq - seg.first
        if seg.offsets[i] == ABSENT or seg.flags[i]:
            return None
        off, length, k = slot_frame(seg, i)
        fd, path, cold = self._open(topic_id, seg)
        try:
            data = self.fs.pread(fd, length, off)
        finally:
            self.fs.close(fd)
        if cold:
            self.cold_reads += 1
        try:
            frame = read_seg_frame(data, 0, len(data))
            if frame is None or frame.seq != seq - k or frame.count <= k or frame.end != length:
                raise frames.FrameError("checksum mismatch or bad frame")
            rec = frame.records()[k]
        except frames.FrameError as exc:
            raise self._corrupt(topic_id, path, cold, off, seq, exc) from None
        if data[length - 1 - k] == DELETED:
            return None
        return rec

    def _corrupt(
        self, topic_id: int, path: str, cold: bool, off: int, seq: int, exc: Exception
    ) -> SegmentCorruption:
        self.corruptions += 1
        rel = posixpath.relpath(path, self.cold_root if cold else self.root)
        log.error("segment corruption: %s offset %d: %s (record %d not served)", rel, off, exc, seq)
        return SegmentCorruption(rel, off, str(exc))

    def read_range(self, topic_id: int, lo: int, hi: int, max_bytes: int) -> StoredRange:
        """The stored JSON of the live records `lo ..= hi` (blocking: run offloaded), in
        seq order, stopping after the record that reaches `max_bytes` of frames (a run
        frame counts once). One `pread` per segment; every frame read is verified.
        Raises `SegmentCorruption` (and counts it) when one fails its checksum. `cold`
        of the result: how many of the segments read are in the cold tier."""
        st = self.topics.get(topic_id)
        out = StoredRange()
        if st is None:
            return out
        total = 0
        for seg in list(st.segments):
            if seg.last < lo or seg.first > hi or total >= max_bytes:
                continue
            want: list[int] = []  # slot indexes to read, ascending
            offsets, lens, flags = seg.offsets, seg.lens, seg.flags
            last_off = -1
            for i in range(max(lo, seg.first) - seg.first, min(hi, seg.last) - seg.first + 1):
                off = offsets[i]
                if off == ABSENT or flags[i]:
                    continue
                want.append(i)
                if off != last_off:
                    last_off = off
                    total += lens[i]
                    if total >= max_bytes:
                        # (the rest of this frame's wanted records come at no extra read)
                        end = off
                        for j in range(i + 1, min(hi, seg.last) - seg.first + 1):
                            if offsets[j] != end:
                                break
                            if not flags[j]:
                                want.append(j)
                        break
            if not want:
                continue
            start = offsets[want[0]]
            stop = offsets[want[-1]] + lens[want[-1]]
            fd, path, cold = self._open(topic_id, seg)
            try:
                data = self.fs.pread(fd, stop - start, start)
            finally:
                self.fs.close(fd)
            if cold:
                out.cold += 1
                self.cold_reads += 1
            frame: SegFrame | None = None
            frame_off = -1
            encs: list[bytes] = []
            for i in want:
                seq = seg.first + i
                off = offsets[i]
                try:
                    if off != frame_off:
                        at = off - start
                        frame = read_seg_frame(data, at, at + lens[i])
                        if frame is None or frame.end != at + lens[i] or frame.seq > seq:
                            raise frames.FrameError("checksum mismatch or bad frame")
                        encs = frame.encs()
                        frame_off = off
                    assert frame is not None
                    k = seq - frame.seq
                    if k >= frame.count:
                        raise frames.FrameError("checksum mismatch or bad frame")
                except frames.FrameError as exc:
                    raise self._corrupt(topic_id, path, cold, off, seq, exc) from None
                if data[frame.end - 1 - k] != DELETED:
                    out[seq] = encs[k]
        return out


# ---- recovery ---------------------------------------------------------------------------


@dataclass(slots=True)
class LoadedSegment:
    """A registered segment as recovery found it: its index, the `$ts` and record size of
    every slot, the sparse extras of its frames, and what the repair step does."""

    segment: Segment
    ts: array[int]  # per slot
    sizes: array[int]  # per slot (0 where absent)
    extras: Extras  # tags, nodes, prios, shapes by seq (of every frame, deleted ones too)
    excess: int  # bytes past data_len (truncated once recovery succeeded)
    # a `.meta` to write once recovery succeeded (it was missing or unusable, so the
    # frames were decoded): the next recovery loads from it
    rewrite: bytes | None = None
    size_sum: int = -1  # the sum of `sizes`, where the `.meta` gave it (-1: not summed)


def load_segment(
    fs: Fs, root: str, topic_id: int, reg: SegSnap, *, max_frame: int, check_data: bool = False
) -> LoadedSegment:
    """Load one registered segment (blocking): from its `.meta` side file when it has a
    usable one (chunks passing their own checksums and tiling the registered length),
    else by decoding and verifying every frame (the `.meta` is then re-made: `rewrite`).

    With a usable `.meta`, an active segment's last frame is decoded (a torn or damaged
    end refuses the start); no other data byte, of it or of a sealed segment, is read
    unless `check_data` (the offline check, `topicd verify`): every read verifies the
    frames it reads, so damage there fails that read (`SegmentCorruption`, a `500` at
    serve time) instead of the start, and a start reads no data beyond one frame per
    active segment, whatever is retained.
    Raises `SegmentCorruption` for a missing or short `.data` or a frame failing its
    checksum."""
    path = data_path(root, topic_id, reg.first)
    rel = posixpath.relpath(path, root)
    if not fs.exists(path):
        raise SegmentCorruption(rel, 0, "registered segment is missing")
    size = fs.size(path)
    if size < reg.data_len:
        raise SegmentCorruption(
            rel, size, f"shorter ({size} bytes) than registered ({reg.data_len})"
        )
    if reg.meta_len >= 0:
        try:
            return _load_meta(fs, root, topic_id, reg, size, check_data=check_data)
        except _MetaUnusable as exc:
            log.warning("%s: %s; decoding the segment's frames", rel[:-5] + ".meta", exc)
    return _load_frames(fs, root, topic_id, reg, max_frame, rel)


class _MetaUnusable(Exception):
    pass


def _load_meta(
    fs: Fs, root: str, topic_id: int, reg: SegSnap, size: int, *, check_data: bool
) -> LoadedSegment:
    path = meta_path(root, topic_id, reg.first)
    if not fs.exists(path):
        raise _MetaUnusable("missing")
    raw = fs.read(path)
    if len(raw) < reg.meta_len:
        raise _MetaUnusable(f"shorter ({len(raw)} bytes) than registered ({reg.meta_len})")
    view = memoryview(raw)[: reg.meta_len]
    seg = Segment(reg.first, reg.first - 1, reg.data_len, reg.sealed, reg.created_ms)
    seg.meta_len = reg.meta_len
    ts = array("q")
    sizes = array("I")
    flips: list[int] = []
    tags: dict[int, str] = {}
    nodes: dict[int, str] = {}
    prios: dict[int, int] = {}
    shapes: dict[int, tuple[int, int]] = {}
    pos = 0
    checks: list[tuple[int, int, int]] = []  # each chunk's (data start, end, digest)
    size_sum = 0
    while pos < len(view):
        old = raw[pos : pos + 4] == META_MAGIC_V1
        chunk = _CHUNK_V1 if old else _CHUNK
        if pos + chunk.size > len(view):
            raise _MetaUnusable(f"chunk at {pos} cut short")
        fields = chunk.unpack_from(view, pos)
        magic, n, base, m, e, start, stop, data_digest = fields[:8]
        total, digest = (-1, fields[8]) if old else fields[8:]
        end = pos + chunk.size + 21 * n + 8 * m + e
        if (magic != META_MAGIC and not old) or end > len(view):
            raise _MetaUnusable(f"bad chunk at {pos}")
        h = xxhash.xxh3_64(view[pos : pos + chunk.size - 8])
        h.update(view[pos + chunk.size : end])
        if h.intdigest() != digest:
            raise _MetaUnusable(f"chunk at {pos} fails its checksum")
        if stop > start:
            checks.append((start, stop, data_digest))
        at = pos + chunk.size
        if n:
            if base != seg.last + 1:
                raise _MetaUnusable(f"chunk at {pos} starts at seq {base}, not {seg.last + 1}")
            _extend(seg.offsets, view[at : at + 4 * n])
            _extend(seg.lens, view[at + 4 * n : at + 8 * n])
            _extend(ts, view[at + 8 * n : at + 16 * n])
            _extend(sizes, view[at + 16 * n : at + 20 * n])
            # (a chunk of the release before the sum: its sizes are summed here)
            size_sum += total if total >= 0 else sum(sizes[len(sizes) - n :])
            seg.flags += view[at + 20 * n : at + 21 * n]
            seg.last += n
        at += 21 * n
        flips += _column("Q", view[at : at + 8 * m])
        at += 8 * m
        if e:
            try:
                t, nd, p, sh = _EXTRAS_DEC.decode(view[at : at + e])
            except msgspec.DecodeError as exc:
                raise _MetaUnusable(f"chunk at {pos}: {exc}") from None
            tags.update(t)
            nodes.update(nd)
            prios.update(p)
            shapes.update(sh)
        pos = end
    if seg.last > reg.last or not _tiles(checks, reg.data_len) or not _ends_at(seg, reg.data_len):
        raise _MetaUnusable("does not match the registry")
    while seg.last < reg.last:  # trailing absent slots
        seg.last += 1
        seg.offsets.append(ABSENT)
        seg.lens.append(0)
        ts.append(ts[-1] if ts else 0)
        sizes.append(0)
        seg.flags.append(0)
    first, last = seg.first, seg.last
    for seq in flips:
        if first <= seq <= last and seg.offsets[seq - first] != ABSENT:
            seg.flags[seq - first] = 1
    if not reg.sealed:
        seg.ts = array("q", ts)
        # the end of the active segment: a torn or damaged end names its frame
        _verify_tail(fs, root, topic_id, seg)
    if check_data:
        _verify_data(fs, root, topic_id, seg, checks)
    return LoadedSegment(
        seg, ts, sizes, (tags, nodes, prios, shapes), size - reg.data_len, size_sum=size_sum
    )


_ABSENT_BYTES: Final = ABSENT.to_bytes(4, sys.byteorder)


def has_absent(offsets: array[int]) -> bool:
    """Whether any slot of the column is `ABSENT`: a C-level search of its bytes, each
    hit checked for alignment (`array.count` makes an int object per element: ~0.3 s
    for the 10 million slots of 10 GiB retained)."""
    assert offsets.itemsize == 4, offsets.typecode
    raw = offsets.tobytes()
    i = raw.find(_ABSENT_BYTES)
    while i >= 0:
        if i % 4 == 0:
            return True
        i = raw.find(_ABSENT_BYTES, i + 1)
    return False


def _tiles(checks: list[tuple[int, int, int]], data_len: int) -> bool:
    """Whether the chunks' data ranges cover `0 .. data_len` exactly, in order (each
    absorb appends where the previous one ended)."""
    end = 0
    for start, stop, _ in checks:
        if start != end:
            return False
        end = stop
    return end == data_len


def _ends_at(seg: Segment, data_len: int) -> bool:
    """Whether the last frame the index names ends at `data_len` (or none is named and
    the segment holds no bytes)."""
    i = len(seg.offsets) - 1
    while i >= 0 and seg.offsets[i] == ABSENT:
        i -= 1
    return seg.offsets[i] + seg.lens[i] == data_len if i >= 0 else data_len == 0


def _verify_data(
    fs: Fs, root: str, topic_id: int, seg: Segment, checks: list[tuple[int, int, int]]
) -> None:
    """Check every byte of the segment's data against its chunks' digests: one read and
    one C-level hash per chunk, the delete flags of deleted records (outside every
    checksum, flipped since the chunk was written) cleared first, as they were when the
    digest was taken. A mismatch makes the `.meta` unusable: decoding the frames then
    names the damaged frame (and refuses the start), or re-makes a damaged `.meta`.
    Done by `topicd verify` (`check_data`) for every segment."""
    if not checks:
        return
    lo, hi = checks[0][0], checks[-1][1]
    if hi > seg.data_len:
        raise _MetaUnusable("chunk data ranges do not match the registry")
    fd = fs.open(data_path(root, topic_id, seg.first))
    try:
        data = fs.pread(fd, hi - lo, lo)
    finally:
        fs.close(fd)
    if len(data) != hi - lo:
        raise _MetaUnusable(f"data shorter than its chunks ({lo + len(data)} < {hi})")
    # only a deleted record's flag differs from what was hashed (a flip the `.meta` does
    # not know yet, from a checkpoint that never committed, fails the digest: the frames
    # are decoded then, whose checksums leave the flags out)
    buf: bytes | bytearray = data
    i = seg.flags.find(1)
    if i >= 0:
        buf = bytearray(data)
        last_off, first = -1, 0
        while i >= 0:
            off = seg.offsets[i]
            if off != ABSENT:
                if off != last_off:  # (the deleted records of one run share its search)
                    last_off, first = off, i - slot_frame(seg, i)[2]
                if lo <= off < hi:
                    buf[off + seg.lens[i] - 1 - (i - first) - lo] = 0
            i = seg.flags.find(1, i + 1)
    view = memoryview(buf)
    for start, stop, digest in checks:
        if xxhash.xxh3_64_intdigest(view[start - lo : stop - lo]) != digest:
            raise _MetaUnusable(f"data bytes {start}..{stop} do not match their digest")


def _verify_tail(fs: Fs, root: str, topic_id: int, seg: Segment) -> None:
    """Check the active segment's last frame (the end of what the newest absorb wrote)
    against its checksum and the index: a torn or damaged end of the file is found at
    start; any other byte is verified when it is read."""
    i = len(seg.offsets) - 1
    while i >= 0 and seg.offsets[i] == ABSENT:
        i -= 1
    if i < 0:
        return
    off, length = seg.offsets[i], seg.lens[i]
    fd = fs.open(data_path(root, topic_id, seg.first))
    try:
        data = fs.pread(fd, length, off)
    finally:
        fs.close(fd)
    try:
        frame = read_seg_frame(data, 0, len(data))
    except frames.FrameError:
        frame = None
    if frame is None or frame.seq + frame.count - 1 != seg.first + i or frame.end != length:
        raise _MetaUnusable(f"the last frame (offset {off}) does not match")


def _load_frames(
    fs: Fs, root: str, topic_id: int, reg: SegSnap, max_frame: int, rel: str
) -> LoadedSegment:
    """Decode and verify every frame of a registered segment; also build its `.meta`."""
    data = fs.read(data_path(root, topic_id, reg.first))
    seg = Segment(reg.first, reg.first - 1, reg.data_len, reg.sealed, reg.created_ms)
    records: list[AbsorbRecord] = []
    offsets = _idx_offsets(fs, root, topic_id, reg, data) if reg.sealed else None
    pos = 0
    entries = offsets if offsets is not None else None
    k = 0
    while True:
        if entries is not None:
            if k >= len(entries):
                break
            pos = entries[k]
            k += 1
        elif pos >= reg.data_len:
            break
        try:
            frame = read_seg_frame(data, pos, reg.data_len)
            if frame is None:
                raise frames.FrameError("checksum mismatch or invalid frame")
            recs = frame.records()
        except frames.FrameError as exc:
            raise SegmentCorruption(rel, pos, str(exc)) from None
        if frame.seq <= seg.last or frame.seq + frame.count - 1 > reg.last:
            raise SegmentCorruption(rel, pos, f"seq {frame.seq} out of order")
        for j, rec in enumerate(recs):
            seg.add(rec.seq, pos, frame.end - pos, rec.ts)
            if data[frame.end - 1 - j] == DELETED:
                seg.flags[-1] = 1
        records += recs
        pos = frame.end
    if entries is None and pos != reg.data_len:
        raise SegmentCorruption(rel, pos, "frames do not end at the registered length")
    while seg.last < reg.last:  # trailing absent slots
        seg.add(reg.last, 0, 0, seg.ts[-1] if len(seg.ts) else 0)
        seg.offsets[-1] = ABSENT
    sizes = array("I", bytes(4 * seg.slots))
    tags: dict[int, str] = {}
    nodes: dict[int, str] = {}
    prios: dict[int, int] = {}
    shapes: dict[int, tuple[int, int]] = {}
    for rec in records:
        seq = rec.seq
        sizes[seq - seg.first] = rec.size
        if rec.tag is not None:
            tags[seq] = rec.tag
        if rec.node is not None:
            nodes[seq] = rec.node
        if rec.prio:
            prios[seq] = rec.prio
        if rec.shape is not None:
            shapes[seq] = rec.shape
    ts = seg.ts
    extras: Extras = (tags, nodes, prios, shapes)
    buf = bytearray(data[: reg.data_len])
    for i, flag in enumerate(seg.flags):
        if flag:
            off, length, k = slot_frame(seg, i)
            buf[off + length - 1 - k] = 0
    rewrite = encode_chunk(
        seg.first,
        seg.offsets,
        seg.lens,
        ts,
        sizes,
        seg.flags,
        [],
        extras,
        (0, reg.data_len, xxhash.xxh3_64_intdigest(bytes(buf))),
    )
    seg.meta_len = len(rewrite)
    if reg.sealed:
        seg.ts = array("q")  # (kept only while a segment may still be sealed)
    return LoadedSegment(seg, ts, sizes, extras, len(data) - reg.data_len, rewrite)


def _idx_offsets(fs: Fs, root: str, topic_id: int, reg: SegSnap, data: bytes) -> list[int] | None:
    """Frame offsets from a sealed segment's `.idx`, or None to scan (missing or not
    matching the registry: the frames are verified either way)."""
    path = idx_path(root, topic_id, reg.first)
    if not fs.exists(path):
        return None
    raw = fs.read(path)
    slots = reg.last - reg.first + 1
    if len(raw) != slots * IDX.size:
        log.warning("%s: does not match the registry; scanning the segment", path)
        return None
    out: list[int] = []
    end = 0
    for off, length, _ts, flags in IDX.iter_unpack(raw):
        if flags & IDX_ABSENT or (out and off == out[-1] and off + length == end):
            continue  # (absent, or the next record of the same run frame)
        if off != end or off + length > reg.data_len:
            log.warning("%s: inconsistent entry; scanning the segment", path)
            return None
        out.append(off)
        end = off + length
    if end != reg.data_len:
        return None
    return out


def encode_idx(seg: Segment) -> bytes:
    """The `.idx` of a segment: per slot `IDX` (offset and length of the record's frame,
    `$ts`, flags), built column by column with strided copies (no per-slot Python)."""
    n = seg.slots
    offsets = seg.offsets
    flags = bytearray(seg.flags)  # 1 = deleted = IDX_DELETED
    absent = offsets.count(ABSENT)
    if absent:
        offsets = array("I", offsets)
        i = offsets.index(ABSENT)
        while absent:
            offsets[i] = 0
            flags[i] = IDX_ABSENT
            absent -= 1
            if absent:
                i = offsets.index(ABSENT, i + 1)
    cols = ((0, 4, _le(offsets)), (4, 4, _le(seg.lens)), (8, 8, _le(seg.ts)), (16, 1, flags))
    out = bytearray(IDX.size * n)
    for at, width, col in cols:
        for b in range(width):
            out[at + b :: IDX.size] = col[b::width]
    return bytes(out)


def decode_idx(raw: bytes) -> list[tuple[int, int, int, int]]:
    """The entries of an `.idx` file; raises `ValueError` if it is not whole entries."""
    if len(raw) % IDX.size:
        raise ValueError("not a whole number of 20-byte entries")
    return [(o, n, t, f) for o, n, t, f in IDX.iter_unpack(raw)]


def list_orphans(fs: Fs, root: str, registered: dict[int, list[SegSnap]]) -> list[str]:
    """Files and topic directories under `topics/` that the registry does not name."""
    base = posixpath.join(root, TOPICS_DIR)
    if not fs.exists(base):
        return []
    out: list[str] = []
    for name in sorted(fs.listdir(base)):
        path = posixpath.join(base, name)
        tid = int(name, 16) if _TOPIC_DIR.fullmatch(name) else None
        if tid is None or tid not in registered:
            out.append(path)
            continue
        firsts = {s.first for s in registered[tid]}
        sealed = {s.first for s in registered[tid] if s.sealed}
        for fname in sorted(fs.listdir(path)):
            m = _SEG.fullmatch(fname)
            ok = m is not None and int(m.group(1)) in (sealed if m.group(2) == "idx" else firsts)
            if not ok:
                out.append(posixpath.join(path, fname))
    return out


def repair(
    fs: Fs,
    root: str,
    truncate: list[tuple[str, int]],
    orphans: list[str],
    metas: list[tuple[str, bytes]] = [],  # noqa: B006  (read only)
) -> None:
    """Recovery's segment repairs, once it succeeded: cut bytes past the registered
    lengths (a checkpoint that wrote them never committed), remove orphans, and write
    the `.meta` files recovery had to re-make from the frames (the next checkpoint's
    registry names them; until then the frames are decoded again)."""
    for path, length in truncate:
        fd = fs.open(path)
        try:
            fs.ftruncate(fd, length)
            fs.fdatasync(fd)
        finally:
            fs.close(fd)
    if orphans:
        remove_paths(fs, orphans)
        log.warning("removed %d orphaned segment files or directories", len(orphans))
    dirs: set[str] = set()
    for path, data in metas:
        fd = fs.open(path, create=True)
        try:
            fs.ftruncate(fd, 0)
            write_all(fs, fd, data, 0)
            fs.fdatasync(fd)
        finally:
            fs.close(fd)
        dirs.add(posixpath.dirname(path))
    for d in sorted(dirs):
        fs.fsync_dir(d)
    if metas:
        log.info("wrote %d segment side files (.meta) re-made from their frames", len(metas))


def remove_paths(fs: Fs, paths: list[str]) -> int:
    """Unlink segment files and remove (emptied) topic directories; sync the parents."""
    removed = 0
    dirs: set[str] = set()
    for path in paths:
        if not fs.exists(path):
            continue
        if _SEG.fullmatch(posixpath.basename(path)) or not _TOPIC_DIR.fullmatch(
            posixpath.basename(path)
        ):
            try:
                fs.unlink(path)
            except IsADirectoryError:
                _remove_tree(fs, path)
        else:  # a deleted topic's directory
            _remove_tree(fs, path)
        dirs.add(posixpath.dirname(path))
        removed += 1
    for d in sorted(dirs):
        if fs.exists(d):
            fs.fsync_dir(d)
    return removed


def _remove_tree(fs: Fs, path: str) -> None:
    for name in fs.listdir(path):
        child = posixpath.join(path, name)
        try:
            fs.unlink(child)
        except IsADirectoryError:
            _remove_tree(fs, child)
    fs.fsync_dir(path)
    fs.rmdir(path)
