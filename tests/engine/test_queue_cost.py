"""Claim, ack and expiry work does not grow with the backlog.

Method: structural, not timed. A `Topic` with a `JobQueue` holds a backlog of 1,000 or
100,000 jobs over 1 or 100 priorities; the test counts how many records the queue looks
at (reads of the log's record slots, `Run.encs`) while it claims 8 jobs, acks them, and
expires a few leases among thousands. The counts must be the same small number at both
backlog sizes.
"""

from __future__ import annotations

import pytest

from topicd.engine.queues import Claimer, JobQueue
from topicd.engine.topic import Enc, Topic
from topicd.model import TopicConfig


def backlog(n: int, levels: int) -> tuple[Topic, JobQueue]:
    topic = Topic("q", 1, TopicConfig(type="queue"), name_json=b'"q"')
    q = topic.queue = JobQueue(topic, 1)
    step = 10_000
    for first in range(1, n + 1, step):
        k = min(step, n - first + 1)
        encs = [b'{"$seq":%d,"$ts":0,"data":0}' % (first + i) for i in range(k)]
        prios = {i: (first + i) % levels for i in range(k) if (first + i) % levels}
        topic.publish(first, 0, encs, [1] * k, k, {}, {}, prios, {})
    return topic, q


class _CountingSlots(list[Enc]):
    """A run's record slots, counting every read (one slot or a slice)."""

    counter: Counting

    def __getitem__(self, i):  # type: ignore[override]
        type(self).counter.calls += 1
        return super().__getitem__(i)


class Counting:
    """Counts reads of the topic's record slots (`Run.encs`): every way the queue or
    the topic looks at a record (`Topic.enc`, the claim sweep, the delete) reads one."""

    def __init__(self, topic: Topic) -> None:
        self.calls = 0
        _CountingSlots.counter = self
        for run in topic.runs:
            run.encs = _CountingSlots(run.encs)


def claim(q: JobQueue, want: int, now: float, lease_ms: int = 1000) -> list[int]:
    me = Claimer("w", want, lease_ms)
    q.sweep(now)
    q.claim([me], now, 0, 0, False)
    return [lease.seq for lease, _ in me.got]


@pytest.mark.parametrize("levels", [1, 100])
def test_claim_and_ack_look_at_the_same_few_records_at_any_backlog(levels):
    looked = []
    for n in (1_000, 100_000):
        topic, q = backlog(n, levels)
        claim(q, 8, 0.0)  # warm: the level heap is settled
        counter = Counting(topic)
        seqs = claim(q, 8, 0.0)
        held, _ = q.hold_for_ack("w", seqs, [])
        topic.delete_seqs(held)
        looked.append(counter.calls)
    assert looked[0] == looked[1]
    assert looked[0] <= 4 * 8  # the claim sweep, the delete, the earliest-seq advance


def test_a_claim_and_ack_storm_on_one_busy_level_costs_the_same_at_any_backlog():
    looked = []
    for n in (10_000, 100_000):
        topic, q = backlog(n, 100)
        claim(q, 8, 0.0)
        counter = Counting(topic)
        for _ in range(300):  # past the point where a level compacts its dead entries
            held, _ = q.hold_for_ack("w", claim(q, 8, 0.0), [])
            topic.delete_seqs(held)
        looked.append(counter.calls)
    assert looked[0] == looked[1] <= 4 * 8 * 300


def test_expiry_looks_only_at_expired_leases():
    looked = []
    for n in (1_000, 100_000):
        topic, q = backlog(n, 100)
        claim(q, 500, 0.0, lease_ms=60_000)  # long leases stay put
        claim(q, 5, 0.0, lease_ms=100)  # five expire
        counter = Counting(topic)
        assert q.sweep(1.0) == 5
        looked.append(counter.calls)
    assert looked[0] == looked[1] <= 2 * 5


def test_a_deleted_prefix_is_skipped_once():
    topic, q = backlog(10_000, 1)
    topic.delete_seqs(range(1, 9_001))
    counter = Counting(topic)
    assert claim(q, 1, 0.0) == [9_001]
    assert counter.calls <= 3  # earliest_seq jumped the dead prefix


def test_a_starved_level_drops_entries_of_dead_jobs():
    topic, q = backlog(10_000, 1)  # 10,000 level-0 jobs...
    encs = [b'{"$seq":%d,"$ts":0,"data":0}' % s for s in range(10_001, 20_001)]
    topic.publish(
        10_001, 0, encs, [1] * 10_000, 10_000, {}, {}, dict.fromkeys(range(10_000), -1), {}
    )
    assert len(q.levels[-1].fresh) == 10_000  # ...and 10,000 at -1, never reached
    topic.delete_seqs(range(10_001, 19_001))
    assert len(q.levels[-1].fresh) <= 2 * 1_000 + 64
