"""Property-based fuzzing of every operation in docs/openapi.yaml, a short CI budget.

Method: Hypothesis draws, per example, a fresh in-process app with a little state and a
few requests generated from the document (`topicd.testing.fuzz_api`: valid bodies from
each request schema through hypothesis-jsonschema, arbitrary JSON, empty and mistyped
bodies, names from the document's patterns). Invariants: no 5xx but a documented `503`,
every answer conforms to the document (strictly), no traceback in the log.
`bench/fuzz_api.py` runs the same driver for as long as asked.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topicd.testing.fuzz_api import Fuzzer

FUZZER = Fuzzer()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(data=st.data())
async def test_generated_requests_get_documented_answers(data):
    await FUZZER.exercise(data.draw, n=6)
