"""Contract tests for queue topics: claim, ack, nack, extend, dead-lettering, priority.

Method: black-box through Quart's test client on an in-process app whose wall clock
follows Trio's clock. Timed rules (lease expiry, nack delays, the coalescing window) take
`autojump_clock` and move virtual time with `advance` (`MockClock.jump`, then settle),
asserting exact virtual times and deadlines; nothing waits on real time. Each test is
named for the rule it proves.
"""

from __future__ import annotations

import json
import re

import pytest
import trio

from topicd.testing.fake_clock import advance
from topicd.testing.harness import make_config, open_app

LEASE_ID = re.compile(r"lease_[0-9a-f]+")
ITEM_KEYS = ["$seq", "lease_id", "deadline", "$ts", "$tag", "$priority", "deliveries", "data"]


async def ok(r) -> dict:
    raw = await r.get_data()
    assert r.status_code == 200, raw
    body = json.loads(raw)
    assert "error" not in body
    assert isinstance(body["performance"]["server_total_ms"], float)
    return body


async def fail(r, status: int, code: str) -> dict:
    raw = await r.get_data()
    assert r.status_code == status, raw
    err = json.loads(raw)["error"]
    assert err["code"] == code, err
    return err


async def make_queue(client, name: str = "q", **cfg) -> None:
    r = await client.put(f"/v0/topics/{name}", json={"type": "queue", **cfg})
    assert r.status_code in (200, 201), await r.get_data()


async def produce(client, name: str, *records) -> list[int]:
    recs = [r if isinstance(r, dict) else {"data": r} for r in records]
    r = await client.post(f"/v0/topics/{name}", json={"records": recs})
    assert r.status_code in (200, 201), await r.get_data()
    return (await r.get_json())["seqs"]


async def claim(client, name: str = "q", node: str = "w1", **kw) -> dict:
    return await ok(await client.post(f"/v0/topics/{name}/claim", json={"node": node, **kw}))


def seqs_of(body: dict) -> list[int]:
    return [job["$seq"] for job in body["claimed"]]


async def op(client, verb: str, name: str = "q", node: str = "w1", **kw) -> dict:
    return await ok(await client.post(f"/v0/topics/{name}/{verb}", json={"node": node, **kw}))


async def queue_state(client, name: str = "q") -> dict:
    r = await client.get(f"/v0/topics/{name}", query_string={"touch": "false"})
    return (await ok(r))["queue"]


def now_ms(harness) -> int:
    return harness.clock.now_ms()


# ---- which topics answer ----------------------------------------------------------------


@pytest.mark.parametrize("verb", ["claim", "ack", "nack", "extend"])
async def test_absent_topic_is_404_and_never_created(client, verb):
    body = {"node": "w", "seqs": [1], "lease_ms": 1000}
    await fail(await client.post(f"/v0/topics/nope/{verb}", json=body), 404, "topic_not_found")
    r = await client.get("/v0/topics/nope")
    assert r.status_code == 404


@pytest.mark.parametrize("verb", ["claim", "ack", "nack", "extend"])
async def test_log_topic_is_409_not_a_queue(client, verb):
    await produce(client, "log", 1)
    body = {"node": "w", "seqs": [1], "lease_ms": 1000}
    err = await fail(await client.post(f"/v0/topics/log/{verb}", json=body), 409, "not_a_queue")
    assert err["detail"] == {"topic": "log"}


# ---- claim: request validation ----------------------------------------------------------


async def test_claim_needs_a_body(client):
    await make_queue(client)
    r = await client.post(
        "/v0/topics/q/claim", data=b"", headers={"Content-Type": "application/json"}
    )
    await fail(r, 400, "invalid_request")


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"node": ""},
        {"node": "x" * 129},
        {"node": 7},
        {"node": "w", "max": -1},
        {"node": "w", "max": 1.5},
    ],
)
async def test_claim_node_must_be_a_non_empty_string_of_at_most_128_bytes(client, body):
    await make_queue(client)
    await fail(await client.post("/v0/topics/q/claim", json=body), 400, "invalid_request")


async def test_claim_node_of_128_bytes_is_accepted(client):
    await make_queue(client)
    await produce(client, "q", 1)
    assert seqs_of(await claim(client, node="é" * 64)) == [1]


async def test_claim_max_defaults_to_1_and_0_means_1(client):
    await make_queue(client)
    await produce(client, "q", 1, 2, 3)
    assert seqs_of(await claim(client)) == [1]
    assert seqs_of(await claim(client, max=0)) == [2]


async def test_claim_max_is_clamped_to_max_claim():
    async with open_app(make_config(queue={"max_claim": 3})) as h:
        client = h.app.test_client()
        await make_queue(client)
        await produce(client, "q", *range(10))
        body = await claim(client, max=1000)
        assert body["count"] == 3
        assert body["ready"] == 7


async def test_claim_lease_ms_defaults_to_the_topic_and_is_clamped(harness, client, autojump_clock):
    await make_queue(client, lease_ms=5000)
    await produce(client, "q", 1, 2, 3)
    t = now_ms(harness)
    assert (await claim(client))["claimed"][0]["deadline"] == t + 5000
    assert (await claim(client, lease_ms=1))["claimed"][0]["deadline"] == t + 100
    body = await claim(client, lease_ms=10**12)
    assert body["claimed"][0]["deadline"] == t + 86_400_000


# ---- claim: the response ------------------------------------------------------------------


async def test_claim_item_fields_and_order(harness, client, autojump_clock):
    await make_queue(client)
    await produce(
        client,
        "q",
        {"data": {"a": 1.10}, "tag": "t1", "meta": {"m": 1}, "priority": 3, "node": "p"},
        {"data": [1, 2]},
    )
    body = await claim(client, max=5, lease_ms=60000)
    assert list(body) == ["topic", "claimed", "count", "ready", "performance"]
    assert (body["topic"], body["count"], body["ready"]) == ("q", 2, 0)
    first, second = body["claimed"]
    assert list(first) == [*ITEM_KEYS, "meta"]
    assert first["$priority"] == 3
    assert first["$tag"] == "t1"
    assert first["meta"] == {"m": 1}
    assert first["deliveries"] == 1
    assert first["deadline"] == now_ms(harness) + 60000
    assert "$node" not in first
    assert LEASE_ID.fullmatch(first["lease_id"])
    assert first["lease_id"] != second["lease_id"]
    assert list(second) == ["$seq", "lease_id", "deadline", "$ts", "deliveries", "data"]


async def test_claim_data_text_is_returned_as_written(client):
    await make_queue(client)
    r = await client.post(
        "/v0/topics/q",
        data=b'{"records":[{"data":{"x":1.10,"big":123456789012345678901234567890}}]}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 200
    r = await client.post("/v0/topics/q/claim", json={"node": "w"})
    raw = await r.get_data()
    assert b'"data":{"x":1.10,"big":123456789012345678901234567890}' in raw


async def test_empty_queue_claims_nothing_without_error(client):
    await make_queue(client)
    body = await claim(client, max=8)
    assert (body["claimed"], body["count"], body["ready"]) == ([], 0, 0)


async def test_without_priorities_claims_come_in_ascending_seq(client):
    await make_queue(client)
    await produce(client, "q", *range(6))
    assert seqs_of(await claim(client, max=2)) == [1, 2]
    assert seqs_of(await claim(client, max=10)) == [3, 4, 5, 6]


async def test_claim_order_is_priority_descending_then_seq(client):
    await make_queue(client)
    prios = [0, 5, -1, 5, 10, 0, -1, 10]
    await produce(client, "q", *[{"data": i, "priority": p} for i, p in enumerate(prios)])
    body = await claim(client, max=8)
    assert seqs_of(body) == [5, 8, 2, 4, 1, 6, 3, 7]
    assert [j.get("$priority", 0) for j in body["claimed"]] == [10, 10, 5, 5, 0, 0, -1, -1]


async def test_batch_priority_is_a_default_and_per_record_wins(client):
    await make_queue(client)
    r = await client.post(
        "/v0/topics/q", json={"priority": 4, "records": [{"data": 1}, {"data": 2, "priority": 9}]}
    )
    assert r.status_code == 200
    body = await claim(client, max=2)
    assert [(j["$seq"], j["$priority"]) for j in body["claimed"]] == [(2, 9), (1, 4)]


@pytest.mark.parametrize("prio", [1.5, "3", 2**31, -(2**31) - 1, True])
async def test_priority_must_be_a_32_bit_integer(client, prio):
    await make_queue(client)
    r = await client.post("/v0/topics/q", json={"records": [{"data": 1, "priority": prio}]})
    await fail(r, 400, "invalid_request")


async def test_retried_work_comes_first_within_its_priority(client):
    await make_queue(client)
    await produce(client, "q", *[{"data": i, "priority": p} for i, p in enumerate([1, 1, 1, 0])])
    assert seqs_of(await claim(client, max=2)) == [1, 2]
    await op(client, "nack", seqs=[2])
    assert seqs_of(await claim(client, max=2)) == [2, 3]  # 2 was retried: before fresh 3


async def test_nacked_job_keeps_its_priority(client):
    await make_queue(client)
    await produce(client, "q", {"data": 0, "priority": 7}, {"data": 1, "priority": 2})
    assert seqs_of(await claim(client)) == [1]
    await op(client, "nack", seqs=[1])
    body = await claim(client)
    assert seqs_of(body) == [1]
    assert body["claimed"][0]["$priority"] == 7


async def test_claims_ignore_node_filtering(client):
    await make_queue(client)
    await produce(client, "q", {"data": 1, "node": "w1"})
    assert seqs_of(await claim(client, node="w1")) == [1]


async def test_diff_on_a_queue_never_claims(client):
    await make_queue(client)
    await produce(client, "q", 1, 2)
    r = await client.post("/v0/topics/q/diff", json={})
    assert len((await ok(r))["records"]) == 2
    assert (await queue_state(client))["ready"] == 2


# ---- ack ------------------------------------------------------------------------------------


async def test_ack_deletes_the_job_for_good(client):
    await make_queue(client)
    await produce(client, "q", 1, 2)
    await claim(client, max=2)
    body = await op(client, "ack", seqs=[1])
    assert list(body) == ["topic", "acked", "skipped", "ready", "in_flight", "performance"]
    assert (body["acked"], body["skipped"], body["ready"], body["in_flight"]) == (1, [], 0, 1)
    assert "fsync_ms" in body["performance"]
    r = await client.post("/v0/topics/q/diff", json={})
    assert [rec["$seq"] for rec in (await ok(r))["records"]] == [2]
    r = await client.get("/v0/topics/q")
    assert (await ok(r))["count"] == 1


async def test_ack_skips_what_the_node_does_not_hold(client):
    await make_queue(client)
    await produce(client, "q", 1, 2, 3)
    await claim(client, node="a")  # 1
    await claim(client, node="b")  # 2
    body = await op(client, "ack", node="a", seqs=[2, 3, 99, 1, 1])
    assert (body["acked"], body["skipped"]) == (1, [2, 3, 99, 1])  # again: already acked


async def test_ack_is_idempotent(client):
    await make_queue(client)
    await produce(client, "q", 1)
    await claim(client)
    assert (await op(client, "ack", seqs=[1]))["acked"] == 1
    body = await op(client, "ack", seqs=[1])
    assert (body["acked"], body["skipped"]) == (0, [1])


async def test_empty_seqs_is_a_no_op(client):
    await make_queue(client)
    body = await op(client, "ack", seqs=[])
    assert (body["acked"], body["skipped"]) == (0, [])


@pytest.mark.parametrize("verb", ["ack", "nack", "extend"])
async def test_more_than_max_claim_seqs_is_batch_too_large(client, verb):
    await make_queue(client)
    body = {"node": "w", "seqs": list(range(1001)), "lease_ms": 1000}
    err = await fail(await client.post(f"/v0/topics/q/{verb}", json=body), 400, "batch_too_large")
    assert err["detail"] == {"seqs": 1001, "max": 1000}


@pytest.mark.parametrize(
    "body",
    [
        {"seqs": [1]},
        {"node": "", "seqs": [1]},
        {"node": "w"},
        {"node": "w", "seqs": [-1]},
        {"node": "w", "seqs": "1"},
        {"node": "w", "seqs": [1, 2], "lease_ids": ["lease_1"]},
        {"node": "w", "seqs": [1], "lease_ids": ["lease_XYZ"]},
        {"node": "w", "seqs": [1], "lease_ids": ["1f4"]},
        {"node": "w", "seqs": [1], "lease_ids": [7]},
    ],
)
@pytest.mark.parametrize("verb", ["ack", "nack", "extend"])
async def test_bad_lease_op_bodies_are_400(client, verb, body):
    await make_queue(client)
    body = {"lease_ms": 1000, **body}
    await fail(await client.post(f"/v0/topics/q/{verb}", json=body), 400, "invalid_request")


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"seqs": [1, 2**64]}, "seqs[1]"),
        ({"seqs": [1, 2], "lease_ids": ["lease_1", "lease_2,lease_3"]}, "lease_ids[1]"),
        ({"seqs": [1, 2], "lease_ids": ["lease_1,", "lease_2"]}, "lease_ids[0]"),
        ({"seqs": [1, 2, 3], "lease_ids": ["", "lease_a", "lease_B"]}, "lease_ids[2]"),
    ],
)
async def test_a_bad_seq_or_fence_is_named_in_the_400(client, extra, field):
    # (all seqs and fences are checked at once; the error still names the first bad one)
    await make_queue(client)
    body = {"node": "w", "lease_ms": 1000, **extra}
    err = await fail(await client.post("/v0/topics/q/ack", json=body), 400, "invalid_request")
    assert err["detail"] == {"field": field}


async def test_ack_on_an_ephemeral_queue(client):
    await make_queue(client, durability="ephemeral")
    await produce(client, "q", 1)
    await claim(client)
    assert (await op(client, "ack", seqs=[1]))["acked"] == 1
    r = await client.get("/v0/topics/q")
    assert (await ok(r))["count"] == 0


# ---- fencing --------------------------------------------------------------------------------


async def test_a_stale_fence_never_acks_a_re_leased_job(client, autojump_clock):
    await make_queue(client)
    await produce(client, "q", 1)
    old = (await claim(client, lease_ms=1000))["claimed"][0]["lease_id"]
    await advance(autojump_clock, 1.5)
    new = (await claim(client))["claimed"][0]  # same node name, another process
    assert new["lease_id"] != old
    assert new["deliveries"] == 2
    for verb in ("ack", "nack", "extend"):
        body = await op(client, verb, seqs=[1], lease_ids=[old], lease_ms=1000)
        assert body["skipped"] == [1]
    body = await op(client, "ack", seqs=[1], lease_ids=[new["lease_id"]])
    assert body["acked"] == 1


async def test_an_empty_fence_checks_only_the_node(client):
    await make_queue(client)
    await produce(client, "q", 1, 2)
    lid = (await claim(client, max=2))["claimed"][0]["lease_id"]
    body = await op(client, "ack", seqs=[1, 2], lease_ids=[lid, ""])
    assert (body["acked"], body["skipped"]) == (2, [])


# ---- the visibility timeout -----------------------------------------------------------------


async def test_an_expired_lease_makes_the_job_claimable_again(harness, client, autojump_clock):
    await make_queue(client)
    await produce(client, "q", 1)
    t0 = trio.current_time()
    first = (await claim(client, lease_ms=1000))["claimed"][0]
    assert first["deadline"] == now_ms(harness) + 1000
    await advance(autojump_clock, 1.0)  # now == deadline: still in flight
    assert await queue_state(client) == {"ready": 0, "in_flight": 1, "dead_lettered": 0}
    assert (await claim(client, node="w2"))["count"] == 0
    await advance(autojump_clock, 0.001)  # now > deadline
    assert trio.current_time() - t0 == pytest.approx(1.001)
    assert await queue_state(client) == {"ready": 1, "in_flight": 0, "dead_lettered": 0}
    again = (await claim(client, node="w2"))["claimed"][0]
    assert (again["$seq"], again["deliveries"]) == (1, 2)


async def test_an_expired_lease_cannot_be_acked_even_if_nobody_re_claimed_it(
    client, autojump_clock
):
    await make_queue(client)
    await produce(client, "q", 1)
    await claim(client, lease_ms=1000)
    await advance(autojump_clock, 2)
    body = await op(client, "ack", seqs=[1])
    assert (body["acked"], body["skipped"], body["ready"]) == (0, [1], 1)


async def test_expiry_timer_releases_leases_without_any_request(harness, autojump_clock):
    client = harness.app.test_client()
    await make_queue(client)
    await produce(client, "q", 1, 2)
    await claim(client, max=2, lease_ms=500)
    q = harness.engine.get("q").queue
    assert len(q.leases) == 2
    await advance(autojump_clock, 0.6)
    assert len(q.leases) == 0  # swept by the timer at the deadline, not by a request
    assert q.counts().ready == 2


# ---- nack -----------------------------------------------------------------------------------


async def test_nack_releases_at_once_and_keeps_the_delivery_count(client):
    await make_queue(client)
    await produce(client, "q", 1)
    await claim(client)
    body = await op(client, "nack", seqs=[1])
    assert list(body) == ["topic", "nacked", "skipped", "ready", "in_flight", "performance"]
    assert (body["nacked"], body["skipped"], body["ready"], body["in_flight"]) == (1, [], 1, 0)
    assert (await claim(client))["claimed"][0]["deliveries"] == 2


async def test_nack_delay_hides_the_job_until_it_ends(client, autojump_clock):
    await make_queue(client)
    await produce(client, "q", 1, 2)
    await claim(client)
    body = await op(client, "nack", seqs=[1], delay_ms=2000)
    assert (body["ready"], body["in_flight"]) == (1, 0)  # in neither count while delayed
    assert seqs_of(await claim(client, max=5)) == [2]
    await advance(autojump_clock, 1.999)
    assert (await claim(client))["count"] == 0
    await advance(autojump_clock, 0.001)
    body = await claim(client)
    assert seqs_of(body) == [1]
    assert body["claimed"][0]["deliveries"] == 2


async def test_nack_delay_is_clamped_to_max_nack_delay_ms(autojump_clock):
    async with open_app(make_config(queue={"max_nack_delay_ms": 1000})) as h:
        client = h.app.test_client()
        await make_queue(client)
        await produce(client, "q", 1)
        await claim(client)
        await op(client, "nack", seqs=[1], delay_ms=10**9)
        await advance(autojump_clock, 1.0)
        assert seqs_of(await claim(client)) == [1]


async def test_nack_skips_what_the_node_does_not_hold(client):
    await make_queue(client)
    await produce(client, "q", 1)
    await claim(client, node="a")
    body = await op(client, "nack", node="b", seqs=[1, 5])
    assert (body["nacked"], body["skipped"]) == (0, [1, 5])


# ---- extend ---------------------------------------------------------------------------------


async def test_extend_sets_the_deadline_from_now(harness, client, autojump_clock):
    await make_queue(client)
    await produce(client, "q", 1)
    await claim(client, lease_ms=1000)
    await advance(autojump_clock, 0.8)
    body = await op(client, "extend", seqs=[1, 2], lease_ms=1000)
    assert list(body) == ["topic", "extended", "skipped", "deadlines", "performance"]
    assert (body["extended"], body["skipped"]) == (1, [2])
    assert body["deadlines"] == {"1": now_ms(harness) + 1000}  # set, not added
    await advance(autojump_clock, 0.5)  # past the original deadline
    assert await queue_state(client) == {"ready": 0, "in_flight": 1, "dead_lettered": 0}
    await advance(autojump_clock, 0.6)
    assert await queue_state(client) == {"ready": 1, "in_flight": 0, "dead_lettered": 0}


async def test_extend_needs_lease_ms(client):
    await make_queue(client)
    r = await client.post("/v0/topics/q/extend", json={"node": "w", "seqs": [1]})
    await fail(r, 400, "invalid_request")


async def test_extend_keeps_the_delivery_count_and_clamps_lease_ms(harness, client, autojump_clock):
    await make_queue(client)
    await produce(client, "q", 1)
    await claim(client)
    body = await op(client, "extend", seqs=[1], lease_ms=1)
    assert body["deadlines"] == {"1": now_ms(harness) + 100}
    await op(client, "nack", seqs=[1])
    assert (await claim(client))["claimed"][0]["deliveries"] == 2


async def test_an_expired_lease_cannot_be_extended(client, autojump_clock):
    await make_queue(client)
    await produce(client, "q", 1)
    await claim(client, lease_ms=100)
    await advance(autojump_clock, 0.2)
    body = await op(client, "extend", seqs=[1], lease_ms=1000)
    assert (body["extended"], body["skipped"], body["deadlines"]) == (0, [1], {})


# ---- dead-lettering -------------------------------------------------------------------------


async def exhaust(client, times: int, **kw) -> list[dict]:
    """Claim and nack `times` rounds; the claims' bodies."""
    out = []
    for _ in range(times):
        body = await claim(client, max=10, **kw)
        out.append(body)
        await op(client, "nack", seqs=seqs_of(body))
    return out


async def test_a_job_over_max_deliveries_moves_to_the_dead_letter_topic(client):
    await make_queue(client, max_deliveries=2, dead_letter="q.dead")
    await produce(
        client,
        "q",
        {"data": {"n": 1.10}, "tag": "t", "node": "src", "priority": 4, "meta": {"k": "v"}},
        {"data": 2, "meta": [1]},
        {"data": 3},
    )
    rounds = await exhaust(client, 2)
    assert [len(b["claimed"]) for b in rounds] == [3, 3]
    body = await claim(client, max=10)  # delivery 3 of each: diverted, not leased
    assert body["count"] == 0
    assert body["ready"] == 0
    state = await queue_state(client)
    assert state == {"ready": 0, "in_flight": 0, "dead_lettered": 3}
    r = await client.get("/v0/topics/q")
    assert (await ok(r))["count"] == 0
    r = await client.post("/v0/topics/q.dead/diff", json={"include_tags": True})
    records = (await ok(r))["records"]
    assert [rec["data"] for rec in records] == [{"n": 1.10}, 2, 3]
    first = records[0]
    assert (first["$tag"], first["$node"], first["$priority"]) == ("t", "src", 4)
    assert first["meta"] == {
        "k": "v",
        "$dead_letter_from": "q",
        "$dead_letter_deliveries": "2",
        "$dead_letter_src_seq": "1",
    }
    # a non-object meta is replaced by a new object; an absent one is created
    assert records[1]["meta"]["$dead_letter_src_seq"] == "2"
    assert "$dead_letter_from" in records[2]["meta"]
    assert "$priority" not in records[1]
    r = await client.get("/v0/topics/q.dead")
    assert (await ok(r))["config"]["type"] == "log"  # created with the default config


async def test_dead_letter_copy_keeps_its_priority_in_a_queue(client):
    await make_queue(client, "dlq")
    await make_queue(client, max_deliveries=1, dead_letter="dlq")
    await produce(client, "q", {"data": 1, "priority": -3}, {"data": 2, "priority": 8})
    await exhaust(client, 1)
    assert (await claim(client, max=10))["count"] == 0
    body = await claim(client, "dlq", max=10)
    assert [j["$priority"] for j in body["claimed"]] == [8, -3]


async def test_without_dead_letter_jobs_are_redelivered_forever(client):
    await make_queue(client, max_deliveries=1)
    await produce(client, "q", 1)
    rounds = await exhaust(client, 5)
    assert [b["claimed"][0]["deliveries"] for b in rounds] == [1, 2, 3, 4, 5]


async def test_a_failed_move_leaves_the_job_claimable(client):
    await make_queue(client, max_deliveries=1, dead_letter="full")
    r = await client.put("/v0/topics/full", json={"cap_records": 1, "discard": "reject"})
    assert r.status_code == 201
    await produce(client, "full", 0)
    await produce(client, "q", 1)
    await exhaust(client, 1)
    body = await claim(client)
    assert body["count"] == 0
    assert await queue_state(client) == {"ready": 1, "in_flight": 0, "dead_lettered": 0}
    await client.post("/v0/topics/full/delete", json={"before_seq": 10})
    await claim(client)  # the move is retried on a later pass
    assert await queue_state(client) == {"ready": 0, "in_flight": 0, "dead_lettered": 1}


# ---- the coalescing window ----------------------------------------------------------------


async def test_a_cohort_is_served_round_robin_when_the_window_closes(client, autojump_clock):
    await make_queue(client, claim_jitter_ms=20)
    await produce(client, "q", *range(50))
    bodies: dict[int, dict] = {}
    t0 = trio.current_time()

    async def one(i: int) -> None:
        bodies[i] = await claim(client, node=f"w{i}", max=10)

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(one, i)
    assert trio.current_time() - t0 == pytest.approx(0.020)
    assert sorted(b["count"] for b in bodies.values()) == [5] * 10
    claimed = sorted(s for b in bodies.values() for s in seqs_of(b))
    assert claimed == list(range(1, 51))
    assert {b["ready"] for b in bodies.values()} == {0}


async def test_a_cohort_on_a_deleted_queue_fails_the_first_claimer_only(client, autojump_clock):
    await make_queue(client, claim_jitter_ms=50)
    await produce(client, "q", 1)
    results: list[object] = []

    async def one(i: int) -> None:
        r = await client.post("/v0/topics/q/claim", json={"node": f"w{i}"})
        results.append((i, r.status_code, await r.get_json()))

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
            await advance(autojump_clock, 0.01)
        r = await client.delete("/v0/topics/q")
        assert r.status_code == 200
    by = {i: (status, body) for i, status, body in results}
    assert by[0][0] == 404
    assert [by[i][1]["count"] for i in (1, 2)] == [0, 0]


# ---- state, deletion ----------------------------------------------------------------------


async def test_get_shows_the_queue_block(client):
    await make_queue(client)
    await produce(client, "q", 1, 2, 3)
    await claim(client)
    r = await client.get("/v0/topics/q")
    body = await ok(r)
    assert body["type"] == "queue"
    assert body["queue"] == {"ready": 2, "in_flight": 1, "dead_lettered": 0}
    assert body["queue"]["ready"] + body["queue"]["in_flight"] == body["count"]
    await produce(client, "log", 1)
    assert "queue" not in await ok(await client.get("/v0/topics/log"))


async def test_deleting_the_topic_drops_its_leases(client):
    await make_queue(client)
    await produce(client, "q", 1)
    lid = (await claim(client))["claimed"][0]["lease_id"]
    assert (await ok(await client.delete("/v0/topics/q")))["deleted"]
    await make_queue(client)
    await produce(client, "q", 1)
    assert await queue_state(client) == {"ready": 1, "in_flight": 0, "dead_lettered": 0}
    body = await op(client, "ack", seqs=[1], lease_ids=[lid])
    assert body["skipped"] == [1]


async def test_evicted_jobs_stop_being_claimable(client):
    await make_queue(client, cap_records=2)
    await produce(client, "q", 1, 2)
    await claim(client)  # leases 1
    await produce(client, "q", 3)  # evicts 1
    assert await queue_state(client) == {"ready": 2, "in_flight": 0, "dead_lettered": 0}
    assert (await op(client, "ack", seqs=[1]))["skipped"] == [1]
    assert seqs_of(await claim(client, max=5)) == [2, 3]


async def test_deleted_jobs_stop_being_claimable(client):
    await make_queue(client)
    await produce(client, "q", {"data": 1, "tag": "x"}, 2, {"data": 3, "tag": "x", "priority": 2})
    await client.post("/v0/topics/q/delete", json={"match": "x"})
    assert seqs_of(await claim(client, max=5)) == [2]


async def test_claim_needs_read_and_write_scopes():
    keys = ("rw:rw", "r:r", "w:w", "full")
    async with open_app(make_config(auth={"api_keys": keys})) as h:
        client = h.app.test_client()

        def auth(k: str) -> dict:
            return {"Authorization": f"Bearer {k}"}

        r = await client.put("/v0/topics/q", json={"type": "queue"}, headers=auth("full"))
        assert r.status_code == 201
        for key in ("r", "w"):
            r = await client.post("/v0/topics/q/claim", json={"node": "n"}, headers=auth(key))
            await fail(r, 403, "forbidden")
        r = await client.post("/v0/topics/q/claim", json={"node": "n"}, headers=auth("rw"))
        assert r.status_code == 200
        for verb in ("ack", "nack"):
            body = {"node": "n", "seqs": []}
            r = await client.post(f"/v0/topics/q/{verb}", json=body, headers=auth("r"))
            await fail(r, 403, "forbidden")
            r = await client.post(f"/v0/topics/q/{verb}", json=body, headers=auth("w"))
            assert r.status_code == 200


async def test_leases_durable_is_accepted_and_the_lease_calls_answer_as_without_it(client):
    r = await client.put("/v0/topics/q", json={"type": "queue", "leases_durable": True})
    assert r.status_code == 201
    assert (await r.get_json())["config"]["leases_durable"] is True
    r = await client.post(
        "/v0/topics/q2",
        json={"records": [{"data": 1}], "config": {"type": "queue", "leases_durable": True}},
    )
    assert r.status_code == 201
    seqs = await produce(client, "q", 1, 2, 3)
    body = await claim(client, "q", max=3)
    assert [(j["$seq"], j["deliveries"]) for j in body["claimed"]] == [(s, 1) for s in seqs]
    lease_ids = [j["lease_id"] for j in body["claimed"]]
    r = await client.post(
        "/v0/topics/q/extend",
        json={"node": "w1", "seqs": seqs[:1], "lease_ms": 5000, "lease_ids": lease_ids[:1]},
    )
    assert (await r.get_json())["extended"] == 1
    r = await client.post("/v0/topics/q/nack", json={"node": "w1", "seqs": seqs[1:2]})
    assert (await r.get_json())["nacked"] == 1
    r = await client.post("/v0/topics/q/ack", json={"node": "w1", "seqs": seqs[2:]})
    assert (await r.get_json())["acked"] == 1
    again = await claim(client, "q", max=3)
    assert [(j["$seq"], j["deliveries"]) for j in again["claimed"]] == [(seqs[1], 2)]
