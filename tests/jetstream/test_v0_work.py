"""The `/v0/topics/:q/work` contract tests of `tests/http/test_contract_work.py`, run on
each storage backend: `memory`, one `jetstream` front, and three `fronts`.

With three fronts, each stream opens on the next front in turn and each ack, nack and
state read goes to the next front after it, so a stream is held by a queue's owner or by
a follower front (which forwards its claims to the owner and is woken by the owner's
notices) and its jobs are acked through any front. The module's `h` fixture is the
backend's `harness` with the queue `q` made, in place of the contract module's
in-memory one. Virtual time is the `NetworkClock` (conftest.py).

The tests that open an app of their own config (the heartbeat period, the SSE caps,
auth keys) get the backend's app of that config instead (`own_apps`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.http import test_contract_work
from tests.http.test_contract_queues import make_queue
from tests.jetstream.conftest import own_apps, take

if TYPE_CHECKING:
    from topicd.testing.harness import AppHarness

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _own_apps(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_apps(backend, request, monkeypatch, test_contract_work)


@pytest.fixture
async def h(harness: AppHarness) -> AppHarness:
    await make_queue(harness.app.test_client())
    return harness


PICKED = [
    "test_jobs_are_pushed_up_to_max_in_claim_order",
    "test_an_append_wakes_an_idle_stream_at_once",
    "test_nack_frees_depth_and_the_job_comes_back",
    "test_an_expired_lease_frees_depth_at_its_deadline",
    "test_disconnect_releases_the_streams_leases_at_once",
    "test_a_pushed_job_is_acked_with_its_lease_id",
    "test_topic_deleted_ends_the_stream_with_a_409_error_frame",
    "test_shutdown_ends_the_stream_and_releases_its_leases",
    "test_max_is_clamped_and_unparsable_max_is_one",
    "test_lease_ms_is_clamped_like_a_claims",
    "test_work_streams_count_in_state_and_metrics",
    "test_establishment_errors_in_order",
    "test_accept_event_stream_absent_or_any_is_accepted",
    "test_pacing_advice_is_an_error_frame_and_the_stream_stays",
    "test_other_methods_are_405_allow_get",
    # (these open an app of their own config)
    "test_heartbeat_after_work_heartbeat_ms_of_silence",
    "test_the_sse_caps_count_work_streams",
    "test_auth_header_or_token_and_read_plus_write",
]

take(globals(), test_contract_work, PICKED)
