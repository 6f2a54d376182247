"""Typed errors of the client: one class per server error code, plus the client's own.

`error_from_response` turns a canonical error body (`{"error": {"code", "message",
"detail"}}`) into the class registered for its `code`; an unknown code becomes a plain
`ServerError`, so a newer server never breaks an older client. `429 throttled` splits in
two: a body carrying `detail.limit` is a `CapacityError` (a resource cap: free something
before retrying), every other `429` is a `Throttled` with `retry_after_ms` (pressure: the
client retries it after the server's hint).
"""

from __future__ import annotations

from typing import ClassVar

JsonScalar = str | int | float | bool | None
JsonValue = JsonScalar | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject = dict[str, JsonValue]


class ClientError(Exception):
    """Base of every error the client raises."""


class ServerError(ClientError):
    """The server answered with a canonical error body.

    Attributes:
        status: the HTTP status.
        code: the stable `error.code` (branch on this or on the class; the class
            attribute `CODE` is the code it was registered for).
        message: human text; may change between versions.
        detail: the `error.detail` object (`{}` when absent).
        retry_after_ms: the server's wait hint, `max(Retry-After·1000, detail.retry_after_ms)`,
            or None when it gave none.
    """

    CODE: ClassVar[str] = ""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        detail: JsonObject | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.detail: JsonObject = detail or {}
        self.retry_after_ms = retry_after_ms


class InvalidRequest(ServerError):
    CODE = "invalid_request"


class BatchTooLarge(ServerError):
    CODE = "batch_too_large"


class RecordTooLarge(ServerError):
    CODE = "record_too_large"


class Unauthorized(ServerError):
    CODE = "unauthorized"


class Forbidden(ServerError):
    CODE = "forbidden"


class TopicNotFound(ServerError):
    CODE = "topic_not_found"


class RouterNotFound(ServerError):
    CODE = "router_not_found"


class NotFound(ServerError):
    CODE = "not_found"


class MethodNotAllowed(ServerError):
    CODE = "method_not_allowed"


class NotAcceptable(ServerError):
    CODE = "not_acceptable"


class RouterCycle(ServerError):
    CODE = "router_cycle"


class TopicExistsIncompatible(ServerError):
    CODE = "topic_exists_incompatible"


class TopicNotEmpty(ServerError):
    CODE = "topic_not_empty"


class NotAQueue(ServerError):
    CODE = "not_a_queue"


class PayloadTooLarge(ServerError):
    CODE = "payload_too_large"


class UnsupportedMediaType(ServerError):
    CODE = "unsupported_media_type"


class TopicFull(ServerError):
    """`422`: a full `discard:"reject"` topic; never retried by the client."""

    CODE = "topic_full"


class Throttled(ServerError):
    """`429` under pressure (`retry_after_ms`, maybe a `cause`); retried after the hint."""

    CODE = "throttled"


class CapacityError(Throttled):
    """`429` carrying `detail.limit`: a resource cap. Never retried by the client."""


class Internal(ServerError):
    CODE = "internal"


class Unavailable(ServerError):
    """Every `503`: the server applied nothing; retried after the hint."""


class NotReady(Unavailable):
    CODE = "not_ready"


class ShuttingDown(Unavailable):
    CODE = "shutting_down"


class StorageUnavailable(Unavailable):
    CODE = "storage_unavailable"


class ConnectionFailed(ClientError):
    """No answer from the server (refused, reset, timed out) after the client's retries,
    or a failure after sending a request that is not safe to retry."""


class ProtocolError(ClientError):
    """The server's answer did not have the documented shape."""


class BackpressureTimeout(ClientError):
    """The producer stayed paused at a hard backpressure threshold for `max_pause_ms`."""


class WatchSuperseded(ClientError):
    """Another stream took over this watch session (a newer `GET` for the same `wid`)."""


def sole_error(group: BaseExceptionGroup[BaseException]) -> Exception | None:
    """The one plain error inside a (nested) exception group, or None when there are
    several or any is not an `Exception` (a cancellation must propagate as it is)."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    if len(leaves) == 1 and isinstance(leaves[0], Exception):
        return leaves[0]
    return None


_BY_CODE: dict[str, type[ServerError]] = {
    cls.CODE: cls
    for cls in (
        InvalidRequest,
        BatchTooLarge,
        RecordTooLarge,
        Unauthorized,
        Forbidden,
        TopicNotFound,
        RouterNotFound,
        NotFound,
        MethodNotAllowed,
        NotAcceptable,
        RouterCycle,
        TopicExistsIncompatible,
        TopicNotEmpty,
        NotAQueue,
        PayloadTooLarge,
        UnsupportedMediaType,
        TopicFull,
        Throttled,
        Internal,
        NotReady,
        ShuttingDown,
        StorageUnavailable,
    )
}


def known_codes() -> frozenset[str]:
    """Every wire code that has its own class."""
    return frozenset(_BY_CODE)


def _int(value: JsonValue) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return int(value)
    return None


def error_from_response(status: int, body: JsonValue, retry_after: str | None) -> ServerError:
    """The typed error for one non-2xx answer.

    Args:
        status: the HTTP status.
        body: the decoded JSON body (anything: a body without the canonical shape gives a
            `ServerError` with code `http_<status>`).
        retry_after: the raw `Retry-After` header, if any.
    """
    code = f"http_{status}"
    message = ""
    detail: JsonObject = {}
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            code = str(err.get("code", code))
            message = str(err.get("message", ""))
            raw_detail = err.get("detail")
            if isinstance(raw_detail, dict):
                detail = raw_detail
    hints: list[int] = []
    if retry_after is not None and retry_after.strip().isdigit():
        hints.append(int(retry_after.strip()) * 1000)
    hinted = _int(detail.get("retry_after_ms"))
    if hinted is not None:
        hints.append(hinted)
    retry_after_ms = max(hints) if hints else None
    cls: type[ServerError] = _BY_CODE.get(code, ServerError)
    if cls is Throttled and "limit" in detail:
        cls = CapacityError
    elif cls is ServerError and status == 503:
        cls = Unavailable
    elif cls is ServerError and status == 429:
        cls = CapacityError if "limit" in detail else Throttled
    return cls(status, code, message or f"HTTP {status}", detail, retry_after_ms)
