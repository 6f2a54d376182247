"""How fast a jetstream front writes and rebuilds: batched writes, then a restart.

Starts a nats-server (JetStream, temporary file store, random loopback port), opens a
front in this process (`open_jetstream_engine` + the app, Quart's test client: no
sockets on the HTTP side), writes `--records` records to `--topics` topics in writes of
`--batch` records (`--concurrency` writers), closes the front and opens a new one on the
same prefix: the second open rebuilds every topic from the streams. Prints writes/s,
records/s and the rebuild time (records/s), plus the load average.

    python bench/jetstream_rebuild.py --records 100000 --batch 1000
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
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jetstream_bridge import start_server

from topicd.config import Config
from topicd.http.app import create_app
from topicd.http.auth import KeyStore
from topicd.lifecycle import Lifecycle
from topicd.storage.jetstream import open_jetstream_engine
from topicd.testing.fake_clock import FakeWallClock


def config(url: str) -> Config:
    cfg = Config()
    js = dataclasses.replace(cfg.storage.jetstream, servers=(url,), prefix="bench")
    storage = dataclasses.replace(cfg.storage, backend="jetstream", jetstream=js)
    protocol = dataclasses.replace(cfg.protocol, max_record_bytes=512 * 1024)
    return dataclasses.replace(cfg, storage=storage, protocol=protocol)


async def run(args: argparse.Namespace, url: str) -> None:
    cfg = config(url)
    per_write = [{"data": {"i": i, "pad": "x" * args.size}} for i in range(args.batch)]
    writes = args.records // args.batch
    async with open_jetstream_engine(cfg, FakeWallClock()) as engine:
        lifecycle = Lifecycle()
        app = create_app(engine, engine.cfg, lifecycle, KeyStore.from_config(cfg.auth))
        lifecycle.set_serving()
        async with app.test_app():
            client = app.test_client()
            todo = list(range(writes))

            async def writer() -> None:
                while todo:
                    k = todo.pop()
                    r = await client.post(
                        f"/v0/topics/t{k % args.topics}", json={"records": per_write}
                    )
                    assert r.status_code in (200, 201), await r.get_data()

            t0 = time.perf_counter()
            async with trio.open_nursery() as n:
                for _ in range(args.concurrency):
                    n.start_soon(writer)
            dt = time.perf_counter() - t0
    print(
        f"write: {writes} writes of {args.batch} records ({args.size}-byte pad) to "
        f"{args.topics} topics, c={args.concurrency}: {dt:.2f} s, {writes / dt:.0f} writes/s, "
        f"{writes * args.batch / dt:.0f} records/s"
    )
    t0 = time.perf_counter()
    async with open_jetstream_engine(cfg, FakeWallClock()) as engine:
        dt = time.perf_counter() - t0
        count = sum(t.count for t in engine.topics.values())
    print(f"rebuild: {count} records in {dt:.2f} s, {count / dt:.0f} records/s")


async def latency(args: argparse.Namespace, url: str) -> None:
    """Single-record writes at c=1: the embedded backend (WAL in a temporary directory,
    `disk` class) against the jetstream backend, alternated round by round."""
    from topicd.clock import SystemWallClock
    from topicd.offload import ThreadOffload
    from topicd.storage.fs import RealFs
    from topicd.storage.service import open_durable_engine

    data = Path(tempfile.mkdtemp(prefix="jslat-"))
    js_cfg = config(url)
    wal_cfg = dataclasses.replace(
        Config(), storage=dataclasses.replace(Config().storage, data_dir=str(data / "d"))
    )
    results: dict[str, list[float]] = {"embedded": [], "jetstream": []}
    body = {"records": [{"data": {"i": 1, "pad": "x" * args.size}}]}

    async def timed(app_engine_cm, cfg: Config, topic: str) -> float:
        async with app_engine_cm as engine:
            lifecycle = Lifecycle()
            app = create_app(engine, engine.cfg, lifecycle, KeyStore.from_config(cfg.auth))
            lifecycle.set_serving()
            async with app.test_app():
                client = app.test_client()
                for _ in range(50):  # warm-up
                    await client.post(f"/v0/topics/{topic}", json=body)
                t0 = time.perf_counter()
                for _ in range(args.latency):
                    r = await client.post(f"/v0/topics/{topic}", json=body)
                    assert r.status_code in (200, 201)
                return (time.perf_counter() - t0) / args.latency

    for k in range(args.rounds):
        offload = ThreadOffload({"wal": 8, "misc": 2, "read": 2, "snapshot": 1}, dedicated=("wal",))
        try:
            results["embedded"].append(
                await timed(
                    open_durable_engine(
                        wal_cfg, RealFs(), offload, SystemWallClock(), boot_id=None
                    ),
                    wal_cfg,
                    f"e{k}",
                )
            )
        finally:
            offload.close()
        results["jetstream"].append(
            await timed(open_jetstream_engine(js_cfg, SystemWallClock()), js_cfg, f"j{k}")
        )
    for name, per in results.items():
        us = sorted(x * 1e6 for x in per)
        print(
            f"{name:10s} single-record write, c=1: median {statistics.median(us):7.0f} µs "
            f"(rounds: {', '.join(f'{x:.0f}' for x in us)})"
        )
    e = statistics.median(results["embedded"])
    j = statistics.median(results["jetstream"])
    print(f"jetstream / embedded: {j / e:.2f}x")
    shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--topics", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument(
        "--latency", type=int, default=0, help="instead: N single-record writes per round"
    )
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jsrebuild-"))
    proc, url = start_server(root)
    try:
        print(f"# load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        trio.run(latency if args.latency else run, args, url)
        print(f"# load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
