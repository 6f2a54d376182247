"""The error table (STYLE §5): every wire code is unique, matches the spec's status, and is
documented in docs/errors.md."""

from __future__ import annotations

from pathlib import Path

from topicd.errors import Throttled, TopicdError, all_error_classes

DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"

# README §6 of the spec: code -> status
SPEC = {
    "invalid_request": 400,
    "batch_too_large": 400,
    "record_too_large": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "topic_not_found": 404,
    "router_not_found": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "not_acceptable": 406,
    "router_cycle": 409,
    "topic_exists_incompatible": 409,
    "topic_not_empty": 409,
    "not_a_queue": 409,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "topic_full": 422,
    "throttled": 429,
    "internal": 500,
    "not_ready": 503,
    "shutting_down": 503,
    "storage_unavailable": 503,
}


# status variants: a subclass that keeps its parent's wire code with another status
VARIANTS = {"RequestHeadTooLarge": ("invalid_request", 431)}


def test_codes_are_unique_and_match_the_spec():
    classes = [c for c in all_error_classes() if "code" in vars(c)]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), codes
    assert {c.code: c.http_status for c in classes} == SPEC


def test_status_variants_keep_their_parents_code():
    variants = {c.__name__: c for c in all_error_classes() if "code" not in vars(c)}
    assert {name: (c.code, c.http_status) for name, c in variants.items()} == VARIANTS


def test_every_code_is_documented():
    text = DOCS.read_text("utf-8")
    missing = [c.code for c in all_error_classes() if f"`{c.code}`" not in text]
    assert not missing, missing


def test_canonical_body_omits_empty_detail():
    assert TopicdError("x").body() == {"error": {"code": "internal", "message": "x"}}


def test_throttled_retry_after():
    assert Throttled.pressure(1).retry_after_s() == 1
    assert Throttled.pressure(2001, cause="wal_ingest", scope="topic").retry_after_s() == 3
    assert Throttled.limit("max_topics", 5).retry_after_s() == 1


def test_an_error_rebuilt_from_its_wire_form_renders_the_same():
    """`error_from_wire` (a forwarded request's answer): every class comes back as
    itself, with the same body, status and Retry-After."""
    from topicd.errors import error_from_wire

    for cls in all_error_classes():
        if cls is Throttled:
            err: TopicdError = Throttled.pressure(2500, cause="wal_ingest", scope="topic")
        elif err_503(cls):
            err = cls("why", {"topic": "t"}, retry_after_s=3)  # type: ignore[call-arg]
        else:
            err = cls.__new__(cls)
            TopicdError.__init__(err, "why", {"topic": "t"})
        body = err.body()["error"]
        assert isinstance(body, dict)
        detail = body.get("detail", {})
        assert isinstance(detail, dict)
        back = error_from_wire(
            str(body["code"]), err.http_status, str(body["message"]), detail, err.retry_after_s()
        )
        assert type(back) is cls
        assert (back.body(), back.http_status) == (err.body(), err.http_status)
        assert back.retry_after_s() == err.retry_after_s()
    unknown = error_from_wire("no_such_code", 418, "teapot", {})
    assert (unknown.code, unknown.http_status) == ("internal", 500)


def err_503(cls: type[TopicdError]) -> bool:
    return cls.http_status == 503
