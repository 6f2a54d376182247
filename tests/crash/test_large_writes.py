"""Writes as large as the request limits allow survive `kill -9` (issue: acked, then lost).

Method: a real `topicd serve` child (see `tests/crash/harness.py`, 1 MiB WAL files) takes
writes of 15, 20, 40 and 63 MiB bodies on `memory`, `disk` and `fsync` topics, each followed by a
small write to the same topic (so a bad frame would sit in the middle of the log, not at
its torn tail), is killed with SIGKILL and restarted: every acknowledged record reads back
with its seq and exact payload. One frame may hold at most `storage.wal.max_frame_bytes`
(16 MiB), so every write above it is stored as several frames that recovery applies
together.
"""

from __future__ import annotations

import hashlib

import msgspec
import pytest
import trio

from tests.crash.harness import JSON, client, serving

pytestmark = pytest.mark.slow

MIB = 1 << 20
MAX_BODY = 64 * MIB  # limits.max_body_bytes' default
MAX_RECORDS = 10_000  # protocol.max_batch_records' default


def big_body(mib: int, salt: str) -> tuple[bytes, list[bytes]]:
    """A write body of about `mib` MiB (at most 10,000 records, each under 1 MiB), and
    the `data` text of each record."""
    target = mib * MIB - 1024
    count = MAX_RECORDS if mib > 30 else 1000
    per = target // count - len('{"data":""},')
    datas = [
        msgspec.json.encode(f"{salt}-{i:05d}-" + "q" * (per - 14 - len(salt))) for i in range(count)
    ]
    body = b'{"records":[' + b",".join(b'{"data":%b}' % d for d in datas) + b"]}"
    assert len(body) <= MAX_BODY and len(body) <= mib * MIB
    assert len(body) > (mib - 1) * MIB
    return body, datas


class _Rec(msgspec.Struct):
    seq: int = msgspec.field(name="$seq")
    data: msgspec.Raw


class _Page(msgspec.Struct):
    records: list[_Rec]
    next_from_seq: int
    caught_up: bool
    tombstone: dict[str, object] | None


async def read_digests(c, topic: str) -> list[tuple[int, str]]:
    """(seq, sha256 of the data text) of every record of `topic`."""
    out: list[tuple[int, str]] = []
    cursor = 0
    while True:
        r = await c.post(
            f"/v0/topics/{topic}/diff",
            json={"from_seq": cursor, "limit": 1000, "max_batch_bytes": 8 * MIB},
        )
        assert r.status_code == 200, r.text
        page = msgspec.json.decode(r.content, type=_Page)
        assert page.tombstone is None, page.tombstone
        out += [(rec.seq, hashlib.sha256(bytes(rec.data)).hexdigest()) for rec in page.records]
        cursor = page.next_from_seq
        if page.caught_up:
            return out


async def post_acked(c, path: str, body: bytes):
    """POST `body` as a client would: a `429` is waited out as its `retry_after_ms` says
    and sent again (a refused write was not applied). Right after a 63 MiB write has held
    the loop for a second, a slow machine's governor may find itself overloaded and
    refuse the next write; what this test checks is that every acknowledged record
    survives, not that none is refused. Any other answer is returned."""
    for _ in range(20):
        r = await c.post(path, content=body, headers=JSON)
        if r.status_code != 429:
            return r
        await trio.sleep(r.json()["error"]["detail"]["retry_after_ms"] / 1000)
    return r


@pytest.mark.parametrize("durability", ["memory", "disk", "fsync"])
async def test_writes_up_to_the_body_limit_survive_kill9(tmp_path, durability):
    topic = f"big-{durability}"
    expected: list[tuple[int, str]] = []
    with trio.fail_after(240):
        async with serving(tmp_path, env={"TOPICD_WAL_SHARDS": "1"}) as server:
            async with client(server) as c:
                r = await c.put(f"/v0/topics/{topic}", json={"durability": durability})
                assert r.status_code in (200, 201), r.text
                for mib in (15, 20, 40, 63):
                    body, datas = big_body(mib, f"{durability}{mib}")
                    r = await post_acked(c, f"/v0/topics/{topic}", body)
                    assert r.status_code in (200, 201), r.text[:500]
                    ack = r.json()
                    assert ack["count"] == len(datas)
                    first = ack["first_seq"]
                    expected += [
                        (first + i, hashlib.sha256(d).hexdigest()) for i, d in enumerate(datas)
                    ]
                    small = b'{"after":%d}' % mib
                    r = await post_acked(
                        c, f"/v0/topics/{topic}", b'{"records":[{"data":%b}]}' % small
                    )
                    assert r.status_code in (200, 201), r.text
                    expected.append((r.json()["first_seq"], hashlib.sha256(small).hexdigest()))
            await server.restart()  # SIGKILL, then recovery from the WAL alone
            async with client(server) as c:
                got = await read_digests(c, topic)
            assert len(got) == len(expected)
            assert got == expected
            assert "torn tails ignored" not in server.run.text
