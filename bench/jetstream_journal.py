"""What a takeover of a busy queue reads, with and without journal compaction.

Starts a nats-server (JetStream, temporary file store, random loopback port) and opens
two fronts on one deployment in this process (one owner shard: the first front owns it,
the second follows). Two queues with durable leases get the same history: `--acks` jobs
claimed and acked `--per-call` at a time (a lease message and an ack message per call in
the journal), then `--held` jobs left leased. The owner compacts the second queue's
journal (a snapshot of its lease state, then a purge below it); the first keeps all of
it. Then the follower's queue takeover (`Journals.take_over`: the journal read, the lease
table rebuilt, an `own` marker appended) is timed on each queue, alternately, `--rounds`
times; it prints the median of each, their ratio, and the journal sizes, plus the load.

    python bench/jetstream_journal.py --acks 10000 --per-call 10
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jetstream_bridge import start_server

from topicd.config import Config
from topicd.http.app import create_app
from topicd.http.auth import KeyStore
from topicd.lifecycle import Lifecycle
from topicd.storage import jsqueues
from topicd.storage.jetstream import JetStreamBackend, open_jetstream_engine
from topicd.testing.fake_clock import FakeWallClock


def config(url: str) -> Config:
    cfg = Config()
    js = dataclasses.replace(
        cfg.storage.jetstream, servers=(url,), prefix="jbench", lease_ms=600_000
    )
    storage = dataclasses.replace(cfg.storage, backend="jetstream", jetstream=js)
    return dataclasses.replace(cfg, storage=storage)


async def journal_size(backend: JetStreamBackend, tid: int) -> int:
    store = backend.store
    assert store.js is not None
    js = store.js
    info = await backend.bridge.call(lambda: js.stream_info(jsqueues.stream(store, tid)))
    return int(info.state.messages)


async def run(args: argparse.Namespace, url: str) -> None:
    # the owner's background compaction stays off: this bench compacts one queue by hand
    jsqueues.COMPACT_MIN = 1 << 62
    cfg = config(url)
    clock = FakeWallClock()
    async with AsyncExitStack() as stack:
        apps = []
        for _ in range(2):
            engine = await stack.enter_async_context(open_jetstream_engine(cfg, clock))
            lifecycle = Lifecycle()
            app = create_app(engine, engine.cfg, lifecycle, KeyStore.from_config(cfg.auth))
            lifecycle.set_serving()
            await stack.enter_async_context(app.test_app())
            apps.append((app, engine))
        (app, owner), (_, follower) = apps
        c = app.test_client()
        names = ("full", "compacted")
        for name in names:
            r = await c.put(f"/v0/topics/{name}", json={"type": "queue", "leases_durable": True})
            assert r.status_code == 201, await r.get_data()
            total = args.acks + args.held
            for lo in range(0, total, 1000):
                recs = [{"data": i} for i in range(lo, min(total, lo + 1000))]
                r = await c.post(f"/v0/topics/{name}", json={"records": recs})
                assert r.status_code == 200, await r.get_data()
            t0 = time.perf_counter()
            for _ in range(args.acks // args.per_call):
                r = await c.post(
                    f"/v0/topics/{name}/claim", json={"node": "w", "max": args.per_call}
                )
                jobs = (await r.get_json())["claimed"]
                body = {
                    "node": "w",
                    "seqs": [j["$seq"] for j in jobs],
                    "lease_ids": [j["lease_id"] for j in jobs],
                }
                r = await c.post(f"/v0/topics/{name}/ack", json=body)
                assert (await r.get_json())["acked"] == len(jobs)
            dt = time.perf_counter() - t0
            print(f"{name}: {args.acks} acks in {dt:.1f} s")
            r = await c.post(
                f"/v0/topics/{name}/claim",
                json={"node": "holder", "max": args.held, "lease_ms": 3_600_000},
            )
            assert len((await r.get_json())["claimed"]) == args.held
        obackend = owner.commit
        assert isinstance(obackend, JetStreamBackend)
        t0 = time.perf_counter()
        assert await obackend.journals.compact(owner.topics["compacted"])
        print(f"compaction: {(time.perf_counter() - t0) * 1000:.0f} ms")
        fbackend = follower.commit
        assert isinstance(fbackend, JetStreamBackend)
        for name in names:
            await fbackend.fronts.catch_up(name)  # type: ignore[union-attr]
            tid = follower.topics[name].topic_id
            print(f"{name}: journal holds {await journal_size(fbackend, tid)} messages")
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.rounds):
            for name in names:
                topic = follower.topics[name]
                t0 = time.perf_counter()
                await fbackend.journals.take_over(topic, "bench")
                times[name].append(time.perf_counter() - t0)
                q = topic.queue
                assert q is not None
                assert len(q.leases) == args.held, len(q.leases)
        full, comp = (statistics.median(times[n]) * 1000 for n in names)
        print(
            f"takeover after {args.acks} acks ({args.per_call} per call), {args.held} "
            f"leases held: full journal {full:.1f} ms, compacted {comp:.1f} ms "
            f"({full / comp:.1f}x), median of {args.rounds} alternated rounds"
        )
    print(f"load average: {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--acks", type=int, default=10000)
    ap.add_argument("--per-call", type=int, default=10)
    ap.add_argument("--held", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jsjournal-"))
    proc, url = start_server(root)
    try:
        trio.run(run, args, url)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
