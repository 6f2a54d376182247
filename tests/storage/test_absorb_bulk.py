"""The checkpoint's bulk absorb builds exactly what a record-at-a-time absorb builds.

`SegmentStore.absorb` frames the live records in one pass (`frames.single_frame`,
`AbsorbRecord.frame` only for records with extras) and indexes them inline. The
reference here is the record-at-a-time definition: every live record's
`AbsorbRecord.frame`, indexed with `Segment.add`, a new segment whenever a gap exceeds
the padding bound, the segment holds `max_events` slots or `max_bytes` data bytes.
Hypothesis drives random live sets (dead slots, long gaps), extras and triggers, and the
segments (index columns, data files, registry) must be equal, byte for byte.
"""

from __future__ import annotations

from array import array

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from topicd.config import SegmentsConfig
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


def _reference(records: list[sg.AbsorbRecord], cfg: SegmentsConfig) -> list[tuple]:
    """(segment index, data bytes) of a record-at-a-time absorb into an empty topic."""
    segs: list[tuple[sg.Segment, bytearray]] = []
    for rec in records:
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
        data = rec.frame(TID)
        seg.add(rec.seq, seg.data_len, len(data), rec.ts)
        seg.data_len += len(data)
        segs[-1][1].extend(data)
    if segs:
        last = segs[-1][0]
        if last.slots >= cfg.max_events or last.data_len >= cfg.max_bytes:
            last.sealed = True
    return [_shape(seg, bytes(data)) for seg, data in segs]


def _shape(seg: sg.Segment, data: bytes) -> tuple:
    ts = list(seg.ts) if not seg.sealed else None  # a sealed segment drops its ts column
    snap = msgspec.structs.replace(seg.snap(), meta_len=-1)  # (the reference has no `.meta`)
    return (snap, list(seg.offsets), list(seg.lens), ts, bytes(seg.flags), data)


@settings(max_examples=300, deadline=None)
@given(_works())
def test_bulk_absorb_equals_the_record_at_a_time_absorb(case):
    work, records, cfg = case
    want = _reference(records, cfg)
    disk = FakeDisk()
    store = sg.SegmentStore(disk, "/d", cfg, write_idx=False)
    disk.mkdir("/d")
    outcome = store.absorb([work], set(), NOW)
    got_segs = outcome.topics[TID].state.segments
    got = [_shape(s, disk.read(sg.data_path("/d", TID, s.first))[: s.data_len]) for s in got_segs]
    assert got == want
    assert outcome.records == len(records)
    assert outcome.bytes == sum(len(r.frame(TID)) for r in records)


def test_a_segment_seals_when_its_bytes_reach_max_bytes_exactly():
    """Equal records whose frames fill `max_bytes` to the byte: the record after them
    starts the next segment (the bound is reached, not only exceeded)."""
    n = 7
    encs: list[bytes | None] = [_enc(seq, NOW, b"abc") for seq in range(1, n + 1)]
    records = [sg.AbsorbRecord(seq, NOW, enc, 5) for seq, enc in enumerate(encs, 1) if enc]
    frame_len = len(records[0].frame(TID))
    cfg = SegmentsConfig(max_events=100, max_bytes=2 * frame_len, max_age_ms=0)
    work = sg.AbsorbWork(
        TID, [sg.AbsorbSlice(1, encs, array("q", [NOW] * n), array("I", [5] * n))], [], 1, n
    )
    disk = FakeDisk()
    store = sg.SegmentStore(disk, "/d", cfg, write_idx=False)
    disk.mkdir("/d")
    segs = store.absorb([work], set(), NOW).topics[TID].state.segments
    assert [(s.first, s.last) for s in segs] == [(1, 2), (3, 4), (5, 6), (7, 7)]
    got = [_shape(s, disk.read(sg.data_path("/d", TID, s.first))[: s.data_len]) for s in segs]
    assert got == _reference(records, cfg)
