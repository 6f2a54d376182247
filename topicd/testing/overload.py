"""A closed-loop write flood for overload tests: `python -m topicd.testing.overload`.

    python -m topicd.testing.overload --port P --conns 128 --seconds 8 --topics 4

Each of `--conns` keep-alive HTTP/1.1 connections (raw asyncio sockets: a load generator
must cost the machine less than the server it loads) writes single records
`{"w": conn, "i": n}` to topic `ovl-<conn % topics>` back to back, **ignoring
`Retry-After`**: a `429`/`503` is followed at once by the next write. Every answer is
classified; the result is one JSON document on stdout:

* `status`: answers per HTTP status;
* `no_retry_after`: `429`/`503` answers without a `Retry-After` header;
* `causes`: `error.detail.cause` of the `429`s;
* `acked`: per topic, `[[seq, w, i], ...]` for every `2xx` (the caller reads them back);
* `errors`: transport errors and timeouts (a request that never got an answer within
  `--timeout` counts here: a timeout is a failure, never a success).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field


@dataclass
class Tally:
    status: dict[str, int] = field(default_factory=dict)
    no_retry_after: int = 0
    causes: dict[str, int] = field(default_factory=dict)
    acked: dict[str, list[list[int]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return status, headers, body


async def _conn(
    port: int, w: int, topics: int, deadline: float, answer_s: float, out: Tally
) -> None:
    topic = f"ovl-{w % topics}"
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), answer_s
        )
    except (OSError, TimeoutError) as exc:
        out.errors.append(f"connect {w}: {exc!r}")
        return
    i = 0
    try:
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            body = json.dumps({"records": [{"data": {"w": w, "i": i}}]}).encode()
            req = (
                f"POST /v0/topics/{topic} HTTP/1.1\r\nHost: x\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body
            writer.write(req)
            try:
                status, headers, payload = await asyncio.wait_for(_read_response(reader), answer_s)
            except (TimeoutError, asyncio.IncompleteReadError, OSError) as exc:
                out.errors.append(f"conn {w} write {i}: {exc!r}")
                return
            out.status[str(status)] = out.status.get(str(status), 0) + 1
            if 200 <= status < 300:
                seqs = json.loads(payload)["seqs"]
                out.acked.setdefault(topic, []).append([seqs[0], w, i])
            elif status in (429, 503):
                if "retry-after" not in headers:
                    out.no_retry_after += 1
                if status == 429:
                    cause = json.loads(payload)["error"]["detail"].get("cause", "pressure")
                    out.causes[cause] = out.causes.get(cause, 0) + 1
            i += 1
    finally:
        writer.close()


async def _main(args: argparse.Namespace) -> Tally:
    out = Tally()
    deadline = asyncio.get_running_loop().time() + args.seconds
    await asyncio.gather(
        *(_conn(args.port, w, args.topics, deadline, args.timeout, out) for w in range(args.conns))
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--conns", type=int, default=128)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--topics", type=int, default=4)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args(argv)
    json.dump(asdict(asyncio.run(_main(args))), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
