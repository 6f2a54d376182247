"""Typed request bodies of the `/v0` surface, decoded by msgspec.

These structs are plain data shared by `http/` (which decodes them) and `engine/` (which
acts on them); nothing here does I/O. Decoding rules (README §3):

* unknown keys are skipped, wrong types are `400 invalid_request`;
* integers are strict: a float, bool, negative (for unsigned) or out-of-type value fails;
  u64 upper bounds are checked after decoding (`check_u64`), because msgspec constraints
  stop at int64;
* write bodies decode into `gc=False` structs (they hold no reference cycles), so a
  10,000-record batch adds nothing for the cyclic GC to scan;
* `data` and `meta` are kept as `msgspec.Raw`: the client's exact JSON text. The whole body
  is minified once before decoding, so every `Raw` slice is already minified with every
  literal untouched (big integers, `1.10`, `1e400`, string escapes).
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

import msgspec

from topicd.errors import BatchTooLarge, InvalidRequest

U64_MAX: Final = 2**64 - 1
I32_MIN: Final = -(2**31)
I32_MAX: Final = 2**31 - 1

U64 = Annotated[int, msgspec.Meta(ge=0)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
I32 = Annotated[int, msgspec.Meta(ge=I32_MIN, le=I32_MAX)]

UNSET = msgspec.UNSET
UnsetType = msgspec.UnsetType

_TOPIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,254}")
_ROUTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:>-]{0,254}")
_LEASE_TOKEN = re.compile(r"lease_[0-9a-f]+")
# a comma-joined list of fences, each `""` or a lease token
_LEASE_TOKENS = re.compile(r"(?:lease_[0-9a-f]+)?(?:,(?:lease_[0-9a-f]+)?)*")


def valid_topic_name(name: str) -> bool:
    """`^[A-Za-z0-9][A-Za-z0-9._:-]{0,254}$`, case-sensitive, ASCII only."""
    return _TOPIC_NAME.fullmatch(name) is not None


def valid_router_name(name: str) -> bool:
    return _ROUTER_NAME.fullmatch(name) is not None


def check_topic_name(name: str, field: str = "topic") -> None:
    if not valid_topic_name(name):
        raise InvalidRequest(
            f"invalid {field} name {name[:300]!r}: 1-255 characters of [A-Za-z0-9._:-], "
            "starting with a letter or digit",
            {field: name[:300]},
        )


def check_u64(value: int, path: str) -> int:
    if value > U64_MAX:
        raise InvalidRequest(f"{path}: {value} is out of the u64 range", {"field": path})
    return value


class TopicConfigIn(msgspec.Struct, omit_defaults=True):
    """The Topic config object as sent (README §10). Omitted fields take defaults."""

    type: Literal["log", "queue"] = "log"
    ttl_ms: U64 = 0
    cap_records: U64 = 0
    cap_bytes: U64 = 0
    discard: Literal["old", "reject"] = "old"
    durable: bool | UnsetType = UNSET
    durability: Literal["ephemeral", "memory", "disk", "fsync"] | UnsetType = UNSET
    priority: I32 | None = None
    auto_priority: bool = True
    auto_create: bool = True
    idempotency_window_ms: U64 = 120000
    dedupe_node: bool = True
    lease_ms: U64 = 30000
    claim_jitter_ms: U64 = 0
    max_deliveries: U64 = 0
    dead_letter: str | None = None
    leases_durable: bool = False
    depth_soft_limit: U64 = 0
    retry_backoff_ms: U64 = 0
    retry_backoff_max_ms: U64 = 3600000

    def check(self, path: str = "config") -> None:
        for name in (
            "ttl_ms",
            "cap_records",
            "cap_bytes",
            "idempotency_window_ms",
            "lease_ms",
            "claim_jitter_ms",
            "max_deliveries",
            "depth_soft_limit",
            "retry_backoff_ms",
            "retry_backoff_max_ms",
        ):
            check_u64(getattr(self, name), f"{path}.{name}")


class RecordIn(msgspec.Struct, gc=False):
    """One element of `records` in `POST /v0/topics/:topic`."""

    data: msgspec.Raw
    tag: str | None = None
    node: str | None = None
    meta: msgspec.Raw | UnsetType = UNSET
    priority: I32 | None = None


class WriteIn(msgspec.Struct, gc=False):
    """`POST /v0/topics/:topic` body (api-topics §6.1)."""

    records: list[RecordIn]
    node: str | None = None
    priority: I32 = 0
    idempotency_key: str | None = None
    create: bool | None = None
    config: TopicConfigIn | None = None
    disable_backpressure: bool = False


class PlainRecordIn(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    """A record with nothing but `data` (the fast path; any other key fails decoding)."""

    data: msgspec.Raw


class PlainWriteIn(msgspec.Struct, gc=False):
    """A write whose records are all plain and that sets no batch `node`/`priority`.

    `decode_write` tries this shape first; anything else falls back to `WriteIn`.
    """

    records: list[PlainRecordIn]
    node: None = None
    priority: Literal[0] = 0
    idempotency_key: str | None = None
    create: bool | None = None
    config: TopicConfigIn | None = None
    disable_backpressure: bool = False


class DiffIn(msgspec.Struct):
    """`POST /v0/topics/:topic/diff` body (api-topics §7.1)."""

    from_seq: U64 = 0
    limit: U32 = 0
    node: str | list[str] | None = None
    include_tags: bool = False
    include_meta: bool = True
    wait_ms: U32 = 0
    max_batch_bytes: U64 = 0

    def check(self) -> None:
        check_u64(self.from_seq, "from_seq")
        check_u64(self.max_batch_bytes, "max_batch_bytes")


class DeleteIn(msgspec.Struct):
    """`POST /v0/topics/:topic/delete` body (api-topics §10.1)."""

    before_seq: U64 | None = None
    match: str | list[str] | None = None

    def check(self) -> None:
        if self.before_seq is not None:
            check_u64(self.before_seq, "before_seq")


class WatchTopicIn(msgspec.Struct):
    """One entry of `POST /v0/watch` `topics` (api-routers-watch §2.2)."""

    from_seq: U64 = 0
    tail: bool = False


class WatchIn(msgspec.Struct):
    """`POST /v0/watch` body (api-routers-watch §2.2)."""

    topics: dict[str, WatchTopicIn]
    node: str | list[str] | None = None
    limit: U32 = 0
    max_batch_bytes: U64 = 262144
    heartbeat_ms: U64 | None = None
    include_meta: bool = True
    include_tags: bool = False
    include_data: bool = True
    consistency: Literal["eventual", "strong"] = "eventual"

    def check(self) -> None:
        check_u64(self.max_batch_bytes, "max_batch_bytes")
        if self.heartbeat_ms is not None:
            check_u64(self.heartbeat_ms, "heartbeat_ms")
        for name, t in self.topics.items():
            check_u64(t.from_seq, f"topics.{name}.from_seq")


class WsEnvelopeIn(msgspec.Struct):
    """What every `/v0/ws` command carries (api-routers-watch §3.1): `op`, and
    `request_id` (any JSON value, echoed verbatim on the reply)."""

    op: str | None = None
    request_id: msgspec.Raw = msgspec.Raw(b"null")


class WsRequestIdIn(msgspec.Struct):
    """Only the `request_id` of a message whose `op` is unusable (to echo it)."""

    request_id: msgspec.Raw = msgspec.Raw(b"null")


class WsSubscribeIn(msgspec.Struct):
    """A `/v0/ws` `subscribe` command: `topic` (+ `from_seq` / `tail`) and/or `topics`."""

    topic: str | None = None
    topics: dict[str, WatchTopicIn] | None = None
    from_seq: U64 = 0
    tail: bool = False
    node: str | list[str] | None = None
    limit: U32 = 0
    max_batch_bytes: U64 = 0
    include_data: bool = True
    include_tags: bool = False
    include_meta: bool = True
    lenient: bool = False

    def check(self) -> None:
        check_u64(self.from_seq, "from_seq")
        check_u64(self.max_batch_bytes, "max_batch_bytes")
        for name, t in (self.topics or {}).items():
            check_u64(t.from_seq, f"topics.{name}.from_seq")


class WsUnsubscribeIn(msgspec.Struct):
    """A `/v0/ws` `unsubscribe` command: `topic` and/or `topics`."""

    topic: str | None = None
    topics: list[str] | None = None


class WsPublishIn(msgspec.Struct):
    """The `/v0/ws` `publish` fields the HTTP write body does not have (the rest of the
    message is decoded as a write body, `WriteIn`)."""

    topic: str
    return_seqs: bool = True
    config: msgspec.Raw = msgspec.Raw(b"null")


WS_ENVELOPE_DECODER: Final = msgspec.json.Decoder(WsEnvelopeIn)
WS_REQUEST_ID_DECODER: Final = msgspec.json.Decoder(WsRequestIdIn)
WS_SUBSCRIBE_DECODER: Final = msgspec.json.Decoder(WsSubscribeIn)
WS_UNSUBSCRIBE_DECODER: Final = msgspec.json.Decoder(WsUnsubscribeIn)
WS_PUBLISH_DECODER: Final = msgspec.json.Decoder(WsPublishIn)


def check_worker_node(node: str, max_bytes: int) -> None:
    """A queue worker's `node`: non-empty, at most `max_bytes` UTF-8 bytes."""
    if not node:
        raise InvalidRequest("node must not be empty", {"field": "node"})
    if len(node.encode()) > max_bytes:
        raise InvalidRequest(f"node is longer than {max_bytes} bytes", {"field": "node"})


class ClaimIn(msgspec.Struct):
    """`POST /v0/topics/:q/claim` body (queues)."""

    node: str
    max: U32 = 1
    lease_ms: U64 | None = None

    def check(self, max_node_bytes: int) -> None:
        check_worker_node(self.node, max_node_bytes)
        if self.lease_ms is not None:
            check_u64(self.lease_ms, "lease_ms")


class LeaseOpIn(msgspec.Struct):
    """`POST /v0/topics/:q/ack`, `/nack` and `/extend` bodies (queues): `delay_ms` is
    nack's, `lease_ms` (required there) extend's."""

    node: str
    seqs: list[U64]
    lease_ids: list[str] | None = None
    delay_ms: U64 = 0
    lease_ms: U64 | None = None

    def check(self, max_node_bytes: int, max_seqs: int) -> None:
        """`node`, then the `seqs` bound (`batch_too_large`), then the fences: each `""`
        or a lease token, aligned with `seqs` when given."""
        check_worker_node(self.node, max_node_bytes)
        if len(self.seqs) > max_seqs:
            raise BatchTooLarge(
                f"{len(self.seqs)} seqs in one call, more than {max_seqs}",
                {"seqs": len(self.seqs), "max": max_seqs},
            )
        seqs = self.seqs
        if seqs and max(seqs) > U64_MAX:  # (one pass in C; the loop only names the culprit)
            for i, seq in enumerate(seqs):
                check_u64(seq, f"seqs[{i}]")
        fences = self.lease_ids
        if fences:
            if len(fences) != len(seqs):
                raise InvalidRequest(
                    f"lease_ids has {len(fences)} entries for {len(seqs)} seqs",
                    {"field": "lease_ids"},
                )
            # every fence at once (one match over the joined list, no fence holds a
            # comma); the loop only runs to name the first bad one
            joined = ",".join(fences)
            if joined.count(",") != len(fences) - 1 or _LEASE_TOKENS.fullmatch(joined) is None:
                for i, fence in enumerate(fences):
                    if fence and _LEASE_TOKEN.fullmatch(fence) is None:
                        raise InvalidRequest(
                            f"lease_ids[{i}] is not a lease id", {"field": f"lease_ids[{i}]"}
                        )
        check_u64(self.delay_ms, "delay_ms")
        if self.lease_ms is not None:
            check_u64(self.lease_ms, "lease_ms")


WRITE_DECODER: Final = msgspec.json.Decoder(WriteIn)
PLAIN_WRITE_DECODER: Final = msgspec.json.Decoder(PlainWriteIn)


def decode_write(body: bytes) -> WriteIn | PlainWriteIn:
    """Decode a minified write body, taking the plain fast path when the shape allows.

    Raises msgspec errors for malformed or mistyped bodies (from the full decoder, so the
    message names the real problem rather than the fast path's stricter shape).
    """
    try:
        return PLAIN_WRITE_DECODER.decode(body)
    except msgspec.ValidationError:
        return WRITE_DECODER.decode(body)


DIFF_DECODER: Final = msgspec.json.Decoder(DiffIn)
DELETE_DECODER: Final = msgspec.json.Decoder(DeleteIn)
CONFIG_DECODER: Final = msgspec.json.Decoder(TopicConfigIn)
WATCH_DECODER: Final = msgspec.json.Decoder(WatchIn)
CLAIM_DECODER: Final = msgspec.json.Decoder(ClaimIn)
LEASE_OP_DECODER: Final = msgspec.json.Decoder(LeaseOpIn)


class RouterIn(msgspec.Struct):
    """`PUT /v0/routers/:router` body (the router fields; `create_dest` is not echoed)."""

    source: str
    dest: str
    preserve_node: bool = True
    preserve_tag: bool = True
    create_dest: bool = True
    filter: str | list[str] | None = None
    allow_cycle: bool = False
    guarantee: Literal["at_least_once", "exactly_once"] = "at_least_once"


ROUTER_DECODER: Final = msgspec.json.Decoder(RouterIn)


def check_router_name(name: str) -> None:
    if not valid_router_name(name):
        raise InvalidRequest(
            f"invalid router name {name[:300]!r}: 1-255 characters of [A-Za-z0-9._:>-], "
            "starting with a letter or digit",
            {"router": name[:300]},
        )
