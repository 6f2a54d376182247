"""The asyncio ↔ Trio bridge of the jetstream backend: what one bridged call costs.

Starts a nats-server (JetStream on, a temporary store, a random loopback port) and, in
alternating rounds so machine load hits both sides alike, times sequential round trips:

* `direct publish`: `await js.publish(...)` on the asyncio loop (nats-py as designed);
* `bridged publish`: the same publish from a Trio task through `AsyncioBridge.call`
  (topicd's path: an asyncio loop on its own thread);
* `direct noop` / `bridged noop`: an empty coroutine, the bridge's own cost.

Each round runs `--n` calls per mode (after a warm-up); the report gives per-call
medians over the rounds (and p90 of the per-round means), and the bridged/direct ratio.

    python bench/jetstream_bridge.py --rounds 7 --n 2000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio

from topicd.storage.jsbridge import AsyncioBridge


def start_server(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = str(Path(sys.executable).parent / "nats-server")
    if not os.access(binary, os.X_OK):
        binary = shutil.which("nats-server") or "nats-server"
    conf = root / "nats.conf"
    conf.write_text(
        f'listen: "127.0.0.1:-1"\nmax_payload: 8MB\njetstream {{ store_dir: "{root / "store"}" }}\n'
    )
    log = root / "log"
    proc = subprocess.Popen(
        [binary, "-c", str(conf)], stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = log.read_text()
        m = re.search(r"Listening for client connections on ([\d.]+:\d+)", text)
        if m and "Server is ready" in text:
            return proc, f"nats://{m.group(1)}"
        time.sleep(0.02)
    proc.kill()
    raise SystemExit(f"nats-server did not start:\n{log.read_text()}")


class Client:
    """nats-py objects living on the bridge's loop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.js = None
        self.nc = None

    async def connect(self) -> None:
        import nats
        from nats.js import api

        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await self.js.add_stream(
            api.StreamConfig(name="BENCH", subjects=["bench.>"], storage=api.StorageType.FILE)
        )

    async def publish(self) -> None:
        await self.js.publish("bench.x", b'{"$seq":1,"$ts":1,"data":1}')

    async def noop(self) -> None:
        return None

    async def direct(self, what: str, n: int) -> float:
        fn = self.publish if what == "publish" else self.noop
        t0 = time.perf_counter()
        for _ in range(n):
            await fn()
        return (time.perf_counter() - t0) / n


async def bridged(bridge: AsyncioBridge, client: Client, what: str, n: int) -> float:
    fn = client.publish if what == "publish" else client.noop
    t0 = time.perf_counter()
    for _ in range(n):
        await bridge.call(fn)
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jsbench-"))
    proc, url = start_server(root)
    bridge = AsyncioBridge()
    bridge.start()
    try:
        client = Client(url)
        loop = bridge._loop
        assert loop is not None

        def on_loop(coro):  # a direct run: the coroutine awaits nothing across threads
            return asyncio.run_coroutine_threadsafe(coro, loop).result()

        on_loop(client.connect())
        results: dict[str, list[float]] = {}

        async def trio_side(what: str, n: int) -> float:
            return await bridged(bridge, client, what, n)

        for what in ("publish", "noop"):
            on_loop(client.direct(what, 200))  # warm-up
            trio.run(trio_side, what, 200)
        for _ in range(args.rounds):
            for what in ("publish", "noop"):
                results.setdefault(f"direct {what}", []).append(
                    on_loop(client.direct(what, args.n))
                )
                results.setdefault(f"bridged {what}", []).append(trio.run(trio_side, what, args.n))
        load = os.getloadavg()
        print(
            f"# {args.rounds} rounds x {args.n} sequential calls per mode, alternated; "
            f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
            f"{os.cpu_count()} CPUs; {threading.active_count()} threads"
        )
        for name, per in results.items():
            us = sorted(x * 1e6 for x in per)
            p90 = us[min(len(us) - 1, int(0.9 * len(us)))]
            print(f"{name:16s} median {statistics.median(us):8.1f} µs/call   p90 {p90:8.1f}")
        for what in ("publish", "noop"):
            d = statistics.median(results[f"direct {what}"])
            b = statistics.median(results[f"bridged {what}"])
            print(f"bridged/direct {what}: {b / d:.2f}x (+{(b - d) * 1e6:.1f} µs)")
        on_loop(client.nc.drain())
    finally:
        bridge.close()
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
