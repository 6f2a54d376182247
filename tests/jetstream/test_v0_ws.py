"""The WebSocket contract tests of `tests/ws/test_ws_contract.py`, run on each storage
backend: `memory`, one `jetstream` front, and three `fronts`.

With three fronts the socket is on one front, and the test's HTTP writes, reads and
deletes go to every front in turn; the socket's front is the one that does *not* own
the test's topic `t`, so its subscriptions are fed by the owner's notices and its
`publish`es are forwarded to the owner. `h.engine` and `h.lifecycle` are the socket's
front's, where the tests look at its watchers and connections.

The admission tests of `tests/ws/test_ws_admission.py` run here too: keys and scopes
on that module's `authed` app, the connection caps, the permits, an upgrade while not
serving and the drain. The tests that open an app of their own config (publish errors
on a tightened config, the subscription cap, auth keys, caps) get the backend's app of
that config instead, socket side included; every bad command of the parser's table runs
on each backend.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest

from tests.jetstream.conftest import FrontsHarness, SpreadClient, fronts_of, open_backend, take
from tests.ws import test_ws_admission, test_ws_contract
from tests.ws.test_ws_admission import authed  # noqa: F401 (a fixture of its tests)
from topicd.config import Config
from topicd.http.app import Gate, gate_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from topicd.testing.harness import AppHarness

pytestmark = pytest.mark.slow

# The servers' default payload cache, as in `test_v0_timed.py`: a catch-up that loads
# records from the stream sends a topic's records where its load ends, so with no cache
# a subscription's topics that need no load (a `tail`) could be caught up before one
# that does, as on the embedded backend for records only in segments.
JETSTREAM_CACHE_BYTES = Config().storage.payload_cache_bytes


def sticky_gate(socket_front: AppHarness, hs: Sequence[AppHarness]) -> Gate:
    """The socket front's gate, except that a watch stream's `GET /v0/watch/:wid` goes
    to the front that created the session (sessions live there: `StickyWatchApp`)."""
    base = gate_of(socket_front.app)

    class Sticky(type(base)):  # type: ignore[misc]
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            path = str(scope.get("path", ""))
            if path.startswith("/v0/watch/"):
                wid = path.split("/")[3]
                for h in hs:
                    if wid in h.engine.watch.sessions:
                        await h.app.asgi_app(scope, receive, send)
                        return
            await base(scope, receive, send)

    gate = copy.copy(base)
    gate.__class__ = Sticky
    return gate


class SocketFrontApp:
    """`h.app` for the `fronts` backend: its ASGI entry (the gate a socket upgrades
    through) is one front's, but a watch stream opens on its session's front; its test
    client sends each request to the next front."""

    def __init__(self, socket_front: AppHarness, hs: Sequence[AppHarness]) -> None:
        self.asgi_app = sticky_gate(socket_front, hs)
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
    backend: str,
    request: pytest.FixtureRequest,
    config: Config | None = None,
    *,
    serving: bool = True,
) -> AsyncIterator[AppHarness]:
    async with open_backend(backend, request, config, serving=serving) as harness:
        yield socket_harness(harness)


@pytest.fixture(autouse=True)
def _own_apps(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the tests that open an app of their own config get the backend's, socket side
    # included)
    for module in (test_ws_contract, test_ws_admission):
        monkeypatch.setattr(module, "open_app", partial(open_socket_app, backend, request))


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
    "test_bad_commands_get_error_messages_and_the_socket_stays",
    "test_a_binary_message_is_unsupported",
    "test_message_over_max_body_bytes_is_refused",
    # (these open an app of their own config)
    "test_publish_errors_carry_the_http_codes",
    "test_subscriptions_per_connection_are_capped_at_max_watch_topics",
]

# the admission tests of `tests/ws/test_ws_admission.py`: keys and scopes on the module's
# `authed` app, the caps, the permits, not serving, and the drain
ADMISSION = [
    "test_upgrade_without_a_valid_key_is_401",
    "test_any_valid_key_connects_and_scopes_are_checked_per_command",
    "test_publish_with_config_needs_admin",
    "test_prefix_allowlist_applies_to_every_named_topic",
    "test_connections_count_against_the_sse_caps",
    "test_per_key_cap_with_auth",
    "test_upgrade_while_not_serving_is_503",
    "test_drain_sends_server_shutting_down_then_closes",
    "test_drain_closes_even_when_the_client_never_answers",
    "test_publish_is_client_work_under_the_permits",
]

take(globals(), test_ws_contract, PICKED)
take(globals(), test_ws_admission, ADMISSION)
