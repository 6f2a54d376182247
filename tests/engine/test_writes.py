"""Write preparation and batch encoding: the plain fast path and the general path must
produce byte-identical records, and every validation error keeps its index.

Method: decode the same logical batch through `decode_write` (which picks the plain
shape when it can) and through the full `WriteIn` decoder, prepare and encode both, and
compare the stored bytes; then probe the limits at their edges.
"""

from __future__ import annotations

import dataclasses

import msgspec
import orjson
import pytest

from topicd.config import ProtocolConfig
from topicd.engine.writes import encode_batch, prepare_write
from topicd.errors import RecordTooLarge
from topicd.wire import WRITE_DECODER, PlainWriteIn, WriteIn, decode_write

LIMITS = ProtocolConfig()


def bytes_of(x):
    return x if isinstance(x, list) else bytes(x)


def body(records, **batch) -> bytes:
    return orjson.dumps({"records": records, **batch})


@pytest.mark.parametrize(
    "data",
    [1, "a%sb%d%%", {"x": [1.10, "q\u00e9"]}, None, "a\\u0000b"],
)
def test_plain_and_general_paths_encode_identically(data):
    raw = body([{"data": data}, {"data": data}])
    plain = decode_write(raw)
    full = WRITE_DECODER.decode(raw)
    assert isinstance(plain, PlainWriteIn)
    assert isinstance(full, WriteIn)
    a = prepare_write(plain, None, LIMITS)
    b = prepare_write(full, None, LIMITS)
    assert a.plain and not b.plain
    assert (a.sizes, a.nbytes) == (b.sizes, b.nbytes)
    enc, joined = encode_batch(a, 41, 7)
    assert (enc, bytes(joined)) == tuple(map(bytes_of, encode_batch(b, 41, 7)))
    assert orjson.loads(enc[1]) == {"$seq": 42, "$ts": 7, "data": data}
    assert bytes(joined) == b"\x00".join(enc)
    for one in (a, b):  # a single record (formatted on its own) as within a batch
        one = dataclasses.replace(one, parts=one.parts[:1], sizes=one.sizes[:1])
        single, single_joined = encode_batch(one, 42, 7)
        assert single == enc[1:] and bytes(single_joined) == enc[1]


def test_non_plain_shapes_fall_back_to_the_full_decoder():
    for raw in (
        body([{"data": 1, "tag": "t"}]),
        body([{"data": 1}], node="n"),
        body([{"data": 1}], priority=3),
        body([{"data": 1, "unknown": 2}]),
    ):
        assert isinstance(decode_write(raw), WriteIn), raw


def test_type_errors_come_from_the_full_decoder():
    with pytest.raises(msgspec.ValidationError, match=r"records\[0\]\.tag"):
        decode_write(body([{"data": 1, "tag": 5}]))


def test_mixed_batch_keeps_extras_sparse():
    req = WRITE_DECODER.decode(
        body([{"data": 1}, {"data": 2, "tag": "t", "meta": {"m": 1}}, {"data": 3, "node": "n"}])
    )
    p = prepare_write(req, None, LIMITS)
    assert p.tags == {1: "t"}
    assert p.nodes == {2: "n"}
    assert set(p.shapes) == {1, 2}
    encs, joined = encode_batch(p, 1, 5)
    assert bytes(joined).split(b"\x00") == encs
    assert encs[1] == b'{"$seq":2,"$ts":5,"meta":{"m":1},"data":2}'
    assert encs[2] == b'{"$seq":3,"$ts":5,"$node":"n","data":3}'


@pytest.mark.parametrize("plain", [True, False])
def test_record_size_limit_at_the_edge(plain):
    limits = ProtocolConfig(max_record_bytes=10)
    ok = "x" * 8  # "xxxxxxxx": 10 bytes of JSON text
    extra = {} if plain else {"tag": "t"}
    prepare_write(decode_write(body([{"data": ok, **extra}])), None, limits)
    with pytest.raises(RecordTooLarge) as exc:
        prepare_write(
            decode_write(body([{"data": ok, **extra}, {"data": ok + "x", **extra}])), None, limits
        )
    assert exc.value.detail == {"index": 1, "bytes": 11, "max": 10}
