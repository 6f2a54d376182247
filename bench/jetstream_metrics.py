"""Three jetstream fronts: what a deployment-wide `/v0/metrics` scrape costs.

Starts a nats-server (JetStream on, a temporary store, a random loopback port) and three
`topicd serve` processes on one prefix with three owner shards (one each, once their
lease checks have shared them out), writes one record to each of `--topics` topics
through the first front, then times scrapes of the first front, alternating round by
round so machine load hits every side alike: the deployment's (the default: the two
other fronts asked in parallel, their figures merged) against the front's own
(`?scope=front`), in the Prometheus text and the JSON form. Prints the medians, their
ratio, the answers' sizes, and checks the deployment's answer counts every topic.

    python bench/jetstream_metrics.py --topics 1000 --rounds 5 --n 20
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from jetstream_bridge import start_server
from jetstream_failover import Front

SIDES = {
    "text deployment": ("/v0/metrics", {}),
    "text front": ("/v0/metrics?scope=front", {}),
    "json deployment": ("/v0/metrics", {"Accept": "application/json"}),
    "json front": ("/v0/metrics?scope=front", {"Accept": "application/json"}),
}


def get(conn: http.client.HTTPConnection, path: str, headers: dict[str, str]) -> bytes:
    conn.request("GET", path, headers=headers)
    r = conn.getresponse()
    data = r.read()
    assert r.status == 200, (r.status, data[:300])
    return data


def timed(conn: http.client.HTTPConnection, path: str, headers: dict[str, str], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        get(conn, path, headers)
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topics", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=20, help="scrapes per round and side")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jsmetrics-"))
    proc, url = start_server(root)
    env = {
        "TOPICD_STORAGE_BACKEND": "jetstream",
        "TOPICD_JETSTREAM_SERVERS": url,
        "TOPICD_JETSTREAM_PREFIX": "metrics",
        "TOPICD_STORAGE_JETSTREAM_SHARDS": "3",
        "TOPICD_STORAGE_JETSTREAM_LEASE_MS": "1500",
    }
    fronts: list[Front] = []
    per: dict[str, list[float]] = {side: [] for side in SIDES}
    sizes: dict[str, int] = {}
    try:
        for name in ("a", "b", "c"):
            front = Front(root, name, env)
            front.wait_ready()
            fronts.append(front)
        conn = http.client.HTTPConnection("127.0.0.1", fronts[0].port, timeout=60)
        deadline = time.monotonic() + 30
        while True:  # the shards shared out: each front answers for its own
            snap = json.loads(get(conn, *SIDES["json deployment"]))
            owners = [f.text().count("took the owner lease") for f in fronts[1:]]
            if snap["fronts"]["answered"] == 3 and all(owners):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the fronts did not settle: {snap['fronts']}, {owners}")
            time.sleep(0.2)
        body = json.dumps({"records": [{"data": {"pad": "x" * 100}}]}).encode()
        for i in range(args.topics):
            conn.request("POST", f"/v0/topics/t{i:06d}", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            assert r.status in (200, 201), r.status
        snap = json.loads(get(conn, *SIDES["json deployment"]))
        assert snap["topics"] == args.topics, snap["topics"]
        assert snap["fronts"] == {"live": 3, "answered": 3, "missing": []}, snap["fronts"]
        text = get(conn, *SIDES["text deployment"]).decode()
        heads = len(re.findall(r"^topics_topic_head_seq\{", text, re.M))
        assert heads == min(args.topics, 1000), heads
        for side, (path, headers) in SIDES.items():
            sizes[side] = len(get(conn, path, headers))
        sides = list(SIDES)
        for k in range(args.rounds):
            for side in sides if k % 2 == 0 else reversed(sides):
                path, headers = SIDES[side]
                per[side].append(timed(conn, path, headers, args.n))
    finally:
        for front in fronts:
            front.stop()
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.topics} topics on 3 fronts, {args.rounds} rounds of {args.n} scrapes per side")
    for side, values in per.items():
        ms = sorted(x * 1e3 for x in values)
        print(
            f"{side:16s} median {statistics.median(ms):8.2f} ms, {sizes[side]:8d} bytes "
            f"(rounds: {', '.join(f'{x:.2f}' for x in ms)})"
        )
    for form in ("text", "json"):
        ratio = statistics.median(per[f"{form} deployment"]) / statistics.median(
            per[f"{form} front"]
        )
        print(f"{form}: deployment / front {ratio:.2f}x")


if __name__ == "__main__":
    main()
