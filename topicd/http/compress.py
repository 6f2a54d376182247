"""Response compression: gzip for large JSON and metrics bodies (docs/api.md, "Responses").

A successful whole-body answer (JSON, or the Prometheus text of `/v0/metrics`) of at
least `GZIP_MIN_BYTES` is sent gzip-encoded when the request's `Accept-Encoding` allows
gzip, and carries `Vary: Accept-Encoding` whatever the request said (its encoding
depended on that header). Errors and smaller answers are left alone: below about 1 KiB
the saved bytes do not pay for the work and the extra headers. SSE streams never reach
this code (they are served before the framework and written frame by frame).

Compression runs at level 1: on JSON it keeps most of level 6's saving (about 11 % of
the size against 9 %) at a third of the CPU (docs/PERFORMANCE.md, "Response
compression"). A body of at least `GZIP_OFFLOAD_BYTES` is compressed in a worker thread
(`zlib` releases the GIL), so one large answer does not hold the event loop for a
millisecond or more; smaller ones are compressed in place, cheaper than the hand-off.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Final

import trio
from quart.wrappers.response import DataBody

if TYPE_CHECKING:
    from quart import Response

GZIP_MIN_BYTES: Final = 1024
GZIP_OFFLOAD_BYTES: Final = 256 * 1024
GZIP_LEVEL: Final = 1
GZIP_THREADS: Final = 2  # concurrent compressions off the loop (the machine has 2 cores)
COMPRESSIBLE: Final = frozenset({"application/json", "text/plain"})
VARY: Final = "Accept-Encoding"


def accepts_gzip(value: str | None) -> bool:
    """Whether an `Accept-Encoding` value allows gzip: `gzip` (or `x-gzip`) with a
    non-zero q-value, or, when gzip is not named, `*` with a non-zero q-value."""
    if not value:
        return False
    named: float | None = None
    star: float | None = None
    for item in value.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        q = 1.0
        for param in params.split(";"):
            name, _, raw = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(raw.strip())
                except ValueError:
                    q = 0.0  # malformed: not an acceptance
        if coding in ("gzip", "x-gzip"):
            named = q if named is None else max(named, q)
        elif coding == "*":
            star = q
    if named is not None:
        return named > 0
    return star is not None and star > 0


def gzip_bytes(body: bytes) -> bytes:
    """`body` as a gzip member (no name, mtime 0: equal bodies compress equally)."""
    c = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return c.compress(body) + c.flush()


class Compressor:
    """Compresses answers for one app (its own bound on compression threads)."""

    def __init__(
        self,
        min_bytes: int = GZIP_MIN_BYTES,
        offload_bytes: int = GZIP_OFFLOAD_BYTES,
        threads: int = GZIP_THREADS,
    ) -> None:
        self.min_bytes = min_bytes
        self.offload_bytes = offload_bytes
        self.limiter = trio.CapacityLimiter(threads)

    async def encode(self, body: bytes, accept_encoding: str | None) -> bytes | None:
        """`body` gzip-encoded, or None when the client does not accept gzip or the
        encoding would not be smaller. The caller has checked `min_bytes`."""
        if not accepts_gzip(accept_encoding):
            return None
        if len(body) >= self.offload_bytes:
            out = await trio.to_thread.run_sync(gzip_bytes, body, limiter=self.limiter)
        else:
            out = gzip_bytes(body)
        return out if len(out) < len(body) else None

    async def finish(self, response: Response, accept_encoding: str | None) -> Response:
        """A framework answer, compressed when it qualifies (see the module docstring)."""
        length = response.content_length  # None for a streamed body
        if (
            length is None
            or length < self.min_bytes  # most answers stop here, at no cost
            or not 200 <= response.status_code < 300
            or response.status_code == 204
            or response.mimetype not in COMPRESSIBLE
            or "Content-Encoding" in response.headers
            or not isinstance(response.response, DataBody)
        ):
            return response
        body = await response.get_data()
        assert isinstance(body, bytes)
        response.vary.add(VARY)
        encoded = await self.encode(body, accept_encoding)
        if encoded is not None:
            response.set_data(encoded)
            response.headers["Content-Encoding"] = "gzip"
        return response
