"""`run_daemon()`: the process shape (architecture §3-§4, §11).

One root nursery. Start order is dependency order, so shutdown unwinds in reverse:

1. lock the data directory if it exists (a `flock` on the directory: nothing is added
   to it);
2. start Hypercorn's Trio server with `nursery.start`, so the listener is bound before
   anything else happens; a bind failure raises `BindError` naming the address;
3. only now create a missing data directory (and lock it), so a start that cannot bind
   leaves nothing behind; write `server.port_file`;
4. recover and open the engine (its own nursery: housekeeping); a refused recovery has
   written nothing;
5. phase SERVING; wait for SIGINT/SIGTERM.

Graceful drain (api-ops §6.2): phase DRAINING (readiness `503 shutting_down`, new requests
`503`), parked long-polls return at once, Hypercorn's listener closes while in-flight
requests get up to `server.drain_timeout_ms`; then the engine closes and the lock is
released. A second signal during the drain exits at once with code 1.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

import trio
from hypercorn.config import Config as HyperConfig

from topicd import __version__
from topicd.clock import SystemWallClock
from topicd.engine.engine import Engine
from topicd.http.app import EngineRef, create_app
from topicd.http.server import serve
from topicd.lifecycle import Lifecycle, Phase
from topicd.offload import ThreadOffload
from topicd.storage.datadir import create_data_dir, open_data_dir
from topicd.storage.fs import RealFs
from topicd.storage.recovery import RecoveryRefused, read_boot_id
from topicd.storage.service import open_durable_engine

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from topicd.config import Config
    from topicd.http.auth import KeyStore

log = logging.getLogger("topicd")

EXIT_OK = 0
EXIT_RUNTIME = 1


class SecondSignal(Exception):
    """A second SIGINT/SIGTERM arrived during the drain."""


class BindError(Exception):
    """The listener could not be bound; the message names the address (exit 1)."""


# the collector's thresholds after start-up, besides generation 0's
# (`engine.gc_threshold0`): a young collection scans generation 0, and every
# `GC_THRESHOLD1 + 1`-th one generation 1 too, which holds the survivors of the
# generation-0 collections since — so one scans at most `(GC_THRESHOLD1 + 2) ×
# gc_threshold0` objects (with 20, after a burst of long-lived objects such as 100,000
# new topics, a million: a 60 ms stall). Full collections stay about as rare as with
# (50000, 20, 20): after `GC_THRESHOLD2` generation-1 collections (and only once the
# long-lived objects grew by a quarter since the last one)
GC_THRESHOLD1: Final = 2
GC_THRESHOLD2: Final = 1000


def settle_gc(threshold0: int) -> None:
    """Once recovery is done (automatic collections off while it ran): one collection,
    the start-up state frozen (never scanned again), and the collector's thresholds."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(threshold0, GC_THRESHOLD1, GC_THRESHOLD2)
    gc.enable()


def settle_switch_interval(interval_us: int) -> None:
    """Set the GIL switch interval for serving (`engine.gil_switch_interval_us`). Each
    time the loop thread comes back from a blocking call (a socket read, the `epoll`
    wait) while a worker thread runs Python (a WAL committer, a checkpoint's absorb
    between its C calls), it waits for the GIL until that thread releases it or its
    interval ends, and a request crosses several such points: with Python's 5 ms
    (the setting's default), up to 5 ms each. (Recovery keeps Python's own interval:
    nothing is served yet.)"""
    sys.setswitchinterval(interval_us / 1_000_000)


def bind_error(cfg: Config, exc: BaseException) -> BindError:
    """`cannot bind 127.0.0.1:4000: address already in use`, from what binding raised."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    host = cfg.server.host
    address = f"[{host}]:{cfg.server.port}" if ":" in host else f"{host}:{cfg.server.port}"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return BindError(f"cannot bind {address}: {reason[:1].lower()}{reason[1:]}")


def caps_summary(cfg: Config) -> str:
    """The active resource caps, for the start-up log (api-ops §6.1)."""
    lim = cfg.limits
    parts = [
        f"{f}={getattr(lim, f) or 'unlimited'}"
        for f in (
            "max_topics",
            "max_total_bytes",
            "max_idempotency_entries",
            "max_inflight_per_key",
            "max_body_bytes",
        )
    ]
    return " ".join(parts)


def hypercorn_config(cfg: Config) -> HyperConfig:
    hc = HyperConfig()
    host = cfg.server.host
    bind_host = f"[{host}]" if ":" in host else host
    hc.bind = [f"{bind_host}:{cfg.server.port}"]
    hc.graceful_timeout = cfg.server.drain_timeout_ms / 1000
    hc.keep_alive_timeout = cfg.server.header_read_timeout_ms / 1000
    hc.backlog = 1024
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.include_server_header = False
    return hc


def _open_storage(
    cfg: Config, offload: ThreadOffload, clock: SystemWallClock, lifecycle: Lifecycle
) -> AbstractAsyncContextManager[Engine]:
    """The engine on the configured storage backend (`storage.backend`)."""
    if cfg.storage.backend == "jetstream":
        from topicd.storage.jetstream import open_jetstream_engine

        return open_jetstream_engine(cfg, clock)
    return open_durable_engine(
        cfg,
        RealFs(),
        offload,
        clock,
        boot_id=read_boot_id(),
        progress=lifecycle.set_progress,
    )


async def _watch_signals(lifecycle: Lifecycle, begin_drain: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if not begin_drain.is_set():
                log.info("received %s: draining", signal.Signals(signum).name)
                lifecycle.begin_drain()
                begin_drain.set()
            else:
                log.warning("second signal during drain: exiting now")
                raise SecondSignal


async def run_daemon(
    cfg: Config,
    keys: KeyStore,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run topicd until a signal drains it.

    Raises `SecondSignal` on a forced exit, `BindError` when the listener cannot be bound
    (nothing was created), `DataDirLocked` / `DataDirError` when the data directory is held
    by another process or cannot be opened, created or locked, and `RecoveryRefused` when
    it cannot be vouched for (the server answered probes, never turned ready; nothing in
    the directory was modified).
    """
    lifecycle = Lifecycle()
    clock = SystemWallClock()
    data_dir = Path(cfg.storage.data_dir)
    lock = await open_data_dir(data_dir)  # None: missing, created once bound
    try:
        async with trio.open_nursery() as root:
            drain = trio.Event()
            root.start_soon(_watch_signals, lifecycle, drain)
            # routes other than probes and metrics answer 503 until recovery is done
            ref = EngineRef(Engine(cfg, clock))
            app = create_app(ref, cfg, lifecycle, keys)
            stop_http = trio.Event()
            http_done = trio.Event()

            async def serve_http(*, task_status: trio.TaskStatus[list[str]]) -> None:
                try:
                    await serve(
                        app,
                        hypercorn_config(cfg),
                        direct=cfg.sse.direct_write,
                        direct_http1=cfg.server.direct_http1,
                        shutdown_trigger=stop_http.wait,
                        task_status=task_status,
                    )
                finally:
                    http_done.set()

            async with trio.open_nursery() as http:
                try:
                    binds = await http.start(serve_http)
                except* OSError as group:
                    raise bind_error(cfg, group) from None
                if lock is None:
                    lock = await create_data_dir(data_dir)
                port = int(binds[0].rsplit(":", 1)[1])
                if cfg.server.port_file:
                    await trio.Path(cfg.server.port_file).write_text(f"{port}\n")
                log.info("bound to %s; recovering %s", ", ".join(binds), cfg.storage.data_dir)
                task_status.started(port)
                offload = ThreadOffload(
                    {
                        "wal": 8,
                        "misc": cfg.io.misc_threads,
                        "read": cfg.io.read_threads,
                        "snapshot": 1,
                    },
                    dedicated=("wal",),  # group commits skip the thread-cache hand-off
                )
                # no automatic collections during recovery: it builds objects that all
                # live on (about ten per topic), so the collector found nothing to free
                # while its full collections, each triggered once the survivors had
                # grown by a quarter, took 40 % of a restart at 10,000 topics; one
                # collection once recovery is done, and the state is frozen
                gc.disable()
                switch_interval = sys.getswitchinterval()
                try:
                    async with _open_storage(cfg, offload, clock, lifecycle) as engine:
                        ref.engine = engine
                        settle_gc(cfg.engine.gc_threshold0)
                        settle_switch_interval(cfg.engine.gil_switch_interval_us)
                        lifecycle.set_serving()
                        log.info(
                            "topicd %s listening on %s (data dir %s, %d topics, %s)",
                            __version__,
                            ", ".join(binds),
                            cfg.storage.data_dir,
                            len(engine.topics),
                            f"{len(keys)} keys" if keys.enabled else "dev mode: NO AUTH",
                        )
                        log.info("caps: %s", caps_summary(cfg))
                        await lifecycle.phase.wait_value(lambda p: p is not Phase.SERVING)
                        engine.begin_drain()
                        stop_http.set()  # listener closes; in-flight requests continue
                        await http_done.wait()  # done, or drain_timeout_ms passed
                        lifecycle.phase.value = Phase.STOPPING
                        # leaving the block drains the WAL and runs the final fsync
                except RecoveryRefused as exc:
                    lifecycle.phase.value = Phase.FAILED
                    log.error("recovery refused: %s", exc)
                    stop_http.set()
                    raise
                finally:
                    gc.enable()  # (also when recovery failed or was cancelled)
                    sys.setswitchinterval(switch_interval)
                    offload.close()  # the engine is closed: no WAL call is left
            root.cancel_scope.cancel("drained")
        lifecycle.phase.value = Phase.STOPPED
        log.info("topicd stopped cleanly")
    finally:
        if lock is not None:
            lock.release()
