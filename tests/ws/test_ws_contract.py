"""The WebSocket data plane `/v0/ws`: every command and message shape, errors, auth, caps.

Method: in-process. The server side of `/v0/ws` (`topicd.http.ws`, behind the gate's
admission) runs on an in-memory stream pair in the test's nursery
(`topicd.testing.ws.open_ws_in_process`), with wsproto as the client, on `MockClock`
(autojump). Writes go through the HTTP app or the WebSocket's own `publish`; frames
arrive through the topics' drains exactly as on a socket. Exact key sets are asserted
so a renamed or missing field fails.
"""

from __future__ import annotations

import json

import pytest
from wsproto.events import BytesMessage, Ping

from topicd.testing.harness import make_config, open_app
from topicd.testing.ws import WsClosed, open_ws_in_process

RECORD_KEYS = {"op", "topic", "records", "from_seq", "to_seq", "head_seq"}
ACK_KEYS = {
    "op",
    "request_id",
    "topic",
    "first_seq",
    "last_seq",
    "seqs",
    "head_seq",
    "count",
    "created",
    "deduped",
    "performance",
}


def seqs_of(msgs: list[dict], topic: str) -> list[int]:
    """Record seqs for `topic`, checking the cursor chain (`from_seq` = previous `to_seq`)."""
    out: list[int] = []
    pos = None
    for m in msgs:
        if m.get("topic") != topic:
            continue
        if m["op"] == "record":
            if pos is not None:
                assert m["from_seq"] == pos, (m, pos)
            pos = m["to_seq"]
            out.extend(r["$seq"] for r in m["records"])
        elif m["op"] == "tombstone":
            pos = m["gap_to"]
    return out


async def write(h, topic: str, *values: object) -> None:
    r = await h.app.test_client().post(
        f"/v0/topics/{topic}", json={"records": [{"data": v} for v in values]}
    )
    assert r.status_code in (200, 201), await r.get_data()


@pytest.fixture
async def h(autojump_clock):
    async with open_app() as harness:
        await harness.app.test_client().put("/v0/topics/t", json={})
        yield harness


async def test_subscribe_replies_subscribed_then_records_then_caught_up(h, nursery):
    await write(h, "t", 1, 2, 3)
    ws = await open_ws_in_process(nursery, h.app)
    assert ws.status == 101
    await ws.send({"op": "subscribe", "request_id": "s-1", "topic": "t"})
    msgs = await ws.recv_until(lambda m: m["op"] == "caught_up")
    assert msgs[0] == {
        "op": "subscribed",
        "request_id": "s-1",
        "topics": {"t": {"from_seq": 0, "head_seq": 3, "earliest_seq": 1}},
    }
    assert set(msgs[1]) == RECORD_KEYS
    assert msgs[1]["op"] == "record"
    assert (msgs[1]["from_seq"], msgs[1]["to_seq"], msgs[1]["head_seq"]) == (0, 3, 3)
    assert [r["data"] for r in msgs[1]["records"]] == [1, 2, 3]
    assert set(msgs[1]["records"][0]) == {"$seq", "$ts", "data"}
    assert msgs[-1] == {"op": "caught_up", "topic": "t", "head_seq": 3}
    # live: a later write arrives as one record frame continuing the chain
    await write(h, "t", 4)
    live = await ws.recv()
    assert live["op"] == "record"
    assert (live["from_seq"], live["to_seq"]) == (3, 4)
    assert [r["$seq"] for r in live["records"]] == [4]


async def test_from_seq_resumes_after_the_cursor_and_tail_starts_at_the_head(h, nursery):
    await h.app.test_client().put("/v0/topics/u", json={})
    await write(h, "t", *range(10))
    await write(h, "u", "a", "b")
    ws = await open_ws_in_process(nursery, h.app)
    await ws.send(
        {"op": "subscribe", "request_id": 1, "topics": {"t": {"from_seq": 7}, "u": {"tail": True}}}
    )
    first = await ws.recv()
    assert first["topics"] == {
        "t": {"from_seq": 7, "head_seq": 10, "earliest_seq": 1},
        "u": {"from_seq": 2, "head_seq": 2, "earliest_seq": 1},
    }
    msgs = await ws.recv_until(lambda m: m["op"] == "caught_up" and m["topic"] == "u")
    assert seqs_of(msgs, "t") == [8, 9, 10]
    assert seqs_of(msgs, "u") == []
    await write(h, "u", "c")
    msgs = await ws.recv_until(lambda m: m["op"] == "record" and m["topic"] == "u")
    assert seqs_of(msgs, "u") == [3]
    # top-level from_seq with `topic`
    ws2 = await open_ws_in_process(nursery, h.app)
    await ws2.send({"op": "subscribe", "topic": "t", "from_seq": 9, "limit": 1})
    msgs = await ws2.recv_until(lambda m: m["op"] == "caught_up")
    assert msgs[0]["request_id"] is None
    assert [m["to_seq"] for m in msgs if m["op"] == "record"] == [10]


async def test_limit_and_projection_options_shape_the_frames(h, nursery):
    c = h.app.test_client()
    await c.post(
        "/v0/topics/t",
        json={"records": [{"data": i, "tag": f"g{i}", "meta": {"m": i}} for i in range(5)]},
    )
    ws = await open_ws_in_process(nursery, h.app)
    await ws.send(
        {
            "op": "subscribe",
            "topic": "t",
            "limit": 2,
            "include_data": False,
            "include_tags": True,
            "include_meta": False,
        }
    )
    msgs = await ws.recv_until(lambda m: m["op"] == "caught_up")
    frames = [m for m in msgs if m["op"] == "record"]
    assert [len(f["records"]) for f in frames] == [2, 2, 1]
    assert set(frames[0]["records"][0]) == {"$seq", "$ts", "$tag"}


async def test_publish_acks_with_the_http_write_fields(h, nursery):
    ws = await open_ws_in_process(nursery, h.app)
    # (raw text: the number literal 1.10 must survive as written)
    await ws.send(
        '{"op": "publish", "request_id": "p-1", "topic": "t", "node": "n1",'
        ' "records": [{"data": {"text": "on my way", "n": 1.10}, "tag": "msg-77"}]}'
    )
    ack = await ws.recv()
    assert set(ack) == ACK_KEYS
    assert ack["op"] == "ack"
    assert (ack["topic"], ack["first_seq"], ack["last_seq"], ack["seqs"]) == ("t", 1, 1, [1])
    assert (ack["head_seq"], ack["count"], ack["created"], ack["deduped"]) == (1, 1, False, False)
    assert "server_total_ms" in ack["performance"]
    # stored exactly as written (the one write implementation keeps literals)
    r = await h.app.test_client().post("/v0/topics/t/diff", json={"include_tags": True})
    body = await r.get_data()
    assert b'"data":{"text":"on my way","n":1.10}' in body
    assert b'"$tag":"msg-77"' in body
    ack = await ws.request_reply(
        {
            "op": "publish",
            "request_id": 2,
            "topic": "t",
            "records": [{"data": 0}],
            "return_seqs": False,
        }
    )
    assert ack["seqs"] is None
    assert (ack["first_seq"], ack["last_seq"]) == (2, 2)
    # idempotency key: the retry is deduped
    body = {"op": "publish", "request_id": 3, "topic": "t", "idempotency_key": "k1"}
    first = await ws.request_reply({**body, "records": [{"data": 1}]})
    again = await ws.request_reply({**body, "records": [{"data": 1}]})
    assert (first["deduped"], again["deduped"]) == (False, True)
    assert again["first_seq"] == first["first_seq"]
    # auto-create with a config (dev mode: admin)
    created = await ws.request_reply(
        {
            "op": "publish",
            "request_id": 4,
            "topic": "fresh",
            "config": {"cap_records": 5},
            "records": [{"data": 1}],
        }
    )
    assert created["created"] is True
    r = await h.app.test_client().get("/v0/topics/fresh")
    assert (await r.get_json())["config"]["cap_records"] == 5


async def test_publish_errors_carry_the_http_codes(autojump_clock, nursery):
    cfg = make_config(protocol={"max_batch_records": 2, "max_record_bytes": 64})
    async with open_app(cfg) as h:
        ws = await open_ws_in_process(nursery, h.app)
        cases = [
            ({"topic": "t", "records": [{"data": 1}] * 3}, "batch_too_large"),
            ({"topic": "t", "records": [{"data": "x" * 100}]}, "record_too_large"),
            ({"topic": "t"}, "invalid_request"),
            ({"records": [{"data": 0}]}, "invalid_request"),
            ({"topic": "bad name", "records": [{"data": 0}]}, "invalid_request"),
            ({"topic": "t", "records": "no"}, "invalid_request"),
            ({"topic": "t", "create": False, "records": [{"data": 0}]}, "topic_not_found"),
        ]
        for i, (fields, code) in enumerate(cases):
            reply = await ws.request_reply({"op": "publish", "request_id": i, **fields})
            assert reply["op"] == "error", (fields, reply)
            assert reply["code"] == code, (fields, reply)
            assert reply["request_id"] == i
            assert isinstance(reply["message"], str)
        assert (await ws.request_reply({"op": "ping", "request_id": "alive"}))["op"] == "pong"


async def test_unsubscribe_stops_delivery_and_ignores_unknown_names(h, nursery):
    await h.app.test_client().put("/v0/topics/u", json={})
    ws = await open_ws_in_process(nursery, h.app)
    await ws.send({"op": "subscribe", "topics": {"t": {}, "u": {}}})
    await ws.recv_until(lambda m: m["op"] == "caught_up" and m["topic"] == "u")
    reply = await ws.request_reply(
        {"op": "unsubscribe", "request_id": "u-1", "topics": ["t", "never"]}
    )
    assert reply == {"op": "unsubscribed", "request_id": "u-1", "topics": ["t", "never"]}
    await write(h, "t", "gone")
    await write(h, "u", "kept")
    msgs = await ws.recv_until(lambda m: m["op"] == "record")
    assert [m["topic"] for m in msgs if m["op"] == "record"] == ["u"]
    reply = await ws.request_reply({"op": "unsubscribe", "request_id": 9, "topic": "u"})
    assert reply["topics"] == ["u"]
    err = await ws.request_reply({"op": "unsubscribe", "request_id": 10})
    assert (err["op"], err["code"]) == ("error", "invalid_request")
    assert h.engine.watch.watchers == {}


async def test_resubscribe_replaces_cursor_and_options(h, nursery):
    await write(h, "t", 1, 2, 3)
    ws = await open_ws_in_process(nursery, h.app)
    await ws.send({"op": "subscribe", "topic": "t"})
    await ws.recv_until(lambda m: m["op"] == "caught_up")
    await ws.send({"op": "subscribe", "request_id": "again", "topic": "t", "from_seq": 1})
    msgs = await ws.recv_until(lambda m: m["op"] == "caught_up")
    assert msgs[0]["op"] == "subscribed"
    assert msgs[0]["topics"]["t"]["from_seq"] == 1
    assert seqs_of(msgs, "t") == [2, 3]
    assert len(h.engine.watch.watchers[next(iter(h.engine.watch.watchers))]) == 1


async def test_ping_echoes_any_request_id(h, nursery):
    ws = await open_ws_in_process(nursery, h.app)
    for rid in (5, "x", {"a": [1, None]}, None):
        await ws.send({"op": "ping", "request_id": rid})
        assert await ws.recv() == {"op": "pong", "request_id": rid}
    await ws.send({"op": "ping"})
    assert await ws.recv() == {"op": "pong", "request_id": None}
    # a protocol-level ping gets a protocol pong
    await ws.send_raw_event(Ping(payload=b"hb"))
    await ws.send({"op": "ping", "request_id": 1})
    await ws.recv()
    assert ws.pongs == [b"hb"]


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("not json", "invalid_json"),
        ("[1, 2]", "invalid_json"),
        ('{"request_id": 1}', "invalid_json"),
        ('{"op": 5, "request_id": [1]}', "invalid_json"),
        ('{"op": null, "request_id": "n"}', "invalid_json"),
        ('{"op": "dance", "request_id": 7}', "invalid_json"),
        ('{"op": "subscribe"}', "invalid_request"),
        ('{"op": "subscribe", "topic": "t", "limit": -1}', "invalid_request"),
        ('{"op": "subscribe", "topic": "t", "from_seq": 18446744073709551616}', "invalid_request"),
        ('{"op": "subscribe", "topics": {"bad name": {}}}', "invalid_request"),
        ('{"op": "subscribe", "topic": "missing"}', "topic_not_found"),
        ('{"op": "unsubscribe", "topics": "t"}', "invalid_request"),
    ],
)
async def test_bad_commands_get_error_messages_and_the_socket_stays(h, nursery, text, code):
    ws = await open_ws_in_process(nursery, h.app)
    await ws.send(text)
    err = await ws.recv()
    assert err["op"] == "error"
    assert err["code"] == code
    assert set(err) <= {"op", "request_id", "code", "message", "detail"}
    assert err["request_id"] == (json.loads(text).get("request_id") if text[0] == "{" else None)
    await ws.send({"op": "ping", "request_id": "still"})
    assert await ws.recv() == {"op": "pong", "request_id": "still"}


async def test_a_binary_message_is_unsupported(h, nursery):
    ws = await open_ws_in_process(nursery, h.app)
    await ws.send_raw_event(BytesMessage(data=b'{"op":"ping"}'))
    err = await ws.recv()
    assert (err["op"], err["code"], err["request_id"]) == ("error", "unsupported_message", None)


async def test_lenient_subscribe_leaves_unknown_topics_out(h, nursery):
    ws = await open_ws_in_process(nursery, h.app)
    reply = await ws.request_reply(
        {"op": "subscribe", "request_id": 1, "topics": {"t": {}, "nope": {}}, "lenient": True}
    )
    assert reply["op"] == "subscribed"
    assert list(reply["topics"]) == ["t"]
    err = await ws.request_reply({"op": "subscribe", "request_id": 2, "topic": "nope"})
    assert (err["code"], err["detail"]) == ("topic_not_found", {"topic": "nope"})


async def test_subscriptions_per_connection_are_capped_at_max_watch_topics(autojump_clock, nursery):
    async with open_app(make_config(watch={"max_watch_topics": 2})) as h:
        c = h.app.test_client()
        for name in ("a", "b", "c"):
            await c.put(f"/v0/topics/{name}", json={})
        ws = await open_ws_in_process(nursery, h.app)
        ok = await ws.request_reply({"op": "subscribe", "request_id": 1, "topics": {"a": {}}})
        assert ok["op"] == "subscribed"
        ok = await ws.request_reply(
            {"op": "subscribe", "request_id": 2, "topics": {"a": {}, "b": {}}}
        )
        assert ok["op"] == "subscribed"  # re-subscribing `a` takes no new slot
        err = await ws.request_reply({"op": "subscribe", "request_id": 3, "topic": "c"})
        assert (err["code"], err["detail"]["max"]) == ("invalid_request", 2)


async def test_message_over_max_body_bytes_is_refused(autojump_clock, nursery):
    async with open_app(make_config(limits={"max_body_bytes": 1024})) as h:
        ws = await open_ws_in_process(nursery, h.app)
        await ws.send({"op": "ping", "request_id": "x" * 1100})
        err = await ws.recv()
        assert (err["code"], err["detail"]) == ("payload_too_large", {"max": 1024})
        await ws.send({"op": "ping", "request_id": "x" * 900})
        assert (await ws.recv())["op"] == "pong"


async def test_topic_deleted_ends_the_subscription(h, nursery):
    ws = await open_ws_in_process(nursery, h.app)
    await ws.send({"op": "subscribe", "topic": "t"})
    await ws.recv_until(lambda m: m["op"] == "caught_up")
    r = await h.app.test_client().delete("/v0/topics/t")
    assert r.status_code == 200
    msg = await ws.recv()
    assert msg == {"op": "topic_deleted", "topic": "t", "head_seq": 0, "reason": "deleted"}
    # the subscription is gone: a new topic of the same name is not delivered
    await write(h, "t", 1)
    reply = await ws.request_reply({"op": "ping", "request_id": 1})
    assert reply["op"] == "pong"
    assert h.engine.watch.watchers == {}


async def test_a_tombstone_reports_cap_eviction_with_its_own_reason(h, nursery):
    await h.app.test_client().put("/v0/topics/capped", json={"cap_records": 3})
    await write(h, "capped", *range(10))
    ws = await open_ws_in_process(nursery, h.app)
    await ws.send({"op": "subscribe", "topic": "capped"})
    msgs = await ws.recv_until(lambda m: m["op"] == "caught_up")
    tomb = next(m for m in msgs if m["op"] == "tombstone")
    assert tomb == {
        "op": "tombstone",
        "topic": "capped",
        "reason": "cap",  # never from_seq_too_old on the WebSocket
        "gap_from": 1,
        "gap_to": 7,
        "earliest_seq": 8,
        "head_seq": 10,
    }
    assert seqs_of(msgs, "capped") == [8, 9, 10]


async def test_client_close_is_answered_and_frees_the_slot(h, nursery):
    ws = await open_ws_in_process(nursery, h.app)
    await ws.send({"op": "subscribe", "topic": "t"})
    await ws.recv_until(lambda m: m["op"] == "caught_up")
    assert h.engine.watch.sse_connections() == 1
    await ws.close(1000)
    with pytest.raises(WsClosed) as closed:
        await ws.recv()
    assert closed.value.code == 1000
    await ws.aclose()
    assert h.engine.watch.sse_connections() == 0
    assert h.engine.watch.ws_conns == {}
    assert h.engine.watch.watchers == {}
    assert h.lifecycle.inflight == 0


async def test_a_bug_in_a_command_is_an_internal_error_message(h, nursery, monkeypatch, caplog):
    from topicd.http import ws as ws_module

    def broken(*_args, **_kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(ws_module.WsEndpoint, "unsubscribe", broken)
    ws = await open_ws_in_process(nursery, h.app)
    err = await ws.request_reply({"op": "unsubscribe", "request_id": 1, "topic": "t"})
    assert (err["op"], err["code"]) == ("error", "internal")
    assert "unhandled error in a /v0/ws unsubscribe command" in caplog.text
    assert (await ws.request_reply({"op": "ping", "request_id": 2}))["op"] == "pong"


async def test_a_command_sent_right_behind_the_handshake_is_not_lost(h, nursery):
    import trio
    import trio.testing
    from wsproto.frame_protocol import FrameProtocol

    from topicd.http.app import gate_of
    from topicd.testing.ws import WsClient

    client_end, server_end = trio.testing.memory_stream_pair()
    client = WsClient(client_end)
    head = client.request()
    # the client's first (masked) frame arrives in the same read as its handshake
    first = bytes(
        FrameProtocol(client=True, extensions=[]).send_data('{"op":"ping","request_id":"early"}')
    )
    nursery.start_soon(gate_of(h.app).ws_upgrade, server_end, head, first)
    with trio.fail_after(5):  # (virtual time: a lost frame fails at once)
        assert await client.read_handshake() == 101
        assert await client.recv() == {"op": "pong", "request_id": "early"}
