"""`Client`: the async topicd client over one keep-alive `httpx.AsyncClient`.

Every request goes through `Client._request`, which is where retries live. A request is
retried only when repeating it cannot change the outcome:

- a connection that could not be opened (nothing was sent): always;
- any other transport failure, or a `429`/`503` answer: only a *safe* request — reads,
  `PUT`s and `DELETE`s (idempotent by construction), writes carrying an
  `idempotency_key` (the client adds one by default), ack / nack / extend (idempotent
  per seq) and record deletes by seq bound. A claim, a keyless write and a tag-matching
  record delete are never retried;
- never: `422 topic_full` and a `429` carrying `detail.limit` (`CapacityError`).

After a `429`/`503` the client waits `max(Retry-After·1000, detail.retry_after_ms)` plus
0–20 % jitter (the server's hint wins over any local guess); after a transport failure it
backs off from `backoff_min_ms`, doubling, to `backoff_max_ms`. At most `max_retries`
retries, then the error surfaces. Writes also pass the backpressure gate
(`topicd.client.backpressure`) once per batch before they are sent.
"""

from __future__ import annotations

import contextlib
import random
import uuid
from typing import TYPE_CHECKING, Final, Literal

import anyio
import httpx
import msgspec

from topicd.client.backpressure import (
    Backpressure,
    BackpressurePolicy,
    Clock,
    LoopClock,
    Observation,
    Signals,
    ZoneReport,
    shared_board,
)
from topicd.client.errors import (
    CapacityError,
    ClientError,
    ConnectionFailed,
    JsonObject,
    JsonValue,
    ProtocolError,
    ServerError,
    TopicFull,
    TopicNotFound,
    error_from_response,
)
from topicd.client.models import Job, LeaseResult, Record, WriteResult

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence
    from types import TracebackType

    from topicd.client.diff import DiffReader
    from topicd.client.watch import WatchStream
    from topicd.client.worker import WorkerStats

DEFAULT_URL: Final = "http://127.0.0.1:4000"


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


AUTO: Final = _Auto()
"""Default `idempotency_key`: the client generates one per call (kept across retries)."""

_NO_SEQS: Final = {"return_seqs": "false"}  # a write's answer: first and last seq only
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class _ClaimItem(msgspec.Struct):
    lease_id: str
    deadline: int
    deliveries: int = 1


_CLAIM_ITEM = msgspec.json.Decoder(_ClaimItem)


class _ClaimWire(msgspec.Struct):
    claimed: list[msgspec.Raw]
    ready: int | None = None


_CLAIM = msgspec.json.Decoder(_ClaimWire)


def _json_obj(value: object, what: str) -> JsonObject:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what}: expected a JSON object")
    out: JsonObject = value
    return out


def _int_field(obj: JsonObject, key: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"field {key!r} is not an integer")
    return v


def _opt_int(obj: JsonObject, key: str) -> int | None:
    v = obj.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class Client:
    """An async topicd client (Trio or asyncio) with one keep-alive connection pool.

    Use it as `async with Client(url) as client:`; `aclose()` closes the pool.

    Args:
        url: the server's base URL (`http://host:port`).
        token: the bearer key, or None in dev mode.
        policy: backpressure and retry settings (`BackpressurePolicy()` defaults).
        on_zone: called with each backpressure decision (`ZoneReport`).
        clock: time source for every wait (default: the event loop's clock).
        rng: random source for retry jitter (default: a fresh `random.Random`).
        timeout: seconds for connect/write/pool; reads get `read_timeout` (longer than
            the longest long-poll, 30 s).
        transport: an httpx transport (tests inject one).
        share_pressure: True (default) shares the server-pressure reading and its probes
            with the other clients of the same event loop and base URL that keep the
            loop's clock (`PressureBoard`); a client with its own `clock` never shares.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        policy: BackpressurePolicy | None = None,
        on_zone: Callable[[ZoneReport], None] | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        timeout: float = 10.0,
        read_timeout: float = 60.0,
        max_connections: int = 16,
        transport: httpx.AsyncBaseTransport | None = None,
        share_pressure: bool = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.policy = policy or BackpressurePolicy()
        self.clock: Clock = clock or LoopClock()
        self.rng = rng or random.Random()
        headers = {"user-agent": "topicd-client"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._headers = headers
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, read=read_timeout),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            transport=transport,
        )
        self.signals = Signals(self.clock, self.policy.signal_ttl_ms)
        self.backpressure = Backpressure(
            self.policy,
            self.signals,
            self._refresh_signals,
            on_zone,
            refresh_pressure=self._refresh_pressure,
        )
        self._kinds: dict[str, str] = {}  # topic -> "log" | "queue", learnt from its state
        self._probe_lock = anyio.Lock()  # one in-flight read at a time during a pause
        # the loop's shared pressure board is looked up at the first request (inside the
        # loop the client runs in)
        self._board_due = share_pressure and clock is None
        self._state_locks: dict[str, anyio.Lock] = {}  # topic -> one state read at a time
        self._state_reads: dict[str, int] = {}  # topic -> state reads begun by writes

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    # ---- the one request path ----------------------------------------------------------

    def backoff_s(self, attempt: int) -> float:
        """Wait before retry `attempt` (0-based) after a transport failure."""
        p = self.policy
        base = min(p.backoff_max_ms, p.backoff_min_ms * (2 ** min(attempt, 30)))
        return float(base * (1 + self.rng.uniform(0, p.retry_jitter)) / 1000)

    def hint_s(self, retry_after_ms: int) -> float:
        """Wait after a `429`/`503` whose hint is `retry_after_ms`: the hint plus jitter."""
        return retry_after_ms * (1 + self.rng.uniform(0, self.policy.retry_jitter)) / 1000

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        params: Mapping[str, str | int] | None = None,
        safe: bool,
        retries: bool = True,
        before_retry: Callable[[], Awaitable[None]] | None = None,
        counted: bool = False,
    ) -> httpx.Response:
        """Send one request, retrying as the module docstring says; returns a 2xx answer
        or raises the typed error. `before_retry` runs after the server's hint, before a
        retry of a pressure refusal (a write's delay law). A `counted` request (a write)
        is in `signals.writes_unanswered` while it waits for its answer."""
        content = None if body is None else msgspec.json.encode(body)
        headers = {"content-type": "application/json"} if content is not None else None
        attempt = 0
        limit = self.policy.max_retries if retries else 0
        if self._board_due:
            self._share_board()
        while True:
            try:
                self.signals.writes_unanswered += counted
                try:
                    resp = await self.http.request(
                        method, path, content=content, headers=headers, params=params
                    )
                finally:
                    self.signals.writes_unanswered -= counted
            except _NOT_SENT as exc:
                if attempt >= limit:
                    raise ConnectionFailed(f"{method} {path}: {exc!r}") from exc
                await self.clock.sleep(self.backoff_s(attempt))
                attempt += 1
                continue
            except httpx.TransportError as exc:
                if not safe or attempt >= limit:
                    raise ConnectionFailed(f"{method} {path}: {exc!r}") from exc
                await self.clock.sleep(self.backoff_s(attempt))
                attempt += 1
                continue
            self.signals.observe_pressure(resp.headers.get("x-topicd-pressure"))
            if resp.is_success:
                return resp
            err = self._error(resp)
            retryable = resp.status_code in (429, 503) and not isinstance(
                err, CapacityError | TopicFull
            )
            if not (retryable and safe) or attempt >= limit:
                raise err
            wait = (
                self.hint_s(err.retry_after_ms)
                if err.retry_after_ms is not None
                else self.backoff_s(attempt)
            )
            await self.clock.sleep(wait)
            if before_retry is not None and resp.status_code == 429:
                await before_retry()
            attempt += 1

    @staticmethod
    def _error(resp: httpx.Response) -> ServerError:
        try:
            body: JsonValue = msgspec.json.decode(resp.content) if resp.content else None
        except msgspec.DecodeError:
            body = None
        return error_from_response(resp.status_code, body, resp.headers.get("retry-after"))

    async def _json(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        params: Mapping[str, str | int] | None = None,
        safe: bool,
        retries: bool = True,
        before_retry: Callable[[], Awaitable[None]] | None = None,
        counted: bool = False,
    ) -> JsonObject:
        resp = await self._request(
            method,
            path,
            body=body,
            params=params,
            safe=safe,
            retries=retries,
            before_retry=before_retry,
            counted=counted,
        )
        try:
            return _json_obj(msgspec.json.decode(resp.content), f"{method} {path}")
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"{method} {path}: {exc}") from None

    # ---- backpressure signals ------------------------------------------------------------

    async def _refresh_in_flight(self, topic: str) -> None:
        """Re-read a topic's in-flight count (one attempt; a failure leaves no signal)."""
        try:
            state = await self._json(
                "GET", f"/v0/topics/{topic}", params={"touch": "false"}, safe=True, retries=False
            )
        except TopicNotFound:
            self._kinds.pop(topic, None)
            return
        except ClientError:
            return
        queue = state.get("queue")
        if isinstance(queue, dict):
            self._kinds[topic] = "queue"
            n = _opt_int(queue, "in_flight")
            if n is not None:
                self.signals.observe_in_flight(topic, n)
        else:
            self._kinds[topic] = "log"

    async def _refresh_signals(self, topic: str) -> None:
        """During a pause: a health probe for pressure, the state for in-flight. Shared by
        every paused producer of this client (and, for pressure, of the clients sharing
        its board): a value younger than `hard_poll_ms` (from any answer) is not probed
        again, and one probe at a time runs, so N paused producers cost one probe per
        poll interval, not N."""
        await self._refresh_pressure()
        if self._kinds.get(topic) == "queue":
            async with self._probe_lock:
                if self._stale(self.signals.in_flight.get(topic)):
                    await self._refresh_in_flight(topic)

    def _stale(self, obs: Observation | None) -> bool:
        """Absent, or `hard_poll_ms` old (less a nanosecond: float error must not skip a
        whole poll interval)."""
        return obs is None or self.clock.now() - obs.at >= self.policy.hard_poll_ms / 1000 - 1e-9

    def _in_flight_due(self, topic: str) -> bool:
        """Whether `topic`'s kind is unknown, or it is a queue whose in-flight count is
        `inflight_poll_ms` old."""
        if self._kinds.get(topic) == "log":
            return False
        obs = self.signals.in_flight.get(topic)
        return obs is None or (self.clock.now() - obs.at) * 1000 >= self.policy.inflight_poll_ms

    async def _refresh_pressure(self) -> None:
        """A health probe for pressure, shared as `_refresh_signals` shares it: one at a
        time per board, and none when a reading younger than `hard_poll_ms` came
        meanwhile."""
        async with self.signals.board.probe_lock:
            if self._stale(self.signals.pressure):
                with contextlib.suppress(ClientError):
                    await self._request("GET", "/v0/health", safe=True, retries=False)

    def _share_board(self) -> None:
        """Read the pressure on the board this loop's clients of the same server share
        (once, before this client's first decision or request, inside its loop)."""
        self._board_due = False
        self.signals.share(shared_board(self.url))

    async def _before_write(self, topic: str) -> None:
        if not self.policy.enabled:
            return
        if self._board_due:
            self._share_board()
        if self._in_flight_due(topic):
            # one read of the topic's state at a time per topic: the writes that find it
            # due together (a producer starting with N writes in flight) share it
            # instead of sending N reads into a server they are about to load
            # (and a read that failed is not repeated by those that waited for it)
            lock = self._state_locks.setdefault(topic, anyio.Lock())
            reads = self._state_reads.get(topic, 0)
            async with lock:
                if self._state_reads.get(topic, 0) == reads and self._in_flight_due(topic):
                    self._state_reads[topic] = reads + 1
                    await self._refresh_in_flight(topic)
        await self.backpressure.wait(topic)

    # ---- topics --------------------------------------------------------------------------

    async def put_topic(self, topic: str, config: Mapping[str, object] | None = None) -> JsonObject:
        """Create or configure a topic (`PUT`; omitted fields reset to defaults)."""
        return await self._json("PUT", f"/v0/topics/{topic}", body=dict(config or {}), safe=True)

    async def get_topic(self, topic: str, *, touch: bool = True) -> JsonObject:
        """A topic's state: watermarks, counts, config, `queue` counters on a queue."""
        params = None if touch else {"touch": "false"}
        state = await self._json("GET", f"/v0/topics/{topic}", params=params, safe=True)
        queue = state.get("queue")
        if isinstance(queue, dict) and (n := _opt_int(queue, "in_flight")) is not None:
            self.signals.observe_in_flight(topic, n)
        return state

    async def list_topics(
        self, prefix: str | None = None, *, page_size: int = 1000
    ) -> list[JsonObject]:
        """Every topic (name order), following `next_cursor` over all pages."""
        out: list[JsonObject] = []
        cursor: str | None = None
        while True:
            params: dict[str, str | int] = {"page_size": page_size}
            if prefix:
                params["prefix"] = prefix
            if cursor:
                params["cursor"] = cursor
            page = await self._json("GET", "/v0/topics", params=params, safe=True)
            items = page.get("topics")
            if not isinstance(items, list):
                raise ProtocolError("GET /v0/topics: no `topics` list")
            out.extend(_json_obj(item, "topic item") for item in items)
            nxt = page.get("next_cursor")
            if not isinstance(nxt, str) or not nxt:
                return out
            cursor = nxt

    async def delete_topic(self, topic: str, *, if_empty: bool = False) -> JsonObject:
        params = {"if_empty": "true"} if if_empty else None
        return await self._json("DELETE", f"/v0/topics/{topic}", params=params, safe=True)

    async def delete_records(
        self, topic: str, *, before_seq: int | None = None, match: object = None
    ) -> JsonObject:
        """Delete records by seq bound and/or tag predicate. Retried only without
        `match` (a retried tag match could also delete records written in between)."""
        body: dict[str, object] = {}
        if before_seq is not None:
            body["before_seq"] = before_seq
        if match is not None:
            body["match"] = match
        return await self._json("POST", f"/v0/topics/{topic}/delete", body=body, safe=match is None)

    # ---- writes --------------------------------------------------------------------------

    async def write(
        self,
        topic: str,
        data: object,
        *,
        tag: str | None = None,
        meta: object = None,
        node: str | None = None,
        priority: int | None = None,
        idempotency_key: str | _Auto | None = AUTO,
        create: bool | None = None,
        config: Mapping[str, object] | None = None,
        disable_backpressure: bool = False,
    ) -> WriteResult:
        """Append one record (`data` is any JSON value; a `msgspec.Raw` is sent as is)."""
        rec: dict[str, object] = {"data": data}
        if tag is not None:
            rec["tag"] = tag
        if meta is not None:
            rec["meta"] = meta
        if node is not None:
            rec["node"] = node
        if priority is not None:
            rec["priority"] = priority
        return await self.write_batch(
            topic,
            [rec],
            idempotency_key=idempotency_key,
            create=create,
            config=config,
            disable_backpressure=disable_backpressure,
        )

    async def write_batch(
        self,
        topic: str,
        records: Sequence[Mapping[str, object]],
        *,
        node: str | None = None,
        priority: int | None = None,
        idempotency_key: str | _Auto | None = AUTO,
        create: bool | None = None,
        config: Mapping[str, object] | None = None,
        disable_backpressure: bool = False,
    ) -> WriteResult:
        """Append records atomically (each a mapping with `data` and optional `tag`,
        `meta`, `node`, `priority`).

        `idempotency_key`: `AUTO` (default) generates one, so retries never append twice
        (within the topic's `idempotency_window_ms`); a string is used as given; None
        sends none, and the write is then never retried.

        `disable_backpressure`: sent to the server (it skips its pressure check and waits
        at a full ingest queue instead), and the client skips its own delay law too.

        Raises the typed error of the answer; `BackpressureTimeout` when paused too long.
        """
        if not records:
            raise ValueError("a write needs at least one record")
        for i, rec in enumerate(records):
            if "data" not in rec:
                raise ValueError(f"record {i} has no `data` key")
        key = f"sdk-{uuid.uuid4().hex}" if isinstance(idempotency_key, _Auto) else idempotency_key
        body: dict[str, object] = {"records": list(records)}
        if node is not None:
            body["node"] = node
        if priority is not None:
            body["priority"] = priority
        if key is not None:
            body["idempotency_key"] = key
        if create is not None:
            body["create"] = create
        if config is not None:
            body["config"] = dict(config)
        if disable_backpressure:
            body["disable_backpressure"] = True
        law: Callable[[], Awaitable[None]] | None = None
        if not disable_backpressure:
            await self._before_write(topic)

            async def again() -> None:
                # a pressure `429` sends the retry through the delay law again, after
                # the server's hint: into a gate that is still full it would only be
                # refused again
                await self._before_write(topic)

            law = again
        # the seqs of one write are consecutive (`first_seq`..`last_seq`, in record
        # order): the answer need not list them, which saves the server building,
        # encoding and compressing one number per record and the client reading them
        res = await self._json(
            "POST",
            f"/v0/topics/{topic}",
            body=body,
            params=_NO_SEQS,
            safe=key is not None,
            before_retry=law,
            counted=True,
        )
        if res.get("created") is True:
            self._kinds.pop(topic, None)
        first, last = _int_field(res, "first_seq"), _int_field(res, "last_seq")
        return WriteResult(
            topic,
            first,
            last,
            tuple(range(first, last + 1)) if _int_field(res, "count") else (),
            _int_field(res, "head_seq"),
            _int_field(res, "count"),
            res.get("created") is True,
            res.get("deduped") is True,
            key,
        )

    # ---- reads ---------------------------------------------------------------------------

    def diff(
        self,
        topic: str,
        from_seq: int = 0,
        *,
        follow: bool = False,
        limit: int = 0,
        node: str | Sequence[str] | None = None,
        include_tags: bool = False,
        include_meta: bool = True,
        wait_ms: int = 30000,
    ) -> DiffReader:
        """Read `topic` after `from_seq`, page by page, as an async iterator of `Record`
        and `Tombstone` events. It ends once caught up, or (`follow=True`) long-polls for
        more forever. `.cursor` is the position after the last event handed out."""
        from topicd.client.diff import DiffReader

        return DiffReader(
            self,
            topic,
            from_seq,
            follow=follow,
            limit=limit,
            node=node,
            include_tags=include_tags,
            include_meta=include_meta,
            wait_ms=wait_ms,
        )

    def watch(
        self,
        topics: Mapping[str, int | Literal["tail"]],
        *,
        node: str | Sequence[str] | None = None,
        include_tags: bool = False,
        include_meta: bool = True,
        include_data: bool = True,
        limit: int = 0,
        heartbeat_ms: int = 15000,
        consistency: Literal["eventual", "strong"] = "eventual",
    ) -> WatchStream:
        """Watch topics live over one SSE stream: `async with client.watch({...}) as w:
        async for event in w: ...`. `topics` maps each topic to the seq to start after
        (`0`: from the oldest retained record) or `"tail"` (only new records).

        The stream reconnects by itself (dropped connection, server restart, a silent
        peer) and resumes exactly after the last event it handed out: no record is
        skipped or repeated across reconnects. `.cursors` holds that position per topic.
        """
        from topicd.client.watch import WatchStream

        return WatchStream(
            self,
            dict(topics),
            node=node,
            include_tags=include_tags,
            include_meta=include_meta,
            include_data=include_data,
            limit=limit,
            heartbeat_ms=heartbeat_ms,
            consistency=consistency,
        )

    # ---- queues --------------------------------------------------------------------------

    async def claim(
        self, queue: str, node: str, *, max: int = 1, lease_ms: int | None = None
    ) -> list[Job]:
        """Lease up to `max` jobs to `node` (never retried: a repeat would lease more)."""
        body: dict[str, object] = {"node": node, "max": max}
        if lease_ms is not None:
            body["lease_ms"] = lease_ms
        resp = await self._request("POST", f"/v0/topics/{queue}/claim", body=body, safe=False)
        try:
            wire = _CLAIM.decode(resp.content)
            jobs = []
            for raw in wire.claimed:
                item = _CLAIM_ITEM.decode(raw)
                rec = Record.decode(queue, bytes(raw))
                jobs.append(Job(queue, rec, item.lease_id, item.deadline, item.deliveries))
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"claim: {exc}") from None
        return jobs

    async def _lease_call(
        self, verb: str, queue: str, node: str, seqs: Sequence[int], extra: dict[str, object]
    ) -> LeaseResult:
        body: dict[str, object] = {"node": node, "seqs": list(seqs), **extra}
        res = await self._json("POST", f"/v0/topics/{queue}/{verb}", body=body, safe=True)
        in_flight = _opt_int(res, "in_flight")
        if in_flight is not None:
            self.signals.observe_in_flight(queue, in_flight)
        skipped = res.get("skipped")
        deadlines = res.get("deadlines")
        done_key = {"ack": "acked", "nack": "nacked", "extend": "extended"}[verb]
        return LeaseResult(
            queue,
            _opt_int(res, done_key) or 0,
            tuple(s for s in skipped if isinstance(s, int)) if isinstance(skipped, list) else (),
            _opt_int(res, "ready"),
            in_flight,
            {k: v for k, v in deadlines.items() if isinstance(v, int)}
            if isinstance(deadlines, dict)
            else {},
        )

    async def ack(
        self, queue: str, node: str, seqs: Sequence[int], *, lease_ids: Sequence[str] | None = None
    ) -> LeaseResult:
        """Complete jobs (a permanent delete). Idempotent; retried like a read."""
        extra: dict[str, object] = {"lease_ids": list(lease_ids)} if lease_ids else {}
        return await self._lease_call("ack", queue, node, seqs, extra)

    async def nack(
        self,
        queue: str,
        node: str,
        seqs: Sequence[int],
        *,
        delay_ms: int = 0,
        lease_ids: Sequence[str] | None = None,
    ) -> LeaseResult:
        """Release jobs, claimable again now or after `delay_ms`."""
        extra: dict[str, object] = {"delay_ms": delay_ms}
        if lease_ids:
            extra["lease_ids"] = list(lease_ids)
        return await self._lease_call("nack", queue, node, seqs, extra)

    async def extend(
        self,
        queue: str,
        node: str,
        seqs: Sequence[int],
        *,
        lease_ms: int,
        lease_ids: Sequence[str] | None = None,
    ) -> LeaseResult:
        """Heartbeat: set each held lease's deadline to now + `lease_ms`."""
        extra: dict[str, object] = {"lease_ms": lease_ms}
        if lease_ids:
            extra["lease_ids"] = list(lease_ids)
        return await self._lease_call("extend", queue, node, seqs, extra)

    async def run_worker(
        self,
        queue: str,
        handler: Callable[[Job], Awaitable[None]],
        *,
        node: str,
        concurrency: int = 1,
        lease_ms: int = 30000,
        idle_poll_ms: int = 250,
        nack_delay_ms: int = 0,
        stop_when_idle: bool = False,
    ) -> WorkerStats:
        """Run a queue worker; see `topicd.client.worker.run_worker`."""
        from topicd.client.worker import run_worker

        return await run_worker(
            self,
            queue,
            handler,
            node=node,
            concurrency=concurrency,
            lease_ms=lease_ms,
            idle_poll_ms=idle_poll_ms,
            nack_delay_ms=nack_delay_ms,
            stop_when_idle=stop_when_idle,
        )

    # ---- routers -------------------------------------------------------------------------

    async def put_router(self, router: str, source: str, dest: str, **fields: object) -> JsonObject:
        """Create or configure a router (`preserve_node`, `preserve_tag`, `create_dest`,
        `filter`, `allow_cycle`, `guarantee` as keyword arguments)."""
        body: dict[str, object] = {"source": source, "dest": dest, **fields}
        return await self._json("PUT", f"/v0/routers/{router}", body=body, safe=True)

    async def get_router(self, router: str) -> JsonObject:
        return await self._json("GET", f"/v0/routers/{router}", safe=True)

    async def list_routers(
        self, *, prefix: str | None = None, source: str | None = None, dest: str | None = None
    ) -> list[JsonObject]:
        """Every router (name order), following `next_cursor` over all pages."""
        out: list[JsonObject] = []
        cursor: str | None = None
        while True:
            params: dict[str, str | int] = {"page_size": 1000}
            params.update(
                (k, v)
                for k, v in (
                    ("prefix", prefix),
                    ("source", source),
                    ("dest", dest),
                    ("cursor", cursor),
                )
                if v
            )
            page = await self._json("GET", "/v0/routers", params=params, safe=True)
            items = page.get("routers")
            if not isinstance(items, list):
                raise ProtocolError("GET /v0/routers: no `routers` list")
            out.extend(_json_obj(item, "router item") for item in items)
            nxt = page.get("next_cursor")
            if not isinstance(nxt, str) or not nxt:
                return out
            cursor = nxt

    async def delete_router(self, router: str) -> JsonObject:
        return await self._json("DELETE", f"/v0/routers/{router}", safe=True)

    # ---- probes --------------------------------------------------------------------------

    async def health(self) -> JsonObject:
        return await self._json("GET", "/v0/health", safe=True)
