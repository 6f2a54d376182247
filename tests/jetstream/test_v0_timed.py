"""The /v0 contract tests that move virtual time, run on each storage backend.

Like `test_v0_subset.py` (`memory`, one `jetstream` front, three `fronts`), for the
contract tests that take `autojump_clock`: long-polls, TTL expiry and its tombstones,
idempotency windows, read times, and the SSE watch stream (frames, heartbeats,
tombstones, resume by `Last-Event-ID`, session reclaim). On the jetstream backends the
clock is a `NetworkClock` (conftest.py): virtual time that never moves while a request
to the NATS servers is in flight, so the tests run unchanged against the real cluster.
With three fronts, a watch stream is opened on the front that created its session
(`StickyWatchApp`: sessions live there, a documented difference); the writes, reads and
deletes of the same test go to every front in turn, so a stream on one front is fed by
writes that the topic's owner, often another front, made.

The tests that open an app of their own config (auth keys, connection and session
caps, small channels for lagging streams) get the backend's app of that config instead
(`own_apps`); the watch-creation tests on the module's auth keys run in
`test_v0_watch.py` (each module's `authed` app is its own). Left out
(`test_v0_coverage.py`): the two that walk minutes of virtual time through every timer
(`test_heartbeat_period_and_clamp`, 8 cases, and
`test_effective_priority_manual_and_auto_decay`: 12-25 s each here; they pass).
"""

from __future__ import annotations

import pytest

from tests.http import (
    test_contract_diff,
    test_contract_record_deletes,
    test_contract_topics,
    test_contract_writes,
)
from tests.jetstream.conftest import own_apps, take
from tests.watch import (
    test_contract_watch_create,
    test_contract_watch_frames,
    test_contract_watch_open,
    test_contract_watch_resume,
)
from tests.watch.test_contract_watch_open import authed  # noqa: F401 (a fixture of its tests)
from topicd.config import Config

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _own_apps(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_apps(backend, request, monkeypatch, test_contract_watch_frames, test_contract_watch_open)


# The servers' default payload cache (the harness's read-back mode, a 0-byte cache, is
# `test_v0_subset.py`'s): a watch catch-up that must load records from the stream splits
# its frames where it loads, as the embedded backend's does for records only in
# segments, so with no cache the frames' batch boundaries and the order of topics in a
# multi-topic catch-up would follow the loads (docs/jetstream.md, Next).
JETSTREAM_CACHE_BYTES = Config().storage.payload_cache_bytes

PICKED = {
    test_contract_diff: [
        "test_long_poll_is_woken_by_a_write",
        "test_pressure_header_is_the_pressure_when_the_answer_starts",
        "test_long_poll_times_out_with_the_empty_result",
        "test_long_poll_wait_is_clamped_to_30s",
        "test_no_wait_when_records_are_available",
        "test_no_wait_when_a_tombstone_is_returned",
        "test_long_poll_woken_by_filtered_write_returns_once",
        "test_topic_deleted_during_long_poll_is_404",
        "test_long_poll_on_absent_topic_is_404_at_once",
        "test_ttl_tombstone_without_writes",
        "test_ttl_expiry_is_strictly_greater_than",
        "test_mixed_tombstone_and_per_range_reason",
        "test_mixed_range_cap_then_ttl_and_ttl_only_subrange",
        "test_no_wait_when_not_caught_up",
    ],
    test_contract_topics: [
        "test_put_tighter_ttl_expires_immediately",
        "test_get_state_after_writes",
        "test_get_touch_bumps_last_read_ts",
        "test_list_enforces_retention",
        "test_delete_if_empty_enforces_ttl_first",
    ],
    test_contract_writes: [
        "test_written_fields_come_back_as_dollar_fields",
        "test_idempotency_window_expiry",
        "test_reject_room_freed_by_ttl",
    ],
    test_contract_record_deletes: [
        "test_only_live_records_count_as_deleted",
    ],
    test_contract_watch_create: [
        "test_tail_session_streams_only_new_records",
        "test_lenient_drops_unknown_topics",
        "test_lenient_dropped_topic_never_appears_in_the_stream",
    ],
    test_contract_watch_frames: [
        "test_open_sends_retry_then_heartbeat_each_its_own_block",
        "test_id_lists_every_session_topic_sorted_bytewise",
        "test_record_frame_shape_and_projection",
        "test_live_record_frame_after_caught_up",
        "test_caught_up_once_per_topic_after_backlog",
        "test_live_records_do_not_repeat_caught_up",
        "test_limit_splits_batches",
        "test_limit_default_zero_and_clamp",
        "test_max_batch_bytes",
        "test_node_filter_skips_that_nodes_records",
        "test_node_filter_off_when_topic_dedupe_node_false",
        "test_skip_only_pass_sends_nothing_but_moves_the_cursor",
        "test_skip_only_deleted_backlog_sends_only_caught_up",
        "test_tombstone_on_first_read_is_from_seq_too_old",
        "test_no_tombstone_when_cursor_is_at_evict_floor",
        "test_deleted_gap_gets_no_tombstone",
        "test_tombstone_earliest_is_evict_floor_when_deletes_follow",
        "test_cursor_above_head_gets_recreated_range",
        "test_cap_eviction_past_a_live_cursor_is_a_cap_tombstone",
        "test_reopen_first_read_tombstone_is_from_seq_too_old_again",
        "test_expired_records_at_open_are_a_tombstone_not_records",
        "test_topic_deleted_while_watched_then_stream_ends",
        "test_topic_deleted_is_per_topic",
        "test_topic_already_gone_at_stream_open",
        "test_every_topic_gone_at_open_ends_the_stream",
        "test_heartbeat_counts_silence_from_the_last_frame",
        "test_shutdown_sends_server_shutting_down_with_the_cursor_map",
        "test_shutdown_id_reflects_frames_written_before_it",
        "test_create_session_returns_all_topics_in_id_even_if_untouched",
        # (these open an app of their own config)
        "test_ttl_expiry_while_lagging_is_a_ttl_tombstone",
        "test_lagging_client_loses_nothing_silently",
    ],
    test_contract_watch_open: [
        "test_response_headers",
        "test_unknown_wid_is_404",
        "test_wid_prefix_or_extension_is_404",
        "test_406_before_404",
        "test_dev_mode_wid_alone_opens_the_stream",
        "test_second_get_takes_over_with_409",
        "test_idle_session_is_reclaimed_after_ttl",
        "test_reclaim_counts_from_stream_close",
        "test_reclaimed_session_is_404_even_with_rewind",
        "test_session_exactly_ttl_old_is_not_reclaimed",
        "test_unacceptable_accept_is_406",
        "test_acceptable_accept",
        "test_wrong_method_on_the_stream_path_is_405",
        "test_wrong_method_on_the_create_path_is_405",
        # (these use the module's `authed` app, or open one of their own config)
        "test_auth_stream_needs_the_creating_key",
        "test_auth_token_first_occurrence_wins",
        "test_auth_header_wins_over_token",
        "test_auth_order_404_before_401",
        "test_auth_order_406_before_401",
        # (the connection-cap tests run in test_v0_caps.py)
    ],
    test_contract_watch_resume: [
        "test_reopen_continues_after_the_last_written_frame",
        "test_unwritten_frames_are_not_counted",
        "test_many_reconnects_no_duplicates_no_gaps",
        "test_last_event_id_rewinds",
        "test_last_event_id_never_advances",
        "test_higher_id_does_not_advance_before_any_delivery",
        "test_rewind_below_the_initial_from_seq",
        "test_missing_topics_keep_their_cursor_unknown_are_ignored",
        "test_padded_base64url_is_accepted",
        "test_id_with_unsorted_keys_or_spaces_still_rewinds",
        "test_cursor_query_used_when_header_absent",
        "test_header_wins_over_cursor_query",
        "test_undecodable_header_still_wins_over_cursor_query",
        "test_rewind_is_applied_to_the_stored_cursor",
        "test_undecodable_id_is_ignored",
    ],
}

for _module, _names in PICKED.items():
    take(globals(), _module, _names)
