"""The worker loop's timing under `MockClock`: heartbeat cadence, fencing, idle polling.

Method: an `httpx.MockTransport` plays the queue (no sockets, autojump clock). Claims
hand out scripted jobs; extend, ack and nack answers are computed from what the worker
sends. Every request is recorded with its virtual time, so the tests assert exactly when
each heartbeat went out and what it carried.
"""

from __future__ import annotations

import itertools
import random

import httpx
import msgspec
import pytest
import trio
import trio.lowlevel

from topicd.client import BackpressurePolicy, Client


class Queue:
    def __init__(self, jobs, lost_after=None):
        self.jobs = list(jobs)  # seqs handed out one per claim
        self.lost_after = lost_after  # extends answered `skipped` from this count on
        self.calls = []
        self.extends = 0

    def __call__(self, request: httpx.Request):
        body = msgspec.json.decode(request.content)
        verb = request.url.path.rsplit("/", 1)[1]
        self.calls.append((trio.current_time(), verb, body))
        if verb == "claim":
            claimed = []
            if self.jobs:
                seq = self.jobs.pop(0)
                claimed = [
                    {
                        "$seq": seq,
                        "$ts": 1,
                        "lease_id": f"lease_{seq:x}",
                        "deadline": 9,
                        "deliveries": 1,
                        "data": seq,
                    }
                ]
            return httpx.Response(
                200, json={"topic": "q", "claimed": claimed, "count": len(claimed), "ready": 0}
            )
        seqs = body["seqs"]
        if verb == "extend":
            self.extends += 1
            if self.lost_after is not None and self.extends >= self.lost_after:
                return httpx.Response(200, json={"extended": 0, "skipped": seqs, "deadlines": {}})
            return httpx.Response(
                200,
                json={"extended": len(seqs), "skipped": [], "deadlines": {str(s): 1 for s in seqs}},
            )
        key = {"ack": "acked", "nack": "nacked"}[verb]
        return httpx.Response(200, json={key: len(seqs), "skipped": [], "ready": 0, "in_flight": 0})


def client(queue):
    return Client(
        "http://topicd.test",
        transport=httpx.MockTransport(queue),
        rng=random.Random(1),
        policy=BackpressurePolicy(enabled=False),
    )


async def test_heartbeats_every_third_of_the_lease_then_a_fenced_ack(autojump_clock):
    queue = Queue([7])

    async def handler(job):
        await trio.sleep(9.5)

    async with client(queue) as c:
        t0 = trio.current_time()
        stats = await c.run_worker("q", handler, node="w", lease_ms=3000, stop_when_idle=True)
    calls = [(round(t - t0, 6), verb) for t, verb, _ in queue.calls]
    assert calls == [(0.0, "claim")] + [(float(i), "extend") for i in range(1, 10)] + [
        (9.5, "ack"),
        (9.5, "claim"),
    ]
    extend = queue.calls[1][2]
    assert extend == {"node": "w", "seqs": [7], "lease_ms": 3000, "lease_ids": ["lease_7"]}
    assert queue.calls[-2][2] == {"node": "w", "seqs": [7], "lease_ids": ["lease_7"]}
    assert (stats.claimed, stats.acked, stats.lost) == (1, 1, 0)


async def test_a_lost_lease_cancels_the_handler_at_that_heartbeat(autojump_clock):
    queue = Queue([1], lost_after=2)
    stopped = []

    async def handler(job):
        try:
            await trio.sleep(60)
        finally:
            stopped.append(trio.current_time())

    async with client(queue) as c:
        t0 = trio.current_time()
        stats = await c.run_worker("q", handler, node="w", lease_ms=3000, stop_when_idle=True)
    assert stopped == [pytest.approx(t0 + 2.0)]
    assert [verb for _, verb, _ in queue.calls] == ["claim", "extend", "extend", "claim"]
    assert (stats.acked, stats.lost) == (0, 1)


async def test_a_failing_handler_is_nacked_with_the_delay(autojump_clock):
    queue = Queue([4])

    async def handler(job):
        raise ValueError("bad job")

    async with client(queue) as c:
        stats = await c.run_worker("q", handler, node="w", nack_delay_ms=5000, stop_when_idle=True)
    nack = next(body for _, verb, body in queue.calls if verb == "nack")
    assert nack == {"node": "w", "seqs": [4], "delay_ms": 5000, "lease_ids": ["lease_4"]}
    assert (stats.failed, stats.nacked, stats.acked) == (1, 1, 0)


async def test_an_empty_queue_is_polled_every_idle_poll(autojump_clock):
    queue = Queue([])

    async def handler(job):
        raise AssertionError("no job to handle")

    async with client(queue) as c:
        with trio.move_on_after(1.1):
            await c.run_worker("q", handler, node="w", idle_poll_ms=250)
    times = [round(t, 6) for t, _, _ in queue.calls]
    assert [b - a for a, b in itertools.pairwise(times)] == pytest.approx([0.25] * 4)
