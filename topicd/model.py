"""Core value types: the resolved topic config and the stored record.

A `Record` is immutable once published. It keeps the client's exact JSON text and one
pre-encoded rendering of itself in the default read projection (`$seq`, `$ts`, `$node`,
`$priority`, `meta`, `data`), built once at write time; every other projection (with
`$tag`, without `meta`, without `data`) is a cheap splice of that rendering. Reads, watch
frames and (later) WAL frames therefore never re-encode user JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import orjson

if TYPE_CHECKING:
    from topicd.errors import JsonValue

DATA_KEY: Final = b',"data":'
META_KEY: Final = b',"meta":'
TAG_KEY: Final = b',"$tag":'


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

    @property
    def durable(self) -> bool:
        return self.durability == "fsync"

    def to_wire(self) -> dict[str, JsonValue]:
        return {
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


class Record:
    """One stored record.

    Attributes:
        seq, ts: `$seq` and `$ts`.
        size: payload bytes for caps and quotas: len(minified data) + len(minified meta).
        tag, node: writer's tag and origin node, or None.
        priority: job priority (topicd extension), 0 when unset.
        enc: the record object in the default projection, e.g.
            `{"$seq":7,"$ts":1767225600000,"$node":"a","meta":{..},"data":{..}}`.
        pre_len: length of the `{"$seq":..,"$ts":..[,"$node"][,"$priority"]` head of `enc`.
        data_off: offset of `,"data":` in `enc` (== pre_len when there is no meta).
    """

    __slots__ = ("data_off", "enc", "node", "pre_len", "priority", "seq", "size", "tag", "ts")

    def __init__(
        self,
        seq: int,
        ts: int,
        size: int,
        tag: str | None,
        node: str | None,
        priority: int,
        enc: bytes,
        pre_len: int,
        data_off: int,
    ) -> None:
        self.seq = seq
        self.ts = ts
        self.size = size
        self.tag = tag
        self.node = node
        self.priority = priority
        self.enc = enc
        self.pre_len = pre_len
        self.data_off = data_off

    @property
    def data(self) -> bytes:
        """The stored `data` JSON text."""
        return self.enc[self.data_off + len(DATA_KEY) : -1]

    @property
    def meta(self) -> bytes | None:
        """The stored `meta` JSON text, or None."""
        if self.data_off == self.pre_len:
            return None
        return self.enc[self.pre_len + len(META_KEY) : self.data_off]

    def render(self, include_tags: bool, include_meta: bool, include_data: bool = True) -> bytes:
        """The record object in the requested projection (api-topics §7.3)."""
        enc = self.enc
        if include_meta and include_data and (not include_tags or self.tag is None):
            return enc
        parts = [enc[: self.pre_len]]
        if include_tags and self.tag is not None:
            parts.append(TAG_KEY + orjson.dumps(self.tag))
        if include_meta:
            parts.append(enc[self.pre_len : self.data_off])
        parts.append(enc[self.data_off :] if include_data else b"}")
        return b"".join(parts)


def encode_record(
    seq: int,
    ts: int,
    node_json: bytes | None,
    priority: int,
    meta: bytes | None,
    data: bytes,
) -> tuple[bytes, int, int]:
    """Build `(enc, pre_len, data_off)` for a record (see `Record`)."""
    pre = b'{"$seq":%d,"$ts":%d' % (seq, ts)
    if node_json is not None:
        pre += b',"$node":' + node_json
    if priority:
        pre += b',"$priority":%d' % priority
    if meta is None:
        return pre + DATA_KEY + data + b"}", len(pre), len(pre)
    head = pre + META_KEY + meta
    return head + DATA_KEY + data + b"}", len(pre), len(head)
