"""The router contract tests of `tests/http/`, run on each storage backend.

The tests are every one of `tests/http/test_contract_routers.py`, taken into this module
so they run under this directory's `harness`/`client` fixtures, parametrized by
backend: `memory` (the in-memory engine), `jetstream` (one front,
whose copies are materialized in the destination's stream: docs/jetstream.md,
"Routers") and `fronts` (three fronts, one owner shard each, each request to the next
front in turn: a router's calls reach the front running it, the destination's owner,
directly and through the others, and its source may be another front's). The two that
open an app of their own config (`max_routers`, auth scopes and prefixes) get the
backend's app of that config (`own_apps`). The one that holds a topic creation by
patching one process's engine runs on `memory` and `jetstream`, and is skipped on
`fronts`, where the creations run on the source's owner, another front's engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.http import test_contract_routers
from tests.jetstream.conftest import own_apps, take

if TYPE_CHECKING:
    from topicd.testing.harness import AppHarness

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _own_apps(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_apps(backend, request, monkeypatch, test_contract_routers)


PICKED = [
    "test_put_creates_and_echoes_every_field",
    "test_put_identical_is_200_noop_that_keeps_the_cursor",
    "test_other_fields_are_mutable_by_reput",
    "test_no_backfill_the_cursor_starts_at_the_source_head",
    "test_bad_names_and_same_source_dest_are_400",
    "test_create_dest_false_on_absent_dest_is_404_with_the_dest",
    "test_fan_in_from_another_source_is_409_router_dest_fan_in",
    "test_two_routers_of_one_source_into_one_dest_copy_in_lockstep",
    "test_exactly_once_copies_carry_the_topics_router_meta_key",
    "test_exactly_once_through_a_chain_keeps_one_marker_of_the_last_hop",
    "test_repoint_is_409_with_the_existing_endpoints",
    "test_a_cycle_is_409_router_cycle_with_the_path",
    "test_allow_cycle_loops_stop_at_the_hop_cap",
    "test_get_has_forwarded_total_and_absent_is_router_not_found",
    "test_list_sorts_filters_and_pages",
    "test_delete_is_idempotent_and_stops_forwarding",
    "test_deleting_source_or_dest_removes_its_routers",
    "test_copy_gets_fresh_seq_and_keeps_data_meta_tag_node",
    "test_preserve_flags_false_drop_node_and_tag",
    "test_node_filtering_applies_to_copies",
    "test_dest_seqs_are_dest_base_plus_source_records_handled",
    "test_direct_writes_interleave_in_arrival_order",
    "test_read_path_catch_up_sees_the_copy_at_once",
    "test_a_full_reject_dest_holds_the_cursor_never_drops",
    "test_records_the_source_evicted_first_are_source_trim",
    # (these open an app of their own config)
    "test_max_routers_is_429_limit",
    "test_scopes_and_prefixes_apply_to_name_source_and_dest",
]


take(globals(), test_contract_routers, PICKED)


async def test_two_routers_auto_creating_one_source_at_once_both_land(
    backend: str, harness: AppHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (it holds one process's creation of the source by patching that engine's
    # `create_default` and its backend's `control`: on `fronts` the creations run on the
    # source's owner, another front's engine, so there is no one process to patch)
    if backend == "fronts":
        pytest.skip("patches one process's engine; the creations run on the owner front")
    await test_contract_routers.test_two_routers_auto_creating_one_source_at_once_both_land(
        harness, monkeypatch
    )


test_two_routers_auto_creating_one_source_at_once_both_land.contract_test = (  # type: ignore[attr-defined]
    test_contract_routers.test_two_routers_auto_creating_one_source_at_once_both_land
)
