"""The watch stream's reconnect protocol, frame by frame, under `MockClock`.

Method: an `httpx.MockTransport` plays the server (no sockets, so the autojump clock is
safe). `POST /v0/watch` answers are scripted; each `GET /v0/watch/:wid` is answered by the
next scripted stream: a list of byte chunks and actions (`DROP` raises a transport error
mid-stream, `SILENCE` never sends again). Every request is recorded with its virtual time
and headers, so the tests assert the exact `Last-Event-ID` sent (the position of the last
event handed out, down to a half-received frame), when the watchdog fires, what a
re-created session asks for, and which error frames end the stream.
"""

from __future__ import annotations

import base64
import random

import httpx
import msgspec
import pytest
import trio

from topicd.client import (
    BackpressurePolicy,
    CaughtUp,
    Client,
    ConnectionFailed,
    PushPaused,
    Record,
    TopicDeleted,
    WatchSuperseded,
)
from topicd.client.watch import decode_cursor, encode_cursor

DROP = object()
SILENCE = object()


def cursor(**topics):
    return (
        base64.urlsafe_b64encode(msgspec.json.encode(dict(sorted(topics.items()))))
        .rstrip(b"=")
        .decode()
    )


def record_frame(topic, seqs, to_seq=None, **ids):
    recs = [{"$seq": s, "$ts": 1, "data": s} for s in seqs]
    data = {
        "topic": topic,
        "records": recs,
        "from_seq": seqs[0] - 1,
        "to_seq": to_seq or seqs[-1],
        "head_seq": 99,
    }
    return frame("record", data, **ids)


def frame(event, data, **ids):
    head = f"id: {cursor(**ids)}\n" if ids else ""
    return f"{head}event: {event}\ndata: {msgspec.json.encode(data).decode()}\n\n".encode()


OPEN = b"retry: 2000\n\n: hb\n\n"


class Server:
    def __init__(self, sessions, streams):
        self.sessions = list(sessions)  # POST answers: dicts, or (status, body)
        self.streams = list(streams)  # GET answers: lists of chunks/actions, or (status, body)
        self.requests = []  # (virtual time, method, path, headers, params, body)

    async def __call__(self, request: httpx.Request):
        body = msgspec.json.decode(request.content) if request.content else None
        self.requests.append(
            (
                trio.current_time(),
                request.method,
                request.url.path,
                dict(request.headers),
                dict(request.url.params),
                body,
            )
        )
        answer = (self.sessions if request.method == "POST" else self.streams).pop(0)
        if isinstance(answer, tuple):
            status, doc = answer
            return httpx.Response(status, json=doc, headers={"retry-after": "1"})
        if request.method == "POST":
            return httpx.Response(200, json=answer)
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=self._stream(answer)
        )

    @staticmethod
    async def _stream(script):
        for item in script:
            await trio.lowlevel.checkpoint()
            if item is DROP:
                raise httpx.ReadError("connection reset by peer")
            if item is SILENCE:
                await trio.sleep_forever()
            yield item

    def gets(self):
        return [r for r in self.requests if r[1] == "GET"]

    def posts(self):
        return [r for r in self.requests if r[1] == "POST"]


def session(wid="wid_a", hb=1000, **topics):
    return {
        "wid": wid,
        "stream_url": f"/v0/watch/{wid}",
        "heartbeat_ms": hb,
        "topics": {
            t: {"from_seq": s, "head_seq": 99, "earliest_seq": 1} for t, s in topics.items()
        },
    }


def client(server, **policy):
    return Client(
        "http://topicd.test",
        transport=httpx.MockTransport(server),
        rng=random.Random(3),
        policy=BackpressurePolicy(retry_jitter=0, **policy),
    )


async def take(stream, n):
    out = []
    while len(out) < n:
        out.append(await stream.__anext__())
    return out


def test_cursor_encoding_is_the_servers():
    assert encode_cursor({"sensor.temps": 88004}) == "eyJzZW5zb3IudGVtcHMiOjg4MDA0fQ"
    assert decode_cursor("eyJhbGVydHMiOjMsImF1ZGl0IjoyfQ") == {"alerts": 3, "audit": 2}
    assert decode_cursor("!!!") is None


async def test_a_drop_mid_frame_resumes_after_the_last_event_handed_out(autojump_clock):
    half = record_frame("t", [3, 4], t=4)
    server = Server(
        [session(t=0)],
        [
            [OPEN, record_frame("t", [1, 2], t=2), half[:30], DROP],
            [OPEN, record_frame("t", [3, 4], t=4), SILENCE],
        ],
    )
    async with client(server) as c, c.watch({"t": 0}) as w:
        events = await take(w, 4)
    assert [e.seq for e in events] == [1, 2, 3, 4]
    first, second = server.gets()
    assert first[3]["last-event-id"] == cursor(t=0)
    assert second[3]["last-event-id"] == cursor(t=2)  # the half frame was never handed out
    assert second[0] == first[0]  # the first reconnect is immediate


async def test_records_already_handed_out_are_never_repeated(autojump_clock):
    """A server that resends a frame the client already handed out (it must not, but a
    proxy might replay): the overlap is dropped."""
    server = Server(
        [session(t=0)],
        [
            [OPEN, record_frame("t", [1, 2, 3], t=3), DROP],
            [OPEN, record_frame("t", [2, 3, 4], t=4), SILENCE],
        ],
    )
    async with client(server) as c, c.watch({"t": 0}) as w:
        events = await take(w, 4)
    assert [e.seq for e in events] == [1, 2, 3, 4]


async def test_the_watchdog_reopens_a_silent_stream(autojump_clock):
    server = Server(
        [session(hb=1000, t=0)],
        [
            [OPEN, record_frame("t", [1], t=1), SILENCE],
            [OPEN, record_frame("t", [2], t=2), SILENCE],
        ],
    )
    async with client(server) as c, c.watch({"t": 0}) as w:
        await take(w, 1)
        t_last = trio.current_time()
        events = await take(w, 1)
        assert w.reconnects == 1
    assert events[0].seq == 2
    assert server.gets()[1][0] - t_last == pytest.approx(2 * 1.0 + 2.0)


async def test_a_forgotten_session_is_recreated_from_the_cursors(autojump_clock):
    server = Server(
        [session(a=0, gone=5), session(wid="wid_b", a=2)],
        [
            [OPEN, record_frame("a", [1, 2], a=2, gone=5), DROP],
            (404, {"error": {"code": "not_found", "message": "no such watch"}}),
            [OPEN, record_frame("a", [3], a=3), SILENCE],
        ],
    )
    async with client(server) as c, c.watch({"a": 0, "gone": 5}) as w:
        events = await take(w, 4)
        assert w.sessions == 2
    assert [type(e).__name__ for e in events] == ["Record", "Record", "TopicDeleted", "Record"]
    assert events[2] == TopicDeleted("gone")
    first, second = server.posts()
    assert first[4] == {} and first[5]["topics"] == {"a": {"from_seq": 0}, "gone": {"from_seq": 5}}
    assert second[4] == {"lenient": "true"}
    assert second[5]["topics"] == {"a": {"from_seq": 2}, "gone": {"from_seq": 5}}
    assert server.gets()[2][2] == "/v0/watch/wid_b"


async def test_shutting_down_frame_reconnects_with_its_cursor(autojump_clock):
    bye = frame(
        "error",
        {"code": "server_shutting_down", "error": "bye", "message": "bye"},
        t=5,
    )
    server = Server(
        [session(t=0)],
        [
            [OPEN, record_frame("t", [1, 2], to_seq=5, t=5), bye, SILENCE],
            [OPEN, frame("caught-up", {"topic": "t", "head_seq": 5}, t=5), SILENCE],
        ],
    )
    async with client(server) as c, c.watch({"t": 0}) as w:
        events = await take(w, 3)
        assert w.cursors == {"t": 5}  # skipped seqs 3..5 count too
    assert isinstance(events[2], CaughtUp)
    assert server.gets()[1][3]["last-event-id"] == cursor(t=5)


async def test_a_superseded_stream_ends_with_watch_superseded(autojump_clock):
    taken = frame("error", {"code": 409, "error": "superseded", "message": "superseded"})
    server = Server([session(t=0)], [[OPEN, record_frame("t", [1], t=1), taken, SILENCE]])
    async with client(server) as c, c.watch({"t": 0}) as w:
        assert (await take(w, 1))[0].seq == 1
        with pytest.raises(WatchSuperseded):
            await w.__anext__()


async def test_pressure_frames_are_events_and_keep_the_stream(autojump_clock):
    paused = frame(
        "error",
        {"code": 429, "error": "p", "message": "p", "retry_after_ms": 1200, "topics": ["t"]},
    )
    server = Server([session(t=0)], [[OPEN, paused, record_frame("t", [1], t=1), SILENCE]])
    async with client(server) as c, c.watch({"t": 0}) as w:
        events = await take(w, 2)
        assert w.reconnects == 0
    assert events[0] == PushPaused(("t",), 1200)
    assert isinstance(events[1], Record)


async def test_reconnects_give_up_after_max_retries(autojump_clock):
    refused = httpx.ConnectError("refused")

    class Down(Server):
        async def __call__(self, request):
            if request.method == "GET" and len(self.gets()) >= 1:
                self.requests.append((trio.current_time(), "GET", "", {}, {}, None))
                raise refused
            return await super().__call__(request)

    server = Down([session(t=0)], [[OPEN, record_frame("t", [1], t=1), DROP]])
    async with client(server, max_retries=3) as c, c.watch({"t": 0}) as w:
        await take(w, 1)
        t0 = trio.current_time()
        with pytest.raises(ConnectionFailed):
            await w.__anext__()
    times = [r[0] - t0 for r in server.gets()[1:]]
    assert times == pytest.approx([0.0, 0.05, 0.15, 0.35])  # 50 ms doubling, 4 attempts
