"""The real `topicd` command in a subprocess (api-ops §5.1, §6; README §2.6).

Method: every test runs `python -m topicd ...` with `cwd` a fresh temporary directory and
an environment stripped of every `TOPICD_*` / `TOPICS_*` variable, so neither the
developer's shell nor the repository's `conf/topicd.toml` leaks in. One-shot commands use
`subprocess.run` with a timeout; tables of independent cases run concurrently (`run_many`)
and report every wrong case at once. `serve` runs under Trio: readiness is the stderr line
containing `listening on` (read with an overall `trio.fail_after`, never a sleep), the
port comes from that line or from the port file, HTTP goes through httpx, and the child
is killed in `finally` whatever happens.

The drain tests hold the drain open deterministically with a raw HTTP/1.1 request that
sends `Expect: 100-continue` and withholds its body: hypercorn answers `100 Continue` once
the request has reached the app, so after that reply the request is provably in flight
and the handler is parked reading the body (a diff long-poll would not do: it returns at
once when draining starts). With that request open:

- SIGINT, then the body: the request completes `201` and the process exits `0` well
  before `drain_timeout_ms` (20 s);
- SIGINT, then SIGTERM: the second signal exits `1` at once (api-ops §6.2), asserted
  exactly, since a clean `0` would need the 20 s drain deadline;
- SIGTERM with `drain_timeout_ms = 300`: the drain deadline ends it with exit `0`.

A start that fails leaves no trace: a port already taken (held by a plain socket of this
test) exits 1 naming the address, and a data directory that did not exist is still absent
(it is created only once the listener is bound); a second server on a directory exits 5
and the directory's `tree_state` is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tomllib
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

import topicd
from tests.server.helpers import tree_state

REPO = Path(__file__).resolve().parents[2]
TOPICD = [sys.executable, "-m", "topicd"]
LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")
DEADLINE_S = 15

pytestmark = pytest.mark.slow


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TOPICD_", "TOPICS_"))}
    clean.update(env or {})
    return clean


def run(cwd: Path, *args: str, env=None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TOPICD, *args],
        cwd=cwd,
        env=child_env(env),
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )


def run_many(cwd: Path, calls) -> list[subprocess.CompletedProcess]:
    """Run several one-shot commands `(args, env)` at once; results in call order."""
    procs: list[subprocess.Popen] = []
    try:
        for args, env in calls:
            procs.append(
                subprocess.Popen(
                    [*TOPICD, *args],
                    cwd=cwd,
                    env=child_env(env),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = []
        for p in procs:
            out, err = p.communicate(timeout=DEADLINE_S)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def printed(cwd: Path, *args: str, env=None) -> dict:
    """The effective config of `check-config --print`, parsed."""
    r = run(cwd, "check-config", "--print", *args, env=env)
    assert r.returncode == 0, r.stderr
    return tomllib.loads(r.stdout)


# --------------------------------------------------------------------------------------
# One-shot commands
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arg", ["version", "--version"])
def test_version(tmp_path, arg):
    r = run(tmp_path, arg)
    assert r.returncode == 0
    assert r.stdout == f"topicd {topicd.__version__}\n"


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["serve", "--port", "abc"]])
def test_usage_error_exits_2(tmp_path, args):
    assert run(tmp_path, *args).returncode == 2


def test_print_default_config_is_the_committed_file(tmp_path):
    r = subprocess.run(
        [*TOPICD, "print-default-config"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert r.returncode == 0
    assert r.stdout == (REPO / "conf" / "topicd.toml").read_bytes()


def test_committed_file_loads_as_the_defaults(tmp_path):
    assert printed(tmp_path, "--config", str(REPO / "conf" / "topicd.toml")) == printed(tmp_path)


def test_check_config_ok_without_any_config(tmp_path):
    r = run(tmp_path, "check-config")
    assert r.returncode == 0
    assert r.stdout.splitlines() == [
        "no configuration file (no --config, $TOPICD_CONFIG unset, no ./conf/topicd.toml): "
        "built-in defaults and the environment",
        "configuration OK (0 keys, dev mode)",
    ]
    assert r.stderr == ""


def test_no_config_at_all_means_loopback_4000(tmp_path):
    cfg = printed(tmp_path)
    assert cfg["server"]["host"] == "127.0.0.1"
    assert cfg["server"]["port"] == 4000
    assert cfg["storage"]["data_dir"] == "./topicd-data"


def test_check_config_print_redacts_secrets(tmp_path):
    r = run(tmp_path, "check-config", "--print", env={"TOPICD_API_KEYS": "s3cret:rw"})
    assert r.returncode == 0, r.stderr
    assert "s3cret" not in r.stdout
    assert "s3cret" not in r.stderr
    assert len(tomllib.loads(r.stdout)["auth"]["api_keys"]) == 1


def test_check_config_file_resolution(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "topicd.toml").write_text("[server]\nport = 4001\n")
    (tmp_path / "env.toml").write_text("[server]\nport = 4002\n")
    (tmp_path / "flag.toml").write_text("[server]\nport = 4003\n")
    assert printed(tmp_path)["server"]["port"] == 4001
    env = {"TOPICD_CONFIG": str(tmp_path / "env.toml")}
    assert printed(tmp_path, env=env)["server"]["port"] == 4002
    assert printed(tmp_path, "--config", "flag.toml", env=env)["server"]["port"] == 4003


def test_check_config_names_the_file_it_loaded(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "topicd.toml").write_text("[server]\nport = 4001\n")
    (tmp_path / "env.toml").write_text("")
    (tmp_path / "flag.toml").write_text("")
    env = {"TOPICD_CONFIG": str(tmp_path / "env.toml")}
    implicit, by_env, by_flag, printing = run_many(
        tmp_path,
        [
            (["check-config"], {}),
            (["check-config"], env),
            (["check-config", "--config", "flag.toml"], env),
            (["check-config", "--print"], {}),
        ],
    )
    found = tmp_path / "conf" / "topicd.toml"
    assert implicit.stdout.splitlines()[0] == (
        f"configuration file {found} (from ./conf/topicd.toml in the working directory), "
        "then the environment"
    )
    assert by_env.stdout.splitlines()[0] == (
        f"configuration file {tmp_path / 'env.toml'} (from $TOPICD_CONFIG), then the environment"
    )
    assert by_flag.stdout.splitlines()[0] == (
        f"configuration file {tmp_path / 'flag.toml'} (from --config), then the environment"
    )
    # with --print the line is a TOML comment: the output still parses
    assert printing.stdout.startswith(f"# configuration file {found} ")
    assert tomllib.loads(printing.stdout)["server"]["port"] == 4001


SERVE_FLAGS = {
    "--config": "./conf/topicd.toml",
    "--host": "127.0.0.1",
    "--port": "4000",
    "--data-dir": "./topicd-data",
    "--log-level": "info",
    "--recovery-on-corruption": "refuse",
}


def test_serve_help_documents_every_flag_with_its_default(tmp_path):
    r = run(tmp_path, "serve", "--help", env={"COLUMNS": "1000"})  # no wrapped help text
    assert r.returncode == 0, r.stderr
    helps: dict[str, str] = {}
    flag = ""
    for line in r.stdout.split("\noptions:\n", 1)[1].split("\n\n", 1)[0].splitlines():
        if line.startswith("  -"):  # a flag; its help follows on this line or the next
            flag = line.split()[0].rstrip(",")
        helps[flag] = helps.get(flag, "") + line
    assert set(helps) == {"-h", *SERVE_FLAGS}
    wrong = {
        flag: helps[flag]
        for flag, default in SERVE_FLAGS.items()
        if "(default: " not in helps[flag] or default not in helps[flag]
    }
    assert wrong == {}
    assert "exit codes:" in r.stdout


def test_legacy_topics_port_alias(tmp_path):
    assert printed(tmp_path, env={"TOPICS_PORT": "4567"})["server"]["port"] == 4567
    both = {"TOPICS_PORT": "4567", "TOPICD_PORT": "4568"}
    assert printed(tmp_path, env=both)["server"]["port"] == 4568
    toml = tmp_path / "c.toml"
    toml.write_text("[server]\nport = 4569\n")
    assert (
        printed(tmp_path, "--config", str(toml), env={"TOPICS_PORT": "4567"})["server"]["port"]
        == 4567
    )


CHECK_CONFIG_ERRORS = [
    ("[server]\nport = 70000\n", {}, "server.port"),
    ("[server]\nbogus = 1\n", {}, "server.bogus"),
    ("[limits]\nmax_topics = true\n", {}, "limits.max_topics"),
    ("", {"TOPICD_PORT": "abc"}, "server.port"),
    ("", {"TOPICD_HTTP2": "maybe"}, "server.http2"),
    ("", {"TOPICD_LOG": "loud"}, "logging.level"),
    ("", {"TOPICD_API_KEYS": "k:superuser"}, "auth.api_keys[0]"),
    ("", {"TOPICD_API_KEYS": "k:r,k:w"}, "duplicate"),
    ('[[auth.key]]\nsha256 = "abc"\n', {}, "auth.key[0].sha256"),
]


def test_check_config_bad_value_exits_2(tmp_path):
    calls = []
    for i, (toml, env, _) in enumerate(CHECK_CONFIG_ERRORS):
        (tmp_path / f"c{i}.toml").write_text(toml)
        calls.append((["check-config", "--config", f"c{i}.toml"], env))
    results = run_many(tmp_path, calls)
    wrong = [
        (case, r.returncode, r.stderr)
        for case, r in zip(CHECK_CONFIG_ERRORS, results, strict=True)
        if r.returncode != 2 or case[2] not in r.stderr or r.stdout
    ]
    assert wrong == []


def test_check_config_missing_file_exits_2(tmp_path):
    r = run(tmp_path, "check-config", "--config", "absent.toml")
    assert r.returncode == 2
    assert "absent.toml" in r.stderr


def test_check_config_warns_on_changed_protocol_limit(tmp_path):
    r = run(tmp_path, "check-config", env={"TOPICD_MAX_LIMIT": "500"})
    assert r.returncode == 0
    assert "protocol.max_limit" in r.stderr


def test_check_config_rejects_a_data_dir_that_is_a_file(tmp_path):
    # api-ops §6: check-config validates "directory paths"; serve could never use this one.
    (tmp_path / "plain-file").write_text("x")
    r = run(tmp_path, "check-config", env={"TOPICD_DATA_DIR": "plain-file"})
    assert r.returncode == 2
    assert "storage.data_dir" in r.stderr


NON_LOOPBACK = [{"TOPICD_HOST": "0.0.0.0"}, {"TOPICD_HOST": "[::]:4000"}, {"TOPICS_HOST": "::"}]


def test_no_auth_guard(tmp_path):
    refused = run_many(tmp_path, [(["check-config"], env) for env in NON_LOOPBACK])
    assert [r.returncode for r in refused] == [3, 3, 3]
    lifted = run_many(
        tmp_path,
        [(["check-config"], {**env, "TOPICD_ALLOW_INSECURE_NO_AUTH": "1"}) for env in NON_LOOPBACK]
        + [(["check-config"], {**env, "TOPICD_API_KEYS": "k"}) for env in NON_LOOPBACK],
    )
    assert [r.returncode for r in lifted] == [0] * 6
    assert all("allow_insecure_no_auth" in r.stderr for r in lifted[:3])


def test_loopback_without_keys_is_dev_mode(tmp_path):
    hosts = ["127.0.0.1", "::1", "[::1]:4000", "localhost", "127.0.0.5:4000"]
    results = run_many(tmp_path, [(["check-config"], {"TOPICD_HOST": h}) for h in hosts])
    wrong = [
        (h, r.returncode, r.stdout + r.stderr)
        for h, r in zip(hosts, results, strict=True)
        if r.returncode != 0 or "dev mode" not in r.stdout
    ]
    assert wrong == []


def test_hash_key(tmp_path):
    r = run(tmp_path, "hash-key", stdin="s3cret\n")
    assert r.returncode == 0
    digest = r.stdout.strip()
    assert digest == hashlib.sha256(b"s3cret").hexdigest()
    assert "s3cret" not in r.stdout + r.stderr
    # The digest is what [[auth.key]] takes.
    (tmp_path / "c.toml").write_text(f'[[auth.key]]\nsha256 = "{digest}"\n')
    r = run(tmp_path, "check-config", "--config", "c.toml")
    assert r.returncode == 0
    assert "1 keys" in r.stdout


@pytest.mark.parametrize("stdin", ["a:b\n", "\n", ""])
def test_hash_key_rejects_unusable_secret(tmp_path, stdin):
    assert run(tmp_path, "hash-key", stdin=stdin).returncode == 2


# --------------------------------------------------------------------------------------
# serve: refusals before binding
# --------------------------------------------------------------------------------------


SERVE_CONFIG_ERRORS = [
    (["--config", "c.toml"], {}, "server.bogus"),
    ([], {"TOPICD_PORT": "abc"}, "server.port"),
    ([], {"TOPICD_API_KEYS": "k:rwx"}, "auth.api_keys[0]"),
    (["--log-level", "loud"], {}, "logging.level"),
]

SERVE_NON_LOOPBACK = [
    (["--host", "0.0.0.0"], {}),
    (["--host", "::"], {}),
    ([], {"TOPICD_HOST": "0.0.0.0"}),
    ([], {"TOPICS_HOST": "[::]:0"}),
]


def test_serve_bad_config_exits_2(tmp_path):
    (tmp_path / "c.toml").write_text("[server]\nbogus = 1\n")
    serve = ["serve", "--port", "0", "--data-dir", "d"]
    results = run_many(tmp_path, [([*serve, *args], env) for args, env, _ in SERVE_CONFIG_ERRORS])
    wrong = [
        (case, r.returncode, r.stderr)
        for case, r in zip(SERVE_CONFIG_ERRORS, results, strict=True)
        if r.returncode != 2 or case[2] not in r.stderr
    ]
    assert wrong == []
    assert not (tmp_path / "d").exists()


def test_serve_non_loopback_without_keys_exits_3(tmp_path):
    serve = ["serve", "--port", "0", "--data-dir", "d"]
    results = run_many(tmp_path, [([*serve, *args], env) for args, env in SERVE_NON_LOOPBACK])
    wrong = [
        (case, r.returncode, r.stderr)
        for case, r in zip(SERVE_NON_LOOPBACK, results, strict=True)
        if r.returncode != 3 or "not loopback" not in r.stderr
    ]
    assert wrong == []
    assert not (tmp_path / "d").exists()


# --------------------------------------------------------------------------------------
# serve: running processes
# --------------------------------------------------------------------------------------


class Child:
    """A running `topicd serve` whose stderr is read line by line."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.stderr = ""
        self._seen = 0  # stderr offset already matched by wait_for

    async def wait_for(self, needle: str) -> str:
        """The next complete stderr line containing `needle`; fails if stderr closes first."""
        assert self.proc.stderr is not None
        while True:
            end = self.stderr.rfind("\n") + 1
            lines = self.stderr[self._seen : end].splitlines(keepends=True)
            for line in lines:
                self._seen += len(line)
                if needle in line:
                    return line
            data = await self.proc.stderr.receive_some(65536)
            if not data:
                raise AssertionError(f"stderr closed before {needle!r}:\n{self.stderr}")
            self.stderr += data.decode("utf-8", "replace")

    async def port(self) -> int:
        m = LISTENING.search(await self.wait_for("listening on"))
        assert m is not None
        return int(m.group(1))

    async def exit_code(self) -> int:
        """Wait for exit, collecting the rest of stderr."""
        assert self.proc.stderr is not None
        while data := await self.proc.stderr.receive_some(65536):
            self.stderr += data.decode("utf-8", "replace")
        return await self.proc.wait()


@asynccontextmanager
async def serving(cwd: Path, *args: str, env=None):
    proc = await trio.lowlevel.open_process(
        [*TOPICD, "serve", *args],
        cwd=cwd,
        env=child_env(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield Child(proc)
    finally:
        with trio.CancelScope(shield=True):
            if proc.poll() is None:
                proc.kill()
            await proc.wait()
            if proc.stderr is not None:
                await proc.stderr.aclose()


async def get_json(port: int, path: str) -> tuple[int, dict]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        r = await client.get(path)
        return r.status_code, r.json()


async def test_serve_port_file_health_and_sigterm(tmp_path):
    with trio.fail_after(DEADLINE_S):
        env = {"TOPICD_PORT_FILE": str(tmp_path / "port")}
        async with serving(tmp_path, "--port", "0", "--data-dir", "d", env=env) as child:
            port = await child.port()
            assert port != 4000
            assert (tmp_path / "port").read_text().strip() == str(port)
            status, body = await get_json(port, "/v0/health")
            assert status == 200
            assert body["status"] == "ok"
            assert body["version"] == topicd.__version__
            status, body = await get_json(port, "/v0/ready")
            assert (status, body["status"]) == (200, "ready")
            child.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                assert await child.exit_code() == 0


async def test_serve_legacy_environment(tmp_path):
    with trio.fail_after(DEADLINE_S):
        env = {
            "TOPICS_PORT": "0",
            "TOPICS_PORT_FILE": str(tmp_path / "port"),
            "TOPICS_DATA_DIR": "legacy-data",
        }
        async with serving(tmp_path, env=env) as child:
            port = await child.port()
            assert port != 4000
            assert (tmp_path / "port").read_text().strip() == str(port)
            assert (tmp_path / "legacy-data").is_dir()
            assert (await get_json(port, "/v0/health"))[0] == 200
            child.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                assert await child.exit_code() == 0


async def test_second_server_on_same_data_dir_exits_5(tmp_path):
    with trio.fail_after(DEADLINE_S):
        async with serving(tmp_path, "--port", "0", "--data-dir", "shared") as first:
            port = await first.port()
            before = tree_state(tmp_path / "shared")  # an idle server writes nothing
            second = await trio.run_process(
                [*TOPICD, "serve", "--port", "0", "--data-dir", "shared"],
                cwd=tmp_path,
                env=child_env(),
                stdin=b"",
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert second.returncode == 5
            assert b"locked" in second.stderr
            assert tree_state(tmp_path / "shared") == before
            assert (await get_json(port, "/v0/health"))[0] == 200
            first.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                assert await first.exit_code() == 0


def test_a_start_that_cannot_bind_names_the_address_and_creates_nothing(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"TOPICD_PORT_FILE": str(tmp_path / "port")}
        r = run(tmp_path, "serve", "--port", str(port), "--data-dir", "new/data", env=env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"topicd: cannot bind 127.0.0.1:{port}: address already in use"
    )
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no data dir, no port file


async def test_a_directory_with_an_earlier_versions_lock_file_still_opens(tmp_path):
    """Earlier versions kept `.topicd.lock` (holding a pid) in the data directory; such a
    directory starts as before, and the file is left exactly as it was."""
    with trio.fail_after(DEADLINE_S):
        for start in range(2):
            async with serving(tmp_path, "--port", "0", "--data-dir", "d") as child:
                port = await child.port()
                assert (await get_json(port, "/v0/ready"))[0] == 200
                child.proc.send_signal(signal.SIGTERM)
                assert await child.exit_code() == 0, child.stderr
            if start == 0:
                assert not (tmp_path / "d" / ".topicd.lock").exists()
                (tmp_path / "d" / ".topicd.lock").write_text("4242\n")
                before = (tmp_path / "d" / ".topicd.lock").stat()
    after = (tmp_path / "d" / ".topicd.lock").stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert (tmp_path / "d" / ".topicd.lock").read_text() == "4242\n"


async def test_serve_with_keys_never_logs_secrets(tmp_path):
    env = {"TOPICD_API_KEYS": "s3cret:rw", "TOPICD_ACCESS_LOG": "1", "TOPICD_LOG": "debug"}
    with trio.fail_after(DEADLINE_S):
        async with serving(tmp_path, "--port", "0", "--data-dir", "d", env=env) as child:
            port = await child.port()
            assert "1 keys" in child.stderr
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                assert (await client.get("/v0/health")).status_code == 200
                assert (await client.get("/v0/topics")).status_code == 401
                good = {"Authorization": "Bearer s3cret"}
                assert (await client.get("/v0/topics", headers=good)).status_code == 200
                bad = {"Authorization": "Bearer s3cretx"}
                assert (await client.get("/v0/topics", headers=bad)).status_code == 401
                r = await client.get("/v0/topics", params={"token": "s3cret"})
                assert r.status_code == 401  # ?token is for the SSE GETs only
            child.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                assert await child.exit_code() == 0
    assert "GET /v0/topics 401" in child.stderr  # the access log is on
    assert "s3cret" not in child.stderr


async def test_json_log_format_and_per_logger_filters(tmp_path):
    # warn overall, info for topicd: the listening line stays, hypercorn's banner goes.
    env = {"TOPICD_LOG_FORMAT": "json", "TOPICD_LOG": "warn,topicd=info"}
    with trio.fail_after(DEADLINE_S):
        async with serving(tmp_path, "--port", "0", "--data-dir", "d", env=env) as child:
            await child.port()
            child.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                assert await child.exit_code() == 0
    lines = [json.loads(line) for line in child.stderr.splitlines()]
    listening = [obj for obj in lines if "listening on" in obj["msg"]]
    assert len(listening) == 1
    assert (listening[0]["level"], listening[0]["logger"]) == ("info", "topicd")
    assert all(obj["logger"].startswith("topicd") for obj in lines), lines


async def test_incomplete_request_head_is_dropped(tmp_path):
    env = {"TOPICD_HEADER_READ_TIMEOUT_MS": "200"}
    with trio.fail_after(DEADLINE_S):
        async with serving(tmp_path, "--port", "0", "--data-dir", "d", env=env) as child:
            stream = await trio.open_tcp_stream("127.0.0.1", await child.port())
            await stream.send_all(b"GET /v0/health HTTP/1.1\r\nHost: x\r\n")
            with trio.fail_after(5):
                while await stream.receive_some(65536):
                    pass  # whatever the server says, it must then close
            await stream.aclose()


# --------------------------------------------------------------------------------------
# serve: drain and signals
# --------------------------------------------------------------------------------------

RECORDS = json.dumps({"records": [{"data": {"n": 1}}]}).encode()


async def held_request(port: int) -> trio.SocketStream:
    """A write whose body is withheld; returns once the app has the request in flight."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(
        b"POST /v0/topics/held HTTP/1.1\r\n"
        b"Host: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        b"Expect: 100-continue\r\n"
        b"Content-Length: " + str(len(RECORDS)).encode() + b"\r\n\r\n"
    )
    head = await read_head(stream, b"")
    assert head[0].startswith(b"HTTP/1.1 100"), head
    return stream


async def read_head(stream: trio.SocketStream, buf: bytes) -> tuple[bytes, bytes]:
    """(head, rest of buffer) of the next response head."""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        assert data, f"connection closed, got {buf!r}"
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


async def read_response(stream: trio.SocketStream) -> tuple[int, bytes]:
    head, body = await read_head(stream, b"")
    status = int(head.split(b" ", 2)[1])
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    assert m is not None, head
    while len(body) < int(m.group(1)):
        data = await stream.receive_some(65536)
        assert data, "connection closed mid-body"
        body += data
    return status, body


DRAIN_ENV = {"TOPICD_DRAIN_TIMEOUT_MS": "20000"}


async def test_inflight_request_finishes_during_drain(tmp_path):
    with trio.fail_after(DEADLINE_S):
        async with serving(tmp_path, "--port", "0", "--data-dir", "d", env=DRAIN_ENV) as child:
            stream = await held_request(await child.port())
            child.proc.send_signal(signal.SIGINT)
            await child.wait_for("draining")
            await stream.send_all(RECORDS)
            status, body = await read_response(stream)
            assert status == 201, body
            assert json.loads(body)["seqs"] == [1]
            await stream.aclose()
            with trio.fail_after(5):  # well before the 20 s drain deadline
                assert await child.exit_code() == 0


async def test_second_signal_during_drain_exits_1(tmp_path):
    with trio.fail_after(DEADLINE_S):
        async with serving(tmp_path, "--port", "0", "--data-dir", "d", env=DRAIN_ENV) as child:
            stream = await held_request(await child.port())
            child.proc.send_signal(signal.SIGINT)
            await child.wait_for("draining")
            assert child.proc.poll() is None  # the held request keeps the drain open
            child.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                assert await child.exit_code() == 1
            await stream.aclose()


async def test_drain_deadline_ends_a_stuck_request(tmp_path):
    with trio.fail_after(DEADLINE_S):
        env = {"TOPICD_DRAIN_TIMEOUT_MS": "300"}
        async with serving(tmp_path, "--port", "0", "--data-dir", "d", env=env) as child:
            stream = await held_request(await child.port())
            child.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                assert await child.exit_code() == 0
            await stream.aclose()
