"""Every test of the /v0 contract modules runs on each storage backend, or is listed here
with the reason it does not.

The contract modules are the `test_contract_*` modules of `tests/http/` (but the
dashboard's, whose page and feed are not /v0) and `tests/watch/`, the compression,
smoke and watch-lag modules, and the WebSocket contract and admission modules. A test
of one of them runs on every backend when a `test_v0_*` module of this directory holds
it (the same function, or a wrapper whose `contract_test` is it). A contract test added later fails
this check until it is taken into one of them or listed in `LEFT_OUT`. (Of some
parametrized refusal tests, the jetstream backends run every `n`-th case:
conftest.py, `THINNED`.)
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import tests.jetstream

CONTRACT = [
    "tests.http.test_compression",
    "tests.http.test_contract_auth",
    "tests.http.test_contract_diff",
    "tests.http.test_contract_errors",
    "tests.http.test_contract_probes",
    "tests.http.test_contract_query_bools",
    "tests.http.test_contract_queue_levels",
    "tests.http.test_contract_queues",
    "tests.http.test_contract_record_deletes",
    "tests.http.test_contract_routers",
    "tests.http.test_contract_topics",
    "tests.http.test_contract_work",
    "tests.http.test_contract_writes",
    "tests.http.test_smoke",
    "tests.watch.test_contract_watch_create",
    "tests.watch.test_contract_watch_frames",
    "tests.watch.test_contract_watch_open",
    "tests.watch.test_contract_watch_resume",
    "tests.watch.test_lag",
    "tests.ws.test_ws_admission",
    "tests.ws.test_ws_contract",
]

# `module::test` -> why it runs on the embedded engine only
LEFT_OUT = {
    "test_compression::test_accept_encoding_parsing": (
        "a pure function of the HTTP layer (the `Accept-Encoding` parser), no app"
    ),
    "test_compression::test_error_answers_are_never_compressed_whatever_their_size": (
        "the compressor's response hook alone, no app"
    ),
    "test_compression::test_large_bodies_are_compressed_off_the_loop": (
        "the compressor alone, no app"
    ),
    "test_compression::test_real_server_sends_gzip_on_the_direct_path": (
        "the daemon's direct socket loop (`serve_in_process`), on the embedded engine"
    ),
    "test_contract_watch_frames::test_composite_id_helper_matches_the_spec_example": (
        "the test module's own id helper against the spec's example, no app"
    ),
    "test_contract_errors::test_generated_bodies_never_500": (
        "a Hypothesis test: pytest-trio runs each example in a Trio run of its own, and "
        "the jetstream app of the `client` fixture, opened in another, answers "
        "`503 the bridge is not started` there"
    ),
    "test_contract_topics::test_effective_priority_manual_and_auto_decay": (
        "walks minutes of virtual time through every timer: 12-25 s a backend here (it passes)"
    ),
    "test_contract_watch_frames::test_heartbeat_period_and_clamp": (
        "8 cases, each walking minutes of virtual time through every timer (they pass)"
    ),
}


def v0_modules() -> list[ModuleType]:
    return [
        importlib.import_module(f"tests.jetstream.{m.name}")
        for m in pkgutil.iter_modules(tests.jetstream.__path__)
        if m.name.startswith("test_v0_") and m.name != "test_v0_coverage"
    ]


def test_every_contract_test_runs_on_each_backend_or_says_why_not() -> None:
    taken = {
        id(getattr(fn, "contract_test", fn))
        for module in v0_modules()
        for name, fn in vars(module).items()
        if name.startswith("test_") and callable(fn)
    }
    missing, stale = [], []
    for path in CONTRACT:
        module = importlib.import_module(path)
        short = path.rsplit(".", 1)[-1]
        for name, fn in vars(module).items():
            if not name.startswith("test_") or not inspect.isfunction(fn):
                continue
            if fn.__module__ != module.__name__:
                continue  # (imported from another module: counted there)
            key = f"{short}::{name}"
            if id(fn) in taken and key in LEFT_OUT:
                stale.append(key)
            elif id(fn) not in taken and key not in LEFT_OUT:
                missing.append(key)
    assert not missing, f"contract tests on no backend but memory, with no reason: {missing}"
    assert not stale, f"listed in LEFT_OUT but run on every backend: {stale}"
