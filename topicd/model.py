"""Core value types: the resolved topic config and the stored record's encoding.

A record is stored as one `bytes` object, its JSON rendering in the default read
projection, built once at write time:

    {"$seq":7,"$ts":1767225600000[,"$node":"a"][,"$priority":3][,"meta":{..}],"data":{..}}

`data` and `meta` inside it are the client's exact minified JSON text. Every other
projection (with `$tag`, without `meta`, without `data`) is spliced from that rendering
with `project()`, using the record's *shape*: the length of its `$node`/`$priority` part
and of its `meta` part (both 0 for a plain record). Reads, and later watch frames and WAL
frames, therefore never re-encode user JSON.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import orjson
import xxhash

if TYPE_CHECKING:
    from topicd.errors import JsonValue

DATA_KEY: Final = b',"data":'
META_KEY: Final = b',"meta":'
TAG_KEY: Final = b',"$tag":'
_HEAD: Final = re.compile(rb'\{"\$seq":\d+,"\$ts":\d+')

Shape = tuple[int, int]  # (length of the $node/$priority part, length of the meta part)
EXTENSION_DEFAULTS: Final = {
    "depth_soft_limit": 0,
    "retry_backoff_ms": 0,
    "retry_backoff_max_ms": 3600000,
}


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """A fully resolved topic config (README §10): every field present, clamps applied."""

    type: str = "log"
    ttl_ms: int = 0
    cap_records: int = 0
    cap_bytes: int = 0
    discard: str = "old"
    durability: str = "disk"
    priority: int | None = None
    auto_priority: bool = True
    auto_create: bool = True
    idempotency_window_ms: int = 120000
    dedupe_node: bool = True
    lease_ms: int = 30000
    claim_jitter_ms: int = 0
    max_deliveries: int = 0
    dead_letter: str | None = None
    leases_durable: bool = False
    depth_soft_limit: int = 0
    retry_backoff_ms: int = 0
    retry_backoff_max_ms: int = 3600000

    @property
    def durable(self) -> bool:
        return self.durability == "fsync"

    def to_wire(self) -> dict[str, JsonValue]:
        """The config object as returned (README §10 order). The queue extensions
        (`depth_soft_limit`, `retry_backoff_ms`, `retry_backoff_max_ms`) are listed
        only when they differ from their defaults, so a queue that does not use them
        returns exactly the object clients of the plain `/v0` contract know."""
        out: dict[str, JsonValue] = {
            "type": self.type,
            "ttl_ms": self.ttl_ms,
            "cap_records": self.cap_records,
            "cap_bytes": self.cap_bytes,
            "discard": self.discard,
            "durable": self.durable,
            "durability": self.durability,
            "priority": self.priority,
            "auto_priority": self.auto_priority,
            "auto_create": self.auto_create,
            "idempotency_window_ms": self.idempotency_window_ms,
            "dedupe_node": self.dedupe_node,
            "lease_ms": self.lease_ms,
            "claim_jitter_ms": self.claim_jitter_ms,
            "max_deliveries": self.max_deliveries,
            "dead_letter": self.dead_letter,
            "leases_durable": self.leases_durable,
        }
        if self.depth_soft_limit:
            out["depth_soft_limit"] = self.depth_soft_limit
        if self.retry_backoff_ms:
            out["retry_backoff_ms"] = self.retry_backoff_ms
        if self.retry_backoff_max_ms != EXTENSION_DEFAULTS["retry_backoff_max_ms"]:
            out["retry_backoff_max_ms"] = self.retry_backoff_max_ms
        return out


_SHARED_CONFIGS: dict[TopicConfig, TopicConfig] = {}
_SHARED_CONFIGS_MAX: Final = 4096


def shared_config(config: TopicConfig) -> TopicConfig:
    """One instance per distinct config (configs are frozen): 100,000 topics with the
    default config hold one object, not 100,000. The table is bounded; past its size it
    starts over (sharing is only a saving, never a meaning)."""
    found = _SHARED_CONFIGS.get(config)
    if found is not None:
        return found
    if len(_SHARED_CONFIGS) >= _SHARED_CONFIGS_MAX:
        _SHARED_CONFIGS.clear()
    _SHARED_CONFIGS[config] = config
    return config


def offsets(enc: bytes, shape: Shape | None) -> tuple[int, int]:
    """(end of the `$seq`/`$ts`/`$node`/`$priority` head, offset of `,"data":`)."""
    m = _HEAD.match(enc)
    assert m is not None
    pre_len = m.end() + (shape[0] if shape else 0)
    return pre_len, pre_len + (shape[1] if shape else 0)


def project(
    enc: bytes,
    shape: Shape | None,
    tag: str | None,
    include_tags: bool,
    include_meta: bool,
    include_data: bool = True,
) -> bytes:
    """A stored record in the requested projection (api-topics §7.3)."""
    pre_len, data_off = offsets(enc, shape)
    parts = [enc[:pre_len]]
    if include_tags and tag is not None:
        parts.append(TAG_KEY + orjson.dumps(tag))
    if include_meta:
        parts.append(enc[pre_len:data_off])
    parts.append(enc[data_off:] if include_data else b"}")
    return b"".join(parts)


def split(enc: bytes, shape: Shape | None) -> tuple[bytes, bytes | None]:
    """The stored `(data, meta)` JSON texts of a record."""
    pre_len, data_off = offsets(enc, shape)
    meta = enc[pre_len + len(META_KEY) : data_off] if data_off > pre_len else None
    return enc[data_off + len(DATA_KEY) : -1], meta


def shard_of(topic_id: int, shards: int) -> int:
    """The shard of a topic: `xxh3_64(topic_id) % shards` (WAL and delivery shards)."""
    return xxhash.xxh3_64_intdigest(topic_id.to_bytes(8, "little")) % shards
