"""Client permits: control work first (scheduler spec R1.3).

Method: the permit pool alone, then through the full app (Quart test client, MockClock):
the permits are taken by the test itself so the pool's edges are exact.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from topicd.errors import Throttled
from topicd.http.app import gate_of
from topicd.offload import InlineOffload
from topicd.sched.classes import ClientPermits, give_back
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, make_config, open_app, open_durable_app


async def test_permits_then_bounded_waiters_then_429():
    pool = ClientPermits(2, 1, lambda: 700)
    a = await pool.admit()
    b = await pool.admit()
    assert pool.stats.in_use == 2
    got = []

    async def third() -> None:
        got.append(await pool.admit())

    async with trio.open_nursery() as n:
        n.start_soon(third)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.stats.waiting == 1
        with pytest.raises(Throttled) as exc:
            await pool.admit()  # a second waiter is one too many
        assert exc.value.detail == {"cause": "client_waiters", "retry_after_ms": 700}
        assert pool.stats.rejected == 1
        a.release()
        a.release()  # idempotent
    assert len(got) == 1 and pool.stats.in_use == 2 and pool.stats.waiting == 0
    b.release()
    got[0].release()
    assert pool.stats.in_use == 0
    assert pool.stats.peak_in_use == 2 and pool.stats.peak_waiting == 1


async def test_give_back_frees_the_current_requests_permit():
    pool = ClientPermits(1, 0, lambda: 250)
    permit = await pool.admit()
    token = ClientPermits.hold(permit)
    try:
        give_back()
        assert not permit.held and pool.stats.in_use == 0
        other = await pool.admit()  # the freed permit is usable at once
        other.release()
    finally:
        ClientPermits.unhold(token)
    permit.release()  # the gate's own release is a no-op now
    assert pool.stats.in_use == 0
    give_back()  # no request: nothing to do


async def test_saturated_permits_answer_429_but_probes_and_metrics_pass(autojump_clock):
    cfg = make_config(classes={"client_permits": 1, "client_waiters": 0})
    async with open_app(cfg) as h:
        c = h.app.test_client()
        pool = gate_of(h.app).permits
        assert pool is not None
        held = await pool.admit()
        r = await c.get("/v0/topics")
        assert r.status_code == 429
        body = await r.get_json()
        assert body["error"]["code"] == "throttled"
        assert body["error"]["detail"]["cause"] == "client_waiters"
        assert r.headers["Retry-After"] == "1"
        for path in ("/v0/health", "/healthz", "/v0/ready", "/readyz", "/v0/metrics"):
            assert (await c.get(path)).status_code == 200, path
        text = (await (await c.get("/v0/metrics")).get_data()).decode()
        assert 'topicd_throttled_total{cause="client_waiters"} 1.0' in text
        assert "topicd_client_permits_in_use 1.0" in text
        held.release()
        assert (await c.get("/v0/topics")).status_code == 200


async def test_a_parked_long_poll_holds_no_permit(autojump_clock):
    cfg = make_config(classes={"client_permits": 1, "client_waiters": 0})
    async with open_app(cfg) as h:
        c = h.app.test_client()
        await c.put("/v0/topics/t", json={})
        out = []

        async def poll() -> None:
            r = await c.post("/v0/topics/t/diff", json={"from_seq": 0, "wait_ms": 10000})
            out.append(await r.get_json())

        async with trio.open_nursery() as n:
            n.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            # the only permit is free while the poll is parked: the write gets it
            r = await c.post("/v0/topics/t", json={"records": [{"data": 1}]})
            assert r.status_code == 200
        assert [rec["$seq"] for rec in out[0]["records"]] == [1]


async def test_an_ack_waiting_for_its_sync_holds_no_permit(autojump_clock):
    """An ack only waits for its synced delete once it is logged: the permit goes back
    (otherwise fifty workers parked on group commits read as saturation, the governor
    widens the commit window, and the waits grow with it)."""
    cfg = durable_config(classes={"client_permits": 1, "client_waiters": 0})
    slow = [0.0]
    offload = InlineOffload(lambda group: slow[0])
    async with open_durable_app(FakeDisk(), cfg, offload=offload) as h:
        c = h.app.test_client()
        await c.put("/v0/topics/q", json={"type": "queue", "durability": "disk"})
        await c.post("/v0/topics/q", json={"records": [{"data": 1}]})
        r = await c.post("/v0/topics/q/claim", json={"node": "w", "max": 1})
        job = (await r.get_json())["claimed"][0]
        slow[0] = 1.0  # every WAL call now takes a virtual second
        out = []

        async def ack() -> None:
            body = {"node": "w", "seqs": [job["$seq"]], "lease_ids": [job["lease_id"]]}
            r = await c.post("/v0/topics/q/ack", json=body)
            out.append((r.status_code, await r.get_json()))

        async with trio.open_nursery() as n:
            n.start_soon(ack)
            await trio.testing.wait_all_tasks_blocked()
            assert not out  # parked on its sync
            t0 = trio.current_time()
            r = await c.get("/v0/topics")  # the only permit is free: no 429
            assert r.status_code == 200
            assert trio.current_time() == t0 and not out  # served while the ack waits
        assert out[0][0] == 200 and out[0][1]["acked"] == 1


async def test_the_pressure_header_reads_the_waiting_room_as_it_is(autojump_clock):
    """With `governor.admission_refuse_fill`, the server's pressure (each answer's
    `X-Topicd-Pressure`, `topicd_pressure`) is at least the waiting room's fill as it is
    read (s4's scale): a saturated server (one request waiting per permit) reads the
    client's soft threshold, and the pressure reaches 1.0 at the fill, ahead of the
    `429 client_waiters`. The governor's sampled value, which drives its ladder, is not
    changed by it."""
    cfg = make_config(
        classes={"client_permits": 1, "client_waiters": 8},
        governor={"admission_refuse_fill": 0.5},  # 1.0 at 4 of the 8 slots
    )
    async with open_app(cfg) as h, trio.open_nursery() as nursery:
        c = h.app.test_client()
        pool = gate_of(h.app).permits
        assert pool is not None
        held = await pool.admit()

        async def header() -> float:
            r = await c.get("/v0/health")
            return float(r.headers["X-Topicd-Pressure"])

        assert await header() == 0.0  # a permit taken, nobody waiting
        waiters: list[trio.CancelScope] = []
        expected = {1: 0.6, 2: 0.6 + 0.4 / 3, 3: 0.6 + 0.8 / 3, 4: 1.0, 5: 1.0}
        for n, want in expected.items():
            scope = trio.CancelScope()
            waiters.append(scope)

            async def wait(scope: trio.CancelScope = scope) -> None:
                with scope:
                    permit = await pool.admit()
                    permit.release()

            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.stats.waiting == n
            assert await header() == pytest.approx(want, abs=1e-3), n
            assert h.engine.pressure == pytest.approx(want)
            text = (await (await c.get("/v0/metrics")).get_data()).decode()
            assert f"topicd_pressure {h.engine.pressure}" in text
        assert h.engine.governor.pressure == 0.0  # the sampled value is its own
        for scope in waiters:
            scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert await header() == 0.0
        held.release()


async def test_without_a_refuse_fill_the_header_is_the_governors_pressure(autojump_clock):
    cfg = make_config(
        classes={"client_permits": 1, "client_waiters": 8},
        governor={"admission_refuse_fill": 0.0},
    )
    async with open_app(cfg) as h:
        c = h.app.test_client()
        pool = gate_of(h.app).permits
        assert pool is not None
        held = await pool.admit()
        async with trio.open_nursery() as waiters:
            for _ in range(3):
                waiters.start_soon(pool.admit)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.stats.waiting == 3
            r = await c.get("/v0/health")
            assert float(r.headers["X-Topicd-Pressure"]) == h.engine.pressure == 0.0
            assert h.engine.admission_now() == 0.0
            waiters.cancel_scope.cancel()
        held.release()
