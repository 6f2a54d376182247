"""A strict HTTP/1.1 request-head parser for the direct socket path (sans-IO).

The direct path (`topicd/http/server.py`) reads a request head off the socket and asks this
module what it is:

* `early_refusal(buf, start)`: while a head is still arriving, whether the bytes so far
  can already never make a valid head (a bare LF or CR, a control byte, a request line
  that is not `token SP target SP ...`, such as a TLS ClientHello sent to the plain port).
  Such a head is refused at once instead of waiting for the header timeout.
* `parse_head(head)`: a complete head (without its final blank line) becomes a `Head`
  (served directly, or `handoff` to Hypercorn when it is valid but unusual), or a
  `Refusal` (`400`, then the connection closes).
* `HeadCache.parse(head)`: `parse_head`, remembering the last `HEAD_CACHE_ENTRIES` heads it
  accepted. A keep-alive client sends the same head again and again (same target, same
  fields, same `content-length` for records of one size), and a repeated head is then a
  dictionary lookup instead of a parse. Only the exact bytes of a head accepted before
  hit, so the answer is the parser's; a `Head` is never changed after it is made.

What the direct path accepts (RFC 9112 / RFC 9110 syntax, checked strictly):

* request line `method SP origin-form SP HTTP/1.1` (or `HTTP/1.0`), the method a token,
  the target printable ASCII without spaces;
* field lines `name ":" OWS value OWS`, the name a token, the value visible ASCII,
  obs-text, spaces and tabs, no other control byte;
* at most one `Content-Length`, a plain decimal number (no list, no sign);
* one `Host` (required in HTTP/1.1).

Refused with `400` (and the connection closed, so nothing after the head is parsed as a
request): anything that breaks the syntax above, obs-fold (a field line starting with
whitespace), a repeated or non-numeric `Content-Length`, `Content-Length` together with
`Transfer-Encoding` (RFC 9112 §6.1: the connection must close), a `Transfer-Encoding` other
than exactly one `chunked`, or any `Transfer-Encoding` in HTTP/1.0.

Handed to Hypercorn unchanged (`handoff`): other forms of target (absolute, authority,
`*`), other `HTTP/1.x` versions, `Transfer-Encoding: chunked`, `Upgrade`, `Expect`.
"""

from __future__ import annotations

import re
from typing import Final

_TOKEN: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
REQUEST_LINE: Final = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])")
# a field line; the value without its surrounding whitespace is group 2
FIELD_LINE: Final = re.compile(
    rb"(" + _TOKEN + rb"):[ \t]*((?:[\x21-\x7e\x80-\xff](?:[\x20-\x7e\x80-\xff\t]*"
    rb"[\x21-\x7e\x80-\xff])?)?)[ \t]*"
)
# bytes that are never in a head, whatever their place (CR and LF are checked in pairs)
_CONTROL: Final = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# what the request line may look like while it is still arriving
_LINE_PREFIX: Final = re.compile(
    rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]*(?: [\x21-\x7e]*(?: [\x21-\x7e]*)?)?"
)
_PREFIX_CHECKED: Final = 64
_DIGITS: Final = re.compile(rb"[0-9]{1,18}")

HANDOFF_FIELDS: Final = frozenset((b"upgrade", b"expect"))


class Head:
    """A parsed request head. `headers` has lowercased names and values without their
    surrounding whitespace, in arrival order (as an ASGI scope carries them)."""

    __slots__ = ("close", "handoff", "headers", "length", "method", "target", "version")

    def __init__(
        self,
        method: bytes,
        target: bytes,
        version: bytes,
        headers: list[tuple[bytes, bytes]],
        length: int | None,
        *,
        close: bool,
        handoff: bool,
    ) -> None:
        self.method = method
        self.target = target
        self.version = version  # b"1.1", b"1.0" (another 1.x only with `handoff`)
        self.headers = headers
        self.length = length  # the declared `content-length`; None: no body framing field
        self.close = close  # the client asked to close (`connection: close`), or HTTP/1.0
        self.handoff = handoff  # valid, but Hypercorn's to serve


class Refusal:
    """Why a head is refused (`400`, then the connection closes)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Refusal({self.reason!r})"


HEAD_CACHE_ENTRIES: Final = 256  # heads remembered (the oldest goes first)
HEAD_CACHE_MAX_BYTES: Final = 2048  # a longer head is parsed every time


class HeadCache:
    """`parse_head` with a bounded memory of the heads it accepted (module docstring).
    At most `HEAD_CACHE_ENTRIES` heads of at most `HEAD_CACHE_MAX_BYTES` bytes each; a
    refused head is never remembered (its connection closes)."""

    __slots__ = ("_heads",)

    def __init__(self) -> None:
        self._heads: dict[bytes, Head] = {}

    def parse(self, head: bytes) -> Head | Refusal:
        heads = self._heads
        hit = heads.get(head)
        if hit is not None:
            return hit
        parsed = parse_head(head)
        if isinstance(parsed, Head) and len(head) <= HEAD_CACHE_MAX_BYTES:
            if len(heads) >= HEAD_CACHE_ENTRIES:
                del heads[next(iter(heads))]  # the oldest (insertion order)
            heads[head] = parsed
        return parsed

    def __len__(self) -> int:
        return len(self._heads)


def early_refusal(buf: bytes, start: int = 0) -> Refusal | None:
    """Whether the incomplete head `buf` (no blank line yet) can already never be valid.
    `buf` starts with the request line (the caller drops empty lines before it). Only
    bytes from `start` on are new (earlier ones were checked by an earlier call), so a
    head that arrives a byte at a time costs linear time."""
    lo = max(start - 1, 0)  # one byte back: a CR at the end of the previous piece
    if buf[:1] == b"\x16":
        return _not_a_request_line(buf)
    if _CONTROL.search(buf, lo):
        return Refusal("a control character in the request head")
    at = buf.find(b"\n", lo)
    while at >= 0:
        if at == 0 or buf[at - 1] != 0x0D:
            return Refusal("a bare LF in the request head (lines end in CRLF)")
        at = buf.find(b"\n", at + 1)
    at = buf.find(b"\r", lo)
    while at >= 0:
        if at + 1 < len(buf) and buf[at + 1] != 0x0A:
            return Refusal("a bare CR in the request head")
        at = buf.find(b"\r", at + 1)
    cr = buf.find(b"\r")
    if cr < 0 or cr + 1 == len(buf):  # the request line is still arriving
        # (its first bytes tell garbage, e.g. a TLS ClientHello, from a request line; the
        # rest of a long line is checked once it is complete)
        stop = min(_PREFIX_CHECKED, len(buf) if cr < 0 else cr)
        if lo < _PREFIX_CHECKED and _LINE_PREFIX.fullmatch(buf, 0, stop) is None:
            return _not_a_request_line(buf)
    elif cr >= lo - 1 and REQUEST_LINE.fullmatch(buf, 0, cr) is None:
        return _not_a_request_line(buf)
    return None


def _not_a_request_line(buf: bytes) -> Refusal:
    if buf[:1] == b"\x16":  # a TLS handshake record
        return Refusal("a TLS handshake on a plain-HTTP port (use http://, not https://)")
    return Refusal("not an HTTP/1.1 request line")


def parse_head(head: bytes) -> Head | Refusal:
    """A complete request head, without its final CRLF CRLF (see module docstring)."""
    lines = head.split(b"\r\n")
    m = REQUEST_LINE.fullmatch(lines[0])
    if m is None:
        if b"\n" in head or b"\r" in head.replace(b"\r\n", b""):
            return Refusal("a bare LF or CR in the request head (lines end in CRLF)")
        return Refusal("not an HTTP/1.1 request line")
    method, target, major, minor = m.groups()
    if major != b"1":
        return Refusal("not an HTTP/1.x request")
    version = b"1." + minor
    handoff = minor not in (b"0", b"1") or target[0] != 0x2F  # "/": origin-form
    headers: list[tuple[bytes, bytes]] = []
    length: int | None = None
    chunked = False
    hosts = 0
    close = minor == b"0"
    for line in lines[1:]:
        f = FIELD_LINE.fullmatch(line)
        if f is None:
            if line[:1] in (b" ", b"\t"):
                return Refusal("a folded header line (obs-fold)")
            return Refusal("a malformed header line")
        name = f.group(1).lower()
        value = f.group(2)
        headers.append((name, value))
        if name == b"content-length":
            if length is not None or _DIGITS.fullmatch(value) is None:
                return Refusal("a repeated or malformed Content-Length")
            length = int(value)
        elif name == b"transfer-encoding":
            if chunked or value.lower() != b"chunked" or minor == b"0":
                return Refusal("an unsupported Transfer-Encoding (only one `chunked`)")
            chunked = True
        elif name == b"host":
            hosts += 1
        elif name == b"connection":
            if b"close" in value.lower():
                close = True
        elif name in HANDOFF_FIELDS:
            handoff = True
    if chunked and length is not None:
        return Refusal("both Content-Length and Transfer-Encoding")
    if hosts > 1 or (hosts == 0 and minor != b"0"):
        return Refusal("an HTTP/1.1 request needs exactly one Host header")
    return Head(
        method,
        target,
        version,
        headers,
        length,
        close=close,
        handoff=handoff or chunked,
    )
