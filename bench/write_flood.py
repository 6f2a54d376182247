#!/usr/bin/env python
"""A flood of single-record writes against one topicd, optionally under py-spy.

    python bench/write_flood.py [--conns 64] [--duration 10] [--durability disk]
                                [--profile OUT.txt] [--batch 1]

Starts `python -m topicd serve` (as bench/http_core.py does), PUTs the bench topic's
durability, then keeps `--conns` keep-alive connections each with one `POST
/v0/topics/:topic` in flight (bench/loadgen.py's closed loop) for `--duration` seconds
and prints requests/s and the server's CPU per request. With `--profile`, `py-spy record`
(not a project dependency: `pip install py-spy`) samples the server during the window
and writes collapsed stacks to the file, for splitting the per-request cost by stage
(docs/PERFORMANCE.md, "Request path").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_core  # a sibling module of this script
import loadgen

# Stages of a request, by frame: a sample belongs to the stage of the frame nearest its
# leaf that matches one of these (first match in this order), so callees not listed are
# charged to their caller's stage.
STAGES: tuple[tuple[str, str], ...] = (
    ("SocketStream.send_all", "socket write (send syscall + trio)"),
    ("send_answer", "socket write (send syscall + trio)"),
    ("SocketStream.receive_some", "socket read (recv + trio)"),
    ("_ready_bytes", "socket read (recv + trio)"),
    ("SegmentStore.", "checkpoint thread (segment absorb, snapshot)"),
    ("(segments.py", "checkpoint thread (segment absorb, snapshot)"),
    ("(snapshot.py", "checkpoint thread (segment absorb, snapshot)"),
    ("(checkpoint.py", "checkpoint thread (segment absorb, snapshot)"),
    ("Thread._bootstrap", "WAL thread (write + fdatasync)"),
    ("ThreadOffload.run", "WAL commit hop, loop side (to_thread, wake-ups)"),
    ("to_thread_run_sync", "WAL commit hop, loop side (to_thread, wake-ups)"),
    ("(topicd/storage/wal.py", "WAL shard task (batching, publish)"),
    ("(wal.py", "WAL shard task (batching, publish)"),  # (py-spy's short form)
    ("Completion.wait", "engine append (stage, commit wait)"),
    ("(topicd/engine/", "engine append (stage, commit wait)"),
    ("decode_write", "JSON decode/validate"),
    ("read_body", "body read + checks"),
    ("check_body", "body read + checks"),
    ("json_response", "response encode (payload, orjson)"),
    ("performance (topicd", "response encode (payload, orjson)"),
    ("write_records", "write handler (principal, query, payload)"),
    ("register.<locals>.write", "write handler (principal, query, payload)"),
    ("query_bool", "write handler (principal, query, payload)"),
    ("Gate.", "gate (admission, permits, pressure, access log)"),
    ("stream_scope", "head parse (h11 + ASGI scope)"),  # (before the head parser)
    ("parse_head", "head parse (topicd's parser + ASGI scope)"),
    ("early_refusal", "head parse (topicd's parser + ASGI scope)"),
    ("head_scope", "head parse (topicd's parser + ASGI scope)"),
    ("_read_head", "head read/sniff"),
    ("DirectExchange.", "direct exchange (ASGI send/receive, head render)"),
    ("_serve_plain", "direct exchange (ASGI send/receive, head render)"),
    ("Listener.", "keep-alive loop"),
    ("(quart", "Quart request/response machinery"),
    ("(werkzeug", "Quart request/response machinery"),
)
# ... and only when none of those is on the stack: Trio's own frames
FALLBACK: tuple[tuple[str, str], ...] = (("(trio/", "trio scheduler (epoll, task switches)"),)


def split(profile: Path) -> list[tuple[str, float]]:
    """(stage, share of samples) of py-spy's raw (collapsed) stacks."""
    shares: Counter[str] = Counter()
    for line in profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        stage = "other"
        frames = stack.split(";")
        for rules in (STAGES, FALLBACK):
            hit = next((name for f in reversed(frames) for key, name in rules if key in f), None)
            if hit is not None:
                stage = hit
                break
        shares[stage] += int(count)
    total = sum(shares.values()) or 1
    return [(stage, n / total) for stage, n in shares.most_common()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--conns", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--batch", type=int, default=1, help="records per request")
    p.add_argument("--durability", default="disk")
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--profile", type=Path, help="py-spy collapsed stacks of the server")
    p.add_argument("--rate", type=int, default=997, help="py-spy samples per second")
    p.add_argument(
        "--topicd-src",
        type=Path,
        default=http_core.REPO_DIR,
        metavar="DIR",
        help="directory holding the topicd package to run (its cwd), as in http_core.py",
    )
    args = p.parse_args()
    host = http_core.HOST
    with tempfile.TemporaryDirectory(prefix="topicd-flood-") as tmp:
        tmpdir = Path(tmp)
        env = dict(os.environ, TOPICD_PORT_FILE=str(tmpdir / "port"))
        argv = [sys.executable, "-m", "topicd", "serve", "--port", "0"]
        server = http_core.Server(
            "topicd",
            [*argv, "--data-dir", str(tmpdir / "data")],
            env,
            tmpdir / "port",
            args.topicd_src,
        )
        workers = http_core.Workers(args.client_procs, None)
        spy: subprocess.Popen[bytes] | None = None
        try:
            server.start()
            assert server.proc is not None
            conn = loadgen.BlockingConn(host, server.port)
            http_core.put_durability(conn, server.port, "flood", args.durability)
            conn.close()
            req = loadgen.build_request(
                host, server.port, "/v0/topics/flood", http_core.write_body(args.batch)
            )
            if args.profile is not None:
                py_spy = shutil.which("py-spy") or "py-spy"
                spy = subprocess.Popen(
                    [
                        py_spy,
                        "record",
                        "--pid",
                        str(server.proc.pid),
                        "--format",
                        "raw",
                        "--rate",
                        str(args.rate),
                        "--duration",
                        str(int(args.warmup + args.duration + 1)),
                        "--output",
                        str(args.profile),
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)  # py-spy attaches
            opts = SimpleNamespace(warmup=args.warmup, duration=args.duration)
            res = http_core.run_throughput(
                workers, server, lambda i: [req], "write", args.batch, args.conns, opts
            )
            print(
                f"c={args.conns} batch={args.batch} {args.durability}: "
                f"{res['req_per_s']:,.0f} req/s, {res['records_per_s']:,.0f} rec/s, "
                f"server CPU {res['server_cpu_pct']:.0f} % = "
                f"{1e6 * res['server_cpu_pct'] / 100 / max(res['req_per_s'], 1):.0f} µs/req, "
                f"errors {res['errors']} {res['first_error'] or ''}"
            )
            if spy is not None and args.profile is not None:
                spy.wait(60)
                for stage, share in split(args.profile):
                    print(f"{100 * share:5.1f} %  {stage}")
        finally:
            if spy is not None and spy.poll() is None:
                spy.terminate()
            workers.close()
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
