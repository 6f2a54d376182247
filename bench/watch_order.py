"""Several fronts: what ordering live watch frames across owners costs (`Fronts.hold`).

Starts a three-node nats-server cluster on loopback (R3 streams, as the JetStream test
suite runs it; stopped by PID) and two fronts in this process on one prefix, each
owning one of two topics, and opens a watch stream on the first front watching both.
Each sample times a write from the client's send to its frame on the stream: `own`
writes go to the watching front's own topic (its commit waits for the ordering round:
the streams' last seqs, begun as the write is received), `other` writes to the other
front's topic (its notice, then the catch-up). Rounds alternate the ordering on (as
shipped) and off (the scheduler's hold removed), so machine load hits both alike; the
medians and their ratio are printed.

    python bench/watch_order.py --rounds 10 --n 100
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.jetstream.conftest import (
    Deployment,
    fronts_of,
    jetstream_config,
    nats_server_binary,
    open_fronts,
    start_cluster,
    stop_all,
    wait_placeable,
)
from tests.jetstream.test_watch_order import names_owned
from tests.watch import helpers as watch_helpers


async def sample(client, s, topic: str, i: int) -> float:
    t0 = time.perf_counter()
    r = await client.post(f"/v0/topics/{topic}", json={"records": [{"data": i}]})
    assert r.status_code == 200, await r.get_data()
    (frame,) = await watch_helpers.read(s, 1, within=10)
    assert frame[2]["topic"] == topic, frame
    return (time.perf_counter() - t0) * 1000


async def run(deployment: Deployment, rounds: int, n: int) -> None:
    cfg = jetstream_config(deployment)
    async with open_fronts(cfg, 2) as hs, trio.open_nursery() as nursery:
        mine, theirs = names_owned(hs, 2)
        c0, c1 = (h.app.test_client() for h in hs)
        for name in (mine, theirs):
            await c0.put(f"/v0/topics/{name}")
        wid = await watch_helpers.wid_of(c0, {"topics": {mine: {}, theirs: {}}})
        s = await watch_helpers.open_ok(hs[0], nursery, wid)
        await watch_helpers.read(s, 2)  # (caught-up twice)
        sched = hs[0].engine.sched
        hold = fronts_of(hs[0]).hold
        lat: dict[tuple[str, str], list[float]] = {}
        for r in range(rounds):
            for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                sched.hold = hold if side == "on" else None
                for i in range(n):
                    for kind, client, topic in (("own", c0, mine), ("other", c1, theirs)):
                        ms = await sample(client, s, topic, i)
                        lat.setdefault((kind, side), []).append(ms)
        sched.hold = hold
        await watch_helpers.close(s)
        nursery.cancel_scope.cancel()
    for kind in ("own", "other"):
        on = statistics.median(lat[(kind, "on")])
        off = statistics.median(lat[(kind, "off")])
        p90 = sorted(lat[(kind, "on")])[int(len(lat[(kind, "on")]) * 0.9)]
        print(
            f"{kind:5} write -> frame: ordered p50 {on:.2f} ms (p90 {p90:.2f}), "
            f"unordered p50 {off:.2f} ms, ratio {on / off:.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--n", type=int, default=100, help="samples per round, side and kind")
    args = p.parse_args()
    binary, why = nats_server_binary()
    if binary is None:
        raise SystemExit(why)
    root = Path(tempfile.mkdtemp(prefix="watch-order-"))
    servers = start_cluster(binary, root)
    try:
        deployment = Deployment(servers, 3)
        wait_placeable(deployment.urls, 3)
        trio.run(run, deployment, args.rounds, args.n)
    finally:
        stop_all(servers)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
