"""The checkpoint's bulk absorb builds exactly what a record-at-a-time absorb builds.

`SegmentStore.absorb` frames the live records straight from the captured slices, a run
frame (`segments.encode_run`) per stretch of consecutive live seqs, cut at the run caps
and the seal triggers, and indexes them in bulk. The reference here walks the records
one at a time: a run ends at a gap or a slice's end, at `RUN_MAX_RECORDS`, when its
text reaches the byte budget it started with, or when its segment is full; a new
segment starts whenever a gap exceeds the padding bound, the segment holds
`max_events` slots or `max_bytes` data bytes. Hypothesis drives random live sets (dead
slots, long gaps), extras and triggers, and the segments (index columns, data files,
registry) must be equal, byte for byte. Every frame written must also decode back
(`read_seg_frame`) to exactly the records drawn, extras included, and a record holding
a raw NUL gets a one-record frame.
"""

from __future__ import annotations

from array import array

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from topicd.config import SegmentsConfig
from topicd.storage import frame as frames
from topicd.storage import segments as sg
from topicd.testing.fake_fs import FakeDisk

TID = 0x1234
NOW = 1_700_000_000_000


def _enc(seq: int, ts: int, data: bytes) -> bytes:
    return b'{"$seq":%d,"$ts":%d,"data":"%b"}' % (seq, ts, data)


@st.composite
def _works(draw: st.DrawFn) -> tuple[sg.AbsorbWork, list[sg.AbsorbRecord], SegmentsConfig]:
    base = draw(st.integers(1, 50))
    n = draw(st.integers(1, 120))
    slices: list[sg.AbsorbSlice] = []
    records: list[sg.AbsorbRecord] = []
    tags: dict[int, str] = {}
    nodes: dict[int, str] = {}
    prios: dict[int, int] = {}
    shapes: dict[int, tuple[int, int]] = {}
    seq = base
    with_extras = draw(st.booleans())  # (a topic without any takes the stretch path)
    for _ in range(draw(st.integers(1, 3))):  # slices, with a gap between them
        encs: list[bytes | None] = []
        stamps: list[int] = []
        sizes: list[int] = []
        start = seq
        for _ in range(n):
            ts = NOW + draw(st.integers(0, 5))
            data = b"x" * draw(st.integers(0, 40))
            if draw(st.integers(0, 9)) == 0:
                encs.append(None)  # dead before the checkpoint: no frame
            else:
                enc = _enc(seq, ts, data)
                encs.append(enc)
                rec = sg.AbsorbRecord(seq, ts, enc, len(data) + 2)
                kind = draw(st.integers(0, 11)) if with_extras else 11
                if kind == 0:
                    rec.tag = tags[seq] = f"t{seq}"
                elif kind == 1:
                    rec.node = nodes[seq] = "nöde"
                elif kind == 2:
                    rec.prio = prios[seq] = draw(st.integers(-5, 5)) or 1
                elif kind == 3:
                    rec.shape = shapes[seq] = (3, 4)
                records.append(rec)
            stamps.append(ts)
            sizes.append(len(data) + 2)
            seq += 1
        slices.append(sg.AbsorbSlice(start, encs, array("q", stamps), array("I", sizes)))
        seq += draw(st.sampled_from([0, 1, 7, sg._MAX_PAD, sg._MAX_PAD + 1, 10_000]))
    cfg = SegmentsConfig(
        max_events=draw(st.integers(1, 200)),
        max_bytes=draw(st.sampled_from([1, 150, 700, 5_000, 1 << 20])),
        max_age_ms=0,
    )
    work = sg.AbsorbWork(TID, slices, [], base, seq)
    work.tags, work.nodes, work.prios, work.shapes = tags, nodes, prios, shapes
    return work, records, cfg


def _reference(
    records: list[sg.AbsorbRecord], cfg: SegmentsConfig, starts: frozenset[int] = frozenset()
) -> list[tuple]:
    """(segment index, data bytes) of a record-at-a-time absorb into an empty topic
    (`starts`: the first seqs of the captured slices, where runs end too)."""
    segs: list[tuple[sg.Segment, bytearray]] = []
    run: list[sg.AbsorbRecord] = []
    budget = 0

    def close() -> None:
        seg, data = segs[-1]
        first = run[0].seq
        ex = frames.Extras(
            None,
            {r.seq - first: r.tag for r in run if r.tag is not None},
            {r.seq - first: r.node for r in run if r.node is not None},
            {r.seq - first: r.prio for r in run if r.prio},
            {r.seq - first: r.shape for r in run if r.shape is not None},
        )
        frame = sg.encode_run(
            TID,
            first,
            [r.enc for r in run],
            array("q", [r.ts for r in run]),
            array("I", [r.size for r in run]),
            ex,
        )
        assert frame is not None
        for r in run:
            seg.add(r.seq, seg.data_len, len(frame), r.ts)
        seg.data_len += len(frame)
        data.extend(frame)
        run.clear()

    for rec in records:
        if run:
            seg = segs[-1][0]
            if (
                rec.seq != run[-1].seq + 1
                or rec.seq in starts
                or len(run) == sg.RUN_MAX_RECORDS
                or sum(len(r.enc) for r in run) >= budget
                or rec.seq - seg.first + 1 > cfg.max_events
            ):
                close()
        if not run:
            seg = segs[-1][0] if segs else None
            if seg is not None and (
                rec.seq - seg.last - 1 > sg._MAX_PAD
                or rec.seq - seg.first + 1 > cfg.max_events
                or seg.data_len >= cfg.max_bytes
            ):
                seg.sealed = True
                seg = None
            if seg is None:
                seg = sg.Segment(rec.seq, rec.seq - 1, 0, False, NOW)
                segs.append((seg, bytearray()))
            budget = min(sg.RUN_MAX_BYTES, cfg.max_bytes - seg.data_len)
        run.append(rec)
    if run:
        close()
    if segs:
        last = segs[-1][0]
        if last.slots >= cfg.max_events or last.data_len >= cfg.max_bytes:
            last.sealed = True
    return [_shape(seg, bytes(data)) for seg, data in segs]


def _decoded(disk: FakeDisk, segments: list[sg.Segment]) -> list[sg.AbsorbRecord]:
    """Every record of the segments' frames, decoded (and verified)."""
    out: list[sg.AbsorbRecord] = []
    for seg in segments:
        data = disk.read(sg.data_path("/d", TID, seg.first))
        pos = 0
        while pos < seg.data_len:
            frame = sg.read_seg_frame(data, pos, seg.data_len)
            assert frame is not None
            out += frame.records()
            pos = frame.end
    return out


def _shape(seg: sg.Segment, data: bytes) -> tuple:
    ts = list(seg.ts) if not seg.sealed else None  # a sealed segment drops its ts column
    snap = msgspec.structs.replace(seg.snap(), meta_len=-1)  # (the reference has no `.meta`)
    return (snap, list(seg.offsets), list(seg.lens), ts, bytes(seg.flags), data)


@settings(max_examples=300, deadline=None)
@given(_works())
def test_bulk_absorb_equals_the_record_at_a_time_absorb(case):
    work, records, cfg = case
    want = _reference(records, cfg, frozenset(sl.base for sl in work.slices))
    disk = FakeDisk()
    store = sg.SegmentStore(disk, "/d", cfg, write_idx=False)
    disk.mkdir("/d")
    outcome = store.absorb([work], set(), NOW)
    got_segs = outcome.topics[TID].state.segments
    got = [_shape(s, disk.read(sg.data_path("/d", TID, s.first))[: s.data_len]) for s in got_segs]
    assert got == want
    assert outcome.records == len(records)
    assert outcome.bytes == sum(s.data_len for s in got_segs)
    assert _decoded(disk, got_segs) == records


def test_a_segment_seals_when_its_bytes_reach_max_bytes():
    """A run ends with the record whose text reaches the segment's byte budget, and the
    segment (its data now at `max_bytes` or past it) seals before the next record."""
    n = 7
    encs: list[bytes | None] = [_enc(seq, NOW, b"abc") for seq in range(1, n + 1)]
    records = [sg.AbsorbRecord(seq, NOW, enc, 5) for seq, enc in enumerate(encs, 1) if enc]
    cfg = SegmentsConfig(max_events=100, max_bytes=2 * len(encs[0] or b""), max_age_ms=0)
    work = sg.AbsorbWork(
        TID, [sg.AbsorbSlice(1, encs, array("q", [NOW] * n), array("I", [5] * n))], [], 1, n
    )
    disk = FakeDisk()
    store = sg.SegmentStore(disk, "/d", cfg, write_idx=False)
    disk.mkdir("/d")
    segs = store.absorb([work], set(), NOW).topics[TID].state.segments
    assert [(s.first, s.last) for s in segs] == [(1, 2), (3, 4), (5, 6), (7, 7)]
    assert all(s.sealed for s in segs)  # (each holds max_bytes of data or more)
    got = [_shape(s, disk.read(sg.data_path("/d", TID, s.first))[: s.data_len]) for s in segs]
    assert got == _reference(records, cfg)


def test_a_record_holding_a_raw_nul_gets_one_record_frames():
    """A run whose text holds a NUL byte (never from the HTTP path) cannot be NUL-joined:
    its records are framed one by one, as one-record Append frames. A segment then holds
    both kinds; delete flags flip in both, reads serve both, and loading the segment from
    its `.meta` gives what decoding its frames gives."""
    encs: list[bytes | None] = [b'"a"', b'"b\x00c"', b'"d"']
    more: list[bytes | None] = [b'"e"', b'"f"', b'"g"']
    n = len(encs)
    cfg = SegmentsConfig(max_events=100, max_age_ms=0)
    stamps, sizes = array("q", [NOW] * n), array("I", [3] * n)
    slices = [sg.AbsorbSlice(1, encs, stamps, sizes), sg.AbsorbSlice(4, more, stamps, sizes)]
    work = sg.AbsorbWork(TID, slices, [], 1, 6)
    work.tags = {2: "t", 5: "u"}
    assert sg.encode_run(TID, 1, list(encs), stamps, sizes) is None
    disk = FakeDisk()
    store = sg.SegmentStore(disk, "/d", cfg, write_idx=False)
    disk.mkdir("/d")
    outcome = store.absorb([work], set(), NOW)
    [seg] = outcome.topics[TID].state.segments
    assert len(set(seg.offsets)) == 4  # three one-record frames, then a run
    got = _decoded(disk, [seg])
    assert [r.enc for r in got] == encs + more
    assert [r.tag for r in got] == [None, "t", None, None, "u", None]
    store.install(outcome)
    store.install(store.absorb([sg.AbsorbWork(TID, [], [2, 5], 1, 6)], set(), NOW))
    path = sg.data_path("/d", TID, 1)
    assert sg.flagged_seqs(disk.read(path), seg.data_len) == [2, 5]
    assert store.read_record(TID, 2) is None
    rec = store.read_record(TID, 6)
    assert rec is not None and rec.enc == b'"g"'
    assert store.read_range(TID, 1, 6, 1 << 20) == {1: b'"a"', 3: b'"d"', 4: b'"e"', 6: b'"g"'}
    [seg] = store.topics[TID].segments
    from_meta = sg.load_segment(disk, "/d", TID, seg.snap(), max_frame=1 << 24)
    assert from_meta.rewrite is None
    disk.unlink(sg.meta_path("/d", TID, 1))
    from_frames = sg.load_segment(disk, "/d", TID, seg.snap(), max_frame=1 << 24)
    assert from_frames.rewrite is not None
    for loaded in (from_meta, from_frames):
        got_seg = loaded.segment
        assert (got_seg.offsets, got_seg.lens, got_seg.flags) == (
            seg.offsets,
            seg.lens,
            seg.flags,
        )
        assert loaded.extras[0] == {2: "t", 5: "u"}
