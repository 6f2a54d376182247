"""`kill -9` while checkpoints relocate sealed segments to the cold tier.

Method: the real `topicd serve` (`tests/crash/harness.py`: a checkpoint every second or
MiB, segments of 50 records, a payload cache of 4 KiB so reads go to the segment files)
with `TOPICD_COLD_DIR` set and `TOPICD_HOT_RETAIN_SEGMENTS=0`, so every checkpoint that
seals a segment also copies it to the cold directory, registers it and (a snapshot later)
removes the hot copy. Four writers append batches of 10 records of ~4 KiB (so a segment
is ~200 KiB and its copy takes a while) to three `fsync` topics; each acknowledged batch
goes into an oracle, each batch in flight at the kill into a "maybe" set. After a
seeded random delay (0.3-2.5 s) the server gets `SIGKILL`; the next start must serve
(recovery finds each segment in the hot or the cold tree), and, read back with diff loops
until `caught_up` (payloads as raw JSON text): every acknowledged record is there at its
seq with its exact bytes, every record read back was sent (acknowledged at that seq, or
in flight), seqs ascend, and no server log line is an error. A second `SIGKILL` and
restart without writes must give an identical dump. At the end the cold directory holds
segment files, a diff from seq 0 reports `performance.cold_segments_read` > 0, and, the
server stopped, `topicd verify` exits 0 with the cold directory configured and 4 (naming
`storage.cold_dir`) without it.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import trio

from tests.crash.harness import (
    JSON,
    TOPICD,
    Server,
    client,
    diff_dumps,
    dump_all,
    serving,
)

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)

CYCLES = 3
WRITERS = 4
TOPICS = ["c0", "c1", "c2"]
BATCH = 10
KILL_AFTER_S = (0.3, 2.5)


class Oracle:
    def __init__(self) -> None:
        self.acked: dict[str, dict[int, bytes]] = {t: {} for t in TOPICS}
        self.maybe: dict[str, set[bytes]] = {t: set() for t in TOPICS}
        self.errors: list[str] = []


def record(pid: str, rng: random.Random) -> bytes:
    return b'{"id":"%s","n":1.10,"pad":"%s"}' % (pid.encode(), b"p" * rng.randint(3000, 5000))


async def writer(server: Server, oracle: Oracle, w: int, rng: random.Random, cycle: int) -> None:
    async with client(server) as c:
        n = 0
        while True:
            topic = rng.choice(TOPICS)
            datas = [record(f"{cycle}.{w}.{n}.{i}", rng) for i in range(BATCH)]
            n += 1
            body = b'{"records":[' + b",".join(b'{"data":%s}' % d for d in datas) + b"]}"
            oracle.maybe[topic].update(datas)
            try:
                r = await c.post(f"/v0/topics/{topic}", content=body, headers=JSON)
            except Exception:  # the kill: the batch stays "maybe"
                return
            if r.status_code not in (200, 201):
                oracle.errors.append(f"{topic}: write answered {r.status_code} {r.text[:200]}")
                return
            first = r.json()["first_seq"]
            for i, d in enumerate(datas):
                oracle.acked[topic][first + i] = d
                oracle.maybe[topic].discard(d)


def check(oracle: Oracle, dumps: dict[str, object]) -> None:
    for topic in TOPICS:
        dump = dumps[topic]
        assert dump is not None, topic
        got = {seq: data for seq, _, data, _ in dump.records}  # type: ignore[attr-defined]
        seqs = [seq for seq, _, _, _ in dump.records]  # type: ignore[attr-defined]
        if seqs != sorted(set(seqs)):
            oracle.errors.append(f"{topic}: seqs do not ascend strictly")
        for seq, data in oracle.acked[topic].items():
            if got.get(seq) != data:
                oracle.errors.append(f"{topic}: acknowledged seq {seq} lost or changed")
        for seq, data in got.items():
            if oracle.acked[topic].get(seq) != data and data not in oracle.maybe[topic]:
                oracle.errors.append(f"{topic}: seq {seq} holds bytes never sent there")
        # what survived is now known: in-flight records that came back are acknowledged
        for seq, data in got.items():
            oracle.acked[topic][seq] = data
        oracle.maybe[topic].clear()


def fail_if(oracle: Oracle, server: Server, what: str, seed: int) -> None:
    problems = [p for r in server.runs for p in r.problems()]
    if oracle.errors or problems:
        raise AssertionError(
            f"seed {seed} ({what}): {len(oracle.errors)} violations\n"
            + "\n".join(oracle.errors[:30] + [f"server log: {p}" for p in problems[:10]])
            + f"\n--- server stderr tail ---\n{server.log_tail()}"
        )


def cold_files(cold: Path) -> list[Path]:
    return sorted(cold.glob("topics/*/seg-*.data")) if cold.exists() else []


@pytest.mark.parametrize("seed", [1, 2])
async def test_kill9_while_segments_move_to_the_cold_tier(tmp_path, seed):
    rng = random.Random(seed)
    cold = tmp_path / "cold"
    env = {"TOPICD_COLD_DIR": str(cold), "TOPICD_HOT_RETAIN_SEGMENTS": "0"}
    oracle = Oracle()
    with trio.fail_after(60 * CYCLES):
        async with serving(tmp_path, env=env) as server:
            async with client(server) as c:
                for topic in TOPICS:
                    r = await c.put(f"/v0/topics/{topic}", json={"durability": "fsync"})
                    assert r.status_code == 201, r.text
            for cycle in range(CYCLES):
                delay = rng.uniform(*KILL_AFTER_S)
                async with trio.open_nursery() as nursery:
                    for w in range(WRITERS):
                        rw = random.Random(f"{seed}/{cycle}/{w}")
                        nursery.start_soon(writer, server, oracle, w, rw, cycle)
                    await trio.sleep(delay)  # the random kill moment is the point of the test
                    await server.kill()
                log.info(
                    "seed %d cycle %d: SIGKILL at %.2f s after %d relocating checkpoints; %d "
                    "segment files in the cold tier",
                    seed,
                    cycle,
                    delay,
                    server.run.text.count("moved to the cold tier"),
                    len(cold_files(cold)),
                )
                await server.start()
                first = await dump_all(server, TOPICS)
                check(oracle, first)
                fail_if(oracle, server, f"restart after kill {cycle} at {delay:.2f} s", seed)
                await server.restart()  # SIGKILL again, nothing written in between
                second = await dump_all(server, TOPICS)
                oracle.errors.extend(diff_dumps(first, second))
                fail_if(oracle, server, f"second restart after kill {cycle}", seed)
            assert cold_files(cold), "no segment was relocated"
            async with client(server) as c:
                r = await c.post("/v0/topics/c0/diff", json={"from_seq": 0, "limit": 20})
                assert r.status_code == 200, r.text
                assert r.json()["performance"].get("cold_segments_read", 0) > 0, r.text
            await server.kill()
            # the offline check finds the cold segments too, and refuses without them
            base = {k: v for k, v in server.env().items() if k != "TOPICD_COLD_DIR"}
            verify = [*TOPICD, "verify", "--data-dir", str(server.data_dir)]
            ok = await trio.run_process(
                verify,
                env={**base, "TOPICD_COLD_DIR": str(cold)},
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert ok.returncode == 0, ok.stderr.decode()
            refused = await trio.run_process(
                verify, env=base, capture_stdout=True, capture_stderr=True, check=False
            )
            assert refused.returncode == 4, refused.stderr.decode()
            assert b"storage.cold_dir is not set" in refused.stderr
