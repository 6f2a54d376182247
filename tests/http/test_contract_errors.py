"""Contract tests for bad input and the error surface of the topic endpoints.

Method: black-box through Quart's test client. Every request here is wrong in one way
(routing, method, media type, encoding, JSON syntax, field types, numeric range, names,
body size, gzip framing) and each answer is checked against README §1, §3, §5 and §6: the
exact status and `error.code`, the canonical error body (`{"error": {code, message,
detail?}}`, detail omitted when empty), `Allow` on 405 and `X-Topicd-Pressure` on every
response. A Hypothesis test finally throws generated JSON bodies at every body-carrying
endpoint and asserts the server never answers `500`.
"""

from __future__ import annotations

import gzip
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topicd.testing.harness import make_config, open_app

JSON_CT = {"Content-Type": "application/json"}
PRESSURE = re.compile(r"0\.\d{3}|1\.000")

# (method, path template) of every body-carrying topic endpoint
BODY_ENDPOINTS = [
    ("POST", "/v0/topics/{}"),
    ("POST", "/v0/topics/{}/diff"),
    ("POST", "/v0/topics/{}/delete"),
    ("PUT", "/v0/topics/{}"),
]


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
    assert isinstance(body["performance"]["server_total_ms"], float)
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


def send(client, method: str, path: str, **kw):
    return client.open(path, method=method, **kw)


async def seed(client, topic: str = "e.t") -> None:
    r = await client.post(f"/v0/topics/{topic}", json={"records": [{"data": 1, "tag": "a"}]})
    assert r.status_code in (200, 201)


# --------------------------------------------------------------------------------------
# Routing: 404 not_found, 405 with Allow
# --------------------------------------------------------------------------------------


async def test_unknown_paths_are_404_not_found(client):
    for method, path in [
        ("GET", "/"),
        ("GET", "/v0"),
        ("GET", "/v0/nope"),
        ("POST", "/v0/nope"),
        ("GET", "/v1/topics"),
        ("GET", "/v0/topics/a/b/c"),
        ("POST", "/v0/topics/a/diff/x"),
        ("POST", "/v0/topics/a/claimz"),
        ("DELETE", "/v0/topic/a"),
        ("GET", "/v0/topics/a/"),
        ("POST", "/v0/topics/a/diff/"),
        ("GET", "/v0/health/"),
    ]:
        err = await fail(await send(client, method, path), 404, "not_found")
        assert "detail" not in err or err["detail"]


def allow_set(r) -> set[str]:
    value = r.headers.get("Allow")
    assert value is not None, "405 without Allow"
    return {m.strip().upper() for m in value.split(",") if m.strip()}


async def test_wrong_method_is_405_with_allow(client):
    await seed(client)
    cases = [
        ("PATCH", "/v0/topics/e.t", {"GET", "PUT", "POST", "DELETE"}),
        ("OPTIONS", "/v0/topics/e.t", {"GET", "PUT", "POST", "DELETE"}),
        ("OPTIONS", "/v0/topics", {"GET"}),
        ("OPTIONS", "/v0/topics/e.t/diff", {"POST"}),
        ("GET", "/v0/topics/e.t/diff", {"POST"}),
        ("PUT", "/v0/topics/e.t/diff", {"POST"}),
        ("GET", "/v0/topics/e.t/delete", {"POST"}),
        ("DELETE", "/v0/topics/e.t/delete", {"POST"}),
        ("POST", "/v0/topics", {"GET"}),
        ("DELETE", "/v0/topics", {"GET"}),
        ("POST", "/v0/health", {"GET"}),
        ("PUT", "/v0/ready", {"GET"}),
    ]
    for method, path, allowed in cases:
        r = await send(client, method, path)
        await fail(r, 405, "method_not_allowed")
        got = allow_set(r)
        assert allowed <= got, (method, path, got)
        assert method not in got


# --------------------------------------------------------------------------------------
# Content type, empty bodies, body size
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), BODY_ENDPOINTS)
async def test_non_json_content_type_is_415(client, method, path):
    await seed(client)
    for ctype in (
        None,
        "text/plain",
        "application/jsonx",
        "application/json-seq",
        "text/json",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ):
        headers = {} if ctype is None else {"Content-Type": ctype}
        r = await send(
            client, method, path.format("e.t"), data=b'{"records":[{"data":1}]}', headers=headers
        )
        await fail(r, 415, "unsupported_media_type")


@pytest.mark.parametrize(("method", "path"), BODY_ENDPOINTS)
async def test_json_media_type_parameters_and_case(client, method, path):
    await seed(client)
    body = b'{"records":[{"data":1}],"before_seq":1}'
    for ctype in (
        "application/json; charset=utf-8",
        "Application/JSON",
        "APPLICATION/JSON;charset=UTF-8",
    ):
        r = await send(
            client, method, path.format("e.t"), data=body, headers={"Content-Type": ctype}
        )
        assert r.status_code in (200, 201), (ctype, await r.get_data())
        check_pressure(r)


async def test_empty_body_rules(client):
    await seed(client)
    # POST records and record delete require a body
    for path in ("/v0/topics/e.t", "/v0/topics/e.t/delete"):
        await fail(await client.post(path, data=b"", headers=JSON_CT), 400, "invalid_request")
        await fail(await client.post(path), 415, "unsupported_media_type")
    # PUT and diff take an empty body as defaults, with or without a content type
    await ok(await client.put("/v0/topics/e.new1"), 201)
    await ok(await client.put("/v0/topics/e.new2", data=b"", headers=JSON_CT), 201)
    await ok(await client.post("/v0/topics/e.t/diff"))
    await ok(await client.post("/v0/topics/e.t/diff", data=b"", headers=JSON_CT))


async def test_body_over_max_body_bytes_is_413():
    async with open_app(make_config(limits={"max_body_bytes": 1024})) as h:
        client = h.app.test_client()
        await seed(client)

        def body_of(size: int) -> bytes:
            head, tail = b'{"records":[{"data":"', b'"}]}'
            return head + b"x" * (size - len(head) - len(tail)) + tail

        assert len(body_of(1024)) == 1024
        await ok(await client.post("/v0/topics/e.t", data=body_of(1024), headers=JSON_CT))
        for method, path in BODY_ENDPOINTS:
            r = await send(client, method, path.format("e.t"), data=body_of(1025), headers=JSON_CT)
            await fail(r, 413, "payload_too_large")
        # the bound applies to the decoded size of a gzip body
        r = await client.post(
            "/v0/topics/e.t",
            data=gzip.compress(body_of(1025)),
            headers={**JSON_CT, "Content-Encoding": "gzip"},
        )
        await fail(r, 413, "payload_too_large")
        r = await client.post(
            "/v0/topics/e.t",
            data=gzip.compress(body_of(1024)),
            headers={**JSON_CT, "Content-Encoding": "gzip"},
        )
        await ok(r)


async def test_413_precedes_415():
    async with open_app(make_config(limits={"max_body_bytes": 1024})) as h:
        client = h.app.test_client()
        r = await client.post(
            "/v0/topics/e.t", data=b"x" * 5000, headers={"Content-Type": "text/plain"}
        )
        await fail(r, 413, "payload_too_large")


# --------------------------------------------------------------------------------------
# gzip request bodies
# --------------------------------------------------------------------------------------

GZ = {**JSON_CT, "Content-Encoding": "gzip"}


async def test_gzip_bodies_are_decoded(client):
    raw = b'{"records":[{"data": {"n" : 1.10}}]}'
    await ok(await client.post("/v0/topics/e.gz", data=gzip.compress(raw), headers=GZ), 201)
    await ok(
        await client.put("/v0/topics/e.gz2", data=gzip.compress(b'{"cap_records": 4}'), headers=GZ),
        201,
    )
    r = await client.post(
        "/v0/topics/e.gz/diff", data=gzip.compress(b'{"from_seq": 0}'), headers=GZ
    )
    assert b'"data":{"n":1.10}' in await r.get_data()
    r = await client.post(
        "/v0/topics/e.gz/delete", data=gzip.compress(b'{"before_seq": 2}'), headers=GZ
    )
    assert (await ok(r))["deleted"] == 1
    r = await client.get("/v0/topics/e.gz2", query_string={"touch": "false"})
    assert (await ok(r))["config"]["cap_records"] == 4


async def test_invalid_gzip_is_400(client):
    good = gzip.compress(b'{"records":[{"data":1}]}')
    for data in (b"not gzip at all", good[: len(good) // 2], b"\x1f\x8b\x08\x00garbage", good[:10]):
        r = await client.post("/v0/topics/e.badgz", data=data, headers=GZ)
        await fail(r, 400, "invalid_request")
    await fail(await client.get("/v0/topics/e.badgz"), 404, "topic_not_found")


async def test_unsupported_content_encoding_is_rejected(client):
    r = await client.post(
        "/v0/topics/e.br",
        data=b'{"records":[{"data":1}]}',
        headers={**JSON_CT, "Content-Encoding": "br"},
    )
    # README §3 names only gzip; the status for other codings is not fixed, a 5xx is wrong
    assert r.status_code in (400, 415)
    await fail(
        r, r.status_code, "invalid_request" if r.status_code == 400 else "unsupported_media_type"
    )
    await fail(await client.get("/v0/topics/e.br"), 404, "topic_not_found")


# --------------------------------------------------------------------------------------
# Malformed JSON, wrong types, numbers
# --------------------------------------------------------------------------------------

MALFORMED = [
    b"{",
    b'{"records": [',
    b"{'records': []}",
    b'{"records": [{"data": 1}],}',
    b'{"records": [{"data": 1}]} x',
    b'{"records": [{"data": 1}]}{}',
    b'{"records": [{"data": tru}]}',
    b'{"records": [{"data": NaN}]}',
    b'{"records": [{"data": Infinity}]}',
    b'{"records": [{"data": 01}]}',
    b'{"records": [{"data": 1.}]}',
    b'{"records": [{"data": "\\x"}]}',
    b'{"records": [{"data": "a\x01b"}]}',
    b"nul",
    b"   ",
    b"\x00",
]


@pytest.mark.parametrize(("method", "path"), BODY_ENDPOINTS)
async def test_malformed_json_is_400(client, method, path):
    await seed(client)
    for raw in MALFORMED:
        r = await send(client, method, path.format("e.t"), data=raw, headers=JSON_CT)
        await fail(r, 400, "invalid_request")


@pytest.mark.parametrize(("method", "path"), BODY_ENDPOINTS)
async def test_non_object_top_level_is_400(client, method, path):
    await seed(client)
    for raw in (b"[]", b"5", b'"x"', b"null", b"true", b'[{"records": []}]'):
        r = await send(client, method, path.format("e.t"), data=raw, headers=JSON_CT)
        await fail(r, 400, "invalid_request")


async def test_write_field_types(client):
    await seed(client)
    bad = [
        {"records": [{"data": 1}], "create": "yes"},
        {"records": [{"data": 1}], "create": 1},
        {"records": [{"data": 1}], "idempotency_key": 5},
        {"records": [{"data": 1}], "disable_backpressure": "no"},
        {"records": [{"data": 1}], "node": 5},
        {"records": [{"data": 1}], "node": ["a"]},
        {"records": [{"data": 1}], "config": 5},
        {"records": [{"data": 1}], "config": "log"},
        {"records": [{"data": 1, "tag": 5}]},
        {"records": [{"data": 1, "tag": ["a"]}]},
        {"records": [{"data": 1, "node": {}}]},
        {"records": [{"data": 1, "priority": "1"}]},
        {"records": "[]"},
    ]
    for body in bad:
        await fail(await client.post("/v0/topics/e.t", json=body), 400, "invalid_request")
    r = await client.get("/v0/topics/e.t", query_string={"touch": "false"})
    assert (await ok(r))["head_seq"] == 1


async def test_diff_field_types_and_ranges(client):
    await seed(client)
    bad = [
        {"from_seq": "5"},
        {"from_seq": True},
        {"from_seq": 1.5},
        {"from_seq": -1},
        {"from_seq": 2**64},
        {"from_seq": 123456789012345678901234567890},
        {"from_seq": None},
        {"limit": -1},
        {"limit": 2**32},
        {"limit": 1.5},
        {"limit": "10"},
        {"wait_ms": -1},
        {"wait_ms": 2**32},
        {"wait_ms": 0.5},
        {"max_batch_bytes": -1},
        {"max_batch_bytes": 2**64},
        {"max_batch_bytes": 1.5},
        {"node": 5},
        {"node": [1]},
        {"node": {"a": 1}},
        {"node": [["a"]]},
        {"include_tags": "yes"},
        {"include_tags": 1},
        {"include_meta": "false"},
    ]
    for body in bad:
        r = await client.post("/v0/topics/e.t/diff", json=body)
        await fail(r, 400, "invalid_request")
    for raw in (b'{"from_seq": 1e400}', b'{"from_seq": -0.5}', b'{"limit": 1e2000}'):
        r = await client.post("/v0/topics/e.t/diff", data=raw, headers=JSON_CT)
        await fail(r, 400, "invalid_request")


async def test_unknown_keys_are_ignored(client):
    r = await client.post(
        "/v0/topics/e.unk", json={"records": [{"data": 1, "colour": "red"}], "x": {"y": 1}}
    )
    await ok(r, 201)
    await ok(await client.post("/v0/topics/e.unk/diff", json={"from_seq": 0, "whatever": [1, 2]}))
    r = await client.post("/v0/topics/e.unk/delete", json={"before_seq": 1, "note": "ignored"})
    await ok(r)


# --------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------

BAD_NAMES = [
    "x" * 256,
    ".lead",
    "-lead",
    "_lead",
    ":lead",
    "a%20b",  # "a b"
    "a>b",
    "orders->audit",
    "a*",
    "a@b",
    "a+b",
    "a%2Cb",  # "a,b"
    "%C3%A9",  # "é"
    "caf%C3%A9",
    "a%09b",  # tab
    "a%00b",  # NUL
]


async def test_invalid_topic_names_are_400_on_every_endpoint(client):
    for name in BAD_NAMES:
        base = f"/v0/topics/{name}"
        for method, path, kw in [
            ("PUT", base, {}),
            ("GET", base, {}),
            ("DELETE", base, {}),
            ("POST", base, {"json": {"records": [{"data": 1}]}}),
            ("POST", base + "/diff", {"json": {}}),
            ("POST", base + "/delete", {"json": {"before_seq": 1}}),
        ]:
            r = await send(client, method, path, **kw)
            assert r.status_code == 400, (method, path, await r.get_data())
            await fail(r, 400, "invalid_request")
    r = await client.get("/v0/topics")
    assert (await ok(r))["topics"] == []


async def test_name_boundaries_are_valid(client):
    for name in ("x" * 255, "A", "0", "a.b_c:d-e", "Z9:_.-"):
        await ok(await client.put(f"/v0/topics/{name}"), 201)
        r = await client.get(f"/v0/topics/{name}", query_string={"touch": "false"})
        assert (await ok(r))["topic"] == name


async def test_names_are_case_sensitive(client):
    await ok(await client.put("/v0/topics/Case"), 201)
    await ok(await client.put("/v0/topics/case"), 201)
    await fail(await client.get("/v0/topics/CASE"), 404, "topic_not_found")


# --------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------

NOT_UTF8 = [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\x80"]


async def test_non_utf8_bodies_are_400(client):
    await seed(client)
    for bad in NOT_UTF8:
        cases = [
            ("POST", "/v0/topics/e.t", b'{"records":[{"data":"' + bad + b'"}]}'),
            ("POST", "/v0/topics/e.t", b'{"records":[{"data":1,"tag":"' + bad + b'"}]}'),
            ("POST", "/v0/topics/e.t", b'{"records":[{"data":1,"meta":{"k":"' + bad + b'"}}]}'),
            ("POST", "/v0/topics/e.t", b'{"records":[{"data":1}],"node":"' + bad + b'"}'),
            ("POST", "/v0/topics/e.t", b'{"records":[{"data":{"' + bad + b'":1}}]}'),
            ("POST", "/v0/topics/e.t/diff", b'{"node":"' + bad + b'"}'),
            ("POST", "/v0/topics/e.t/delete", b'{"match":"' + bad + b'"}'),
            ("PUT", "/v0/topics/e.t", b'{"dead_letter":"' + bad + b'"}'),
        ]
        for method, path, raw in cases:
            r = await send(client, method, path, data=raw, headers=JSON_CT)
            await fail(r, 400, "invalid_request")
    r = await client.get("/v0/topics/e.t", query_string={"touch": "false"})
    assert (await ok(r))["head_seq"] == 1


async def test_lone_surrogate_escapes_never_500(client):
    await seed(client)
    for raw in (
        b'{"records":[{"data":"\\ud800"}]}',
        b'{"records":[{"data":1,"tag":"\\udc00"}]}',
        b'{"records":[{"data":1,"meta":{"\\ud800":1}}]}',
    ):
        r = await client.post("/v0/topics/e.t", data=raw, headers=JSON_CT)
        assert r.status_code in (200, 400), await r.get_data()
        check_pressure(r)
    r = await client.post("/v0/topics/e.t/diff", json={"include_tags": True})
    assert r.status_code == 200


# --------------------------------------------------------------------------------------
# Query strings
# --------------------------------------------------------------------------------------


async def test_odd_query_values_never_500(client):
    await seed(client)
    for path, qs in [
        ("/v0/topics", {"page_size": "abc"}),
        ("/v0/topics", {"page_size": "1e3"}),
        ("/v0/topics", {"page_size": "99999999999999999999999"}),
        ("/v0/topics", {"prefix": "\x00"}),
        ("/v0/topics/e.t", {"touch": "\xff"}),
    ]:
        r = await client.get(path, query_string=qs)
        if r.status_code != 200:
            await fail(r, 400, "invalid_request")
        check_pressure(r)


# --------------------------------------------------------------------------------------
# Never a 500
# --------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
field_names = st.sampled_from(
    [
        "records",
        "data",
        "tag",
        "node",
        "meta",
        "priority",
        "create",
        "config",
        "idempotency_key",
        "from_seq",
        "limit",
        "wait_ms",
        "include_tags",
        "include_meta",
        "max_batch_bytes",
        "before_seq",
        "match",
        "type",
        "ttl_ms",
        "cap_records",
        "discard",
        "durability",
        "dead_letter",
        "lease_ms",
    ]
)
bodies = st.dictionaries(field_names, json_values, max_size=4) | st.dictionaries(
    st.just("records"),
    st.lists(st.dictionaries(field_names, json_values, max_size=4), max_size=3),
    min_size=1,
)


@settings(
    max_examples=60,
    database=None,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=bodies, endpoint=st.sampled_from(BODY_ENDPOINTS))
async def test_generated_bodies_never_500(client, body, endpoint):
    method, path = endpoint
    if method == "POST" and path.endswith("/diff"):
        body.pop("wait_ms", None)  # a long-poll would wait in real time
    r = await send(client, method, path.format("e.fuzz"), json=body)
    assert r.status_code < 500, (method, path, body, await r.get_data())
    check_pressure(r)
    if r.status_code >= 400:
        raw = json.loads(await r.get_data())
        assert set(raw) <= {"error", "performance"}
        assert isinstance(raw["error"]["code"], str)
