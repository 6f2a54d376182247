#!/usr/bin/env python
"""The queue handlers' CPU per job, in process: no sockets, no head parse.

    python bench/queue_handlers.py [--rounds 5] [--batches 150]

An app on the in-memory engine (`open_app`) and one `queue` topic; per round, `batches`
times: one 100-job write, then claims of 8 and, after each, the fenced ack of what it
got, until the write's jobs are gone, each request through `Gate.serve_direct` (what the
direct socket path calls for a hot endpoint). The loop thread's CPU time
(`time.thread_time`) of the claims, the acks and the writes is divided by the jobs
acked; prints the median round as JSON (µs per job). For an A/B, run this file from
each checkout's directory in turn (`cd DIR && python PATH/bench/queue_handlers.py`):
the `topicd` of the current directory comes first on the path.

`--mock-clock` runs it under Trio's `MockClock` (time stands still: no timer of the
app's background tasks fires), with the garbage collector off, so the work per job is
the same from run to run: run under valgrind, the difference of the instruction counts
of `--batches 60` and `--batches 20` (one round each) over 4,000 jobs is the
instructions per job, a measure no other load on the machine moves:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python PATH/bench/queue_handlers.py --rounds 1 --batches 60 --mock-clock
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import trio
import trio.testing

sys.path.insert(0, str(Path.cwd()))

from topicd.testing.harness import open_app


def scope(path: bytes, body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path.decode(),
        "raw_path": path,
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"x"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "extensions": {},
        "state": {},
        "topicd.direct": True,
    }


async def main(rounds: int, batches: int) -> None:
    async with open_app() as h:
        gate: Any = h.app.asgi_app
        r = await h.app.test_client().put("/v0/topics/q", json={"type": "queue"})
        assert r.status_code in (200, 201), r.status_code
        write = orjson.dumps({"records": [{"data": {"job": i}} for i in range(100)]})
        claim = orjson.dumps({"node": "w1", "max": 8, "lease_ms": 60000})
        rows = []
        for _ in range(rounds):
            gc.collect()
            t_claim = t_ack = t_write = 0.0
            jobs = 0
            for _ in range(batches):
                t0 = time.thread_time()
                status, _, out = await gate.serve_direct(scope(b"/v0/topics/q", write), write)
                t_write += time.thread_time() - t0
                assert status == 200, out
                while True:
                    t0 = time.thread_time()
                    status, _, out = await gate.serve_direct(
                        scope(b"/v0/topics/q/claim", claim), claim
                    )
                    t_claim += time.thread_time() - t0
                    got = orjson.loads(out)["claimed"]
                    if not got:
                        break
                    ack = orjson.dumps(
                        {
                            "node": "w1",
                            "seqs": [j["$seq"] for j in got],
                            "lease_ids": [j["lease_id"] for j in got],
                        }
                    )
                    t0 = time.thread_time()
                    status, _, out = await gate.serve_direct(scope(b"/v0/topics/q/ack", ack), ack)
                    t_ack += time.thread_time() - t0
                    assert orjson.loads(out)["acked"] == len(got), out
                    jobs += len(got)
            per = [1e6 * t / jobs for t in (t_claim, t_ack, t_write)]
            rows.append({"claim": per[0], "ack": per[1], "write": per[2], "total": sum(per)})
        rows.sort(key=lambda row: row["total"])
        mid = rows[len(rows) // 2]
        print(orjson.dumps({k: round(v, 2) for k, v in mid.items()}).decode())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", type=int, default=150)
    p.add_argument("--mock-clock", action="store_true", help="MockClock, GC off (see above)")
    a = p.parse_args()
    if a.mock_clock:
        gc.disable()
    clock = trio.testing.MockClock() if a.mock_clock else None
    trio.run(main, a.rounds, a.batches, clock=clock)
