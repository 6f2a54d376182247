"""Property-based fuzzing of every operation in docs/openapi.yaml, a short CI budget.

Method: Hypothesis draws, per example, a fresh in-process app with a little state and a
few requests generated from the document (`topicd.testing.fuzz_api`: bodies valid for
each request schema, arbitrary JSON, empty and mistyped bodies, names from the
document's patterns), on virtual time (a `MockClock` with autojump: a long-poll costs
nothing). Invariants: no 5xx but a documented `503`, every answer conforms to the
document (strictly), no traceback in the log. `bench/fuzz_api.py` runs the same driver
for as long as asked, in process or against a real server.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from topicd.testing.fuzz_api import Fuzzer

FUZZER = Fuzzer()
# no "explain" phase: its line tracing of a whole app makes a failure take minutes to report
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]


@settings(
    max_examples=100,
    deadline=None,
    # the clock fixture is reset by nothing between examples, and needs nothing reset:
    # each example opens its own app
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
    derandomize=True,
    phases=PHASES,
)
@given(data=st.data())
async def test_generated_requests_get_documented_answers(autojump_clock, data):
    await FUZZER.exercise(data.draw, n=6)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
    derandomize=True,
    phases=PHASES,
)
@given(data=st.data())
async def test_generated_requests_get_documented_answers_while_storage_fails(autojump_clock, data):
    """The same on a durable app whose disk starts failing every sync, heals, gets
    background writes and lets virtual time pass, at drawn points: refusals must be the
    documented `503 storage_unavailable`, nothing may crash (a background task dying
    fails the example), and once the disk has healed and the breaker's longest open time
    has passed, writes are taken again."""
    await FUZZER.exercise(data.draw, n=8, faults=True)
