"""Contract tests for `POST /v0/watch` (api-routers-watch §2.2, §2.4, §2.8; README §2-§6).

Method: black-box. An in-process app (engine + full ASGI app with its auth/lifecycle gate)
is driven over HTTP with Quart's test client; topics are set up through the topic
endpoints. Each test sends one request shape and compares the whole answer with the value
the spec gives (exact JSON for success bodies, the canonical error body of README §5 with
the exact `code` and `detail` for failures). Processing order is checked by requests that
break two rules at once (the earlier check must win). Session lifetime uses pytest-trio's
`autojump_clock` (MockClock): the engine's clocks follow Trio's virtual time, so
`autojump_clock.jump(...)` ages a session without real waiting.
"""

from __future__ import annotations

import base64
import json
from functools import partial

import pytest

from tests.watch.helpers import (
    WID_RE,
    bearer,
    create,
    each_bounded,
    fail,
    ok_json,
    open_fail,
    open_ok,
    put_topic,
    read,
    write_n,
)
from topicd.testing.harness import make_config, open_app


async def test_create_response_shape(client):
    await write_n(client, "a", 3)
    await put_topic(client, "b")  # empty: earliest_seq = head_seq + 1
    await write_n(client, "c", 5)
    r = await client.post(
        "/v0/watch",
        json={"topics": {"a": {"from_seq": 1}, "b": {}, "c": {"tail": True}}},
    )
    assert r.headers["Content-Type"].startswith("application/json")
    body = await ok_json(r)
    wid = body["wid"]
    assert WID_RE.fullmatch(wid), wid
    assert len(base64.urlsafe_b64decode(wid[4:] + "==")) == 16
    assert body["stream_url"] == f"/v0/watch/{wid}"
    assert body["session_ttl_ms"] == 300000
    assert body["topics"] == {
        "a": {"from_seq": 1, "head_seq": 3, "earliest_seq": 1},
        "b": {"from_seq": 0, "head_seq": 0, "earliest_seq": 1},
        "c": {"from_seq": 5, "head_seq": 5, "earliest_seq": 1},
    }
    assert isinstance(body["performance"]["server_total_ms"], float)
    assert {"wid", "stream_url", "session_ttl_ms", "topics", "performance"} <= set(body)


async def test_wids_are_unique_and_well_formed(client):
    await write_n(client, "a", 1)
    wids = [(await create(client, {"topics": {"a": {}}}))["wid"] for _ in range(50)]
    assert len(set(wids)) == 50
    for wid in wids:
        assert WID_RE.fullmatch(wid), wid


async def test_from_seq_defaults_to_zero_and_tail_wins_over_from_seq(client):
    await write_n(client, "a", 4)
    body = await create(client, {"topics": {"a": {}}})
    assert body["topics"]["a"] == {"from_seq": 0, "head_seq": 4, "earliest_seq": 1}
    body = await create(client, {"topics": {"a": {"tail": True, "from_seq": 1}}})
    assert body["topics"]["a"] == {"from_seq": 4, "head_seq": 4, "earliest_seq": 1}
    body = await create(client, {"topics": {"a": {"tail": False, "from_seq": 2}}})
    assert body["topics"]["a"] == {"from_seq": 2, "head_seq": 4, "earliest_seq": 1}


async def test_tail_session_streams_only_new_records(harness, client, nursery, autojump_clock):
    await write_n(client, "a", 4)
    wid = (await create(client, {"topics": {"a": {"tail": True}}}))["wid"]
    await write_n(client, "a", 1)
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 2)
    assert frames[0][0] == "record"
    assert [r["$seq"] for r in frames[0][2]["records"]] == [5]
    assert frames[0][2]["from_seq"] == 4
    assert frames[1] == ("caught-up", {"a": 5}, {"topic": "a", "head_seq": 5})


# ---- 400 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("topics", [{}, None])
async def test_empty_or_missing_topics_is_400(client, topics):
    body = {} if topics is None else {"topics": topics}
    await fail(await client.post("/v0/watch", json=body), 400, "invalid_request")


async def test_topic_count_edge_256_ok_257_is_400(client):
    names = [f"t{i:03d}" for i in range(257)]
    await each_bounded(partial(put_topic, client), names)
    body = await create(client, {"topics": {n: {} for n in names[:256]}})
    assert len(body["topics"]) == 256
    r = await client.post("/v0/watch", json={"topics": {n: {} for n in names}})
    await fail(r, 400, "invalid_request")


async def test_too_many_topics_is_400_before_404(client):
    # 257 unknown topics: validation (400) runs before topic resolution (404)
    r = await client.post("/v0/watch", json={"topics": {f"u{i}": {} for i in range(257)}})
    await fail(r, 400, "invalid_request")
    r = await client.post(
        "/v0/watch",
        json={"topics": {f"u{i}": {} for i in range(257)}},
        query_string={"lenient": "true"},
    )
    await fail(r, 400, "invalid_request")


@pytest.mark.parametrize(
    "name", ["", "-a", ".a", "_a", "a b", "a/b", "a*", "é", "a" * 256, "a\nb", "a;b"]
)
async def test_invalid_topic_name_is_400(client, name):
    await write_n(client, "a", 1)
    r = await client.post("/v0/watch", json={"topics": {"a": {}, name: {}}})
    await fail(r, 400, "invalid_request")


async def test_longest_valid_name_is_accepted(client):
    name = "A" + "b" * 254
    await write_n(client, name, 1)
    body = await create(client, {"topics": {name: {}}})
    assert body["topics"] == {name: {"from_seq": 0, "head_seq": 1, "earliest_seq": 1}}


BAD_BODIES = [
    [],
    None,
    "topics",
    {"topics": []},
    {"topics": "a"},
    {"topics": {"a": 5}},
    {"topics": {"a": None}},
    {"topics": {"a": {"from_seq": -1}}},
    {"topics": {"a": {"from_seq": 1.5}}},
    {"topics": {"a": {"from_seq": "1"}}},
    {"topics": {"a": {"from_seq": True}}},
    {"topics": {"a": {"from_seq": 2**64}}},
    {"topics": {"a": {"tail": "yes"}}},
    {"topics": {"a": {"tail": 1}}},
    {"topics": {"a": {}}, "limit": -1},
    {"topics": {"a": {}}, "limit": 2.5},
    {"topics": {"a": {}}, "limit": 2**32},
    {"topics": {"a": {}}, "max_batch_bytes": -1},
    {"topics": {"a": {}}, "max_batch_bytes": 2**64},
    {"topics": {"a": {}}, "heartbeat_ms": "1000"},
    {"topics": {"a": {}}, "heartbeat_ms": -1},
    {"topics": {"a": {}}, "include_meta": 1},
    {"topics": {"a": {}}, "include_tags": "true"},
    {"topics": {"a": {}}, "include_data": 0},
    {"topics": {"a": {}}, "node": 5},
    {"topics": {"a": {}}, "node": ["n1", 2]},
    {"topics": {"a": {}}, "node": {"n": 1}},
    {"topics": {"a": {}}, "consistency": "weird"},
    {"topics": {"a": {}}, "consistency": 1},
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=[json.dumps(b)[:60] for b in BAD_BODIES])
async def test_wrong_types_are_400(client, body):
    await write_n(client, "a", 1)
    await fail(await client.post("/v0/watch", json=body), 400, "invalid_request")


@pytest.mark.parametrize("raw", [b'{"topics":', b"{", b"nope", b'{"topics":{"a":{}}}x', b""])
async def test_malformed_json_is_400(client, raw):
    await write_n(client, "a", 1)
    r = await client.post("/v0/watch", data=raw, headers={"Content-Type": "application/json"})
    await fail(r, 400, "invalid_request")


async def test_missing_content_type_is_415(client):
    await write_n(client, "a", 1)
    r = await client.post("/v0/watch", data=b'{"topics":{"a":{}}}')
    await fail(r, 415, "unsupported_media_type")


async def test_unknown_keys_are_ignored(client):
    await write_n(client, "a", 1)
    body = await create(client, {"topics": {"a": {"zzz": 1}}, "whatever": [1, 2]})
    assert body["topics"] == {"a": {"from_seq": 0, "head_seq": 1, "earliest_seq": 1}}


async def test_over_max_values_are_clamped_not_rejected(client):
    await write_n(client, "a", 1)
    body = await create(
        client,
        {
            "topics": {"a": {"from_seq": 2**64 - 1}},
            "limit": 2**32 - 1,
            "max_batch_bytes": 2**64 - 1,
            "heartbeat_ms": 2**64 - 1,
        },
    )
    assert body["topics"]["a"]["from_seq"] == 2**64 - 1


# ---- 404 / lenient ------------------------------------------------------------------------


async def test_unknown_topic_is_404_topic_not_found(client):
    await write_n(client, "a", 1)
    for query in (None, {"lenient": "false"}, {"lenient": "0"}, {"lenient": "FALSE"}):
        r = await client.post(
            "/v0/watch", json={"topics": {"a": {}, "nope": {}}}, query_string=query
        )
        err = await fail(r, 404, "topic_not_found")
        assert err["detail"]["topic"] == "nope"


@pytest.mark.parametrize("flag", ["true", "1"])
async def test_lenient_drops_unknown_topics(client, flag):
    await write_n(client, "a", 2)
    body = await create(
        client,
        {"topics": {"nope": {}, "a": {"from_seq": 1}, "nope2": {"tail": True}}},
        query={"lenient": flag},
    )
    assert body["topics"] == {"a": {"from_seq": 1, "head_seq": 2, "earliest_seq": 1}}


async def test_lenient_dropped_topic_never_appears_in_the_stream(
    harness, client, nursery, autojump_clock
):
    await write_n(client, "a", 1)
    wid = (await create(client, {"topics": {"a": {}, "later": {}}}, query={"lenient": "true"}))[
        "wid"
    ]
    await write_n(client, "later", 2)  # created after the session: still not watched
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 2)
    assert frames[1] == ("caught-up", {"a": 1}, {"topic": "a", "head_seq": 1})
    assert frames[0][1] == {"a": 1}
    await write_n(client, "later", 1)
    await write_n(client, "a", 1)
    frames = await read(s, 1)
    assert frames[0][0] == "record" and frames[0][1] == {"a": 2}
    assert frames[0][2]["topic"] == "a"


# ---- session cap / lifetime ---------------------------------------------------------------


async def test_session_cap_edge_and_order():
    async with open_app(make_config(limits={"max_watch_sessions": 2})) as h:
        client = h.app.test_client()
        await write_n(client, "a", 1)
        await create(client, {"topics": {"a": {}}})
        await create(client, {"topics": {"a": {}}})
        r = await client.post("/v0/watch", json={"topics": {"a": {}}})
        err = await fail(r, 429, "throttled")
        assert err["detail"] == {"limit": "max_watch_sessions", "max": 2}
        assert r.headers["Retry-After"] == "1"
        # earlier checks win over the cap: 400 (validation) and 404 (resolution)
        await fail(await client.post("/v0/watch", json={"topics": {}}), 400, "invalid_request")
        r = await client.post("/v0/watch", json={"topics": {"nope": {}}})
        await fail(r, 404, "topic_not_found")


async def test_reclaimed_sessions_free_their_slot(nursery, autojump_clock):
    async with open_app(make_config(limits={"max_watch_sessions": 1})) as h:
        client = h.app.test_client()
        await write_n(client, "a", 1)
        old = (await create(client, {"topics": {"a": {}}}))["wid"]
        autojump_clock.jump(299.9)
        await fail(await client.post("/v0/watch", json={"topics": {"a": {}}}), 429, "throttled")
        autojump_clock.jump(0.2)  # idle for more than session_ttl_ms: reclaimed on POST
        new = (await create(client, {"topics": {"a": {}}}))["wid"]
        assert new != old
        await open_fail(h, nursery, old, 404, "not_found")
        s = await open_ok(h, nursery, new)
        s.disconnect()
        await s.wait_done()


# ---- auth ----------------------------------------------------------------------------------

KEYS = ("full", "other", "rd:r", "wr:w+a+d", "pre:r:tenant1.|shared.")


@pytest.fixture
async def authed():
    async with open_app(make_config(auth={"api_keys": KEYS})) as h:
        client = h.app.test_client()
        for topic in ("t", "tenant1.a", "shared.x"):
            r = await client.post(
                f"/v0/topics/{topic}", json={"records": [{"data": 1}]}, headers=bearer("full")
            )
            assert r.status_code == 201
        yield h


async def test_auth_no_key_or_bad_key_is_401(authed):
    client = authed.app.test_client()
    body = {"topics": {"t": {}}}
    await fail(await client.post("/v0/watch", json=body), 401, "unauthorized")
    r = await client.post("/v0/watch", json=body, headers=bearer("nope"))
    await fail(r, 401, "unauthorized")
    r = await client.post("/v0/watch", json=body, headers={"Authorization": "Basic full"})
    await fail(r, 401, "unauthorized")
    # `?token=` is a stream-only fallback, never accepted on the POST
    r = await client.post("/v0/watch", json=body, query_string={"token": "full"})
    await fail(r, 401, "unauthorized")


async def test_auth_key_without_read_is_403(authed):
    client = authed.app.test_client()
    r = await client.post("/v0/watch", json={"topics": {"t": {}}}, headers=bearer("wr"))
    await fail(r, 403, "forbidden")


async def test_auth_read_keys_may_create(authed):
    client = authed.app.test_client()
    for key in ("full", "other", "rd"):
        body = await create(client, {"topics": {"t": {}}}, headers=bearer(key))
        assert body["topics"] == {"t": {"from_seq": 0, "head_seq": 1, "earliest_seq": 1}}
    body = await create(
        client, {"topics": {"tenant1.a": {}, "shared.x": {}}}, headers=bearer("pre")
    )
    assert set(body["topics"]) == {"tenant1.a", "shared.x"}


async def test_auth_topic_outside_prefixes_is_403_with_detail_topic(authed):
    client = authed.app.test_client()
    r = await client.post(
        "/v0/watch", json={"topics": {"tenant1.a": {}, "t": {}}}, headers=bearer("pre")
    )
    err = await fail(r, 403, "forbidden")
    assert err["detail"]["topic"] == "t"


async def test_auth_allowlist_runs_before_topic_resolution(authed):
    client = authed.app.test_client()
    # an unknown topic outside the prefixes is 403 (allowlist), not 404, even if lenient
    for query in (None, {"lenient": "true"}):
        r = await client.post(
            "/v0/watch",
            json={"topics": {"tenant1.a": {}, "zzz": {}}},
            headers=bearer("pre"),
            query_string=query,
        )
        err = await fail(r, 403, "forbidden")
        assert err["detail"]["topic"] == "zzz"
    # an unknown topic inside the prefixes is 404
    r = await client.post("/v0/watch", json={"topics": {"tenant1.nope": {}}}, headers=bearer("pre"))
    err = await fail(r, 404, "topic_not_found")
    assert err["detail"]["topic"] == "tenant1.nope"
