"""A run's slot list is not tracked by the cyclic garbage collector (`topic.slot_list`):
with millions of retained records a full collection visited every slot, the longest loop
stall left at 10 GiB. The list must stay untracked through every change the engine makes
to it (CPython never re-tracks a list, but a new list would be tracked), and through
recovery, which builds runs of its own."""

from __future__ import annotations

import gc
import sys

import pytest

from topicd.engine.topic import EVICTED, Run
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import RecordIn, WriteIn

pytestmark = pytest.mark.skipif(
    sys.implementation.name != "cpython", reason="untracking is CPython's"
)


def test_a_run_slot_list_stays_untracked_through_in_place_changes():
    run = Run(1)
    encs = run.encs
    assert not gc.is_tracked(encs)
    encs.append(b"a")
    encs.extend([b"b", None, b"c"] * 1000)
    encs[1] = EVICTED
    encs[2:5] = [EVICTED, EVICTED, None]
    del encs[:3]
    assert run.encs is encs and not gc.is_tracked(encs)
    gc.collect()
    assert not gc.is_tracked(encs)
    assert encs[:4] == [EVICTED, None, None, b"c"]  # (nothing was freed under it)


async def test_every_run_of_a_written_and_recovered_topic_is_untracked():
    import msgspec

    disk = FakeDisk()
    cfg = durable_config()
    async with open_durable(disk, cfg) as engine:
        for i in range(50):
            await engine.append("t", WriteIn(records=[RecordIn(data=msgspec.Raw(b"%d" % i))]))
        runs = engine.get("t").runs
        assert runs and all(not gc.is_tracked(r.encs) for r in runs)
    async with open_durable(disk, cfg) as engine:
        t = engine.get("t")
        assert t.head_seq == 50
        assert all(not gc.is_tracked(r.encs) for r in t.runs)
