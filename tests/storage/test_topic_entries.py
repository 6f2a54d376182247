"""A snapshot's topic entry stores only what differs from the defaults.

Method: `snapshot.config_entry` of the default config is empty and of a config with
every field changed names every field; either way `recovery.config_from_wire` rebuilds
the same config. A default-config topic's whole encoded entry stays small (its size is
what 100,000 topics keep in memory between checkpoints), and decodes back field for field.
"""

from __future__ import annotations

import dataclasses

import msgspec

from topicd.model import TopicConfig
from topicd.storage import snapshot
from topicd.storage.recovery import config_from_wire
from topicd.storage.segments import SegSnap

CHANGED = TopicConfig(
    type="queue",
    ttl_ms=1,
    cap_records=2,
    cap_bytes=3,
    discard="reject",
    durability="fsync",
    priority=4,
    auto_priority=False,
    auto_create=False,
    idempotency_window_ms=5,
    dedupe_node=False,
    lease_ms=6,
    claim_jitter_ms=7,
    max_deliveries=8,
    dead_letter="dlq",
    leases_durable=True,
    depth_soft_limit=9,
    retry_backoff_ms=10,
    retry_backoff_max_ms=11,
)


def test_every_changed_field_is_stored_and_the_rest_come_back_as_defaults():
    assert snapshot.config_entry(TopicConfig()) == {}
    assert set(snapshot.config_entry(CHANGED)) == {f.name for f in dataclasses.fields(TopicConfig)}
    for config in (TopicConfig(), CHANGED, TopicConfig(cap_records=5, durability="memory")):
        assert config_from_wire(snapshot.config_entry(config)) == config


def test_a_default_topics_entry_is_small_and_decodes_whole():
    snap = snapshot.TopicSnap(
        id=12345,
        name="t12345",
        config=snapshot.config_entry(TopicConfig()),
        head=3,
        reserved=3,
        earliest=1,
        evict_floor=1,
        evictions=[],
        lost=[],
        last_ts=1795000000000,
        last_write_ts=1795000000000,
        last_read_ts=None,
        runs=[],
        segments=[SegSnap(1, 3, 400, False, 1795000000000)],
        absorbed=3,
    )
    raw = msgspec.msgpack.encode(snap)
    assert len(raw) < 200
    assert msgspec.msgpack.decode(raw, type=snapshot.TopicSnap) == snap
