"""Boolean query parameters (`touch`, `if_empty`, `return_seqs`, `lenient`).

Method: black-box through Quart's test client. Each parameter is sent with every accepted
spelling (`true`/`false`/`1`/`0`, any letter case) and its effect is observed on the
resource (a read clock bumped or not, a topic deleted or refused, `seqs` present or not,
an unknown topic dropped or refused); absence gives the documented default. Every other
value, the empty one included, is `400 invalid_request` naming the parameter, and the
request changes nothing. `page_size` is the exception: it is clamped, never refused.
"""

from __future__ import annotations

import pytest

TRUE = ["true", "TRUE", "True", "1"]
FALSE = ["false", "FALSE", "fAlSe", "0"]
OTHER = ["yes", "no", "on", "off", "", "2", "-1", "t", "f", "maybe", "true ", "01"]


async def status_and_body(r) -> tuple[int, dict]:
    return r.status_code, await r.get_json()


async def write(client, topic: str, n: int = 1, **query) -> tuple[int, dict]:
    r = await client.post(
        f"/v0/topics/{topic}",
        json={"records": [{"data": i} for i in range(n)]},
        query_string=query or None,
    )
    return await status_and_body(r)


async def topic_state(client, topic: str) -> dict:
    r = await client.get(f"/v0/topics/{topic}", query_string={"touch": "false"})
    assert r.status_code == 200
    return await r.get_json()


def assert_refused(status: int, body: dict, param: str) -> None:
    assert status == 400, body
    err = body["error"]
    assert err["code"] == "invalid_request"
    assert err["detail"] == {"parameter": param}
    assert param in err["message"]


async def test_if_empty_yes_deletes_nothing(client):
    await write(client, "keep", 2)
    r = await client.delete("/v0/topics/keep", query_string={"if_empty": "yes"})
    assert_refused(*await status_and_body(r), "if_empty")
    assert (await topic_state(client, "keep"))["count"] == 2


@pytest.mark.parametrize("value", OTHER)
async def test_if_empty_other_values_are_400_and_delete_nothing(client, value):
    await write(client, "t", 1)
    r = await client.delete("/v0/topics/t", query_string={"if_empty": value})
    assert_refused(*await status_and_body(r), "if_empty")
    assert (await topic_state(client, "t"))["count"] == 1


@pytest.mark.parametrize("value", TRUE)
async def test_if_empty_true_spellings_refuse_a_non_empty_topic(client, value):
    await write(client, "t", 1)
    r = await client.delete("/v0/topics/t", query_string={"if_empty": value})
    status, body = await status_and_body(r)
    assert (status, body["error"]["code"]) == (409, "topic_not_empty")


@pytest.mark.parametrize("value", [*FALSE, None])
async def test_if_empty_false_spellings_and_absence_delete(client, value):
    await write(client, "t", 1)
    query = None if value is None else {"if_empty": value}
    r = await client.delete("/v0/topics/t", query_string=query)
    status, body = await status_and_body(r)
    assert (status, body["deleted"]) == (200, True)


@pytest.mark.parametrize("value", OTHER)
async def test_return_seqs_other_values_are_400_and_append_nothing(client, value):
    await write(client, "t", 1)
    assert_refused(*await write(client, "t", 3, return_seqs=value), "return_seqs")
    assert (await topic_state(client, "t"))["head_seq"] == 1


@pytest.mark.parametrize(
    ("value", "has_seqs"), [(v, True) for v in [*TRUE, None]] + [(v, False) for v in FALSE]
)
async def test_return_seqs_spellings(client, value, has_seqs):
    query = {} if value is None else {"return_seqs": value}
    status, body = await write(client, "t", 2, **query)
    assert status == 201
    assert ("seqs" in body) is has_seqs
    if has_seqs:
        assert body["seqs"] == [1, 2]


@pytest.mark.parametrize("value", OTHER)
async def test_touch_other_values_are_400_and_touch_nothing(client, value):
    await write(client, "t", 1)
    r = await client.get("/v0/topics/t", query_string={"touch": value})
    assert_refused(*await status_and_body(r), "touch")
    r = await client.get("/v0/topics", query_string={"touch": value})
    assert_refused(*await status_and_body(r), "touch")
    assert (await topic_state(client, "t"))["last_read_ts"] is None


@pytest.mark.parametrize(
    ("value", "touched"), [(v, True) for v in [*TRUE, None]] + [(v, False) for v in FALSE]
)
async def test_touch_spellings_on_the_state_read(client, value, touched):
    await write(client, "t", 1)
    r = await client.get("/v0/topics/t", query_string=None if value is None else {"touch": value})
    assert r.status_code == 200
    assert ((await topic_state(client, "t"))["last_read_ts"] is not None) is touched


@pytest.mark.parametrize(
    ("value", "touched"), [(v, True) for v in TRUE] + [(v, False) for v in [*FALSE, None]]
)
async def test_touch_spellings_on_the_list(client, value, touched):
    await write(client, "t", 1)
    r = await client.get("/v0/topics", query_string=None if value is None else {"touch": value})
    assert r.status_code == 200
    assert ((await topic_state(client, "t"))["last_read_ts"] is not None) is touched


async def create_watch(client, value):
    r = await client.post(
        "/v0/watch",
        json={"topics": {"t": {}, "absent": {}}},
        query_string=None if value is None else {"lenient": value},
    )
    return await status_and_body(r)


@pytest.mark.parametrize("value", OTHER)
async def test_lenient_other_values_are_400(client, value):
    await write(client, "t", 1)
    assert_refused(*await create_watch(client, value), "lenient")


@pytest.mark.parametrize("value", TRUE)
async def test_lenient_true_spellings_drop_unknown_topics(client, value):
    await write(client, "t", 1)
    status, body = await create_watch(client, value)
    assert status == 200
    assert list(body["topics"]) == ["t"]


@pytest.mark.parametrize("value", [*FALSE, None])
async def test_lenient_false_spellings_and_absence_refuse_unknown_topics(client, value):
    await write(client, "t", 1)
    status, body = await create_watch(client, value)
    assert (status, body["error"]["code"]) == (404, "topic_not_found")


@pytest.mark.parametrize(("raw", "size"), [("abc", 3), ("", 3), ("0", 1), ("-5", 1), ("5000", 3)])
async def test_page_size_is_clamped_never_refused(client, raw, size):
    for name in ("p1", "p2", "p3"):
        await write(client, name, 1)
    r = await client.get("/v0/topics", query_string={"page_size": raw})
    status, body = await status_and_body(r)
    assert status == 200, body
    assert len(body["topics"]) == size
    assert ("next_cursor" in body) is (size < 3)
