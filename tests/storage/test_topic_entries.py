"""A snapshot's topic entry stores only what differs from the defaults.

Method: `snapshot.config_entry` of the default config is empty and of a config with
every field changed names every field; either way `recovery.config_from_wire` rebuilds
the same config. A default-config topic's whole encoded entry stays small (its size is
what 100,000 topics keep in memory between checkpoints), and decodes back field for field.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

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


@pytest.mark.parametrize("n", [0, 3, 15, 16, 17, 70_000])  # the three array header forms
def test_the_body_is_encoded_in_pieces_that_join_to_one_encode(monkeypatch, n):
    monkeypatch.setattr(snapshot, "CHUNK_TOPICS", 4)
    entries = [msgspec.Raw(msgspec.msgpack.encode({"id": i, "pad": "x" * 40})) for i in range(n)]
    body = snapshot.SnapshotBody(
        snapshot.VERSION, 1, n + 1, 2, [(0, 64), (1, 64)], entries, [(1, "k", 1, 1, 1, 1)]
    )
    pieces = snapshot._encode_body(body)
    assert b"".join(pieces) == msgspec.msgpack.encode(body)
    assert max(len(p) for p in pieces) < 4 * 60 + 200  # no piece holds more than 4 entries
