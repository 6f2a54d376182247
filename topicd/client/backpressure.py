"""Graduated producer backpressure: the delay law, signals that go stale, the zone report.

The client moderates a producer instead of switching it on and off. Two signals feed it:

- server pressure, the `X-Topicd-Pressure` header (0.000–1.000) every `/v0` answer
  carries, stamped with the time the client received it;
- for a producer into a queue topic, the queue's in-flight count (leases taken and not
  finished, not the backlog), refreshed from `GET /v0/topics/:q?touch=false` every
  `inflight_poll_ms` and from ack/nack answers.

An observation older than `signal_ttl_ms` counts as no signal, and no signal means no
delay: a dead worker must not also freeze its producers. Per signal `x` with thresholds
`soft < hard`, `delay_ms(x)` is 0 up to `soft`, rises linearly to `soft_delay_max_ms` just
below `hard`, and is `PAUSE` from `hard` on. The larger of the two delays applies once per
batch, before it is sent, to the signals as they are while the batch waits: it is sent
once the time since its turn reaches the delay for the latest fresh reading, and any new
observation makes it decide again (`Backpressure._wait_turn`). A pause re-reads the
signals every `hard_poll_ms` until they drop below `hard` or go stale (then the rest of the
delay for the value read applies, the time paused counted), and gives up with
`BackpressureTimeout` after `max_pause_ms`. A pressure reading that is
`hard_poll_ms` old is re-read (the same probe) before a batch decides on it when it is
above `soft`, or when one of the client's writes is still unanswered: answers, the only
other source, are slow exactly when the server is loaded, so an old reading with a write
outstanding is the server's silence, not its calm.

The batches of one client take their delay **in turn**: a batch that must wait (amber or
red) waits for the batches ahead of it to have waited theirs, then waits its own, so
successive sends of one client are at least one delay apart however many writes it has
in flight. The law moderates the producer's rate: with one batch in flight the delay is
the gap between batches, and with N in flight side by side N delays slept at once would
shrink that gap N times (a producer keeping 8 writes in flight against a server at
0.8 would still send 8 batches every 330 ms). A green batch does not queue behind
anyone unless a delay is being waited. `max_pause_ms` counts from the batch's own start.

The clients of one event loop that talk to the same server (the same base URL) and keep
the loop's clock share what they hear of its pressure (`PressureBoard`): the pressure is
the server's, not one client's, so a reading any of them gets is as fresh for all, and a
probe one of them sends spares the others theirs (32 producers with a client each, in
one process, sent 1.15–1.19 requests per write with a reading each, 1.01 with one
shared). Each client still waits its own delays, counts its own writes unanswered and
reads its own queues' in-flight counts.

Time comes from a `Clock` (the event loop's clock by default, so Trio's `MockClock`
drives every wait in tests); every wait is a checkpoint, so cancelling the producer stops
it at once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal, Protocol

import anyio
import anyio.lowlevel
from anyio.lowlevel import RunVar

from topicd.client.errors import BackpressureTimeout

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

log = logging.getLogger("topicd.client")

Zone = Literal["green", "amber", "red"]


class _Pause:
    """The `PAUSE` result of the delay law (a signal at or above its hard threshold)."""

    def __repr__(self) -> str:
        return "PAUSE"


PAUSE: Final = _Pause()
Delay = float | _Pause


class Clock(Protocol):
    """Monotonic time in seconds and a way to wait; both must follow the event loop."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """The event loop's own clock (Trio's, or asyncio's): `MockClock` moves it in tests."""

    def now(self) -> float:
        return anyio.current_time()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


@dataclass(frozen=True)
class BackpressurePolicy:
    """The client's backpressure and retry settings (durations in ms).

    Attributes:
        pressure_soft / pressure_hard: thresholds of the server-pressure signal.
        inflight_soft / inflight_hard: thresholds of a queue's in-flight count.
        soft_delay_max_ms: the delay just below a hard threshold.
        hard_poll_ms: how often a pause re-reads the signals.
        signal_ttl_ms: age after which an observation counts as no signal.
        inflight_poll_ms: how often a queue producer refreshes the in-flight count.
        max_pause_ms: longest pause before `BackpressureTimeout`.
        max_retries: retries of a safe request after `429`/`503` or a transport failure.
        retry_jitter: the server's wait hint is stretched by a random 0..this fraction.
        backoff_min_ms / backoff_max_ms: doubling backoff after a transport failure (no
            server hint to follow).
        enabled: False turns the delay law off (hints and retries still apply).
    """

    pressure_soft: float = 0.6
    pressure_hard: float = 0.9
    inflight_soft: float = 50
    inflight_hard: float = 200
    soft_delay_max_ms: float = 500
    hard_poll_ms: float = 100
    signal_ttl_ms: float = 10000
    inflight_poll_ms: float = 1000
    max_pause_ms: float = 60000
    max_retries: int = 8
    retry_jitter: float = 0.2
    backoff_min_ms: float = 50
    backoff_max_ms: float = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        if not (self.pressure_soft < self.pressure_hard):
            raise ValueError("pressure_soft must be below pressure_hard")
        if not (self.inflight_soft < self.inflight_hard):
            raise ValueError("inflight_soft must be below inflight_hard")
        if self.max_retries < 0 or self.retry_jitter < 0:
            raise ValueError("max_retries and retry_jitter must not be negative")


def delay_ms(x: float | None, soft: float, hard: float, soft_delay_max_ms: float) -> Delay:
    """The delay law for one signal: 0 when absent or `x ≤ soft`, proportional between
    `soft` and `hard`, `PAUSE` at `x ≥ hard`."""
    if x is None or x <= soft:
        return 0.0
    if x >= hard:
        return PAUSE
    return soft_delay_max_ms * (x - soft) / (hard - soft)


def larger(a: Delay, b: Delay) -> Delay:
    if isinstance(a, _Pause) or isinstance(b, _Pause):
        return PAUSE
    return max(a, b)


@dataclass
class Observation:
    """One signal value and the client time (seconds) it was received."""

    value: float
    at: float


@dataclass(frozen=True)
class ZoneReport:
    """What the producer's backpressure decided for one batch.

    `zone` is green (no delay), amber (a proportional delay) or red (paused);
    `delay_ms` the wait applied (for red: the pause's length so far); `pressure` and
    `in_flight` the fresh signal values it used (None = absent or stale)."""

    topic: str
    zone: Zone
    delay_ms: float
    pressure: float | None
    in_flight: float | None


class PressureBoard:
    """The latest pressure reading of one server, and the lock its probes take: shared by
    the clients of one event loop that talk to it (module docstring), or one client's own.
    """

    __slots__ = ("_probe_lock", "pressure")

    def __init__(self) -> None:
        self.pressure: Observation | None = None
        self._probe_lock: anyio.Lock | None = None

    @property
    def probe_lock(self) -> anyio.Lock:
        """One probe at a time (made on first use, inside the event loop)."""
        if self._probe_lock is None:
            self._probe_lock = anyio.Lock()
        return self._probe_lock


_BOARDS: RunVar[dict[str, PressureBoard]] = RunVar("topicd_client_pressure_boards")


def shared_board(url: str) -> PressureBoard:
    """The pressure board of the server at `url` for the running event loop (a new loop,
    as each test's, starts with none)."""
    try:
        boards = _BOARDS.get()
    except LookupError:
        boards = {}
        _BOARDS.set(boards)
    board = boards.get(url)
    if board is None:
        board = boards[url] = PressureBoard()
    return board


class Signals:
    """The latest observations of one client; its pressure reading is on a
    `PressureBoard` (the client's own, or the one its loop's clients share)."""

    def __init__(self, clock: Clock, ttl_ms: float, board: PressureBoard | None = None) -> None:
        self.clock = clock
        self.ttl_s = ttl_ms / 1000
        self.board = board or PressureBoard()
        self.in_flight: dict[str, Observation] = {}
        # writes of this client sent and not yet answered (the client counts them)
        self.writes_unanswered = 0
        # set by the next observation (made when a batch first waits for one)
        self._observed: anyio.Event | None = None

    def share(self, board: PressureBoard) -> None:
        """Read and write the pressure on `board` from now on (the newer of the two
        readings is kept)."""
        own, theirs = self.board.pressure, board.pressure
        if own is not None and (theirs is None or own.at > theirs.at):
            board.pressure = own
        self.board = board

    @property
    def pressure(self) -> Observation | None:
        return self.board.pressure

    def _notify(self) -> None:
        if self._observed is not None:
            self._observed.set()
            self._observed = None

    async def changed(self, timeout_s: float) -> None:
        """Wait until the next observation or for `timeout_s`, whichever comes first
        (the event loop's clock, which every `Clock` follows)."""
        if self._observed is None:
            self._observed = anyio.Event()
        with anyio.move_on_after(timeout_s):
            await self._observed.wait()

    def observe_pressure(self, header: str | None) -> None:
        if header is None:
            return
        try:
            value = float(header)
        except ValueError:
            return
        if math.isfinite(value):
            self.board.pressure = Observation(value, self.clock.now())
            self._notify()

    def observe_in_flight(self, topic: str, value: float) -> None:
        self.in_flight[topic] = Observation(float(value), self.clock.now())
        self._notify()

    def fresh(self, obs: Observation | None) -> float | None:
        """The value, or None when absent or older than the TTL."""
        if obs is None or self.clock.now() - obs.at > self.ttl_s:
            return None
        return obs.value

    def fresh_pressure(self) -> float | None:
        return self.fresh(self.pressure)

    def fresh_in_flight(self, topic: str) -> float | None:
        return self.fresh(self.in_flight.get(topic))


async def _no_probe() -> None:
    await anyio.lowlevel.checkpoint()


class Backpressure:
    """Applies the delay law before each batch of one client.

    Args:
        policy: thresholds and timings.
        signals: the shared observations.
        refresh: `await refresh(topic)` re-reads the signals during a pause (the client
            asks the server: a health probe for pressure, the topic's state for in-flight).
        on_zone: called with every `ZoneReport` (each batch, and at each pause poll).
        refresh_pressure: `await refresh_pressure()` re-reads the server pressure before a
            decision whose reading is above `soft` and `hard_poll_ms` old (a health
            probe; none by default).
    """

    WARN_INTERVAL_S: Final = 10.0

    def __init__(
        self,
        policy: BackpressurePolicy,
        signals: Signals,
        refresh: Callable[[str], Awaitable[None]],
        on_zone: Callable[[ZoneReport], None] | None = None,
        refresh_pressure: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.policy = policy
        self.signals = signals
        self.clock = signals.clock
        self.refresh = refresh
        self.refresh_pressure = refresh_pressure or _no_probe
        self.on_zone = on_zone
        self._last_warn: float | None = None
        # the client's batches wait their delays one at a time (module docstring)
        self._turn = anyio.Lock()

    def decide(self, topic: str) -> tuple[Delay, float | None, float | None]:
        """(delay, pressure, in_flight) from the fresh signals."""
        p = self.policy
        pressure = self.signals.fresh_pressure()
        in_flight = self.signals.fresh_in_flight(topic)
        d = larger(
            delay_ms(pressure, p.pressure_soft, p.pressure_hard, p.soft_delay_max_ms),
            delay_ms(in_flight, p.inflight_soft, p.inflight_hard, p.soft_delay_max_ms),
        )
        return d, pressure, in_flight

    def _report(self, report: ZoneReport) -> None:
        if self.on_zone is not None:
            self.on_zone(report)
        if report.zone == "green":
            return
        now = self.clock.now()
        if self._last_warn is None or now - self._last_warn >= self.WARN_INTERVAL_S:
            self._last_warn = now
            log.warning(
                "topicd client backpressure on %s: zone %s, delay %.0f ms (pressure %s, "
                "in-flight %s)",
                report.topic,
                report.zone,
                report.delay_ms,
                report.pressure,
                report.in_flight,
            )

    async def wait(self, topic: str) -> float:
        """Wait as the law says before sending one batch to `topic`; returns the ms
        waited. Raises `BackpressureTimeout` after `max_pause_ms` in a pause."""
        if not self.policy.enabled:
            return 0.0
        start = self.clock.now()
        await self._refresh_if_warned()
        d, pressure, in_flight = self.decide(topic)
        if d == 0 and not self._turn.locked():
            self._report(ZoneReport(topic, "green", 0.0, pressure, in_flight))
            return 0.0
        async with self._turn:
            # (the signals may have moved while the batches ahead waited)
            return await self._wait_turn(topic, start)

    async def _refresh_if_warned(self) -> None:
        """Re-read the pressure before deciding when the last reading is `hard_poll_ms`
        old or older and was above `soft`, or a write of this client is still
        unanswered (the same probe a pause polls with).

        A producer hears from the server only when one of its requests is answered, and
        those answers come slowly exactly when the server is loaded: its reading would
        be hundreds of ms old when it sends, while the queue it is told about fills in a
        few. A green reading that old while a write is outstanding says only that the
        server has not answered for `hard_poll_ms`: many producers sending on such
        readings at once are the bursts an admission gate refuses. A green reading with
        no write outstanding is not re-read: a producer writing now and then to an
        unloaded server costs no probe, and one with writes in flight to an unloaded
        server gets answers more often than every `hard_poll_ms`."""
        p = self.policy
        obs = self.signals.pressure
        if obs is None or (obs.value <= p.pressure_soft and self.signals.writes_unanswered <= 0):
            return
        age_s = self.clock.now() - obs.at
        if p.hard_poll_ms / 1000 - 1e-9 <= age_s <= self.signals.ttl_s:
            await self.refresh_pressure()

    async def _wait_turn(self, topic: str, start: float) -> float:
        """`wait` for a batch whose turn it is (the client's other batches wait).

        The law is applied to the signals as they are while the batch waits, not only as
        they were when it began: the batch is sent once the time since its turn came
        reaches the delay for the latest fresh reading. Every new observation (an answer
        to another write of this client, a probe) wakes it to decide again, and a reading
        that gets `hard_poll_ms` old while it waits is re-read as before a decision. So a
        delay decided on a high reading ends early when the pressure falls (the server's
        queue drains in tens of ms; a 400 ms delay slept whole leaves it idle), grows
        when it rises, and turns into a pause at `hard`; a pause that ends in the amber
        band counts the time paused toward the delay."""
        turn = self.clock.now()
        poll_s = self.policy.hard_poll_ms / 1000
        await self._refresh_if_warned()
        d, pressure, in_flight = self.decide(topic)
        reported: Zone | None = None
        while True:
            now = self.clock.now()
            if isinstance(d, _Pause):
                waited_ms = (now - start) * 1000
                reported = "red"
                self._report(ZoneReport(topic, "red", waited_ms, pressure, in_flight))
                if waited_ms >= self.policy.max_pause_ms:
                    raise BackpressureTimeout(
                        f"paused {waited_ms:.0f} ms before writing to {topic!r} (pressure "
                        f"{pressure}, in-flight {in_flight})"
                    )
                await self.clock.sleep(min(poll_s, (self.policy.max_pause_ms - waited_ms) / 1000))
                await self.refresh(topic)
            else:
                zone: Zone = "green" if d == 0 else "amber"
                if zone != reported:
                    reported = zone
                    self._report(ZoneReport(topic, zone, d, pressure, in_flight))
                left_s = turn + d / 1000 - now
                if left_s <= 0:
                    return (now - start) * 1000
                await self.signals.changed(min(left_s, poll_s))
                await self._refresh_if_warned()
            d, pressure, in_flight = self.decide(topic)
