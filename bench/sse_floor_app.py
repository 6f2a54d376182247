"""The framework floor for bench/sse_fanout.py: SSE fan-out on quart-trio + Hypercorn, no engine.

    python bench/sse_floor_app.py --port 0 --port-file PATH

The same routes as topicd's watch path (api-routers-watch §2), doing only what any SSE
fan-out over this framework must do, so the floor costs "framework + parse + one encode
per write + one non-blocking channel send per watcher + one ASGI send per frame":

* `PUT /v0/topics/<topic>` accepts a topic config and ignores it (so the benchmark can
  configure both servers alike);
* `POST /v0/watch` parses the subscription and answers `{"wid", "stream_url", ...}`;
  only the first topic of `topics` is watched, from its current head (`tail`);
* `GET /v0/watch/<wid>` is served at the ASGI layer, like topicd's stream (its gate
  dispatches the stream before Quart; a Quart streaming response would add Quart's
  per-chunk work and its response timeout, and would no longer be a floor). It sends
  `retry: 2000` + `: hb`, a `caught-up` frame, then forwards every frame from the
  connection's bounded trio memory channel (1024 frames, topicd's `sse.channel_frames`),
  joining whatever is queued into one write (at most 64 frames, like topicd's pump), with
  a `: hb` after `heartbeat_ms` of silence. A second task ends the stream on
  `http.disconnect`;
* `POST /v0/topics/<topic>` reads and parses the body, assigns seqs, encodes **one**
  `record` frame of topicd's shape (`id:` = base64url of the cursor map, `event: record`,
  `data: {"topic", "records": [{"$seq", "$ts", "data"}], "from_seq", "to_seq",
  "head_seq"}`) and offers it to every watching connection's channel with
  `send_nowait`; a full channel drops the frame (counted, no lag handling: the floor is
  not meant for stalled watchers), then answers like topicd's write.

Hypercorn settings, start-up and the "listening on" line come from bench/floor_app.py
(its `_serve`, given this app); as in topicd's daemon, the GC thresholds are set to
(10000, 2, 1000) and the start-up objects are `gc.freeze()`-d.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import logging
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import trio
from quart import Response, request
from quart_trio import QuartTrio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import floor_app  # a sibling module: Hypercorn settings and start-up shared with the HTTP floor

STREAM_PREFIX = "/v0/watch/"
CHANNEL_FRAMES = 1024  # topicd's sse.channel_frames
COALESCE_FRAMES = 64  # topicd's pump joins at most this many queued frames per write
GC_THRESHOLDS = (10_000, 2, 1000)  # topicd's engine.gc_threshold0, daemon.GC_THRESHOLD1/2
SSE_HEAD = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),
    (b"connection", b"keep-alive"),
]


def cursor_id(topic: str, seq: int) -> bytes:
    raw = orjson.dumps({topic: seq})
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


class Hub:
    """Sessions, per-topic heads and the open streams of each topic."""

    def __init__(self) -> None:
        self.sessions: dict[str, tuple[str, int]] = {}  # wid -> (topic, heartbeat s)
        self.heads: dict[str, int] = {}
        self.streams: dict[str, dict[trio.MemorySendChannel[bytes], None]] = {}
        self.dropped = 0

    def publish(self, topic: str, datas: list[Any]) -> tuple[int, int]:
        """Assign seqs, encode one frame, offer it to every stream of `topic`."""
        before = self.heads.get(topic, 0)
        last = before + len(datas)
        self.heads[topic] = last
        ts = int(time.time() * 1000)
        recs = b",".join(
            orjson.dumps({"$seq": before + i + 1, "$ts": ts, "data": d})
            for i, d in enumerate(datas)
        )
        frame = b"".join(
            (
                b"id: ",
                cursor_id(topic, last),
                b'\nevent: record\ndata: {"topic":',
                orjson.dumps(topic),
                b',"records":[',
                recs,
                b'],"from_seq":%d,"to_seq":%d,"head_seq":%d}\n\n' % (before, last, last),
            )
        )
        for ch in self.streams.get(topic, ()):
            try:
                ch.send_nowait(frame)
            except trio.WouldBlock:
                self.dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        return before + 1, last


def create_quart(hub: Hub) -> QuartTrio:
    app = QuartTrio("sse-floor")

    @app.route("/v0/topics/<topic>", methods=["PUT"])
    async def configure(topic: str) -> Response:
        orjson.loads(await request.get_data(cache=False) or b"{}")
        return Response(orjson.dumps({"topic": topic}), 200, content_type="application/json")

    @app.route("/v0/topics/<topic>", methods=["POST"])
    async def append(topic: str) -> Response:
        req = orjson.loads(await request.get_data(cache=False))
        first, last = hub.publish(topic, [r.get("data") for r in req["records"]])
        return Response(
            orjson.dumps(
                {
                    "topic": topic,
                    "first_seq": first,
                    "last_seq": last,
                    "seqs": list(range(first, last + 1)),
                    "head_seq": last,
                    "count": last - first + 1,
                    "created": False,
                    "deduped": False,
                    "performance": {"server_total_ms": 0.0},
                }
            ),
            200,
            content_type="application/json",
        )

    @app.route("/v0/watch", methods=["POST"])
    async def create_watch() -> Response:
        req = orjson.loads(await request.get_data(cache=False))
        topic = next(iter(req["topics"]))
        heartbeat = min(max(int(req.get("heartbeat_ms") or 15000), 1000), 60000) / 1000
        wid = "wid_" + base64.urlsafe_b64encode(secrets.token_bytes(16)).rstrip(b"=").decode()
        hub.sessions[wid] = (topic, heartbeat)
        head = hub.heads.get(topic, 0)
        body = {
            "wid": wid,
            "stream_url": STREAM_PREFIX + wid,
            "topics": {topic: {"from_seq": head, "head_seq": head, "earliest_seq": 1}},
        }
        return Response(orjson.dumps(body), 200, content_type="application/json")

    return app


class FloorApp:
    """ASGI entry: watch streams here, everything else through Quart."""

    def __init__(self) -> None:
        self.hub = Hub()
        self.quart = create_quart(self.hub)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and scope["method"] == "GET" and path.startswith(STREAM_PREFIX):
            await self.stream(path[len(STREAM_PREFIX) :], receive, send)
        else:
            await self.quart(scope, receive, send)

    async def stream(self, wid: str, receive: Any, send: Any) -> None:
        hub = self.hub
        session = hub.sessions.get(wid)
        if session is None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 404,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"error":{"code":"not_found"}}'})
            return
        topic, heartbeat = session
        send_ch, recv_ch = trio.open_memory_channel[bytes](CHANNEL_FRAMES)
        streams = hub.streams.setdefault(topic, {})
        streams[send_ch] = None
        try:
            head = hub.heads.get(topic, 0)
            opening = b"retry: 2000\n\n: hb\n\nid: %s\nevent: caught-up\ndata: %s\n\n" % (
                cursor_id(topic, head),
                orjson.dumps({"topic": topic, "head_seq": head}),
            )
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEAD})
            await send({"type": "http.response.body", "body": opening, "more_body": True})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(until_disconnect, receive, nursery.cancel_scope)
                while True:
                    frame = None
                    with trio.move_on_after(heartbeat):
                        frame = await recv_ch.receive()
                    if frame is None:
                        await send(
                            {"type": "http.response.body", "body": b": hb\n\n", "more_body": True}
                        )
                        continue
                    parts = [frame]
                    while len(parts) < COALESCE_FRAMES:
                        try:
                            parts.append(recv_ch.receive_nowait())
                        except trio.WouldBlock:
                            break
                    body = parts[0] if len(parts) == 1 else b"".join(parts)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            streams.pop(send_ch, None)
            send_ch.close()


async def until_disconnect(receive: Any, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            scope.cancel()
            return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", default="")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    app = FloorApp()
    floor_app.create_app = lambda _diff_body: app  # floor_app._serve serves this app
    gc.set_threshold(*GC_THRESHOLDS)  # kept through _serve's gc.collect() + freeze()
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(floor_app._serve, args.port, args.port_file, b"")


if __name__ == "__main__":
    main()
