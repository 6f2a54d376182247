"""Which requests the client retries, and how long it waits: scripted answers under
`MockClock`.

Method: an `httpx.MockTransport` plays the server (no sockets, so Trio's autojump clock
is safe): each test scripts a sequence of answers or transport failures and records the
virtual time of every request. Jitter comes from a seeded `random.Random` whose draws the
test repeats, so every wait is asserted exactly: `max(Retry-After·1000,
detail.retry_after_ms)` stretched by the jitter draw. The real-server side of the same
rules is in `test_contract.py`.
"""

from __future__ import annotations

import contextlib
import itertools
import random

import httpx
import msgspec
import pytest
import trio
import trio.testing

from topicd.client import (
    BackpressurePolicy,
    CapacityError,
    Client,
    ConnectionFailed,
    LoopClock,
    NotReady,
    StorageUnavailable,
    Throttled,
    TopicFull,
)
from topicd.client.backpressure import Observation, shared_board

WRITE_OK = {
    "topic": "t",
    "first_seq": 1,
    "last_seq": 1,
    "seqs": [1],
    "head_seq": 1,
    "count": 1,
    "created": False,
    "deduped": False,
}


def err(status, code, detail=None, retry_after=None, pressure="0.100"):
    body = {"error": {"code": code, "message": code}}
    if detail:
        body["error"]["detail"] = detail
    headers = {"x-topicd-pressure": pressure}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    return httpx.Response(status, json=body, headers=headers)


def ok(body, pressure="0.100"):
    return httpx.Response(200, json=body, headers={"x-topicd-pressure": pressure})


class Script:
    """Answers in order; each entry is a response or an exception to raise."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = []  # (virtual time, method, path, body)

    def __call__(self, request: httpx.Request):
        body = msgspec.json.decode(request.content) if request.content else None
        self.calls.append((trio.current_time(), request.method, request.url.path, body))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def client(script, seed=7, **policy):
    policy.setdefault("enabled", False)  # the delay law is tested on its own
    return Client(
        "http://topicd.test",
        transport=httpx.MockTransport(script),
        rng=random.Random(seed),
        policy=BackpressurePolicy(**policy),
    )


def jitters(seed, n, spread=0.2):
    rng = random.Random(seed)
    return [1 + rng.uniform(0, spread) for _ in range(n)]


def gaps(script):
    times = [t for t, *_ in script.calls]
    return [b - a for a, b in itertools.pairwise(times)]


async def test_pressure_429_is_retried_after_the_larger_hint_plus_jitter(autojump_clock):
    script = Script(
        err(429, "throttled", {"retry_after_ms": 2500}, retry_after=3),  # header wins: 3000
        err(429, "throttled", {"cause": "wal_ingest", "retry_after_ms": 4200}, retry_after=1),
        ok(WRITE_OK),
    )
    async with client(script) as c:
        res = await c.write("t", {"a": 1})
    j = jitters(7, 2)
    assert gaps(script) == pytest.approx([3.0 * j[0], 4.2 * j[1]])
    keys = {call[3]["idempotency_key"] for call in script.calls}
    assert len(keys) == 1 and res.idempotency_key in keys  # one key across the retries


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (
            err(503, "storage_unavailable", {"retry_after_ms": 1000}, retry_after=1),
            StorageUnavailable,
        ),
        (err(503, "not_ready", {"replay_progress": 0.5}, retry_after=1), NotReady),
    ],
)
async def test_every_503_is_retried_up_to_max_retries_then_surfaces(autojump_clock, answer, error):
    script = Script(*[answer] * 4)
    async with client(script, max_retries=3) as c:
        with pytest.raises(error):
            await c.write("t", 1)
    assert len(script.calls) == 4
    assert gaps(script) == pytest.approx([x * 1.0 for x in jitters(7, 3)])


async def test_a_capacity_429_is_never_retried(autojump_clock):
    script = Script(err(429, "throttled", {"limit": "max_topics", "max": 3}, retry_after=1))
    async with client(script) as c:
        with pytest.raises(CapacityError) as info:
            await c.write("t", 1)
    assert info.value.detail == {"limit": "max_topics", "max": 3}
    assert isinstance(info.value, Throttled)
    assert len(script.calls) == 1


async def test_topic_full_is_never_retried(autojump_clock):
    script = Script(err(422, "topic_full", {"topic": "t"}))
    async with client(script) as c:
        with pytest.raises(TopicFull):
            await c.write("t", 1)
    assert len(script.calls) == 1


async def test_a_write_without_idempotency_key_is_not_retried(autojump_clock):
    script = Script(err(503, "storage_unavailable", {"retry_after_ms": 10}, retry_after=1))
    async with client(script) as c:
        with pytest.raises(StorageUnavailable):
            await c.write("t", 1, idempotency_key=None)
    assert len(script.calls) == 1
    assert "idempotency_key" not in script.calls[0][3]


async def test_a_claim_is_not_retried(autojump_clock):
    script = Script(err(429, "throttled", {"retry_after_ms": 10}, retry_after=1))
    async with client(script) as c:
        with pytest.raises(Throttled):
            await c.claim("q", "w1")
    assert len(script.calls) == 1


async def test_a_lost_answer_retries_only_safe_requests(autojump_clock):
    lost = httpx.ReadError("connection reset")
    script = Script(lost, ok(WRITE_OK), lost)
    async with client(script) as c:
        await c.write("t", 1)  # keyed write: retried
        with pytest.raises(ConnectionFailed):
            await c.claim("q", "w1")  # may have leased jobs: not retried
    assert [call[2] for call in script.calls] == [
        "/v0/topics/t",
        "/v0/topics/t",
        "/v0/topics/q/claim",
    ]
    assert gaps(script)[0] == pytest.approx(0.05 * jitters(7, 1)[0])


async def test_a_refused_connection_is_retried_for_any_request(autojump_clock):
    refused = httpx.ConnectError("refused")
    script = Script(refused, refused, ok({"topic": "q", "claimed": [], "count": 0, "ready": 0}))
    async with client(script) as c:
        assert await c.claim("q", "w1") == []
    j = jitters(7, 2)
    assert gaps(script) == pytest.approx([0.05 * j[0], 0.1 * j[1]])


async def test_transport_backoff_doubles_to_its_cap_then_gives_up(autojump_clock):
    refused = httpx.ConnectError("refused")
    script = Script(*[refused] * 9)
    async with client(script, seed=1, retry_jitter=0) as c:
        t0 = trio.current_time()
        with pytest.raises(ConnectionFailed):
            await c.get_topic("t")
    assert len(script.calls) == 9  # 1 + max_retries
    assert gaps(script) == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert trio.current_time() - t0 == pytest.approx(7.15)


async def test_reads_puts_and_deletes_are_retried(autojump_clock):
    busy = err(503, "shutting_down", retry_after=1)
    script = Script(
        busy,
        ok({"topic": "t"}),  # GET
        busy,
        ok({"topic": "t", "created": True}),  # PUT
        busy,
        ok({"topic": "t", "deleted": True}),  # DELETE
        busy,
        ok({"acked": 1, "skipped": [], "ready": 0, "in_flight": 0}),  # ack
    )
    async with client(script, retry_jitter=0) as c:
        await c.get_topic("t")
        await c.put_topic("t")
        await c.delete_topic("t")
        await c.ack("q", "w1", [1])
    assert [m for _, m, _, _ in script.calls] == ["GET"] * 2 + ["PUT"] * 2 + ["DELETE"] * 2 + [
        "POST"
    ] * 2


async def test_a_tag_matching_record_delete_is_not_retried(autojump_clock):
    script = Script(
        err(503, "storage_unavailable", retry_after=1),
        err(503, "storage_unavailable", retry_after=1),
        ok({"deleted": 0}),
    )
    async with client(script, retry_jitter=0) as c:
        with pytest.raises(StorageUnavailable):
            await c.delete_records("t", match="a*")
        await c.delete_records("t", before_seq=5)  # a seq bound is: retried once
    assert len(script.calls) == 3


async def test_every_answer_stamps_pressure_and_lease_answers_stamp_in_flight(autojump_clock):
    script = Script(
        err(404, "topic_not_found", {"topic": "t"}, pressure="0.420"),
        ok({"topic": "q", "nacked": 1, "skipped": [], "ready": 3, "in_flight": 77}, pressure="0.5"),
    )
    async with client(script) as c:
        with pytest.raises(Exception, match="topic_not_found"):
            await c.get_topic("t")
        assert c.signals.fresh_pressure() == pytest.approx(0.42)
        await c.nack("q", "w1", [1])
        assert c.signals.fresh_in_flight("q") == 77
        assert c.signals.fresh_pressure() == pytest.approx(0.5)


async def test_writes_to_a_queue_pass_the_delay_law_with_its_in_flight(autojump_clock):
    """The in-flight count is read from the queue's state (touch=false) before a write,
    at most once per `inflight_poll_ms`, and delays the batch by the law."""
    state = ok(
        {"topic": "q", "type": "queue", "queue": {"ready": 0, "in_flight": 125, "dead_lettered": 0}}
    )
    script = Script(state, ok(WRITE_OK), ok(WRITE_OK), state, ok(WRITE_OK))
    async with client(script, enabled=True) as c:
        t0 = trio.current_time()
        await c.write("q", 1)  # GET state, wait 250 ms, POST
        await c.write("q", 2)  # fresh (250 ms old): no GET, wait 250 ms
        await trio.sleep(1.0)
        await c.write("q", 3)  # 1.5 s old: GET again
    calls = [(round(t - t0, 6), m, p) for t, m, p, _ in script.calls]
    assert calls == [
        (0.0, "GET", "/v0/topics/q"),
        (0.25, "POST", "/v0/topics/q"),
        (0.5, "POST", "/v0/topics/q"),
        (1.5, "GET", "/v0/topics/q"),
        (1.75, "POST", "/v0/topics/q"),
    ]


async def test_a_log_topic_is_probed_once(autojump_clock):
    log_state = ok({"topic": "t", "type": "log"})
    script = Script(log_state, ok(WRITE_OK), ok(WRITE_OK))
    async with client(script, enabled=True) as c:
        await c.write("t", 1)
        await trio.sleep(5)
        await c.write("t", 2)
    assert [m for _, m, _, _ in script.calls] == ["GET", "POST", "POST"]


async def test_a_failed_in_flight_refresh_is_one_attempt_and_no_signal(autojump_clock):
    script = Script(err(503, "shutting_down", retry_after=1), ok(WRITE_OK))
    async with client(script, enabled=True) as c:
        t0 = trio.current_time()
        await c.write("q", 1)
        assert trio.current_time() == t0  # no retry wait, no delay: no signal
    assert [m for _, m, _, _ in script.calls] == ["GET", "POST"]


async def test_disable_backpressure_skips_the_delay_law_and_tells_the_server(autojump_clock):
    script = Script(ok(WRITE_OK, pressure="0.99"), ok(WRITE_OK))
    async with client(script, enabled=True) as c:
        c.signals.observe_pressure("0.99")  # a pause for any other write
        c._kinds["t"] = "log"
        t0 = trio.current_time()
        await c.write("t", 1, disable_backpressure=True)
        assert trio.current_time() == t0
    assert script.calls[0][3]["disable_backpressure"] is True


def paused_then_calm(probes):
    """A server whose health probes read 0.95 nine times, then 0.10 (each probe's time
    appended to `probes`); writes read 0.10."""

    def server(request):
        if request.url.path == "/v0/health":
            probes.append(trio.current_time())
            pressure = "0.95" if len(probes) < 10 else "0.10"
            return ok({"status": "ok"}, pressure=pressure)
        return ok(WRITE_OK, pressure="0.10")

    return server


async def test_paused_producers_share_one_probe_per_poll_interval(autojump_clock):
    """Twenty producers paused together probe `/v0/health` about once per
    `hard_poll_ms` between them, not twenty times."""
    probes = []
    server = paused_then_calm(probes)

    c = Client(
        "http://topicd.test",
        transport=httpx.MockTransport(server),
        policy=BackpressurePolicy(),
    )
    async with c:
        c.signals.observe_pressure("0.95")
        c._kinds["t"] = "log"
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for _ in range(20):
                n.start_soon(c.write, "t", 1)
        assert trio.current_time() - t0 == pytest.approx(1.0)
    assert len(probes) == 10
    assert [round(p - t0, 6) for p in probes] == [round(0.1 * i, 6) for i in range(1, 11)]


async def test_writes_starting_together_share_one_state_read(autojump_clock):
    """Eight writes of one client to a topic it has not seen yet read its state once
    between them (not eight reads into a server they are about to load)."""
    gets = []

    def server(request):
        if request.method == "GET":
            gets.append(trio.current_time())
            return ok({"topic": "t", "type": "log"})
        return ok(WRITE_OK)

    c = Client(
        "http://topicd.test", transport=httpx.MockTransport(server), policy=BackpressurePolicy()
    )
    async with c, trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(c.write, "t", i)
    assert len(gets) == 1


async def test_writes_that_waited_for_a_failed_state_read_do_not_repeat_it(autojump_clock):
    script = Script(err(503, "shutting_down", retry_after=1), *[ok(WRITE_OK)] * 4)
    async with client(script, enabled=True) as c, trio.open_nursery() as n:
        for i in range(4):
            n.start_soon(c.write, "q", i)
    assert [m for _, m, _, _ in script.calls] == ["GET"] + ["POST"] * 4


async def test_a_write_asks_for_no_seq_list_and_derives_its_seqs(autojump_clock):
    """The seqs of one write are consecutive: the client asks the server not to list
    them (`return_seqs=false`) and answers them from `first_seq`..`last_seq`."""
    urls = []

    def server(request):
        urls.append(request.url)
        body = {k: v for k, v in WRITE_OK.items() if k != "seqs"}
        return ok(body | {"first_seq": 41, "last_seq": 43, "head_seq": 43, "count": 3})

    c = Client("http://topicd.test", transport=httpx.MockTransport(server), policy=P_OFF)
    async with c:
        res = await c.write_batch("t", [{"data": i} for i in range(3)])
    assert urls[0].params["return_seqs"] == "false"
    assert res.seqs == (41, 42, 43) and (res.first_seq, res.last_seq) == (41, 43)


P_OFF = BackpressurePolicy(enabled=False)


async def test_an_old_amber_reading_is_re_read_with_a_health_probe(autojump_clock):
    script = Script(ok({"status": "ok"}, pressure="0.100"), ok(WRITE_OK))
    async with client(script, enabled=True) as c:
        c._kinds["t"] = "log"
        c.signals.observe_pressure("0.750")
        await trio.sleep(0.5)
        t0 = trio.current_time()
        await c.write("t", 1)
        assert trio.current_time() == t0  # the probe read 0.1: no delay
    assert [(m, p) for _, m, p, _ in script.calls] == [
        ("GET", "/v0/health"),
        ("POST", "/v0/topics/t"),
    ]


async def test_a_green_reading_is_re_read_while_the_clients_write_is_unanswered(
    autojump_clock,
):
    """The client counts its writes waiting for an answer; a batch that decides on a
    green reading 200 ms old while one is outstanding probes first, and waits the
    delay of what the probe read."""
    calls = []
    release = trio.Event()

    async def server(request):
        calls.append((trio.current_time(), request.method, request.url.path))
        if request.url.path == "/v0/health":
            return ok({"status": "ok"}, pressure="0.750")
        if len(calls) == 1:
            await release.wait()  # the first write is answered late
        return ok(WRITE_OK, pressure="0.300")

    c = Client(
        "http://topicd.test", transport=httpx.MockTransport(server), policy=BackpressurePolicy()
    )
    async with c:
        c._kinds["t"] = "log"
        c.signals.observe_pressure("0.300")
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(c.write, "t", 1)
            await trio.sleep(0.2)
            assert c.signals.writes_unanswered == 1
            await c.write("t", 2)
            release.set()
        assert c.signals.writes_unanswered == 0
    assert [(round(t - t0, 6), m, p) for t, m, p in calls] == [
        (0.0, "POST", "/v0/topics/t"),
        (0.2, "GET", "/v0/health"),  # the re-read: 0.75, a 250 ms delay
        (0.3, "GET", "/v0/health"),  # re-read as it gets 100 ms old while waited
        (0.4, "GET", "/v0/health"),
        (0.45, "POST", "/v0/topics/t"),
    ]


async def test_a_write_that_fails_in_transport_is_no_longer_counted(autojump_clock):
    script = Script(httpx.ConnectError("refused"), ok(WRITE_OK))
    async with client(script) as c:
        await c.write("t", 1)
        assert c.signals.writes_unanswered == 0
    assert len(script.calls) == 2


async def test_clients_of_one_loop_and_server_share_pressure_and_its_probes(autojump_clock):
    """Twenty clients of the same server in one loop, paused together, read one board:
    the answer one gets is every one's reading, and they probe `/v0/health` about once
    per `hard_poll_ms` between them, not once each. A client of another URL, one with
    `share_pressure=False` and one with its own clock keep their own readings."""
    probes = []
    server = paused_then_calm(probes)

    def make(url="http://topicd.test", **kw):
        c = Client(url, transport=httpx.MockTransport(server), policy=BackpressurePolicy(), **kw)
        c._kinds["t"] = "log"
        return c

    clients = [make() for _ in range(20)]
    other, private = make("http://other.test"), make(share_pressure=False)
    own_clock = make(clock=LoopClock())
    async with contextlib.AsyncExitStack() as stack:
        for c in [*clients, other, private, own_clock]:
            await stack.enter_async_context(c)
        # a reading on the loop's board for that URL (as one of them would have got)
        board = shared_board("http://topicd.test")
        board.pressure = Observation(0.95, trio.current_time())
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for c in clients:
                n.start_soon(c.write, "t", 1)
        assert trio.current_time() - t0 == pytest.approx(1.0)
        assert len(probes) == 10
        assert [round(p - t0, 6) for p in probes] == [round(0.1 * i, 6) for i in range(1, 11)]
        assert all(c.signals.board is board for c in clients)
        for c in (other, private, own_clock):
            await c.write("t", 1)  # green at once: none of them read the pause
            assert c.signals.board is not board
            assert c.signals.pressure is not None and c.signals.pressure.value == 0.10
        assert len(probes) == 10
        assert trio.current_time() - t0 == pytest.approx(1.0)


def test_each_event_loop_starts_with_no_shared_reading():
    """The board lives in the event loop's run (a new loop, as each test's, starts with
    none): a reading left by one loop never reaches a client of the next (which would
    pause on it and probe)."""
    paths = []

    async def once(pressure):
        def server(request):
            paths.append(request.url.path)
            return ok(WRITE_OK if request.method == "POST" else {"status": "ok"}, pressure)

        async with Client("http://topicd.test", transport=httpx.MockTransport(server)) as c:
            c._kinds["t"] = "log"
            await c.write("t", 1)
            assert c.signals.pressure is not None and c.signals.pressure.value == float(pressure)

    trio.run(once, "0.950", clock=trio.testing.MockClock(autojump_threshold=0))
    trio.run(once, "0.100", clock=trio.testing.MockClock(autojump_threshold=0))
    assert paths == ["/v0/topics/t", "/v0/topics/t"]  # no probe
