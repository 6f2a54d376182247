"""A small topic stays small: what 100,000 topics cost is mostly per-topic overhead.

Method: structural. Topics are built and published to directly (no engine); the Python
heap they take is measured with `tracemalloc` and bounded per topic, so a regression (an
instance dict, a 4 KiB `orjson` buffer kept for a short name, containers made for every
topic) fails the bound. Topics without tags, nodes, priorities or shapes share one
read-only empty map; the first extra gives a topic its own, and the shared one stays empty.
"""

from __future__ import annotations

import gc
import tracemalloc

import orjson
import pytest

from topicd.engine.topic import Topic
from topicd.model import TopicConfig

RECORD = b'{"$seq":%d,"$ts":1795000000000,"data":"' + b"x" * 60 + b'"}'


def small_topic(i: int) -> Topic:
    t = Topic(f"topic-{i}", i, TopicConfig(), name_json=orjson.dumps(f"topic-{i}"))
    encs = [RECORD % s for s in (1, 2, 3)]
    t.publish(1, 1795000000000, encs, [len(e) for e in encs], 3 * len(encs[0]), {}, {}, {}, {})
    return t


def test_a_three_record_topic_takes_under_1500_bytes_of_heap_beside_its_records():
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        topics = [small_topic(i) for i in range(2000)]
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    records = sum(len(e) + 33 for t in topics for e in t.runs[0].encs if isinstance(e, bytes))
    per_topic = (used - records) / len(topics)
    assert per_topic < 1500, per_topic  # ~1,200 now; ~6,900 before slots and lazy maps


def test_topics_without_extras_share_one_empty_map_that_refuses_writes():
    a, b = small_topic(1), small_topic(2)
    for name in ("tags", "nodes", "prios", "shapes", "hops"):
        assert getattr(a, name) is getattr(b, name)
    with pytest.raises(TypeError):
        a.tags[1] = "x"
    a.publish(4, 1, [RECORD % 4], [10], 10, {0: "t"}, {0: "n"}, {0: 2}, {0: (1, 2)})
    assert (a.tags, a.nodes, a.prios, a.shapes) == ({4: "t"}, {4: "n"}, {4: 2}, {4: (1, 2)})
    assert a.tag_index.exact("t") == [4]
    assert (b.tags, b.nodes, b.prios, b.shapes) == ({}, {}, {}, {})  # still shared, empty
    assert b.tags is small_topic(3).tags
    deleted, _ = a.delete_records(None, ("Eq", "t"), a.head_seq)
    assert deleted == 1
    assert a.tags == {}


def test_a_small_topic_is_few_objects_for_the_garbage_collector():
    """A full collection walks every tracked object: at 100,000 topics each one a topic
    keeps is 100,000 more per pause (it was 16 a topic)."""
    gc.collect()
    before = len(gc.get_objects())
    topics = [small_topic(i) for i in range(1000)]
    gc.collect()
    per_topic = (len(gc.get_objects()) - before) / len(topics)
    # the topic, its scheduler slot, its runs list and one run (its encs list and its two
    # arrays: array objects are tracked too)
    assert per_topic <= 7.5, per_topic
