"""Real `topicd serve` children for crash tests, and reading a data directory back.

Method: `Server` owns one data directory and serves it with successive
`python -m topicd serve` children (cwd = the test's temporary directory, every inherited
`TOPICD_*` variable removed, 1 MiB WAL files, a checkpoint every second or MiB). A pump
task reads each child's stderr to EOF, so the child never blocks on a full pipe; readiness
is the stderr line containing `listening on`, waited for under `trio.fail_after`, never
with a sleep; the port comes from `TOPICD_PORT_FILE`. `serving()` kills every child on the
way out, whatever happened. Reads go through diff loops until `caught_up`, and payloads are
kept as raw JSON text (`msgspec.Raw`), never as parsed values.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import msgspec
import trio

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

TOPICD = [sys.executable, "-m", "topicd"]
READY_S = 30  # one start-up, recovery included
WAL_FILE_BYTES = 1 << 20
JSON = {"content-type": "application/json"}


# --------------------------------------------------------------------------------------
# The server process
# --------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Run:
    """One child process and everything it wrote to stderr."""

    proc: trio.Process
    text: str = ""
    waiters: dict[str, trio.Event] = field(default_factory=dict)

    def has_line(self, needle: str) -> bool:
        """Whether a complete stderr line containing `needle` arrived."""
        at = self.text.find(needle)
        return at >= 0 and "\n" in self.text[at:]

    async def pump(self) -> None:
        """Read stderr until EOF (so the child never blocks on a full pipe)."""
        stream = self.proc.stderr
        assert stream is not None
        async with stream:
            while data := await stream.receive_some(65536):
                self.text += data.decode("utf-8", "replace")
                for needle, ev in self.waiters.items():
                    if self.has_line(needle):
                        ev.set()
        for ev in self.waiters.values():
            ev.set()  # EOF: whoever waits finds out the line never came

    async def wait_line(self, needle: str) -> bool:
        """Wait for a stderr line containing `needle`; False if stderr closed first."""
        if not self.has_line(needle):
            await self.waiters.setdefault(needle, trio.Event()).wait()
        return self.has_line(needle)

    def problems(self) -> list[str]:
        """Log lines that must never appear in a crash test."""
        return [
            line
            for line in self.text.splitlines()
            if " ERROR " in line or "Traceback" in line or "CRITICAL" in line
        ]


class Server:
    """One data directory served by successive `topicd serve` children."""

    def __init__(self, nursery: trio.Nursery, workdir: Path) -> None:
        self.nursery = nursery
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.port_file = workdir / "port"
        self.runs: list[_Run] = []
        self.port = 0
        self.shards: list[int | None] = []  # WAL shard count per start (None: default)
        self.pick_shards: random.Random | None = None  # vary it per start when set
        self.extra_env: dict[str, str] = {}  # applied last, per start

    @property
    def run(self) -> _Run:
        return self.runs[-1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TOPICD_", "TOPICS_"))}
        env["TOPICD_PORT_FILE"] = str(self.port_file)
        env["TOPICD_STORAGE_WAL_FILE_BYTES"] = str(WAL_FILE_BYTES)
        # checkpoints (snapshot + WAL trim) every second or MiB, as storage spec §12 asks
        env["TOPICD_STORAGE_SNAPSHOT_INTERVAL_MS"] = "1000"
        env["TOPICD_STORAGE_SNAPSHOT_CHECK_INTERVAL_MS"] = "100"
        env["TOPICD_STORAGE_SNAPSHOT_WAL_BYTES_THRESHOLD"] = str(WAL_FILE_BYTES)
        env["TOPICD_SEGMENT_MAX_EVENTS"] = "50"  # segments seal (and drop) within a run
        # a payload cache of a few records: reads after each restart load evicted records
        # back from the segments
        env["TOPICD_STORAGE_PAYLOAD_CACHE_BYTES"] = "4096"
        shards = self.pick_shards.choice([1, 2, 3]) if self.pick_shards else None
        self.shards.append(shards)
        if shards is not None:
            env["TOPICD_WAL_SHARDS"] = str(shards)  # a change re-shards at start
        env.update(self.extra_env)
        return env

    async def spawn(self) -> _Run:
        """Start a child on the data directory (not waiting for anything)."""
        assert not self.runs or self.run.proc.returncode is not None
        self.port_file.unlink(missing_ok=True)
        proc = await trio.lowlevel.open_process(
            [
                *TOPICD,
                "serve",
                "--port",
                "0",
                "--data-dir",
                str(self.data_dir),
                "--log-level",
                "info",
            ],
            cwd=self.workdir,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        run = _Run(proc)
        self.runs.append(run)
        self.nursery.start_soon(run.pump)
        return run

    async def start(self) -> None:
        """Start a child; return once it logged `listening on` (recovery done, ready)."""
        run = await self.spawn()
        with trio.fail_after(READY_S):
            ready = await run.wait_line("listening on")
        if not ready:
            code = await run.proc.wait()
            raise AssertionError(f"topicd exited {code} before it was ready:\n{self.log_tail()}")
        self.port = int(self.port_file.read_text().strip())
        assert f":{self.port}" in run.text

    async def kill_during_startup(self, rng: random.Random) -> str:
        """Start a child and SIGKILL it at a random moment after it bound its port:
        during recovery, repair, re-shard or the FORMAT/BOOT_ID writes, or just after.
        Returns where the kill landed (for the log)."""
        run = await self.spawn()
        with trio.fail_after(READY_S):
            assert await run.wait_line("recovering"), self.log_tail()
        delay = rng.uniform(0, 0.06)
        await trio.sleep(delay)  # the kill moment is the point of the test
        stage = (
            "ready"
            if run.has_line("listening on")
            else ("after replay" if run.has_line("recovered ") else "in replay")
        )
        await self.kill()
        return f"{delay * 1000:.0f} ms after binding ({stage})"

    async def kill(self) -> None:
        """SIGKILL the running child (it must still be running: no crash of its own)."""
        proc = self.run.proc
        if proc.returncode is not None or proc.poll() is not None:
            raise AssertionError(
                f"topicd exited {proc.returncode} on its own before the kill:\n{self.run.text}"
            )
        proc.send_signal(signal.SIGKILL)
        with trio.fail_after(10):
            assert await proc.wait() == -signal.SIGKILL

    async def term_then_kill(self, delay: float) -> int | None:
        """SIGTERM (graceful drain, final checkpoint), then SIGKILL `delay` seconds later
        unless it exited by then. Returns the exit code, or None if it was killed."""
        proc = self.run.proc
        if proc.poll() is not None:
            raise AssertionError(f"topicd exited {proc.returncode} on its own:\n{self.log_tail()}")
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(delay):  # the kill moment is the point of the test
            code = await proc.wait()
            if code != 0:
                raise AssertionError(f"drain exited {code}:\n{self.log_tail()}")
            return code
        # the drain may finish just as the delay runs out: a clean exit then is no error
        proc.send_signal(signal.SIGKILL)
        with trio.fail_after(10):
            code = await proc.wait()
        if code == 0:
            return code
        assert code == -signal.SIGKILL, f"drain exited {code}:\n{self.log_tail()}"
        return None

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    async def close(self) -> None:
        for run in self.runs:
            if run.proc.returncode is None:
                run.proc.kill()
            await run.proc.wait()

    def log_tail(self, chars: int = 4000) -> str:
        text = "\n".join(
            f"--- run {i} (wal_shards {n}) ---\n{r.text}"
            for i, (r, n) in enumerate(zip(self.runs, self.shards, strict=False))
        )
        return text[-chars:]


@asynccontextmanager
async def serving(
    workdir: Path, shards: random.Random | None = None, env: dict[str, str] | None = None
) -> AsyncIterator[Server]:
    """A started `Server`; every child is killed on the way out, whatever happened."""
    async with trio.open_nursery() as nursery:
        server = Server(nursery, workdir)
        server.pick_shards = shards
        server.extra_env = dict(env or {})
        try:
            await server.start()
            yield server
        finally:
            with trio.CancelScope(shield=True):
                await server.close()


def client(server: Server) -> httpx.AsyncClient:
    """A keep-alive HTTP/1.1 client (one connection) for one task."""
    return httpx.AsyncClient(
        base_url=server.url,
        verify=False,  # plain HTTP; skips building a CA bundle (~150 ms per client)
        timeout=httpx.Timeout(20.0),
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
    )


# --------------------------------------------------------------------------------------
# Reading everything back
# --------------------------------------------------------------------------------------


class _Rec(msgspec.Struct):
    seq: int = msgspec.field(name="$seq")
    ts: int = msgspec.field(name="$ts")
    data: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""))
    tag: str | None = msgspec.field(default=None, name="$tag")


class _Tomb(msgspec.Struct):
    gap_from: int
    gap_to: int
    reason: str


class _Diff(msgspec.Struct):
    records: list[_Rec]
    next_from_seq: int
    head_seq: int
    caught_up: bool
    tombstone: _Tomb | None = None


_DIFF = msgspec.json.Decoder(_Diff)

Record = tuple[int, int, bytes, "str | None"]  # seq, ts, raw data, tag


@dataclass
class TopicDump:
    state: dict[str, object]  # head_seq, earliest_seq, next_seq, count, bytes, config
    records: list[Record]
    tombstones: list[tuple[int, int, str]]

    def key(self) -> tuple[object, ...]:
        return (sorted(self.state.items()), self.records, self.tombstones)


async def dump_topic(c: httpx.AsyncClient, name: str) -> TopicDump | None:
    """Everything readable on `name` (None if absent), via diff loops until caught up."""
    r = await c.get(f"/v0/topics/{name}", params={"touch": "false"})
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    s = r.json()
    state = {k: s[k] for k in ("head_seq", "earliest_seq", "next_seq", "count", "bytes")}
    state["config"] = json.dumps(s["config"], sort_keys=True)
    records: list[Record] = []
    tombs: list[tuple[int, int, str]] = []
    cursor = 0
    while s["head_seq"]:  # (a topic that never had a record has nothing to read)
        r = await c.post(
            f"/v0/topics/{name}/diff",
            json={"from_seq": cursor, "limit": 1000, "include_tags": True},
        )
        assert r.status_code == 200, r.text
        d = _DIFF.decode(r.content)
        records.extend((x.seq, x.ts, bytes(x.data), x.tag) for x in d.records)
        if d.tombstone is not None:
            t = d.tombstone
            tombs.append((t.gap_from, t.gap_to, t.reason))
        assert d.caught_up or d.next_from_seq > cursor, f"{name}: diff stuck at {cursor}"
        cursor = d.next_from_seq
        if d.caught_up:
            break
    return TopicDump(state, records, tombs)


async def dump_all(server: Server, names: list[str]) -> dict[str, TopicDump | None]:
    """`dump_topic` for every name, over four connections at once."""
    out: dict[str, TopicDump | None] = {}
    todo = iter(sorted(names))

    async def worker() -> None:
        async with client(server) as c:
            for name in todo:
                out[name] = await dump_topic(c, name)

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(worker)
    return {name: out[name] for name in sorted(names)}


async def list_topics(c: httpx.AsyncClient) -> list[str]:
    names: list[str] = []
    cursor = None
    while True:
        params: dict[str, str | int] = {"page_size": 1000}
        if cursor:
            params["cursor"] = cursor
        r = await c.get("/v0/topics", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        names.extend(t["topic"] for t in body["topics"])
        cursor = body.get("next_cursor")
        if not cursor:
            return names


def diff_dumps(a: dict[str, TopicDump | None], b: dict[str, TopicDump | None]) -> list[str]:
    out = []
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if (x is None) != (y is None) or (x is not None and y is not None and x.key() != y.key()):
            out.append(
                f"{name}: first restart {summary(x)} != second restart {summary(y)}"
                f"{first_difference(x, y)}"
            )
    return out


def summary(d: TopicDump | None) -> str:
    if d is None:
        return "absent"
    return f"{d.state} {len(d.records)} records, tombstones {d.tombstones}"


def first_difference(x: TopicDump | None, y: TopicDump | None) -> str:
    if x is None or y is None:
        return ""
    for i, (p, q) in enumerate(zip(x.records, y.records, strict=False)):
        if p != q:
            return f"; record #{i}: {p!r} vs {q!r}"
    return ""


def payload(pid: str, rng: random.Random) -> bytes:
    """Minified JSON whose literals a re-encoder would change (1.10, 1E+2, escapes)."""
    pad = "x" * rng.choice([0, 8, 40, 200, 800])
    return (
        '{"id":"' + pid + '","n":1.10,"big":123456789012345678901234567890,"e":1E+2,'
        '"z":-0.0,"s":"\\u00e9\\"q\\n\u00e9","pad":"' + pad + '"}'
    ).encode()
