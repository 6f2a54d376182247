"""Contract tests for resuming a watch session (api-routers-watch §2.5, §2.3, §2.6).

Method: black-box. A session's stream is read, disconnected and reopened with
`topicd.testing.sse.open_stream` (raw ASGI; the body channel has capacity 0, so a frame
counts as written only once the test received it). What the reopened stream sends is
compared exactly with the spec's rule: it starts from the session's stored cursor (after
the last frame written), lowered — never raised — per topic by `Last-Event-ID` (or the
`?cursor=` query when the header is absent); topics missing from the presented map keep
their cursor, unknown topics are ignored, an undecodable id is ignored, padded and
unpadded base64url both decode. Ids are built with the spec's encoding (compact JSON,
keys sorted bytewise, base64url). Every test takes pytest-trio's `autojump_clock` so
"no frame" is checked in virtual time.
"""

from __future__ import annotations

import base64

import pytest

from tests.watch.helpers import (
    caught_up,
    close,
    enc_id,
    open_ok,
    put_topic,
    quiet,
    read,
    seqs,
    wid_of,
    write_n,
)


async def session_at(harness, client, nursery, body) -> tuple[str, list]:
    """A session whose stream was read to its caught-up frames, then closed."""
    wid = await wid_of(client, body)
    s = await open_ok(harness, nursery, wid)
    frames = []
    while sum(f[0] == "caught-up" for f in frames) < len(body["topics"]):
        frames += await read(s, 1)
    await close(s)
    return wid, frames


async def test_reopen_continues_after_the_last_written_frame(
    autojump_clock, harness, client, nursery
):
    await write_n(client, "a", 3)
    wid, frames = await session_at(harness, client, nursery, {"topics": {"a": {}}})
    assert [seqs(f) for f in frames[:-1]] == [[1, 2, 3]]
    await write_n(client, "a", 2)
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 2)
    assert seqs(frames[0]) == [4, 5]
    assert frames[0][2]["from_seq"] == 3 and frames[0][1] == {"a": 5}
    assert frames[1] == caught_up("a", 5, {"a": 5})
    await quiet(s, 10)
    await close(s)
    s = await open_ok(harness, nursery, wid)
    assert await read(s, 1) == [caught_up("a", 5, {"a": 5})]  # caught-up again on reconnect
    await close(s)


async def test_unwritten_frames_are_not_counted(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 3)
    wid = await wid_of(client, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid)
    await close(s)  # the backlog frame was never taken by the client
    s = await open_ok(harness, nursery, wid)
    frames = await read(s, 2)
    assert seqs(frames[0]) == [1, 2, 3] and frames[0][2]["from_seq"] == 0
    await close(s)


async def test_many_reconnects_no_duplicates_no_gaps(autojump_clock, harness, client, nursery):
    await put_topic(client, "a")
    await put_topic(client, "b")
    wid = await wid_of(client, {"topics": {"a": {}, "b": {}}, "limit": 3})
    seen: dict[str, list[int]] = {"a": [], "b": []}
    n = 0
    for round_ in range(6):
        await write_n(client, "a", round_ + 1)
        await write_n(client, "b", 2)
        n += round_ + 1
        s = await open_ok(harness, nursery, wid)
        done = 0
        while done < 2:
            (frame,) = await read(s, 1)
            if frame[0] == "record":
                seen[frame[2]["topic"]] += seqs(frame)
            else:
                assert frame[0] == "caught-up"
                done += 1
        await close(s)
    assert seen == {"a": list(range(1, n + 1)), "b": list(range(1, 13))}


async def test_last_event_id_rewinds(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 5)
    wid, frames = await session_at(harness, client, nursery, {"topics": {"a": {}}, "limit": 2})
    assert [f[1] for f in frames] == [{"a": 2}, {"a": 4}, {"a": 5}, {"a": 5}]
    s = await open_ok(harness, nursery, wid, headers={"Last-Event-ID": enc_id({"a": 2})})
    frames = await read(s, 3)
    assert [seqs(f) for f in frames[:2]] == [[3, 4], [5]]
    assert frames[0][2]["from_seq"] == 2
    assert frames[2] == caught_up("a", 5, {"a": 5})
    await close(s)


@pytest.mark.parametrize("presented", [{"a": 99}, {"a": 5}, {"a": 2**64 - 1}])
async def test_last_event_id_never_advances(autojump_clock, harness, client, nursery, presented):
    await write_n(client, "a", 5)
    wid, _ = await session_at(harness, client, nursery, {"topics": {"a": {"from_seq": 2}}})
    await write_n(client, "a", 1)
    s = await open_ok(harness, nursery, wid, headers={"Last-Event-ID": enc_id(presented)})
    frames = await read(s, 2)
    assert seqs(frames[0]) == [6] and frames[0][2]["from_seq"] == 5
    assert frames[1] == caught_up("a", 6, {"a": 6})
    await close(s)


async def test_higher_id_does_not_advance_before_any_delivery(
    autojump_clock, harness, client, nursery
):
    await write_n(client, "a", 5)
    wid = await wid_of(client, {"topics": {"a": {"from_seq": 1}}})
    s = await open_ok(harness, nursery, wid, headers={"Last-Event-ID": enc_id({"a": 4})})
    frames = await read(s, 2)
    assert seqs(frames[0]) == [2, 3, 4, 5] and frames[0][2]["from_seq"] == 1
    await close(s)


async def test_rewind_below_the_initial_from_seq(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 5)
    wid = await wid_of(client, {"topics": {"a": {"from_seq": 4}}})
    s = await open_ok(harness, nursery, wid, headers={"Last-Event-ID": enc_id({"a": 1})})
    frames = await read(s, 2)
    assert seqs(frames[0]) == [2, 3, 4, 5] and frames[0][2]["from_seq"] == 1
    assert frames[1] == caught_up("a", 5, {"a": 5})
    await close(s)


async def test_missing_topics_keep_their_cursor_unknown_are_ignored(
    autojump_clock, harness, client, nursery
):
    await write_n(client, "a", 5)
    await write_n(client, "b", 4)
    wid, _ = await session_at(harness, client, nursery, {"topics": {"a": {}, "b": {}}})
    presented = {"a": 3, "zzz": 0, "c": 1}
    s = await open_ok(harness, nursery, wid, headers={"Last-Event-ID": enc_id(presented)})
    frames = await read(s, 3)
    assert seqs(frames[0]) == [4, 5]
    assert frames[0][2]["from_seq"] == 3 and frames[0][1] == {"a": 5, "b": 4}
    assert frames[1] == caught_up("a", 5, {"a": 5, "b": 4})
    assert frames[2] == caught_up("b", 4, {"a": 5, "b": 4})
    await close(s)


@pytest.mark.parametrize(
    "bad",
    [
        "!!!not-base64!!!",
        "e30",  # {} : decodes, names nothing
        base64.urlsafe_b64encode(b"not json").decode().rstrip("="),
        base64.urlsafe_b64encode(b"[1,2]").decode().rstrip("="),
        base64.urlsafe_b64encode(b'"a"').decode().rstrip("="),
        "",
        " ",
    ],
)
async def test_undecodable_id_is_ignored(autojump_clock, harness, client, nursery, bad):
    await write_n(client, "a", 3)
    wid, _ = await session_at(harness, client, nursery, {"topics": {"a": {}}})
    await write_n(client, "a", 1)
    s = await open_ok(harness, nursery, wid, headers={"Last-Event-ID": bad})
    frames = await read(s, 2)
    assert seqs(frames[0]) == [4] and frames[0][2]["from_seq"] == 3
    await close(s)


async def test_padded_base64url_is_accepted(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 5)
    wid, _ = await session_at(harness, client, nursery, {"topics": {"a": {}}})
    padded = enc_id({"a": 2}, padded=True)
    assert padded.endswith("=")
    s = await open_ok(harness, nursery, wid, headers={"Last-Event-ID": padded})
    frames = await read(s, 2)
    assert seqs(frames[0]) == [3, 4, 5] and frames[0][2]["from_seq"] == 2
    await close(s)


async def test_id_with_unsorted_keys_or_spaces_still_rewinds(
    autojump_clock, harness, client, nursery
):
    await write_n(client, "a", 5)
    await write_n(client, "b", 5)
    wid, _ = await session_at(harness, client, nursery, {"topics": {"a": {}, "b": {}}})
    raw = base64.urlsafe_b64encode(b'{ "b": 4, "a": 3 }').decode().rstrip("=")
    s = await open_ok(harness, nursery, wid, headers={"Last-Event-ID": raw})
    frames = await read(s, 4)
    assert [(f[0], f[2]["topic"]) for f in frames] == [
        ("record", "a"),
        ("caught-up", "a"),
        ("record", "b"),
        ("caught-up", "b"),
    ]
    assert seqs(frames[0]) == [4, 5] and seqs(frames[2]) == [5]
    await close(s)


async def test_cursor_query_used_when_header_absent(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 5)
    wid, _ = await session_at(harness, client, nursery, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid, query=f"cursor={enc_id({'a': 3})}")
    frames = await read(s, 2)
    assert seqs(frames[0]) == [4, 5] and frames[0][2]["from_seq"] == 3
    await close(s)


async def test_header_wins_over_cursor_query(autojump_clock, harness, client, nursery):
    await write_n(client, "a", 5)
    wid, _ = await session_at(harness, client, nursery, {"topics": {"a": {}}})
    s = await open_ok(
        harness,
        nursery,
        wid,
        headers={"Last-Event-ID": enc_id({"a": 4})},
        query=f"cursor={enc_id({'a': 1})}",
    )
    frames = await read(s, 2)
    assert seqs(frames[0]) == [5] and frames[0][2]["from_seq"] == 4
    await close(s)


async def test_undecodable_header_still_wins_over_cursor_query(
    autojump_clock, harness, client, nursery
):
    # the query is used "only when the header is absent": a present-but-bad header is
    # ignored, and the query is not consulted
    await write_n(client, "a", 5)
    wid, _ = await session_at(harness, client, nursery, {"topics": {"a": {}}})
    s = await open_ok(
        harness, nursery, wid, headers={"Last-Event-ID": "!!"}, query=f"cursor={enc_id({'a': 1})}"
    )
    assert await read(s, 1) == [caught_up("a", 5, {"a": 5})]
    await close(s)


async def test_rewind_is_applied_to_the_stored_cursor(autojump_clock, harness, client, nursery):
    # a rewind moves the session's cursor: a later plain reconnect starts from the rewound
    # position unless frames were written after it
    await write_n(client, "a", 5)
    wid, _ = await session_at(harness, client, nursery, {"topics": {"a": {}}})
    s = await open_ok(harness, nursery, wid, headers={"Last-Event-ID": enc_id({"a": 2})})
    frames = await read(s, 2)
    assert seqs(frames[0]) == [3, 4, 5]
    await close(s)
    s = await open_ok(harness, nursery, wid)
    assert await read(s, 1) == [caught_up("a", 5, {"a": 5})]
    await close(s)
