"""The client against a real server: every call, typed errors, tombstones, retries.

Method: each test starts the whole app on the daemon's HTTP server on port 0 in this
process (`serve_in_process`, real clock, real sockets) and drives it only through
`topicd.client.Client`, asserting on what the client returns and on the server's state.
Retries against a real `429` use a server with one client permit and no waiter slot,
whose permit the test holds: every request is refused with `client_waiters` until the
test lets go.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
import msgspec
import pytest
import trio

from tests.server.helpers import served
from topicd.client import (
    BackpressurePolicy,
    CapacityError,
    CaughtUp,
    Client,
    InvalidRequest,
    NotAQueue,
    Record,
    RouterCycle,
    RouterNotFound,
    SyncClient,
    Throttled,
    Tombstone,
    TopicExistsIncompatible,
    TopicFull,
    TopicNotEmpty,
    TopicNotFound,
    Unauthorized,
)
from topicd.errors import Throttled as ServerThrottled
from topicd.http.app import gate_of
from topicd.testing.harness import make_config


@asynccontextmanager
async def server(**sections):
    cfg = make_config(server={"port": 0}, **sections)
    async with served(cfg) as (engine, app, host, port):
        yield engine, app, f"http://{host}:{port}"


@asynccontextmanager
async def connected(**sections):
    async with server(**sections) as (_engine, _app, url), Client(url) as c:
        yield c


async def test_topic_lifecycle():
    async with connected() as c:
        created = await c.put_topic("a", {"cap_records": 5})
        assert created["created"] is True and created["config"]["cap_records"] == 5
        assert (await c.put_topic("a", {"cap_records": 5}))["created"] is False
        state = await c.get_topic("a")
        assert (state["head_seq"], state["count"]) == (0, 0)
        await c.put_topic("b")
        assert [t["topic"] for t in await c.list_topics()] == ["a", "b"]
        assert [t["topic"] for t in await c.list_topics("b")] == ["b"]
        assert (await c.delete_topic("a"))["deleted"] is True
        assert (await c.delete_topic("a"))["deleted"] is False
        with pytest.raises(TopicNotFound) as info:
            await c.get_topic("a")
        assert info.value.detail == {"topic": "a"} and info.value.status == 404


async def test_list_topics_follows_every_page():
    async with connected() as c:
        for i in range(7):
            await c.put_topic(f"t{i}")
        names = [t["topic"] for t in await c.list_topics(page_size=2)]
        assert names == [f"t{i}" for i in range(7)]


async def test_writes_single_and_batched_with_exact_payloads():
    async with connected() as c:
        one = await c.write("w", {"x": 1}, tag="first", meta={"m": True})
        assert (one.first_seq, one.created, one.idempotency_key is not None) == (1, True, True)
        raw = msgspec.Raw(b'{"celsius":21.40,"big":123456789012345678901234567890}')
        batch = await c.write_batch("w", [{"data": raw}, {"data": None, "tag": "t"}])
        assert batch.seqs == (2, 3) and batch.count == 2
        recs = [e async for e in c.diff("w", include_tags=True)]
        assert [r.seq for r in recs] == [1, 2, 3]
        assert recs[0].tag == "first" and recs[0].meta == {"m": True}
        assert recs[1].data_json == b'{"celsius":21.40,"big":123456789012345678901234567890}'
        assert recs[1].data["big"] == 123456789012345678901234567890
        assert recs[2].data is None and recs[2].data_json == b"null"


async def test_the_generated_key_makes_a_repeat_a_dedupe_hit():
    async with connected() as c:
        first = await c.write("k", 1, idempotency_key="batch-1")
        again = await c.write("k", 1, idempotency_key="batch-1")
        assert (again.deduped, again.first_seq) == (True, first.first_seq)
        auto1 = await c.write("k", 2)
        auto2 = await c.write("k", 2)
        assert auto1.idempotency_key != auto2.idempotency_key
        assert (await c.get_topic("k"))["count"] == 3


async def test_diff_follows_next_from_seq_across_pages_and_surfaces_the_tombstone():
    async with connected() as c:
        await c.put_topic("d", {"cap_records": 10})
        await c.write_batch("d", [{"data": i} for i in range(25)])  # seqs 1..25; 1..15 evicted
        reader = c.diff("d", limit=4)
        events = [e async for e in reader]
        assert isinstance(events[0], Tombstone)
        tomb = events[0]
        assert (tomb.reason, tomb.gap_from, tomb.gap_to) == ("cap", 1, 15)
        assert [e.seq for e in events[1:]] == list(range(16, 26))
        assert reader.cursor == 25 and reader.caught_up
        # resuming from the cursor after more writes gives exactly the new records
        await c.write_batch("d", [{"data": "x"}, {"data": "y"}])
        more = [e.seq async for e in c.diff("d", reader.cursor)]
        assert more == [26, 27]


async def test_diff_cursor_moves_over_records_it_skips():
    async with connected() as c:
        await c.write_batch(
            "n", [{"data": 1, "node": "me"}, {"data": 2}, {"data": 3, "node": "me"}]
        )
        reader = c.diff("n", node="me")
        assert [e.seq async for e in reader] == [2]
        assert reader.cursor == 3


async def test_diff_surfaces_a_recreated_topic_and_rereads_the_new_instance():
    async with connected() as c:
        await c.write_batch("r", [{"data": i} for i in range(5)])
        await c.delete_topic("r")
        await c.write_batch("r", [{"data": "a"}, {"data": "b"}])
        reader = c.diff("r", 5)
        tomb = await reader.__anext__()
        assert isinstance(tomb, Tombstone) and tomb.reason == "recreated"
        assert (tomb.gap_from, tomb.gap_to, tomb.earliest_seq) == (1, 2, 1)
        assert reader.cursor == 0  # not gap_to: the new records are still to be read
        assert [e.data async for e in c.diff("r", reader.cursor)] == ["a", "b"]
        assert [e.data async for e in reader] == ["a", "b"]


async def test_watch_of_a_recreated_topic_delivers_the_new_instance():
    async with connected() as c:
        await c.write_batch("r", [{"data": i} for i in range(5)])
        await c.delete_topic("r")
        await c.write_batch("r", [{"data": "a"}, {"data": "b"}])
        events = []
        with trio.fail_after(10):
            async with c.watch({"r": 5}) as w:
                async for e in w:
                    events.append(e)
                    if isinstance(e, Tombstone):
                        assert w.cursors == {"r": 0}
                    if isinstance(e, CaughtUp):
                        break
        assert [type(e).__name__ for e in events] == ["Tombstone", "Record", "Record", "CaughtUp"]
        assert [e.data for e in events[1:3]] == ["a", "b"]


async def test_diff_follow_long_polls_for_the_next_append():
    async with connected() as c:
        await c.write("f", 1)
        got = []
        first = trio.Event()

        async def reader():
            async for e in c.diff("f", follow=True, wait_ms=5000):
                got.append(e.seq)
                first.set()
                if len(got) == 2:
                    return

        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                n.start_soon(reader)
                await first.wait()
                await c.write("f", 2)
        assert got == [1, 2]


async def test_watch_delivers_tombstones_records_and_caught_up():
    async with connected() as c:
        await c.put_topic("alerts", {"cap_records": 2})
        await c.write_batch("alerts", [{"data": i} for i in range(3)])
        await c.write("audit", "login")
        events = []
        async with c.watch({"alerts": 0, "audit": 0}) as w:
            with trio.fail_after(10):
                async for e in w:
                    events.append(e)
                    if isinstance(e, CaughtUp) and e.topic == "audit":
                        break
            assert w.cursors == {"alerts": 3, "audit": 1}
        kinds = [(type(e).__name__, e.topic) for e in events]
        assert kinds == [
            ("Tombstone", "alerts"),
            ("Record", "alerts"),
            ("Record", "alerts"),
            ("CaughtUp", "alerts"),
            ("Record", "audit"),
            ("CaughtUp", "audit"),
        ]
        assert events[0].reason == "from_seq_too_old" and (
            events[0].gap_from,
            events[0].gap_to,
        ) == (1, 1)


async def test_watch_tail_sees_only_new_records_and_ends_when_every_topic_is_deleted():
    async with connected() as c:
        await c.write("t", "old")
        events = []
        async with c.watch({"t": "tail"}) as w:
            with trio.fail_after(10):
                async for e in w:
                    events.append(e)
                    if isinstance(e, CaughtUp):
                        await c.write("t", "new")
                    elif isinstance(e, Record):
                        await c.delete_topic("t")
        names = [type(e).__name__ for e in events]
        assert names == ["CaughtUp", "Record", "TopicDeleted"]
        assert events[1].data == "new"


async def test_watch_of_an_unknown_topic_is_topic_not_found():
    async with connected() as c:
        with pytest.raises(TopicNotFound):
            async with c.watch({"nope": 0}) as w:
                await w.__anext__()


async def test_queue_claim_ack_nack_extend():
    async with connected() as c:
        await c.put_topic("q", {"type": "queue"})
        await c.write_batch("q", [{"data": {"job": i}} for i in range(3)])
        jobs = await c.claim("q", "w1", max=2, lease_ms=5000)
        assert [j.seq for j in jobs] == [1, 2] and jobs[0].data == {"job": 0}
        assert all(j.deliveries == 1 and j.lease_id.startswith("lease_") for j in jobs)
        ext = await c.extend("q", "w1", [1], lease_ms=9000, lease_ids=[jobs[0].lease_id])
        assert ext.done == 1 and "1" in ext.deadlines
        wrong = await c.ack("q", "w2", [1])
        assert (wrong.done, wrong.skipped) == (0, (1,))
        acked = await c.ack("q", "w1", [1], lease_ids=[jobs[0].lease_id])
        assert acked.done == 1 and acked.in_flight == 1
        nacked = await c.nack("q", "w1", [2])
        assert nacked.done == 1
        again = await c.claim("q", "w1", max=5)
        assert [(j.seq, j.deliveries) for j in again] == [(2, 2), (3, 1)]
        await c.put_topic("log")
        with pytest.raises(NotAQueue):
            await c.claim("log", "w1")


async def test_worker_heartbeats_keep_a_slow_job_leased_and_ack_it():
    async with connected() as c:
        await c.put_topic("jobs", {"type": "queue"})
        await c.write_batch("jobs", [{"data": i} for i in range(4)])
        seen = []

        async def handler(job):
            seen.append((job.seq, job.deliveries))
            if job.seq == 1:
                await trio.sleep(2.5)  # 2.5 leases: only the heartbeats keep it
            if job.seq == 3:
                raise RuntimeError("poison")

        with trio.fail_after(20):
            stats = await c.run_worker(
                "jobs",
                handler,
                node="w1",
                concurrency=2,
                lease_ms=1000,
                nack_delay_ms=60000,  # the failed job stays out of reach: the claims run dry
                stop_when_idle=True,
            )
        assert sorted(seen) == [(1, 1), (2, 1), (3, 1), (4, 1)]
        assert (stats.claimed, stats.acked, stats.failed, stats.nacked, stats.lost) == (
            4,
            3,
            1,
            1,
            0,
        )
        state = await c.get_topic("jobs")
        assert state["count"] == 1  # only the poison job is left
        assert (1, 2) not in seen  # seq 1 was never redelivered: the heartbeat held it


async def test_worker_surfaces_a_server_error_as_itself():
    async with connected() as c:
        await c.put_topic("plain")

        async def handler(job):
            raise AssertionError("never called")

        with pytest.raises(NotAQueue):
            await c.run_worker("plain", handler, node="w1", concurrency=3)


async def test_worker_cancels_a_handler_whose_lease_was_lost():
    async with connected() as c:
        await c.put_topic("lost", {"type": "queue"})
        await c.write("lost", "job")
        cancelled = trio.Event()

        async def handler(job):
            # another worker (same node name, no fence) acks it out from under us
            await c.ack("lost", "w1", [job.seq])
            try:
                await trio.sleep(30)
            finally:
                cancelled.set()

        with trio.fail_after(10):
            stats = await c.run_worker(
                "lost", handler, node="w1", lease_ms=300, stop_when_idle=True
            )
        assert cancelled.is_set() and stats.lost == 1 and stats.acked == 0


async def test_router_management():
    async with connected() as c:
        r = await c.put_router("pay->audit", "pay", "audit", guarantee="exactly_once")
        assert r["created"] is True and r["guarantee"] == "exactly_once"
        assert (await c.get_router("pay->audit"))["forwarded_total"] == 0
        await c.write("pay", {"amount": 5})
        copies = [e async for e in c.diff("audit")]
        assert [e.data for e in copies] == [{"amount": 5}]
        assert [x["router"] for x in await c.list_routers(source="pay")] == ["pay->audit"]
        with pytest.raises(RouterCycle):
            await c.put_router("audit->pay", "audit", "pay")
        with pytest.raises(TopicExistsIncompatible):
            await c.put_router("other->audit", "other", "audit")
        assert (await c.delete_router("pay->audit"))["deleted"] is True
        with pytest.raises(RouterNotFound):
            await c.get_router("pay->audit")


async def test_typed_errors_for_refusals():
    async with connected() as c:
        await c.put_topic("full", {"cap_records": 1, "discard": "reject"})
        await c.write("full", 1)
        with pytest.raises(TopicFull):
            await c.write("full", 2)
        with pytest.raises(TopicNotEmpty):
            await c.delete_topic("full", if_empty=True)
        with pytest.raises(InvalidRequest):
            await c.put_topic("bad name!")
        with pytest.raises(TopicNotFound):
            await c.write("absent", 1, create=False)


async def test_capacity_cap_is_a_capacity_error_not_retried():
    async with connected(limits={"max_topics": 1}) as c:
        await c.put_topic("one")
        t0 = trio.current_time()
        with pytest.raises(CapacityError) as info:
            await c.put_topic("two")
        assert info.value.detail["limit"] == "max_topics"
        assert trio.current_time() - t0 < 0.9  # no wait for its Retry-After: 1


async def test_auth_token_is_sent_and_a_missing_one_is_unauthorized():
    async with server(auth={"api_keys": ("s3cret",)}) as (_e, _a, url):
        async with Client(url) as anon:
            with pytest.raises(Unauthorized):
                await anon.list_topics()
        async with Client(url, token="s3cret") as c:
            await c.write("x", 1)
            async with c.watch({"x": 0}) as w:
                with trio.fail_after(10):
                    assert isinstance(await w.__anext__(), Record)


@asynccontextmanager
async def permit_held(app):
    """Hold the server's only client permit (waiting for the request that just finished
    to give it back first)."""
    pool = gate_of(app).permits
    with trio.fail_after(10):
        while True:
            try:
                held = await pool.admit()
                break
            except ServerThrottled:
                await trio.sleep(0.01)
    try:
        yield
    finally:
        held.release()


class CountingTransport(httpx.AsyncHTTPTransport):
    """The real transport, noting each answer's status (so a test can wait for a 429)."""

    def __init__(self):
        super().__init__()
        self.statuses = []
        self.refused = trio.Event()

    async def handle_async_request(self, request):
        resp = await super().handle_async_request(request)
        self.statuses.append(resp.status_code)
        if resp.status_code == 429:
            self.refused.set()
        return resp


async def test_a_real_pressure_429_is_retried_for_a_write_but_not_for_a_claim():
    async with server(classes={"client_permits": 1, "client_waiters": 0}) as (_e, app, url):
        transport = CountingTransport()
        policy = BackpressurePolicy(enabled=False)
        async with Client(url, policy=policy, transport=transport) as c:
            await c.put_topic("q", {"type": "queue"})
            result = []

            async def write():
                result.append(await c.write("q", "job"))

            with trio.fail_after(20):
                async with trio.open_nursery() as n, permit_held(app):
                    with pytest.raises(Throttled) as info:
                        await c.claim("q", "w1")
                    assert info.value.detail.get("cause") == "client_waiters"
                    assert info.value.retry_after_ms >= 1000
                    assert transport.statuses[-1] == 429
                    transport.refused = trio.Event()
                    n.start_soon(write)
                    await transport.refused.wait()  # the write's first attempt: 429
                    assert not result
                    # the permit is free again: the write's retry goes through
            assert result[0].first_seq == 1
            assert transport.statuses[-2:] == [429, 200]


def test_sync_client_round_trip():
    """The blocking facade, from a plain thread with its own Trio loop for the server."""

    async def main():
        async with server() as (_e, _a, url):

            def blocking():
                with SyncClient(url) as c:
                    c.put_topic("s")
                    c.write("s", {"n": 1}, tag="a")
                    c.write_batch("s", [{"data": 2}, {"data": 3}])
                    events = list(c.diff("s", include_tags=True))
                    assert [e.seq for e in events] == [1, 2, 3] and events[0].tag == "a"
                    watched = []
                    for e in c.watch({"s": 1}):
                        watched.append(e)
                        if isinstance(e, CaughtUp):
                            break
                    assert [type(e).__name__ for e in watched] == ["Record", "Record", "CaughtUp"]
                    assert [t["topic"] for t in c.list_topics()] == ["s"]

            await trio.to_thread.run_sync(blocking)

    trio.run(main)
