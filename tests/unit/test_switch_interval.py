"""The daemon serves with the configured GIL switch interval and restores it on exit.

While a worker thread runs Python (a checkpoint's absorb), the loop thread waits for the
GIL each time it comes back from a blocking call until that thread's switch interval
ends, so the interval bounds how late the loop resumes (`engine.gil_switch_interval_us`).
Method: `run_daemon` in process on a fresh data directory (port 0, real sockets and
threads: nothing here is timed); `Lifecycle.set_serving` is wrapped to read the
interval the moment recovery is done and then to begin the drain, so the daemon stops
on its own (the collector settings it also applies are put back afterwards).
"""

from __future__ import annotations

import gc
import sys

import pytest
import trio

from topicd.daemon import run_daemon
from topicd.http.auth import KeyStore
from topicd.lifecycle import Lifecycle
from topicd.testing.harness import make_config


@pytest.mark.parametrize("interval_us", [1000, 250])
async def test_serving_uses_the_configured_switch_interval_and_restores_it(
    tmp_path, monkeypatch, interval_us
):
    before = sys.getswitchinterval()
    assert before != interval_us / 1e6
    seen: list[float] = []
    set_serving = Lifecycle.set_serving

    def serving_then_drain(self: Lifecycle) -> None:
        set_serving(self)
        seen.append(sys.getswitchinterval())
        self.begin_drain()

    monkeypatch.setattr(Lifecycle, "set_serving", serving_then_drain)
    cfg = make_config(
        server={"port": 0},
        storage={"data_dir": str(tmp_path / "data")},
        engine={"gil_switch_interval_us": interval_us},
    )
    thresholds = gc.get_threshold()
    try:
        with trio.fail_after(60):
            await run_daemon(cfg, KeyStore([]))
    finally:  # (the daemon froze the test process's objects and set the collector's)
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    assert seen == [interval_us / 1e6]
    assert sys.getswitchinterval() == before
