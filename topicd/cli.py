"""The `topicd` command (api-ops §6).

    topicd serve [--config FILE] [--host H] [--port P] [--data-dir DIR] [--log-level L]
    topicd check-config [--config FILE] [--print]
    topicd print-default-config
    topicd hash-key
    topicd version | --version
    topicd write TOPIC | tail [-f] TOPIC... | topics     (client subcommands, --url/--token)

Exit codes: 0 clean, 1 runtime failure (bind error, second signal), 2 usage or
configuration error, 3 refused by the no-auth startup guard, 4 recovery refused, 5 data
directory locked, 70 unexpected internal error. The client subcommands use 0, 1 (a request
failed after the client's retries, or no connection) and 2 (usage); see
`topicd.client.cli`.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

import trio

from topicd import __version__
from topicd.config import (
    DEFAULT,
    Config,
    ConfigError,
    KeySpec,
    check_paths,
    contract_warnings,
    env_names,
    hash_secret,
    is_loopback_host,
    load_config,
    parse_log_level,
    render_toml,
    resolve_config_path,
)
from topicd.http.auth import KeyStore

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_CONFIG = 2
EXIT_INSECURE = 3
EXIT_RECOVERY = 4
EXIT_LOCKED = 5
EXIT_SOFTWARE = 70

TRACE = 5
_LEVELS = {
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": TRACE,
}


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, object] = {
            "ts": int(record.created * 1000),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)


def setup_logging(cfg: Config) -> None:
    logging.addLevelName(TRACE, "TRACE")
    root_level, per = parse_log_level(cfg.logging.level)
    handler = logging.StreamHandler(sys.stderr)
    if cfg.logging.format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[root_level])
    for name, level in per.items():
        logging.getLogger(name).setLevel(_LEVELS[level])
    if cfg.logging.access_log:
        logging.getLogger("topicd.access").setLevel(logging.INFO)


CONFIG_HELP = (
    "configuration file (default: $TOPICD_CONFIG if set, else ./conf/topicd.toml if it "
    "exists, else none: built-in defaults and the environment)"
)
SERVE_EPILOG = """\
Each flag overrides the environment and the configuration file; without it the setting
comes from TOPICD_* (or legacy TOPICS_*) variables, then the file, then the built-in
default shown. `topicd check-config` shows which file is used.

exit codes: 0 clean shutdown, 1 runtime failure (cannot bind, second signal during the
drain), 2 usage or configuration error, 3 refused by the no-auth guard, 4 recovery
refused (nothing was modified), 5 data directory locked by another process, 70 internal
error.
"""


def _setting(path: str, what: str) -> str:
    """Flag help for the setting at `path`: what it does, its key, variable and default."""
    section_path, _, name = path.rpartition(".")
    section: object = DEFAULT
    for part in section_path.split("."):
        section = getattr(section, part)
    assert dataclasses.is_dataclass(section)
    spec = next(f for f in dataclasses.fields(section) if f.name == name).metadata["key"]
    assert isinstance(spec, KeySpec)
    env = env_names(path, spec)[0]
    return f"{what} (default: ${env}, else {path} in the file, else {getattr(section, name)})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="topicd", description="topicd: a persistent event engine")
    p.add_argument("--version", action="version", version=f"topicd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the server",
        description="Run the topicd server until SIGINT or SIGTERM drains it.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    serve.add_argument("--host", metavar="H", help=_setting("server.host", "address to listen on"))
    serve.add_argument(
        "--port",
        metavar="P",
        type=int,
        help=_setting("server.port", "port to listen on, 0 = any free port"),
    )
    serve.add_argument(
        "--data-dir",
        metavar="DIR",
        help=_setting(
            "storage.data_dir", "data directory; created (once the port is bound) if missing"
        ),
    )
    serve.add_argument(
        "--log-level",
        metavar="L",
        help=_setting(
            "logging.level",
            "error, warn, info, debug or trace, optionally with per-logger filters such as "
            "info,topicd.http=debug",
        ),
    )
    serve.add_argument(
        "--recovery-on-corruption",
        choices=("refuse", "truncate"),
        help=_setting(
            "storage.recovery.on_corruption",
            "refuse to start on a corrupt WAL, or truncate it at the first corrupt frame "
            "(an operator decision: acknowledged writes after it are discarded)",
        ),
    )

    verify = sub.add_parser(
        "verify",
        help="check a data directory offline (read-only)",
        description="Run recovery against a stopped server's data directory without "
        "modifying it: exit 0 if serve would start, 4 if it would refuse, 5 if locked.",
    )
    verify.add_argument(
        "--data-dir", metavar="DIR", required=True, help="the data directory (required)"
    )
    verify.add_argument("--config", metavar="FILE", help=CONFIG_HELP)

    check = sub.add_parser(
        "check-config",
        help="validate the configuration and exit",
        description="Load and validate the configuration exactly as serve does; say which "
        "file was loaded. Starts nothing.",
    )
    check.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    check.add_argument(
        "--print",
        action="store_true",
        help="print the effective configuration as TOML, secrets redacted (default: off)",
    )

    _client_parsers(sub)
    sub.add_parser("print-default-config", help="print the default TOML with comments")
    sub.add_parser("hash-key", help="read a secret on stdin, print its SHA-256 for [[auth.key]]")
    sub.add_parser("version", help="print the version")
    return p


CLIENT_EPILOG = """\
environment: TOPICD_URL (the server, default http://127.0.0.1:4000) and TOPICD_TOKEN (the
bearer key) are used when --url / --token are not given.

exit codes: 0 success, 1 a request failed after the client's retries or no connection,
2 usage (bad arguments or input). Errors are printed as `topicd: <code>: <message>`.
"""


def _client_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", metavar="URL", help="server URL (default: $TOPICD_URL, else http://127.0.0.1:4000)"
    )
    common.add_argument(
        "--token",
        metavar="KEY",
        help="bearer key (default: $TOPICD_TOKEN, else none; prefer the variable: "
        "arguments are visible to other users)",
    )
    common.add_argument(
        "--retries",
        metavar="N",
        type=int,
        default=8,
        help="retries of a request that failed safely (429, 503, no connection) (default: 8)",
    )
    kw: dict[str, object] = {
        "parents": [common],
        "epilog": CLIENT_EPILOG,
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }
    write = sub.add_parser(
        "write",
        help="write records read from stdin",
        description="Write records to TOPIC: one JSON object per stdin line, "
        '{"data": ..., "tag": ..., "meta": ..., "node": ..., "priority": ...} (only data is '
        "required; data and meta are sent exactly as written), batched. Prints a summary "
        "line. A line that is not such an object stops the command (exit 2) after every "
        "record before it was written.",
        **kw,  # type: ignore[arg-type]
    )
    write.add_argument("topic", metavar="TOPIC")
    write.add_argument(
        "--batch", metavar="N", type=int, default=1000, help="records per write (default: 1000)"
    )
    write.add_argument(
        "--linger-ms",
        metavar="MS",
        type=int,
        default=100,
        help="send a partial batch once no line arrived for this long (default: 100)",
    )
    tail = sub.add_parser(
        "tail",
        help="print records of topics",
        description="Print the records of each TOPIC after --from-seq, one JSON object per "
        "line on stdout (the record with its topic); tombstones (records lost before they "
        "were read) and deleted topics go to stderr. With -f, keep printing new records "
        "(reconnecting and resuming exactly) until interrupted (exit 0).",
        **kw,  # type: ignore[arg-type]
    )
    tail.add_argument("topics", metavar="TOPIC", nargs="+")
    tail.add_argument("-f", "--follow", action="store_true", help="follow new records")
    tail.add_argument(
        "--from-seq", metavar="SEQ", type=int, default=0, help="start after this seq (default: 0)"
    )
    topics = sub.add_parser(
        "topics",
        help="list topics with their counts",
        description="List topics: name, live record count, bytes, head and earliest seq.",
        **kw,  # type: ignore[arg-type]
    )
    topics.add_argument("--prefix", metavar="P", help="only names starting with P")
    topics.add_argument("--json", action="store_true", help="one JSON object per line")


def config_source(explicit: str | None, path: Path | None) -> str:
    """Which configuration file is used and why, in words (`check-config`, the serve log)."""
    if path is None:
        return (
            "no configuration file (no --config, $TOPICD_CONFIG unset, no "
            "./conf/topicd.toml): built-in defaults and the environment"
        )
    why = (
        "--config"
        if explicit
        else "$TOPICD_CONFIG"
        if os.environ.get("TOPICD_CONFIG")
        else "./conf/topicd.toml in the working directory"
    )
    return f"configuration file {path.absolute()} (from {why}), then the environment"


def _load(args: argparse.Namespace) -> tuple[Config, KeyStore, str]:
    """The configuration, its key store, and `config_source` (which file, in words)."""
    flags: dict[str, object] = {}
    for attr, key_path in (
        ("host", "server.host"),
        ("port", "server.port"),
        ("data_dir", "storage.data_dir"),
        ("log_level", "logging.level"),
        ("recovery_on_corruption", "storage.recovery.on_corruption"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            flags[key_path] = value
    path = resolve_config_path(args.config, os.environ)
    cfg = load_config(path, os.environ, flags)
    keys = KeyStore.from_config(cfg.auth)
    return cfg, keys, config_source(args.config, path)


def _without_secrets(cfg: Config) -> Config:
    """The config the daemon keeps: plaintext key entries dropped once hashed."""
    entries = tuple("<redacted>" for _ in cfg.auth.api_keys)
    return dataclasses.replace(cfg, auth=dataclasses.replace(cfg.auth, api_keys=entries))


def _insecure(cfg: Config, keys: KeyStore) -> bool:
    """The no-auth startup guard (README §2.6)."""
    return (
        not keys.enabled
        and not cfg.auth.allow_insecure_no_auth
        and not is_loopback_host(cfg.server.host)
    )


def _serve(args: argparse.Namespace) -> int:
    from topicd.daemon import BindError, SecondSignal, run_daemon
    from topicd.storage.datadir import DataDirError, DataDirLocked
    from topicd.storage.jetstream import JetStreamUnavailable
    from topicd.storage.recovery import RecoveryRefused

    try:
        cfg, keys, source = _load(args)
    except ConfigError as exc:
        print(f"topicd: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    cfg = _without_secrets(cfg)
    setup_logging(cfg)
    log = logging.getLogger("topicd")
    log.info("%s", source)
    if _insecure(cfg, keys):
        print(
            f"topicd: refusing to start: bind address {cfg.server.host} is not loopback and no "
            "API keys are configured (set auth.api_keys, or auth.allow_insecure_no_auth = true "
            "on a trusted network)",
            file=sys.stderr,
        )
        return EXIT_INSECURE
    if not keys.enabled:
        log.warning("no API keys configured: DEV MODE, every request has full access")
        if not is_loopback_host(cfg.server.host):
            log.warning(
                "!!! allow_insecure_no_auth on a non-loopback bind: anyone who can reach "
                "%s has full access !!!",
                cfg.server.host,
            )
    code = EXIT_OK

    def leaf(exc: BaseException) -> BaseException:
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        return exc

    try:
        trio.run(run_daemon, cfg, keys)
    except* DataDirLocked as eg:
        print(f"topicd: {leaf(eg)}", file=sys.stderr)
        code = EXIT_LOCKED
    except* BindError as eg:
        print(f"topicd: {leaf(eg)}", file=sys.stderr)
        code = EXIT_RUNTIME
    except* RecoveryRefused as eg:
        print(f"topicd: recovery refused: {leaf(eg)}", file=sys.stderr)
        code = EXIT_RECOVERY
    except* DataDirError as eg:
        print(f"topicd: {leaf(eg)}", file=sys.stderr)
        code = EXIT_RUNTIME
    except* JetStreamUnavailable as eg:
        print(f"topicd: {leaf(eg)}", file=sys.stderr)
        code = EXIT_RUNTIME
    except* (SecondSignal, KeyboardInterrupt):
        code = EXIT_RUNTIME
    except* OSError as eg:
        print(f"topicd: {leaf(eg)}", file=sys.stderr)
        code = EXIT_RUNTIME
    except* Exception:
        log.exception("topicd: unexpected internal error")
        code = EXIT_SOFTWARE
    return code


def _check_config(args: argparse.Namespace) -> int:
    try:
        cfg, keys, source = _load(args)
        check_paths(cfg)
    except ConfigError as exc:
        print(f"topicd: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    for warning in contract_warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    if _insecure(cfg, keys):
        print(
            f"topicd: serve would refuse to start: {cfg.server.host} is not loopback and no "
            "API keys are configured",
            file=sys.stderr,
        )
        return EXIT_INSECURE
    if args.print:
        sys.stdout.write(f"# {source}\n")
        sys.stdout.write(render_toml(cfg, redact=True))
    else:
        print(source)
        print(f"configuration OK ({len(keys)} keys{'' if keys.enabled else ', dev mode'})")
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    """Run recovery read-only against a data directory (storage spec §10.3)."""
    from topicd.clock import SystemWallClock
    from topicd.storage.datadir import DataDirError, DataDirLocked, hold_lock
    from topicd.storage.fs import RealFs
    from topicd.storage.recovery import RecoveryRefused, read_boot_id, recover
    from topicd.storage.service import READ_WORKERS

    try:
        cfg, _, _ = _load(args)
    except ConfigError as exc:
        print(f"topicd: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    root = cfg.storage.data_dir
    if not os.path.isdir(root):
        why = "is not a directory" if os.path.exists(root) else "does not exist"
        print(f"topicd: verify: data directory {root} {why}", file=sys.stderr)
        return EXIT_CONFIG
    # verify only reports: corruption is a refusal whatever on_corruption says, and its
    # progress (a long replay logs every second) and warnings go to stderr
    storage = cfg.storage
    cfg = dataclasses.replace(
        cfg,
        storage=dataclasses.replace(
            storage, recovery=dataclasses.replace(storage.recovery, on_corruption="refuse")
        ),
    )
    setup_logging(cfg)
    try:
        with hold_lock(root):
            # (every segment's bytes too: a start leaves those to the reads)
            result = recover(
                cfg,
                RealFs(),
                SystemWallClock(),
                boot_id=read_boot_id(),
                check_sealed=True,
                read_workers=READ_WORKERS,
            )
    except DataDirLocked as exc:
        print(f"topicd: {exc} (stop it before verifying)", file=sys.stderr)
        return EXIT_LOCKED
    except DataDirError as exc:
        print(f"topicd: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except RecoveryRefused as exc:
        print(f"topicd: verify: recovery would be refused: {exc}", file=sys.stderr)
        return EXIT_RECOVERY
    engine = result.engine
    records = sum(t.count for t in engine.topics.values())
    print(
        f"{root}: OK — {len(engine.topics)} topics, {records} live records, "
        f"{result.frames} WAL frames ({result.bytes} bytes) replayed"
        + (f" on top of snapshot {result.snapshot_number}" if result.snapshot_number else "")
    )
    for torn in result.torn:
        print(f"torn tail (would be cleared at the next start): {torn}")
    for note in result.lost:
        print(
            f"lost range (a machine crash): topic {note.topic.name!r} seqs "
            f"{note.gap_from}..{note.gap_to}"
        )
    return EXIT_OK


def _hash_key() -> int:
    if sys.stdin.isatty():
        secret = getpass.getpass("secret: ")
    else:
        secret = sys.stdin.readline().rstrip("\r\n")
    secret = secret.strip()
    if not secret or ":" in secret:
        print("topicd: a secret must be non-empty and contain no ':'", file=sys.stderr)
        return EXIT_CONFIG
    print(hash_secret(secret))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version exit 0, usage errors exit 2
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_CONFIG
    if args.command == "serve":
        return _serve(args)
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "print-default-config":
        sys.stdout.write(render_toml(DEFAULT, redact=False))
        return EXIT_OK
    if args.command == "verify":
        return _verify(args)
    if args.command == "hash-key":
        return _hash_key()
    if args.command in ("write", "tail", "topics"):
        from topicd.client import cli as client_cli

        mains = {
            "write": client_cli.write_main,
            "tail": client_cli.tail_main,
            "topics": client_cli.topics_main,
        }
        return client_cli.run(args, mains[args.command])
    if args.command == "version":
        print(f"topicd {__version__}")
        return EXIT_OK
    raise AssertionError(args.command)
