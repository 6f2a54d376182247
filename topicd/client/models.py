"""What the client hands back: records, tombstones and the other stream events, write
results and jobs.

Payloads stay exact: a record keeps its `data` and `meta` as the JSON text the server sent
(`data_json`, `meta_json`), so numbers such as `21.40` or big integers survive a round
trip; `.data` and `.meta` parse that text on demand (standard-library JSON: big integers
exact, floats as floats). `Record.json()` is the record object as the server sent it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import msgspec

from topicd.client.errors import JsonObject, JsonValue, ProtocolError


class _RecordWire(msgspec.Struct, frozen=True):
    seq: int = msgspec.field(name="$seq")
    ts: int = msgspec.field(name="$ts", default=0)
    tag: str | None = msgspec.field(name="$tag", default=None)
    node: str | None = msgspec.field(name="$node", default=None)
    priority: int = msgspec.field(name="$priority", default=0)
    data: msgspec.Raw = msgspec.Raw(b"")  # empty: the key was absent
    meta: msgspec.Raw = msgspec.Raw(b"")


_RECORD = msgspec.json.Decoder(_RecordWire)


@dataclass(frozen=True)
class Record:
    """One record of `topic`.

    Attributes:
        seq / ts: `$seq` and `$ts`.
        tag / node: `$tag` (only when the read asked for tags) and `$node`.
        priority: `$priority` (0 when absent).
        data_json / meta_json: the exact JSON text of `data` / `meta` (`meta_json` is None
            when the record has none; `data_json` is None only for a watch with
            `include_data=False`).
        raw: the whole record object as the server sent it.
    """

    topic: str
    seq: int
    ts: int
    tag: str | None
    node: str | None
    priority: int
    data_json: bytes | None
    meta_json: bytes | None
    raw: bytes = field(repr=False)

    @property
    def data(self) -> JsonValue:
        """`data`, parsed (None when the read left it out)."""
        return None if self.data_json is None else _loads(self.data_json)

    @property
    def meta(self) -> JsonValue:
        return None if self.meta_json is None else _loads(self.meta_json)

    def json(self) -> bytes:
        """`{"topic": ..., <the record's own keys>}`: one line of `topicd tail`."""
        head = msgspec.json.encode({"topic": self.topic})
        return head[:-1] + b"," + self.raw.lstrip()[1:]

    @classmethod
    def decode(cls, topic: str, raw: bytes) -> Record:
        try:
            w = _RECORD.decode(raw)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"bad record from the server: {exc}") from None
        return cls(
            topic,
            w.seq,
            w.ts,
            w.tag,
            w.node,
            w.priority,
            bytes(w.data) or None,
            bytes(w.meta) or None,
            raw,
        )


def _loads(text: bytes) -> JsonValue:
    value: JsonValue = json.loads(text)
    return value


@dataclass(frozen=True)
class Tombstone:
    """Records between `gap_from` and `gap_to` (inclusive) were lost before this reader
    got them: by a cap or TTL, a crash, a router source trim, or a recreated topic
    (`reason`). Never silent: every read path yields it as an event."""

    topic: str
    reason: str
    gap_from: int
    gap_to: int
    earliest_seq: int
    head_seq: int
    missed_estimate: int

    @classmethod
    def from_json(cls, topic: str, obj: JsonObject) -> Tombstone:
        def num(key: str, default: int = 0) -> int:
            v = obj.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ProtocolError(f"tombstone field {key!r} is not an integer")
            return v

        gap_from, gap_to = num("gap_from"), num("gap_to")
        return cls(
            topic,
            str(obj.get("reason", "")),
            gap_from,
            gap_to,
            num("earliest_seq"),
            num("head_seq"),
            num("missed_estimate", max(0, gap_to - gap_from + 1)),
        )

    @property
    def resume_after(self) -> int:
        """The cursor a reader holds right after this tombstone: `gap_to`, except for a
        recreated topic, where reading restarts below the new instance's first record
        (`earliest_seq - 1`, lower than `gap_to`)."""
        return max(0, min(self.gap_to, self.earliest_seq - 1))

    def json(self) -> bytes:
        return msgspec.json.encode(
            {
                "topic": self.topic,
                "tombstone": {
                    "reason": self.reason,
                    "gap_from": self.gap_from,
                    "gap_to": self.gap_to,
                    "earliest_seq": self.earliest_seq,
                    "head_seq": self.head_seq,
                },
            }
        )


@dataclass(frozen=True)
class CaughtUp:
    """A watched topic is delivered up to `head_seq` (once per backlog→live turn)."""

    topic: str
    head_seq: int


@dataclass(frozen=True)
class TopicDeleted:
    """A watched topic was deleted (or was gone when the stream opened or reopened);
    nothing more comes for it."""

    topic: str


@dataclass(frozen=True)
class PushPaused:
    """Advisory: under heavy load live push is paused for `topics`; it resumes by itself
    and nothing is lost."""

    topics: tuple[str, ...]
    retry_after_ms: int


Event = Record | Tombstone | CaughtUp | TopicDeleted | PushPaused


@dataclass(frozen=True)
class WriteResult:
    topic: str
    first_seq: int
    last_seq: int
    seqs: tuple[int, ...]
    head_seq: int
    count: int
    created: bool
    deduped: bool
    idempotency_key: str | None


@dataclass(frozen=True)
class Job:
    """One claimed job of `topic`: the record, its lease and its delivery count."""

    topic: str
    record: Record
    lease_id: str
    deadline: int
    deliveries: int

    @property
    def seq(self) -> int:
        return self.record.seq

    @property
    def data(self) -> JsonValue:
        return self.record.data


@dataclass(frozen=True)
class LeaseResult:
    """The answer of ack / nack / extend: how many seqs it applied to and which it
    skipped (not held by this node, expired, or fenced off)."""

    topic: str
    done: int
    skipped: tuple[int, ...]
    ready: int | None
    in_flight: int | None
    deadlines: dict[str, int]
