"""Two jetstream fronts: what forwarding a write to the owner front costs.

Starts a nats-server (JetStream on, a temporary store, a random loopback port) and opens
two fronts on one prefix in this process (each its own engine, asyncio bridge and NATS
connection; the apps are driven through Quart's test client, so no HTTP sockets). The
first front takes the owner lease; the second forwards its writes to it. Each round
times `--n` sequential single-record writes (c=1) on the owner (`direct`) and the same on
the follower (`forwarded`: the follower's bridge, one NATS request, the owner's engine
and JetStream publish, the answer back), alternated round by round so machine load hits
both alike; then `--reads` diff reads of one record on each (the follower's read first
asks JetStream for the topic's entry and last seq).

    python bench/jetstream_fronts.py --rounds 5 --n 500
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import trio
from jetstream_bridge import start_server

from topicd.clock import SystemWallClock
from topicd.config import Config
from topicd.http.app import create_app
from topicd.http.auth import KeyStore
from topicd.lifecycle import Lifecycle
from topicd.storage.jetstream import open_jetstream_engine


def config(url: str) -> Config:
    cfg = Config()
    js = dataclasses.replace(cfg.storage.jetstream, servers=(url,), prefix="fronts")
    storage = dataclasses.replace(cfg.storage, backend="jetstream", jetstream=js)
    # the server's default max_payload (1 MB) holds records up to this size
    protocol = dataclasses.replace(cfg.protocol, max_record_bytes=512 * 1024)
    return dataclasses.replace(cfg, storage=storage, protocol=protocol)


async def run(args: argparse.Namespace, url: str) -> None:
    cfg = config(url)
    body = {"records": [{"data": {"i": 1, "pad": "x" * args.size}}]}
    results: dict[str, list[float]] = {"direct": [], "forwarded": []}
    reads: dict[str, list[float]] = {"direct": [], "forwarded": []}
    async with (
        open_jetstream_engine(cfg, SystemWallClock()) as owner,
        open_jetstream_engine(cfg, SystemWallClock()) as follower,
    ):
        assert owner.forward is None
        assert follower.forward is not None
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            ready = trio.Event()
            apps = []
            for engine in (owner, follower):
                lifecycle = Lifecycle()
                app = create_app(engine, engine.cfg, lifecycle, KeyStore.from_config(cfg.auth))
                lifecycle.set_serving()
                apps.append(app)

            async def serve_apps() -> None:
                async with apps[0].test_app(), apps[1].test_app():
                    ready.set()
                    await stop.wait()

            nursery.start_soon(serve_apps)
            await ready.wait()
            clients = {"direct": apps[0].test_client(), "forwarded": apps[1].test_client()}

            async def timed(name: str, topic: str) -> float:
                client = clients[name]
                for _ in range(50):  # warm-up
                    await client.post(f"/v0/topics/{topic}", json=body)
                t0 = time.perf_counter()
                for _ in range(args.n):
                    r = await client.post(f"/v0/topics/{topic}", json=body)
                    assert r.status_code in (200, 201), await r.get_data()
                return (time.perf_counter() - t0) / args.n

            async def timed_reads(name: str, topic: str) -> float:
                client = clients[name]
                t0 = time.perf_counter()
                for _ in range(args.reads):
                    r = await client.post(
                        f"/v0/topics/{topic}/diff", json={"from_seq": 0, "limit": 1}
                    )
                    assert r.status_code == 200, await r.get_data()
                return (time.perf_counter() - t0) / args.reads

            for k in range(args.rounds):
                order = ("direct", "forwarded") if k % 2 == 0 else ("forwarded", "direct")
                for name in order:
                    results[name].append(await timed(name, f"{name[0]}{k}"))
                for name in order:
                    reads[name].append(await timed_reads(name, f"{name[0]}{k}"))
            stop.set()
    for title, table in (("single-record write", results), ("one-record diff read", reads)):
        for name, per in table.items():
            us = sorted(x * 1e6 for x in per)
            print(
                f"{name:10s} {title}, c=1: median {statistics.median(us):7.0f} µs "
                f"(rounds: {', '.join(f'{x:.0f}' for x in us)})"
            )
        ratio = statistics.median(table["forwarded"]) / statistics.median(table["direct"])
        print(f"{title}: follower / owner {ratio:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=500, help="writes per round and side")
    p.add_argument("--reads", type=int, default=500, help="reads per round and side")
    p.add_argument("--size", type=int, default=100, help="pad bytes per record")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jsfronts-"))
    proc, url = start_server(root)
    try:
        trio.run(run, args, url)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
