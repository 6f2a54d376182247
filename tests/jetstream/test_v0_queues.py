"""The queue contract tests of `tests/http/test_contract_queues.py` that need no virtual
time, run on each storage backend like `test_v0_subset.py`: `memory`, one `jetstream`
front, and three `fronts` (each request to the next front in turn, so claims, acks,
nacks and extends reach the queue's owner directly and through followers alike).
Left out: the body-shape refusals of ack/nack/extend (`test_bad_lease_op_bodies_are_400`,
`test_a_bad_seq_or_fence_is_named_in_the_400`: 31 cases), which the HTTP layer decides
before any backend is asked, so they would only add a queue creation each to the
suite's time.
"""

from __future__ import annotations

import pytest

from tests.http import test_contract_queues

pytestmark = pytest.mark.slow

PICKED = [
    "test_absent_topic_is_404_and_never_created",
    "test_log_topic_is_409_not_a_queue",
    "test_claim_needs_a_body",
    "test_claim_node_of_128_bytes_is_accepted",
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
]

for _name in PICKED:
    globals()[_name] = getattr(test_contract_queues, _name)
