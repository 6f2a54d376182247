"""Write validation (api-topics §6.2 steps 3-4) and record encoding (step 11).

`prepare_write` checks a decoded write against the protocol limits before any topic is
touched. `encode_batch` later renders every record's stored JSON with its seq and the
batch's `$ts` (see `model`). This is the hot path of batched writes, so per-record Python
work is kept to a minimum:

* a batch decoded as `PlainWriteIn` (every record is only `{"data": ...}`) keeps the
  `data` texts as they are: validation is one pass over their lengths;
* otherwise each record's *tail* is rendered once (`[,"$node":..][,"$priority":..]
  [,"meta":..],"data":..}`), with the extras kept in sparse maps (index → value);
* `encode_batch` formats the whole batch with a single `bytes %` over a repeated template
  and splits it at NUL separators (valid JSON text never holds a raw NUL byte), instead
  of one formatting call per record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import msgspec
import orjson

from topicd.errors import BatchTooLarge, InvalidRequest, RecordTooLarge
from topicd.model import DATA_KEY, META_KEY, Shape
from topicd.wire import UNSET, PlainWriteIn, RecordIn, WriteIn

if TYPE_CHECKING:
    from topicd.config import ProtocolConfig

_META_OBJECT: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_PLAIN_OVERHEAD: Final = len(DATA_KEY) + 1  # ,"data": ... }


@dataclass(slots=True)
class PreparedWrite:
    """A validated batch, ready to be stamped.

    `parts` are the records' `data` texts when `plain`, else their rendered tails. The
    extras are sparse: record index → value, only for records that have one.
    """

    parts: list[bytes | msgspec.Raw]
    plain: bool
    sizes: list[int]
    nbytes: int
    idempotency_key: str | None
    tags: dict[int, str] = field(default_factory=dict)
    nodes: dict[int, str] = field(default_factory=dict)
    prios: dict[int, int] = field(default_factory=dict)
    shapes: dict[int, Shape] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.parts)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def prepare_write(
    req: WriteIn | PlainWriteIn, header_key: str | None, limits: ProtocolConfig
) -> PreparedWrite:
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
    max_record = limits.max_record_bytes
    if isinstance(req, PlainWriteIn):
        datas: list[bytes | msgspec.Raw] = [r.data for r in req.records]
        sizes = list(map(len, datas))
        if max(sizes) > max_record:
            i = next(i for i, size in enumerate(sizes) if size > max_record)
            raise _too_large(i, sizes[i], max_record)
        return PreparedWrite(datas, True, sizes, sum(sizes), key)
    batch_node = req.node
    batch_prio = req.priority
    parts: list[bytes | msgspec.Raw] = []
    sizes = []
    out = PreparedWrite(parts, False, sizes, 0, key)
    node_json: dict[str, bytes] = {}
    total = 0
    for i, r in enumerate(req.records):
        if (
            r.tag is None
            and r.meta is UNSET
            and batch_node is None
            and r.node is None
            and not batch_prio
            and not r.priority
        ):
            tail = b',"data":%b}' % r.data
            size = len(tail) - _PLAIN_OVERHEAD
        else:
            tail, size = _special(out, i, r, batch_node, batch_prio, limits, node_json)
        if size > max_record:
            raise _too_large(i, size, max_record)
        parts.append(tail)
        sizes.append(size)
        total += size
    out.nbytes = total
    return out


def _too_large(index: int, size: int, max_record: int) -> RecordTooLarge:
    return RecordTooLarge(
        f"record {index}: data+meta is {size} bytes, over max_record_bytes {max_record}",
        {"index": index, "bytes": size, "max": max_record},
    )


def _special(
    out: PreparedWrite,
    i: int,
    r: RecordIn,
    batch_node: str | None,
    batch_prio: int,
    limits: ProtocolConfig,
    node_json: dict[str, bytes],
) -> tuple[bytes, int]:
    """The slow path of one record with a tag, node, meta or priority."""
    tag = r.tag
    node = r.node if r.node is not None else batch_node
    prio = r.priority if r.priority is not None else batch_prio
    if tag is not None:
        if len(tag) * 4 > limits.max_tag_bytes and _utf8_len(tag) > limits.max_tag_bytes:
            raise _field_error(i, "tag", f"longer than {limits.max_tag_bytes} bytes")
        out.tags[i] = tag
    head = b""
    if node is not None:
        if len(node) * 4 > limits.max_node_bytes and _utf8_len(node) > limits.max_node_bytes:
            raise _field_error(i, "node", f"longer than {limits.max_node_bytes} bytes")
        enc = node_json.get(node)
        if enc is None:
            enc = node_json[node] = b',"$node":' + orjson.dumps(node)
        head = enc
        out.nodes[i] = node
    if prio:
        head += b',"$priority":%d' % prio
        out.prios[i] = prio
    meta_part = b""
    size = 0
    if r.meta is not UNSET:
        meta = bytes(r.meta)
        if meta != b"null":
            if len(meta) > limits.max_meta_bytes:
                raise _field_error(i, "meta", f"longer than {limits.max_meta_bytes} bytes")
            if meta[:1] == b"{" and meta.count(b":") > limits.max_meta_keys:
                keys = len(_META_OBJECT.decode(meta))
                if keys > limits.max_meta_keys:
                    raise _field_error(
                        i, "meta", f"has {keys} keys, more than {limits.max_meta_keys}"
                    )
            meta_part = META_KEY + meta
            size = len(meta)
    tail = b'%b%b,"data":%b}' % (head, meta_part, r.data)
    size += len(tail) - len(head) - len(meta_part) - _PLAIN_OVERHEAD
    if head or meta_part:
        out.shapes[i] = (len(head), len(meta_part))
    return tail, size


def _field_error(index: int, field: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"records[{index}].{field} is {what}", {"index": index, "field": field})


_ONE_PLAIN: Final = b'{"$seq":%d,"$ts":%d,"data":%b}'
_ONE: Final = b'{"$seq":%d,"$ts":%d%b'


def encode_batch(
    prepared: PreparedWrite, first_seq: int, ts: int
) -> tuple[list[bytes], bytes | memoryview]:
    """Each record's stored JSON: `{"$seq":S,"$ts":T` + its tail (see module docstring),
    and the same texts joined by NUL bytes (the WAL's Append body takes that as it is).
    A single record, the commonest write, is one `%` without the template and split."""
    parts = prepared.parts
    n = len(parts)
    if n == 1:
        enc = (_ONE_PLAIN if prepared.plain else _ONE) % (first_seq, ts, parts[0])
        return [enc], enc
    head = b'{"$seq":%d,"$ts":' + b"%d" % ts
    template = head + (b',"data":%b}\x00' if prepared.plain else b"%b\x00")
    # the `%` arguments seq, part, seq, part, ...: two C-level slice stores
    args: list[int | bytes | msgspec.Raw] = [0] * (2 * n)
    args[0::2] = range(first_seq, first_seq + n)
    args[1::2] = parts
    text = (template * n) % tuple(args)
    encs = text.split(b"\x00")
    assert len(encs) == n + 1, "a NUL byte inside JSON text"  # msgspec rejects raw NULs
    encs.pop()
    return encs, memoryview(text)[:-1]
