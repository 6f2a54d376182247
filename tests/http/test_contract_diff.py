"""Contract tests for `POST /v0/topics/:topic/diff` and tombstones, api-topics §7-§9.

Method: black-box through Quart's test client. Records are written with the public write
endpoint, removed by caps, TTL, record deletes or a topic delete, and each diff response
is compared field by field with what the normative algorithm of §7.2 yields: records,
`next_from_seq`, `caught_up`, `lag`, watermarks and the exact tombstone object of §8.3 /
§8.4. Long-polls run in a nursery: the poll is started, `wait_all_tasks_blocked()` proves
it is parked, then the test writes or deletes. Timeouts, TTL expiry and clamps run under
`autojump_clock` and assert exact virtual time.
"""

from __future__ import annotations

import json
import re

import trio
import trio.testing

from topicd.testing.fake_clock import advance
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


async def write(client, topic: str, *records, **fields) -> dict:
    r = await client.post(f"/v0/topics/{topic}", json={"records": list(records), **fields})
    assert r.status_code in (200, 201), await r.get_data()
    return await r.get_json()


async def write_n(client, topic: str, n: int, **fields) -> dict:
    return await write(client, topic, *({"data": i} for i in range(n)), **fields)


async def diff(client, topic: str, **req) -> dict:
    body = await ok(await client.post(f"/v0/topics/{topic}/diff", json=req))
    check_shape(body, topic)
    return body


def check_shape(body: dict, topic: str) -> None:
    """Invariants every diff response keeps (§7.3)."""
    assert body["topic"] == topic
    assert "tombstone" in body
    assert body["caught_up"] is (body["next_from_seq"] == body["head_seq"])
    assert body["lag"] == body["head_seq"] - body["next_from_seq"]
    seqs = [rec["$seq"] for rec in body["records"]]
    assert seqs == sorted(set(seqs))
    for rec in body["records"]:
        assert {"$seq", "$ts", "data"} <= set(rec)


def seqs_of(body: dict) -> list[int]:
    return [rec["$seq"] for rec in body["records"]]


def tomb(gap_from, gap_to, reason, earliest, head) -> dict:
    return {
        "gap_from": gap_from,
        "gap_to": gap_to,
        "reason": reason,
        "missed_estimate": gap_to - gap_from + 1,
        "earliest_seq": earliest,
        "head_seq": head,
    }


async def put(client, topic: str, body: dict | None = None) -> None:
    r = await client.put(f"/v0/topics/{topic}", json=body or {})
    assert r.status_code in (200, 201), await r.get_data()


# --------------------------------------------------------------------------------------
# Request fields
# --------------------------------------------------------------------------------------


async def test_diff_response_fields(client):
    await write_n(client, "d.fields", 3)
    body = await diff(client, "d.fields")
    assert {k: v for k, v in body.items() if k not in ("records", "performance")} == {
        "topic": "d.fields",
        "next_from_seq": 3,
        "head_seq": 3,
        "earliest_seq": 1,
        "caught_up": True,
        "tombstone": None,
        "lag": 0,
    }
    assert [rec["data"] for rec in body["records"]] == [0, 1, 2]


async def test_diff_absent_topic_is_404_and_never_creates(client):
    r = await client.post("/v0/topics/d.none/diff", json={})
    err = await fail(r, 404, "topic_not_found")
    assert err["detail"] == {"topic": "d.none"}
    await fail(await client.get("/v0/topics/d.none"), 404, "topic_not_found")


async def test_empty_body_means_defaults(client):
    await write_n(client, "d.empty", 300)
    for kwargs in ({}, {"data": b"", "headers": JSON_CT}, {"json": {}}):
        r = await client.post("/v0/topics/d.empty/diff", **kwargs)
        body = await ok(r)
        check_shape(body, "d.empty")
        assert seqs_of(body) == list(range(1, 257)), kwargs
        assert body["next_from_seq"] == 256
        assert body["caught_up"] is False
        assert body["lag"] == 44
        assert body["tombstone"] is None


async def test_from_seq_is_exclusive(client):
    await write_n(client, "d.from", 5)
    assert seqs_of(await diff(client, "d.from", from_seq=2)) == [3, 4, 5]
    body = await diff(client, "d.from", from_seq=5)
    assert body["records"] == []
    assert (body["next_from_seq"], body["caught_up"], body["lag"]) == (5, True, 0)
    assert body["tombstone"] is None


async def test_empty_topic_is_caught_up_at_zero(client):
    await put(client, "d.none0")
    body = await diff(client, "d.none0")
    assert body["records"] == []
    assert (body["next_from_seq"], body["head_seq"], body["earliest_seq"]) == (0, 0, 1)
    assert body["caught_up"] is True
    assert body["tombstone"] is None


async def test_limit_default_zero_and_clamp(client):
    await write_n(client, "d.limit", 1200)
    assert len((await diff(client, "d.limit", limit=0))["records"]) == 256
    body = await diff(client, "d.limit", limit=1)
    assert seqs_of(body) == [1]
    assert (body["next_from_seq"], body["caught_up"], body["lag"]) == (1, False, 1199)
    body = await diff(client, "d.limit", limit=1001)
    assert len(body["records"]) == 1000
    assert body["next_from_seq"] == 1000
    assert len((await diff(client, "d.limit", limit=2**32 - 1))["records"]) == 1000
    body = await diff(client, "d.limit", from_seq=1000, limit=1000)
    assert seqs_of(body) == list(range(1001, 1201))
    assert body["caught_up"] is True


async def test_over_max_values_are_clamped_not_rejected(client):
    await write_n(client, "d.clamp", 2)
    body = await diff(client, "d.clamp", limit=10**9, max_batch_bytes=2**64 - 1, wait_ms=10**9)
    assert seqs_of(body) == [1, 2]


async def test_from_seq_u64_max_is_valid(client):
    await write_n(client, "d.u64", 2)
    body = await diff(client, "d.u64", from_seq=2**64 - 1)
    assert body["tombstone"] == tomb(1, 2, "recreated", 1, 2)


async def test_node_filter_string_and_array(client):
    await write(
        client,
        "d.node",
        {"data": 1, "node": "a"},
        {"data": 2, "node": "b"},
        {"data": 3},
        {"data": 4, "node": "A"},
        {"data": 5, "node": "a "},
        {"data": 6, "node": "c"},
    )
    assert seqs_of(await diff(client, "d.node", node="a")) == [2, 3, 4, 5, 6]
    assert seqs_of(await diff(client, "d.node", node=["a", "c"])) == [2, 3, 4, 5]
    assert seqs_of(await diff(client, "d.node", node=[])) == [1, 2, 3, 4, 5, 6]
    body = await diff(client, "d.node", node=["a", "b", "c", "A", "a "])
    assert seqs_of(body) == [3]
    assert body["next_from_seq"] == 6
    assert body["caught_up"] is True


async def test_node_filter_cursor_moves_over_skipped(client):
    await write(
        client,
        "d.skip",
        {"data": 1, "node": "b"},
        {"data": 2, "node": "a"},
        {"data": 3, "node": "a"},
    )
    body = await diff(client, "d.skip", node="a")
    assert seqs_of(body) == [1]
    assert (body["next_from_seq"], body["caught_up"], body["lag"]) == (3, True, 0)
    body = await diff(client, "d.skip", from_seq=1, node="a")
    assert body["records"] == []
    assert body["next_from_seq"] == 3
    assert body["tombstone"] is None


async def test_node_filter_stops_at_limit(client):
    await write(client, "d.nlim", *({"data": i, "node": "ab"[i % 2]} for i in range(6)))
    # nodes: a b a b a b -> filtering "a" leaves 2, 4, 6
    body = await diff(client, "d.nlim", node="a", limit=1)
    assert seqs_of(body) == [2]
    assert body["next_from_seq"] == 2
    body = await diff(client, "d.nlim", node="a", limit=2, from_seq=2)
    assert seqs_of(body) == [4, 6]
    assert body["next_from_seq"] == 6


async def test_dedupe_node_false_delivers_echoes(client):
    await write(client, "d.echo", {"data": 1, "node": "a"}, config={"dedupe_node": False})
    body = await diff(client, "d.echo", node="a")
    assert seqs_of(body) == [1]
    assert body["records"][0]["$node"] == "a"


async def test_include_tags_and_include_meta(client):
    await write(client, "d.inc", {"data": 1, "tag": "t", "meta": {"m": 1}}, {"data": 2})
    recs = (await diff(client, "d.inc"))["records"]
    assert "$tag" not in recs[0]
    assert recs[0]["meta"] == {"m": 1}
    assert "meta" not in recs[1]
    recs = (await diff(client, "d.inc", include_tags=True, include_meta=False))["records"]
    assert recs[0]["$tag"] == "t"
    assert "meta" not in recs[0]
    assert "$tag" not in recs[1]
    assert set(recs[1]) == {"$seq", "$ts", "data"}


async def test_max_batch_bytes_budget(client):
    await write(client, "d.mbb", *({"data": "x" * 98} for _ in range(5)))  # 100 bytes each
    body = await diff(client, "d.mbb", max_batch_bytes=299)
    assert seqs_of(body) == [1, 2]
    # stops without examining the record that did not fit
    assert body["next_from_seq"] == 2
    assert body["caught_up"] is False
    # at least one record is always delivered
    body = await diff(client, "d.mbb", max_batch_bytes=1, from_seq=2)
    assert seqs_of(body) == [3]
    assert body["next_from_seq"] == 3
    # 0 = the 1 MiB default
    assert seqs_of(await diff(client, "d.mbb", max_batch_bytes=0)) == [1, 2, 3, 4, 5]


async def test_max_batch_bytes_default_is_1mib(client):
    await write(client, "d.mbbd", *({"data": "x" * (300_000 - 2)} for _ in range(5)))
    body = await diff(client, "d.mbbd")
    assert seqs_of(body) == [1, 2, 3]
    assert body["next_from_seq"] == 3


async def test_priority_field_on_read(client):
    await write(client, "d.prio", {"data": 1, "priority": -4}, {"data": 2})
    recs = (await diff(client, "d.prio"))["records"]
    assert recs[0]["$priority"] == -4
    assert "$priority" not in recs[1]


async def test_deleted_records_are_walked_over(client):
    await write(
        client, "d.del", {"data": 1}, {"data": 2, "tag": "x"}, {"data": 3, "tag": "x"}, {"data": 4}
    )
    await ok(await client.post("/v0/topics/d.del/delete", json={"match": "x"}))
    body = await diff(client, "d.del", from_seq=1, limit=1)
    assert seqs_of(body) == [4]
    assert body["next_from_seq"] == 4
    assert body["tombstone"] is None


async def test_deleted_tail_moves_cursor_without_records(client):
    await write(client, "d.tail", {"data": 1}, {"data": 2, "tag": "x"}, {"data": 3, "tag": "x"})
    await ok(await client.post("/v0/topics/d.tail/delete", json={"match": "x"}))
    body = await diff(client, "d.tail", from_seq=1)
    assert body["records"] == []
    assert (body["next_from_seq"], body["caught_up"]) == (3, True)


# --------------------------------------------------------------------------------------
# Long-poll (§7.2 step 9)
# --------------------------------------------------------------------------------------


async def test_long_poll_is_woken_by_a_write(client, autojump_clock):
    await write_n(client, "d.lp", 1)
    out = {}

    async def poll():
        out["r"] = await client.post("/v0/topics/d.lp/diff", json={"from_seq": 1, "wait_ms": 5000})

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        await trio.testing.wait_all_tasks_blocked()
        assert "r" not in out
        await write(client, "d.lp", {"data": "late"})
    assert trio.current_time() - t0 == 0
    body = await ok(out["r"])
    assert [rec["data"] for rec in body["records"]] == ["late"]
    assert (body["next_from_seq"], body["caught_up"]) == (2, True)


async def test_pressure_header_is_the_pressure_when_the_answer_starts(
    client, harness, autojump_clock
):
    """A request that waited (here a long-poll) reports the pressure of the moment its
    answer starts, not the one it found on arrival: clients stamp the value with the
    time they receive it and pace on it."""
    await write_n(client, "d.lpp", 1)
    harness.engine.pressure = 0.25
    out = {}

    async def poll():
        out["r"] = await client.post("/v0/topics/d.lpp/diff", json={"from_seq": 1, "wait_ms": 5000})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        await trio.testing.wait_all_tasks_blocked()
        harness.engine.pressure = 0.75  # what the governor publishes meanwhile
        w = await client.post("/v0/topics/d.lpp", json={"records": [{"data": 1}]})
        assert w.headers["X-Topicd-Pressure"] == "0.750"
    assert out["r"].headers["X-Topicd-Pressure"] == "0.750"


async def test_long_poll_times_out_with_the_empty_result(client, autojump_clock):
    await write_n(client, "d.lpto", 2)
    t0 = trio.current_time()
    body = await diff(client, "d.lpto", from_seq=2, wait_ms=2000)
    assert trio.current_time() - t0 == 2.0
    assert body["records"] == []
    assert (body["next_from_seq"], body["caught_up"], body["tombstone"]) == (2, True, None)


async def test_long_poll_wait_is_clamped_to_30s(client, autojump_clock):
    await put(client, "d.lpclamp")
    t0 = trio.current_time()
    body = await diff(client, "d.lpclamp", wait_ms=120000)
    assert trio.current_time() - t0 == 30.0
    assert body["records"] == []


async def test_no_wait_when_records_are_available(client, autojump_clock):
    await write_n(client, "d.lpnow", 2)
    t0 = trio.current_time()
    body = await diff(client, "d.lpnow", from_seq=1, wait_ms=5000)
    assert trio.current_time() - t0 == 0
    assert seqs_of(body) == [2]


async def test_no_wait_when_a_tombstone_is_returned(client, autojump_clock):
    await put(client, "d.lptomb")
    t0 = trio.current_time()
    body = await diff(client, "d.lptomb", from_seq=7, wait_ms=5000)
    assert trio.current_time() - t0 == 0
    assert body["tombstone"]["reason"] == "recreated"


async def test_no_wait_when_not_caught_up():
    # max_scan_per_read stops the walk early: empty records but caught_up:false
    async with open_app(make_config(protocol={"max_scan_per_read": 2})) as h:
        client = h.app.test_client()
        await write(client, "d.scan", *({"data": i, "node": "a"} for i in range(5)))
        with trio.fail_after(1):
            body = await diff(client, "d.scan", node="a", wait_ms=30000)
        assert body["records"] == []
        assert body["next_from_seq"] == 2
        assert body["caught_up"] is False


async def test_long_poll_woken_by_filtered_write_returns_once(client, autojump_clock):
    await put(client, "d.lpf")
    out = {}

    async def poll():
        out["r"] = await client.post("/v0/topics/d.lpf/diff", json={"node": "me", "wait_ms": 5000})

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        await trio.testing.wait_all_tasks_blocked()
        await write(client, "d.lpf", {"data": 1, "node": "me"})
    assert trio.current_time() - t0 == 0
    body = await ok(out["r"])
    assert body["records"] == []
    assert (body["next_from_seq"], body["caught_up"]) == (1, True)


async def test_topic_deleted_during_long_poll_is_404(client, autojump_clock):
    await put(client, "d.lpdel")
    out = {}

    async def poll():
        out["r"] = await client.post("/v0/topics/d.lpdel/diff", json={"wait_ms": 5000})

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        await trio.testing.wait_all_tasks_blocked()
        await ok(await client.delete("/v0/topics/d.lpdel"))
    assert trio.current_time() - t0 < 5
    err = await fail(out["r"], 404, "topic_not_found")
    assert err["detail"] == {"topic": "d.lpdel"}


async def test_long_poll_on_absent_topic_is_404_at_once(client, autojump_clock):
    t0 = trio.current_time()
    await fail(
        await client.post("/v0/topics/d.lpnone/diff", json={"wait_ms": 5000}),
        404,
        "topic_not_found",
    )
    assert trio.current_time() - t0 == 0


# --------------------------------------------------------------------------------------
# Tombstones: cap, TTL, mixed (§8.2-§8.3)
# --------------------------------------------------------------------------------------


async def test_cap_records_tombstone(client):
    await put(client, "t.cap", {"cap_records": 3})
    for i in range(10):
        await write(client, "t.cap", {"data": i})
    body = await diff(client, "t.cap")
    assert body["tombstone"] == tomb(1, 7, "cap", 8, 10)
    assert seqs_of(body) == [8, 9, 10]
    assert (body["earliest_seq"], body["next_from_seq"], body["caught_up"]) == (8, 10, True)
    assert (await diff(client, "t.cap", from_seq=5))["tombstone"] == tomb(6, 7, "cap", 8, 10)
    body = await diff(client, "t.cap", from_seq=6, limit=1)
    assert body["tombstone"] == tomb(7, 7, "cap", 8, 10)
    assert seqs_of(body) == [8]
    assert body["next_from_seq"] == 8
    body = await diff(client, "t.cap", from_seq=7)
    assert body["tombstone"] is None
    assert seqs_of(body) == [8, 9, 10]


async def test_cap_in_one_oversized_batch(client):
    await write_n(client, "t.capb", 5, config={"cap_records": 2})
    body = await diff(client, "t.capb")
    assert body["tombstone"] == tomb(1, 3, "cap", 4, 5)
    assert seqs_of(body) == [4, 5]


async def test_cap_bytes_tombstone(client):
    await put(client, "t.bytes", {"cap_bytes": 30})
    for _ in range(5):
        await write(client, "t.bytes", {"data": "x" * 8})  # 10 bytes each
    body = await diff(client, "t.bytes")
    assert body["tombstone"] == tomb(1, 2, "cap", 3, 5)
    assert seqs_of(body) == [3, 4, 5]


async def test_tighter_cap_produces_tombstone(client):
    await write_n(client, "t.tight", 10)
    await put(client, "t.tight", {"cap_records": 4})
    body = await diff(client, "t.tight", from_seq=2)
    assert body["tombstone"] == tomb(3, 6, "cap", 7, 10)
    assert seqs_of(body) == [7, 8, 9, 10]


async def test_ttl_tombstone_without_writes(client, harness, autojump_clock):
    await put(client, "t.ttl", {"ttl_ms": 1000})
    await write_n(client, "t.ttl", 2)
    await advance(autojump_clock, 0.5)
    await write(client, "t.ttl", {"data": "young"})
    await advance(autojump_clock, 0.5625)  # ages: 1062 ms, 1062 ms, 562 ms
    body = await diff(client, "t.ttl")
    assert body["tombstone"] == tomb(1, 2, "ttl", 3, 3)
    assert [rec["data"] for rec in body["records"]] == ["young"]
    assert body["earliest_seq"] == 3
    st = await ok(await client.get("/v0/topics/t.ttl", query_string={"touch": "false"}))
    assert (st["earliest_seq"], st["count"]) == (3, 1)


async def test_ttl_expiry_is_strictly_greater_than(client, autojump_clock):
    await write_n(client, "t.ttlb", 1, config={"ttl_ms": 1000})
    await advance(autojump_clock, 1.0)  # age exactly 1000 ms: still live
    body = await diff(client, "t.ttlb")
    assert seqs_of(body) == [1]
    assert body["tombstone"] is None
    await advance(autojump_clock, 0.0625)
    body = await diff(client, "t.ttlb")
    assert body["records"] == []
    assert body["tombstone"] == tomb(1, 1, "ttl", 2, 1)
    assert (body["earliest_seq"], body["next_from_seq"], body["caught_up"]) == (2, 1, True)


async def test_mixed_tombstone_and_per_range_reason(client, autojump_clock):
    await put(client, "t.mix", {"cap_records": 2, "ttl_ms": 1000})
    await write_n(client, "t.mix", 3)  # seq 1 evicted by the cap
    await advance(autojump_clock, 1.0625)  # seqs 2 and 3 expire
    body = await diff(client, "t.mix")
    assert body["tombstone"] == tomb(1, 3, "mixed", 4, 3)
    assert body["records"] == []
    assert body["next_from_seq"] == 3
    # the range [2, 3] holds only TTL loss
    assert (await diff(client, "t.mix", from_seq=1))["tombstone"] == tomb(2, 3, "ttl", 4, 3)


async def test_mixed_range_cap_then_ttl_and_ttl_only_subrange(client, autojump_clock):
    await put(client, "t.caponly", {"cap_records": 2, "ttl_ms": 1000})
    await write_n(client, "t.caponly", 4)  # 1 and 2 evicted by the cap
    await advance(autojump_clock, 1.0625)  # 3 and 4 expire
    await write(client, "t.caponly", {"data": "new"})
    body = await diff(client, "t.caponly")
    assert body["tombstone"] == tomb(1, 4, "mixed", 5, 5)
    assert seqs_of(body) == [5]
    assert (await diff(client, "t.caponly", from_seq=2))["tombstone"] == tomb(3, 4, "ttl", 5, 5)


# --------------------------------------------------------------------------------------
# Dual watermark: deletes are silent (§8.2)
# --------------------------------------------------------------------------------------


async def test_deleted_prefix_is_silent(client):
    await write(
        client, "t.delp", *({"data": i, "tag": "x"} for i in range(3)), {"data": 3}, {"data": 4}
    )
    await ok(await client.post("/v0/topics/t.delp/delete", json={"match": "x"}))
    body = await diff(client, "t.delp")
    assert body["tombstone"] is None
    assert seqs_of(body) == [4, 5]
    assert body["earliest_seq"] == 4


async def test_evicting_deleted_slots_does_not_move_the_floor(client):
    await put(client, "t.dfloor", {"cap_records": 3})
    await write_n(client, "t.dfloor", 3)
    await ok(await client.post("/v0/topics/t.dfloor/delete", json={"before_seq": 3}))
    await write_n(client, "t.dfloor", 2)  # live 3, 4, 5: within the cap
    body = await diff(client, "t.dfloor")
    assert body["tombstone"] is None
    assert seqs_of(body) == [3, 4, 5]
    await write_n(client, "t.dfloor", 1)  # evicts 3
    body = await diff(client, "t.dfloor")
    # [1, 3] covers the evicted seq 3 and otherwise only deleted seqs
    assert body["tombstone"] == tomb(1, 3, "cap", 4, 6)
    assert seqs_of(body) == [4, 5, 6]
    body = await diff(client, "t.dfloor", from_seq=3)
    assert body["tombstone"] is None


async def test_tombstone_earliest_below_response_earliest_after_deletes(client):
    await put(client, "t.dual", {"cap_records": 3})
    await write(
        client,
        "t.dual",
        {"data": 1},
        {"data": 2},
        {"data": 3, "tag": "d"},
        {"data": 4, "tag": "d"},
        {"data": 5},
    )
    await ok(await client.post("/v0/topics/t.dual/delete", json={"match": "d"}))
    body = await diff(client, "t.dual")
    assert body["tombstone"] == tomb(1, 2, "cap", 3, 5)
    assert body["earliest_seq"] == 5
    assert seqs_of(body) == [5]
    assert body["next_from_seq"] == 5
    for from_seq in (2, 3):
        body = await diff(client, "t.dual", from_seq=from_seq)
        assert body["tombstone"] is None
        assert seqs_of(body) == [5]


# --------------------------------------------------------------------------------------
# recreated (§8.4)
# --------------------------------------------------------------------------------------


async def test_recreated_tombstone_after_delete_and_recreate(client):
    await write_n(client, "t.re", 5)
    await ok(await client.delete("/v0/topics/t.re"))
    await write_n(client, "t.re", 2)
    body = await diff(client, "t.re", from_seq=5)
    assert body["tombstone"] == tomb(1, 2, "recreated", 1, 2)
    assert seqs_of(body) == [1, 2]
    assert (body["next_from_seq"], body["caught_up"]) == (2, True)
    # a stale cursor <= the new head goes unnoticed
    body = await diff(client, "t.re", from_seq=2)
    assert body["tombstone"] is None
    assert body["records"] == []


async def test_recreated_tombstone_on_empty_instance(client):
    await write_n(client, "t.re0", 3)
    await ok(await client.delete("/v0/topics/t.re0"))
    await put(client, "t.re0")
    body = await diff(client, "t.re0", from_seq=3)
    assert body["tombstone"] == {
        "gap_from": 1,
        "gap_to": 0,
        "reason": "recreated",
        "missed_estimate": 0,
        "earliest_seq": 1,
        "head_seq": 0,
    }
    assert body["records"] == []
    assert (body["next_from_seq"], body["caught_up"], body["lag"]) == (0, True, 0)


async def test_recreated_restarts_at_earliest(client):
    await write_n(client, "t.refut", 5)
    await ok(await client.post("/v0/topics/t.refut/delete", json={"before_seq": 3}))
    body = await diff(client, "t.refut", from_seq=9)
    assert body["tombstone"] == tomb(1, 5, "recreated", 3, 5)
    assert seqs_of(body) == [3, 4, 5]


async def test_at_most_one_tombstone_recreated_wins(client):
    await write_n(client, "t.one", 5, config={"cap_records": 2})
    body = await diff(client, "t.one", from_seq=6)
    assert body["tombstone"] == tomb(1, 5, "recreated", 4, 5)
    assert seqs_of(body) == [4, 5]
