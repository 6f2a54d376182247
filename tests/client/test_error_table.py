"""The client's typed errors mirror the server's error table.

Method: the server's table (`topicd.errors.all_error_classes`) is the reference: every
code it can answer must have its own client class, and docs/client.md must list it.
Then `error_from_response` is fed canonical bodies and odd ones (no body, an unknown
code, hints in the header, the body or both) and must pick the class and the wait hint
the docs promise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from topicd.client import errors as ce
from topicd.errors import all_error_classes

ROOT = Path(__file__).resolve().parents[2]


def server_codes():
    return {cls.code for cls in all_error_classes()}


def test_every_server_code_has_a_client_class():
    assert server_codes() <= ce.known_codes()


def test_client_md_lists_every_code():
    text = (ROOT / "docs" / "client.md").read_text("utf-8")
    missing = [code for code in server_codes() if f"`{code}`" not in text]
    assert not missing


def body(code, detail=None):
    err = {"code": code, "message": f"{code} happened"}
    if detail is not None:
        err["detail"] = detail
    return {"error": err}


@pytest.mark.parametrize(
    ("status", "code", "detail", "cls"),
    [
        (404, "topic_not_found", {"topic": "t"}, ce.TopicNotFound),
        (409, "not_a_queue", {"topic": "t"}, ce.NotAQueue),
        (422, "topic_full", {}, ce.TopicFull),
        (429, "throttled", {"retry_after_ms": 300}, ce.Throttled),
        (429, "throttled", {"cause": "wal_ingest", "retry_after_ms": 300}, ce.Throttled),
        (429, "throttled", {"limit": "max_topics", "max": 1}, ce.CapacityError),
        (503, "storage_unavailable", {"retry_after_ms": 10}, ce.StorageUnavailable),
        (503, "brand_new_reason", None, ce.Unavailable),
        (429, "brand_new_throttle", {"limit": "x"}, ce.CapacityError),
        (418, "teapot", None, ce.ServerError),
    ],
)
def test_codes_map_to_classes(status, code, detail, cls):
    err = ce.error_from_response(status, body(code, detail), "1")
    assert type(err) is cls
    assert (err.status, err.code, err.message) == (status, code, f"{code} happened")
    assert err.detail == (detail or {})


def test_the_wait_hint_is_the_larger_of_header_and_body():
    assert (
        ce.error_from_response(429, body("throttled", {"retry_after_ms": 2500}), "1").retry_after_ms
        == 2500
    )
    assert (
        ce.error_from_response(429, body("throttled", {"retry_after_ms": 200}), "2").retry_after_ms
        == 2000
    )
    assert ce.error_from_response(503, body("not_ready"), None).retry_after_ms is None


def test_a_body_without_the_canonical_shape_still_gives_a_typed_error():
    err = ce.error_from_response(502, None, None)
    assert type(err) is ce.ServerError and err.code == "http_502"
    assert type(ce.error_from_response(503, "oops", "3")) is ce.Unavailable
