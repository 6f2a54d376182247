"""What one dashboard snapshot costs the event loop, by instance size.

The dashboard's feed builds one snapshot per interval (1 s) while anyone watches, on the
loop, in one synchronous step. This builds it in-process for growing numbers of topics
(a fixed share of them queues, each with a job, plus idle watch sessions) and prints the
mean build-and-serialize time, next to the JSON metrics snapshot (the same numbers).

    python bench/dashboard_snapshot.py [--sizes 1000,20000,100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.http_core import speed_probe
from topicd.http.metrics import json_snapshot
from topicd.testing.harness import make_config, open_app
from topicd.wire import TopicConfigIn, WatchIn, WatchTopicIn


async def measure(n_topics: int, rounds: int) -> tuple[float, float]:
    cfg = make_config(limits={"max_topics": n_topics * 2, "max_watch_sessions": n_topics})
    async with open_app(cfg) as h:
        e = h.engine
        n_queues = max(1, n_topics // 100)
        for i in range(n_topics):
            await e.put_topic(f"t{i:06d}", None)
        for i in range(n_queues):
            await e.put_topic(f"q{i:05d}", TopicConfigIn(type="queue"))
        for i in range(0, n_topics, 100):  # one watch session per 100 topics
            req = WatchIn(topics={f"t{i:06d}": WatchTopicIn()})
            e.create_watch(None, req, False)
        hub = h.app.asgi_app.dashboard
        ref = h.app.extensions["topicd"]["engine"]
        hub.snapshot_event()
        t0 = time.perf_counter()
        for _ in range(rounds):
            hub.snapshot_event()
        dash = (time.perf_counter() - t0) / rounds
        t0 = time.perf_counter()
        for _ in range(rounds):
            json_snapshot(ref, h.lifecycle)
        metrics = (time.perf_counter() - t0) / rounds
        return dash, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,20000,100000")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"machine: trio.sleep(0) {speed_probe():,.0f}/s")
    print(f"{'topics':>8} {'queues':>7} {'dashboard ms':>13} {'metrics json ms':>16}")
    for n in (int(s) for s in args.sizes.split(",")):
        dash, metrics = trio.run(measure, n, args.rounds)
        print(f"{n:>8} {max(1, n // 100):>7} {dash * 1000:>13.1f} {metrics * 1000:>16.1f}")
    print(f"machine: trio.sleep(0) {speed_probe():,.0f}/s")


if __name__ == "__main__":
    main()
