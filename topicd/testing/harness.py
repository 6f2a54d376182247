"""In-process harnesses: an engine or a whole app on the current Trio loop."""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from topicd.clock import SystemWallClock
from topicd.config import Config
from topicd.daemon import hypercorn_config
from topicd.engine.engine import Engine, open_engine
from topicd.http.app import create_app
from topicd.http.auth import KeyStore
from topicd.http.server import serve
from topicd.lifecycle import Lifecycle
from topicd.offload import InlineOffload, Offload
from topicd.storage.service import open_durable_engine
from topicd.testing.fake_clock import FakeWallClock
from topicd.testing.fake_fs import MonitorFs

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from quart_trio import QuartTrio

    from topicd.clock import WallClock
    from topicd.storage.fs import Fs


@dataclass
class AppHarness:
    app: QuartTrio
    engine: Engine
    lifecycle: Lifecycle
    clock: WallClock


def make_config(**sections: dict[str, object]) -> Config:
    """The default config with some fields replaced, e.g. `test_config(limits={...})`."""
    cfg = Config()
    for name, fields in sections.items():
        cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **fields)})
    return cfg


@asynccontextmanager
async def open_app(
    config: Config | None = None, clock: WallClock | None = None, *, serving: bool = True
) -> AsyncIterator[AppHarness]:
    """An engine plus the full HTTP app (gate included), ready for Quart's test client."""
    config = config or Config()
    clock = clock or FakeWallClock()
    lifecycle = Lifecycle()
    async with open_engine(config, clock) as engine:
        app = create_app(engine, config, lifecycle, KeyStore.from_config(config.auth))
        if serving:
            lifecycle.set_serving()
        async with app.test_app():
            yield AppHarness(app, engine, lifecycle, clock)


def durable_config(
    data_dir: str = "/data",
    shards: int = 2,
    *,
    wal: dict[str, int] | None = None,
    segments: dict[str, int] | None = None,
    **sections: dict[str, object],
) -> Config:
    """A config for durable tests on a `FakeDisk`: 1 MiB WAL files, a fixed shard count;
    `wal` replaces `[storage.wal]` fields, `segments` `[storage.segments]` fields (tests
    about segment files pass `inline_max_bytes=0`, so that small topics get them too),
    `sections` whole-section fields."""
    cfg = make_config(**sections)
    wal_cfg = dataclasses.replace(cfg.storage.wal, **({"file_bytes": 1 << 20} | (wal or {})))
    seg_cfg = dataclasses.replace(cfg.storage.segments, **(segments or {}))
    storage = dataclasses.replace(
        cfg.storage, data_dir=data_dir, wal_shards=shards, wal=wal_cfg, segments=seg_cfg
    )
    return dataclasses.replace(cfg, storage=storage)


@asynccontextmanager
async def open_durable(
    fs: Fs,
    config: Config | None = None,
    clock: WallClock | None = None,
    *,
    offload: Offload | None = None,
    boot_id: str | None = "boot-1",
) -> AsyncIterator[Engine]:
    """Recover `config.storage.data_dir` from `fs` and run an engine on its WAL, all on
    the test's loop (inline offload, inline recovery) so `MockClock` drives everything.

    The filesystem is watched by a `MonitorFs` that fails any call breaking the
    persistence-ordering rules: a file renamed into the data directory was synced first,
    and `meta/` was synced before an old snapshot in it is removed."""
    config = config or durable_config()
    root = config.storage.data_dir
    monitor = MonitorFs(fs)
    monitor.require_synced_before_rename(root)
    monitor.require_dir_synced_before_unlink(root + "/meta")
    async with open_durable_engine(
        config,
        monitor,
        offload or InlineOffload(),
        clock or FakeWallClock(),
        boot_id=boot_id,
        recover_in_thread=False,
    ) as engine:
        yield engine


@asynccontextmanager
async def open_durable_app(
    fs: Fs,
    config: Config | None = None,
    clock: WallClock | None = None,
    *,
    offload: Offload | None = None,
    boot_id: str | None = "boot-1",
) -> AsyncIterator[AppHarness]:
    """`open_durable` plus the full HTTP app."""
    config = config or durable_config()
    clock = clock or FakeWallClock()
    lifecycle = Lifecycle()
    async with open_durable(fs, config, clock, offload=offload, boot_id=boot_id) as engine:
        app = create_app(engine, config, lifecycle, KeyStore.from_config(config.auth))
        lifecycle.set_serving()
        async with app.test_app():
            yield AppHarness(app, engine, lifecycle, clock)


@asynccontextmanager
async def serve_in_process(
    config: Config, apps: list[QuartTrio] | None = None
) -> AsyncIterator[tuple[Engine, str]]:
    """The whole app on the daemon's HTTP server (`topicd.http.server.serve`, port 0)
    in this process, with the real clock: yields the engine and the base URL (and
    appends the app to `apps` when given)."""
    lifecycle = Lifecycle()
    stop = trio.Event()
    async with open_engine(config, SystemWallClock()) as engine, trio.open_nursery() as nursery:
        app = create_app(engine, config, lifecycle, KeyStore.from_config(config.auth))
        if apps is not None:
            apps.append(app)

        async def run(*, task_status: trio.TaskStatus[list[str]]) -> None:
            await serve(
                app,
                hypercorn_config(config),
                direct=config.sse.direct_write,
                direct_http1=config.server.direct_http1,
                shutdown_trigger=stop.wait,
                task_status=task_status,
            )

        binds = await nursery.start(run)
        lifecycle.set_serving()
        try:
            yield engine, binds[0]
        finally:
            stop.set()
