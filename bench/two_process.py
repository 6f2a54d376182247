#!/usr/bin/env python
"""The multi-core design in miniature: one topicd process against two that split the topics.

    python bench/two_process.py [--duration S] [--repeat N] [--conns N] [--topics N]

Needs `wrk` (Debian package `wrk`) and the project's own dependencies; installs nothing.

docs/scaling.md describes how topicd would use N cores: N processes, each a whole topicd
(event loop, WAL shards, scheduler, governor) owning a disjoint share of the topics, and
clients (or the SDK) sending each topic's requests to its owner. This script measures the
write path of that design with two processes and client-side ownership routing, which is
the design's best case (no forwarding hop):

* `one`: one `topicd serve` pinned to CPU 0; wrk (one thread, `--conns` connections)
  writes single records (`disk`) round-robin over `--topics` topics;
* `two`: two `topicd serve` processes with separate data directories, pinned to CPU 0 and
  CPU 1; the topics are split between them by a stable hash of the name; one wrk per
  process (one thread each, `--conns`/2 connections) writes to that process's topics only.

Each scenario runs `--repeat` times, alternating; medians. Reported: accepted writes/s
per scenario and the ratio two/one. There is no target: this machine has two cores, and
in `two` the load generators share them with the servers, so the ratio says what the
second process adds here, not what N cores would give. Results go to
bench/results/two_process-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_core  # a sibling module of this script

HOST = http_core.HOST

LUA = """
local topics = {%s}
local body = %s
local n = 0
request = function()
  n = n + 1
  local t = topics[(n %% #topics) + 1]
  return wrk.format("POST", "/v0/topics/" .. t, {["Content-Type"] = "application/json"}, body)
end
local errors = 0
response = function(status, headers, body)
  if status ~= 200 then errors = errors + 1 end
end
done = function(summary, latency, requests)
  io.write(string.format("NON200 %%d\\n", summary.errors.status))
end
"""


def owner(topic: str, n: int) -> int:
    """The process owning `topic` among `n` (a stable hash of the name)."""
    return zlib.crc32(topic.encode()) % n


def lua_script(path: Path, topics: list[str]) -> None:
    names = ", ".join(f'"{t}"' for t in topics)
    body = orjson.dumps(http_core.write_body(1).decode()).decode()
    path.write_text(LUA % (names, body))


def wrk(
    port: int, script: Path, conns: int, duration: float, cpu: int | None
) -> subprocess.Popen[str]:
    argv = [
        "wrk",
        "-t1",
        f"-c{conns}",
        f"-d{duration:g}s",
        "--latency",
        "-s",
        str(script),
        f"http://{HOST}:{port}/",
    ]
    if cpu is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", str(cpu), *argv]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def parse_wrk(out: str) -> dict[str, Any]:
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non200 = re.search(r"NON200 (\d+)", out)
    errs = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m is None:
        raise RuntimeError(f"wrk said:\n{out}")
    return {
        "req_per_s": float(m.group(1)),
        "non_2xx": int(errs.group(1)) if errs else 0,
        "status_errors": int(non200.group(1)) if non200 else 0,
    }


def create_topics(port: int, topics: list[str]) -> None:
    import loadgen

    conn = loadgen.BlockingConn(HOST, port)
    for t in topics:
        status, out = conn.request(
            loadgen.build_request(HOST, port, f"/v0/topics/{t}", b'{"durability":"disk"}', "PUT")
        )
        if status not in (200, 201):
            raise RuntimeError(f"PUT {t}: {status} {out[:200]!r}")
    conn.close()


def scenario(n: int, args: argparse.Namespace, tmp: Path, rnd: int) -> dict[str, Any]:
    topics = [f"w{rnd}-{i}" for i in range(args.topics)]
    servers = []
    try:
        for k in range(n):
            d = tmp / f"s{n}-{rnd}-{k}"
            d.mkdir()
            s = http_core.topicd_server(d, args.topicd_src)
            s.start(cpu=k if n > 1 else 0)
            servers.append(s)
        shares = [[t for t in topics if owner(t, n) == k] for k in range(n)]
        procs = []
        for k, s in enumerate(servers):
            create_topics(s.port, shares[k])
            script = tmp / f"w-{n}-{rnd}-{k}.lua"
            lua_script(script, shares[k])
            # one process: wrk on the other CPU; two: each wrk shares its server's CPU
            cpu = 1 if n == 1 else None
            procs.append(wrk(s.port, script, args.conns // n, args.duration, cpu))
        outs = [p.communicate(timeout=args.duration + 60)[0] for p in procs]
        rows = [parse_wrk(o) for o in outs]
        return {
            "processes": n,
            "round": rnd,
            "req_per_s": sum(r["req_per_s"] for r in rows),
            "per_process": [r["req_per_s"] for r in rows],
            "non_2xx": sum(r["non_2xx"] for r in rows),
            "load_avg": os.getloadavg()[0],
        }
    finally:
        for s in servers:
            s.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--conns", type=int, default=64)
    p.add_argument("--topics", type=int, default=16)
    p.add_argument("--topicd-src", type=Path, default=http_core.REPO_DIR)
    args = p.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian package `wrk`): nothing to measure")
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="topicd-bench-2p-") as tmp:
        for r in range(args.repeat):
            order = (1, 2) if r % 2 == 0 else (2, 1)
            for n in order:
                row = scenario(n, args, Path(tmp), r)
                rows.append(row)
                print(orjson.dumps(row).decode(), flush=True)
    med = {
        n: statistics.median(x["req_per_s"] for x in rows if x["processes"] == n) for n in (1, 2)
    }
    ratio = med[2] / med[1] if med[1] else float("nan")
    print(f"\none process: {med[1]:,.0f} writes/s; two processes: {med[2]:,.0f} writes/s")
    print(f"two / one: {ratio:.2f} (no target on a 2-core machine)")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=args.topicd_src,
    ).stdout.strip()
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": http_core.machine_info(args.topicd_src),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "median_req_per_s": {str(k): v for k, v in med.items()},
        "ratio": ratio,
    }
    http_core.RESULTS_DIR.mkdir(exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    (http_core.RESULTS_DIR / f"two_process-{stamp}.json").write_bytes(
        orjson.dumps(out, option=orjson.OPT_INDENT_2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
