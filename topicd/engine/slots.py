"""Connection slots: the seam through which the SSE connection caps are counted.

A long-lived stream (an SSE watch stream, a `/work` stream, a WebSocket, a dashboard
feed) takes one slot of `limits.max_sse_connections`, one of its key's
`limits.max_sse_connections_per_key` (auth on), and a dashboard feed one of
`dashboard.max_viewers`.

On one process (the embedded backend) the process's own counts are the deployment's:
`WatchRegistry.check_sse_caps` and the dashboard's viewer count decide synchronously,
where a stream registers, and `WatchRegistry.slots` is None (nothing here runs).

When several processes serve one deployment (the jetstream backend's fronts), the
count must be the deployment's: `WatchRegistry.slots` is then a `ConnectionSlots`
(`topicd.storage.jsslots`), which the HTTP layer awaits once when a stream opens
(after every other establishment check, so the refusal order is unchanged) and once
when it ends, however it ends. Nothing is counted per frame.

`limits.max_inflight_per_key` (auth on) is counted through the same seam when it is on:
every authenticated request that is not a stream takes a *request slot* of its key
(`acquire_request`) while it runs, and gives it back without waiting
(`release_request`). On the embedded backend the gate's own count decides, as before.
So is `limits.max_watch_sessions`: a stored watch session holds a *session slot*
(`acquire_session` at its creation, after the creation's other checks) until it is
reclaimed (`release_session`); the registry's `reclaim_idle` gives it back.

`limits.max_total_bytes` and `limits.max_idempotency_entries` go through a
`ShareBudget` each when they are on: on the embedded backend `Engine.bytes_budget` and
`Engine.entry_budget` are None and the engine's own counts decide. On the jetstream
backend each owner front holds a *share* of each limit (the shares' sum never passes
it): a write that fits in this front's share is admitted with no round trip (`fits`);
one that does not waits for a larger share (`grow`), which asks the other fronts to
give back what they do not use before it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol

MAX_SSE_LIMIT: Final = "max_sse_connections"
PER_KEY_LIMIT: Final = "max_sse_connections_per_key"
INFLIGHT_LIMIT: Final = "max_inflight_per_key"
SESSIONS_LIMIT: Final = "max_watch_sessions"
MAX_VIEWERS_LIMIT: Final = "dashboard.max_viewers"  # the `detail.limit` of the viewer cap


@dataclass(eq=False)
class Slot:
    """One stream's hold on the caps: given back exactly once (`ConnectionSlots.release`)."""

    key: str | None  # the key's id (auth on), else None: no per-key count
    viewer: bool  # a dashboard feed (counts against `dashboard.max_viewers` too)
    counted: bool = True  # False: no cap applies to it, nothing was counted
    released: bool = False
    request: bool = False  # a request's slot under `max_inflight_per_key` (not a stream)
    session: bool = False  # a watch session's slot under `max_watch_sessions`
    grow: int = 0  # a larger share of a limit by this much (`ShareBudget`)
    share: str = ""  # ... of which limit: "b" `max_total_bytes`, "e" `max_idempotency_entries`


class ConnectionSlots(Protocol):
    """The deployment-wide count of open streams (see the module docstring)."""

    async def acquire(self, key: str | None, *, viewer: bool = False) -> Slot:
        """Take a slot for a stream of `key` (None: auth off). Raises `Throttled`
        (`429 {limit, max}`) at a cap, checked in the embedded order: the viewer cap
        (`viewer`), then `max_sse_connections`, then the key's; `StorageUnavailable`
        (`503`) when the count cannot be reached. Cancelled, it takes nothing."""
        ...

    async def release(self, slot: Slot) -> None:
        """Give `slot` back (idempotent; never raises). Runs shielded and bounded, so it
        completes in a `finally` of a cancelled task; the count is the deployment's again
        when it returns, unless the count could not be reached within the bound: then
        the slot comes back later without anyone's help (implementation's docstring)."""
        ...

    async def acquire_request(self, key: str) -> Slot:
        """Take a request slot of `key` under `limits.max_inflight_per_key` (which the
        caller checked is on). Raises `Throttled` (`429 {limit, max}`) at the cap,
        `StorageUnavailable` (`503`) when the count cannot be reached. Cancelled, it
        takes nothing."""
        ...

    def release_request(self, slot: Slot) -> None:
        """Give a request slot back at once (idempotent; never raises, never waits); the
        deployment's count follows (implementation's docstring)."""
        ...

    async def acquire_session(self) -> Slot:
        """Take a watch session's slot under `limits.max_watch_sessions` (which the
        caller checked is on), after the caller reclaimed this process's idle sessions.
        At the cap, the processes holding sessions reclaim their idle-expired ones first,
        as one process does on a create. Raises `Throttled` (`429 {limit, max}`) at the
        cap, `StorageUnavailable` (`503`) when the count cannot be reached."""
        ...

    def release_session(self, slot: Slot) -> None:
        """Give a session's slot back (it was reclaimed); as `release_request`."""
        ...


class ShareBudget(Protocol):
    """This process's share of `limits.max_total_bytes` (bytes) or of
    `limits.max_idempotency_entries` (entries; see the module docstring)."""

    def fits(self, n: int) -> bool:
        """Whether `n` more (bytes, entries) fit in this process's share now (counted
        against it when they do); synchronous, no round trip."""
        ...

    async def grow(self, n: int) -> None:
        """Take a share that fits `n` more than this process holds now. Raises
        `Throttled` (`429 {limit, max}`) when the deployment's count and `n` pass the
        limit, `StorageUnavailable` (`503`) when the shares cannot be reached."""
        ...
