"""Every ```console block of README.md and docs/*.md runs, as printed, against a real server.

Method: each file gets its own `topicd serve` child on a fresh data directory and a free
port (`tests.crash.harness.serving`). The file's console blocks are read in order: a line
`$ curl ...` (continued by lines ending in `\\`) is a command, the lines after it up to
the next command are what it printed. A block with output before any command fails the
test (a reader must be able to type every step). Each curl command line is translated
into an httpx request (only the curl options the docs use: `-s`, `-i`, `-N`, `-X`, `-H`,
`-d`; the host must be `localhost:4000`), run, and what it printed is compared with the
text in the docs, after replacing the values that change from run to run: `$ts`,
`uptime_ms`, `last_*_ts`, `effective_priority`, the whole `performance` object, `wid_…`
ids, and the `date`, `content-length` and `x-topicd-pressure` header values. Everything
else must match exactly: fields and their order, seqs, counts, literals such as `21.40`,
status lines and header names (`-i`), SSE blocks.

`-N` (an SSE stream) opens the stream at once and reads it until its first `caught-up`
frame before the next command runs (the reader watches it catch up, then writes in
another terminal); after the file's last command the rest of the frames the docs show
are read, bounded by a deadline.

A `wid_…` printed in the docs maps to the one the server returned, so a later command
using the printed id reaches the real session. Snippets that are not meant to run go in
```sh, ```json or ```text blocks. `python tools/regen_console.py FILE...` rewrites the
outputs of a file's console blocks from a real run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import trio

from tests.crash.harness import Server, client, serving
from topicd.testing.sse import Frame, RawSseClient, SseParser

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
PRINTED_HOST = "localhost:4000"
DEADLINE_S = 15

_FENCE = re.compile(r"^```console\n(.*?)^```", re.M | re.S)
_WID = re.compile(r"wid_[A-Za-z0-9_-]{22}")
_VOLATILE = [
    (re.compile(r'"\$ts":\d+'), '"$ts":…'),
    (
        re.compile(r'"(uptime_ms|last_write_ts|last_read_ts|effective_priority)":(-?\d+|null)'),
        r'"\1":…',
    ),
    (re.compile(r'"performance":\{[^{}]*\}'), '"performance":{…}'),
    (_WID, "wid_…"),
    (re.compile(r"^(date|content-length|x-topicd-pressure): .*$", re.M), r"\1: …"),
]


def normalize(text: str) -> str:
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    return text


# --------------------------------------------------------------------------------------
# Reading the docs
# --------------------------------------------------------------------------------------


@dataclass
class Step:
    command: str
    expected: str
    where: str  # file:line, for messages


def console_steps(path: str) -> list[Step]:
    text = (ROOT / path).read_text("utf-8")
    steps: list[Step] = []
    for m in _FENCE.finditer(text):
        first_line = text.count("\n", 0, m.start(1)) + 1
        lines = m.group(1).split("\n")
        i = 0
        while i < len(lines):
            line = lines[i]
            where = f"{path}:{first_line + i}"
            if not line.startswith("$ "):
                assert not line.strip(), f"{where}: output without a command: {line!r}"
                i += 1
                continue
            command = line[2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            i += 1
            out: list[str] = []
            while i < len(lines) and not lines[i].startswith("$ "):
                out.append(lines[i])
                i += 1
            steps.append(Step(command, "\n".join(out).strip("\n"), where))
    return steps


@dataclass
class Curl:
    method: str
    path: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    data: str | None = None
    include: bool = False
    stream: bool = False


def parse_curl(command: str) -> Curl:
    argv = shlex.split(command)
    assert argv[0] == "curl", f"only curl commands run: {command!r}"
    method = url = data = None
    headers: list[tuple[str, str]] = []
    include = stream = False
    args = iter(argv[1:])
    for arg in args:
        if arg == "-X":
            method = next(args)
        elif arg == "-H":
            name, _, value = next(args).partition(":")
            headers.append((name.strip(), value.strip()))
        elif arg in ("-d", "--data"):
            data = next(args)
        elif arg.startswith("-") and set(arg[1:]) <= set("siN"):
            include = include or "i" in arg
            stream = stream or "N" in arg
        elif arg.startswith("-"):
            raise AssertionError(f"curl option {arg!r} is not translated: {command!r}")
        else:
            url = arg
    assert url is not None and url.startswith(PRINTED_HOST + "/"), command
    if data is not None and not any(k.lower() == "content-type" for k, _ in headers):
        headers.append(("Content-Type", "application/x-www-form-urlencoded"))  # as curl does
    return Curl(
        method or ("POST" if data is not None else "GET"),
        url[len(PRINTED_HOST) :],
        headers,
        data,
        include,
        stream,
    )


def test_console_steps_parse_commands_and_outputs():
    steps = console_steps("README.md")
    assert steps, "the README has a Quickstart of console blocks"
    for step in steps:
        parse_curl(step.command)  # every command is one the test can run


# --------------------------------------------------------------------------------------
# Running them
# --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a step's command printed on the real server, as curl would show it."""

    step: Step
    text: str


def render_head(response: httpx.Response) -> str:
    lines = [f"HTTP/1.1 {response.status_code} {response.reason_phrase}"]
    lines += [f"{k.decode()}: {v.decode()}" for k, v in response.headers.raw]
    return "\n".join(lines)


def render_frames(frames: list[Frame]) -> str:
    blocks = []
    for f in frames:
        lines = []
        if f.retry is not None:
            lines.append(f"retry: {f.retry}")
        if f.comment is not None:
            lines.append(f": {f.comment}")
        if f.id is not None:
            lines.append(f"id: {f.id}")
        if f.event is not None:
            lines.append(f"event: {f.event}")
        if f.raw_data is not None:
            lines.append(f"data: {f.raw_data}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


@dataclass
class _Stream:
    index: int  # of its outcome
    sse: RawSseClient
    want: int  # frames the docs show
    frames: list[Frame] = field(default_factory=list)


async def run_steps(
    steps: list[Step], server: Server, wids: dict[str, str] | None = None
) -> list[Outcome]:
    """Run `steps` in order against `server` (see the module docstring). `wids` collects
    each `wid_…` the docs print → the one the server returned."""
    wids = {} if wids is None else wids
    streams: list[_Stream] = []
    outcomes: list[Outcome] = []
    try:
        async with client(server) as http:
            for step in steps:
                command = step.command
                for printed, real in wids.items():
                    command = command.replace(printed, real)
                curl = parse_curl(command)
                if curl.stream:
                    want = len(SseParser().feed((step.expected + "\n\n").encode()))
                    sse = await RawSseClient.connect(
                        "127.0.0.1", server.port, curl.path, dict(curl.headers)
                    )
                    stream = _Stream(len(outcomes), sse, want)
                    streams.append(stream)
                    outcomes.append(Outcome(step, ""))
                    with trio.fail_after(DEADLINE_S):
                        await sse.read_head()
                        assert sse.status == 200, f"{step.where}: stream status {sse.status}"
                        stream.frames += await sse.read_until(lambda f: f.event == "caught-up")
                    continue
                with trio.fail_after(DEADLINE_S):
                    r = await http.request(
                        curl.method,
                        curl.path,
                        headers=curl.headers,
                        content=None if curl.data is None else curl.data.encode(),
                    )
                text = r.text
                if curl.include:
                    text = render_head(r) + "\n\n" + text
                outcomes.append(Outcome(step, text))
                for a, b in zip(_WID.findall(step.expected), _WID.findall(r.text), strict=False):
                    wids[a] = b
        for stream in streams:
            missing = stream.want - len(stream.frames)
            if missing > 0:
                with trio.fail_after(DEADLINE_S):
                    stream.frames += await stream.sse.read_frames(missing)
            outcomes[stream.index].text = render_frames(stream.frames)
    finally:
        for stream in streams:
            await stream.sse.aclose()
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize(
    "path", [p for p in DOC_FILES if _FENCE.search((ROOT / p).read_text("utf-8"))]
)
async def test_console_blocks_run_as_printed(path: str, tmp_path: Path):
    steps = console_steps(path)
    assert steps, f"{path}: a console block without a command"
    async with serving(tmp_path) as server:
        outcomes = await run_steps(steps, server)
        assert not server.run.problems(), server.log_tail()
    for o in outcomes:
        assert normalize(o.text) == normalize(o.step.expected), (
            f"{o.step.where}: `{o.step.command}` prints something else now "
            "(python tools/regen_console.py rewrites the outputs):\n"
            f"--- the docs:\n{o.step.expected}\n--- the server:\n{o.text}"
        )
