"""Write validation (api-topics §6.2 steps 3-4) and record construction (step 11).

`prepare_write` checks a decoded `WriteIn` against the protocol limits before any topic is
touched, and turns each record into the exact bytes it will be stored as. `build_records`
later stamps seqs and `$ts` and encodes each record once (`model.encode_record`).
The per-record loop is the hot path of batched writes, so it avoids per-record function
calls and encodes each distinct `node` once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import msgspec
import orjson

from topicd.errors import BatchTooLarge, InvalidRequest, RecordTooLarge
from topicd.model import Record, encode_record
from topicd.wire import UNSET, WriteIn

if TYPE_CHECKING:
    from topicd.config import ProtocolConfig

_META_OBJECT: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])


@dataclass(slots=True)
class PreparedRecord:
    data: bytes
    meta: bytes | None
    tag: str | None
    node_json: bytes | None
    node: str | None
    priority: int
    size: int


@dataclass(slots=True)
class PreparedWrite:
    records: list[PreparedRecord]
    nbytes: int
    idempotency_key: str | None


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def prepare_write(req: WriteIn, header_key: str | None, limits: ProtocolConfig) -> PreparedWrite:
    """Validate steps 3-4 of api-topics §6.2 (first failure wins)."""
    recs = req.records
    n = len(recs)
    if n == 0:
        raise InvalidRequest("records must hold at least one record", {"field": "records"})
    if n > limits.max_batch_records:
        raise BatchTooLarge(
            f"{n} records exceed max_batch_records {limits.max_batch_records}",
            {"count": n, "max": limits.max_batch_records},
        )
    # the body field wins over the header; an empty key identifies nothing (absent)
    key = req.idempotency_key or header_key or None
    if key is not None and _utf8_len(key) > limits.max_idempotency_key_bytes:
        raise InvalidRequest(
            f"idempotency_key is longer than {limits.max_idempotency_key_bytes} bytes",
            {"field": "idempotency_key", "max": limits.max_idempotency_key_bytes},
        )
    max_tag = limits.max_tag_bytes
    max_node = limits.max_node_bytes
    max_meta = limits.max_meta_bytes
    max_meta_keys = limits.max_meta_keys
    max_record = limits.max_record_bytes
    batch_node = req.node
    batch_prio = req.priority
    node_cache: dict[str, bytes] = {}
    out: list[PreparedRecord] = []
    total = 0
    for i, r in enumerate(recs):
        data = bytes(r.data)
        meta: bytes | None = None
        if r.meta is not UNSET:
            meta = bytes(r.meta)
            if meta == b"null":
                meta = None
        tag = r.tag
        node = r.node if r.node is not None else batch_node
        prio = r.priority if r.priority is not None else batch_prio
        if tag is not None and len(tag) * 4 > max_tag and _utf8_len(tag) > max_tag:
            raise _field_error(i, "tag", f"longer than {max_tag} bytes")
        node_json: bytes | None = None
        if node is not None:
            node_json = node_cache.get(node)
            if node_json is None:
                if len(node) * 4 > max_node and _utf8_len(node) > max_node:
                    raise _field_error(i, "node", f"longer than {max_node} bytes")
                node_json = node_cache[node] = orjson.dumps(node)
        size = len(data)
        if meta is not None:
            if len(meta) > max_meta:
                raise _field_error(i, "meta", f"longer than {max_meta} bytes")
            if meta[:1] == b"{" and meta.count(b":") > max_meta_keys:
                keys = len(_META_OBJECT.decode(meta))
                if keys > max_meta_keys:
                    raise _field_error(i, "meta", f"has {keys} keys, more than {max_meta_keys}")
            size += len(meta)
        if size > max_record:
            raise RecordTooLarge(
                f"record {i}: data+meta is {size} bytes, over max_record_bytes {max_record}",
                {"index": i, "bytes": size, "max": max_record},
            )
        total += size
        out.append(PreparedRecord(data, meta, tag, node_json, node, prio, size))
    return PreparedWrite(out, total, key)


def _field_error(index: int, field: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"records[{index}].{field} is {what}", {"index": index, "field": field})


def build_records(prepared: PreparedWrite, first_seq: int, ts: int) -> list[Record]:
    """Stamp seqs and `$ts`, encode each record once in the default projection."""
    out: list[Record] = []
    seq = first_seq
    for p in prepared.records:
        enc, pre_len, data_off = encode_record(seq, ts, p.node_json, p.priority, p.meta, p.data)
        out.append(Record(seq, ts, p.size, p.tag, p.node, p.priority, enc, pre_len, data_off))
        seq += 1
    return out
