"""Contract tests for the liveness and readiness probes, api-ops §1-§2 and README §2.5.

Method: black-box through Quart's test client. The app is observed in the three phases a
probe must distinguish: serving (the default harness), starting (`open_app(serving=False)`,
i.e. recovery not finished) and draining (the harness's `Lifecycle.begin_drain()`, what
SIGTERM triggers). Probe authentication is checked with keys configured, with and without
`probe_auth`. Every answer also carries `X-Topicd-Pressure`.
"""

from __future__ import annotations

import json
import re

import pytest

from topicd.testing.harness import make_config, open_app

PRESSURE = re.compile(r"0\.\d{3}|1\.000")
HEALTH = ("/v0/health", "/healthz")
READY = ("/v0/ready", "/readyz")


def check_pressure(r) -> None:
    value = r.headers.get("X-Topicd-Pressure")
    assert value is not None, "X-Topicd-Pressure missing"
    assert PRESSURE.fullmatch(value), value


async def ok(r) -> dict:
    raw = await r.get_data()
    assert r.status_code == 200, raw
    check_pressure(r)
    assert r.headers["Content-Type"].split(";")[0].strip() == "application/json"
    return json.loads(raw)


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


async def check_health(client) -> None:
    for path in HEALTH:
        body = await ok(await client.get(path))
        assert body["status"] == "ok"
        assert isinstance(body["version"], str)
        assert body["version"]
        assert isinstance(body["uptime_ms"], int)
        assert body["uptime_ms"] >= 0
        # README §9: every JSON success response carries performance.server_total_ms
        assert isinstance(body["performance"]["server_total_ms"], float)


async def test_health_when_serving(client):
    await check_health(client)


async def test_ready_when_serving_counts_topics(client):
    for path in READY:
        body = await ok(await client.get(path))
        assert body["status"] == "ready"
        assert body["wal_replay_complete"] is True
        assert body["topics"] == 0
        assert isinstance(body["performance"]["server_total_ms"], float)
    await client.put("/v0/topics/p1")
    await client.post("/v0/topics/p2", json={"records": [{"data": 1}]})
    for path in READY:
        assert (await ok(await client.get(path)))["topics"] == 2


async def test_while_starting_only_probes_answer():
    async with open_app(serving=False) as h:
        client = h.app.test_client()
        await check_health(client)
        for path in READY:
            r = await client.get(path)
            err = await fail(r, 503, "not_ready")
            progress = err["detail"]["replay_progress"]
            assert isinstance(progress, int | float)
            assert 0.0 <= progress <= 1.0
            assert r.headers["Retry-After"] == "1"
        for method, path in [
            ("GET", "/v0/topics"),
            ("GET", "/v0/topics/t"),
            ("PUT", "/v0/topics/t"),
            ("POST", "/v0/topics/t/diff"),
        ]:
            r = await client.open(path, method=method)
            err = await fail(r, 503, "not_ready")
            assert 0.0 <= err["detail"]["replay_progress"] <= 1.0
            assert int(r.headers["Retry-After"]) >= 1


async def test_while_draining(client, harness):
    harness.lifecycle.begin_drain()
    await check_health(client)
    for path in READY:
        r = await client.get(path)
        await fail(r, 503, "shutting_down")
        assert r.headers["Retry-After"] == "1"
    r = await client.post("/v0/topics/t", json={"records": [{"data": 1}]})
    await fail(r, 503, "shutting_down")
    assert int(r.headers["Retry-After"]) >= 1


@pytest.mark.parametrize("probe_auth", [False, True])
async def test_probe_auth(probe_auth):
    cfg = make_config(auth={"api_keys": ("wonly:w", "rd:r"), "probe_auth": probe_auth})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        for path in HEALTH + READY:
            r = await client.get(path)
            if probe_auth:
                await fail(r, 401, "unauthorized")
                await fail(
                    await client.get(path, headers={"Authorization": "Bearer bad"}),
                    401,
                    "unauthorized",
                )
            else:
                await ok(r)
                await ok(await client.get(path, headers={"Authorization": "Bearer bad"}))
            # any valid key will do: no scope is needed
            await ok(await client.get(path, headers={"Authorization": "Bearer wonly"}))
        # other routes still need a key
        await fail(await client.get("/v0/topics"), 401, "unauthorized")
