"""Shared fixtures: an in-process app (engine + Quart app + gate) on the test's Trio loop.

Timed tests take `autojump_clock` (pytest-trio) so virtual time jumps whenever every task
is blocked; the engine's wall clock is a `FakeWallClock` derived from Trio's clock, so
TTLs and idempotency windows follow the same virtual time.

Every checkpoint in the tests checks its incremental capture: each snapshot entry it
reuses must equal a fresh capture of that topic (`snapshot.VERIFY_INCREMENTAL`).
"""

from __future__ import annotations

import pytest

from topicd.storage import snapshot
from topicd.testing.harness import AppHarness, open_app

snapshot.VERIFY_INCREMENTAL = True


@pytest.fixture
async def harness():
    async with open_app() as h:
        yield h


@pytest.fixture
def client(harness: AppHarness):
    return harness.app.test_client()
