"""The /v0 contract tests that need no virtual time, run on each storage backend.

The tests are the ones of `tests/http/` (and a few of `tests/watch/`), taken into this
module so they run under this directory's `harness`/`client` fixtures, parametrized by
backend: `memory` (the in-memory engine), `jetstream` (one front on a real nats-server
cluster) and `fronts` (three fronts, each request to the next in turn). Taken: the
topic, write, diff, record-delete, error, probe, query-boolean, auth, compression,
smoke and watch-create contract tests (those taking `autojump_clock` run in
`test_v0_timed.py`, but for a few here that move it too). The tests that open an app of
their own config (tightened limits, auth keys, a server still starting) get the
backend's app of that config instead (`own_apps`). On the jetstream backends the ones
exercising what the backend does differently by design (the batch ceiling; see
docs/jetstream.md) are marked, and `test_backend.py` checks it; so are, on `fronts`, the
instance-wide limits each front counts on its own (conftest.py, `FRONTS_UNFIXED`).
Left out, with the reasons, in `test_v0_coverage.py`: tests of a pure function or of
the compressor alone, the direct socket path, and the generated-bodies Hypothesis test.
The queue and router contract tests run in `test_v0_queues.py` and `test_v0_routers.py`.
"""

from __future__ import annotations

import pytest

from tests.http import (
    test_compression,
    test_contract_auth,
    test_contract_diff,
    test_contract_errors,
    test_contract_probes,
    test_contract_query_bools,
    test_contract_record_deletes,
    test_contract_topics,
    test_contract_writes,
    test_smoke,
)
from tests.http.test_compression import frozen_perf  # noqa: F401 (a fixture of its tests)
from tests.http.test_contract_auth import authed  # noqa: F401 (a fixture of its tests)
from tests.jetstream.conftest import own_apps, take
from tests.watch import test_contract_watch_create, test_contract_watch_frames

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _own_apps(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_apps(
        backend,
        request,
        monkeypatch,
        test_compression,
        test_contract_auth,
        test_contract_errors,
        test_contract_probes,
        test_contract_topics,
        test_contract_writes,
    )


PICKED = {
    test_contract_topics: [
        "test_put_empty_body_creates_with_all_defaults",
        "test_put_empty_object_equals_empty_body",
        "test_put_empty_body_with_json_content_type_is_defaults",
        "test_put_returns_full_resolved_config",
        "test_put_identical_is_200_noop",
        "test_put_is_not_a_merge",
        "test_put_unknown_fields_are_ignored",
        "test_put_type_change_is_409_and_changes_nothing",
        "test_put_omitting_type_on_a_queue_is_a_type_change",
        "test_put_lease_ms_is_clamped_and_stored_clamped",
        "test_put_claim_jitter_is_clamped",
        "test_put_priority_is_clamped_within_i32",
        "test_put_priority_outside_i32_is_a_type_error",
        "test_put_durable_alias",
        "test_put_durability_is_mutable_in_place",
        "test_put_durability_change_across_ephemeral_keeps_the_records",
        "test_put_dead_letter_must_be_a_valid_name",
        "test_put_dead_letter_on_queue_must_differ_from_topic",
        "test_put_queue_only_fields_echoed_on_log",
        "test_put_check_order_dead_letter_before_type_immutability",
        "test_put_bad_values_are_400_and_create_nothing",
        "test_put_u64_max_is_accepted",
        "test_put_non_object_body_is_400",
        "test_put_tighter_cap_evicts_immediately",
        "test_put_tighter_cap_on_reject_topic_evicts_immediately",
        "test_put_switching_reject_to_old_evicts_immediately",
        "test_get_state_of_empty_topic",
        "test_get_touch_true_values",
        "test_diff_bumps_last_read_ts",
        "test_get_absent_topic_is_404_and_never_creates",
        "test_list_empty",
        "test_list_is_sorted_bytewise_with_item_fields",
        "test_list_prefix_filter",
        "test_list_pagination_with_cursor",
        "test_list_next_cursor_only_when_another_page_exists",
        "test_list_cursor_is_unpadded_base64url_of_after",
        "test_list_cursor_with_prefix",
        "test_list_page_size_clamps_never_reject",
        "test_list_default_page_size_is_100",
        "test_list_empty_cursor_is_treated_as_absent",
        "test_list_accepts_standard_base64_cursor",
        "test_list_bad_cursor_is_400",
        "test_list_cursor_survives_deletion_of_its_topic",
        "test_list_touch_false_by_default",
        "test_delete_existing_topic",
        "test_delete_absent_topic_is_200_deleted_false",
        "test_delete_if_empty_on_non_empty_topic_is_409",
        "test_delete_if_empty_on_empty_topic",
        "test_delete_if_empty_counts_live_records_only",
        "test_recreate_after_delete_is_a_fresh_instance",
        # (these open an app of their own config)
        "test_put_max_topics_cap",
        "test_list_page_size_clamp_uses_max_page_size",
    ],
    test_contract_writes: [
        "test_first_write_creates_201_then_200",
        "test_write_to_put_created_topic_is_200",
        "test_return_seqs_false_omits_seqs",
        "test_seqs_are_contiguous_in_array_order",
        "test_data_null_is_kept_and_data_key_required",
        "test_create_false_on_absent_topic_is_404",
        "test_create_false_on_existing_topic_is_ignored",
        "test_inline_auto_create_false_blocks_lazy_creation",
        "test_create_true_overrides_auto_create_false",
        "test_inline_config_is_used_exactly_like_put",
        "test_inline_config_ignored_on_existing_topic",
        "test_bad_inline_config_on_creating_write_is_400",
        "test_inline_config_type_errors_are_400_even_on_existing_topic",
        "test_lazy_create_with_invalid_name_is_400",
        "test_records_must_be_a_non_empty_array",
        "test_batch_too_large_at_default_10000",
        "test_idempotency_key_length_in_utf8_bytes",
        "test_idempotency_header_length_limit",
        "test_tag_limit_256_bytes",
        "test_node_limit_128_bytes",
        "test_batch_node_is_resolved_per_record",
        "test_meta_limits",
        "test_meta_may_be_any_json_value",
        "test_meta_key_limit_counts_top_level_keys_of_objects_only",
        "test_priority_must_be_i32",
        "test_record_too_large_boundary",
        "test_rejected_batch_appends_nothing",
        "test_data_and_meta_round_trip_as_exact_minified_text",
        "test_bytes_are_minified_data_plus_meta",
        "test_unset_fields_are_omitted_never_null",
        "test_dedupe_replay_returns_original_result",
        "test_dedupe_replay_survives_record_deletes",
        "test_dedupe_replay_respects_return_seqs",
        "test_idempotency_key_header",
        "test_idempotency_body_key_wins_over_header",
        "test_idempotency_keys_are_per_topic",
        "test_dedupe_of_a_creating_write_is_200_created_false",
        "test_topic_delete_forgets_dedupe_state",
        "test_concurrent_writes_with_same_key_append_once",
        "test_reject_topic_full_is_422_with_detail",
        "test_reject_batch_larger_than_cap_is_record_too_large",
        "test_reject_room_freed_by_record_delete",
        "test_discard_old_evicts_oldest",
        "test_order_content_type_before_body_shape",
        "test_order_idempotency_key_before_record_size",
        "test_order_field_overflow_before_record_size",
        "test_order_records_checked_in_array_order",
        "test_order_record_checks_before_topic_resolution",
        "test_order_topic_not_found_before_dedupe",
        "test_order_record_checks_before_dedupe",
        "test_order_dedupe_before_topic_full",
        # (these open an app of their own config)
        "test_batch_limit_boundary",
        "test_record_size_counts_minified_text",
        "test_max_total_bytes",
        "test_max_total_bytes_is_not_bypassed",
        "test_max_idempotency_entries",
        "test_max_total_bytes_counts_live_bytes_only",
        "test_max_idempotency_entries_is_instance_wide",
        "test_order_batch_too_large_before_idempotency_key_length",
        "test_order_batch_too_large_before_record_checks",
        "test_order_record_checks_before_max_topics",
        "test_order_dedupe_before_max_total_bytes",
        "test_order_topic_full_before_max_total_bytes",
        "test_order_max_topics_is_the_last_resolution_check",
    ],
    test_contract_diff: [
        "test_diff_response_fields",
        "test_diff_absent_topic_is_404_and_never_creates",
        "test_empty_body_means_defaults",
        "test_from_seq_is_exclusive",
        "test_empty_topic_is_caught_up_at_zero",
        "test_limit_default_zero_and_clamp",
        "test_over_max_values_are_clamped_not_rejected",
        "test_from_seq_u64_max_is_valid",
        "test_node_filter_string_and_array",
        "test_node_filter_cursor_moves_over_skipped",
        "test_node_filter_stops_at_limit",
        "test_dedupe_node_false_delivers_echoes",
        "test_include_tags_and_include_meta",
        "test_max_batch_bytes_budget",
        "test_max_batch_bytes_default_is_1mib",
        "test_priority_field_on_read",
        "test_deleted_records_are_walked_over",
        "test_deleted_tail_moves_cursor_without_records",
        "test_cap_records_tombstone",
        "test_cap_in_one_oversized_batch",
        "test_cap_bytes_tombstone",
        "test_tighter_cap_produces_tombstone",
        "test_deleted_prefix_is_silent",
        "test_evicting_deleted_slots_does_not_move_the_floor",
        "test_tombstone_earliest_below_response_earliest_after_deletes",
        "test_recreated_tombstone_after_delete_and_recreate",
        "test_recreated_tombstone_on_empty_instance",
        "test_recreated_restarts_at_earliest",
        "test_at_most_one_tombstone_recreated_wins",
    ],
    test_contract_record_deletes: [
        "test_before_seq_deletes_prefix_and_reports_state",
        "test_before_seq_bounds",
        "test_deleting_again_deletes_zero",
        "test_head_is_unchanged_and_seqs_are_not_reused",
        "test_middle_delete_does_not_move_earliest",
        "test_match_eq_tuple",
        "test_match_glob_tuple",
        "test_match_glob_star_alone_matches_every_tagged_record",
        "test_only_the_final_star_is_special",
        "test_bare_string_without_star_is_eq",
        "test_bare_string_with_trailing_star_is_glob",
        "test_match_is_byte_exact",
        "test_untagged_records_never_match",
        "test_match_nothing_is_200_with_zero",
        "test_before_seq_and_match_are_anded",
        "test_delete_is_point_in_time",
        "test_no_tombstone_after_deletes",
        "test_bytes_and_count_are_post_delete",
        "test_absent_topic_is_404_and_never_creates",
        "test_neither_before_seq_nor_match_is_400",
        "test_empty_body_is_invalid",
        "test_bad_predicates_are_400",
        "test_bad_before_seq_is_400",
    ],
    test_contract_errors: [
        "test_unknown_paths_are_404_not_found",
        "test_wrong_method_is_405_with_allow",
        "test_empty_body_rules",
        "test_gzip_bodies_are_decoded",
        "test_invalid_gzip_is_400",
        "test_unsupported_content_encoding_is_rejected",
        "test_write_field_types",
        "test_diff_field_types_and_ranges",
        "test_unknown_keys_are_ignored",
        "test_invalid_topic_names_are_400_on_every_endpoint",
        "test_name_boundaries_are_valid",
        "test_names_are_case_sensitive",
        "test_non_utf8_bodies_are_400",
        "test_lone_surrogate_escapes_never_500",
        "test_odd_query_values_never_500",
        "test_non_json_content_type_is_415",
        "test_json_media_type_parameters_and_case",
        "test_malformed_json_is_400",
        "test_non_object_top_level_is_400",
        # (these open an app of their own config)
        "test_body_over_max_body_bytes_is_413",
        "test_413_precedes_415",
    ],
    test_contract_probes: [
        "test_health_when_serving",
        "test_ready_when_serving_counts_topics",
        "test_while_draining",
        # (these open an app of their own config)
        "test_while_starting_only_probes_answer",
        "test_probe_auth",
    ],
    test_contract_query_bools: [
        "test_if_empty_yes_deletes_nothing",
        "test_if_empty_other_values_are_400_and_delete_nothing",
        "test_if_empty_true_spellings_refuse_a_non_empty_topic",
        "test_if_empty_false_spellings_and_absence_delete",
        "test_return_seqs_other_values_are_400_and_append_nothing",
        "test_return_seqs_spellings",
        "test_touch_other_values_are_400_and_touch_nothing",
        "test_touch_spellings_on_the_state_read",
        "test_touch_spellings_on_the_list",
        "test_lenient_other_values_are_400",
        "test_lenient_true_spellings_drop_unknown_topics",
        "test_lenient_false_spellings_and_absence_refuse_unknown_topics",
        "test_page_size_is_clamped_never_refused",
    ],
    test_smoke: [
        "test_write_then_diff",
    ],
    test_contract_watch_create: [
        "test_create_response_shape",
        "test_wids_are_unique_and_well_formed",
        "test_from_seq_defaults_to_zero_and_tail_wins_over_from_seq",
        "test_topic_count_edge_256_ok_257_is_400",
        "test_too_many_topics_is_400_before_404",
        "test_longest_valid_name_is_accepted",
        "test_missing_content_type_is_415",
        "test_unknown_keys_are_ignored",
        "test_over_max_values_are_clamped_not_rejected",
        "test_unknown_topic_is_404_topic_not_found",
    ],
    test_contract_auth: [
        "test_dev_mode_ignores_the_header",
        # (these use the module's `authed` app, or open one of their own config)
        "test_missing_or_unknown_key_is_401",
        "test_401_precedes_body_and_route_checks",
        "test_token_whitespace_is_trimmed",
        "test_scope_table",
        "test_write_scope_may_lazy_create_without_config",
        "test_creating_write_with_config_needs_admin",
        "test_config_on_existing_topic_needs_no_admin",
        "test_order_json_shape_before_admin_check",
        "test_order_admin_check_before_record_checks",
        "test_prefix_allowlist_on_path_names",
        "test_prefix_allowlist_filters_the_list",
        "test_key_entry_syntax",
        "test_prefix_key_keeps_its_scopes",
        "test_other_methods_on_topic_paths_need_write",
        "test_query_token_is_not_accepted_on_topic_routes",
    ],
    # (these move virtual time, as `test_v0_timed.py`'s do; here, with the 0-byte cache,
    # every live record's bytes are loaded back from the stream before a watch stream
    # gets them: it must still get one record frame each and no second `caught-up`)
    test_contract_watch_frames: [
        "test_live_records_do_not_repeat_caught_up",
        "test_heartbeat_counts_silence_from_the_last_frame",
    ],
    test_compression: [
        # (these open an app of their own)
        "test_diff_answers_at_the_threshold",
        "test_claim_of_many_jobs_is_compressed",
        "test_small_answers_and_errors_are_never_compressed",
        "test_metrics_text_and_json_are_compressed",
        "test_sse_streams_are_never_compressed",
    ],
}

for _module, _names in PICKED.items():
    take(globals(), _module, _names)


@pytest.mark.usefixtures("frozen_perf")
async def test_fast_path_write_answers_at_the_threshold(autojump_clock: object) -> None:
    # (on virtual time: a jetstream write's `performance.wal_append_ms` is its publish
    # round trip, measured on the Trio clock, which the `NetworkClock` keeps still while
    # the publish is in flight; on the real clock its digits would change the answer's
    # size, which the test sets to the byte)
    await test_compression.test_fast_path_write_answers_at_the_threshold(None)


test_fast_path_write_answers_at_the_threshold.contract_test = (  # type: ignore[attr-defined]
    test_compression.test_fast_path_write_answers_at_the_threshold
)
