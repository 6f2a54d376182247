"""Contract tests for a queue's depth levels and its retry backoff (topicd extensions).

Method: black-box through Quart's test client on an in-process app under
`autojump_clock`. Depth levels: a queue with `depth_soft_limit` is filled step by step
and each write's answer is checked against the level its depth implies (normal below
0.70, warning, critical from 0.85, overflow above 0.95, each left 0.05 below its lower
bound); `retry_after_ms` is checked against the ack rate the test produced.
Backoff: a job's lease expires or it is nacked, and `ready` is read at the exact
virtual times the attempts² schedule names.
"""

from __future__ import annotations

import json

import pytest
import trio

from topicd.testing.fake_clock import advance
from topicd.testing.harness import make_config, open_app


async def put(client, name: str = "q", **cfg) -> dict:
    r = await client.put(f"/v0/topics/{name}", json={"type": "queue", **cfg})
    assert r.status_code in (200, 201), await r.get_data()
    return (await r.get_json())["config"]


async def write(client, n: int = 1, name: str = "q", **kw):
    return await client.post(
        f"/v0/topics/{name}", json={"records": [{"data": i} for i in range(n)], **kw}
    )


async def ok(r) -> dict:
    raw = await r.get_data()
    assert r.status_code in (200, 201), raw
    return json.loads(raw)


async def throttled(r) -> dict:
    raw = await r.get_data()
    assert r.status_code == 429, raw
    err = json.loads(raw)["error"]
    assert err["code"] == "throttled"
    assert set(err["detail"]) == {"cause", "retry_after_ms"}
    assert err["detail"]["cause"] == "queue_depth"
    assert r.headers["Retry-After"] == str(-(-err["detail"]["retry_after_ms"] // 1000))
    return err["detail"]


async def op(client, verb: str, **kw) -> dict:
    return await ok(await client.post(f"/v0/topics/q/{verb}", json={"node": "w", **kw}))


async def ready(client) -> int:
    return (await (await client.get("/v0/topics/q")).get_json())["queue"]["ready"]


# ---- config -------------------------------------------------------------------------------


async def test_extension_fields_are_echoed_only_when_set(client):
    cfg = await put(client)
    assert not {"depth_soft_limit", "retry_backoff_ms", "retry_backoff_max_ms"} & set(cfg)
    cfg = await put(client, depth_soft_limit=10, retry_backoff_ms=50, retry_backoff_max_ms=900)
    assert (cfg["depth_soft_limit"], cfg["retry_backoff_ms"], cfg["retry_backoff_max_ms"]) == (
        10,
        50,
        900,
    )
    r = await client.put("/v0/topics/q", json={"type": "queue", "depth_soft_limit": -1})
    assert r.status_code == 400
    r = await client.put("/v0/topics/q", json={"type": "queue", "retry_backoff_ms": "1"})
    assert r.status_code == 400


# ---- depth levels -------------------------------------------------------------------------


async def test_levels_gate_new_jobs_from_critical_on(client, harness, autojump_clock):
    await put(client, depth_soft_limit=100)
    await ok(await write(client, 84))  # ratio 0.84: warning
    await ok(await write(client, 1))  # 0.84 at admission: still admitted, now 0.85
    detail = await throttled(await write(client, 1))  # critical
    # no acks measured: rate floor 1/s, (85 - 70) / 1 s = 15 s
    assert detail["retry_after_ms"] == 15000
    level = harness.engine.saturation.queues["jobs.q"]
    assert level.level == 2
    # disable_backpressure skips the check at critical
    await ok(await write(client, 10, disable_backpressure=True))  # 95: still critical
    await ok(await write(client, 1, disable_backpressure=True))  # 96 after: overflow next
    r = await client.get("/v0/metrics")
    text = (await r.get_data()).decode()
    assert 'topicd_queue_capacity{queue="jobs.q"} 100.0' in text
    assert 'topicd_throttled_total{cause="queue_depth"} 1.0' in text


async def test_hysteresis_leaves_critical_only_below_its_bound_minus_005(client, autojump_clock):
    await put(client, depth_soft_limit=100, lease_ms=60000)
    await ok(await write(client, 86))
    await throttled(await write(client))
    claimed = await op(client, "claim", max=5)  # depth 81 (ratio 0.81 > 0.80)
    assert len(claimed["claimed"]) == 5
    await throttled(await write(client))
    await op(client, "claim", max=1)  # depth 80: still not below 0.80
    await throttled(await write(client))
    await op(client, "claim", max=1)  # 79: below 0.80, warning
    await ok(await write(client))


async def test_retry_after_follows_the_measured_ack_rate(client, autojump_clock):
    await put(client, depth_soft_limit=100, lease_ms=60000)
    await ok(await write(client, 120, disable_backpressure=True))  # depth 120 at most here
    for _ in range(10):  # 10 acks of 10 jobs, one per second
        got = await op(client, "claim", max=10)
        await op(client, "ack", seqs=[j["$seq"] for j in got["claimed"]])
        await advance(autojump_clock, 1)
    # 20 jobs left; ack rate ~ 100 acks over ~10 s of a 10 s EWMA
    await ok(await write(client, 80, disable_backpressure=True))  # 100: overflow
    detail = await throttled(await write(client))
    # (100 - 70) / rate; rate = sum(10/10 * e^(-k/10) for k = 1..10) ≈ 6.0 per second
    rate = sum(1.0 * 2.718281828459045 ** (-k / 10) for k in range(1, 11))
    assert detail["retry_after_ms"] == round(1000 * 30 / rate)


async def test_retry_after_is_clamped(nursery, autojump_clock):
    cfg = make_config(queue={"depth_retry_min_ms": 700, "depth_retry_max_ms": 9000})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        await put(client, depth_soft_limit=1000)
        await ok(await write(client, 900))
        assert (await throttled(await write(client)))["retry_after_ms"] == 9000
        await put(client, depth_soft_limit=20)
        # 900 jobs, soft 20: still clamped at the top; a tiny excess is clamped below
        assert (await throttled(await write(client)))["retry_after_ms"] == 9000


async def test_overflow_bypass_waits_for_the_level_then_429(client, harness, autojump_clock):
    await put(client, depth_soft_limit=10, lease_ms=60000)
    await ok(await write(client, 10, disable_backpressure=True))  # ratio 1.0: overflow
    t0 = trio.current_time()
    await throttled(await write(client, disable_backpressure=True))
    assert trio.current_time() - t0 == 30.0  # backpressure.bypass_wait_ms
    # a claim during the wait drops the level below overflow (0.89): the write proceeds
    results: list[int] = []

    async def bypassing_write() -> None:
        r = await write(client, disable_backpressure=True)
        results.append(r.status_code)

    async with trio.open_nursery() as n:
        n.start_soon(bypassing_write)
        await advance(autojump_clock, 2)
        assert results == []
        await op(client, "claim", max=2)  # depth 8: 0.80, below 0.90
    assert results == [200]
    assert trio.current_time() - t0 == 32.0


async def test_levels_off_by_default_and_on_log_topics(client, autojump_clock):
    await put(client)
    await ok(await write(client, 5000))
    r = await client.put("/v0/topics/log", json={"depth_soft_limit": 1})
    assert r.status_code == 201
    await ok(await write(client, 5, name="log"))
    await ok(await write(client, 5, name="log"))


# ---- retry backoff ------------------------------------------------------------------------


async def test_expired_and_nacked_jobs_back_off_by_deliveries_squared(client, autojump_clock):
    await put(client, retry_backoff_ms=1000, retry_backoff_max_ms=3000, lease_ms=500)
    await ok(await write(client))
    t0 = trio.current_time()
    await op(client, "claim")
    await advance(autojump_clock, 0.5 + 0.001)  # the lease expired: 1000 * 1^2 ms of backoff
    assert await ready(client) == 0
    await advance(autojump_clock, 0.999)
    assert await ready(client) == 0
    await advance(autojump_clock, 0.001)
    assert await ready(client) == 1
    assert trio.current_time() - t0 == pytest.approx(1.501)  # from the expiry: 0.501 + 1
    got = await op(client, "claim")
    assert got["claimed"][0]["deliveries"] == 2
    await op(client, "nack", seqs=[1])  # no delay_ms: min(1000 * 2^2, 3000) = 3 s
    assert await ready(client) == 0
    await advance(autojump_clock, 2.999)
    assert await ready(client) == 0
    await advance(autojump_clock, 0.001)
    assert await ready(client) == 1
    await op(client, "claim")
    await op(client, "nack", seqs=[1], delay_ms=100)  # an explicit delay wins
    await advance(autojump_clock, 0.1)
    assert await ready(client) == 1


async def test_no_backoff_by_default(client, autojump_clock):
    await put(client, lease_ms=500)
    await ok(await write(client))
    await op(client, "claim")
    await op(client, "nack", seqs=[1])
    assert await ready(client) == 1
    await op(client, "claim")
    await advance(autojump_clock, 0.501)
    assert await ready(client) == 1


async def test_a_queue_leaves_the_registry_when_its_limit_goes(client, harness, autojump_clock):
    await put(client, depth_soft_limit=10)
    assert "jobs.q" in harness.engine.saturation.queues
    await put(client)  # the limit back to 0: levels off
    assert "jobs.q" not in harness.engine.saturation.queues
    await put(client, depth_soft_limit=10)
    r = await client.delete("/v0/topics/q")
    assert r.status_code == 200
    assert "jobs.q" not in harness.engine.saturation.queues
