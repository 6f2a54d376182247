"""Property test of the reader contract (api-topics §7-§8) with Hypothesis.

Method: Hypothesis generates an interleaving of writes (tagged or not), wall-clock moves
(forward and backward), config changes (cap_records, cap_bytes, ttl_ms), deletes (by seq
bound and by tag) and reads. The topic is driven exactly as the engine drives it
(`enforce` before every read and after every publish). A model records which seqs were
ever written and which were removed by an explicit delete; any other seq that vanished was
evicted by cap or TTL. A reader follows `next_from_seq` with random limits and checks:

* it sees every record that is live when it reaches it exactly once, in seq order;
* every evicted seq it skipped lies inside the tombstone of that read, and a tombstone's
  range holds only evicted or deleted seqs;
* a read that skipped only deleted seqs carries no tombstone.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from topicd.engine.topic import Topic
from topicd.model import TopicConfig

TAGS = [None, "a", "b", "c:x", "c:y"]

op = st.one_of(
    st.tuples(st.just("write"), st.integers(1, 6), st.sampled_from(TAGS), st.integers(1, 40)),
    st.tuples(st.just("tick"), st.integers(0, 2500)),
    st.tuples(st.just("clock_back"), st.integers(1, 5000)),
    st.tuples(
        st.just("config"),
        st.sampled_from([0, 0, 3, 7, 20]),
        st.sampled_from([0, 0, 60, 200]),
        st.sampled_from([0, 0, 1000, 4000]),
    ),
    st.tuples(st.just("del_before"), st.integers(0, 60)),
    st.tuples(st.just("del_tag"), st.sampled_from(["Eq:a", "Eq:c:x", "Glob:c:", "Glob:"])),
    st.tuples(st.just("read"), st.integers(1, 8)),
    st.tuples(st.just("gap"), st.integers(1, 5)),
    st.tuples(st.just("lost"), st.integers(1, 5)),
)


class Model:
    def __init__(self) -> None:
        self.now = 1_000_000
        self.topic = Topic("t", 1, TopicConfig(), name_json=b'"t"')
        self.written: set[int] = set()
        self.deleted: set[int] = set()
        self.evicted: set[int] = set()
        self.never: set[int] = set()  # seqs a restart skipped (never held a record)
        self.lost: set[int] = set()  # seqs in lost ranges (possibly lost in a crash)
        self.cursor = 0
        self.delivered: list[int] = []
        self.tag_of: dict[int, str | None] = {}

    def live(self, seq: int) -> bool:
        return self.topic.live(seq)

    def sync_evictions(self, before: set[int]) -> None:
        """Seqs that were live and vanished without an explicit delete were evicted."""
        for seq in before:
            if not self.live(seq) and seq not in self.deleted:
                self.evicted.add(seq)

    def live_set(self) -> set[int]:
        return {s for s in self.written if self.live(s)}

    def write(self, n: int, tag: str | None, size: int) -> None:
        t = self.topic
        before = self.live_set()
        first = t.next_seq
        ts = t.stamp(self.now)
        data = b'"' + b"x" * size + b'"'
        encs = [b'{"$seq":%d,"$ts":%d,"data":%b}' % (first + i, ts, data) for i in range(n)]
        tags = {i: tag for i in range(n)} if tag is not None else {}
        t.next_seq = first + n
        t.publish(first, ts, encs, [len(data)] * n, len(data) * n, tags, {}, {}, {})
        self.written.update(range(first, first + n))
        t.enforce(self.now)
        self.sync_evictions(before | set(range(first, first + n)))

    def enforce(self) -> None:
        before = self.live_set()
        self.topic.enforce(self.now)
        self.sync_evictions(before)

    def delete(self, before_seq: int | None, match: tuple[str, str] | None) -> None:
        self.enforce()
        before = self.live_set()
        self.topic.delete_records(before_seq, match, self.topic.head_seq)
        for seq in before:
            if not self.live(seq):
                self.deleted.add(seq)
        # the delete removed exactly the matching live records
        for seq in before:
            rec_gone = not self.live(seq)
            matches = before_seq is None or seq < before_seq
            if match is not None:
                tag = self.tag_of[seq]
                op, value = match
                matches = (
                    matches
                    and tag is not None
                    and (tag == value if op == "Eq" else tag.startswith(value))
                )
            assert rec_gone == matches, (seq, before_seq, match)

    def read(self, limit: int) -> None:
        self.enforce()
        t = self.topic
        c = self.cursor
        res = t.read(c, limit, 1 << 20, None, False, True, 100_000)
        seqs = [int(r.split(b",", 1)[0][len(b'{"$seq":') :]) for r in res.records]
        assert seqs == sorted(seqs)
        assert all(s > c for s in seqs)
        assert len(seqs) <= limit
        assert all(self.live(s) for s in seqs)
        assert res.next_from_seq >= c
        if seqs:
            assert res.next_from_seq >= seqs[-1]
        skipped = [s for s in range(c + 1, res.next_from_seq + 1) if s not in seqs]
        loss = [s for s in skipped if s in self.evicted or s in self.lost]
        gone = self.evicted | self.deleted | self.never | self.lost
        for s in skipped:
            assert s in gone, (s, "skipped a live record")
        tomb = res.tombstone
        if tomb is not None:
            assert tomb.reason in ("cap", "ttl", "mixed", "crash")
            assert tomb.gap_from == c + 1 or tomb.reason == "crash"
            for s in range(tomb.gap_from, tomb.gap_to + 1):
                assert s in gone, (s, "tombstone covers a live seq")
            for s in loss:
                assert tomb.gap_from <= s <= tomb.gap_to, (s, "lost seq outside the tombstone")
        else:
            assert not loss, ("evicted or lost seqs skipped silently", loss)
        self.delivered.extend(seqs)
        self.cursor = res.next_from_seq
        assert res.caught_up == (res.next_from_seq == t.head_seq)


@settings(max_examples=600, deadline=None)
@given(st.lists(op, min_size=1, max_size=60))
def test_reader_sees_live_records_once_and_loss_only_through_tombstones(ops):
    m = Model()
    for o in ops:
        kind = o[0]
        if kind == "write":
            _, n, tag, size = o
            first = m.topic.next_seq
            for s in range(first, first + n):
                m.tag_of[s] = tag
            m.write(n, tag, size)
        elif kind == "tick":
            m.now += o[1]
        elif kind == "clock_back":
            m.now -= o[1]
        elif kind == "config":
            _, cap_r, cap_b, ttl = o
            m.topic.config = replace(m.topic.config, cap_records=cap_r, cap_bytes=cap_b, ttl_ms=ttl)
            m.enforce()
        elif kind == "del_before":
            m.delete(o[1], None)
        elif kind == "del_tag":
            opname, _, value = o[1].partition(":")
            m.delete(None, (opname, value))
        elif kind == "read":
            m.read(o[1])
        elif kind == "gap":
            t = m.topic
            m.never.update(range(t.head_seq + 1, t.head_seq + o[1] + 1))
            t.skip_to(t.head_seq + o[1])
        elif kind == "lost":
            t = m.topic
            m.lost.update(range(t.head_seq + 1, t.head_seq + o[1] + 1))
            t.add_lost_range(t.head_seq + 1, t.head_seq + o[1])
    # drain the reader to the head
    for _ in range(1000):
        if m.cursor == m.topic.head_seq:
            break
        m.read(5)
    assert m.cursor == m.topic.head_seq
    # exactly once, in order
    assert m.delivered == sorted(set(m.delivered))
    # everything still live was delivered
    assert m.live_set() <= set(m.delivered)
    # floors never regress and stay ordered
    t = m.topic
    assert t.evict_floor <= t.earliest_seq <= t.head_seq + 1
    assert t.count == len(m.live_set())
    assert t.bytes == sum(t.size(s) for s in m.live_set())


def test_ts_never_decreases_when_the_wall_clock_steps_back():
    t = Topic("t", 1, TopicConfig(), name_json=b'"t"')
    assert t.stamp(5000) == 5000
    assert t.stamp(4000) == 5000
    assert t.stamp(6000) == 6000
