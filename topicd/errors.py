"""The one error table: every failure a client can see, with its wire code and HTTP status.

The engine raises these; `topicd.http.app` renders every one of them through a single
handler as the canonical body `{"error": {"code", "message", "detail"?}}` (spec README §5),
adding `Retry-After` where the class says so. The engine never imports Quart, and no other
module decides a status code.

Families (few, per STYLE §5): request errors (4xx the client must change), capacity errors
(429/422 the client may retry), lifecycle and storage errors (503, always retryable) and
`Internal` (a bug). Bugs elsewhere are `assert`s, not codes.
"""

from __future__ import annotations

import math
from typing import ClassVar

JsonScalar = str | int | float | bool | None
JsonValue = JsonScalar | list["JsonValue"] | dict[str, "JsonValue"]
Detail = dict[str, JsonValue]


class TopicdError(Exception):
    """Base of every client-visible error.

    Args:
        message: human text (never parsed by clients; may change).
        detail: optional machine-readable object; omitted from the body when empty.
    """

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, detail: Detail | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail: Detail = detail if detail is not None else {}

    def retry_after_s(self) -> int | None:
        """Seconds for the `Retry-After` header, or None when the error carries none."""
        return None

    def extra_headers(self) -> dict[str, str]:
        """Headers the error adds besides `Retry-After` (e.g. `Allow` on a 405)."""
        return {}

    def body(self) -> dict[str, JsonValue]:
        err: dict[str, JsonValue] = {"code": self.code, "message": self.message}
        if self.detail:
            err["detail"] = dict(self.detail)
        return {"error": err}


# ---- request errors (4xx) -------------------------------------------------------------


class InvalidRequest(TopicdError):
    code = "invalid_request"
    http_status = 400


class RequestHeadTooLarge(InvalidRequest):
    """`431`: the request line and headers exceed the server's bound. A status variant of
    `invalid_request` (same wire code): the client must send a smaller head."""

    http_status = 431


class BatchTooLarge(TopicdError):
    code = "batch_too_large"
    http_status = 400


class RecordTooLarge(TopicdError):
    code = "record_too_large"
    http_status = 400


class Unauthorized(TopicdError):
    code = "unauthorized"
    http_status = 401

    def extra_headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="topicd"'}


class Forbidden(TopicdError):
    code = "forbidden"
    http_status = 403


class TopicNotFound(TopicdError):
    code = "topic_not_found"
    http_status = 404

    def __init__(self, topic: str) -> None:
        super().__init__(f"topic {topic!r} does not exist", {"topic": topic})


class RouterNotFound(TopicdError):
    code = "router_not_found"
    http_status = 404


class NotFound(TopicdError):
    code = "not_found"
    http_status = 404


class MethodNotAllowed(TopicdError):
    code = "method_not_allowed"
    http_status = 405

    def __init__(self, message: str, allow: list[str]) -> None:
        super().__init__(message)
        self.allow = sorted(set(allow))

    def extra_headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allow)}


class NotAcceptable(TopicdError):
    code = "not_acceptable"
    http_status = 406


class RouterCycle(TopicdError):
    code = "router_cycle"
    http_status = 409


class TopicExistsIncompatible(TopicdError):
    code = "topic_exists_incompatible"
    http_status = 409


class TopicNotEmpty(TopicdError):
    code = "topic_not_empty"
    http_status = 409


class NotAQueue(TopicdError):
    code = "not_a_queue"
    http_status = 409


class PayloadTooLarge(TopicdError):
    code = "payload_too_large"
    http_status = 413


class UnsupportedMediaType(TopicdError):
    code = "unsupported_media_type"
    http_status = 415


# ---- capacity (retryable after something changes) ------------------------------------


class TopicFull(TopicdError):
    code = "topic_full"
    http_status = 422


class Throttled(TopicdError):
    """`429 throttled`. Exactly one of the three README §6 shapes.

    * resource cap: `limit` + `max` (Retry-After 1; retry only after freeing resources);
    * pressure: `retry_after_ms` (optionally with `cause` and `scope`).
    """

    code = "throttled"
    http_status = 429

    def __init__(self, message: str, detail: Detail) -> None:
        assert ("limit" in detail) != ("retry_after_ms" in detail), detail
        super().__init__(message, detail)

    @classmethod
    def limit(cls, name: str, maximum: int) -> Throttled:
        return cls(f"resource cap {name} reached ({maximum})", {"limit": name, "max": maximum})

    @classmethod
    def pressure(
        cls, retry_after_ms: int, *, cause: str | None = None, scope: str | None = None
    ) -> Throttled:
        detail: Detail = {}
        if cause is not None:
            detail["cause"] = cause
        if scope is not None:
            detail["scope"] = scope
        detail["retry_after_ms"] = retry_after_ms
        what = f"{cause} saturated" if cause else "server under pressure"
        return cls(f"{what}; retry after {retry_after_ms} ms", detail)

    @property
    def cause_label(self) -> str:
        """Label for `topicd_throttled_total{cause}`."""
        if "limit" in self.detail:
            return "limit"
        cause = self.detail.get("cause")
        return cause if isinstance(cause, str) else "pressure"

    def retry_after_s(self) -> int:
        ms = self.detail.get("retry_after_ms")
        if isinstance(ms, int):
            return max(1, math.ceil(ms / 1000))
        return 1


# ---- server side ---------------------------------------------------------------------


class Internal(TopicdError):
    code = "internal"
    http_status = 500


class _Retryable503(TopicdError):
    http_status = 503

    def __init__(self, message: str, detail: Detail | None = None, retry_after_s: int = 1) -> None:
        super().__init__(message, detail)
        self._retry_after_s = max(1, retry_after_s)

    def retry_after_s(self) -> int:
        return self._retry_after_s


class NotReady(_Retryable503):
    code = "not_ready"


class ShuttingDown(_Retryable503):
    code = "shutting_down"


class StorageUnavailable(_Retryable503):
    code = "storage_unavailable"


def all_error_classes() -> list[type[TopicdError]]:
    """Every concrete error class (used by the docs/uniqueness test)."""
    out: list[type[TopicdError]] = []
    stack: list[type[TopicdError]] = [TopicdError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls is not TopicdError and not cls.__name__.startswith("_"):
            out.append(cls)
    return out


def error_from_wire(
    code: str, status: int, message: str, detail: Detail, retry_after_s: int | None = None
) -> TopicdError:
    """The error another topicd process answered (`code`, `status`, `message`, `detail`
    as its canonical body has them, and its `Retry-After` seconds), rebuilt as the class
    that raised it, so this process renders it unchanged (a forwarded request's answer)."""
    for cls in all_error_classes():
        if cls.code == code and cls.http_status == status:
            err = cls.__new__(cls)
            TopicdError.__init__(err, message, dict(detail))
            if isinstance(err, MethodNotAllowed):
                err.allow = []
            if isinstance(err, _Retryable503):
                err._retry_after_s = max(1, retry_after_s or 1)
            return err
    return Internal(message, dict(detail))
