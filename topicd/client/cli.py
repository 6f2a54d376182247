"""The client subcommands of `topicd`: `write`, `tail` and `topics`.

They use `topicd.client.Client` (so retries, server hints and backpressure are the SDK's)
and share `--url` / `--token` (environment `TOPICD_URL` / `TOPICD_TOKEN`). Exit codes:
0 success, 1 a request failed after the client's retries or no connection could be made,
2 usage (bad arguments, or a `write` input line that is not a record object). Errors go to
stderr as `topicd: <code>: <message>`.

Standard output is written directly from the event loop: it is the command's only
product, so a reader that stops reading (a full pipe) rightly stops the command.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, cast

import msgspec
import trio

from topicd.client._client import DEFAULT_URL, Client
from topicd.client.backpressure import BackpressurePolicy
from topicd.client.errors import (
    BackpressureTimeout,
    ClientError,
    ConnectionFailed,
    ServerError,
    sole_error,
)
from topicd.client.models import Event, Record, Tombstone, TopicDeleted

if TYPE_CHECKING:
    import argparse
    import io
    from collections.abc import Callable, Coroutine

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

URL_ENV: Final = "TOPICD_URL"
TOKEN_ENV: Final = "TOPICD_TOKEN"
READ_CHUNK_BYTES: Final = 65536
MAX_LINE_BYTES: Final = 64 << 20  # a line longer than the server's body bound is an error


class _Line(msgspec.Struct):
    data: msgspec.Raw
    tag: str | None = None
    meta: msgspec.Raw = msgspec.Raw(b"")
    node: str | None = None
    priority: int | None = None


_LINE = msgspec.json.Decoder(_Line)


class UsageError(Exception):
    """Bad input: exit 2."""


def connection(args: argparse.Namespace) -> tuple[str, str | None]:
    """The server URL and token: the flag, else the environment, else the default."""
    url = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    token = args.token or os.environ.get(TOKEN_ENV) or None
    return url, token


def _client(args: argparse.Namespace) -> Client:
    url, token = connection(args)
    policy = BackpressurePolicy(max_retries=args.retries)
    return Client(url, token=token, policy=policy)


def _fail(code: str, message: str) -> None:
    sys.stderr.write(f"topicd: {code}: {message}\n")
    sys.stderr.flush()


def run(
    args: argparse.Namespace, main: Callable[[argparse.Namespace], Coroutine[object, object, int]]
) -> int:
    """Run one client subcommand and map its outcome to an exit code."""
    try:
        try:
            return trio.run(main, args)
        except BaseExceptionGroup as group:  # `write` runs a reader and a writer task
            sole = sole_error(group)
            if sole is not None:
                raise sole from None
            interrupt, rest = group.split(KeyboardInterrupt)
            if interrupt is not None and rest is None:
                raise KeyboardInterrupt from None
            raise
    except UsageError as exc:
        _fail("invalid_input", str(exc))
        return EXIT_USAGE
    except ServerError as exc:
        _fail(exc.code, exc.message)
        return EXIT_FAILED
    except ConnectionFailed as exc:
        _fail("connection_failed", str(exc))
        return EXIT_FAILED
    except BackpressureTimeout as exc:
        _fail("backpressure_timeout", str(exc))
        return EXIT_FAILED
    except ClientError as exc:
        _fail("client_error", str(exc))
        return EXIT_FAILED
    except BrokenPipeError:
        return EXIT_OK  # `topicd tail t | head`: the reader had enough
    except KeyboardInterrupt:
        return EXIT_OK if getattr(args, "follow", False) else EXIT_FAILED


# ---- topicd write ---------------------------------------------------------------------


def parse_line(line: bytes, number: int) -> dict[str, object]:
    """One input line as a write record (`data` kept as its exact JSON text)."""
    try:
        rec = _LINE.decode(line)
    except msgspec.ValidationError as exc:
        raise UsageError(f"line {number}: not a record object ({exc})") from None
    except msgspec.DecodeError as exc:
        raise UsageError(f"line {number}: not JSON ({exc})") from None
    out: dict[str, object] = {"data": rec.data}
    if rec.tag is not None:
        out["tag"] = rec.tag
    if bytes(rec.meta):
        out["meta"] = rec.meta
    if rec.node is not None:
        out["node"] = rec.node
    if rec.priority is not None:
        out["priority"] = rec.priority
    return out


@dataclass
class _WriteTotals:
    records: int = 0
    batches: int = 0
    first_seq: int | None = None
    last_seq: int | None = None


async def write_main(args: argparse.Namespace) -> int:
    """`topicd write TOPIC`: records from stdin, batched, each batch one write with its
    own idempotency key (so the client's retries never append twice)."""
    if args.batch < 1:
        raise UsageError("--batch must be at least 1")
    totals = _WriteTotals()
    send, receive = trio.open_memory_channel[dict[str, object]](args.batch)
    problem: list[UsageError] = []

    stdin = cast("io.BufferedReader", sys.stdin.buffer)

    async def reader() -> None:
        buf = b""
        number = 0
        async with send:
            while True:
                chunk = await trio.to_thread.run_sync(stdin.read1, READ_CHUNK_BYTES)
                lines = (buf + chunk).split(b"\n")
                buf = lines.pop() if chunk else b""
                if len(buf) > MAX_LINE_BYTES:
                    problem.append(
                        UsageError(f"line {number + 1}: longer than {MAX_LINE_BYTES} bytes")
                    )
                    return
                for line in lines:
                    number += 1
                    if not line.strip():
                        continue
                    try:
                        rec = parse_line(line, number)
                    except UsageError as exc:
                        problem.append(exc)
                        return
                    await send.send(rec)
                if not chunk:
                    return

    async def writer(client: Client) -> None:
        linger_s = args.linger_ms / 1000
        async with receive:
            while True:
                try:
                    batch = [await receive.receive()]
                except trio.EndOfChannel:
                    return
                while len(batch) < args.batch:
                    with trio.move_on_after(linger_s) as scope:
                        try:
                            batch.append(await receive.receive())
                        except trio.EndOfChannel:
                            break
                    if scope.cancelled_caught:
                        break
                res = await client.write_batch(args.topic, batch)
                totals.records += res.count
                totals.batches += 1
                if totals.first_seq is None:
                    totals.first_seq = res.first_seq
                totals.last_seq = res.last_seq

    async with _client(args) as client, trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        nursery.start_soon(writer, client)
    summary: dict[str, object] = {
        "topic": args.topic,
        "records": totals.records,
        "batches": totals.batches,
    }
    if totals.first_seq is not None:
        summary["first_seq"] = totals.first_seq
        summary["last_seq"] = totals.last_seq
    sys.stdout.buffer.write(msgspec.json.encode(summary) + b"\n")
    sys.stdout.flush()
    if problem:
        raise problem[0]
    return EXIT_OK


# ---- topicd tail ----------------------------------------------------------------------


def _emit(event: Event, *, flush: bool) -> None:
    if isinstance(event, Record):
        sys.stdout.buffer.write(event.json() + b"\n")
        if flush:
            sys.stdout.flush()
    elif isinstance(event, Tombstone):
        sys.stdout.flush()
        sys.stderr.buffer.write(event.json() + b"\n")
        sys.stderr.flush()
    elif isinstance(event, TopicDeleted):
        sys.stdout.flush()
        sys.stderr.buffer.write(
            msgspec.json.encode({"topic": event.topic, "deleted": True}) + b"\n"
        )
        sys.stderr.flush()


async def tail_main(args: argparse.Namespace) -> int:
    """`topicd tail [-f] TOPIC...`: each topic's records from `--from-seq` up to its head
    (a diff), then with `-f` every new record live (a watch starting exactly where the
    diffs stopped). Records on stdout, one JSON object per line; tombstones on stderr."""
    async with _client(args) as client:
        cursors: dict[str, int] = {}
        for topic in dict.fromkeys(args.topics):
            reader = client.diff(topic, args.from_seq, include_tags=True)
            async for event in reader:
                _emit(event, flush=False)
            cursors[topic] = reader.cursor
        sys.stdout.flush()
        if not args.follow:
            return EXIT_OK
        async with client.watch(dict(cursors), include_tags=True) as stream:
            async for event in stream:
                _emit(event, flush=True)
    return EXIT_OK


# ---- topicd topics --------------------------------------------------------------------


async def topics_main(args: argparse.Namespace) -> int:
    """`topicd topics`: every topic with its record count and watermarks."""
    async with _client(args) as client:
        items = await client.list_topics(args.prefix)
    out = sys.stdout
    if args.json:
        for item in items:
            out.buffer.write(msgspec.json.encode(item) + b"\n")
        out.flush()
        return EXIT_OK
    columns = ("topic", "count", "bytes", "head_seq", "earliest_seq")
    rows = [[str(item.get(c, "")) for c in columns] for item in items]
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    for row in [[c.upper() for c in columns], *rows]:
        cells = [row[0].ljust(widths[0])] + [
            v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)
        ]
        out.write("  ".join(cells).rstrip() + "\n")
    out.flush()
    return EXIT_OK
