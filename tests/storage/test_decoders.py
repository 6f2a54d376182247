"""Decoders never crash on arbitrary bytes (storage spec §12, "Decoders").

Method: Hypothesis feeds random bytes — and valid encodings with random damage — to the
WAL frame reader, the file-header decoder, the Append body decoder and the snapshot
decoder. Each must return a result or raise its own format error (`FrameError`,
`HeaderError`, `SnapshotError`), never anything else, and never accept damaged bytes as
the original.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topicd.storage import frame as frames
from topicd.storage import snapshot

MAX = 1 << 20


def _frame() -> bytes:
    return frames.encode_append(
        7,
        1,
        123,
        [b'{"$seq":1,"$ts":123,"data":1}', b'{"$seq":2,"$ts":123,"data":[2]}'],
        [1, 3],
        frames.Extras(key="k", tags={1: "t"}),
        fsync_class=True,
    )


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 64))
def test_read_frame_on_random_bytes(data, offset):
    try:
        f = frames.read_frame(data, offset, len(data), MAX)
    except frames.FrameError:
        return
    if f is not None:
        assert f.end <= len(data)
        try:
            if f.ftype == frames.APPEND:
                frames.decode_append(f)
        except frames.FrameError:
            pass


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 200), st.integers(1, 255))
def test_damaged_frames_never_validate(pos, xor):
    good = _frame()
    assert frames.read_frame(good, 0, len(good), MAX) is not None
    bad = bytearray(good)
    i = pos % (len(bad) - 1)  # the tail byte is outside the checksum by design
    bad[i] ^= xor
    try:
        f = frames.read_frame(bytes(bad), 0, len(bad), MAX)
    except frames.FrameError:
        return
    assert f is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=128))
def test_file_header_decoder(data):
    with contextlib.suppress(frames.HeaderError):
        frames.decode_file_header(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.booleans())
def test_snapshot_decoder(data, with_header):
    if with_header:  # a valid header around random bytes reaches the body decoder
        import struct

        import xxhash

        data = (
            snapshot.HEADER.pack(
                snapshot.MAGIC, snapshot.VERSION, 1, len(data), xxhash.xxh3_64_intdigest(data)
            )
            + data
        )
        assert len(struct.pack("<Q", 0)) == 8
    try:
        body = snapshot.decode(data)
    except snapshot.SnapshotError:
        return
    for topic in body.topics:
        with contextlib.suppress(snapshot.SnapshotError):
            snapshot.restore_runs(topic)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 5), st.sampled_from([0, frames.FLAG_NUL_JOINED]))
def test_append_body_decoder(body, count, flags):
    f = frames.Frame(frames.APPEND, flags, 1, 1, 0, count, memoryview(body), 0, 0)
    with contextlib.suppress(frames.FrameError):
        frames.decode_append(f)


_TEXT = st.binary(max_size=40).map(lambda b: b.replace(b"\x00", b"."))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_TEXT, min_size=1, max_size=8),
    st.booleans(),
    st.booleans(),
    st.dictionaries(st.integers(0, 7), st.text(max_size=5), max_size=3),
)
def test_append_round_trip(encs, pass_joined, fsync, tags):
    """Both layouts decode to what was encoded: NUL-joined (with or without the caller's
    joined text) for batches, the length column when a record holds a raw NUL byte."""
    sizes = [len(e) % 7 for e in encs]
    extras = frames.Extras(key="k" if fsync else None, tags=tags)
    joined = b"\x00".join(encs) if pass_joined else None
    data = frames.encode_append(9, 5, 77, encs, sizes, extras, fsync_class=fsync, joined=joined)
    f = frames.read_frame(data, 0, len(data), MAX)
    assert f is not None and (f.topic_id, f.seq, f.ts_ms, f.count) == (9, 5, 77, len(encs))
    assert bool(f.flags & frames.FLAG_NUL_JOINED) == (len(encs) > 1)
    assert bool(f.flags & frames.FLAG_FSYNC) == fsync
    body = frames.decode_append(f)
    assert (body.encs, body.sizes, body.extras) == (encs, sizes, extras)
    if len(encs) == 1:  # the segment read's shortcut reads the same bytes
        assert frames.single_enc(f) == encs[0]
    else:
        with pytest.raises(frames.FrameError):
            frames.single_enc(f)


def test_a_record_with_a_raw_nul_keeps_the_length_column():
    encs = [b"a\x00b", b"c"]
    data = frames.encode_append(1, 1, 1, encs, [1, 1], frames.Extras(), fsync_class=False)
    f = frames.read_frame(data, 0, len(data), MAX)
    assert f is not None and not f.flags & frames.FLAG_NUL_JOINED
    assert frames.decode_append(f).encs == encs


def test_nul_joined_separator_count_must_match():
    import struct

    body = struct.pack("<II", 3, 0) + struct.pack("<III", 1, 1, 1) + b"a\x00b"
    f = frames.Frame(frames.APPEND, frames.FLAG_NUL_JOINED, 1, 1, 0, 3, memoryview(body), 0, 0)
    with pytest.raises(frames.FrameError, match="separators"):
        frames.decode_append(f)


def test_short_append_bodies_are_format_errors():
    import struct

    for n, tail in ((3, b"\x01\x02\x03"), (2, b"\x00" * 9)):
        body = struct.pack("<II", n, 0) + tail
        f = frames.Frame(frames.APPEND, 0, 1, 1, 0, n, memoryview(body), 0, 0)
        try:
            frames.decode_append(f)
        except frames.FrameError:
            continue
        raise AssertionError("accepted a short body")


# ---- multi-frame writes and the search for the next valid frame ----------------------


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.binary(min_size=1, max_size=300).map(lambda b: b.replace(b"\x00", b".")),
        min_size=1,
        max_size=40,
    ),
    st.booleans(),
    st.dictionaries(st.integers(0, 39), st.text(max_size=8), max_size=6),
    st.dictionaries(st.integers(0, 39), st.integers(-5, 5).filter(bool), max_size=4),
    st.integers(700, 3000),
)
def test_a_write_too_large_for_one_frame_splits_and_merges_back(encs, joined, tags, prios, cap):
    """Every frame of a split write fits `max_frame`, only the last lacks FLAG_MORE, seqs
    continue frame to frame, only the first carries the key, and merging the frames gives
    back exactly the write."""
    n = len(encs)
    tags = {i: t for i, t in tags.items() if i < n}
    prios = {i: p for i, p in prios.items() if i < n}
    sizes = [len(e) for e in encs]
    extras = frames.Extras(key="idem-key", tags=tags, prios=prios)
    data = frames.encode_append(
        3,
        10,
        55,
        encs,
        sizes,
        extras,
        fsync_class=True,
        joined=b"\x00".join(encs) if joined else None,
        max_frame=cap,
    )
    parts = []
    pos = 0
    while pos < len(data):
        f = frames.read_frame(data, pos, len(data), cap)
        assert f is not None, "a frame over the limit (or a broken one)"
        parts.append((f, frames.decode_append(f)))
        pos = f.end
    assert [bool(f.flags & frames.FLAG_MORE) for f, _ in parts] == [True] * (len(parts) - 1) + [
        False
    ]
    assert all(f.flags & frames.FLAG_FSYNC for f, _ in parts)
    seq = 10
    for i, (f, body) in enumerate(parts):
        assert f.seq == seq
        seq += f.count
        assert (body.extras.key is not None) == (i == 0)
    assert seq == 10 + n
    merged = frames.merge_appends(parts)
    assert (merged.encs, merged.sizes, merged.extras) == (encs, sizes, extras)
    if len(data) - 4 <= cap and len(parts) == 1:
        assert not parts[0][0].flags & frames.FLAG_MORE


def test_a_record_too_large_for_any_frame_is_refused_by_the_encoder():
    with pytest.raises(ValueError, match="max_frame_bytes"):
        frames.encode_append(
            1,
            1,
            1,
            [b"x" * 5000, b"y"],
            [5000, 1],
            frames.Extras(),
            fsync_class=False,
            max_frame=4096,
        )


def _brute_find(buf: bytes, start: int, limit: int, max_frame: int) -> int:
    for pos in range(start, max(start, limit - frames.FRAME_HEAD_LEN + 1)):
        try:
            if frames.read_frame(buf, pos, limit, max_frame) is not None:
                return pos
        except frames.FrameError:
            return pos
    return -1


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=200),
    st.binary(max_size=200),
    st.integers(0, 2),
    st.integers(0, 60),
    st.sampled_from([b"", b"\x00" * 50, b"\x01\x00\x00\x00" * 20, b"ab\x00\x01\x00\x00\x00"]),
)
def test_the_valid_frame_search_agrees_with_trying_every_offset(pre, post, nframes, start, pad):
    """The C-speed scan finds exactly the offset that parsing at every offset finds."""
    frame = _frame()
    buf = pre + pad + frame * nframes + post
    start = min(start, len(buf))
    assert frames.find_valid_frame(buf, start, len(buf), MAX) == _brute_find(
        buf, start, len(buf), MAX
    )


def test_a_frame_with_a_non_zero_reserved_field_is_not_valid():
    import struct

    data = bytearray(_frame())
    data[6] = 1  # checksummed again, so only the reserved field is wrong
    struct.pack_into("<Q", data, len(data) - 9, frames.checksum(bytes(data[4:-9])))
    assert frames.read_frame(bytes(data), 0, len(data), MAX) is None
    data[6] = 0
    struct.pack_into("<Q", data, len(data) - 9, frames.checksum(bytes(data[4:-9])))
    assert frames.read_frame(bytes(data), 0, len(data), MAX) is not None
