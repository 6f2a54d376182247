"""`kill -9` during a forwarding storm: no copy lost, none duplicated, seqs unchanged.

Method: one temporary data directory served by successive real `topicd serve` children
(`tests/crash/harness.py`). Three source topics (`memory`, `disk`, `fsync`), each with a
router into three destinations (one per class): every pairing of persistent classes.
Writers append numbered batches to the sources and, now and then, direct records to the
destinations; a reader keeps diffing the destinations meanwhile (read-path catch-up, so
copies are being made while the kill lands) and remembers every `(seq, payload)` it saw.
After a seeded random delay the server gets `SIGKILL` and is started again; then, per
destination:

- everything the reader saw before the kill is at the same seq with the same payload;
- the copies are exactly the source's records after the restart, once each, in source
  order (every acknowledged source write is in the source: a process crash keeps the
  page cache), and every acknowledged direct write is there once;
- a second kill and restart without writes reads back an identical destination.

Nothing sleeps to wait for a condition: readiness is the `listening on` stderr line.
"""

from __future__ import annotations

import random

import pytest
import trio

from tests.crash.harness import client, dump_topic, serving

pytestmark = pytest.mark.slow

CLASSES = ["memory", "disk", "fsync"]
SOURCES = [f"s_{c}" for c in CLASSES]
DESTS = {s: [f"d_{s[2:]}_{c}" for c in CLASSES] for s in SOURCES}
ALL_DESTS = [d for ds in DESTS.values() for d in ds]


async def setup(server) -> None:
    async with client(server) as c:
        for name in SOURCES + ALL_DESTS:
            cls = name.rsplit("_", 1)[1]
            r = await c.put(f"/v0/topics/{name}", json={"durability": cls})
            assert r.status_code in (200, 201), r.text
        for s, ds in DESTS.items():
            for d in ds:
                r = await c.put(f"/v0/routers/{s}->{d}", json={"source": s, "dest": d})
                assert r.status_code in (200, 201), r.text


async def storm(server, rng: random.Random, acked: dict[str, list[bytes]], seen: dict) -> None:
    """Writers and a reader until cancelled (the kill cancels them)."""

    async def writer(i: int) -> None:
        async with client(server) as c:
            n = 0
            while True:
                if rng.random() < 0.2:
                    name = rng.choice(ALL_DESTS)
                    datas = [f'"direct:{i}:{n}"']
                else:
                    name = rng.choice(SOURCES)
                    datas = [f'"{name}:{i}:{n + k}"' for k in range(rng.randint(1, 20))]
                n += len(datas)
                body = '{"records":[' + ",".join(f'{{"data":{d}}}' for d in datas) + "]}"
                try:
                    r = await c.post(
                        f"/v0/topics/{name}",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                except Exception:  # the kill: the connection drops mid-request
                    return
                if r.status_code in (200, 201):
                    acked.setdefault(name, []).extend(d.encode() for d in datas)

    async def reader() -> None:
        async with client(server) as c:
            while True:
                for d in ALL_DESTS:
                    try:
                        dump = await dump_topic(c, d)
                    except Exception:
                        return
                    if dump is not None:
                        for seq, _, data, _ in dump.records:
                            assert seen.setdefault((d, seq), data) == data
                await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(writer, i)
        nursery.start_soon(reader)


@pytest.mark.parametrize("seed", [1, 2])
async def test_kill9_during_forwarding_loses_and_duplicates_no_copy(tmp_path, seed):
    rng = random.Random(seed)
    acked: dict[str, list[bytes]] = {}
    seen: dict[tuple[str, int], bytes] = {}
    async with serving(tmp_path) as server:
        await setup(server)
        with trio.move_on_after(rng.uniform(0.3, 1.5)):
            await storm(server, rng, acked, seen)
        await server.restart()
        async with client(server) as c:
            dumps = {name: await dump_topic(c, name) for name in SOURCES + ALL_DESTS}
        for s, ds in DESTS.items():
            src = dumps[s]
            assert src is not None
            src_payloads = [data for _, _, data, _ in src.records]
            assert set(acked.get(s, [])) <= set(src_payloads)
            for d in ds:
                dst = dumps[d]
                assert dst is not None
                records = {seq: data for seq, _, data, _ in dst.records}
                for (name, seq), data in seen.items():
                    if name == d:
                        assert records.get(seq) == data, (d, seq)
                copies = [data for _, _, data, _ in dst.records if data.startswith(b'"s_')]
                assert copies == src_payloads, d
                directs = [data for _, _, data, _ in dst.records if data.startswith(b'"direct')]
                assert len(directs) == len(set(directs))
                assert set(acked.get(d, [])) <= set(directs)
                assert dst.tombstones == []
        await server.restart()
        async with client(server) as c:
            again = {name: await dump_topic(c, name) for name in ALL_DESTS}
        for d in ALL_DESTS:
            a, b = again[d], dumps[d]
            assert a is not None
            assert b is not None
            assert a.records == b.records, d


@pytest.mark.parametrize("seed", [3])
async def test_kill9_with_an_ephemeral_end_follows_the_documented_rule(tmp_path, seed):
    """An `ephemeral` source or destination gets no copies back after `kill -9` (its
    records were never persisted, or the copies of persisted records are not restored
    into a RAM-only topic); the routers survive and resume at the source's head, and a
    persistent pair in the same storm keeps every copy at its seq."""
    rng = random.Random(seed)
    pairs = {"e_src": "p_dst", "p_src": "e_dst", "p2_src": "p2_dst"}
    classes = {"e_src": "ephemeral", "e_dst": "ephemeral", "p_src": "disk", "p_dst": "disk"}
    acked: dict[str, int] = {}
    async with serving(tmp_path) as server:
        async with client(server) as c:
            for name in [*pairs, *pairs.values()]:
                r = await c.put(
                    f"/v0/topics/{name}", json={"durability": classes.get(name, "disk")}
                )
                assert r.status_code in (200, 201), r.text
            for s, d in pairs.items():
                r = await c.put(f"/v0/routers/{s}->{d}", json={"source": s, "dest": d})
                assert r.status_code == 201, r.text

        async def writer() -> None:
            async with client(server) as c:
                n = 0
                while True:
                    name = rng.choice(list(pairs))
                    n += 1
                    try:
                        r = await c.post(f"/v0/topics/{name}", json={"records": [{"data": n}]})
                    except Exception:  # the kill
                        return
                    if r.status_code == 200:
                        acked[name] = acked.get(name, 0) + 1

        with trio.move_on_after(rng.uniform(0.3, 1.0)):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(writer)
        async with client(server) as c:
            seen = await dump_topic(c, "p2_dst")
        await server.restart()
        async with client(server) as c:
            dumps = {n: await dump_topic(c, n) for n in [*pairs, *pairs.values()]}
            assert acked.get("e_src") and acked.get("p_src")
            assert dumps["e_src"].records == []  # ephemeral: RAM only
            assert dumps["p_dst"].records == []  # copies of unpersisted records: none
            assert dumps["e_dst"].records == []  # a RAM-only destination gets none back
            assert len(dumps["p_src"].records) >= acked["p_src"]
            src2 = [data for _, _, data, _ in dumps["p2_src"].records]
            assert [data for _, _, data, _ in dumps["p2_dst"].records] == src2
            assert seen is not None
            before = {seq: data for seq, _, data, _ in seen.records}
            after = {seq: data for seq, _, data, _ in dumps["p2_dst"].records}
            assert all(after.get(seq) == data for seq, data in before.items())
            # the routers survived and resume at the source head
            for s, d in pairs.items():
                w = await c.post(f"/v0/topics/{s}", json={"records": [{"data": "after"}]})
                assert w.status_code == 200, w.text
                dump = await dump_topic(c, d)  # read-path catch-up
                assert dump is not None
                assert dump.records[-1][2] == b'"after"'
                r = await c.get(f"/v0/routers/{s}->{d}")
                assert r.status_code == 200, r.text
                assert r.json()["cursor_lag"] == 0
