"""Shared fixtures: an in-process app (engine + Quart app + gate) on the test's Trio loop.

Timed tests take `autojump_clock` (pytest-trio) so virtual time jumps whenever every task
is blocked; the engine's wall clock is a `FakeWallClock` derived from Trio's clock, so
TTLs and idempotency windows follow the same virtual time.

Every checkpoint in the tests checks its incremental capture: each snapshot entry it
reuses must equal a fresh capture of that topic (`snapshot.VERIFY_INCREMENTAL`).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from topicd.storage import snapshot
from topicd.testing.harness import AppHarness, open_app

snapshot.VERIFY_INCREMENTAL = True

# the seconds spent in each directory of tests (setup, call and teardown), printed at the
# end of a run: the JetStream suite's share of CI time is one of its bounds (10 minutes)
_SPENT: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    parts = report.nodeid.split("::", 1)[0].split("/")
    _SPENT["/".join(parts[:2]) if len(parts) > 2 else parts[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _SPENT:
        return
    terminalreporter.section("seconds per test directory")
    for where, seconds in sorted(_SPENT.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {where}")


@pytest.fixture
async def harness():
    async with open_app() as h:
        yield h


@pytest.fixture
def client(harness: AppHarness):
    return harness.app.test_client()
