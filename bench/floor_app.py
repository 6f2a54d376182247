"""The framework floor for bench/http_core.py: quart-trio on Hypercorn's Trio worker, no engine.

    python bench/floor_app.py --port 0 --port-file PATH [--diff-body FILE]

Two routes, shaped like topicd's so that the floor costs exactly "framework + parse +
answer":

* `POST /v0/topics/<topic>` reads the body, parses it with orjson, advances a per-topic
  seq counter by the number of records and answers a JSON object with the same fields as
  topicd's write response (`seqs` included unless `?return_seqs=false`).
* `POST /v0/topics/<topic>/diff` reads and parses the (small) JSON body and answers a
  pre-built response (`--diff-body`, bytes sent as they are): 1000 records of the same
  shape and size as topicd's diff response, so no per-request encoding is done.

The Hypercorn settings mirror topicd's `daemon.hypercorn_config()` (no access log, no
server header, backlog 1024), and the process ends like topicd's start-up: `gc.freeze()`.
Prints "listening on" to stderr once bound, after writing the port to `--port-file`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
from functools import partial
from pathlib import Path

import hypercorn.trio
import orjson
import trio
from hypercorn.config import Config as HyperConfig
from quart import Response, request
from quart_trio import QuartTrio

_EMPTY_DIFF = b'{"topic":"x","records":[],"next_from_seq":0,"head_seq":0,"earliest_seq":1,'
_EMPTY_DIFF += b'"caught_up":true,"tombstone":null,"lag":0,"performance":{"server_total_ms":0.0}}'


def create_app(diff_body: bytes) -> QuartTrio:
    app = QuartTrio("floor")
    heads: dict[str, int] = {}

    @app.route("/v0/topics/<topic>", methods=["POST"])
    async def write(topic: str) -> Response:
        body = await request.get_data(cache=False)
        req = orjson.loads(body)
        count = len(req["records"])
        first = heads.get(topic, 0) + 1
        last = first + count - 1
        created = first == 1
        heads[topic] = last
        payload: dict[str, object] = {"topic": topic, "first_seq": first, "last_seq": last}
        if request.args.get("return_seqs") not in ("false", "0"):
            payload["seqs"] = list(range(first, last + 1))
        payload["head_seq"] = last
        payload["count"] = count
        payload["created"] = created
        payload["deduped"] = False
        payload["performance"] = {"server_total_ms": 0.0, "fsync_ms": 0.0}
        return Response(
            orjson.dumps(payload), 201 if created else 200, content_type="application/json"
        )

    @app.route("/v0/topics/<topic>/diff", methods=["POST"])
    async def diff(topic: str) -> Response:
        body = await request.get_data(cache=False)
        if body:
            orjson.loads(body)
        return Response(diff_body, 200, content_type="application/json")

    return app


async def _serve(port: int, port_file: str, diff_body: bytes) -> None:
    hc = HyperConfig()
    hc.bind = [f"127.0.0.1:{port}"]
    hc.backlog = 1024
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.include_server_header = False
    app = create_app(diff_body)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, app, hc))
        bound = int(binds[0].rsplit(":", 1)[1])
        if port_file:
            Path(port_file).write_text(f"{bound}\n")
        gc.collect()
        gc.freeze()
        print(f"floor listening on {', '.join(binds)}", file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", default="")
    p.add_argument("--diff-body", metavar="FILE", help="canned diff response (JSON bytes)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    diff_body = Path(args.diff_body).read_bytes() if args.diff_body else _EMPTY_DIFF
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(_serve, args.port, args.port_file, diff_body)


if __name__ == "__main__":
    main()
