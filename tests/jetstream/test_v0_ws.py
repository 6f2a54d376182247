"""The WebSocket contract tests of `tests/ws/test_ws_contract.py`, run on each storage
backend: `memory`, one `jetstream` front, and three `fronts`.

With three fronts the socket is on one front, and the test's HTTP writes, reads and
deletes go to every front in turn; the socket's front is the one that does *not* own
the test's topic `t`, so its subscriptions are fed by the owner's notices and its
`publish`es are forwarded to the owner. `h.engine` and `h.lifecycle` are the socket's
front's, where the tests look at its watchers and connections.

The tests that open an app of their own config (publish errors on a tightened config,
the subscription cap) get the backend's app of that config instead. Left out: what the
socket's command parser decides before any backend is asked (a binary message, the
body cap; of the bad commands, every case but the unknown topic's).
"""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING

import pytest

from tests.jetstream.conftest import FrontsHarness, SpreadClient, fronts_of, open_backend
from tests.ws import test_ws_contract
from topicd.config import Config

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from topicd.testing.harness import AppHarness

pytestmark = pytest.mark.slow

# The servers' default payload cache, as in `test_v0_timed.py`: a catch-up that loads
# records from the stream sends a topic's records where its load ends, so with no cache
# a subscription's topics that need no load (a `tail`) could be caught up before one
# that does, as on the embedded backend for records only in segments.
JETSTREAM_CACHE_BYTES = Config().storage.payload_cache_bytes


class SocketFrontApp:
    """`h.app` for the `fronts` backend: its ASGI entry (the gate a socket upgrades
    through) is one front's; its test client sends each request to the next front."""

    def __init__(self, socket_front: AppHarness, hs: Sequence[AppHarness]) -> None:
        self.asgi_app = socket_front.app.asgi_app
        self._hs = list(hs)

    def test_client(self) -> SpreadClient:
        return SpreadClient(self._hs)


def socket_harness(harness: AppHarness) -> AppHarness:
    """`harness` itself, or on `fronts` the harness of the front that does not own `t`,
    with sockets on that front and HTTP requests spread over all three."""
    if not isinstance(harness, FrontsHarness):
        return harness
    hs = harness.fronts
    front = next(f for f in hs if not fronts_of(f).owns("t"))
    return dataclasses.replace(front, app=SocketFrontApp(front, hs))  # type: ignore[arg-type]


@asynccontextmanager
async def open_socket_app(
    backend: str, request: pytest.FixtureRequest, config: Config | None = None
) -> AsyncIterator[AppHarness]:
    async with open_backend(backend, request, config) as harness:
        yield socket_harness(harness)


@pytest.fixture(autouse=True)
def _own_apps(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the tests that open an app of their own config get the backend's, socket side
    # included)
    monkeypatch.setattr(test_ws_contract, "open_app", partial(open_socket_app, backend, request))


@pytest.fixture
async def h(harness: AppHarness, autojump_clock: object) -> AppHarness:
    await harness.app.test_client().put("/v0/topics/t", json={})
    return socket_harness(harness)


PICKED = [
    "test_subscribe_replies_subscribed_then_records_then_caught_up",
    "test_from_seq_resumes_after_the_cursor_and_tail_starts_at_the_head",
    "test_limit_and_projection_options_shape_the_frames",
    "test_publish_acks_with_the_http_write_fields",
    "test_unsubscribe_stops_delivery_and_ignores_unknown_names",
    "test_resubscribe_replaces_cursor_and_options",
    "test_ping_echoes_any_request_id",
    "test_lenient_subscribe_leaves_unknown_topics_out",
    "test_topic_deleted_ends_the_subscription",
    "test_a_tombstone_reports_cap_eviction_with_its_own_reason",
    "test_client_close_is_answered_and_frees_the_slot",
    "test_a_bug_in_a_command_is_an_internal_error_message",
    "test_a_command_sent_right_behind_the_handshake_is_not_lost",
    # (these open an app of their own config)
    "test_publish_errors_carry_the_http_codes",
    "test_subscriptions_per_connection_are_capped_at_max_watch_topics",
]

for _name in PICKED:
    globals()[_name] = getattr(test_ws_contract, _name)


@pytest.mark.parametrize(
    ("text", "code"), [('{"op": "subscribe", "topic": "missing"}', "topic_not_found")]
)
async def test_bad_commands_get_error_messages_and_the_socket_stays(
    h: AppHarness, nursery: object, text: str, code: str
) -> None:
    # (the one case a backend answers: the contract test, with that case only)
    await test_ws_contract.test_bad_commands_get_error_messages_and_the_socket_stays(
        h, nursery, text, code
    )
