"""The queue contract tests of `tests/http/test_contract_queues.py` and
`tests/http/test_contract_queue_levels.py`, run on each storage backend like
`test_v0_subset.py`: `memory`, one `jetstream` front, and three `fronts` (each request
to the next front in turn, so claims, acks, nacks and extends reach the queue's owner
directly and through followers alike). The ones that move virtual time (lease expiry,
extend, nack delays, retry backoff, the claim coalescing window, depth levels against
the ack rate) run on the `NetworkClock` (conftest.py), as `test_v0_timed.py`'s do.

The body-shape refusals of claims, ack/nack/extend and priorities run too (the HTTP
layer decides them before any backend is asked, so they cost a queue creation each and
show that no backend changes them). The tests that open an app of their own config
(`max_claim`, `max_nack_delay_ms`, auth scopes, the retry-after clamps) get the
backend's app of that config instead (`own_apps`).
"""

from __future__ import annotations

import pytest

from tests.http import test_contract_queue_levels, test_contract_queues
from tests.jetstream.conftest import own_apps, take

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _own_apps(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_apps(backend, request, monkeypatch, test_contract_queues, test_contract_queue_levels)


PICKED = [
    "test_absent_topic_is_404_and_never_created",
    "test_log_topic_is_409_not_a_queue",
    "test_claim_needs_a_body",
    "test_claim_node_of_128_bytes_is_accepted",
    "test_claim_node_must_be_a_non_empty_string_of_at_most_128_bytes",
    "test_priority_must_be_a_32_bit_integer",
    "test_bad_lease_op_bodies_are_400",
    "test_a_bad_seq_or_fence_is_named_in_the_400",
    "test_claim_max_defaults_to_1_and_0_means_1",
    "test_claim_data_text_is_returned_as_written",
    "test_empty_queue_claims_nothing_without_error",
    "test_without_priorities_claims_come_in_ascending_seq",
    "test_claim_order_is_priority_descending_then_seq",
    "test_batch_priority_is_a_default_and_per_record_wins",
    "test_retried_work_comes_first_within_its_priority",
    "test_nacked_job_keeps_its_priority",
    "test_claims_ignore_node_filtering",
    "test_diff_on_a_queue_never_claims",
    "test_ack_deletes_the_job_for_good",
    "test_ack_skips_what_the_node_does_not_hold",
    "test_ack_is_idempotent",
    "test_empty_seqs_is_a_no_op",
    "test_more_than_max_claim_seqs_is_batch_too_large",
    "test_an_empty_fence_checks_only_the_node",
    "test_nack_releases_at_once_and_keeps_the_delivery_count",
    "test_nack_skips_what_the_node_does_not_hold",
    "test_extend_needs_lease_ms",
    "test_a_job_over_max_deliveries_moves_to_the_dead_letter_topic",
    "test_dead_letter_copy_keeps_its_priority_in_a_queue",
    "test_without_dead_letter_jobs_are_redelivered_forever",
    "test_a_failed_move_leaves_the_job_claimable",
    "test_get_shows_the_queue_block",
    "test_deleting_the_topic_drops_its_leases",
    "test_evicted_jobs_stop_being_claimable",
    "test_deleted_jobs_stop_being_claimable",
    "test_leases_durable_is_accepted_and_the_lease_calls_answer_as_without_it",
    "test_ack_on_an_ephemeral_queue",
    # (these move virtual time)
    "test_claim_lease_ms_defaults_to_the_topic_and_is_clamped",
    "test_claim_item_fields_and_order",
    "test_a_stale_fence_never_acks_a_re_leased_job",
    "test_an_expired_lease_makes_the_job_claimable_again",
    "test_an_expired_lease_cannot_be_acked_even_if_nobody_re_claimed_it",
    "test_expiry_timer_releases_leases_without_any_request",
    "test_nack_delay_hides_the_job_until_it_ends",
    "test_extend_sets_the_deadline_from_now",
    "test_extend_keeps_the_delivery_count_and_clamps_lease_ms",
    "test_an_expired_lease_cannot_be_extended",
    "test_a_cohort_is_served_round_robin_when_the_window_closes",
    "test_a_cohort_on_a_deleted_queue_fails_the_first_claimer_only",
    # (these open an app of their own config)
    "test_claim_max_is_clamped_to_max_claim",
    "test_nack_delay_is_clamped_to_max_nack_delay_ms",
    "test_claim_needs_read_and_write_scopes",
]

LEVELS = [
    "test_extension_fields_are_echoed_only_when_set",
    "test_levels_gate_new_jobs_from_critical_on",
    "test_hysteresis_leaves_critical_only_below_its_bound_minus_005",
    "test_retry_after_follows_the_measured_ack_rate",
    "test_overflow_bypass_waits_for_the_level_then_429",
    "test_levels_off_by_default_and_on_log_topics",
    "test_expired_and_nacked_jobs_back_off_by_deliveries_squared",
    "test_no_backoff_by_default",
    "test_a_queue_leaves_the_registry_when_its_limit_goes",
    "test_retry_after_is_clamped",
]

take(globals(), test_contract_queues, PICKED)
take(globals(), test_contract_queue_levels, LEVELS)
