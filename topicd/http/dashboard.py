"""The operator dashboard: `GET <dashboard.path>` (one self-contained HTML page) and
`GET <dashboard.path>/events` (its Server-Sent-Events feed). Outside `/v0`.

The page is static (`topicd.http.dashboard_page`): every number it shows, thresholds
included, arrives on the feed. The feed is served at the ASGI layer, like the watch and
`/work` streams (the gate hands the request to `DashboardHub`), so on the direct HTTP/1.1
path its frames go straight to the socket and a disconnect is seen at once.

Publishing: while at least one viewer is attached, one snapshot is built every
`dashboard.interval_ms`, serialized once, and put in each viewer's `Slot`, a single-slot
latest-wins mailbox (an overwritten snapshot is a counted drop, `topicd_dropped_total
{kind="dashboard"}`). Exactly one task publishes: every viewer's connection runs a
publisher that first takes `DashboardHub.seat` (a FIFO `trio.Lock`); the holder publishes,
the others wait. When the holder's viewer leaves, its task is cancelled with its
connection and the next viewer's takes the seat, keeping the cadence (`_due`). With no
viewer, nothing runs and nothing is built.

The numbers come from the same functions as `GET /v0/metrics` (`topicd.http.metrics`);
this module only ranks them, adds the lag of topics (max over live watch sessions and
routers of head minus cursor), the worker state of queues, and the zone of each value
against the `[dashboard]` thresholds, which the snapshot carries too.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Final, cast

import orjson
import trio
from quart import Response

from topicd.engine.slots import MAX_VIEWERS_LIMIT
from topicd.errors import MethodNotAllowed, Throttled
from topicd.http.app import principal
from topicd.http.dashboard_page import PAGE
from topicd.http.metrics import (
    breakers_snapshot,
    governor_snapshot,
    queues_snapshot,
    routers_snapshot,
    saturation_snapshot,
    tidy_floats,
)
from topicd.http.watch import _until_disconnect, stream_request
from topicd.lifecycle import Phase

if TYPE_CHECKING:
    from collections.abc import Callable

    from quart_trio import QuartTrio

    from topicd.config import Config, DashboardConfig
    from topicd.engine.engine import Engine
    from topicd.engine.slots import Slot as ConnSlot
    from topicd.errors import JsonValue
    from topicd.http.app import EngineRef, Receive, Scope, Send
    from topicd.http.auth import KeyStore
    from topicd.lifecycle import Lifecycle

log = logging.getLogger("topicd.dashboard")

EVENTS_SUFFIX: Final = "/events"
_HEAD: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),
]
_CSP: Final = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
)
LEVEL_ZONES: Final = {"normal": "green", "warning": "amber", "critical": "red", "overflow": "red"}
BREAKER_ZONES: Final = {"closed": "green", "half_open": "amber", "open": "red"}
_ZONE_RANK: Final = {"green": 0, "amber": 1, "red": 2}


def zone(value: float, warn: float, pause: float) -> str:
    """green below `warn`, amber from `warn` below `pause`, red from `pause`."""
    if value >= pause:
        return "red"
    return "amber" if value >= warn else "green"


def worst(zones: list[str]) -> str:
    return max(zones, key=_ZONE_RANK.__getitem__, default="green")


class Slot:
    """A viewer's single-slot, latest-wins mailbox (one consumer: the viewer's pump)."""

    def __init__(self) -> None:
        self.item: bytes | None = None
        self._ready = trio.Event()

    def put(self, data: bytes) -> bool:
        """Leave `data` for the viewer; True when it overwrote one the viewer never took."""
        dropped = self.item is not None
        self.item = data
        self._ready.set()
        return dropped

    async def take(self) -> bytes:
        """The latest item, once there is one."""
        while self.item is None:
            await self._ready.wait()
            self._ready = trio.Event()
        item, self.item = self.item, None
        return item


def topic_lags(engine: Engine, top: int) -> list[JsonValue]:
    """The `top` topics by lag: per topic, the largest `head_seq - cursor` over its watch
    sessions (streaming, or idle within the session TTL) and the routers reading it;
    with its readers and the streams marked lagged (channel full, reading from the log).
    Topics nobody reads have no lag and are not listed."""
    now = trio.current_time()
    ttl = engine.cfg.watch.session_ttl_ms / 1000
    lag: dict[str, int] = {}
    readers: dict[str, int] = {}
    lagged: dict[str, int] = {}
    for session in engine.watch.sessions.values():
        conn = session.conn
        if conn is None and now - session.last_used > ttl:
            continue  # reclaimable: nobody will resume it
        for name, topic in session.instances.items():
            if topic.deleted:
                continue
            behind = max(0, topic.head_seq - session.cursors.get(name, 0))
            lag[name] = max(lag.get(name, 0), behind)
            readers[name] = readers.get(name, 0) + 1
            if conn is not None and conn.lagged:
                lagged[name] = lagged.get(name, 0) + 1
    for router in engine.routers.routers.values():
        name = router.src.name
        lag[name] = max(lag.get(name, 0), router.lag)
        readers[name] = readers.get(name, 0) + 1
    ranked = sorted(lag.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    topics = engine.topics
    return [
        {
            "topic": name,
            "head_seq": topics[name].head_seq if name in topics else 0,
            "lag": n,
            "readers": readers[name],
            "lagged_connections": lagged.get(name, 0),
        }
        for name, n in ranked
    ]


def worker_state(entry: dict[str, JsonValue], attached_ms: int, now_ms: int, stale_ms: int) -> str:
    """`streaming`: a `/work` stream is attached; `active`: a claim, extend, ack or nack
    within `stale_ms`; `off`: the queue holds jobs (ready, delayed or leased) and nothing
    touched it for `stale_ms` since the last op or since the queue began (created, or the
    server started); `idle`: otherwise (nothing to do, or too soon to tell)."""
    if cast("int", entry["work_streams"]) > 0:
        return "streaming"
    last_op = max(
        cast("int", v) for k, v in entry.items() if k.startswith("last_") and k.endswith("_ms")
    )
    if last_op and now_ms - last_op < stale_ms:
        return "active"
    jobs = sum(cast("int", entry[k]) for k in ("ready", "in_flight", "delayed"))
    return "off" if jobs and now_ms - max(last_op, attached_ms) >= stale_ms else "idle"


class DashboardHub:
    """The feed: viewers, the publisher seat, the history of the charts."""

    def __init__(
        self, ref: EngineRef, config: Config, lifecycle: Lifecycle, keys: KeyStore
    ) -> None:
        self.ref = ref
        self.cfg: DashboardConfig = config.dashboard
        self.retry_ms = config.watch.sse_retry_ms
        self.slow_s = config.watch.slow_consumer_timeout_ms / 1000
        self.lifecycle = lifecycle
        self.keys = keys
        self.page_path = self.cfg.path
        self.events_path = self.cfg.path + EVENTS_SUFFIX
        self.interval_s = self.cfg.interval_ms / 1000
        self.viewers: dict[Slot, None] = {}
        self.seat = trio.Lock()  # held by the one publishing task
        self.dropped = 0  # snapshots overwritten before their viewer took them
        self.published = 0
        self.latest: bytes | None = None  # the last snapshot event (a new viewer's first)
        self.history: deque[list[float]] = deque(maxlen=self.cfg.history_points)
        self._due = 0.0  # Trio time of the next snapshot
        self._prev: tuple[float, int] | None = None  # (time, records appended) of the last
        self._changed = trio.Event()  # set (and replaced) when a viewer comes or goes

    # ---- routing ------------------------------------------------------------------------

    def is_feed(self, scope: Scope) -> bool:
        """Whether this request opens the feed (a GET of the events path)."""
        return scope.get("method") == "GET" and scope.get("path") == self.events_path

    def control_paths(self) -> frozenset[str]:
        """The dashboard's paths: control work, no client permit."""
        return frozenset({self.page_path, self.events_path})

    # ---- the snapshot -------------------------------------------------------------------

    def thresholds(self) -> dict[str, JsonValue]:
        c = self.cfg
        return {
            "pressure": {"warn": c.pressure_warn, "pause": c.pressure_pause},
            "lag": {"warn": c.lag_warn, "pause": c.lag_pause},
            "inflight": {"warn": c.inflight_warn, "pause": c.inflight_pause},
            "worker_stale_ms": c.worker_stale_ms,
            "interval_ms": c.interval_ms,
            "stale_after_ms": c.interval_ms * c.stale_after_intervals,
        }

    def snapshot(self) -> dict[str, JsonValue]:
        """One snapshot of everything the page shows (see module docstring)."""
        engine = self.ref.engine
        c = self.cfg
        now = trio.current_time()
        now_ms = engine.clock.now_ms()
        appended = engine.records_appended
        rate = 0.0
        if self._prev is not None and now > self._prev[0]:
            rate = max(0, appended - self._prev[1]) / (now - self._prev[0])
        self._prev = (now, appended)
        pressure = engine.pressure
        zones: list[str] = []

        p_zone = zone(pressure, c.pressure_warn, c.pressure_pause)
        zones.append(p_zone)
        ladder = governor_snapshot(engine)

        def zoned(items: list[JsonValue], of: Callable[[dict[str, JsonValue]], str]) -> None:
            for item in items:
                entry = cast("dict[str, JsonValue]", item)
                z = entry["zone"] = of(entry)
                zones.append(z)

        def lag_zone(entry: dict[str, JsonValue]) -> str:
            return zone(cast("int", entry["lag"]), c.lag_warn, c.lag_pause)

        breakers = breakers_snapshot(engine)
        zoned(breakers, lambda e: BREAKER_ZONES[cast("str", e["state"])])
        internal = saturation_snapshot(engine)
        zoned(internal, lambda e: LEVEL_ZONES[cast("str", e["level"])])
        topics = topic_lags(engine, c.top_n)
        zoned(topics, lag_zone)
        routers = routers_snapshot(engine, c.top_n)
        zoned(routers, lag_zone)
        ranked: list[tuple[int, str, dict[str, JsonValue]]] = []
        all_queues = cast("dict[str, dict[str, JsonValue]]", queues_snapshot(engine))
        for name, entry in all_queues.items():
            topic = engine.topics.get(name)
            job_queue = None if topic is None else topic.queue
            attached = 0 if job_queue is None else job_queue.attached_ms
            in_flight = cast("int", entry["in_flight"])
            q_zone = worst(
                [
                    zone(in_flight, c.inflight_warn, c.inflight_pause),
                    LEVEL_ZONES[cast("str", entry["level"])],
                ]
            )
            zones.append(q_zone)
            row: dict[str, JsonValue] = {"topic": name, **entry}
            row["worker"] = worker_state(entry, attached, now_ms, c.worker_stale_ms)
            row["zone"] = q_zone
            ranked.append((-(in_flight + cast("int", entry["ready"])), name, row))
        ranked.sort(key=lambda r: (r[0], r[1]))
        queues: list[JsonValue] = [row for _, _, row in ranked[: c.top_n]]
        point = [float(now_ms), round(pressure, 4), round(rate, 1)]
        self.history.append(point)
        permits = self.ref.permits
        out: dict[str, JsonValue] = {
            "server_time_ms": now_ms,
            "uptime_ms": self.lifecycle.uptime_ms(),
            "phase": self.lifecycle.phase.value.value,
            "status": worst(zones),
            "thresholds": self.thresholds(),
            "pressure": {
                "value": pressure,
                "zone": p_zone,
                "signals": ladder["signals"],
                "throttle_at": engine.cfg.governor.throttle_at,
            },
            "ladder": {
                "coalesce_ms": ladder["coalesce_window_ms"],
                "commit_window_ms": ladder["commit_window_ms"],
                "defer_active": ladder["defer_active"],
                "loop_lag_ms": ladder["loop_lag_ms"],
                "sched_latency_ms": ladder["sched_latency_ms"],
            },
            "throughput": {"records_appended": appended, "records_per_s": rate},
            "point": cast("list[JsonValue]", point),
            "breakers": breakers,
            "internal_queues": internal,
            "topics": {"count": len(engine.topics), "top": topics},
            "queues": {"count": len(all_queues), "top": queues},
            "routers": {"count": len(engine.routers.routers), "top": routers},
            "connections": {
                "sse": engine.watch.sse_connections(),
                "watch_sessions": len(engine.watch.sessions),
                "dashboard_viewers": len(self.viewers),
                "client_permits_in_use": 0 if permits is None else permits.stats.in_use,
                "client_waiters": 0 if permits is None else permits.stats.waiting,
            },
            "throttled": cast("dict[str, JsonValue]", dict(engine.throttled)),
        }
        return cast("dict[str, JsonValue]", tidy_floats(out))

    def snapshot_event(self) -> bytes:
        return b"event: snapshot\ndata: " + orjson.dumps(self.snapshot()) + b"\n\n"

    def hello_event(self) -> bytes:
        """A viewer's first frame: the reconnect delay, the thresholds and the history."""
        body = {
            "thresholds": self.thresholds(),
            "history_span_ms": self.cfg.history_points * self.cfg.interval_ms,
            "history": cast("list[JsonValue]", list(self.history)),
        }
        return b"retry: %d\nevent: hello\ndata: " % self.retry_ms + orjson.dumps(body) + b"\n\n"

    def publish(self) -> None:
        """Build one snapshot and leave it in every viewer's slot."""
        data = self.snapshot_event()
        self.latest = data
        self.published += 1
        for slot in self.viewers:
            if slot.put(data):
                self.dropped += 1

    async def run_publisher(self) -> None:
        """Publish every interval while holding the seat (see module docstring)."""
        async with self.seat:
            while True:
                now = trio.current_time()
                if self._due > now:
                    await trio.sleep_until(self._due)
                    now = self._due
                self._due = now + self.interval_s
                try:
                    self.publish()
                except Exception:  # a bug in one snapshot must not end the feed
                    log.exception("dashboard snapshot failed")

    # ---- viewers ------------------------------------------------------------------------

    async def attach(self, scope: Scope) -> tuple[Slot, str | None, ConnSlot | None]:
        """The establishment checks in order — `406` (Accept), `401`, `403` (read), `429`
        (`dashboard.max_viewers`, then the SSE caps) — then the viewer's slot, key and
        deployment-wide connection slot (several fronts: the caps are checked there)."""
        _, who = stream_request(scope, self.keys, "dashboard feed")
        who.require("read")
        key = who.key_id if self.keys.enabled else None
        registry = self.ref.engine.watch
        conn_slot = None
        if registry.slots is not None:
            conn_slot = await registry.slots.acquire(key, viewer=True)
        elif len(self.viewers) >= self.cfg.max_viewers:
            raise Throttled.limit(MAX_VIEWERS_LIMIT, self.cfg.max_viewers)
        registry.reserve_stream(key)  # 429 at an SSE cap (this process's counts)
        slot = Slot()
        if self.latest is not None:
            slot.put(self.latest)  # the page fills at once; the next one follows on time
        self.viewers[slot] = None
        self._changed.set()
        self._changed = trio.Event()
        return slot, key, conn_slot

    def detach(self, slot: Slot, key: str | None) -> None:
        if slot in self.viewers:
            del self.viewers[slot]
            self.ref.engine.watch.release_stream(key)
        if not self.viewers:
            self._prev = None  # the next rate is measured afresh, not across the gap
        self._changed.set()
        self._changed = trio.Event()

    async def wait_viewers(self, count: int) -> None:
        """Return once exactly `count` viewers are attached."""
        while len(self.viewers) != count:
            await self._changed.wait()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Establish (a refusal raises its `TopicdError` before anything is sent: the
        gate answers it) and serve the feed until the client leaves or the server drains."""
        slot, key, conn_slot = await self.attach(scope)
        try:
            headers = list(_HEAD)
            if scope.get("http_version") in ("1.0", "1.1"):
                headers.append((b"connection", b"keep-alive"))
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            ended = False
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
                nursery.start_soon(self.run_publisher)
                ended = await self._pump(slot, send)
                nursery.cancel_scope.cancel()
            if ended:
                with trio.move_on_after(1.0):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.detach(slot, key)
            slots = self.ref.engine.watch.slots
            if conn_slot is not None and slots is not None:
                await slots.release(conn_slot)

    async def _pump(self, slot: Slot, send: Send) -> bool:
        """Write the hello, then each snapshot the slot holds, until the server drains
        (returns True: end the body cleanly) or one write blocks past
        `watch.slow_consumer_timeout_ms` (returns False: the write was cut short, so the
        connection just closes)."""

        async def write(chunk: bytes) -> bool:
            with trio.move_on_after(self.slow_s):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                return True
            return False

        if not await write(self.hello_event()):
            return False
        clean = True
        async with trio.open_nursery() as inner:

            async def until_draining() -> None:
                await self.lifecycle.phase.wait_value(lambda p: p is not Phase.SERVING)
                inner.cancel_scope.cancel()  # (ends the loop below: a clean end)

            inner.start_soon(until_draining)
            while True:
                if not await write(await slot.take()):
                    clean = False
                    break
            inner.cancel_scope.cancel()
        return clean


def register(app: QuartTrio, hub: DashboardHub) -> None:
    """The page route, and a placeholder on the feed's path so other methods answer
    `405` (a GET of the feed is served by the gate before the framework)."""

    async def page() -> Response:
        principal().require("read")
        resp = Response(PAGE, content_type="text/html; charset=utf-8")
        resp.headers["Cache-Control"] = "no-store"
        resp.headers["Content-Security-Policy"] = _CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        return resp

    async def feed_placeholder() -> Response:
        raise MethodNotAllowed("open the dashboard feed with GET", ["GET"])

    app.add_url_rule(hub.page_path, "dashboard", page, methods=["GET"])
    app.add_url_rule(hub.events_path, "dashboard_events", feed_placeholder, methods=["GET"])
