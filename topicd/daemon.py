"""`run_daemon()`: the process shape (architecture §3-§4, §11).

One root nursery. Start order is dependency order, so shutdown unwinds in reverse:

1. lock the data directory;
2. open the engine (its own nursery: housekeeping);
3. start Hypercorn's Trio server with `nursery.start`, so the listener is bound before the
   daemon reports ready; write `server.port_file`;
4. phase SERVING; wait for SIGINT/SIGTERM.

Graceful drain (api-ops §6.2): phase DRAINING (readiness `503 shutting_down`, new requests
`503`), parked long-polls return at once, Hypercorn's listener closes while in-flight
requests get up to `server.drain_timeout_ms`; then the engine closes and the lock is
released. A second signal during the drain exits at once with code 1.
"""

from __future__ import annotations

import gc
import logging
import signal
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import hypercorn.trio
import trio
from hypercorn.config import Config as HyperConfig

from topicd import __version__
from topicd.clock import SystemWallClock
from topicd.engine.engine import open_engine
from topicd.http.app import create_app
from topicd.lifecycle import Lifecycle, Phase
from topicd.storage.datadir import lock_data_dir

if TYPE_CHECKING:
    from topicd.config import Config
    from topicd.http.auth import KeyStore

log = logging.getLogger("topicd")

EXIT_OK = 0
EXIT_RUNTIME = 1


class SecondSignal(Exception):
    """A second SIGINT/SIGTERM arrived during the drain."""


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
    """Run topicd until a signal drains it. Raises `SecondSignal` on a forced exit."""
    lifecycle = Lifecycle()
    lock = await lock_data_dir(Path(cfg.storage.data_dir))
    try:
        async with trio.open_nursery() as root:
            drain = trio.Event()
            root.start_soon(_watch_signals, lifecycle, drain)
            async with open_engine(cfg, SystemWallClock()) as engine:
                app = create_app(engine, cfg, lifecycle, keys)
                stop_http = trio.Event()
                async with trio.open_nursery() as http:
                    binds = await http.start(
                        partial(
                            hypercorn.trio.serve,
                            app,
                            hypercorn_config(cfg),
                            shutdown_trigger=stop_http.wait,
                        )
                    )
                    port = int(binds[0].rsplit(":", 1)[1])
                    if cfg.server.port_file:
                        await trio.Path(cfg.server.port_file).write_text(f"{port}\n")
                    log.info(
                        "topicd %s listening on %s (data dir %s, %s)",
                        __version__,
                        ", ".join(binds),
                        cfg.storage.data_dir,
                        f"{len(keys)} keys" if keys.enabled else "dev mode: NO AUTH",
                    )
                    log.info("caps: %s", caps_summary(cfg))
                    gc.collect()
                    gc.freeze()  # start-up objects never need scanning again
                    gc.set_threshold(cfg.engine.gc_threshold0, 20, 20)
                    lifecycle.set_serving()
                    task_status.started(port)
                    await lifecycle.phase.wait_value(lambda p: p is not Phase.SERVING)
                    engine.begin_drain()
                    stop_http.set()  # listener closes; in-flight requests continue
                    # hypercorn returns once connections are done or graceful_timeout passed
                lifecycle.phase.value = Phase.STOPPING
            root.cancel_scope.cancel("drained")
        lifecycle.phase.value = Phase.STOPPED
        log.info("topicd stopped cleanly")
    finally:
        lock.release()
