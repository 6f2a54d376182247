"""Contract tests for the topic control plane: PUT, GET, DELETE and the topic list.

Method: black-box. Every test drives the in-process app through Quart's test client and
asserts only what the spec promises (api-topics §2-§5, README §5-§8 and §10): status
codes, `error.code` and `detail`, the fully resolved config object, clamps, watermarks,
omit-when-absent keys, list ordering and the opaque cursor. Nothing here imports the
engine; configs that change limits are built with `make_config` and served by `open_app`.
Timed cases run under `autojump_clock` and move virtual time with `autojump_clock.jump`.
"""

from __future__ import annotations

import base64
import json
import re

from tests.watch.helpers import each_bounded
from topicd.testing.harness import make_config, open_app

JSON_CT = {"Content-Type": "application/json"}
PRESSURE = re.compile(r"0\.\d{3}|1\.000")

# README §10: every field, every default.
DEFAULT_CONFIG = {
    "type": "log",
    "ttl_ms": 0,
    "cap_records": 0,
    "cap_bytes": 0,
    "discard": "old",
    "durable": False,
    "durability": "disk",
    "priority": None,
    "auto_priority": True,
    "auto_create": True,
    "idempotency_window_ms": 120000,
    "dedupe_node": True,
    "lease_ms": 30000,
    "claim_jitter_ms": 0,
    "max_deliveries": 0,
    "dead_letter": None,
    "leases_durable": False,
}


def check_pressure(r) -> None:
    value = r.headers.get("X-Topicd-Pressure")
    assert value is not None, "X-Topicd-Pressure missing"
    assert PRESSURE.fullmatch(value), value


async def ok(r, status: int = 200) -> dict:
    raw = await r.get_data()
    assert r.status_code == status, raw
    check_pressure(r)
    assert r.headers["Content-Type"].split(";")[0].strip() == "application/json"
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
    assert isinstance(err["message"], str)
    if "detail" in err:
        assert isinstance(err["detail"], dict)
        assert err["detail"], "detail must be omitted when empty"
    return err


def page_cursor(after: str) -> str:
    """A list cursor in topicd's documented encoding (README §7)."""
    raw = json.dumps({"after": after}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def config_with(**changes) -> dict:
    return {**DEFAULT_CONFIG, **changes}


def assert_config(actual: dict, **changes) -> None:
    expected = config_with(**changes)
    assert set(expected) <= set(actual), set(expected) - set(actual)
    assert {k: actual[k] for k in expected} == expected


async def put(client, topic: str, body=None):
    if body is None:
        return await client.put(f"/v0/topics/{topic}")
    return await client.put(f"/v0/topics/{topic}", json=body)


async def write(client, topic: str, *records, **fields) -> dict:
    r = await client.post(f"/v0/topics/{topic}", json={"records": list(records), **fields})
    assert r.status_code in (200, 201), await r.get_data()
    return await r.get_json()


async def state(client, topic: str, **query) -> dict:
    qs = {k: str(v) for k, v in query.items()}
    return await ok(await client.get(f"/v0/topics/{topic}", query_string=qs or None))


async def listing(client, **query) -> dict:
    return await ok(
        await client.get("/v0/topics", query_string={k: str(v) for k, v in query.items()})
    )


# --------------------------------------------------------------------------------------
# PUT
# --------------------------------------------------------------------------------------


async def test_put_empty_body_creates_with_all_defaults(client):
    body = await ok(await client.put("/v0/topics/cfg.empty"), 201)
    assert body["topic"] == "cfg.empty"
    assert body["created"] is True
    assert_config(body["config"])


async def test_put_empty_object_equals_empty_body(client):
    body = await ok(await put(client, "cfg.obj", {}), 201)
    assert body["created"] is True
    assert_config(body["config"])


async def test_put_empty_body_with_json_content_type_is_defaults(client):
    r = await client.put("/v0/topics/cfg.ct", data=b"", headers=JSON_CT)
    body = await ok(r, 201)
    assert_config(body["config"])


async def test_put_returns_full_resolved_config(client):
    req = {
        "type": "queue",
        "durability": "fsync",
        "discard": "reject",
        "cap_records": 500000,
        "lease_ms": 45000,
        "max_deliveries": 4,
        "dead_letter": "render-jobs.dead",
    }
    body = await ok(await put(client, "render-jobs", req), 201)
    assert body == {
        "topic": "render-jobs",
        "created": True,
        "config": config_with(
            type="queue",
            durability="fsync",
            durable=True,
            discard="reject",
            cap_records=500000,
            lease_ms=45000,
            max_deliveries=4,
            dead_letter="render-jobs.dead",
        ),
        "performance": body["performance"],
    }


async def test_put_identical_is_200_noop(client):
    req = {"cap_records": 10, "ttl_ms": 5000}
    first = await ok(await put(client, "cfg.same", req), 201)
    await write(client, "cfg.same", {"data": 1}, {"data": 2})
    again = await ok(await put(client, "cfg.same", req), 200)
    assert again["created"] is False
    assert again["config"] == first["config"]
    st = await state(client, "cfg.same", touch="false")
    assert st["head_seq"] == 2
    assert st["count"] == 2


async def test_put_is_not_a_merge(client):
    await ok(await put(client, "cfg.merge", {"cap_records": 5, "ttl_ms": 1000, "priority": 7}), 201)
    body = await ok(await put(client, "cfg.merge", {"cap_records": 5}), 200)
    assert body["created"] is False
    assert_config(body["config"], cap_records=5)
    st = await state(client, "cfg.merge", touch="false")
    assert_config(st["config"], cap_records=5)


async def test_put_unknown_fields_are_ignored(client):
    body = await ok(await put(client, "cfg.unknown", {"colour": "blue", "ttl_ms": 9}), 201)
    assert "colour" not in body["config"]
    assert_config(body["config"], ttl_ms=9)


async def test_put_type_change_is_409_and_changes_nothing(client):
    await ok(await put(client, "cfg.type", {"cap_records": 3}), 201)
    err = await fail(
        await put(client, "cfg.type", {"type": "queue"}), 409, "topic_exists_incompatible"
    )
    detail = err["detail"]
    assert detail["topic"] == "cfg.type"
    assert detail["existing_type"] == "log"
    assert detail["requested_type"] == "queue"
    st = await state(client, "cfg.type", touch="false")
    assert st["type"] == "log"
    assert_config(st["config"], cap_records=3)


async def test_put_omitting_type_on_a_queue_is_a_type_change(client):
    # omitted fields reset to defaults, so `{}` on a queue asks for type "log"
    await ok(await put(client, "cfg.q", {"type": "queue"}), 201)
    err = await fail(await put(client, "cfg.q", {}), 409, "topic_exists_incompatible")
    assert err["detail"]["existing_type"] == "queue"
    assert err["detail"]["requested_type"] == "log"


async def test_put_lease_ms_is_clamped_and_stored_clamped(client):
    body = await ok(await put(client, "cfg.lease.lo", {"type": "queue", "lease_ms": 5}), 201)
    assert body["config"]["lease_ms"] == 100
    body = await ok(await put(client, "cfg.lease.zero", {"type": "queue", "lease_ms": 0}), 201)
    assert body["config"]["lease_ms"] == 100
    body = await ok(await put(client, "cfg.lease.hi", {"lease_ms": 86400001}), 201)
    assert body["config"]["lease_ms"] == 86400000
    body = await ok(await put(client, "cfg.lease.max", {"lease_ms": 2**64 - 1}), 201)
    assert body["config"]["lease_ms"] == 86400000
    st = await state(client, "cfg.lease.lo", touch="false")
    assert st["config"]["lease_ms"] == 100


async def test_put_claim_jitter_is_clamped(client):
    body = await ok(
        await put(client, "cfg.jitter", {"type": "queue", "claim_jitter_ms": 99999}), 201
    )
    assert body["config"]["claim_jitter_ms"] == 5000
    body = await ok(await put(client, "cfg.jitter2", {"claim_jitter_ms": 5000}), 201)
    assert body["config"]["claim_jitter_ms"] == 5000


async def test_put_priority_is_clamped_within_i32(client):
    body = await ok(await put(client, "cfg.prio.hi", {"priority": 5000}), 201)
    assert body["config"]["priority"] == 1000
    body = await ok(await put(client, "cfg.prio.lo", {"priority": -5000}), 201)
    assert body["config"]["priority"] == -1000
    body = await ok(await put(client, "cfg.prio.ok", {"priority": -17}), 201)
    assert body["config"]["priority"] == -17
    body = await ok(await put(client, "cfg.prio.null", {"priority": None}), 201)
    assert body["config"]["priority"] is None


async def test_put_priority_outside_i32_is_a_type_error(client):
    await fail(await put(client, "cfg.prio.big", {"priority": 2**31}), 400, "invalid_request")
    await fail(
        await put(client, "cfg.prio.small", {"priority": -(2**31) - 1}), 400, "invalid_request"
    )
    await fail(await client.get("/v0/topics/cfg.prio.big"), 404, "topic_not_found")


async def test_put_durable_alias(client):
    body = await ok(await put(client, "cfg.d1", {"durable": True}), 201)
    assert body["config"]["durability"] == "fsync"
    assert body["config"]["durable"] is True
    body = await ok(await put(client, "cfg.d2", {"durable": False}), 201)
    assert body["config"]["durability"] == "disk"
    assert body["config"]["durable"] is False
    # `durability` wins over the alias; `durable` is always reported as durability == fsync
    body = await ok(await put(client, "cfg.d3", {"durable": True, "durability": "memory"}), 201)
    assert body["config"]["durability"] == "memory"
    assert body["config"]["durable"] is False
    body = await ok(await put(client, "cfg.d4", {"durable": False, "durability": "fsync"}), 201)
    assert body["config"]["durability"] == "fsync"
    assert body["config"]["durable"] is True
    body = await ok(await put(client, "cfg.d5", {"durability": "ephemeral"}), 201)
    assert body["config"]["durability"] == "ephemeral"
    assert body["config"]["durable"] is False


async def test_put_durability_is_mutable_in_place(client):
    await ok(await put(client, "cfg.dur", {"durability": "memory"}), 201)
    body = await ok(await put(client, "cfg.dur", {"durability": "fsync"}), 200)
    assert body["config"]["durability"] == "fsync"
    assert body["created"] is False


async def test_put_durability_change_across_ephemeral_keeps_the_records(client):
    """The class changes the next writes' durability; the records, their seqs, tags,
    the gaps record deletes left and the idempotency window stay, and seqs go on."""
    await ok(await put(client, "cfg.dx", {"durability": "disk"}), 201)
    await write(client, "cfg.dx", {"data": 1, "tag": "a"}, {"data": 2}, {"data": 3, "tag": "a"})
    await write(client, "cfg.dx", {"data": 4}, idempotency_key="k")
    await ok(await client.post("/v0/topics/cfg.dx/delete", json={"before_seq": 2}))
    expected = [(2, 2, None), (3, 3, "a"), (4, 4, None)]
    for durability, seq in (("ephemeral", 5), ("fsync", 6), ("memory", 7), ("ephemeral", 8)):
        body = await ok(await put(client, "cfg.dx", {"durability": durability}), 200)
        assert body["config"]["durability"] == durability
        r = await client.post(
            "/v0/topics/cfg.dx/diff", json={"from_seq": 0, "limit": 100, "include_tags": True}
        )
        got = [(x["$seq"], x["data"], x.get("$tag")) for x in (await ok(r))["records"]]
        assert got == expected
        again = await write(client, "cfg.dx", {"data": 4}, idempotency_key="k")
        assert (again["first_seq"], again["deduped"]) == (4, True)
        assert (await write(client, "cfg.dx", {"data": seq}))["first_seq"] == seq
        expected.append((seq, seq, None))
    assert (await state(client, "cfg.dx"))["head_seq"] == 8


async def test_put_dead_letter_must_be_a_valid_name(client):
    err = await fail(
        await put(client, "cfg.dl", {"type": "queue", "dead_letter": "bad name"}),
        400,
        "invalid_request",
    )
    assert err["detail"] == {"dead_letter": "bad name"}
    err = await fail(await put(client, "cfg.dl", {"dead_letter": ""}), 400, "invalid_request")
    assert err["detail"] == {"dead_letter": ""}
    await fail(await client.get("/v0/topics/cfg.dl"), 404, "topic_not_found")


async def test_put_dead_letter_on_queue_must_differ_from_topic(client):
    await fail(
        await put(client, "cfg.self", {"type": "queue", "dead_letter": "cfg.self"}),
        400,
        "invalid_request",
    )
    # on a log the field is accepted and echoed (queue-only fields have no effect)
    body = await ok(await put(client, "cfg.selflog", {"dead_letter": "cfg.selflog"}), 201)
    assert body["config"]["dead_letter"] == "cfg.selflog"
    body = await ok(
        await put(client, "cfg.q2", {"type": "queue", "dead_letter": "cfg.q2.dead"}), 201
    )
    assert body["config"]["dead_letter"] == "cfg.q2.dead"


async def test_put_queue_only_fields_echoed_on_log(client):
    req = {"lease_ms": 1234, "claim_jitter_ms": 7, "max_deliveries": 3, "leases_durable": True}
    body = await ok(await put(client, "cfg.logq", req), 201)
    assert_config(body["config"], **req)


async def test_put_check_order_dead_letter_before_type_immutability(client):
    await ok(await put(client, "cfg.order"), 201)
    await fail(
        await put(client, "cfg.order", {"type": "queue", "dead_letter": "bad name"}),
        400,
        "invalid_request",
    )
    await fail(
        await put(client, "cfg.order", {"type": "queue", "dead_letter": "cfg.order"}),
        400,
        "invalid_request",
    )
    await fail(
        await put(client, "cfg.order", {"type": "queue", "dead_letter": "ok.dl"}),
        409,
        "topic_exists_incompatible",
    )


async def test_put_max_topics_cap():
    async with open_app(make_config(limits={"max_topics": 2})) as h:
        client = h.app.test_client()
        await ok(await put(client, "cap.a"), 201)
        await ok(await put(client, "cap.b"), 201)
        r = await put(client, "cap.c")
        err = await fail(r, 429, "throttled")
        assert err["detail"] == {"limit": "max_topics", "max": 2}
        assert r.headers["Retry-After"] == "1"
        await fail(await client.get("/v0/topics/cap.c"), 404, "topic_not_found")
        # updates are never subject to max_topics
        body = await ok(await put(client, "cap.a", {"cap_records": 9}), 200)
        assert body["config"]["cap_records"] == 9
        # validation precedes the create-cap
        await fail(await put(client, "cap.c", {"dead_letter": "bad name"}), 400, "invalid_request")
        # lazy creation counts too
        r = await client.post("/v0/topics/cap.d", json={"records": [{"data": 1}]})
        err = await fail(r, 429, "throttled")
        assert err["detail"] == {"limit": "max_topics", "max": 2}
        # a delete returns the slot
        await ok(await client.delete("/v0/topics/cap.b"))
        await ok(await put(client, "cap.c"), 201)


async def test_put_bad_values_are_400_and_create_nothing(client):
    bad = [
        {"type": "stream"},
        {"type": None},
        {"discard": "new"},
        {"durability": "tape"},
        {"durable": "yes"},
        {"ttl_ms": -1},
        {"ttl_ms": 1.5},
        {"ttl_ms": "10"},
        {"ttl_ms": 2**64},
        {"cap_records": True},
        {"cap_bytes": -5},
        {"idempotency_window_ms": 12.25},
        {"lease_ms": -1},
        {"max_deliveries": 2**70},
        {"priority": "high"},
        {"priority": 1.5},
        {"auto_create": "false"},
        {"dead_letter": 5},
        {"dead_letter": ["x"]},
    ]
    for i, req in enumerate(bad):
        name = f"cfg.bad{i}"
        await fail(await put(client, name, req), 400, "invalid_request")
        await fail(await client.get(f"/v0/topics/{name}"), 404, "topic_not_found")


async def test_put_u64_max_is_accepted(client):
    body = await ok(
        await put(client, "cfg.u64", {"ttl_ms": 2**64 - 1, "cap_bytes": 2**64 - 1}), 201
    )
    assert body["config"]["ttl_ms"] == 2**64 - 1
    assert body["config"]["cap_bytes"] == 2**64 - 1


async def test_put_non_object_body_is_400(client):
    for raw in (b"[]", b"5", b'"log"', b"null", b"true"):
        r = await client.put("/v0/topics/cfg.nonobj", data=raw, headers=JSON_CT)
        await fail(r, 400, "invalid_request")


async def test_put_tighter_cap_evicts_immediately(client):
    await write(client, "cfg.tight", *({"data": i} for i in range(10)))
    await ok(await put(client, "cfg.tight", {"cap_records": 4}), 200)
    st = await state(client, "cfg.tight", touch="false")
    assert st["count"] == 4
    assert st["earliest_seq"] == 7
    assert st["head_seq"] == 10


async def test_put_tighter_cap_on_reject_topic_evicts_immediately(client):
    # README §10 / api-topics §2: "a tighter cap/TTL evicts/expires immediately"
    await ok(await put(client, "cfg.rej", {"cap_records": 5, "discard": "reject"}), 201)
    await write(client, "cfg.rej", *({"data": i} for i in range(5)))
    await ok(await put(client, "cfg.rej", {"cap_records": 2, "discard": "reject"}), 200)
    st = await state(client, "cfg.rej", touch="false")
    assert (st["count"], st["earliest_seq"], st["head_seq"]) == (2, 4, 5)
    body = await ok(await client.post("/v0/topics/cfg.rej/diff", json={}))
    assert body["tombstone"]["reason"] == "cap"
    assert (body["tombstone"]["gap_from"], body["tombstone"]["gap_to"]) == (1, 3)


async def test_put_switching_reject_to_old_evicts_immediately(client):
    await ok(await put(client, "cfg.rej2", {"cap_records": 5, "discard": "reject"}), 201)
    await write(client, "cfg.rej2", *({"data": i} for i in range(5)))
    # not a merge: discard resets to "old"
    await ok(await put(client, "cfg.rej2", {"cap_records": 2}), 200)
    st = await state(client, "cfg.rej2", touch="false")
    assert (st["count"], st["earliest_seq"]) == (2, 4)


async def test_put_tighter_ttl_expires_immediately(client, autojump_clock):
    await write(client, "cfg.ttl", {"data": 1}, {"data": 2})
    autojump_clock.jump(2)  # (virtual time: the records are 2 s old)
    await write(client, "cfg.ttl", {"data": 3})
    await ok(await put(client, "cfg.ttl", {"ttl_ms": 1000}), 200)
    st = await state(client, "cfg.ttl", touch="false")
    assert (st["count"], st["earliest_seq"], st["head_seq"]) == (1, 3, 3)
    body = await ok(await client.post("/v0/topics/cfg.ttl/diff", json={}))
    assert body["tombstone"]["reason"] == "ttl"
    assert (body["tombstone"]["gap_from"], body["tombstone"]["gap_to"]) == (1, 2)


# --------------------------------------------------------------------------------------
# GET state
# --------------------------------------------------------------------------------------


async def test_get_state_of_empty_topic(client):
    await ok(await put(client, "st.empty"), 201)
    st = await state(client, "st.empty", touch="false")
    assert st["topic"] == "st.empty"
    assert st["type"] == "log"
    assert st["head_seq"] == 0
    assert st["next_seq"] == 1
    assert st["earliest_seq"] == 1
    assert st["count"] == 0
    assert st["bytes"] == 0
    assert st["last_write_ts"] is None
    assert st["last_read_ts"] is None
    assert isinstance(st["effective_priority"], int)
    assert not isinstance(st["effective_priority"], bool)
    assert_config(st["config"])
    assert "queue" not in st


async def test_get_state_after_writes(client, harness, autojump_clock):
    await write(client, "st.w", {"data": {"a": 1}, "meta": {"k": "v"}}, {"data": [1, 2]})
    now = harness.clock.now_ms()
    autojump_clock.jump(2)  # (virtual time: last_write_ts stays the write's)
    st = await state(client, "st.w", touch="false")
    assert st["head_seq"] == 2
    assert st["next_seq"] == 3
    assert st["earliest_seq"] == 1
    assert st["count"] == 2
    # README §10: minified data + minified meta: {"a":1} 7 + {"k":"v"} 9 + [1,2] 5
    assert st["bytes"] == 21
    assert st["last_write_ts"] == now
    assert st["last_read_ts"] is None


async def test_get_touch_bumps_last_read_ts(client, harness, autojump_clock):
    await ok(await put(client, "st.touch"), 201)
    autojump_clock.jump(3)  # (virtual time)
    assert (await state(client, "st.touch", touch="false"))["last_read_ts"] is None
    assert (await state(client, "st.touch", touch="0"))["last_read_ts"] is None
    now = harness.clock.now_ms()
    await state(client, "st.touch")  # touch defaults to true
    autojump_clock.jump(1)  # (virtual time: last_read_ts stays the touch's)
    assert (await state(client, "st.touch", touch="false"))["last_read_ts"] == now


async def test_get_touch_true_values(client):
    await ok(await put(client, "st.t1"), 201)
    await state(client, "st.t1", touch="1")
    assert isinstance((await state(client, "st.t1", touch="false"))["last_read_ts"], int)


async def test_diff_bumps_last_read_ts(client):
    await ok(await put(client, "st.diff"), 201)
    await ok(await client.post("/v0/topics/st.diff/diff", json={}))
    assert isinstance((await state(client, "st.diff", touch="false"))["last_read_ts"], int)


async def test_effective_priority_manual_and_auto_decay(client, autojump_clock):
    # scheduler-and-backpressure.md A.5: manual priority replaces the automatic term;
    # the automatic term is 500 right after a read and halves every 30 s (0 from 300 s)
    await ok(await put(client, "st.manual", {"priority": 300}), 201)
    assert (await state(client, "st.manual", touch="false"))["effective_priority"] == 300
    await ok(await put(client, "st.off", {"auto_priority": False}), 201)
    await state(client, "st.off")
    assert (await state(client, "st.off", touch="false"))["effective_priority"] == 0
    await ok(await put(client, "st.auto"), 201)
    await state(client, "st.auto")  # touch: read recency = now
    seen = []
    for step in (0, 15, 15, 30, 60, 180):
        autojump_clock.jump(step)
        seen.append((await state(client, "st.auto", touch="false"))["effective_priority"])
    assert seen == [500, 354, 250, 125, 31, 0]
    items = {t["topic"]: t for t in (await listing(client))["topics"]}
    assert items["st.manual"]["effective_priority"] == 300
    assert items["st.auto"]["effective_priority"] == 0


async def test_get_absent_topic_is_404_and_never_creates(client):
    err = await fail(await client.get("/v0/topics/st.none"), 404, "topic_not_found")
    assert err["detail"] == {"topic": "st.none"}
    body = await listing(client)
    assert body["topics"] == []


# --------------------------------------------------------------------------------------
# GET list
# --------------------------------------------------------------------------------------


async def test_list_empty(client):
    body = await listing(client)
    assert body["topics"] == []
    assert "next_cursor" not in body


async def test_list_is_sorted_bytewise_with_item_fields(client):
    for name in ("b", "a.b", "B", "a-b", "a", "a_b"):
        await ok(await put(client, name, {"durable": name == "b"}), 201)
    await write(client, "a", {"data": {"x": 1}}, {"data": "hi"})
    body = await listing(client)
    names = [t["topic"] for t in body["topics"]]
    assert names == ["B", "a", "a-b", "a.b", "a_b", "b"]
    assert "next_cursor" not in body
    items = {t["topic"]: t for t in body["topics"]}
    a = items["a"]
    assert a["head_seq"] == 2
    assert a["earliest_seq"] == 1
    assert a["count"] == 2
    assert a["bytes"] == len(b'{"x":1}') + len(b'"hi"')
    assert a["durable"] is False
    assert isinstance(a["effective_priority"], int)
    assert items["b"]["durable"] is True
    empty = items["B"]
    assert (empty["head_seq"], empty["earliest_seq"], empty["count"], empty["bytes"]) == (
        0,
        1,
        0,
        0,
    )


async def test_list_prefix_filter(client):
    for name in ("sensor.temp", "sensor.hum", "sensors", "other"):
        await ok(await put(client, name), 201)
    names = [t["topic"] for t in (await listing(client, prefix="sensor."))["topics"]]
    assert names == ["sensor.hum", "sensor.temp"]
    names = [t["topic"] for t in (await listing(client, prefix="sensor"))["topics"]]
    assert names == ["sensor.hum", "sensor.temp", "sensors"]
    assert (await listing(client, prefix="zzz"))["topics"] == []
    assert (await listing(client, prefix="Sensor"))["topics"] == []


async def test_list_pagination_with_cursor(client):
    for i in range(5):
        await ok(await put(client, f"p{i}"), 201)
    page = await listing(client, page_size=2)
    assert [t["topic"] for t in page["topics"]] == ["p0", "p1"]
    page = await listing(client, page_size=2, cursor=page["next_cursor"])
    assert [t["topic"] for t in page["topics"]] == ["p2", "p3"]
    page = await listing(client, page_size=2, cursor=page["next_cursor"])
    assert [t["topic"] for t in page["topics"]] == ["p4"]
    assert "next_cursor" not in page


async def test_list_next_cursor_only_when_another_page_exists(client):
    for i in range(4):
        await ok(await put(client, f"e{i}"), 201)
    page = await listing(client, page_size=4)
    assert len(page["topics"]) == 4
    assert "next_cursor" not in page
    page = await listing(client, page_size=2)
    page = await listing(client, page_size=2, cursor=page["next_cursor"])
    assert [t["topic"] for t in page["topics"]] == ["e2", "e3"]
    assert "next_cursor" not in page


async def test_list_cursor_is_unpadded_base64url_of_after(client):
    for name in ("c1", "c2", "c3"):
        await ok(await put(client, name), 201)
    cursor = (await listing(client, page_size=1))["next_cursor"]
    assert isinstance(cursor, str)
    assert "=" not in cursor
    assert re.fullmatch(r"[A-Za-z0-9_-]+", cursor)
    decoded = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    assert json.loads(decoded) == {"after": "c1"}


async def test_list_cursor_with_prefix(client):
    for name in ("x1", "x2", "x3", "y1"):
        await ok(await put(client, name), 201)
    page = await listing(client, prefix="x", page_size=2)
    assert [t["topic"] for t in page["topics"]] == ["x1", "x2"]
    page = await listing(client, prefix="x", page_size=2, cursor=page["next_cursor"])
    assert [t["topic"] for t in page["topics"]] == ["x3"]
    assert "next_cursor" not in page
    # a cursor below the prefix range starts at the prefix; one past the end is empty
    page = await listing(client, prefix="x", cursor=page_cursor("a"))
    assert [t["topic"] for t in page["topics"]] == ["x1", "x2", "x3"]
    page = await listing(client, cursor=page_cursor("y1"))
    assert page["topics"] == []
    assert "next_cursor" not in page


async def test_list_page_size_clamps_never_reject(client):
    for i in range(3):
        await ok(await put(client, f"ps{i}"), 201)
    for value in ("0", "-7"):
        page = await listing(client, page_size=value)
        assert [t["topic"] for t in page["topics"]] == ["ps0"]
        assert "next_cursor" in page
    page = await listing(client, page_size=10**6)
    assert len(page["topics"]) == 3


async def test_list_default_page_size_is_100(client):
    async def create(name: str) -> None:
        await ok(await put(client, name), 201)

    await each_bounded(create, [f"d{i:03d}" for i in range(101)])
    page = await listing(client)
    assert len(page["topics"]) == 100
    assert page["topics"][-1]["topic"] == "d099"
    page = await listing(client, cursor=page["next_cursor"])
    assert [t["topic"] for t in page["topics"]] == ["d100"]
    assert "next_cursor" not in page


async def test_list_page_size_clamp_uses_max_page_size():
    cfg = make_config(protocol={"default_page_size": 2, "max_page_size": 3})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        for i in range(5):
            await ok(await put(client, f"m{i}"), 201)
        assert len((await listing(client))["topics"]) == 2
        assert len((await listing(client, page_size=1000))["topics"]) == 3


async def test_list_empty_cursor_is_treated_as_absent(client):
    for name in ("k1", "k2"):
        await ok(await put(client, name), 201)
    page = await listing(client, cursor="")
    assert [t["topic"] for t in page["topics"]] == ["k1", "k2"]


async def test_list_accepts_standard_base64_cursor(client):
    for name in ("a", "b", "b.x", "c"):
        await ok(await put(client, name), 201)
    # {"after":"b~"} in standard base64 contains '+' and padding; base64url would use '-'
    padded = base64.b64encode(b'{"after":"b~"}').decode()
    assert padded == "eyJhZnRlciI6ImJ+In0="
    for cursor in (
        padded,
        padded.rstrip("="),
        base64.urlsafe_b64encode(b'{"after":"b~"}').decode(),
    ):
        page = await listing(client, cursor=cursor)
        assert [t["topic"] for t in page["topics"]] == ["c"], cursor


async def test_list_bad_cursor_is_400(client):
    await ok(await put(client, "bc"), 201)
    for cursor in ("!!!", "%%%", "aGVsbG8", base64.b64encode(b"[1,2]").decode()):
        r = await client.get("/v0/topics", query_string={"cursor": cursor})
        await fail(r, 400, "invalid_request")


async def test_list_enforces_retention(client, autojump_clock):
    await write(client, "lr", {"data": 1}, {"data": 2}, config={"ttl_ms": 1000})
    autojump_clock.jump(1.5)
    (item,) = (await listing(client))["topics"]
    assert (item["count"], item["bytes"], item["earliest_seq"], item["head_seq"]) == (0, 0, 3, 2)


async def test_list_cursor_survives_deletion_of_its_topic(client):
    for i in range(4):
        await ok(await put(client, f"q{i}"), 201)
    page = await listing(client, page_size=2)
    await ok(await client.delete("/v0/topics/q1"))
    page = await listing(client, page_size=2, cursor=page["next_cursor"])
    assert [t["topic"] for t in page["topics"]] == ["q2", "q3"]


async def test_list_touch_false_by_default(client):
    await ok(await put(client, "lt"), 201)
    await listing(client)
    assert (await state(client, "lt", touch="false"))["last_read_ts"] is None
    await listing(client, touch="true")
    assert isinstance((await state(client, "lt", touch="false"))["last_read_ts"], int)


# --------------------------------------------------------------------------------------
# DELETE
# --------------------------------------------------------------------------------------


async def test_delete_existing_topic(client):
    await write(client, "del.a", {"data": 1})
    body = await ok(await client.delete("/v0/topics/del.a"))
    assert body["topic"] == "del.a"
    assert body["deleted"] is True
    assert body["routers_removed"] == []
    await fail(await client.get("/v0/topics/del.a"), 404, "topic_not_found")
    await fail(await client.post("/v0/topics/del.a/diff", json={}), 404, "topic_not_found")
    assert (await listing(client))["topics"] == []


async def test_delete_absent_topic_is_200_deleted_false(client):
    body = await ok(await client.delete("/v0/topics/del.none"))
    assert body["topic"] == "del.none"
    assert body["deleted"] is False
    assert body["routers_removed"] == []
    await write(client, "del.twice", {"data": 1})
    assert (await ok(await client.delete("/v0/topics/del.twice")))["deleted"] is True
    assert (await ok(await client.delete("/v0/topics/del.twice")))["deleted"] is False


async def test_delete_if_empty_on_non_empty_topic_is_409(client):
    await write(client, "del.ne", {"data": 1}, {"data": 2})
    for flag in ("true", "1"):
        r = await client.delete("/v0/topics/del.ne", query_string={"if_empty": flag})
        err = await fail(r, 409, "topic_not_empty")
        assert err["detail"] == {"topic": "del.ne", "count": 2}
    st = await state(client, "del.ne", touch="false")
    assert st["count"] == 2


async def test_delete_if_empty_on_empty_topic(client):
    await ok(await put(client, "del.e"), 201)
    r = await client.delete("/v0/topics/del.e", query_string={"if_empty": "true"})
    assert (await ok(r))["deleted"] is True


async def test_delete_if_empty_counts_live_records_only(client):
    await write(client, "del.live", {"data": 1}, {"data": 2})
    await ok(await client.post("/v0/topics/del.live/delete", json={"before_seq": 3}))
    r = await client.delete("/v0/topics/del.live", query_string={"if_empty": "true"})
    assert (await ok(r))["deleted"] is True


async def test_delete_if_empty_enforces_ttl_first(client, autojump_clock):
    await write(client, "del.ttl", {"data": 1}, config={"ttl_ms": 1000})
    autojump_clock.jump(1.5)
    r = await client.delete("/v0/topics/del.ttl", query_string={"if_empty": "true"})
    assert (await ok(r))["deleted"] is True


async def test_recreate_after_delete_is_a_fresh_instance(client):
    await ok(await put(client, "del.re", {"cap_records": 5}), 201)
    await write(client, "del.re", {"data": 1}, {"data": 2}, {"data": 3})
    await ok(await client.delete("/v0/topics/del.re"))
    r = await client.post("/v0/topics/del.re", json={"records": [{"data": "new"}]})
    body = await ok(r, 201)
    assert body["created"] is True
    assert body["seqs"] == [1]
    st = await state(client, "del.re", touch="false")
    assert st["head_seq"] == 1
    assert_config(st["config"])
