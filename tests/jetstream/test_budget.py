"""`limits.max_total_bytes` across a deployment of fronts (`topicd.storage.jsslots`).

Method: three fronts in this process on the session's cluster (`open_fronts`: one shard
each), each reached through its own app. Every topic is named so that a chosen front
owns it (`owned_by`), and each write goes to the app of the front the test means (a
write on another front is forwarded to the owner, which admits it). Each test checks
the deployment's bytes against the limit with the embedded backend's `429` and
`detail`, and the shares in the registry (`front.slots`, `b`): their sum never passes
the limit. Races are exact: writes started together on every front, counted after.
A dead front is one whose NATS connection closed (as when its process is killed): the
other front's next lease check finds it gone, or, with no lease check, its record
counts until the shared wall clock passes its term and one more.
"""

from __future__ import annotations

from functools import partial

import pytest
import trio

from tests.jetstream.conftest import fronts_of, jetstream_config, open_fronts
from topicd.config import Config
from topicd.storage.jsslots import JsSlots, read_table
from topicd.testing.harness import AppHarness, make_config

pytestmark = pytest.mark.slow


def config(cluster, limit: int) -> Config:
    return jetstream_config(cluster, make_config(limits={"max_total_bytes": limit}))


def desk(h: AppHarness) -> JsSlots:
    slots = fronts_of(h).backend.slots
    assert slots is not None
    return slots


def owned_by(h: AppHarness, prefix: str) -> str:
    """A topic name whose shard the front `h` owns."""
    for i in range(1000):
        name = f"{prefix}.{i}"
        if fronts_of(h).owns(name):
            return name
    raise AssertionError("no name found")


async def shares(h: AppHarness) -> dict[str, int]:
    """The registry's shares: front id -> its share of the limit."""
    d = desk(h)
    table, _ = await d.backend.bridge.call(partial(read_table, d.store))
    return {front: tally.b for front, (tally, _) in table.items() if tally.b}


async def put(h: AppHarness, topic: str, data: object, n: int = 1) -> int:
    """Write `n` records of `data` through `h`'s app; the status (200: written, the
    topic created or not)."""
    r = await h.app.test_client().post(
        f"/v0/topics/{topic}", json={"records": [{"data": data}] * n}
    )
    if r.status_code == 429:
        body = await r.get_json()
        assert body["error"]["code"] == "throttled"
        assert body["error"]["detail"] == {"limit": "max_total_bytes", "max": LIMIT}
        assert r.headers["Retry-After"] == "1"
    return 200 if r.status_code == 201 else r.status_code


LIMIT = 30
TEN = "x" * 8  # 10 bytes as stored


async def test_three_fronts_fill_one_limit_and_refuse_only_at_it(cluster):
    """10 bytes owned by each front fill a limit of 30: then every front refuses a
    1-byte write, whoever owns its topic; deleting on one front lets a write on another
    front in (the freed bytes go back through a share given back)."""
    async with open_fronts(config(cluster, LIMIT)) as (a, b, c):
        ta, tb, tc = owned_by(a, "ba"), owned_by(b, "bb"), owned_by(c, "bc")
        assert await put(a, ta, TEN) == 200
        assert await put(b, tb, TEN) == 200
        assert await put(c, tc, "x" * 7) == 200  # 9 bytes: 29 in all
        assert await put(a, tc, 1) == 200  # (forwarded to the third front): exactly 30
        assert sum((await shares(a)).values()) <= LIMIT
        for h, t in ((a, ta), (b, tb), (c, tc), (a, tb), (b, tc), (c, ta)):
            assert await put(h, t, 1) == 429
        assert [
            sum(t.bytes for t in h.engine.topics.values() if fronts_of(h).owns(t.name))
            for h in (a, b, c)
        ] == [10, 10, 10]
        r = await b.app.test_client().post(f"/v0/topics/{tb}/delete", json={"before_seq": 2})
        assert r.status_code in (200, 201)
        assert await put(a, ta, TEN) == 200  # the second front's share came back
        assert await put(c, tc, 1) == 429
        assert sum((await shares(a)).values()) <= LIMIT


async def test_a_share_unused_on_one_front_is_reclaimed_by_another(cluster):
    """Far from the limit a front writes within its share with no round trip; the
    shares the other fronts hold beyond their bytes go back to a front that needs them
    (one ask), and the limit is then reached exactly."""
    limit = 80
    async with open_fronts(config(cluster, limit)) as (a, b, c):
        ta, tb, tc = owned_by(a, "ra"), owned_by(b, "rb"), owned_by(c, "rc")
        assert (
            await a.app.test_client().post(f"/v0/topics/{ta}", json={"records": [{"data": TEN}]})
        ).status_code in (200, 201)
        grows = desk(a).grows
        assert grows == 1
        held = desk(a).mine.b
        assert held > 10  # (a part of the limit beyond what the write needed)
        # within its share: no round
        writes = desk(a).writes
        r = await a.app.test_client().post(f"/v0/topics/{ta}", json={"records": [{"data": 1}]})
        assert r.status_code in (200, 201)
        assert (desk(a).grows, desk(a).writes) == (grows, writes)
        big = "x" * 48  # 50 bytes
        r = await b.app.test_client().post(f"/v0/topics/{tb}", json={"records": [{"data": big}]})
        assert r.status_code in (200, 201)
        assert desk(a).mine.b + desk(b).mine.b == limit  # nothing left unallocated
        assert desk(c).live_asks == 0
        # 19 bytes more on the third front: only the unused parts of the others' shares
        r = await c.app.test_client().post(
            f"/v0/topics/{tc}", json={"records": [{"data": "x" * 17}]}
        )
        assert r.status_code in (200, 201)
        assert desk(c).live_asks == 1
        assert (desk(a).mine.b, desk(b).mine.b) == (11, 50)
        got = await shares(a)
        assert got[desk(a).front_id] == 11 and got[desk(b).front_id] == 50
        assert sum(got.values()) <= limit
        # 80 bytes in all now: one more byte is refused on every front
        for h, t in ((a, ta), (b, tb), (c, tc)):
            r = await h.app.test_client().post(f"/v0/topics/{t}", json={"records": [{"data": 1}]})
            assert r.status_code == 429
            err = (await r.get_json())["error"]
            assert err["detail"] == {"limit": "max_total_bytes", "max": limit}


async def test_racing_writes_on_three_fronts_admit_exactly_the_limit(cluster, nursery):
    """Fifteen 1-byte writes at once on each of three fronts against a limit of 30:
    exactly 30 are admitted, and every other is the `429`."""
    async with open_fronts(config(cluster, LIMIT)) as hs:
        topics = [owned_by(h, f"race{i}") for i, h in enumerate(hs)]
        statuses: list[int] = []

        async def one(h: AppHarness, t: str) -> None:
            statuses.append(await put(h, t, 1))

        async with trio.open_nursery() as n:
            for _ in range(15):
                for h, t in zip(hs, topics, strict=True):
                    n.start_soon(one, h, t)
        assert sorted(statuses) == [200] * 30 + [429] * 15
        assert sum(h.engine.topics[t].bytes for h, t in zip(hs, topics, strict=True)) == 30
        assert sum((await shares(hs[0])).values()) <= LIMIT


async def test_a_dead_fronts_share_goes_back_and_its_bytes_still_count(cluster):
    """The third front holds 20 bytes of a limit of 30 (and a share beyond them), then
    its connection closes: the first front's lease check finds it gone, its share is
    released and its topic moves to a live owner, whose share now covers those bytes.
    The deployment admits exactly the 10 bytes left."""
    async with open_fronts(config(cluster, LIMIT)) as (a, b, c):
        tc = owned_by(c, "dc")
        assert await put(c, tc, "x" * 18) == 200  # 20 bytes
        assert desk(c).mine.b > 20
        gone = fronts_of(c)
        nc = gone.store.nc
        assert nc is not None
        await gone.backend.bridge.call(nc.close)
        await fronts_of(a)._tend_lease()  # (what it runs every third of `lease_ms`)
        await fronts_of(b)._tend_lease()
        owner = a if fronts_of(a).owns(tc) else b
        assert fronts_of(owner).owns(tc)
        ta = owned_by(a, "da")
        assert await put(a, ta, TEN) == 200  # the dead front's share no longer counts
        assert desk(c).front_id not in await shares(a)
        assert await put(b, owned_by(b, "db"), 1) == 429  # its 20 bytes still count
        assert await put(a, ta, 1) == 429


async def keyed(h: AppHarness, topic: str, key: str) -> tuple[int, dict]:
    r = await h.app.test_client().post(
        f"/v0/topics/{topic}",
        json={"records": [{"data": 1}], "idempotency_key": key},
    )
    return (200 if r.status_code == 201 else r.status_code), await r.get_json()


async def test_idempotency_entries_fill_one_limit_across_fronts(cluster):
    """`max_idempotency_entries = 3`: one keyed write on a topic of each front fills it;
    then a keyed write is refused on every front with the embedded `429`, while writes
    without a key and dedupe hits go on; a topic deleted on one front frees its entry
    for a keyed write on another (whose owner takes that front's share)."""
    cfg = jetstream_config(cluster, make_config(limits={"max_idempotency_entries": 3}))
    entries = {"limit": "max_idempotency_entries", "max": 3}
    async with open_fronts(cfg) as (a, b, c):
        ta, tb, tc = owned_by(a, "ia"), owned_by(b, "ib"), owned_by(c, "ic")
        for h, t in ((a, ta), (b, tb), (c, tc)):
            assert (await keyed(h, t, "k"))[0] == 200
        for h, t in ((a, ta), (b, tb), (c, tc), (a, tc), (c, tb)):
            status, body = await keyed(h, t, "k2")
            assert status == 429, body
            assert body["error"]["detail"] == entries
        assert await put(b, tb, 1) == 200  # no key: no entry
        status, body = await keyed(c, ta, "k")  # (forwarded to its owner)
        assert (status, body["deduped"]) == (200, True)
        assert (await b.app.test_client().delete(f"/v0/topics/{tb}")).status_code == 200
        assert (await keyed(a, ta, "k2"))[0] == 200
        assert desk(a).live_asks >= 1
        assert (await keyed(c, tc, "k2"))[0] == 429
        table, _ = await desk(a).backend.bridge.call(partial(read_table, desk(a).store))
        assert sum(t.e for t, _ in table.values()) <= 3


async def test_a_silent_fronts_share_counts_until_its_term_and_one_more_end(cluster):
    """The third front took a share, then its records went (its bytes are 0) and its
    connection closed, with no lease check to find it gone: the first front, short of
    room, asks it to give back, gets no answer, and refuses, for as long as the silent
    front's record counts (its term and one more, so a dead owner's bytes are never
    uncounted before its shards move). Past that, its share is free."""
    async with open_fronts(config(cluster, LIMIT)) as (a, _b, c):
        tc, ta = owned_by(c, "sc"), owned_by(a, "sa")
        assert await put(c, tc, TEN) == 200
        r = await c.app.test_client().post(f"/v0/topics/{tc}/delete", json={"before_seq": 2})
        assert r.status_code == 200
        held = desk(c).mine.b
        assert held > 10
        nc = fronts_of(c).store.nc
        assert nc is not None
        await fronts_of(c).backend.bridge.call(nc.close)
        big = "x" * (LIMIT - held + 1 - 2)  # one byte more than the room c's share leaves
        assert await put(a, ta, big) == 429
        lease = a.engine.cfg.storage.jetstream.lease_ms
        a.clock.jump(2 * lease - 10_000)  # (its term has ended, the one more has not)
        assert await put(a, ta, big) == 429
        a.clock.jump(10_001)
        assert await put(a, ta, big) == 200
        assert desk(c).front_id not in await shares(a)
