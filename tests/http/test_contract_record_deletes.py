"""Contract tests for `POST /v0/topics/:topic/delete` (record deletes), api-topics §10.

Method: black-box through Quart's test client. Each test writes a small, tagged log,
issues one delete, and checks the response (`deleted` plus post-delete state), then what
readers see afterwards: `GET` state, and diffs that must walk over the holes silently
(no tombstone, `earliest_seq` advancing only for a dead prefix). Predicate parsing is
covered both for accepted forms (tuple `Eq`/`Glob`, bare strings, canonical echo) and for
every malformed form, which must be `400 invalid_request`.
"""

from __future__ import annotations

import json
import re

from topicd.testing.fake_clock import advance

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
    return body


async def fail(r, status: int, code: str) -> dict:
    raw = await r.get_data()
    assert r.status_code == status, raw
    check_pressure(r)
    body = json.loads(raw)
    assert set(body) <= {"error", "performance"}, body
    err = body["error"]
    assert {"code", "message"} <= set(err) <= {"code", "message", "detail"}, err
    assert err["code"] == code, err
    if "detail" in err:
        assert isinstance(err["detail"], dict)
        assert err["detail"]
    return err


async def write(client, topic: str, *records) -> dict:
    r = await client.post(f"/v0/topics/{topic}", json={"records": list(records)})
    assert r.status_code in (200, 201), await r.get_data()
    return await r.get_json()


async def tagged(client, topic: str, *tags) -> None:
    """One record per tag, `None` = untagged; data is the 1-based index (1 byte each)."""
    recs = []
    for i, tag in enumerate(tags, 1):
        rec = {"data": i % 10}
        if tag is not None:
            rec["tag"] = tag
        recs.append(rec)
    await write(client, topic, *recs)


def delete(client, topic: str, body):
    return client.post(f"/v0/topics/{topic}/delete", json=body)


async def remaining(client, topic: str) -> list[int]:
    r = await client.post(f"/v0/topics/{topic}/diff", json={"limit": 1000})
    body = await ok(r)
    assert body["tombstone"] is None
    return [rec["$seq"] for rec in body["records"]]


async def state(client, topic: str) -> dict:
    return await ok(await client.get(f"/v0/topics/{topic}", query_string={"touch": "false"}))


# --------------------------------------------------------------------------------------
# before_seq
# --------------------------------------------------------------------------------------


async def test_before_seq_deletes_prefix_and_reports_state(client):
    await tagged(client, "rd.before", None, None, None, None, None)
    body = await ok(await delete(client, "rd.before", {"before_seq": 3}))
    assert body["topic"] == "rd.before"
    assert body["deleted"] == 2
    assert body["earliest_seq"] == 3
    assert body["head_seq"] == 5
    assert body["count"] == 3
    assert body["bytes"] == 3
    assert await remaining(client, "rd.before") == [3, 4, 5]
    st = await state(client, "rd.before")
    assert (st["earliest_seq"], st["head_seq"], st["count"], st["bytes"]) == (3, 5, 3, 3)


async def test_before_seq_bounds(client):
    await tagged(client, "rd.bnd", None, None, None)
    assert (await ok(await delete(client, "rd.bnd", {"before_seq": 0})))["deleted"] == 0
    assert (await ok(await delete(client, "rd.bnd", {"before_seq": 1})))["deleted"] == 0
    body = await ok(await delete(client, "rd.bnd", {"before_seq": 2**64 - 1}))
    assert body["deleted"] == 3
    assert (body["earliest_seq"], body["head_seq"], body["count"], body["bytes"]) == (4, 3, 0, 0)
    assert await remaining(client, "rd.bnd") == []


async def test_deleting_again_deletes_zero(client):
    await tagged(client, "rd.again", None, None)
    assert (await ok(await delete(client, "rd.again", {"before_seq": 3})))["deleted"] == 2
    assert (await ok(await delete(client, "rd.again", {"before_seq": 3})))["deleted"] == 0


async def test_head_is_unchanged_and_seqs_are_not_reused(client):
    await tagged(client, "rd.head", None, None, None)
    await ok(await delete(client, "rd.head", {"before_seq": 10}))
    body = await write(client, "rd.head", {"data": 1})
    assert body["seqs"] == [4]
    st = await state(client, "rd.head")
    assert (st["head_seq"], st["earliest_seq"], st["count"]) == (4, 4, 1)


async def test_middle_delete_does_not_move_earliest(client):
    await tagged(client, "rd.mid", None, "m", "m", None)
    body = await ok(await delete(client, "rd.mid", {"match": "m"}))
    assert body["deleted"] == 2
    assert body["earliest_seq"] == 1
    assert await remaining(client, "rd.mid") == [1, 4]
    body = await ok(await delete(client, "rd.mid", {"before_seq": 2}))
    # seq 1 gone, 2 and 3 already deleted: the dead prefix now reaches 3
    assert body["earliest_seq"] == 4


# --------------------------------------------------------------------------------------
# match
# --------------------------------------------------------------------------------------


async def test_match_eq_tuple(client):
    await tagged(client, "rd.eq", "a", "ab", "a", "b", None)
    body = await ok(await delete(client, "rd.eq", {"match": ["tag", "Eq", "a"]}))
    assert body["deleted"] == 2
    assert body["match"] == ["tag", "Eq", "a"]
    assert await remaining(client, "rd.eq") == [2, 4, 5]


async def test_match_glob_tuple(client):
    await tagged(client, "rd.glob", "a", "ab", "b", "xa", None)
    body = await ok(await delete(client, "rd.glob", {"match": ["tag", "Glob", "a*"]}))
    assert body["deleted"] == 2
    assert body["match"] == ["tag", "Glob", "a*"]
    assert await remaining(client, "rd.glob") == [3, 4, 5]


async def test_match_glob_star_alone_matches_every_tagged_record(client):
    await tagged(client, "rd.star", "a", None, "", "z", None)
    body = await ok(await delete(client, "rd.star", {"match": ["tag", "Glob", "*"]}))
    assert body["deleted"] == 3
    assert await remaining(client, "rd.star") == [2, 5]


async def test_only_the_final_star_is_special(client):
    await tagged(client, "rd.lit", "a*b", "a*bc", "axb", "a*", "a")
    body = await ok(await delete(client, "rd.lit", {"match": ["tag", "Glob", "a*b*"]}))
    assert body["deleted"] == 2
    assert await remaining(client, "rd.lit") == [3, 4, 5]
    # Eq on a value ending in '*' is a literal tag match
    body = await ok(await delete(client, "rd.lit", {"match": ["tag", "Eq", "a*"]}))
    assert body["deleted"] == 1
    assert await remaining(client, "rd.lit") == [3, 5]


async def test_bare_string_without_star_is_eq(client):
    await tagged(client, "rd.bare", "a", "ab", "a")
    body = await ok(await delete(client, "rd.bare", {"match": "a"}))
    assert body["deleted"] == 2
    assert body["match"] == ["tag", "Eq", "a"]
    assert await remaining(client, "rd.bare") == [2]


async def test_bare_string_with_trailing_star_is_glob(client):
    await tagged(client, "rd.bareg", "a", "ab", "b", None)
    body = await ok(await delete(client, "rd.bareg", {"match": "a*"}))
    assert body["deleted"] == 2
    assert body["match"] == ["tag", "Glob", "a*"]
    assert await remaining(client, "rd.bareg") == [3, 4]
    body = await ok(await delete(client, "rd.bareg", {"match": "*"}))
    assert body["deleted"] == 1
    assert body["match"] == ["tag", "Glob", "*"]
    assert await remaining(client, "rd.bareg") == [4]


async def test_match_is_byte_exact(client):
    await tagged(client, "rd.case", "A", "a", "é", "e")
    assert (await ok(await delete(client, "rd.case", {"match": "a"})))["deleted"] == 1
    assert (await ok(await delete(client, "rd.case", {"match": "é"})))["deleted"] == 1
    assert await remaining(client, "rd.case") == [1, 4]


async def test_untagged_records_never_match(client):
    await tagged(client, "rd.untag", None, None)
    for match in ("*", ["tag", "Glob", "*"], "", ["tag", "Eq", ""]):
        assert (await ok(await delete(client, "rd.untag", {"match": match})))["deleted"] == 0
    assert await remaining(client, "rd.untag") == [1, 2]


async def test_match_nothing_is_200_with_zero(client):
    await tagged(client, "rd.zero", "a")
    body = await ok(await delete(client, "rd.zero", {"match": "zzz"}))
    assert body["deleted"] == 0
    assert (body["count"], body["earliest_seq"], body["head_seq"]) == (1, 1, 1)


async def test_before_seq_and_match_are_anded(client):
    await tagged(client, "rd.and", "a", "b", "a", "a", "b")
    body = await ok(await delete(client, "rd.and", {"match": "a", "before_seq": 4}))
    assert body["deleted"] == 2
    assert body["match"] == ["tag", "Eq", "a"]
    assert await remaining(client, "rd.and") == [2, 4, 5]


async def test_delete_is_point_in_time(client):
    await tagged(client, "rd.pit", "a", "a")
    await ok(await delete(client, "rd.pit", {"match": "a"}))
    await write(client, "rd.pit", {"data": 3, "tag": "a"})
    assert await remaining(client, "rd.pit") == [3]
    st = await state(client, "rd.pit")
    assert (st["count"], st["earliest_seq"]) == (1, 3)


async def test_no_tombstone_after_deletes(client):
    await tagged(client, "rd.silent", "x", "x", None, "x", None)
    await ok(await delete(client, "rd.silent", {"match": "x"}))
    for from_seq in (0, 1, 2, 3):
        r = await client.post("/v0/topics/rd.silent/diff", json={"from_seq": from_seq})
        body = await ok(r)
        assert body["tombstone"] is None
    r = await client.post("/v0/topics/rd.silent/diff", json={})
    body = await ok(r)
    assert [rec["$seq"] for rec in body["records"]] == [3, 5]
    assert body["earliest_seq"] == 3


async def test_only_live_records_count_as_deleted(client, autojump_clock):
    await client.put("/v0/topics/rd.live", json={"cap_records": 2, "ttl_ms": 1000})
    await tagged(client, "rd.live", "a", "a", "a")  # seq 1 evicted by the cap
    body = await ok(await delete(client, "rd.live", {"match": "a", "before_seq": 3}))
    assert body["deleted"] == 1
    assert (body["count"], body["earliest_seq"]) == (1, 3)
    await advance(autojump_clock, 1.5)  # seq 3 expires (virtual time)
    body = await ok(await delete(client, "rd.live", {"before_seq": 10}))
    assert body["deleted"] == 0
    assert (body["count"], body["bytes"], body["earliest_seq"], body["head_seq"]) == (0, 0, 4, 3)


async def test_bytes_and_count_are_post_delete(client):
    await write(client, "rd.bytes", {"data": "abc", "tag": "t", "meta": {"k": 1}}, {"data": [1, 2]})
    body = await ok(await delete(client, "rd.bytes", {"match": "t"}))
    assert body["deleted"] == 1
    assert (body["count"], body["bytes"]) == (1, len(b"[1,2]"))


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


async def test_absent_topic_is_404_and_never_creates(client):
    err = await fail(await delete(client, "rd.none", {"before_seq": 1}), 404, "topic_not_found")
    assert err["detail"] == {"topic": "rd.none"}
    await fail(await client.get("/v0/topics/rd.none"), 404, "topic_not_found")


async def test_neither_before_seq_nor_match_is_400(client):
    await tagged(client, "rd.neither", "a")
    for body in ({}, {"before_seq": None}, {"match": None}, {"other": 1}):
        await fail(await delete(client, "rd.neither", body), 400, "invalid_request")
    assert await remaining(client, "rd.neither") == [1]


async def test_empty_body_is_invalid(client):
    await tagged(client, "rd.emptyb", "a")
    r = await client.post("/v0/topics/rd.emptyb/delete", data=b"", headers=JSON_CT)
    await fail(r, 400, "invalid_request")
    r = await client.post("/v0/topics/rd.emptyb/delete")
    await fail(r, 415, "unsupported_media_type")


async def test_bad_predicates_are_400(client):
    await tagged(client, "rd.badp", "a", "a*")
    bad = [
        ["tag", "Eq"],
        ["tag", "Eq", "a", "b"],
        ["tag"],
        [],
        ["node", "Eq", "a"],
        ["Tag", "Eq", "a"],
        ["tag", "eq", "a"],
        ["tag", "EQ", "a"],
        ["tag", "glob", "a*"],
        ["tag", "Prefix", "a"],
        ["tag", "Glob", "a"],
        ["tag", "Glob", ""],
        ["tag", "Eq", 5],
        ["tag", "Eq", None],
        [5, "Eq", "a"],
        {"tag": "a"},
        5,
        True,
        [["tag", "Eq", "a"]],
    ]
    for match in bad:
        r = await delete(client, "rd.badp", {"match": match})
        await fail(r, 400, "invalid_request")
    assert await remaining(client, "rd.badp") == [1, 2]


async def test_bad_before_seq_is_400(client):
    await tagged(client, "rd.badb", None)
    for value in (-1, 1.5, "3", 2**64, True, [3]):
        await fail(await delete(client, "rd.badb", {"before_seq": value}), 400, "invalid_request")
    assert await remaining(client, "rd.badb") == [1]
