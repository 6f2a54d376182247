"""WAL file header and frame codec (docs/storage.md has the byte layouts).

Pure functions over bytes: no I/O. Every integer is little-endian.

File header (64 bytes): magic `TOPICDWL`, format version, checksum algorithm (1 = XXH3-64),
shard, shard count at creation, file index, creation time, `prev_valid_len` (the exact
valid length of the previous file: the *fence*), reserved zeros, then XXH3-64 of bytes
0-55.

Frame::

    off size
      0   4  frame_len  u32   bytes after this field: 36 + body_len + 8 + 1
      4   1  type       u8
      5   1  flags      u8    b0 fsync_class (informational)
      6   2  reserved   u16   0
      8   8  topic_id   u64
     16   8  seq        u64   first seq of an Append, else 0
     24   8  ts_ms      u64
     32   4  count      u32   records in an Append, else 0
     36   4  body_len   u32
     40   -  body
      .   8  xxh3_64    over bytes [4, 40 + body_len)
      .   1  tail       u8    0x00

`frame_len` comes first so a reader validates the boundary before parsing anything; the
zeros of a preallocated file fail the `frame_len ≥ 45` test and read as end-of-data.

One write request of N records is **one** Append frame (topicd decision, replacing the
spec's N single-record frames with a `batch_end` flag): it is atomic by construction (the
frame validates or it does not) and costs one header and one checksum per write instead
of per record, which is what keeps the WAL cheap in Python. Append body::

    u32 n | u32 extras_len | n × u32 enc_len | n × u32 size | extras | enc_0 .. enc_{n-1}

where `enc_i` is the record's stored JSON (it carries `$seq` and `$ts`), `size_i` its
payload size, and `extras` a msgpack map of the sparse per-record fields (tags, nodes,
priorities, projection shapes) plus the idempotency key. A frame with flag b1
(`FLAG_NUL_JOINED`, what topicd writes for n > 1) drops the length column and separates
the records by NUL bytes instead, which JSON text never holds raw::

    u32 n | u32 extras_len | n × u32 size | extras | enc_0 0x00 enc_1 .. 0x00 enc_{n-1}

That text is exactly what `engine.writes.encode_batch` formats before it splits it, so a
batch's frame costs no per-record work (docs/storage.md). A single record keeps
`u32 1 | u32 extras_len | u32 enc_len | u32 size | extras | enc_0`. Control frame bodies
are compact JSON objects.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Final, TypeVar

import msgspec
import orjson
import xxhash

FORMAT_VERSION: Final = 1
CHECKSUM_XXH3: Final = 1

FILE_MAGIC: Final = b"TOPICDWL"
FILE_HEADER_LEN: Final = 64
_FILE_HEADER: Final = struct.Struct("<8sHBBHHQQQ16s")  # 56 bytes, then the checksum
NO_PREVIOUS: Final = 2**64 - 1

FRAME_HEAD: Final = struct.Struct("<IBBHQQQII")  # 40 bytes
FRAME_HEAD_LEN: Final = 40
FRAME_TRAILER_LEN: Final = 9  # checksum + tail
MIN_FRAME_LEN: Final = FRAME_HEAD_LEN - 4 + FRAME_TRAILER_LEN  # 45
DEFAULT_MAX_FRAME: Final = 16 << 20  # storage.wal.max_frame_bytes' default
# the largest frame recovery reads: topicd 0.1 wrote a write of any size as one frame
LEGACY_MAX_FRAME: Final = 1 << 30

FLAG_FSYNC: Final = 0x01
FLAG_NUL_JOINED: Final = 0x02  # Append body layout 2 (see the module docstring)
# more Append frames of the same write follow (the spec's `batch_end`, inverted so that a
# frame written before multi-frame writes existed reads as a complete write)
FLAG_MORE: Final = 0x04

# frame types (storage spec §3.3; 1 carries a whole write)
APPEND: Final = 1
TOPIC_CREATE: Final = 2
TOPIC_CONFIG: Final = 3
TOPIC_DELETE: Final = 4
RECORDS_DELETE: Final = 5
EVICT_WATERMARK: Final = 6
HEAD_WATERMARK: Final = 7
ROUTER_CREATE: Final = 8
ROUTER_DELETE: Final = 9
ROUTER_CURSOR: Final = 10
LEASE: Final = 11
PROBE: Final = 12
LOST_RANGE: Final = 13
KNOWN_TYPES: Final = frozenset(range(1, 14))

_V = TypeVar("_V")
_U32X2: Final = struct.Struct("<II")
_U32X4: Final = struct.Struct("<IIII")
_LITTLE: Final = sys.byteorder == "little"


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


# ---- file header ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FileHeader:
    shard: int
    shard_count: int
    file_index: int
    created_ms: int
    prev_valid_len: int  # NO_PREVIOUS for the first file of a shard

    def encode(self) -> bytes:
        head = _FILE_HEADER.pack(
            FILE_MAGIC,
            FORMAT_VERSION,
            CHECKSUM_XXH3,
            0,
            self.shard,
            self.shard_count,
            self.file_index,
            self.created_ms,
            self.prev_valid_len,
            bytes(16),
        )
        out = head + struct.pack("<Q", checksum(head))
        assert len(out) == FILE_HEADER_LEN
        return out


class HeaderError(ValueError):
    """A WAL file header is invalid (bad magic, version, checksum or length)."""


def decode_file_header(data: bytes | memoryview) -> FileHeader:
    if len(data) < FILE_HEADER_LEN:
        raise HeaderError("file shorter than its 64-byte header")
    head = bytes(data[:56])
    (expected,) = struct.unpack_from("<Q", data, 56)
    if checksum(head) != expected:
        raise HeaderError("file header checksum mismatch")
    magic, version, alg, _, shard, count, index, created, prev, _ = _FILE_HEADER.unpack(head)
    if magic != FILE_MAGIC:
        raise HeaderError("bad magic (not a topicd WAL file)")
    if version != FORMAT_VERSION or alg != CHECKSUM_XXH3:
        raise HeaderError(f"unsupported format version {version} / checksum {alg}")
    return FileHeader(shard, count, index, created, prev)


# ---- frames -----------------------------------------------------------------------------


def encode_frame(
    ftype: int, topic_id: int, seq: int, ts_ms: int, count: int, body: bytes, flags: int = 0
) -> bytes:
    """One framed, checksummed record of the log."""
    return _frame_of(ftype, topic_id, seq, ts_ms, count, (body,), flags)


def _frame_of(
    ftype: int,
    topic_id: int,
    seq: int,
    ts_ms: int,
    count: int,
    body: tuple[bytes | memoryview, ...],
    flags: int,
) -> bytes:
    """The frame whose body is the concatenation of `body` (copied once, into the frame)."""
    body_len = sum(map(len, body))
    head = FRAME_HEAD.pack(
        FRAME_HEAD_LEN - 4 + body_len + FRAME_TRAILER_LEN,
        ftype,
        flags,
        0,
        topic_id,
        seq,
        ts_ms,
        count,
        body_len,
    )
    digest = xxhash.xxh3_64(memoryview(head)[4:])
    for piece in body:
        digest.update(piece)
    return b"".join((head, *body, struct.pack("<QB", digest.intdigest(), 0)))


def encode_control(ftype: int, topic_id: int, ts_ms: int, payload: dict[str, object]) -> bytes:
    return encode_frame(ftype, topic_id, 0, ts_ms, 0, orjson.dumps(payload))


class Extras(msgspec.Struct, omit_defaults=True, gc=False):
    """The sparse per-record fields of an Append (record index → value)."""

    key: str | None = None
    tags: dict[int, str] = {}
    nodes: dict[int, str] = {}
    prios: dict[int, int] = {}
    shapes: dict[int, tuple[int, int]] = {}


_EXTRAS_ENC: Final = msgspec.msgpack.Encoder()
_EXTRAS_DEC: Final = msgspec.msgpack.Decoder(Extras)


def _u32s(values: list[int]) -> bytes:
    arr = array("I")
    arr.fromlist(values)  # (reads the list directly: no sequence protocol per item)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def encode_append(
    topic_id: int,
    first_seq: int,
    ts_ms: int,
    encs: list[bytes],
    sizes: list[int],
    extras: Extras,
    *,
    fsync_class: bool,
    joined: bytes | memoryview | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """The Append frame(s) of one write submission, each at most `max_frame` long.

    `joined`, if given, must be `b"\\x00".join(encs)` (what `encode_batch` formats anyway).
    A write too large for one frame becomes several contiguous frames, every one but the
    last flagged `FLAG_MORE`; recovery applies them all or none (docs/storage.md).
    """
    n = len(encs)
    blob = b"" if extras is NO_EXTRAS or extras == NO_EXTRAS else _EXTRAS_ENC.encode(extras)
    text = len(joined) if joined is not None else sum(map(len, encs)) + n - 1
    if MIN_FRAME_LEN + 8 + 8 * n + len(blob) + text > max_frame:
        return b"".join(
            _split_append(
                topic_id, first_seq, ts_ms, encs, sizes, extras, fsync_class, joined, max_frame
            )
        )
    return _append_frame(topic_id, first_seq, ts_ms, encs, sizes, blob, fsync_class, joined)


def _append_frame(
    topic_id: int,
    first_seq: int,
    ts_ms: int,
    encs: list[bytes],
    sizes: list[int],
    blob: bytes,
    fsync_class: bool,
    joined: bytes | memoryview | None,
    more: bool = False,
) -> bytes:
    n = len(encs)
    flags = (FLAG_FSYNC if fsync_class else 0) | (FLAG_MORE if more else 0)
    if n == 1:  # the common single-record write: no arrays
        body: tuple[bytes | memoryview, ...] = (
            _U32X4.pack(1, len(blob), len(encs[0]), sizes[0]),
            blob,
            encs[0],
        )
    else:
        if joined is None:
            joined = b"\x00".join(encs)
            if joined.count(0) != n - 1:  # a record holding a raw NUL: layout 1
                body = (_U32X2.pack(n, len(blob)), _u32s(list(map(len, encs))), _u32s(sizes))
                return _frame_of(APPEND, topic_id, first_seq, ts_ms, n, (*body, blob, *encs), flags)
        body = (_U32X2.pack(n, len(blob)), _u32s(sizes), blob, joined)
        flags |= FLAG_NUL_JOINED
    return _frame_of(APPEND, topic_id, first_seq, ts_ms, n, body, flags)


NO_EXTRAS: Final = Extras()  # shared by every write without extras (never mutated)
# what an Append frame's extras may add per record beyond a tag's or node's text (msgpack
# map keys, integers and string headers; generous)
_EXTRA_SLACK: Final = 24


def _split_append(
    topic_id: int,
    first_seq: int,
    ts_ms: int,
    encs: list[bytes],
    sizes: list[int],
    extras: Extras,
    fsync_class: bool,
    joined: bytes | memoryview | None,
    max_frame: int,
) -> list[bytes]:
    """A write too large for one frame, as frames of whole records (all but the last
    flagged `FLAG_MORE`). Only the first carries the idempotency key."""
    n = len(encs)
    key_cost = 4 * len(extras.key) + _EXTRA_SLACK if extras.key is not None else 0
    budget = max_frame - MIN_FRAME_LEN - 8 - _EXTRA_SLACK - key_cost
    cost = [len(enc) + 9 for enc in encs]  # text, separator, up to two u32 columns
    for sparse in (extras.tags, extras.nodes):
        for i, text in sparse.items():
            cost[i] += 4 * len(text) + _EXTRA_SLACK
    for sparse_ in (extras.prios, extras.shapes):
        for i in sparse_:
            cost[i] += _EXTRA_SLACK
    cuts = [0]
    used = 0
    for i, c in enumerate(cost):
        if c > budget:
            raise ValueError(
                f"record {i} needs {c} bytes of frame, over storage.wal.max_frame_bytes {max_frame}"
            )
        if used + c > budget:
            cuts.append(i)
            used = 0
        used += c
    cuts.append(n)
    starts = [0, *accumulate(len(enc) + 1 for enc in encs)] if joined is not None else []
    out = []
    for a, b in pairwise(cuts):
        part = Extras(
            extras.key if a == 0 else None,
            _window(extras.tags, a, b),
            _window(extras.nodes, a, b),
            _window(extras.prios, a, b),
            _window(extras.shapes, a, b),
        )
        blob = b"" if part == NO_EXTRAS else _EXTRAS_ENC.encode(part)
        piece = None if joined is None else joined[starts[a] : starts[b] - 1]
        frame = _append_frame(
            topic_id, first_seq + a, ts_ms, encs[a:b], sizes[a:b], blob, fsync_class, piece, b < n
        )
        assert len(frame) - 4 <= max_frame, "append split under-estimated its frame"
        out.append(frame)
    return out


def _window(sparse: dict[int, _V], a: int, b: int) -> dict[int, _V]:
    """The entries of `sparse` for records a..b-1, re-indexed from 0."""
    return {i - a: v for i, v in sparse.items() if a <= i < b}


def _shifted(sparse: dict[int, _V], base: int) -> dict[int, _V]:
    return {base + i: v for i, v in sparse.items()}


def merge_appends(parts: list[tuple[Frame, AppendBody]]) -> AppendBody:
    """The records of one multi-frame write, as if they had been one frame."""
    if len(parts) == 1:
        return parts[0][1]
    encs: list[bytes] = []
    sizes: list[int] = []
    merged = Extras(parts[0][1].extras.key, {}, {}, {}, {})
    for _, body in parts:
        base = len(encs)
        ex = body.extras
        merged.tags.update(_shifted(ex.tags, base))
        merged.nodes.update(_shifted(ex.nodes, base))
        merged.prios.update(_shifted(ex.prios, base))
        merged.shapes.update(_shifted(ex.shapes, base))
        encs += body.encs
        sizes += body.sizes
    return AppendBody(encs, sizes, merged)


@dataclass(slots=True)
class Frame:
    """A validated frame. `offset`/`end` locate it in its file."""

    ftype: int
    flags: int
    topic_id: int
    seq: int
    ts_ms: int
    count: int
    body: memoryview
    offset: int
    end: int

    def control(self) -> dict[str, object]:
        obj = orjson.loads(self.body)
        if not isinstance(obj, dict):
            raise FrameError("control body is not a JSON object")
        return obj


@dataclass(slots=True)
class AppendBody:
    encs: list[bytes]
    sizes: list[int]
    extras: Extras = field(default_factory=Extras)


class FrameError(ValueError):
    """A checksum-valid frame whose content cannot be decoded (format error)."""


def _extras(body: memoryview, pos: int, length: int) -> Extras:
    if not length:
        return NO_EXTRAS
    try:
        return _EXTRAS_DEC.decode(body[pos : pos + length])
    except msgspec.DecodeError as exc:
        raise FrameError(f"append extras: {exc}") from None


def _u32_column(body: memoryview, pos: int, n: int) -> array[int]:
    column = array("I")
    column.frombytes(body[pos : pos + 4 * n])
    if not _LITTLE:  # pragma: no cover
        column.byteswap()
    return column


def decode_append(frame: Frame) -> AppendBody:
    body = frame.body
    if len(body) < 8:
        raise FrameError("append body too short")
    n, extras_len = _U32X2.unpack_from(body, 0)
    if n != frame.count or n == 0:
        raise FrameError("append record count mismatch")
    if n == 1:  # the common single-record write: no arrays
        if len(body) < 16:
            raise FrameError("append body too short")
        length, size = _U32X2.unpack_from(body, 8)
        extras = _extras(body, 16, extras_len)
        if 16 + extras_len + length != len(body):
            raise FrameError("append lengths do not add up")
        return AppendBody([bytes(body[16 + extras_len :])], [size], extras)
    columns = 1 if frame.flags & FLAG_NUL_JOINED else 2
    pos = 8 + 4 * n * columns
    if len(body) < pos + extras_len:
        raise FrameError("append body too short for its record count")
    sizes = _u32_column(body, pos - 4 * n, n).tolist()
    extras = _extras(body, pos, extras_len)
    pos += extras_len
    if columns == 1:  # NUL-joined
        encs = bytes(body[pos:]).split(b"\x00")
        if len(encs) != n:
            raise FrameError("append record count does not match its separators")
        return AppendBody(encs, sizes, extras)
    lens = _u32_column(body, 8, n)
    if pos + sum(lens) != len(body):
        raise FrameError("append lengths do not add up")
    blob = bytes(body[pos:])
    offs = [0, *accumulate(lens)]
    return AppendBody([blob[a:b] for a, b in pairwise(offs)], sizes, extras)


def single_enc(frame: Frame) -> bytes:
    """The stored JSON of a one-record Append frame, without decoding its extras (a
    segment read that only needs the bytes). Raises `FrameError` like `decode_append`."""
    body = frame.body
    if frame.ftype != APPEND or frame.count != 1 or len(body) < 16:
        raise FrameError("not a one-record Append frame")
    n, extras_len = _U32X2.unpack_from(body, 0)
    length, _size = _U32X2.unpack_from(body, 8)
    if n != 1 or 16 + extras_len + length != len(body):
        raise FrameError("append lengths do not add up")
    return bytes(body[16 + extras_len :])


def read_frame(buf: bytes | memoryview, offset: int, limit: int, max_frame: int) -> Frame | None:
    """The valid frame at `offset` (within `buf[:limit]`), or None if there is none.

    Valid means: `45 ≤ frame_len ≤ max_frame`, the reserved field is zero, it fits, the
    lengths add up, the checksum matches and the type is known. Zero bytes fail the first
    test (end of data).
    """
    if offset + FRAME_HEAD_LEN > limit:
        return None
    frame_len, ftype, flags, reserved, topic_id, seq, ts, count, body_len = FRAME_HEAD.unpack_from(
        buf, offset
    )
    if frame_len < MIN_FRAME_LEN or frame_len > max_frame or reserved:
        return None
    end = offset + 4 + frame_len
    if end > limit or frame_len != FRAME_HEAD_LEN - 4 + body_len + FRAME_TRAILER_LEN:
        return None
    view = memoryview(buf)
    body_end = offset + FRAME_HEAD_LEN + body_len
    (expected,) = struct.unpack_from("<Q", buf, body_end)
    if xxhash.xxh3_64_intdigest(view[offset + 4 : body_end]) != expected:
        return None
    if ftype not in KNOWN_TYPES:
        raise FrameError(f"checksum-valid frame of unknown type {ftype}")
    return Frame(
        ftype,
        flags,
        topic_id,
        seq,
        ts,
        count,
        view[offset + FRAME_HEAD_LEN : body_end],
        offset,
        end,
    )


def find_valid_frame(buf: bytes, start: int, limit: int, max_frame: int) -> int:
    """Offset of the first checksum-valid frame at or after `start`, or -1.

    Used after an invalid frame: none found means a torn tail, one found means corruption
    in the middle of the log. Every offset is considered, at C speed: a frame head holds a
    non-zero type byte at offset 4 followed (after the flags) by two reserved zero bytes at
    6-7, so only offsets 6 bytes before a pair of zero bytes can start a frame. Record text
    never holds two zero bytes in a row (`bytes.find` passes over it), and of a run of zeros
    only its first two pairs can qualify (the rest is skipped by `next_nonzero`).
    """
    find = buf.find
    last = limit - FRAME_HEAD_LEN  # the last offset a frame head fits at
    pos = start + 6
    while pos <= last + 6:
        pair = find(b"\x00\x00", pos, last + 8)
        if pair < 0:
            return -1
        for k in (pair, pair + 1):
            cand = k - 6
            if (
                start <= cand <= last
                and buf[k - 2]
                and not buf[k]
                and not buf[k + 1]
                and _valid_at(buf, cand, limit, max_frame)
            ):
                return cand
        nxt = next_nonzero(buf, pair, limit)
        if nxt < 0:
            return -1
        pos = max(nxt, pair + 2)
    return -1


def _valid_at(buf: bytes, pos: int, limit: int, max_frame: int) -> bool:
    try:
        return read_frame(buf, pos, limit, max_frame) is not None
    except FrameError:
        return True  # checksum-valid, unknown type: still a valid frame boundary


def all_zero(buf: bytes, start: int, end: int) -> bool:
    """Whether `buf[start:end]` holds only zero bytes (C speed, no copy)."""
    return start >= end or buf.count(0, start, end) == end - start


def next_nonzero(buf: bytes, pos: int, limit: int) -> int:
    """Offset of the first non-zero byte in `buf[pos:limit]`, or -1.

    Counts zeros per 1 MiB chunk (C speed, no copy) and bisects inside the first chunk
    that holds something else.
    """
    chunk = 1 << 20
    while pos < limit:
        end = min(limit, pos + chunk)
        if buf.count(0, pos, end) == end - pos:
            pos = end
            continue
        lo, hi = pos, end
        while hi - lo > 64:
            mid = (lo + hi) // 2
            if buf.count(0, lo, mid) == mid - lo:
                lo = mid
            else:
                hi = mid
        for i in range(lo, hi):
            if buf[i]:
                return i
        raise AssertionError("count said non-zero")  # pragma: no cover
    return -1
