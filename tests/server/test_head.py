"""The direct path's request-head parser (`topicd.http.head`), without a socket.

Method: table tests for every rule the module docstring states (accepted, refused,
handed off), then properties with Hypothesis: the parser never raises on any bytes; every
head it accepts, h11 (the parser it replaced, still Hypercorn's) accepts too, with the
same method, target, version and header list; heads built from valid parts are accepted
however their bytes are split on arrival, and a bare LF, bare CR or control byte
inserted anywhere is refused by the first piece that holds it.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topicd.http.head import (
    HEAD_CACHE_ENTRIES,
    HEAD_CACHE_MAX_BYTES,
    Head,
    HeadCache,
    Refusal,
    early_refusal,
    parse_head,
)

H = b"Host: x\r\n"
SETTINGS = settings(
    max_examples=300,
    database=None,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def parse(raw: bytes) -> Head | Refusal:
    """`raw` is a whole head ending in CRLF CRLF, as on the wire."""
    assert raw.endswith(b"\r\n\r\n")
    return parse_head(raw[:-4])


def test_a_plain_head_is_parsed_as_an_asgi_scope_carries_it():
    head = parse(
        b"POST /v0/topics/t?x=1 HTTP/1.1\r\nHost: example:80\r\nContent-Type:application/json"
        b"  \r\nX-Empty:\r\nContent-Length: 12\r\nX-Mid: a \t b\r\n\r\n"
    )
    assert isinstance(head, Head)
    assert (head.method, head.target, head.version) == (b"POST", b"/v0/topics/t?x=1", b"1.1")
    assert head.headers == [
        (b"host", b"example:80"),
        (b"content-type", b"application/json"),
        (b"x-empty", b""),
        (b"content-length", b"12"),
        (b"x-mid", b"a \t b"),
    ]
    assert (head.length, head.close, head.handoff) == (12, False, False)


@pytest.mark.parametrize(
    ("raw", "close"),
    [
        (b"GET / HTTP/1.1\r\n" + H + b"Connection: close\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\n" + H + b"Connection: keep-alive, Close\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\n" + H + b"Connection: keep-alive\r\n\r\n", False),
        (b"GET / HTTP/1.0\r\n\r\n", True),  # HTTP/1.0: no Host needed, never kept
        (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True),
    ],
)
def test_connection_close_and_http10(raw, close):
    head = parse(raw)
    assert isinstance(head, Head) and head.close is close and not head.handoff


@pytest.mark.parametrize(
    "raw",
    [
        b"GET http://x/v0/topics HTTP/1.1\r\n" + H + b"\r\n",  # absolute-form
        b"OPTIONS * HTTP/1.1\r\n" + H + b"\r\n",
        b"CONNECT x:443 HTTP/1.1\r\n" + H + b"\r\n",
        b"GET / HTTP/1.2\r\n" + H + b"\r\n",
        b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: CHUNKED\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + H + b"Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"POST / HTTP/1.1\r\n" + H + b"Expect: 100-continue\r\nContent-Length: 1\r\n\r\n",
    ],
)
def test_valid_but_unusual_heads_are_handed_off(raw):
    head = parse(raw)
    assert isinstance(head, Head) and head.handoff


REFUSED = {
    "CL and TE": b"POST / HTTP/1.1\r\n"
    + H
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    "TE and CL": b"POST / HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\nContent-Length: 0\r\n",
    "TE twice": b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n" * 2,
    "TE list": b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked, identity\r\n",
    "TE gzip": b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip, chunked\r\n",
    "TE xchunked": b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: xchunked\r\n",
    "TE in 1.0": b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n",
    "TE space colon": b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding : chunked\r\n",
    "TE tab colon": b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding\t: chunked\r\n",
    "TE folded": b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding:\r\n chunked\r\n",
    "CL twice same": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 3\r\nContent-Length: 3\r\n",
    "CL twice differ": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 3\r\nContent-Length: 4\r\n",
    "CL list": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 3, 3\r\n",
    "CL sign": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: +3\r\n",
    "CL negative": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: -1\r\n",
    "CL hex": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 0x10\r\n",
    "CL empty": b"POST / HTTP/1.1\r\n" + H + b"Content-Length:\r\n",
    "CL huge": b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 1" + b"0" * 18 + b"\r\n",
    "obs-fold": b"GET / HTTP/1.1\r\n" + H + b"X-A: a\r\n\tb\r\n",
    "space before colon": b"GET / HTTP/1.1\r\n" + H + b"X-A : a\r\n",
    "no colon": b"GET / HTTP/1.1\r\n" + H + b"X-A a\r\n",
    "empty name": b"GET / HTTP/1.1\r\n" + H + b": a\r\n",
    "bad name": b"GET / HTTP/1.1\r\n" + H + b"X(A): a\r\n",
    "NUL in value": b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n",
    "bare CR in value": b"GET / HTTP/1.1\r\n" + H + b"X-A: a\rb\r\n",
    "bare LF in value": b"GET / HTTP/1.1\r\n" + H + b"X-A: a\nb\r\n",
    "DEL in value": b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x7fb\r\n",
    "no Host": b"GET / HTTP/1.1\r\nX-A: a\r\n",
    "two Hosts": b"GET / HTTP/1.1\r\n" + H + H,
    "two Hosts in 1.0": b"GET / HTTP/1.0\r\n" + H + H,
    "two spaces": b"GET  / HTTP/1.1\r\n" + H,
    "no version": b"GET /\r\n" + H,
    "lowercase version": b"GET / http/1.1\r\n" + H,
    "HTTP/2.0 line": b"GET / HTTP/2.0\r\n" + H,
    "HTTP/0.9 line": b"GET / HTTP/0.9\r\n" + H,
    "non-ASCII target": b"GET /caf\xc3\xa9 HTTP/1.1\r\n" + H,
    "space in target": b"GET /a b HTTP/1.1\r\n" + H,
    "bad method": b"G(T / HTTP/1.1\r\n" + H,
    "trailing space": b"GET / HTTP/1.1 \r\n" + H,
    "bare LF lines": b"GET / HTTP/1.1\n" + H,
    "leading space": b" GET / HTTP/1.1\r\n" + H,
}


@pytest.mark.parametrize("raw", list(REFUSED.values()), ids=list(REFUSED))
def test_malformed_and_ambiguous_heads_are_refused(raw):
    assert isinstance(parse(raw + b"\r\n"), Refusal)


def test_refusals_name_the_reason():
    reason = parse(REFUSED["CL and TE"] + b"\r\n")
    assert isinstance(reason, Refusal)
    assert reason.reason == "both Content-Length and Transfer-Encoding"
    folded = parse(REFUSED["obs-fold"] + b"\r\n")
    assert isinstance(folded, Refusal) and "obs-fold" in folded.reason


CLIENT_HELLO = bytes.fromhex("160301020001000 1fc0303".replace(" ", "")) + bytes(range(32))


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (CLIENT_HELLO[:1], "TLS"),
        (CLIENT_HELLO, "TLS"),
        (b"GET / HTTP/1.1\nHost", "bare LF"),
        (b"GET / HTTP/1.1\r\nHost: x\n", "bare LF"),
        (b"GET / HTTP/1.1\r\nHost: x\rY", "bare CR"),
        (b"GET /\x00", "control"),
        (b"GET / HTTP/1.1\r\nX: \x01", "control"),
        (b"G(", "request line"),
        (b"GET / HTTP/1.1 x\r\n", "request line"),
        (b"GET / FTP/1.1\r\n", "request line"),
    ],
)
def test_a_head_that_can_never_be_valid_is_refused_before_it_completes(raw, words):
    refusal = early_refusal(raw)
    assert isinstance(refusal, Refusal) and words in refusal.reason, refusal


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"G",
        b"GET",
        b"GET /v0/top",
        b"GET / HTTP/1.",
        b"GET / HTTP/1.1\r",
        b"PRI * HTTP/2.0\r\n",
    ],
)
def test_a_valid_prefix_is_not_refused(raw):
    assert early_refusal(raw) is None


# ------------------------------------------------------------------------------------------
# properties

TCHARS = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
tokens = st.binary(min_size=1, max_size=12).map(lambda b: bytes(TCHARS[x % len(TCHARS)] for x in b))
targets = st.binary(max_size=30).map(lambda b: b"/" + bytes(0x21 + x % 94 for x in b))
values = st.binary(max_size=30).map(
    lambda b: bytes(x if 0x20 <= x < 0x7F or x >= 0x80 or x == 9 else 0x61 for x in b).strip(b" \t")
)
# names the parser rules on, so a generated head stays a plain one
SPECIAL = {
    b"host",
    b"content-length",
    b"transfer-encoding",
    b"upgrade",
    b"expect",
    b"connection",
}
fields = st.lists(
    st.tuples(tokens.filter(lambda t: t.lower() not in SPECIAL), values),
    max_size=6,
)


@st.composite
def valid_heads(draw: st.DrawFn) -> bytes:
    method = draw(tokens)
    target = draw(targets)
    lines = [b"%s %s HTTP/1.1" % (method, target), b"Host: " + draw(values)]
    lines += [
        name + b":" + draw(st.sampled_from([b"", b" ", b"\t "])) + v for name, v in draw(fields)
    ]
    if draw(st.booleans()):
        lines.append(b"Content-Length: %d" % draw(st.integers(0, 10**6)))
    return b"\r\n".join(lines) + b"\r\n\r\n"


def h11_view(raw: bytes) -> tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]]] | None:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if not isinstance(event, h11.Request):
        return None
    return event.method, event.target, event.http_version, list(event.headers)


@SETTINGS
@given(raw=st.binary(max_size=300))
def test_any_bytes_give_a_head_or_a_refusal_never_an_exception(raw):
    result = parse_head(raw)
    assert isinstance(result, Head | Refusal)
    if isinstance(result, Head):
        for _name, value in result.headers:
            assert not any(c in value for c in b"\r\n\x00")
    assert early_refusal(raw) is None or isinstance(early_refusal(raw), Refusal)


@SETTINGS
@given(raw=valid_heads())
def test_every_head_accepted_is_accepted_alike_by_h11(raw):
    head = parse(raw)
    assert isinstance(head, Head), head
    assert not head.handoff
    assert h11_view(raw) == (head.method, head.target, head.version, head.headers)


@SETTINGS
@given(raw=valid_heads(), cuts=st.lists(st.integers(0, 400), max_size=5))
def test_a_valid_head_split_anywhere_is_never_refused_early(raw, cuts):
    checked = 0
    for cut in [*sorted({c % len(raw) for c in cuts}), len(raw) - 4]:
        if cut <= checked:
            continue
        assert early_refusal(raw[:cut], checked) is None, raw[:cut]
        checked = cut


@SETTINGS
@given(
    raw=valid_heads(),
    at=st.integers(1, 10_000),
    bad=st.sampled_from([b"\n", b"\r", b"\x00", b"\x1b"]),
)
def test_a_bad_byte_anywhere_is_refused_by_the_first_piece_holding_it(raw, at, bad):
    at = at % (len(raw) - 4)
    if bad == b"\r" and raw[at : at + 1] == b"\n":
        return  # (a CR before that LF would make a line end, not a bare CR)
    broken = raw[:at] + bad + raw[at:]
    # the piece that holds the bad byte (and the one after it, for a CR) is refused,
    # whether earlier pieces came before it or not
    stop = at + 2
    assert isinstance(early_refusal(broken[:stop], 0), Refusal), broken[:stop]
    assert isinstance(early_refusal(broken[:stop], at), Refusal), broken[:stop]
    assert isinstance(parse_head(broken[:-4]), Refusal), broken


def _fields(head: Head | Refusal) -> tuple[object, ...]:
    assert isinstance(head, Head)
    return (head.method, head.target, head.version, head.headers, head.length, head.close)


def test_the_head_cache_answers_a_repeated_head_as_the_parser_does_and_stays_bounded():
    cache = HeadCache()
    raw = b"POST /v0/topics/t HTTP/1.1\r\nHost: x\r\nContent-Length: 12"
    first = cache.parse(raw)
    assert cache.parse(bytes(raw)) is first  # equal bytes: the same parsed head
    assert _fields(first) == _fields(parse_head(raw))
    # a refused head is refused every time and never remembered
    bad = b"POST /v0/topics/t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2"
    assert isinstance(cache.parse(bad), Refusal)
    assert isinstance(cache.parse(bad), Refusal)
    assert len(cache) == 1
    # a head over the size bound is parsed, not remembered
    big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * HEAD_CACHE_MAX_BYTES
    assert isinstance(cache.parse(big), Head)
    assert len(cache) == 1
    # at most HEAD_CACHE_ENTRIES heads; the oldest goes first
    for i in range(HEAD_CACHE_ENTRIES + 10):
        cache.parse(b"GET /%d HTTP/1.1\r\nHost: x" % i)
    assert len(cache) == HEAD_CACHE_ENTRIES
    assert cache.parse(raw) is not first  # pushed out: parsed again
    assert _fields(cache.parse(raw)) == _fields(first)


def test_a_scope_gets_its_own_header_list_from_a_remembered_head():
    from topicd.http.server import head_scope

    head = HeadCache().parse(b"GET / HTTP/1.1\r\nHost: x")
    assert isinstance(head, Head)
    addrs = (("127.0.0.1", 1), ("127.0.0.1", 2))
    scope = head_scope(head, addrs)
    headers = scope["headers"]
    assert isinstance(headers, list)
    headers.append((b"x-added", b"1"))  # (what a later stage might do to its scope)
    assert head.headers == [(b"host", b"x")]
    assert head_scope(head, addrs)["headers"] == [(b"host", b"x")]
