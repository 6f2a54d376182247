"""Contract tests for `POST /v0/topics/:topic` (append records), api-topics §6.

Method: black-box through Quart's test client. Each test writes, then observes the result
only through the public API (the write response, `GET` state and `diff`). Covered: the
response fields and 201/200, `return_seqs`, lazy creation (§6.3), every per-field limit
with its exact boundary, the validation order of §6.2 (requests that break two rules and
the rule that must win), idempotency (README §8) including window expiry under
`autojump_clock`, `discard:"reject"` caps, the resource caps that answer `429` with
`limit`, and the exact-JSON rule of README §3, checked on the raw response bytes.
"""

from __future__ import annotations

import json
import re

import trio
import trio.testing

from topicd.testing.harness import make_config, open_app

JSON_CT = {"Content-Type": "application/json"}
PRESSURE = re.compile(r"0\.\d{3}|1\.000")


def check_pressure(r) -> None:
    value = r.headers.get("X-Topicd-Pressure")
    assert value is not None, "X-Topicd-Pressure missing"
    assert PRESSURE.fullmatch(value), value


async def ok(r, status: int = 200) -> dict:
    raw = await r.get_data()
    assert r.status_code == status, raw
    check_pressure(r)
    body = json.loads(raw)
    assert "error" not in body
    total = body["performance"]["server_total_ms"]
    assert isinstance(total, float), total
    assert total >= 0
    return body


async def fail(r, status: int, code: str) -> dict:
    """The canonical error body (README §5); returns the `error` object."""
    raw = await r.get_data()
    assert r.status_code == status, raw
    check_pressure(r)
    assert r.headers["Content-Type"].split(";")[0].strip() == "application/json"
    body = json.loads(raw)
    assert set(body) <= {"error", "performance"}, body
    err = body["error"]
    assert {"code", "message"} <= set(err) <= {"code", "message", "detail"}, err
    assert err["code"] == code, err
    if "detail" in err:
        assert isinstance(err["detail"], dict)
        assert err["detail"], "detail must be omitted when empty"
    return err


def post(client, topic: str, body: dict, **kw):
    return client.post(f"/v0/topics/{topic}", json=body, **kw)


async def write(client, topic: str, *records, status: int | None = None, **fields) -> dict:
    r = await post(client, topic, {"records": list(records), **fields})
    if status is None:
        assert r.status_code in (200, 201), await r.get_data()
        status = r.status_code
    return await ok(r, status)


async def state(client, topic: str) -> dict:
    return await ok(await client.get(f"/v0/topics/{topic}", query_string={"touch": "false"}))


async def read_all(client, topic: str, **req) -> dict:
    return await ok(await client.post(f"/v0/topics/{topic}/diff", json={"limit": 1000, **req}))


def n_records(n: int) -> list[dict]:
    return [{"data": i} for i in range(n)]


# --------------------------------------------------------------------------------------
# Response, 201 vs 200, return_seqs
# --------------------------------------------------------------------------------------


async def test_first_write_creates_201_then_200(client):
    r = await post(client, "w.basic", {"records": [{"data": 1}, {"data": 2}, {"data": 3}]})
    body = await ok(r, 201)
    assert {k: v for k, v in body.items() if k != "performance"} == {
        "topic": "w.basic",
        "first_seq": 1,
        "last_seq": 3,
        "seqs": [1, 2, 3],
        "head_seq": 3,
        "count": 3,
        "created": True,
        "deduped": False,
    }
    body = await write(client, "w.basic", {"data": 4}, status=200)
    assert body["first_seq"] == body["last_seq"] == 4
    assert body["seqs"] == [4]
    assert body["head_seq"] == 4
    assert body["count"] == 1
    assert body["created"] is False
    assert body["deduped"] is False


async def test_write_to_put_created_topic_is_200(client):
    await ok(await client.put("/v0/topics/w.put"), 201)
    body = await write(client, "w.put", {"data": None}, status=200)
    assert body["created"] is False
    assert body["seqs"] == [1]


async def test_return_seqs_false_omits_seqs(client):
    for i, flag in enumerate(("false", "0")):
        r = await post(
            client, f"w.rs{i}", {"records": n_records(2)}, query_string={"return_seqs": flag}
        )
        body = await ok(r, 201)
        assert "seqs" not in body
        assert (body["first_seq"], body["last_seq"], body["head_seq"], body["count"]) == (
            1,
            2,
            2,
            2,
        )
    r = await post(client, "w.rs2", {"records": n_records(2)})
    assert (await ok(r, 201))["seqs"] == [1, 2]
    r = await post(client, "w.rs2", {"records": n_records(1)}, query_string={"return_seqs": "1"})
    assert (await ok(r))["seqs"] == [3]


async def test_seqs_are_contiguous_in_array_order(client):
    await write(client, "w.order", *({"data": {"i": i}} for i in range(5)))
    await write(client, "w.order", {"data": {"i": 5}}, {"data": {"i": 6}})
    body = await read_all(client, "w.order")
    assert [rec["$seq"] for rec in body["records"]] == list(range(1, 8))
    assert [rec["data"]["i"] for rec in body["records"]] == list(range(7))


async def test_data_null_is_kept_and_data_key_required(client):
    await write(client, "w.null", {"data": None}, status=201)
    body = await read_all(client, "w.null")
    assert body["records"][0]["data"] is None
    assert "data" in body["records"][0]
    await fail(await post(client, "w.null", {"records": [{"tag": "x"}]}), 400, "invalid_request")


# --------------------------------------------------------------------------------------
# Lazy creation (§6.3)
# --------------------------------------------------------------------------------------


async def test_create_false_on_absent_topic_is_404(client):
    r = await post(client, "w.typo", {"records": [{"data": 1}], "create": False})
    err = await fail(r, 404, "topic_not_found")
    assert err["detail"] == {"topic": "w.typo"}
    await fail(await client.get("/v0/topics/w.typo"), 404, "topic_not_found")


async def test_create_false_on_existing_topic_is_ignored(client):
    await write(client, "w.cf", {"data": 1})
    body = await write(client, "w.cf", {"data": 2}, create=False, status=200)
    assert body["seqs"] == [2]


async def test_inline_auto_create_false_blocks_lazy_creation(client):
    r = await post(client, "w.nac", {"records": [{"data": 1}], "config": {"auto_create": False}})
    err = await fail(r, 404, "topic_not_found")
    assert err["detail"] == {"topic": "w.nac"}
    await fail(await client.get("/v0/topics/w.nac"), 404, "topic_not_found")


async def test_create_true_overrides_auto_create_false(client):
    body = await write(
        client, "w.ct", {"data": 1}, create=True, config={"auto_create": False}, status=201
    )
    assert body["created"] is True
    st = await state(client, "w.ct")
    assert st["config"]["auto_create"] is False


async def test_inline_config_is_used_exactly_like_put(client):
    body = await write(
        client,
        "w.cfg",
        {"data": 1},
        config={"cap_records": 7, "durable": True, "lease_ms": 1, "priority": 9999},
        status=201,
    )
    assert body["created"] is True
    cfg = (await state(client, "w.cfg"))["config"]
    assert cfg["cap_records"] == 7
    assert cfg["durability"] == "fsync"
    assert cfg["durable"] is True
    assert cfg["lease_ms"] == 100
    assert cfg["priority"] == 1000


async def test_inline_config_ignored_on_existing_topic(client):
    await write(client, "w.ign", {"data": 1})
    body = await write(
        client,
        "w.ign",
        {"data": 2},
        create=True,
        config={"type": "queue", "cap_records": 1, "dead_letter": "bad name"},
        status=200,
    )
    assert body["created"] is False
    st = await state(client, "w.ign")
    assert st["type"] == "log"
    assert st["config"]["cap_records"] == 0
    assert st["count"] == 2


async def test_bad_inline_config_on_creating_write_is_400(client):
    r = await post(
        client, "w.badcfg", {"records": [{"data": 1}], "config": {"dead_letter": "bad name"}}
    )
    err = await fail(r, 400, "invalid_request")
    assert err["detail"] == {"dead_letter": "bad name"}
    await fail(await client.get("/v0/topics/w.badcfg"), 404, "topic_not_found")


async def test_inline_config_type_errors_are_400_even_on_existing_topic(client):
    # a wrongly typed config is a JSON shape error (§6.2 step 1), not an ignored config
    await write(client, "w.cfgtype", {"data": 1})
    r = await post(client, "w.cfgtype", {"records": [{"data": 1}], "config": {"ttl_ms": "soon"}})
    await fail(r, 400, "invalid_request")
    assert (await state(client, "w.cfgtype"))["count"] == 1


async def test_lazy_create_with_invalid_name_is_400(client):
    r = await post(client, "bad!name", {"records": [{"data": 1}]})
    await fail(r, 400, "invalid_request")


# --------------------------------------------------------------------------------------
# Request shape and per-field limits (§6.2 steps 1, 3, 4)
# --------------------------------------------------------------------------------------


async def test_records_must_be_a_non_empty_array(client):
    for body in (
        {"records": []},
        {},
        {"records": None},
        {"records": {"data": 1}},
        {"records": [1]},
        {"records": [None]},
        {"records": [{"data": 1}, "x"]},
    ):
        await fail(await post(client, "w.shape", body), 400, "invalid_request")
    await fail(await client.get("/v0/topics/w.shape"), 404, "topic_not_found")


async def test_batch_too_large_at_default_10000(client):
    r = await post(client, "w.big", {"records": n_records(10001)})
    await fail(r, 400, "batch_too_large")
    await fail(await client.get("/v0/topics/w.big"), 404, "topic_not_found")


async def test_batch_limit_boundary():
    async with open_app(make_config(protocol={"max_batch_records": 3})) as h:
        client = h.app.test_client()
        assert (await write(client, "w.b3", *n_records(3)))["count"] == 3
        await fail(await post(client, "w.b3", {"records": n_records(4)}), 400, "batch_too_large")
        assert (await state(client, "w.b3"))["head_seq"] == 3


async def test_idempotency_key_length_in_utf8_bytes(client):
    await write(client, "w.ik", {"data": 1}, idempotency_key="k" * 256, status=201)
    await write(client, "w.ik", {"data": 1}, idempotency_key="é" * 128)  # 256 bytes
    for key in ("k" * 257, "é" * 129):  # 257 and 258 bytes
        r = await post(client, "w.ik", {"records": [{"data": 1}], "idempotency_key": key})
        await fail(r, 400, "invalid_request")
    assert (await state(client, "w.ik"))["head_seq"] == 2


async def test_idempotency_header_length_limit(client):
    await write(client, "w.ikh", {"data": 1})
    r = await post(
        client, "w.ikh", {"records": [{"data": 1}]}, headers={"Idempotency-Key": "h" * 257}
    )
    await fail(r, 400, "invalid_request")
    r = await post(
        client, "w.ikh", {"records": [{"data": 1}]}, headers={"Idempotency-Key": "h" * 256}
    )
    await ok(r)


async def test_tag_limit_256_bytes(client):
    await write(client, "w.tag", {"data": 1, "tag": "t" * 256})
    await write(client, "w.tag", {"data": 1, "tag": "é" * 128})
    for tag in ("t" * 257, "é" * 129):
        await fail(
            await post(client, "w.tag", {"records": [{"data": 1, "tag": tag}]}),
            400,
            "invalid_request",
        )
    assert (await state(client, "w.tag"))["head_seq"] == 2


async def test_node_limit_128_bytes(client):
    await write(client, "w.node", {"data": 1, "node": "n" * 128})
    await write(client, "w.node", {"data": 1}, node="é" * 64)
    for node in ("n" * 129, "é" * 65):
        r = await post(client, "w.node", {"records": [{"data": 1, "node": node}]})
        await fail(r, 400, "invalid_request")
        r = await post(client, "w.node", {"records": [{"data": 1}], "node": node})
        await fail(r, 400, "invalid_request")
    assert (await state(client, "w.node"))["head_seq"] == 2


async def test_batch_node_is_resolved_per_record(client):
    # §6.2 step 4: the node is resolved per record over the batch default, so an over-long
    # batch `node` that no record uses is never a record's node
    body = await write(client, "w.noderes", {"data": 1, "node": "own"}, node="n" * 129)
    assert body["count"] == 1
    recs = (await read_all(client, "w.noderes"))["records"]
    assert recs[0]["$node"] == "own"


async def test_meta_limits(client):
    await write(client, "w.meta", {"data": 1, "meta": {f"k{i}": i for i in range(64)}})
    r = await post(
        client, "w.meta", {"records": [{"data": 1, "meta": {f"k{i}": i for i in range(65)}}]}
    )
    await fail(r, 400, "invalid_request")
    overhead = len('{"k":""}')
    await write(client, "w.meta", {"data": 1, "meta": {"k": "x" * (16384 - overhead)}})
    r = await post(
        client, "w.meta", {"records": [{"data": 1, "meta": {"k": "x" * (16385 - overhead)}}]}
    )
    await fail(r, 400, "invalid_request")
    # the bound is on the minified text: whitespace outside strings is not counted
    value = "x" * (16384 - overhead)
    raw = b'{"records":[{"data":1,"meta":  {  "k"  :  "' + value.encode() + b'"  }  }]}'
    await ok(await client.post("/v0/topics/w.meta", data=raw, headers=JSON_CT))
    assert (await state(client, "w.meta"))["head_seq"] == 3


async def test_meta_may_be_any_json_value(client):
    await write(
        client,
        "w.metaany",
        {"data": 1, "meta": [1, 2]},
        {"data": 2, "meta": "s"},
        {"data": 3, "meta": 5},
    )
    recs = (await read_all(client, "w.metaany"))["records"]
    assert [rec["meta"] for rec in recs] == [[1, 2], "s", 5]


async def test_meta_key_limit_counts_top_level_keys_of_objects_only(client):
    nested = {"outer": {f"k{i}": i for i in range(100)}}
    await write(
        client, "w.metak", {"data": 1, "meta": nested}, {"data": 2, "meta": list(range(100))}
    )
    recs = (await read_all(client, "w.metak"))["records"]
    assert recs[0]["meta"] == nested


async def test_priority_must_be_i32(client):
    await write(
        client, "w.prio", {"data": 1, "priority": 2**31 - 1}, {"data": 2, "priority": -(2**31)}
    )
    for value in (2**31, -(2**31) - 1, 1.5, "high", True):
        r = await post(client, "w.prio", {"records": [{"data": 1, "priority": value}]})
        await fail(r, 400, "invalid_request")
        r = await post(client, "w.prio", {"records": [{"data": 1}], "priority": value})
        await fail(r, 400, "invalid_request")
    assert (await state(client, "w.prio"))["head_seq"] == 2


async def test_record_too_large_boundary(client):
    limit = 1048576
    await write(client, "w.size", {"data": "x" * (limit - 2)})  # '"' + ... + '"' = limit
    r = await post(client, "w.size", {"records": [{"data": "x" * (limit - 1)}]})
    await fail(r, 400, "record_too_large")
    # data + meta together: meta {"k":""} is 8 bytes
    await write(client, "w.size", {"data": "x" * (limit - 2 - 8), "meta": {"k": ""}})
    r = await post(
        client, "w.size", {"records": [{"data": "x" * (limit - 2 - 8), "meta": {"k": "y"}}]}
    )
    await fail(r, 400, "record_too_large")
    st = await state(client, "w.size")
    assert st["head_seq"] == 2
    assert st["bytes"] == 2 * limit


async def test_record_size_counts_minified_text():
    async with open_app(make_config(protocol={"max_record_bytes": 10})) as h:
        client = h.app.test_client()
        raw = b'{"records":[{"data": [ 1 , 2 , 3 , 4 ] }]}'  # minified [1,2,3,4] = 9 bytes
        await ok(await client.post("/v0/topics/w.min", data=raw, headers=JSON_CT), 201)
        raw = b'{"records":[{"data": [ 1 , 2 , 3 , 4 ], "meta": 77 }]}'  # 9 + 2
        await fail(
            await client.post("/v0/topics/w.min", data=raw, headers=JSON_CT),
            400,
            "record_too_large",
        )
        assert (await state(client, "w.min"))["bytes"] == 9


async def test_rejected_batch_appends_nothing(client):
    await write(client, "w.atomic", {"data": 1})
    r = await post(client, "w.atomic", {"records": [{"data": 2}, {"data": 3, "tag": "t" * 300}]})
    await fail(r, 400, "invalid_request")
    st = await state(client, "w.atomic")
    assert (st["head_seq"], st["count"]) == (1, 1)


# --------------------------------------------------------------------------------------
# Exact JSON text (README §3) and the $-fields of what was written (README §4)
# --------------------------------------------------------------------------------------

RAW_WRITE = (
    b'{ "records" : [ {\n'
    b'  "data" : { "big" : 123456789012345678901234567890 , "dec" : 1.10 , "huge" : 1e400 ,\n'
    b'    "neg" : -0.0 , "exp" : 2.5E-3 , "esc" : "\\u00e9\\n\\/\\"" , "sp" : "a  b\\t c" ,\n'
    b'    "utf8" : "\xc3\xbc" , "arr" : [ 1 , [ ] , { } , null , true , false ] } ,\n'
    b'  "meta" : { "v" : 1.10 , "e" : "\\u00e9" , "n" : 1e400 }\n'
    b'} , { "data" : 1.10 } , { "data" : "  x  " } ,\n'
    b'  { "data" : 123456789012345678901234567890 } , { "data" : null } , { "data" : -1E+2 } ] }'
)
DATA_0 = (
    b'{"big":123456789012345678901234567890,"dec":1.10,"huge":1e400,'
    b'"neg":-0.0,"exp":2.5E-3,"esc":"\\u00e9\\n\\/\\"","sp":"a  b\\t c",'
    b'"utf8":"\xc3\xbc","arr":[1,[],{},null,true,false]}'
)
META_0 = b'{"v":1.10,"e":"\\u00e9","n":1e400}'


async def test_data_and_meta_round_trip_as_exact_minified_text(client):
    r = await client.post("/v0/topics/w.exact", data=RAW_WRITE, headers=JSON_CT)
    await ok(r, 201)
    r = await client.post("/v0/topics/w.exact/diff", json={})
    raw = await r.get_data()
    assert r.status_code == 200
    assert b'"data":' + DATA_0 in raw
    assert b'"meta":' + META_0 in raw
    for literal in (b"1.10", b'"  x  "', b"123456789012345678901234567890", b"null", b"-1E+2"):
        assert b'"data":' + literal + b"}" in raw or b'"data":' + literal + b"," in raw, literal
    recs = json.loads(raw)["records"]
    assert len(recs) == 6
    assert recs[0]["data"]["esc"] == 'é\n/"'
    assert recs[0]["data"]["utf8"] == "ü"
    assert recs[4]["data"] is None


async def test_bytes_are_minified_data_plus_meta(client):
    r = await client.post("/v0/topics/w.bytes", data=RAW_WRITE, headers=JSON_CT)
    await ok(r, 201)
    expected = len(DATA_0) + len(META_0) + len(b"1.10") + len(b'"  x  "')
    expected += len(b"123456789012345678901234567890") + len(b"null") + len(b"-1E+2")
    assert (await state(client, "w.bytes"))["bytes"] == expected


async def test_written_fields_come_back_as_dollar_fields(client, harness, autojump_clock):
    await write(
        client,
        "w.dollar",
        {"data": 1},
        {"data": 2, "node": "own", "tag": "t2", "meta": {"m": 1}, "priority": 5},
        {"data": 3, "priority": 0},
        {"data": 4, "tag": ""},
        node="batch",
        priority=3,
    )
    now = harness.clock.now_ms()
    recs = (await read_all(client, "w.dollar", include_tags=True))["records"]
    assert recs[0] == {"$seq": 1, "$ts": now, "$node": "batch", "$priority": 3, "data": 1}
    assert recs[1] == {
        "$seq": 2,
        "$ts": now,
        "$node": "own",
        "$tag": "t2",
        "$priority": 5,
        "data": 2,
        "meta": {"m": 1},
    }
    assert recs[2] == {"$seq": 3, "$ts": now, "$node": "batch", "data": 3}
    assert recs[3] == {
        "$seq": 4,
        "$ts": now,
        "$node": "batch",
        "$tag": "",
        "$priority": 3,
        "data": 4,
    }


async def test_unset_fields_are_omitted_never_null(client):
    await write(client, "w.omit", {"data": {"x": None}})
    r = await client.post("/v0/topics/w.omit/diff", json={"include_tags": True})
    raw = await r.get_data()
    rec = json.loads(raw)["records"][0]
    assert set(rec) == {"$seq", "$ts", "data"}
    for key in (b'"$node"', b'"$tag"', b'"meta"', b'"$priority"'):
        assert key not in raw


# --------------------------------------------------------------------------------------
# Idempotency (README §8)
# --------------------------------------------------------------------------------------


async def test_dedupe_replay_returns_original_result(client):
    first = await write(
        client, "w.idem", {"data": 1}, {"data": 2}, idempotency_key="k1", status=201
    )
    await write(client, "w.idem", {"data": 3})
    again = await write(client, "w.idem", {"data": "other"}, idempotency_key="k1", status=200)
    assert again["first_seq"] == 1
    assert again["last_seq"] == 2
    assert again["seqs"] == [1, 2]
    assert again["head_seq"] == first["head_seq"] == 2
    assert again["count"] == 2
    assert again["created"] is False
    assert again["deduped"] is True
    st = await state(client, "w.idem")
    assert (st["head_seq"], st["count"]) == (3, 3)
    recs = (await read_all(client, "w.idem"))["records"]
    assert [rec["data"] for rec in recs] == [1, 2, 3]


async def test_dedupe_replay_survives_record_deletes(client):
    await write(client, "w.idemdel", {"data": 1}, {"data": 2}, idempotency_key="k")
    await ok(await client.post("/v0/topics/w.idemdel/delete", json={"before_seq": 10}))
    body = await write(client, "w.idemdel", {"data": 1}, {"data": 2}, idempotency_key="k")
    assert body["deduped"] is True
    assert (body["seqs"], body["head_seq"], body["count"]) == ([1, 2], 2, 2)
    assert (await state(client, "w.idemdel"))["count"] == 0


async def test_dedupe_replay_respects_return_seqs(client):
    await write(client, "w.idemrs", {"data": 1}, idempotency_key="k")
    r = await post(
        client,
        "w.idemrs",
        {"records": [{"data": 1}], "idempotency_key": "k"},
        query_string={"return_seqs": "false"},
    )
    body = await ok(r)
    assert body["deduped"] is True
    assert "seqs" not in body


async def test_idempotency_key_header(client):
    hdr = {"Idempotency-Key": "h1"}
    await ok(await post(client, "w.hdr", {"records": [{"data": 1}]}, headers=hdr), 201)
    body = await ok(await post(client, "w.hdr", {"records": [{"data": 1}]}, headers=hdr))
    assert body["deduped"] is True
    assert body["seqs"] == [1]
    # the body field is the same key space as the header
    body = await write(client, "w.hdr", {"data": 1}, idempotency_key="h1")
    assert body["deduped"] is True
    assert (await state(client, "w.hdr"))["head_seq"] == 1


async def test_idempotency_body_key_wins_over_header(client):
    r = await post(
        client,
        "w.wins",
        {"records": [{"data": 1}], "idempotency_key": "B"},
        headers={"Idempotency-Key": "H"},
    )
    await ok(r, 201)
    # "H" was not used, so a header-only retry with it appends
    body = await ok(
        await post(client, "w.wins", {"records": [{"data": 2}]}, headers={"Idempotency-Key": "H"})
    )
    assert body["deduped"] is False
    assert body["seqs"] == [2]
    # "B" was the key: a retry with B in the body (any header) is a dedupe hit
    r = await post(
        client,
        "w.wins",
        {"records": [{"data": 3}], "idempotency_key": "B"},
        headers={"Idempotency-Key": "Z"},
    )
    body = await ok(r)
    assert body["deduped"] is True
    assert body["seqs"] == [1]
    assert (await state(client, "w.wins"))["head_seq"] == 2


async def test_idempotency_keys_are_per_topic(client):
    await write(client, "w.k1", {"data": 1}, idempotency_key="same")
    body = await write(client, "w.k2", {"data": 1}, idempotency_key="same", status=201)
    assert body["deduped"] is False
    assert body["created"] is True


async def test_dedupe_of_a_creating_write_is_200_created_false(client):
    await write(client, "w.cr", {"data": 1}, idempotency_key="c", status=201)
    body = await write(client, "w.cr", {"data": 1}, idempotency_key="c", status=200)
    assert body["created"] is False
    assert body["deduped"] is True


async def test_idempotency_window_expiry(client, autojump_clock):
    await write(
        client, "w.win", {"data": 1}, idempotency_key="k", config={"idempotency_window_ms": 1000}
    )
    autojump_clock.jump(0.5)
    body = await write(client, "w.win", {"data": 1}, idempotency_key="k")
    assert body["deduped"] is True
    autojump_clock.jump(1.0)
    body = await write(client, "w.win", {"data": 1}, idempotency_key="k")
    assert body["deduped"] is False
    assert body["seqs"] == [2]
    body = await write(client, "w.win", {"data": 1}, idempotency_key="k")
    assert body["deduped"] is True
    assert body["seqs"] == [2]


async def test_topic_delete_forgets_dedupe_state(client):
    await write(client, "w.delk", {"data": 1}, {"data": 2}, idempotency_key="k")
    await ok(await client.delete("/v0/topics/w.delk"))
    body = await write(client, "w.delk", {"data": 1}, idempotency_key="k", status=201)
    assert body["deduped"] is False
    assert body["seqs"] == [1]


async def test_concurrent_writes_with_same_key_append_once(client):
    results = []

    async def one():
        r = await post(client, "w.conc", {"records": n_records(3), "idempotency_key": "race"})
        results.append((r.status_code, await r.get_json()))

    await ok(await client.put("/v0/topics/w.conc"), 201)
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one)
    assert [s for s, _ in results] == [200] * 4
    assert sorted(b["deduped"] for _, b in results) == [False, True, True, True]
    assert all(b["seqs"] == [1, 2, 3] for _, b in results)
    assert (await state(client, "w.conc"))["head_seq"] == 3


# --------------------------------------------------------------------------------------
# Caps: discard:"reject", discard:"old" (api-topics §6.2 step 7, §6.4)
# --------------------------------------------------------------------------------------


async def test_reject_topic_full_is_422_with_detail(client):
    await ok(
        await client.put("/v0/topics/w.rej", json={"cap_records": 3, "discard": "reject"}), 201
    )
    await write(client, "w.rej", *n_records(2))
    await write(client, "w.rej", {"data": 2})  # exactly at the cap
    r = await post(client, "w.rej", {"records": [{"data": 3}]})
    err = await fail(r, 422, "topic_full")
    assert err["detail"] == {
        "topic": "w.rej",
        "cap_records": 3,
        "cap_bytes": 0,
        "head_seq": 3,
        "earliest_seq": 1,
    }
    st = await state(client, "w.rej")
    assert (st["head_seq"], st["count"]) == (3, 3)


async def test_reject_batch_larger_than_cap_is_record_too_large(client):
    await ok(
        await client.put("/v0/topics/w.rej2", json={"cap_records": 3, "discard": "reject"}), 201
    )
    await fail(await post(client, "w.rej2", {"records": n_records(4)}), 400, "record_too_large")
    await ok(
        await client.put("/v0/topics/w.rej3", json={"cap_bytes": 10, "discard": "reject"}), 201
    )
    await fail(
        await post(client, "w.rej3", {"records": [{"data": "x" * 9}]}), 400, "record_too_large"
    )
    await write(client, "w.rej3", {"data": "x" * 8})  # 10 bytes: fits exactly
    err = await fail(await post(client, "w.rej3", {"records": [{"data": 1}]}), 422, "topic_full")
    assert err["detail"]["cap_bytes"] == 10
    assert err["detail"]["cap_records"] == 0


async def test_reject_room_freed_by_record_delete(client):
    await ok(
        await client.put("/v0/topics/w.rejdel", json={"cap_records": 2, "discard": "reject"}), 201
    )
    await write(client, "w.rejdel", *n_records(2))
    await fail(await post(client, "w.rejdel", {"records": [{"data": 9}]}), 422, "topic_full")
    await ok(await client.post("/v0/topics/w.rejdel/delete", json={"before_seq": 2}))
    body = await write(client, "w.rejdel", {"data": 9})
    assert body["seqs"] == [3]


async def test_reject_room_freed_by_ttl(client, autojump_clock):
    await ok(
        await client.put(
            "/v0/topics/w.rejttl", json={"cap_records": 2, "discard": "reject", "ttl_ms": 1000}
        ),
        201,
    )
    await write(client, "w.rejttl", *n_records(2))
    await fail(await post(client, "w.rejttl", {"records": [{"data": 9}]}), 422, "topic_full")
    autojump_clock.jump(1.5)
    assert (await write(client, "w.rejttl", *n_records(2)))["seqs"] == [3, 4]


async def test_discard_old_evicts_oldest(client):
    await ok(await client.put("/v0/topics/w.old", json={"cap_records": 3}), 201)
    body = await write(client, "w.old", *n_records(5))
    assert body["seqs"] == [1, 2, 3, 4, 5]
    st = await state(client, "w.old")
    assert (st["head_seq"], st["earliest_seq"], st["count"]) == (5, 3, 3)


# --------------------------------------------------------------------------------------
# Resource caps (429 with limit)
# --------------------------------------------------------------------------------------


async def test_max_total_bytes():
    async with open_app(make_config(limits={"max_total_bytes": 20})) as h:
        client = h.app.test_client()
        await write(client, "tb.a", {"data": "x" * 13})  # 15 bytes
        r = await post(client, "tb.b", {"records": [{"data": "abcd"}]})  # 6 more
        err = await fail(r, 429, "throttled")
        assert err["detail"] == {"limit": "max_total_bytes", "max": 20}
        assert r.headers["Retry-After"] == "1"
        await write(client, "tb.a", {"data": "abc"})  # 5 more: exactly 20
        await fail(await post(client, "tb.a", {"records": [{"data": 1}]}), 429, "throttled")
        # record deletes and topic deletes give the bytes back
        await ok(await client.post("/v0/topics/tb.a/delete", json={"before_seq": 2}))
        await write(client, "tb.a", {"data": "x" * 13})
        await ok(await client.delete("/v0/topics/tb.a"))
        await write(client, "tb.b", {"data": "x" * 18})


async def test_max_total_bytes_is_not_bypassed():
    cfg = make_config(limits={"max_total_bytes": 4})
    async with open_app(cfg) as h:
        c = h.app.test_client()
        r = await post(c, "tb.c", {"records": [{"data": 12345}], "disable_backpressure": True})
        err = await fail(r, 429, "throttled")
        assert err["detail"]["limit"] == "max_total_bytes"


async def test_max_idempotency_entries(autojump_clock):
    async with open_app(make_config(limits={"max_idempotency_entries": 2})) as h:
        client = h.app.test_client()
        cfg = {"idempotency_window_ms": 1000}
        await write(client, "ie", {"data": 1}, idempotency_key="k1", config=cfg)
        await write(client, "ie", {"data": 2}, idempotency_key="k2")
        r = await post(client, "ie", {"records": [{"data": 3}], "idempotency_key": "k3"})
        err = await fail(r, 429, "throttled")
        assert err["detail"] == {"limit": "max_idempotency_entries", "max": 2}
        assert r.headers["Retry-After"] == "1"
        assert (await state(client, "ie"))["head_seq"] == 2
        # writes without a key and dedupe hits add no entry
        await write(client, "ie", {"data": 4})
        assert (await write(client, "ie", {"data": 1}, idempotency_key="k1"))["deduped"] is True
        # expired entries are pruned first
        autojump_clock.jump(1.5)
        body = await write(client, "ie", {"data": 3}, idempotency_key="k3")
        assert body["deduped"] is False


async def test_max_total_bytes_counts_live_bytes_only(autojump_clock):
    async with open_app(make_config(limits={"max_total_bytes": 20})) as h:
        client = h.app.test_client()
        await write(client, "tb.ttl", {"data": "x" * 13}, config={"ttl_ms": 1000})
        await fail(
            await post(client, "tb.ttl", {"records": [{"data": "x" * 13}]}), 429, "throttled"
        )
        autojump_clock.jump(1.5)  # the first record expires: its bytes are no longer live
        await write(client, "tb.ttl", {"data": "x" * 13})


async def test_max_idempotency_entries_is_instance_wide():
    async with open_app(make_config(limits={"max_idempotency_entries": 2})) as h:
        client = h.app.test_client()
        await write(client, "ie.a", {"data": 1}, idempotency_key="k")
        await write(client, "ie.b", {"data": 1}, idempotency_key="k")
        r = await post(client, "ie.c", {"records": [{"data": 1}], "idempotency_key": "k"})
        err = await fail(r, 429, "throttled")
        assert err["detail"] == {"limit": "max_idempotency_entries", "max": 2}
        # a topic delete drops its entries
        await ok(await client.delete("/v0/topics/ie.a"))
        await write(client, "ie.c", {"data": 1}, idempotency_key="k")


# --------------------------------------------------------------------------------------
# Validation order (api-topics §6.2: first failure wins)
# --------------------------------------------------------------------------------------


async def test_order_content_type_before_body_shape(client):
    r = await client.post(
        "/v0/topics/o.ct", data=b'{"records": []}', headers={"Content-Type": "text/plain"}
    )
    await fail(r, 415, "unsupported_media_type")


async def test_order_batch_too_large_before_idempotency_key_length():
    async with open_app(make_config(protocol={"max_batch_records": 2})) as h:
        client = h.app.test_client()
        r = await post(client, "o.b", {"records": n_records(3), "idempotency_key": "k" * 300})
        await fail(r, 400, "batch_too_large")


async def test_order_batch_too_large_before_record_checks():
    async with open_app(make_config(protocol={"max_batch_records": 2})) as h:
        client = h.app.test_client()
        recs = [{"data": 1, "tag": "t" * 300}, {"data": "x" * 2_000_000}, {"data": 3}]
        await fail(await post(client, "o.b2", {"records": recs}), 400, "batch_too_large")


async def test_order_idempotency_key_before_record_size(client):
    r = await post(
        client, "o.ik", {"records": [{"data": "x" * 1_100_000}], "idempotency_key": "k" * 300}
    )
    await fail(r, 400, "invalid_request")


async def test_order_field_overflow_before_record_size(client):
    r = await post(client, "o.fld", {"records": [{"data": "x" * 1_100_000, "tag": "t" * 300}]})
    await fail(r, 400, "invalid_request")


async def test_order_records_checked_in_array_order(client):
    big, bad = {"data": "x" * 1_100_000}, {"data": 1, "tag": "t" * 300}
    await fail(await post(client, "o.arr", {"records": [big, bad]}), 400, "record_too_large")
    await fail(await post(client, "o.arr", {"records": [bad, big]}), 400, "invalid_request")


async def test_order_record_checks_before_topic_resolution(client):
    r = await post(client, "o.res", {"records": [{"data": "x" * 1_100_000}], "create": False})
    await fail(r, 400, "record_too_large")
    r = await post(client, "o.res", {"records": [{"data": 1, "node": "n" * 200}], "create": False})
    await fail(r, 400, "invalid_request")
    r = await post(
        client, "o.res", {"records": [{"data": "x" * 1_100_000}], "config": {"auto_create": False}}
    )
    await fail(r, 400, "record_too_large")


async def test_order_record_checks_before_max_topics():
    async with open_app(make_config(limits={"max_topics": 1})) as h:
        client = h.app.test_client()
        await write(client, "o.one", {"data": 1})
        r = await post(client, "o.two", {"records": [{"data": "x" * 1_100_000}]})
        await fail(r, 400, "record_too_large")
        r = await post(
            client, "o.two", {"records": [{"data": 1}], "config": {"dead_letter": "bad name"}}
        )
        await fail(r, 400, "invalid_request")
        r = await post(client, "o.two", {"records": [{"data": 1}]})
        await fail(r, 429, "throttled")


async def test_order_topic_not_found_before_dedupe(client):
    # a key used on an existing topic does not make create:false succeed on another
    await write(client, "o.nf", {"data": 1}, idempotency_key="k")
    r = await post(
        client, "o.nf2", {"records": [{"data": 1}], "idempotency_key": "k", "create": False}
    )
    await fail(r, 404, "topic_not_found")


async def test_order_record_checks_before_dedupe(client):
    await write(client, "o.dd", {"data": 1}, idempotency_key="k")
    r = await post(
        client, "o.dd", {"records": [{"data": 1, "tag": "t" * 300}], "idempotency_key": "k"}
    )
    await fail(r, 400, "invalid_request")


async def test_order_dedupe_before_topic_full(client):
    await ok(
        await client.put("/v0/topics/o.full", json={"cap_records": 2, "discard": "reject"}), 201
    )
    await write(client, "o.full", *n_records(2), idempotency_key="k")
    body = await write(client, "o.full", *n_records(2), idempotency_key="k")
    assert body["deduped"] is True
    assert body["seqs"] == [1, 2]
    # the dedupe hit also skips the "batch alone exceeds the cap" check
    body = await write(client, "o.full", *n_records(3), idempotency_key="k")
    assert body["deduped"] is True


async def test_order_dedupe_before_max_total_bytes():
    async with open_app(make_config(limits={"max_total_bytes": 10})) as h:
        client = h.app.test_client()
        await write(client, "o.tb", {"data": "x" * 8}, idempotency_key="k")
        body = await write(client, "o.tb", {"data": "x" * 8}, idempotency_key="k")
        assert body["deduped"] is True


async def test_order_topic_full_before_max_total_bytes():
    async with open_app(make_config(limits={"max_total_bytes": 10})) as h:
        client = h.app.test_client()
        await ok(
            await client.put("/v0/topics/o.tf", json={"cap_records": 1, "discard": "reject"}), 201
        )
        await write(client, "o.tf", {"data": "x" * 8})
        await fail(await post(client, "o.tf", {"records": [{"data": "x" * 8}]}), 422, "topic_full")
        r = await post(client, "o.tf", {"records": [{"data": "x" * 8}, {"data": 1}]})
        await fail(r, 400, "record_too_large")


async def test_order_max_topics_is_the_last_resolution_check():
    async with open_app(make_config(limits={"max_topics": 1})) as h:
        client = h.app.test_client()
        await write(client, "o.mt", {"data": 1})
        r = await post(client, "o.mt2", {"records": [{"data": 1}], "create": False})
        await fail(r, 404, "topic_not_found")
