"""CPU time of one stream open and close, in process, on the embedded engine.

Opens `--n` SSE watch streams (sessions created beforehand), `--n` `/work` streams and
`--n` WebSockets one after another on an in-process app (the ASGI and in-memory socket
seams the contract tests use), each read to its first frames and closed before the
next, and prints the process CPU time per open and close of each kind. CPU time rather
than wall time, so a busy machine blurs it less. To compare two trees, run it with each
on `PYTHONPATH`, alternating:

    PYTHONPATH=<other tree> python bench/stream_opens.py --n 1000
    python bench/stream_opens.py --n 1000
"""

from __future__ import annotations

import argparse
import contextlib
import time

import trio
import trio.testing

from topicd.testing.harness import make_config, open_app
from topicd.testing.sse import open_sse, open_stream
from topicd.testing.ws import open_ws_in_process


async def run(n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with open_app(make_config()) as h, trio.open_nursery() as nursery:
        c = h.app.test_client()
        await c.put("/v0/topics/a", json={})
        await c.put("/v0/topics/q", json={"type": "queue"})
        wids = []
        for _ in range(n):
            r = await c.post("/v0/watch", json={"topics": {"a": {}}})
            wids.append((await r.get_json())["wid"])
        t0 = time.process_time()
        for wid in wids:
            s = await open_stream(nursery, h.app.asgi_app, wid)
            await s.read_frames(2)
            s.disconnect()
            await s.wait_done()
        out["watch"] = time.process_time() - t0
        t0 = time.process_time()
        for _ in range(n):
            s = await open_sse(nursery, h.app.asgi_app, "/v0/topics/q/work", query="node=w")
            await s.read_frames(2)
            s.disconnect()
            await s.wait_done()
        out["work"] = time.process_time() - t0
        t0 = time.process_time()
        for _ in range(n):
            ws = await open_ws_in_process(nursery, h.app)
            await ws.close(1000)
            with contextlib.suppress(Exception):
                await ws.recv()
            await ws.aclose()
        await trio.testing.wait_all_tasks_blocked()
        out["websocket"] = time.process_time() - t0
        nursery.cancel_scope.cancel()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000, help="opens of each kind")
    args = p.parse_args()
    got = trio.run(run, args.n)
    print(" ".join(f"{k} {v / args.n * 1e6:.0f} µs" for k, v in got.items()), "(CPU per open)")


if __name__ == "__main__":
    main()
