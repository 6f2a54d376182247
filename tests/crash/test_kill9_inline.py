"""`kill -9` while small topics stay inline and grow out of it (storage.md "Inline
topics").

Method: one temporary data directory served by successive `topicd serve` children
(`tests/crash/harness.py`: a checkpoint every second or MiB) with
`storage.segments.inline_max_bytes` at 1,024 bytes, so a topic moves from the snapshot
into segment files after about seven of these records. Four writers append one or two
~100-byte records at a time round-robin over 16 topics (`disk`, some `fsync`), which
outgrow the bound within the first cycle; 8 more topics get two records a cycle and stay
inline throughout. Each acknowledged record goes into an oracle. After a random delay (from a seeded
`random.Random`) the server gets `SIGKILL`, so kills land before, during and after the
checkpoints in which topics move — writes, absorbs and snapshot writes all in flight.
After each restart every topic is read back: every acknowledged record must be there
with its seq and exact bytes, nothing unacknowledged twice, no payload at two seqs, seqs
ascending; a second `SIGKILL` and restart without writes must read back the same. At the
end some topics must have segment directories and some not (both paths were exercised).
"""

from __future__ import annotations

import logging
import random

import httpx
import pytest
import trio

from tests.crash.harness import client, diff_dumps, dump_all, serving

log = logging.getLogger(__name__)

CYCLES = 3
TOPICS = 24
HOT = 16  # written by the writers; the others get two records a cycle
WRITERS = 4
KILL_AFTER_S = (0.6, 2.4)  # checkpoints run every second: kills land around them


def topic_names() -> list[str]:
    return [f"s{i}" for i in range(TOPICS)]


async def writer(
    server_url: str, w: int, cycle: int, rng: random.Random, acked: dict[str, dict[int, bytes]]
) -> None:
    names = topic_names()[:HOT][w::WRITERS]
    n = 0
    async with httpx.AsyncClient(base_url=server_url, timeout=httpx.Timeout(20.0)) as c:
        while True:
            for name in names:
                n += 1
                datas = [
                    b'"c%d-w%d-%d-%d-%s"' % (cycle, w, n, k, b"p" * rng.randrange(60, 100))
                    for k in range(rng.choice((1, 1, 2)))
                ]
                body = b'{"records":[%s]}' % b",".join(b'{"data":%s}' % d for d in datas)
                try:
                    r = await c.post(
                        f"/v0/topics/{name}",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                except httpx.TransportError:
                    return  # the kill
                if r.status_code in (429, 503):
                    continue
                assert r.status_code in (200, 201), r.text
                first = r.json()["first_seq"]
                for k, d in enumerate(datas):
                    acked[name][first + k] = d


@pytest.mark.parametrize("seed", [1, 2])
async def test_kill9_while_inline_topics_grow_into_segments(tmp_path, seed):
    rng = random.Random(seed)
    acked: dict[str, dict[int, bytes]] = {name: {} for name in topic_names()}
    env = {"TOPICD_STORAGE_SEGMENTS_INLINE_MAX_BYTES": "1024"}
    with trio.fail_after(60 * CYCLES):
        async with serving(tmp_path, env=env) as server:
            async with client(server) as c:
                for i, name in enumerate(topic_names()):
                    durability = "fsync" if i % 6 == 0 else "disk"
                    r = await c.put(f"/v0/topics/{name}", json={"durability": durability})
                    assert r.status_code == 201, r.text
            for cycle in range(CYCLES):
                async with client(server) as c:
                    for name in topic_names()[HOT:]:
                        for k in range(2):
                            data = b'"c%d-%d-%s"' % (cycle, k, b"q" * 90)
                            r = await c.post(
                                f"/v0/topics/{name}",
                                content=b'{"records":[{"data":%s}]}' % data,
                                headers={"content-type": "application/json"},
                            )
                            assert r.status_code == 200, r.text
                            acked[name][r.json()["first_seq"]] = data
                delay = rng.uniform(*KILL_AFTER_S)
                async with trio.open_nursery() as nursery:
                    for w in range(WRITERS):
                        rw = random.Random(f"{seed}/{cycle}/{w}")
                        nursery.start_soon(writer, server.url, w, cycle, rw, acked)
                    await trio.sleep(delay)  # the random moment is the point of the test
                    await server.kill()
                log.info("seed %d cycle %d: SIGKILL at %.0f ms", seed, cycle, delay * 1000)
                await server.start()
                first = await dump_all(server, topic_names())
                for name, dump in first.items():
                    assert dump is not None, name
                    got = {seq: data for seq, _, data, _ in dump.records}
                    seqs = [seq for seq, _, _, _ in dump.records]
                    assert seqs == sorted(set(seqs)), f"{name}: seqs not ascending"
                    missing = {s: d for s, d in acked[name].items() if got.get(s) != d}
                    assert not missing, f"{name}: acknowledged records lost: {missing}"
                    datas = list(got.values())
                    assert len(datas) == len(set(datas)), f"{name}: a payload at two seqs"
                    unknown = set(got) - set(acked[name])
                    for seq in unknown:  # in flight at the kill: kept, now acknowledged
                        acked[name][seq] = got[seq]
                await server.restart()  # SIGKILL again, with no write in between
                second = await dump_all(server, topic_names())
                assert diff_dumps(first, second) == []
                assert not [p for r in server.runs for p in r.problems()], server.log_tail()
            # one more write to every hot topic, then a clean shutdown (its final checkpoint
            # takes everything): every hot topic has moved into segments by then, whatever
            # the kills hit
            async with client(server) as c:
                for name in topic_names()[:HOT]:
                    r = await c.post(
                        f"/v0/topics/{name}",
                        content=b'{"records":[{"data":"last"}]}',
                        headers={"content-type": "application/json"},
                    )
                    assert r.status_code == 200, r.text
            assert await server.term_then_kill(20) == 0, server.log_tail()
            await server.start()
            final = await dump_all(server, topic_names())
            for name, dump in final.items():
                assert dump is not None, name
                got = {seq: data for seq, _, data, _ in dump.records}
                assert all(got.get(s) == d for s, d in acked[name].items()), name
    topics_dir = tmp_path / "data" / "topics"
    dirs = list(topics_dir.iterdir()) if topics_dir.exists() else []
    assert len(dirs) == HOT, f"{len(dirs)} topics have segment directories, not the {HOT} hot ones"
