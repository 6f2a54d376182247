"""Contract tests for the frames of the SSE watch stream (api-routers-watch §2.5-§2.7;
api-topics §7-§9; README §4).

Method: black-box. Topics are set up and written over HTTP (Quart test client), a watch
session is created with `POST /v0/watch` and its stream is read with
`topicd.testing.sse.open_stream` (raw ASGI, capacity-0 body channel: the test is the
client's socket). Its `SseParser` already enforces the framing rules (no CR, one compact
JSON `data:` line, heartbeats in their own block); each frame is then reduced to
`(event, decoded id map, data)` and whole runs of frames are compared with `==` against
the values the spec defines: record projection, batch bounds (`from_seq`/`to_seq`/
`head_seq`), the composite id (all session topics, keys sorted bytewise, unpadded
base64url, checked byte for byte), tombstone ranges and reasons, `caught-up`,
`topic-deleted`, heartbeats and the shutdown frame.

Every stream test takes pytest-trio's `autojump_clock` (MockClock): the engine's clocks
follow Trio's virtual time, so heartbeat periods are measured exactly with
`trio.current_time()`, "no frame" is checked by waiting in virtual time, and TTL expiry
is reached by moving the wall clock (`harness.clock.jump`). Where a test needs the
server to have processed a write before it goes on (the lagged-connection case) it uses
`trio.testing.wait_all_tasks_blocked()`, never a sleep.
"""

from __future__ import annotations

import base64

import pytest
import trio
import trio.testing

from tests.watch.helpers import (
    caught_up,
    close,
    create,
    delete_topic,
    diff,
    enc_id,
    ends,
    ok_json,
    open_ok,
    put_topic,
    quiet,
    read,
    read_until_event,
    seqs,
    state,
    wid_of,
    write,
    write_n,
)
from topicd.testing.harness import make_config, open_app


def bounds(frame) -> tuple[int, int, int]:
    d = frame[2]
    return (d["from_seq"], d["to_seq"], d["head_seq"])


# ---- opening, ids --------------------------------------------------------------------------


def test_composite_id_helper_matches_the_spec_example():
    assert (
        enc_id({"alerts": 3127, "payments.audit": 7310, "sensor.temps": 88215})
        == "eyJhbGVydHMiOjMxMjcsInBheW1lbnRzLmF1ZGl0Ijo3MzEwLCJzZW5zb3IudGVtcHMiOjg4MjE1fQ"
    )


async def test_open_sends_retry_then_heartbeat_each_its_own_block(
    autojump_clock, harness, client, nursery
):
    await put_topic(client, "a")
    wid = await wid_of(client, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid)  # asserts retry: 2000, then `: hb`
    first, second = s.parser.frames[:2]
    assert (first.retry, first.event, first.id, first.raw_data, first.comment) == (
        2000,
        None,
        None,
        None,
        None,
    )
    assert (second.comment, second.event, second.id, second.retry) == ("hb", None, None, None)
    assert await read(s, 1) == [caught_up("a", 0, {"a": 0})]
    await close(s)


async def test_id_lists_every_session_topic_sorted_bytewise(
    autojump_clock, harness, client, nursery
):
    names = ["b", "B", "a.x", "a", "a-z", "a0", "a:z"]
    for n in names:
        await put_topic(client, n)
    await write_n(client, "a", 2)
    await write_n(client, "b", 1)
    body = {"topics": {n: {} for n in names}}
    body["topics"]["a0"] = {"tail": True}
    wid = await wid_of(client, body)
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 9)
    start = {"b": 0, "B": 0, "a.x": 0, "a": 0, "a-z": 0, "a0": 0, "a:z": 0}
    after_b = start | {"b": 1}
    done = after_b | {"a": 2}
    assert [f[0] for f in frames] == [
        "record",
        "caught-up",
        "caught-up",
        "caught-up",
        "record",
        "caught-up",
        "caught-up",
        "caught-up",
        "caught-up",
    ]  # session order: b, B, a.x, a, a-z, a0, a:z
    assert [f[2]["topic"] for f in frames] == ["b", "b", "B", "a.x", "a", "a", "a-z", "a0", "a:z"]
    assert [f[1] for f in frames] == [after_b] * 4 + [done] * 5
    # byte for byte: keys sorted bytewise (B < a < a-z < a.x < a0 < a:z < b), no padding
    raw = [f.id for f in s.parser.frames[2:11]]
    assert raw[-1] == enc_id(done) and "=" not in raw[-1]
    literal = b'{"B":0,"a":2,"a-z":0,"a.x":0,"a0":0,"a:z":0,"b":1}'
    assert raw[-1] == base64.urlsafe_b64encode(literal).decode().rstrip("=")
    await close(s)


# ---- record frames ---------------------------------------------------------------------------

RECORDS = [
    {"data": {"x": 1}, "node": "n1", "tag": "x", "meta": {"m": 1}},
    {"data": [1, "s"]},
    {"data": None, "tag": "y"},
    {"data": "plain", "meta": {"k": "v"}, "node": "n2"},
]


def expected_records(ts: int, *, meta: bool, tags: bool, data: bool) -> list[dict]:
    out = []
    for i, r in enumerate(RECORDS, start=1):
        rec = {"$seq": i, "$ts": ts}
        if "node" in r:
            rec["$node"] = r["node"]
        if tags and "tag" in r:
            rec["$tag"] = r["tag"]
        if meta and "meta" in r:
            rec["meta"] = r["meta"]
        if data:
            rec["data"] = r["data"]
        out.append(rec)
    return out


@pytest.mark.parametrize(
    ("flags", "meta", "tags", "data"),
    [
        ({}, True, False, True),  # defaults: include_meta true, include_tags false
        ({"include_meta": False}, False, False, True),
        ({"include_tags": True}, True, True, True),
        ({"include_data": False}, True, False, False),
        ({"include_meta": False, "include_tags": True, "include_data": False}, False, True, False),
        ({"include_meta": True, "include_tags": True, "include_data": True}, True, True, True),
    ],
)
async def test_record_frame_shape_and_projection(
    autojump_clock, harness, client, nursery, flags, meta, tags, data
):
    ts = harness.clock.now_ms()
    await write(client, "a", RECORDS)
    wid = await wid_of(client, {"topics": {"a": {}}, **flags})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 2)
    assert frames == [
        (
            "record",
            {"a": 4},
            {
                "topic": "a",
                "records": expected_records(ts, meta=meta, tags=tags, data=data),
                "from_seq": 0,
                "to_seq": 4,
                "head_seq": 4,
            },
        ),
        caught_up("a", 4, {"a": 4}),
    ]
    # the same projection as a diff read with the same flags (api-topics §7.3)
    if data:
        d = await diff(client, "a", include_meta=meta, include_tags=tags, from_seq=0)
        assert frames[0][2]["records"] == d["records"]
    await close(s)


async def test_live_record_frame_after_caught_up(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 2)
    await put_topic(client, "b")
    wid = await wid_of(client, {"topics": {"a": {}, "b": {}}})
    s = await open_ok(harness, nursery, wid)
    assert [f[0] for f in await read(s, 3)] == ["record", "caught-up", "caught-up"]
    ts = harness.clock.now_ms()
    await write(client, "b", [{"data": "B1"}])
    await write(client, "a", [{"data": "A3"}, {"data": "A4"}])
    assert await read(s, 2) == [
        (
            "record",
            {"a": 2, "b": 1},
            {
                "topic": "b",
                "records": [{"$seq": 1, "$ts": ts, "data": "B1"}],
                "from_seq": 0,
                "to_seq": 1,
                "head_seq": 1,
            },
        ),
        (
            "record",
            {"a": 4, "b": 1},
            {
                "topic": "a",
                "records": [
                    {"$seq": 3, "$ts": ts, "data": "A3"},
                    {"$seq": 4, "$ts": ts, "data": "A4"},
                ],
                "from_seq": 2,
                "to_seq": 4,
                "head_seq": 4,
            },
        ),
    ]
    await close(s)


async def test_caught_up_once_per_topic_after_backlog(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 5)
    await write_n(client, "b", 1)
    wid = await wid_of(client, {"topics": {"a": {}, "b": {}}, "limit": 2})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 6)
    assert [(f[0], f[2]["topic"]) for f in frames] == [
        ("record", "a"),
        ("record", "a"),
        ("record", "a"),
        ("caught-up", "a"),
        ("record", "b"),
        ("caught-up", "b"),
    ]
    assert frames[3] == caught_up("a", 5, {"a": 5, "b": 0})
    assert frames[5] == caught_up("b", 1, {"a": 5, "b": 1})
    await quiet(s, 10)  # nothing more (the default heartbeat is 15 s)
    await close(s)


async def test_live_records_do_not_repeat_caught_up(autojump_clock, harness, client, nursery):
    await put_topic(client, "a")
    wid = await wid_of(client, {"topics": {"a": {}}, "heartbeat_ms": 1000})
    s = await open_ok(harness, nursery, wid)
    assert await read(s, 1) == [caught_up("a", 0, {"a": 0})]
    await write_n(client, "a", 1)
    frames = await read(s, 2, within=2)
    assert frames[0][0] == "record" and frames[0][1] == {"a": 1}
    assert frames[1] == ("hb", None, None)
    await close(s)


# ---- batching ---------------------------------------------------------------------------------


async def test_limit_splits_batches(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 5)
    wid = await wid_of(client, {"topics": {"a": {}}, "limit": 2})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 4)
    assert [seqs(f) for f in frames[:3]] == [[1, 2], [3, 4], [5]]
    assert [bounds(f) for f in frames[:3]] == [(0, 2, 5), (2, 4, 5), (4, 5, 5)]
    assert [f[1] for f in frames] == [{"a": 2}, {"a": 4}, {"a": 5}, {"a": 5}]
    assert frames[3] == caught_up("a", 5, {"a": 5})
    await close(s)


@pytest.mark.parametrize(
    ("limit", "written", "sizes"),
    [
        (None, 300, [256, 44]),  # default 256
        (0, 300, [256, 44]),  # 0 ⇒ 256
        (1000, 1200, [1000, 200]),
        (5000, 1200, [1000, 200]),  # clamped to 1000
        (2**32 - 1, 1200, [1000, 200]),
    ],
)
async def test_limit_default_zero_and_clamp(
    autojump_clock, harness, client, nursery, limit, written, sizes
):
    await write_n(client, "a", written)
    body = {"topics": {"a": {}}}
    if limit is not None:
        body["limit"] = limit
    wid = await wid_of(client, body)
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, len(sizes) + 1)
    assert [len(seqs(f)) for f in frames[:-1]] == sizes
    assert frames[-1] == caught_up("a", written, {"a": written})
    await close(s)


def blob(size: int) -> str:
    """A string whose JSON text (with its quotes) is exactly `size` bytes."""
    return "x" * (size - 2)


@pytest.mark.parametrize(
    ("max_batch_bytes", "record_bytes", "n", "sizes"),
    [
        (2500, 1000, 5, [2, 2, 1]),
        (1, 1000, 3, [1, 1, 1]),  # at least one record per frame, always
        (None, 100_000, 5, [2, 2, 1]),  # watch default 262144
        (0, 100_000, 12, [10, 2]),  # 0 ⇒ 1 MiB
        (2**40, 1_000_000, 9, [8, 1]),  # clamped to 8 MiB
    ],
)
async def test_max_batch_bytes(
    autojump_clock, harness, client, nursery, max_batch_bytes, record_bytes, n, sizes
):
    for _ in range(n):
        await write(client, "a", [{"data": blob(record_bytes)}])
    body = {"topics": {"a": {}}}
    if max_batch_bytes is not None:
        body["max_batch_bytes"] = max_batch_bytes
    wid = await wid_of(client, body)
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, len(sizes) + 1)
    assert [len(seqs(f)) for f in frames[:-1]] == sizes
    ends_at = 0
    for f in frames[:-1]:
        assert f[2]["from_seq"] == ends_at
        ends_at = f[2]["to_seq"]
        assert f[1] == {"a": ends_at}
    assert frames[-1] == caught_up("a", n, {"a": n})
    await close(s)


# ---- node filter (api-topics §9) ----------------------------------------------------------------

NODE_RECORDS = [
    {"data": 1, "node": "n1"},
    {"data": 2, "node": "n2"},
    {"data": 3},
    {"data": 4, "node": "n1"},
    {"data": 5, "node": "N1"},
]


@pytest.mark.parametrize(
    ("node", "delivered"),
    [
        ("n1", [2, 3, 5]),  # byte-exact: "N1" is another node
        (["n1", "n2"], [3, 5]),
        ([], [1, 2, 3, 4, 5]),
        ("n3", [1, 2, 3, 4, 5]),
    ],
)
async def test_node_filter_skips_that_nodes_records(
    autojump_clock, harness, client, nursery, node, delivered
):
    await write(client, "a", NODE_RECORDS)
    wid = await wid_of(client, {"topics": {"a": {}}, "node": node})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 2)
    assert seqs(frames[0]) == delivered
    assert bounds(frames[0]) == (0, 5, 5)  # to_seq counts the skipped seqs
    assert frames[1] == caught_up("a", 5, {"a": 5})
    await close(s)


async def test_node_filter_off_when_topic_dedupe_node_false(
    autojump_clock, harness, client, nursery
):
    await put_topic(client, "a", {"dedupe_node": False})
    await write(client, "a", NODE_RECORDS)
    wid = await wid_of(client, {"topics": {"a": {}}, "node": ["n1", "n2"]})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 2)
    assert seqs(frames[0]) == [1, 2, 3, 4, 5]
    await write(client, "a", [{"data": 6, "node": "n1"}])
    assert seqs((await read(s, 1))[0]) == [6]
    await close(s)


async def test_skip_only_pass_sends_nothing_but_moves_the_cursor(
    autojump_clock, harness, client, nursery
):
    await write(client, "a", [{"data": 1, "node": "me"}, {"data": 2, "node": "me"}])
    wid = await wid_of(client, {"topics": {"a": {}}, "node": "me", "heartbeat_ms": 1000})
    s = await open_ok(harness, nursery, wid)
    # backlog entirely filtered: no record frame, but the cursor (and the id) moved
    assert await read(s, 1) == [caught_up("a", 2, {"a": 2})]
    await write(client, "a", [{"data": 3, "node": "me"}])
    assert await read(s, 1, within=1.5) == [("hb", None, None)]  # skip-only: no frame
    await write(client, "a", [{"data": 4, "node": "you"}])
    frames = await read(s, 1)
    assert seqs(frames[0]) == [4]
    assert bounds(frames[0]) == (3, 4, 4)
    assert frames[0][1] == {"a": 4}
    await close(s)


async def test_skip_only_deleted_backlog_sends_only_caught_up(
    autojump_clock, harness, client, nursery
):
    await write_n(client, "a", 5)
    await write(client, "a", [{"data": 6, "tag": "del"}, {"data": 7, "tag": "del"}])
    r = await client.post("/v0/topics/a/delete", json={"match": "del"})
    assert (await ok_json(r))["deleted"] == 2
    wid = await wid_of(client, {"topics": {"a": {"from_seq": 5}}})
    s = await open_ok(harness, nursery, wid)
    assert await read(s, 1) == [caught_up("a", 7, {"a": 7})]
    await write_n(client, "a", 1)
    frames = await read(s, 1)
    assert seqs(frames[0]) == [8] and bounds(frames[0]) == (7, 8, 8)
    await close(s)


# ---- tombstones -------------------------------------------------------------------------------


@pytest.mark.parametrize(("from_seq", "gap_from"), [(2, 3), (0, 1), (4, 5)])
async def test_tombstone_on_first_read_is_from_seq_too_old(
    autojump_clock, harness, client, nursery, from_seq, gap_from
):
    await put_topic(client, "a", {"cap_records": 5})
    await write_n(client, "a", 10)  # evicts 1..5: evict_floor = earliest_seq = 6
    assert (await state(client, "a"))["earliest_seq"] == 6
    await put_topic(client, "b")
    wid = await wid_of(client, {"topics": {"a": {"from_seq": from_seq}, "b": {}}})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 4)
    assert frames[0] == (
        "tombstone",
        {"a": 5, "b": 0},
        {
            "topic": "a",
            "reason": "from_seq_too_old",
            "gap_from": gap_from,
            "gap_to": 5,
            "earliest_seq": 6,
            "head_seq": 10,
        },
    )
    assert seqs(frames[1]) == [6, 7, 8, 9, 10]
    assert bounds(frames[1]) == (5, 10, 10)
    assert frames[1][1] == {"a": 10, "b": 0}
    assert frames[2] == caught_up("a", 10, {"a": 10, "b": 0})
    assert frames[3] == caught_up("b", 0, {"a": 10, "b": 0})
    await close(s)


async def test_no_tombstone_when_cursor_is_at_evict_floor(autojump_clock, harness, client, nursery):
    await put_topic(client, "a", {"cap_records": 5})
    await write_n(client, "a", 10)
    wid = await wid_of(client, {"topics": {"a": {"from_seq": 5}}})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 2)
    assert frames[0][0] == "record" and bounds(frames[0]) == (5, 10, 10)
    await close(s)


async def test_deleted_gap_gets_no_tombstone(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 10)
    r = await client.post("/v0/topics/a/delete", json={"before_seq": 6})
    assert (await ok_json(r))["deleted"] == 5
    wid = await wid_of(client, {"topics": {"a": {"from_seq": 2}}})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 2)
    assert seqs(frames[0]) == [6, 7, 8, 9, 10]
    assert bounds(frames[0]) == (2, 10, 10)
    assert frames[1] == caught_up("a", 10, {"a": 10})
    await close(s)


async def test_tombstone_earliest_is_evict_floor_when_deletes_follow(
    autojump_clock, harness, client, nursery
):
    await put_topic(client, "a", {"cap_records": 8})
    await write_n(client, "a", 10)  # cap evicts 1, 2: evict_floor 3
    r = await client.post("/v0/topics/a/delete", json={"before_seq": 5})  # deletes 3, 4
    assert (await ok_json(r))["deleted"] == 2
    wid = await wid_of(client, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 3)
    assert frames[0] == (
        "tombstone",
        {"a": 2},
        {
            "topic": "a",
            "reason": "from_seq_too_old",
            "gap_from": 1,
            "gap_to": 2,
            "earliest_seq": 3,
            "head_seq": 10,
        },
    )
    assert seqs(frames[1]) == [5, 6, 7, 8, 9, 10]
    assert bounds(frames[1]) == (2, 10, 10)
    assert frames[2] == caught_up("a", 10, {"a": 10})
    await close(s)


async def test_cursor_above_head_gets_recreated_range(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 3)
    wid = await wid_of(client, {"topics": {"a": {"from_seq": 7}}})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 3)
    # api-topics §8.4: gap 1..head, reading restarts at earliest_seq; first read ⇒ reason
    # from_seq_too_old. The records frame then starts at earliest_seq - 1 = 0, so the
    # tombstone's id must already say 0 (an id of 3 would skip records on resume).
    assert frames[0] == (
        "tombstone",
        {"a": 0},
        {
            "topic": "a",
            "reason": "from_seq_too_old",
            "gap_from": 1,
            "gap_to": 3,
            "earliest_seq": 1,
            "head_seq": 3,
        },
    )
    assert seqs(frames[1]) == [1, 2, 3] and bounds(frames[1]) == (0, 3, 3)
    assert frames[2] == caught_up("a", 3, {"a": 3})
    await close(s)


async def test_cap_eviction_past_a_live_cursor_is_a_cap_tombstone(
    autojump_clock, harness, client, nursery
):
    await put_topic(client, "a", {"cap_records": 5})
    await write_n(client, "a", 2)
    wid = await wid_of(client, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid)
    assert [f[0] for f in await read(s, 2)] == ["record", "caught-up"]
    await write_n(client, "a", 9)  # seqs 3..11; cap 5 evicts 1..6, 3..6 unseen
    frames = await read(s, 3)
    assert frames[0] == (
        "tombstone",
        {"a": 6},
        {
            "topic": "a",
            "reason": "cap",
            "gap_from": 3,
            "gap_to": 6,
            "earliest_seq": 7,
            "head_seq": 11,
        },
    )
    assert seqs(frames[1]) == [7, 8, 9, 10, 11] and bounds(frames[1]) == (6, 11, 11)
    assert frames[2] == caught_up("a", 11, {"a": 11})  # again after a tombstone
    await close(s)


async def test_reopen_first_read_tombstone_is_from_seq_too_old_again(
    autojump_clock, harness, client, nursery
):
    await put_topic(client, "a", {"cap_records": 3})
    await write_n(client, "a", 2)
    wid = await wid_of(client, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid)
    assert [f[0] for f in await read(s, 2)] == ["record", "caught-up"]
    await close(s)
    await write_n(client, "a", 6)  # seqs 3..8, cap 3 keeps 6..8
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 3)
    assert frames[0] == (
        "tombstone",
        {"a": 5},
        {
            "topic": "a",
            "reason": "from_seq_too_old",
            "gap_from": 3,
            "gap_to": 5,
            "earliest_seq": 6,
            "head_seq": 8,
        },
    )
    assert seqs(frames[1]) == [6, 7, 8] and bounds(frames[1]) == (5, 8, 8)
    assert frames[2] == caught_up("a", 8, {"a": 8})
    await close(s)


@pytest.mark.parametrize("expire_before_post", [True, False])
async def test_expired_records_at_open_are_a_tombstone_not_records(
    autojump_clock, harness, client, nursery, expire_before_post
):
    # README §10: with ttl_ms > 0 a record is expired once now - $ts > ttl_ms; reads skip
    # it and a reader whose cursor it crosses gets a tombstone (first read: from_seq_too_old)
    await put_topic(client, "a", {"ttl_ms": 5000})
    await write_n(client, "a", 3)
    if expire_before_post:
        harness.clock.jump(5001)
    wid = await wid_of(client, {"topics": {"a": {}}})
    if not expire_before_post:
        harness.clock.jump(5001)
    s = await open_ok(harness, nursery, wid)
    assert await read(s, 2) == [
        (
            "tombstone",
            {"a": 3},
            {
                "topic": "a",
                "reason": "from_seq_too_old",
                "gap_from": 1,
                "gap_to": 3,
                "earliest_seq": 4,
                "head_seq": 3,
            },
        ),
        caught_up("a", 3, {"a": 3}),
    ]
    await close(s)


async def test_ttl_expiry_while_lagging_is_a_ttl_tombstone(autojump_clock, nursery):
    # §2.7: a connection whose channel filled is lagged; it catches up from its own cursor
    # and whatever TTL removed meanwhile arrives as a tombstone with the exact range.
    async with open_app(make_config(sse={"channel_frames": 1})) as h:
        client = h.app.test_client()
        await put_topic(client, "a", {"ttl_ms": 5000})
        wid = await wid_of(client, {"topics": {"a": {}}})
        s = await open_ok(h, nursery, wid)
        assert await read(s, 1) == [caught_up("a", 0, {"a": 0})]
        # the client stops reading: 1 is in the socket write, 2 in the channel, 3 lags
        for i in (1, 2, 3):
            await write(client, "a", [{"data": i}])
            await trio.testing.wait_all_tasks_blocked()
        h.clock.jump(10_000)  # wall time only: 1..3 are now expired
        frames = await read(s, 4)
        assert seqs(frames[0]) == [1] and bounds(frames[0]) == (0, 1, 1)
        assert seqs(frames[1]) == [2] and bounds(frames[1]) == (1, 2, 2)
        assert frames[2] == (
            "tombstone",
            {"a": 3},
            {
                "topic": "a",
                "reason": "ttl",
                "gap_from": 3,
                "gap_to": 3,
                "earliest_seq": 4,
                "head_seq": 3,
            },
        )
        assert frames[3] == caught_up("a", 3, {"a": 3})
        await close(s)


async def test_lagging_client_loses_nothing_silently(autojump_clock, nursery):
    async with open_app(make_config(sse={"channel_frames": 2})) as h:
        client = h.app.test_client()
        await put_topic(client, "a", {"cap_records": 10})
        wid = await wid_of(client, {"topics": {"a": {}}, "limit": 3})
        s = await open_ok(h, nursery, wid)
        assert await read(s, 1) == [caught_up("a", 0, {"a": 0})]
        for _ in range(12):  # the client is not reading
            await write_n(client, "a", 4)
            await trio.testing.wait_all_tasks_blocked()
        frames = await read_until_event(s, "caught-up", within=10)
        cursor = 0
        seen: list[int] = []
        gaps: list[tuple[int, int]] = []
        for event, id_, data in frames:
            if event == "record":
                assert data["from_seq"] == cursor, (cursor, data)
                assert all(cursor < q <= data["to_seq"] for q in seqs((event, id_, data)))
                seen += seqs((event, id_, data))
                cursor = data["to_seq"]
            elif event == "tombstone":
                assert data["reason"] == "cap"
                assert data["gap_from"] == cursor + 1
                assert data["earliest_seq"] == data["gap_to"] + 1
                gaps.append((data["gap_from"], data["gap_to"]))
                cursor = data["gap_to"]
            else:
                assert event == "caught-up"
            assert id_ == {"a": cursor}
        assert cursor == 48
        assert gaps, "the cap evicted records the client had not read: a tombstone is due"
        covered = sorted(seen + [q for a, b in gaps for q in range(a, b + 1)])
        assert covered == list(range(1, 49))  # every seq delivered or announced, once
        assert seen[-10:] == list(range(39, 49))
        await close(s)


# ---- topic-deleted ------------------------------------------------------------------------------


async def test_topic_deleted_while_watched_then_stream_ends(
    autojump_clock, harness, client, nursery
):
    await write_n(client, "a", 3)
    wid = await wid_of(client, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid)
    assert [f[0] for f in await read(s, 2)] == ["record", "caught-up"]
    await delete_topic(client, "a")
    assert await read(s, 1) == [
        ("topic-deleted", {"a": 3}, {"topic": "a", "head_seq": 0, "reason": "deleted"})
    ]
    await ends(s)


async def test_topic_deleted_is_per_topic(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 2)
    await write_n(client, "b", 1)
    wid = await wid_of(client, {"topics": {"a": {}, "b": {}}})
    s = await open_ok(harness, nursery, wid)
    assert len(await read(s, 4)) == 4
    await delete_topic(client, "a")
    assert await read(s, 1) == [
        ("topic-deleted", {"a": 2, "b": 1}, {"topic": "a", "head_seq": 0, "reason": "deleted"})
    ]
    await write_n(client, "a", 5)  # a new instance of "a": terminal for this session
    await write_n(client, "b", 1)
    frames = await read(s, 1)
    assert frames[0][0] == "record" and frames[0][2]["topic"] == "b"
    assert frames[0][1] == {"a": 2, "b": 2}
    await quiet(s, 10)
    await delete_topic(client, "b")
    assert await read(s, 1) == [
        ("topic-deleted", {"a": 2, "b": 2}, {"topic": "b", "head_seq": 0, "reason": "deleted"})
    ]
    await ends(s)


async def test_topic_already_gone_at_stream_open(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 2)
    await write_n(client, "b", 1)
    wid = await wid_of(client, {"topics": {"a": {}, "b": {}}})
    await delete_topic(client, "a")
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 3)
    assert frames[0] == (
        "topic-deleted",
        {"a": 0, "b": 0},
        {"topic": "a", "head_seq": 0, "reason": "deleted"},
    )
    assert seqs(frames[1]) == [1] and frames[1][1] == {"a": 0, "b": 1}
    assert frames[2] == caught_up("b", 1, {"a": 0, "b": 1})
    await close(s)
    # a later open announces it again
    s = await open_ok(harness, nursery, wid)
    assert await read(s, 2) == [
        ("topic-deleted", {"a": 0, "b": 1}, {"topic": "a", "head_seq": 0, "reason": "deleted"}),
        caught_up("b", 1, {"a": 0, "b": 1}),
    ]
    await close(s)


async def test_every_topic_gone_at_open_ends_the_stream(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 1)
    await write_n(client, "b", 1)
    wid = await wid_of(client, {"topics": {"a": {}, "b": {"tail": True}}})
    await delete_topic(client, "b")
    await delete_topic(client, "a")
    s = await open_ok(harness, nursery, wid)
    assert await read(s, 2) == [
        ("topic-deleted", {"a": 0, "b": 1}, {"topic": "a", "head_seq": 0, "reason": "deleted"}),
        ("topic-deleted", {"a": 0, "b": 1}, {"topic": "b", "head_seq": 0, "reason": "deleted"}),
    ]
    await ends(s)


# ---- heartbeats ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heartbeat_ms", "period"),
    [
        (None, 15.0),
        (1000, 1.0),
        (2500, 2.5),
        (10, 1.0),
        (0, 1.0),
        (60000, 60.0),
        (120000, 60.0),
        (2**64 - 1, 60.0),
    ],
)
async def test_heartbeat_period_and_clamp(
    autojump_clock, harness, client, nursery, heartbeat_ms, period
):
    await put_topic(client, "a")
    body = {"topics": {"a": {}}}
    if heartbeat_ms is not None:
        body["heartbeat_ms"] = heartbeat_ms
    wid = await wid_of(client, body)
    s = await open_ok(harness, nursery, wid)
    assert await read(s, 1) == [caught_up("a", 0, {"a": 0})]
    last = trio.current_time()
    for _ in range(3):
        assert await read(s, 1, within=period + 1) == [("hb", None, None)]
        now = trio.current_time()
        assert now - last == pytest.approx(period, abs=1e-6)
        last = now
    assert all(f.id is None for f in s.parser.frames if f.heartbeat)
    await close(s)


async def test_heartbeat_counts_silence_from_the_last_frame(
    harness, client, nursery, autojump_clock
):
    await put_topic(client, "a")
    wid = await wid_of(client, {"topics": {"a": {}}, "heartbeat_ms": 1000})
    s = await open_ok(harness, nursery, wid)
    assert await read(s, 1) == [caught_up("a", 0, {"a": 0})]
    t0 = trio.current_time()
    autojump_clock.jump(0.6)
    await write_n(client, "a", 1)
    assert (await read(s, 1))[0][0] == "record"
    assert trio.current_time() - t0 == pytest.approx(0.6, abs=1e-6)
    assert await read(s, 1, within=2) == [("hb", None, None)]
    assert trio.current_time() - t0 == pytest.approx(1.6, abs=1e-6)
    # ids continue across heartbeats
    await write_n(client, "a", 1)
    frames = await read(s, 1)
    assert frames[0][1] == {"a": 2} and bounds(frames[0]) == (1, 2, 2)
    await close(s)


# ---- graceful shutdown ---------------------------------------------------------------------------


async def test_shutdown_sends_server_shutting_down_with_the_cursor_map(
    autojump_clock, harness, client, nursery
):
    await write_n(client, "a", 3)
    await put_topic(client, "b")
    w1 = await wid_of(client, {"topics": {"a": {}, "b": {}}})
    w2 = await wid_of(client, {"topics": {"b": {}, "a": {"tail": True}}})
    s1 = await open_ok(harness, nursery, w1)
    s2 = await open_ok(harness, nursery, w2)
    assert len(await read(s1, 3)) == 3
    assert len(await read(s2, 2)) == 2
    harness.engine.begin_drain()
    for s, cursors in ((s1, {"a": 3, "b": 0}), (s2, {"a": 3, "b": 0})):
        frames = await read(s, 1)
        event, id_, data = frames[0]
        assert event == "error"
        assert id_ == cursors
        assert set(data) == {"code", "error", "message"}
        assert data["code"] == "server_shutting_down"
        assert data["error"] == data["message"] and isinstance(data["message"], str)
        await ends(s)


async def test_shutdown_id_reflects_frames_written_before_it(
    autojump_clock, harness, client, nursery
):
    await write_n(client, "a", 5)
    wid = await wid_of(client, {"topics": {"a": {}}, "limit": 2})
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 4)
    assert frames[-1] == caught_up("a", 5, {"a": 5})
    await write_n(client, "a", 1)
    assert (await read(s, 1))[0][1] == {"a": 6}
    harness.engine.begin_drain()
    frames = await read(s, 1)
    assert frames[0][0] == "error" and frames[0][1] == {"a": 6}
    assert frames[0][2]["code"] == "server_shutting_down"
    await ends(s)


async def test_create_session_returns_all_topics_in_id_even_if_untouched(
    autojump_clock, harness, client, nursery
):
    await write_n(client, "a", 1)
    await write_n(client, "z", 4)
    body = await create(client, {"topics": {"z": {"tail": True}, "a": {}}})
    s = await open_ok(harness, nursery, body["wid"])
    frames = await read(s, 3)
    assert frames == [
        caught_up("z", 4, {"a": 0, "z": 4}),
        frames[1],
        caught_up("a", 1, {"a": 1, "z": 4}),
    ]
    assert seqs(frames[1]) == [1] and frames[1][1] == {"a": 1, "z": 4}
    await close(s)
