"""In-process harnesses: an engine or a whole app on the current Trio loop."""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from topicd.config import Config
from topicd.engine.engine import Engine, open_engine
from topicd.http.app import create_app
from topicd.http.auth import KeyStore
from topicd.lifecycle import Lifecycle
from topicd.testing.fake_clock import FakeWallClock

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from quart_trio import QuartTrio

    from topicd.clock import WallClock


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
