"""A queue worker loop: claim, run the handler under lease heartbeats, ack or nack.

Each of `concurrency` slots claims one job at a time (`max: 1`, so a slow handler never
sits on leased jobs it has not started), runs `handler(job)` and, meanwhile, extends the
lease every `lease_ms / 3` (the heartbeat), fenced by the job's `lease_id`. Then:

- the handler returned: the job is acked (fenced);
- the handler raised: it is logged and the job nacked (`nack_delay_ms`), so it is
  redelivered (and, past the queue's `max_deliveries`, dead-lettered);
- a heartbeat found the lease gone (expired, or re-claimed by another worker): the handler
  is cancelled and the job left alone, since someone else may be running it now.

An empty claim waits `idle_poll_ms` and claims again, or with `stop_when_idle` ends the
slot. A throttled (`429`, whatever its cause) or unavailable claim waits the server's
hint and claims again. Cancelling the caller
stops every slot at once; their leases then expire (or are released by nobody), and the
jobs are redelivered: the queue's contract is at-least-once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from topicd.client.errors import ClientError, Throttled, Unavailable, sole_error

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from topicd.client._client import Client
    from topicd.client.models import Job

log = logging.getLogger("topicd.client")


@dataclass
class WorkerStats:
    """Counts of one `run_worker` call."""

    claimed: int = 0
    acked: int = 0
    nacked: int = 0
    failed: int = 0  # handler raised
    lost: int = 0  # lease lost while running


async def run_worker(
    client: Client,
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
    """Run `handler` on the jobs of `queue` as worker `node` (see the module docstring).

    Returns (only with `stop_when_idle`, or when cancelled from outside it raises the
    cancellation) the counts. Errors of the server other than pressure surface.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if lease_ms < 100:
        raise ValueError("lease_ms must be at least 100")
    stats = WorkerStats()

    async def slot() -> None:
        while True:
            try:
                jobs = await client.claim(queue, node, max=1, lease_ms=lease_ms)
            except (Throttled, Unavailable) as exc:
                # a capacity 429 here is `max_inflight_per_key` (the key's other requests
                # hold every slot): it frees itself, so the loop waits like for pressure
                hint = exc.retry_after_ms if exc.retry_after_ms is not None else 1000
                await client.clock.sleep(client.hint_s(hint))
                continue
            if not jobs:
                if stop_when_idle:
                    return
                await client.clock.sleep(idle_poll_ms / 1000)
                continue
            stats.claimed += 1
            await _run_one(client, jobs[0], handler, node, lease_ms, nack_delay_ms, stats)

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(slot)
    except BaseExceptionGroup as group:
        # one slot's error (say `NotAQueue`) surfaces as itself, not wrapped
        sole = sole_error(group)
        if sole is None:
            raise
        raise sole from None
    return stats


async def _run_one(
    client: Client,
    job: Job,
    handler: Callable[[Job], Awaitable[None]],
    node: str,
    lease_ms: int,
    nack_delay_ms: int,
    stats: WorkerStats,
) -> None:
    outcome = "lost"
    fence = [job.lease_id]

    async def heartbeat(scope: anyio.CancelScope) -> None:
        while True:
            await client.clock.sleep(lease_ms / 3 / 1000)
            try:
                res = await client.extend(
                    job.topic, node, [job.seq], lease_ms=lease_ms, lease_ids=fence
                )
            except ClientError as exc:
                log.warning("worker %s: extend of %s/%d failed: %s", node, job.topic, job.seq, exc)
                continue
            if job.seq in res.skipped:
                log.warning("worker %s: lease of %s/%d lost; cancelling", node, job.topic, job.seq)
                scope.cancel()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat, tg.cancel_scope)
        try:
            await handler(job)
            outcome = "ok"
        except Exception:
            log.exception("worker %s: handler failed on %s/%d", node, job.topic, job.seq)
            outcome = "failed"
        tg.cancel_scope.cancel()
    try:
        if outcome == "ok":
            res = await client.ack(job.topic, node, [job.seq], lease_ids=fence)
            if res.done:
                stats.acked += 1
            else:
                stats.lost += 1
        elif outcome == "failed":
            stats.failed += 1
            res = await client.nack(
                job.topic, node, [job.seq], delay_ms=nack_delay_ms, lease_ids=fence
            )
            stats.nacked += res.done
        else:
            stats.lost += 1
    except ClientError as exc:
        log.warning("worker %s: %s of %s/%d failed: %s", node, outcome, job.topic, job.seq, exc)
