"""The connection-cap contract tests, run on each storage backend: `memory`, one
`jetstream` front, and three `fronts`.

These tests open an app of their own config (the cap under test), so each gets the
backend's app of that config (`own_apps`). With three fronts the caps are the
deployment's (docs/jetstream.md, "Connection caps across fronts"): each watch session is
created on the next front in turn and its stream opens there (`StickyWatchApp`), and
each dashboard feed opens on the next front, so the streams that fill a cap and the one
refused are on different fronts, and must get exactly the admissions, refusals
(status, code, `detail`) and `Retry-After` of one embedded process; so must the requests
under `limits.max_inflight_per_key` (each request goes to the next front). The `/work` stream's
cap test runs in `test_v0_work.py`; the `fronts` tests of every stream kind at once, of
racing opens and of a dead front's slots are in `test_slots.py`.
"""

from __future__ import annotations

import pytest

from tests.http import test_contract_auth, test_contract_dashboard
from tests.jetstream.conftest import own_apps
from tests.watch import test_contract_watch_create, test_contract_watch_open

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _own_apps(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_apps(
        backend,
        request,
        monkeypatch,
        test_contract_watch_open,
        test_contract_dashboard,
        test_contract_auth,
        test_contract_watch_create,
    )


PICKED = {
    test_contract_watch_open: [
        "test_max_sse_connections_edge",
        "test_max_sse_connections_order_401_before_429",
        "test_max_sse_connections_per_key_edge",
        "test_per_key_cap_not_applied_in_dev_mode",
        "test_refused_stream_429_retry_after",
        "test_takeover_at_the_connection_cap",
        "test_session_with_open_stream_is_never_reclaimed",
    ],
    test_contract_watch_create: [
        "test_session_cap_edge_and_order",
        "test_reclaimed_sessions_free_their_slot",
    ],
    test_contract_dashboard: [
        "test_max_viewers_refuses_with_429_limit",
    ],
    test_contract_auth: [
        "test_max_inflight_per_key",
        "test_dev_mode_has_no_per_key_inflight_cap",
    ],
}

for _module, _names in PICKED.items():
    for _name in _names:
        globals()[_name] = getattr(_module, _name)
