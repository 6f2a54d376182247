"""Live watch frames across topics of different owners follow the acknowledgement order
(`Fronts.hold`): a write another owner acknowledged before the client sent a write to
this front's own topic reaches a watch stream here first, even when its notice never
comes (the ordering round's listing finds it)."""

from __future__ import annotations

import itertools

import trio

from tests.jetstream.conftest import fronts_of, jetstream_config, open_fronts
from tests.watch import helpers as watch_helpers


def names_owned(fronts, count: int) -> list[str]:
    """One topic name owned by each of the first `count` fronts."""
    out: list[str] = []
    for i in range(count):
        f = fronts_of(fronts[i])
        out.append(next(f"t{n}" for n in itertools.count() if f.owns(f"t{n}")))
    return out


async def _write(client, topic: str, data: object) -> None:
    r = await client.post(f"/v0/topics/{topic}", json={"records": [{"data": data}]})
    assert r.status_code in (200, 201), await r.get_data()


async def test_an_acknowledged_write_of_another_owner_comes_first(cluster, nursery):
    cfg = jetstream_config(cluster)
    async with open_fronts(cfg, 2) as hs:
        mine, theirs = names_owned(hs, 2)
        c0, c1 = (h.app.test_client() for h in hs)
        for name in (mine, theirs):
            assert (await c0.put(f"/v0/topics/{name}")).status_code == 201
        wid = await watch_helpers.wid_of(c0, {"topics": {mine: {}, theirs: {}}})
        s = await watch_helpers.open_ok(hs[0], nursery, wid)
        assert [f[0] for f in await watch_helpers.read(s, 2)] == ["caught-up", "caught-up"]
        # the other owner's notices are lost: only the ordering round (or, a second
        # later, the poll) tells the watching front of its write
        fronts_of(hs[1]).store.notify = False
        with trio.fail_after(10):
            await _write(c1, theirs, "first")  # acknowledged ...
            await _write(c0, mine, "second")  # ... before this one is sent
            frames = await watch_helpers.read(s, 2)
        assert [(f[2]["topic"], f[2]["records"][0]["data"]) for f in frames] == [
            (theirs, "first"),
            (mine, "second"),
        ]
        assert [f[1] for f in frames] == [{mine: 0, theirs: 1}, {mine: 1, theirs: 1}]
        # a stream whose topics this front all owns waits for no round
        assert fronts_of(hs[0])._held == {}
        await watch_helpers.close(s)
