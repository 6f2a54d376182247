"""The daemon's garbage-collector settings bound what one automatic collection scans.

A collection holds the GIL for all of its scan, so its length is a loop stall. After a
burst of long-lived objects (100,000 new topics) generation 1 holds every survivor of the
generation-0 collections since its own last collection: with CPython's (…, 20, 20) that is
up to 22 generation-0 loads in one young collection (a million objects, ~60 ms). Method:
the daemon's `settle_gc` with a small generation 0, then a burst of long-lived topics
built directly; `gc.callbacks` sizes each collection's generations when it starts.
"""

from __future__ import annotations

import gc

import orjson

from topicd import daemon
from topicd.engine.topic import Topic
from topicd.model import TopicConfig

THRESHOLD0 = 1000


def test_no_young_collection_scans_more_than_its_bound_during_a_burst_of_topics():
    old = gc.get_threshold()
    was_enabled = gc.isenabled()
    sizes: list[tuple[int, int]] = []  # (generation, objects in generations 0..it)

    def sizer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            g = info["generation"]
            sizes.append((g, sum(len(gc.get_objects(k)) for k in range(g + 1))))

    gc.disable()
    try:
        daemon.settle_gc(THRESHOLD0)
        gc.callbacks.append(sizer)
        try:
            config = TopicConfig()
            kept = []
            for i in range(20_000):  # ~7 long-lived tracked objects each
                t = Topic(f"t{i}", i, config, name_json=orjson.dumps(f"t{i}"))
                enc = b'{"$seq":1,"data":"x"}'
                t.publish(1, 1795000000000, [enc], [len(enc)], len(enc), {}, {}, {}, {})
                kept.append(t)
        finally:
            gc.callbacks.remove(sizer)
    finally:
        gc.unfreeze()  # (the test process's own objects: back to the oldest generation)
        gc.set_threshold(*old)
        if was_enabled:
            gc.enable()
    young = [n for g, n in sizes if g < 2]
    assert len(young) > 2 * daemon.GC_THRESHOLD1, sizes  # the burst did trigger collections
    assert any(g == 1 for g, _ in sizes), sizes
    assert not any(g == 2 for g, _ in sizes), sizes  # full collections stay rare
    # at most four generation-0 loads (plus what the callback itself allocates): the
    # collection's own and the survivors of the three generation-0 collections before
    bound = 4 * THRESHOLD0 + 200
    assert max(young) <= bound, (max(young), bound)
