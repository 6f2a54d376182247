"""Contract tests for authentication and authorization on the topic endpoints, README §2.

Method: black-box. An app is opened with a fixed set of bearer keys (`auth.api_keys`) of
different scopes and prefix allowlists; requests carry `Authorization: Bearer ...` and the
tests check 401 (not authenticated) vs 403 (authenticated, not allowed) with the canonical
error body, the scope table of §2.3 for every topic route, the extra `admin` requirement of
a creating write that carries `config` and its place in the validation order of
api-topics §6.2, and the prefix allowlist (rejected on names, filtered on the list).
"""

from __future__ import annotations

import json
import re

import pytest
import trio
import trio.testing

from topicd.testing.harness import make_config, open_app

PRESSURE = re.compile(r"0\.\d{3}|1\.000")

KEYS = (
    "rwkey:rw",
    "adm:admin+rw",
    "rd:r",
    "wr:w",
    "del:d",
    " full ",
    "pre::tenant1.|shared.",
    "prerw:rw:tenant1.",
    "colon::ns:a|x.",
    "mixed:READ++W",
    "",
)


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


FULL = bearer("full")


def check_pressure(r) -> None:
    value = r.headers.get("X-Topicd-Pressure")
    assert value is not None, "X-Topicd-Pressure missing"
    assert PRESSURE.fullmatch(value), value


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


async def ok(r, status: int = 200) -> dict:
    raw = await r.get_data()
    assert r.status_code == status, raw
    check_pressure(r)
    return json.loads(raw)


@pytest.fixture
async def authed():
    async with open_app(make_config(auth={"api_keys": KEYS})) as h:
        client = h.app.test_client()
        for topic in ("t", "tenant1.a", "tenant1.b", "shared.x", "other"):
            r = await client.post(
                f"/v0/topics/{topic}", json={"records": [{"data": 1}]}, headers=FULL
            )
            assert r.status_code == 201
        yield client


def route(client, op: str, topic: str, headers: dict):
    """One request per topic operation of the scope table (README §2.3)."""
    base = f"/v0/topics/{topic}"
    if op == "put":
        return client.put(base, json={}, headers=headers)
    if op == "get":
        return client.get(base, query_string={"touch": "false"}, headers=headers)
    if op == "list":
        return client.get("/v0/topics", headers=headers)
    if op == "delete_topic":
        return client.delete(base, headers=headers)
    if op == "write":
        return client.post(base, json={"records": [{"data": 2}]}, headers=headers)
    if op == "diff":
        return client.post(base + "/diff", json={}, headers=headers)
    if op == "delete_records":
        return client.post(base + "/delete", json={"before_seq": 1}, headers=headers)
    raise AssertionError(op)


# delete_topic last: the other operations need the topic to exist
SCOPE_OF = {
    "put": "admin",
    "get": "read",
    "list": "read",
    "write": "write",
    "diff": "read",
    "delete_records": "delete",
    "delete_topic": "delete",
}
KEY_SCOPES = {
    "rwkey": {"read", "write"},
    "adm": {"admin", "read", "write"},
    "rd": {"read"},
    "wr": {"write"},
    "del": {"delete"},
    "full": {"read", "write", "delete", "admin"},
}


# --------------------------------------------------------------------------------------
# 401
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("nope"),
        bearer(""),
        {"Authorization": "Basic cndrZXk6"},
        {"Authorization": "bearer rwkey"},
        {"Authorization": "Bearerrwkey"},
        {"Authorization": "rwkey"},
        bearer("rwkey:rw"),
    ],
)
async def test_missing_or_unknown_key_is_401(authed, headers):
    for op in SCOPE_OF:
        await fail(await route(authed, op, "t", headers), 401, "unauthorized")


async def test_401_precedes_body_and_route_checks(authed):
    r = await authed.post("/v0/topics/t", data=b"{", headers={"Content-Type": "text/plain"})
    await fail(r, 401, "unauthorized")
    r = await authed.post("/v0/topics/absent", json={"records": [], "config": {}})
    await fail(r, 401, "unauthorized")


async def test_token_whitespace_is_trimmed(authed):
    await ok(await authed.get("/v0/topics", headers={"Authorization": "Bearer  rwkey  "}))
    # the key entry " full " was trimmed at load
    await ok(await authed.get("/v0/topics", headers=FULL))


# --------------------------------------------------------------------------------------
# 403: scopes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(KEY_SCOPES))
async def test_scope_table(authed, key):
    for op, scope in SCOPE_OF.items():
        r = await route(authed, op, "t", bearer(key))
        if scope in KEY_SCOPES[key]:
            assert r.status_code in (200, 201), (key, op, await r.get_data())
            check_pressure(r)
        else:
            await fail(r, 403, "forbidden")


async def test_write_scope_may_lazy_create_without_config(authed):
    r = await authed.post(
        "/v0/topics/fresh", json={"records": [{"data": 1}]}, headers=bearer("rwkey")
    )
    body = await ok(r, 201)
    assert body["created"] is True


async def test_creating_write_with_config_needs_admin(authed):
    body = {"records": [{"data": 1}], "config": {"cap_records": 5}}
    r = await authed.post("/v0/topics/newcfg", json=body, headers=bearer("rwkey"))
    err = await fail(r, 403, "forbidden")
    assert err["detail"] == {"topic": "newcfg"}
    await fail(await authed.get("/v0/topics/newcfg", headers=FULL), 404, "topic_not_found")
    r = await authed.post("/v0/topics/newcfg", json=body, headers=bearer("adm"))
    assert (await ok(r, 201))["created"] is True


async def test_config_on_existing_topic_needs_no_admin(authed):
    body = {"records": [{"data": 1}], "config": {"type": "queue"}}
    r = await authed.post("/v0/topics/t", json=body, headers=bearer("rwkey"))
    assert (await ok(r))["created"] is False


async def test_order_json_shape_before_admin_check(authed):
    r = await authed.post(
        "/v0/topics/o1", json={"records": 5, "config": {}}, headers=bearer("rwkey")
    )
    await fail(r, 400, "invalid_request")


async def test_order_admin_check_before_record_checks(authed):
    h = bearer("rwkey")
    for body in (
        {"records": [], "config": {}},
        {"records": [{"data": 1, "tag": "t" * 300}], "config": {}},
        {"records": [{"data": "x" * 1_100_000}], "config": {}},
        {"records": [{"data": 1}], "config": {}, "create": False},
        {"records": [{"data": 1}], "config": {"dead_letter": "bad name"}},
    ):
        r = await authed.post("/v0/topics/o2", json=body, headers=h)
        err = await fail(r, 403, "forbidden")
        assert err["detail"] == {"topic": "o2"}


# --------------------------------------------------------------------------------------
# 403: prefix allowlist
# --------------------------------------------------------------------------------------


async def test_prefix_allowlist_on_path_names(authed):
    h = bearer("pre")
    for op in ("put", "get", "write", "diff", "delete_records"):
        r = await route(authed, op, "tenant1.a", h)
        assert r.status_code in (200, 201), (op, await r.get_data())
        for topic in ("other", "tenant1", "Tenant1.a", "tenant2.a"):
            await fail(await route(authed, op, topic, h), 403, "forbidden")
    # an absent name outside the list is 403, not 404
    await fail(await route(authed, "get", "nowhere", h), 403, "forbidden")
    await fail(await route(authed, "delete_topic", "other", h), 403, "forbidden")
    await ok(await route(authed, "delete_topic", "shared.x", h))


async def test_prefix_allowlist_filters_the_list(authed):
    body = await ok(await authed.get("/v0/topics", headers=bearer("pre")))
    assert [t["topic"] for t in body["topics"]] == ["shared.x", "tenant1.a", "tenant1.b"]
    body = await ok(await authed.get("/v0/topics", headers=bearer("prerw")))
    assert [t["topic"] for t in body["topics"]] == ["tenant1.a", "tenant1.b"]
    body = await ok(
        await authed.get("/v0/topics", query_string={"page_size": "1"}, headers=bearer("prerw"))
    )
    assert [t["topic"] for t in body["topics"]] == ["tenant1.a"]
    body = await ok(
        await authed.get("/v0/topics", query_string={"prefix": "o"}, headers=bearer("prerw"))
    )
    assert body["topics"] == []
    assert "next_cursor" not in body


async def test_key_entry_syntax(authed):
    # README §2.2: splitting stops after the third field, so prefixes may contain ':'
    await ok(await authed.put("/v0/topics/ns:a.1", headers=bearer("colon")), 201)
    await ok(await authed.put("/v0/topics/x.1", headers=bearer("colon")), 201)
    await fail(await authed.put("/v0/topics/ns:b", headers=bearer("colon")), 403, "forbidden")
    # scope tokens are case-insensitive; empty tokens are skipped
    await ok(await authed.post("/v0/topics/t/diff", json={}, headers=bearer("mixed")))
    await ok(
        await authed.post("/v0/topics/t", json={"records": [{"data": 1}]}, headers=bearer("mixed"))
    )
    await fail(await authed.put("/v0/topics/t", headers=bearer("mixed")), 403, "forbidden")
    await fail(await authed.delete("/v0/topics/t", headers=bearer("mixed")), 403, "forbidden")


async def test_prefix_key_keeps_its_scopes(authed):
    await fail(await route(authed, "put", "tenant1.a", bearer("prerw")), 403, "forbidden")
    await ok(await route(authed, "write", "tenant1.a", bearer("prerw")))


async def test_other_methods_on_topic_paths_need_write(authed):
    # README §2.3: any other method on a /v0/topics/:t/... path requires `write` (fail closed)
    for method, path in [
        ("PATCH", "/v0/topics/t"),
        ("GET", "/v0/topics/t/diff"),
        ("PUT", "/v0/topics/t/delete"),
    ]:
        for key in ("rd", "del"):
            r = await authed.open(path, method=method, headers=bearer(key))
            await fail(r, 403, "forbidden")
        r = await authed.open(path, method=method, headers=bearer("wr"))
        await fail(r, 405, "method_not_allowed")


async def test_query_token_is_not_accepted_on_topic_routes(authed):
    # README §2.5: ?token= only on the SSE GETs
    await fail(await authed.get("/v0/topics", query_string={"token": "full"}), 401, "unauthorized")
    r = await authed.post("/v0/topics/t/diff", json={}, query_string={"token": "full"})
    await fail(r, 401, "unauthorized")


async def test_max_inflight_per_key(autojump_clock):
    cfg = make_config(auth={"api_keys": ("a", "b")}, limits={"max_inflight_per_key": 1})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        r = await client.put("/v0/topics/inf", headers=bearer("a"))
        assert r.status_code == 201
        out = {}

        async def poll():
            out["r"] = await client.post(
                "/v0/topics/inf/diff", json={"wait_ms": 1000}, headers=bearer("a")
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            r = await client.get("/v0/topics", headers=bearer("a"))
            err = await fail(r, 429, "throttled")
            assert err["detail"] == {"limit": "max_inflight_per_key", "max": 1}
            assert r.headers["Retry-After"] == "1"
            await ok(await client.get("/v0/topics", headers=bearer("b")))
        await ok(out["r"])
        # the slot is released when the request ends
        await ok(await client.get("/v0/topics", headers=bearer("a")))


async def test_dev_mode_has_no_per_key_inflight_cap(autojump_clock):
    async with open_app(make_config(limits={"max_inflight_per_key": 1})) as h:
        client = h.app.test_client()
        await ok(await client.put("/v0/topics/dev"), 201)

        async def poll():
            await client.post("/v0/topics/dev/diff", json={"wait_ms": 1000})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            await ok(await client.get("/v0/topics"))


async def test_dev_mode_ignores_the_header(client):
    r = await client.post(
        "/v0/topics/dev", json={"records": [{"data": 1}]}, headers=bearer("garbage")
    )
    assert r.status_code == 201
    r = await client.put("/v0/topics/dev2", headers={"Authorization": "Basic x"})
    assert r.status_code == 201
