"""The rest of the watch contract tests, run on each storage backend: `memory`, one
`jetstream` front, and three `fronts`.

The session-creation tests of `tests/watch/test_contract_watch_create.py` that the other
modules leave out (refusals of bad bodies and names, the session cap, and the auth
cases on the module's `authed` app, each client request to the next front in turn),
and the lag tests of `tests/watch/test_lag.py`: a stalled watcher never delays the
others nor loses a record, eviction while lagged arrives as an exact tombstone, the
byte bound, the slow-consumer timeout, the memory bound with many stalled streams. The
tests that open an app of their own config get the backend's app of that config
(`own_apps`); a watch stream opens on the front that created its session
(`StickyWatchApp`), so on `fronts` it is fed by the writes of whichever front owns its
topics. Virtual time is the `NetworkClock` (conftest.py).
"""

from __future__ import annotations

import pytest

from tests.jetstream.conftest import own_apps, take
from tests.watch import test_contract_watch_create, test_lag
from tests.watch.test_contract_watch_create import authed  # noqa: F401 (a fixture of its tests)
from topicd.config import Config

pytestmark = pytest.mark.slow

# The servers' default payload cache, as in `test_v0_timed.py`: a lagged stream's
# catch-up splits its frames where it loads records from the stream.
JETSTREAM_CACHE_BYTES = Config().storage.payload_cache_bytes


@pytest.fixture(autouse=True)
def _own_apps(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_apps(backend, request, monkeypatch, test_contract_watch_create, test_lag)


PICKED = {
    test_contract_watch_create: [
        "test_empty_or_missing_topics_is_400",
        "test_invalid_topic_name_is_400",
        "test_wrong_types_are_400",
        "test_malformed_json_is_400",
        # (these use the module's `authed` app, or open one of their own config)
        "test_auth_no_key_or_bad_key_is_401",
        "test_auth_key_without_read_is_403",
        "test_auth_read_keys_may_create",
        "test_auth_topic_outside_prefixes_is_403_with_detail_topic",
        "test_auth_allowlist_runs_before_topic_resolution",
    ],
    test_lag: [
        "test_stalled_watcher_never_delays_others_and_loses_nothing",
        "test_eviction_while_lagged_arrives_as_an_exact_tombstone",
        "test_byte_bound_marks_lagged",
        "test_slow_consumer_timeout_closes_the_stream_and_the_session_resumes",
        "test_memory_per_connection_is_bounded_with_many_stalled",
    ],
}

for _module, _names in PICKED.items():
    take(globals(), _module, _names)
