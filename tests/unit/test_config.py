"""The configuration registry (api-ops §5): precedence, env names, types, bounds, printing.

Method: every test calls `load_config(path, env=..., flags=...)` directly with a TOML file
written to `tmp_path` and an explicit environment mapping, so the process environment
never leaks in. Failures are asserted as `ConfigError` whose message names the offending
key path (the contract the command relies on for its exit-2 message). The spec table of
§5.2 is transcribed below (`SPEC_TABLE`) and compared against the registry, so a key whose
default or environment names drift from the spec is caught here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tomllib

import pytest

from topicd.config import (
    DEFAULT,
    Config,
    ConfigError,
    HashedKey,
    KeySpec,
    contract_warnings,
    env_names,
    load_config,
    parse_log_level,
    render_toml,
    resolve_config_path,
)


def load(tmp_path, toml: str | None = None, env=None, flags=None) -> Config:
    path = None
    if toml is not None:
        path = tmp_path / "topicd.toml"
        path.write_text(toml, encoding="utf-8")
    return load_config(path, env=env or {}, flags=flags or {})


def registry(cls=Config, prefix=""):
    """{key path: (default, env names)} for every plain key of the registry."""
    out = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if "section" in f.metadata:
            out.update(registry(type(f.default_factory()), path + "."))
        elif "key" in f.metadata:
            spec = f.metadata["key"]
            assert isinstance(spec, KeySpec)
            default = f.default_factory() if callable(f.default_factory) else f.default
            out[path] = (default, env_names(path, spec))
    return out


def get(cfg: Config, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def both(name: str) -> tuple[str, str]:
    return (f"TOPICD_{name}", f"TOPICS_{name}")


def only(name: str) -> tuple[str]:
    return (f"TOPICD_{name}",)


# api-ops §5.2, the rows that name a key: (key path, default, env names canonical first).
SPEC_TABLE = [
    ("server.host", "127.0.0.1", both("HOST")),
    ("server.port", 4000, both("PORT")),
    ("server.port_file", "", both("PORT_FILE")),
    ("server.drain_timeout_ms", 10000, only("DRAIN_TIMEOUT_MS")),
    ("server.header_read_timeout_ms", 60000, only("HEADER_READ_TIMEOUT_MS")),
    ("server.http2", True, only("HTTP2")),
    ("auth.api_keys", (), both("API_KEYS")),
    ("auth.api_keys_file", "", only("API_KEYS_FILE")),
    ("auth.allow_insecure_no_auth", False, both("ALLOW_INSECURE_NO_AUTH")),
    ("auth.probe_auth", False, both("PROBE_AUTH")),
    ("storage.data_dir", "./topicd-data", both("DATA_DIR")),
    ("storage.cold_dir", "", both("COLD_DIR")),
    ("storage.wal_shards", 0, both("WAL_SHARDS")),
    ("storage.segments.max_events", 10000, both("SEGMENT_MAX_EVENTS")),
    ("storage.segments.max_bytes", 67108864, both("SEGMENT_MAX_BYTES")),
    ("storage.segments.max_age_ms", 3600000, both("SEGMENT_MAX_AGE_MS")),
    ("storage.tiering.hot_retain_segments", 4, both("HOT_RETAIN_SEGMENTS")),
    ("storage.tiering.hot_retain_bytes", 0, both("HOT_RETAIN_BYTES")),
    ("limits.max_topics", 100000, both("MAX_TOPICS")),
    ("limits.max_routers", 10000, both("MAX_ROUTERS")),
    ("limits.max_watch_sessions", 10000, both("MAX_WATCH_SESSIONS")),
    ("limits.max_sse_connections", 10000, both("MAX_SSE_CONNECTIONS")),
    ("limits.max_sse_connections_per_key", 1000, both("MAX_SSE_CONNECTIONS_PER_KEY")),
    ("limits.max_inflight_per_key", 1000, both("MAX_INFLIGHT_PER_KEY")),
    ("limits.max_total_bytes", 0, both("MAX_TOTAL_BYTES")),
    ("limits.max_idempotency_entries", 1000000, only("MAX_IDEMPOTENCY_ENTRIES")),
    ("limits.max_body_bytes", 67108864, both("MAX_BODY_BYTES")),
    ("protocol.max_batch_records", 10000, both("MAX_BATCH_RECORDS")),
    ("protocol.max_record_bytes", 1048576, both("MAX_RECORD_BYTES")),
    ("protocol.max_meta_bytes", 16384, both("MAX_META_BYTES")),
    ("protocol.max_meta_keys", 64, only("MAX_META_KEYS")),
    ("protocol.max_tag_bytes", 256, both("MAX_TAG_BYTES")),
    ("protocol.max_node_bytes", 128, both("MAX_NODE_BYTES")),
    ("protocol.max_idempotency_key_bytes", 256, only("MAX_IDEMPOTENCY_KEY_BYTES")),
    ("protocol.default_limit", 256, only("DEFAULT_LIMIT")),
    ("protocol.max_limit", 1000, both("MAX_LIMIT")),
    ("protocol.max_wait_ms", 30000, only("MAX_WAIT_MS")),
    ("protocol.default_max_batch_bytes", 1048576, only("DEFAULT_MAX_BATCH_BYTES")),
    ("protocol.max_batch_bytes", 8388608, only("MAX_BATCH_BYTES")),
    ("protocol.max_scan_per_read", 100000, only("MAX_SCAN_PER_READ")),
    ("protocol.default_page_size", 100, only("DEFAULT_PAGE_SIZE")),
    ("protocol.max_page_size", 1000, only("MAX_PAGE_SIZE")),
    ("watch.max_watch_topics", 256, both("MAX_WATCH_TOPICS")),
    ("watch.session_ttl_ms", 300000, only("SESSION_TTL_MS")),
    ("watch.default_heartbeat_ms", 15000, only("DEFAULT_HEARTBEAT_MS")),
    ("watch.min_heartbeat_ms", 1000, only("MIN_HEARTBEAT_MS")),
    ("watch.max_heartbeat_ms", 60000, only("MAX_HEARTBEAT_MS")),
    ("watch.sse_retry_ms", 2000, only("SSE_RETRY_MS")),
    ("watch.slow_consumer_timeout_ms", 30000, only("SLOW_CONSUMER_TIMEOUT_MS")),
    ("watch.ws_outbound_queue", 4, only("WS_OUTBOUND_QUEUE")),
    ("queue.max_claim", 1000, both("MAX_CLAIM")),
    ("queue.min_lease_ms", 100, only("MIN_LEASE_MS")),
    ("queue.max_lease_ms", 86400000, only("MAX_LEASE_MS")),
    ("queue.max_claim_jitter_ms", 5000, only("MAX_CLAIM_JITTER_MS")),
    ("queue.max_nack_delay_ms", 86400000, only("MAX_NACK_DELAY_MS")),
    ("queue.work_heartbeat_ms", 15000, only("WORK_HEARTBEAT_MS")),
    ("queue.work_poll_ms", 250, only("WORK_POLL_MS")),
    ("routers.tick_ms", 50, only("ROUTER_TICK_MS")),
    ("routers.batch", 1024, only("ROUTER_BATCH")),
    ("routers.max_hops", 8, only("ROUTER_MAX_HOPS")),
    ("logging.level", "info", only("LOG")),
    ("logging.format", "text", only("LOG_FORMAT")),
    ("logging.access_log", False, only("ACCESS_LOG")),
]


# --------------------------------------------------------------------------------------
# The registry against the spec table
# --------------------------------------------------------------------------------------


def test_registered_keys_match_spec_table():
    reg = registry()
    wrong = [
        f"{path}: registry has {reg[path]!r}, spec says {(default, env)!r}"
        for path, default, env in SPEC_TABLE
        if path in reg and reg[path] != (default, env)
    ]
    assert wrong == []


def test_every_spec_table_key_is_registered():
    reg = registry()
    missing = [path for path, _, _ in SPEC_TABLE if path not in reg]
    assert missing == [], f"api-ops §5.2 keys missing from the registry: {missing}"


def test_no_config_at_all_gives_the_defaults():
    cfg = load_config(None, env={}, flags={})
    assert cfg == DEFAULT
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 4000)


# --------------------------------------------------------------------------------------
# Precedence: flags > TOPICD_* > TOPICS_* > TOML > defaults
# --------------------------------------------------------------------------------------

PORT_LAYERS = [
    ("flags", 1004),
    ("TOPICD_PORT", 1003),
    ("TOPICS_PORT", 1002),
    ("toml", 1001),
    ("default", 4000),
]


@pytest.mark.parametrize("top", range(len(PORT_LAYERS)))
def test_precedence_highest_present_layer_wins(tmp_path, top):
    present = {name for name, _ in PORT_LAYERS[top:]}
    toml = "[server]\nport = 1001\n" if "toml" in present else None
    env = {}
    if "TOPICS_PORT" in present:
        env["TOPICS_PORT"] = "1002"
    if "TOPICD_PORT" in present:
        env["TOPICD_PORT"] = "1003"
    flags = {"server.port": 1004} if "flags" in present else {}
    cfg = load(tmp_path, toml, env, flags)
    assert cfg.server.port == PORT_LAYERS[top][1]


def test_precedence_applies_per_key(tmp_path):
    cfg = load(
        tmp_path,
        '[server]\nport = 1001\nhost = "127.0.0.2"\n[auth]\nprobe_auth = true\n',
        env={"TOPICS_PROBE_AUTH": "false", "TOPICD_DRAIN_TIMEOUT_MS": "5"},
        flags={"storage.data_dir": "/tmp/x"},
    )
    assert cfg.server.port == 1001
    assert cfg.server.host == "127.0.0.2"
    assert cfg.auth.probe_auth is False
    assert cfg.server.drain_timeout_ms == 5
    assert cfg.storage.data_dir == "/tmp/x"
    assert cfg.limits == DEFAULT.limits


def test_legacy_alias_works_alone_for_every_aliased_key(tmp_path):
    # A deployment environment written for `topics` must keep working unchanged.
    cfg = load(
        tmp_path,
        env={
            "TOPICS_HOST": "127.0.0.3",
            "TOPICS_PORT": "4100",
            "TOPICS_DATA_DIR": "/srv/t",
            "TOPICS_MAX_LIMIT": "900",
            "TOPICS_API_KEYS": "k1:r",
        },
    )
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.3", 4100)
    assert cfg.storage.data_dir == "/srv/t"
    assert cfg.protocol.max_limit == 900
    assert cfg.auth.api_keys == ("k1:r",)


# --------------------------------------------------------------------------------------
# Explicit vs derived environment names
# --------------------------------------------------------------------------------------


def test_derived_env_name_for_keys_without_explicit_names(tmp_path):
    cfg = load(
        tmp_path,
        env={
            "TOPICD_SCHEDULER_PRIORITY_MIN": "-5",
            "TOPICD_ENGINE_HOUSEKEEPING_INTERVAL_MS": "250",
        },
    )
    assert cfg.scheduler.priority_min == -5
    assert cfg.engine.housekeeping_interval_ms == 250


def test_payload_cache_bytes_defaults_to_256_mib_and_takes_its_derived_env_name(tmp_path):
    assert DEFAULT.storage.payload_cache_bytes == 256 << 20
    cfg = load(tmp_path, env={"TOPICD_STORAGE_PAYLOAD_CACHE_BYTES": "0"})
    assert cfg.storage.payload_cache_bytes == 0  # 0: every absorbed payload is evicted
    with pytest.raises(ConfigError):
        load(tmp_path, env={"TOPICD_STORAGE_PAYLOAD_CACHE_BYTES": "-1"})


def test_derived_names_have_no_legacy_alias(tmp_path):
    cfg = load(tmp_path, env={"TOPICS_SCHEDULER_PRIORITY_MIN": "-5"})
    assert cfg.scheduler.priority_min == DEFAULT.scheduler.priority_min


@pytest.mark.parametrize(
    ("var", "path"),
    [
        ("TOPICD_SERVER_PORT", "server.port"),
        ("TOPICD_SERVER_HOST", "server.host"),
        ("TOPICD_AUTH_API_KEYS", "auth.api_keys"),
        ("TOPICD_LOGGING_LEVEL", "logging.level"),
        ("TOPICD_PROTOCOL_MAX_LIMIT", "protocol.max_limit"),
        ("TOPICD_QUEUE_MIN_LEASE_MS", "queue.min_lease_ms"),
        ("TOPICD_STORAGE_DATA_DIR", "storage.data_dir"),
    ],
)
def test_explicitly_named_key_ignores_its_derived_name(tmp_path, var, path):
    # Also a garbage value: the derived name must not even be parsed.
    cfg = load(tmp_path, env={var: "not-a-value-for-anything"})
    assert get(cfg, path) == get(DEFAULT, path)


def test_explicit_name_without_legacy_alias_ignores_topics_prefix(tmp_path):
    # §5.2 lists TOPICD_MAX_META_KEYS with no TOPICS_ alias.
    cfg = load(tmp_path, env={"TOPICS_MAX_META_KEYS": "3", "TOPICS_DEFAULT_LIMIT": "3"})
    assert cfg.protocol.max_meta_keys == 64
    assert cfg.protocol.default_limit == 256


def test_env_names_helper():
    reg = registry()
    assert reg["server.port"][1] == ("TOPICD_PORT", "TOPICS_PORT")
    assert reg["logging.level"][1] == ("TOPICD_LOG",)
    assert reg["scheduler.priority_max"][1] == ("TOPICD_SCHEDULER_PRIORITY_MAX",)
    assert reg["engine.gc_threshold0"][1] == ("TOPICD_ENGINE_GC_THRESHOLD0",)


# --------------------------------------------------------------------------------------
# Value syntax in env
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["1", "true", "yes", "on"])
def test_env_boolean_true(tmp_path, raw):
    cfg = load(tmp_path, env={"TOPICD_PROBE_AUTH": raw})
    assert cfg.auth.probe_auth is True


@pytest.mark.parametrize("raw", ["0", "false", "no", "off", ""])
def test_env_boolean_false(tmp_path, raw):
    # server.http2 defaults to true and the file says true: the env value must win.
    cfg = load(tmp_path, "[server]\nhttp2 = true\n", env={"TOPICD_HTTP2": raw})
    assert cfg.server.http2 is False


@pytest.mark.parametrize("raw", ["2", "enable", "y", "truthy", "-1"])
def test_env_boolean_garbage_is_an_error(tmp_path, raw):
    with pytest.raises(ConfigError, match=r"auth\.probe_auth"):
        load(tmp_path, env={"TOPICD_PROBE_AUTH": raw})


def test_env_list_is_comma_separated_and_trimmed(tmp_path):
    cfg = load(tmp_path, env={"TOPICD_API_KEYS": " a:r , b:w,,c ,"})
    assert cfg.auth.api_keys == ("a:r", "b:w", "c")


def test_env_list_replaces_the_files_list(tmp_path):
    cfg = load(tmp_path, '[auth]\napi_keys = ["f1", "f2"]\n', env={"TOPICD_API_KEYS": "e1"})
    assert cfg.auth.api_keys == ("e1",)


def test_canonical_env_list_replaces_legacy_list(tmp_path):
    cfg = load(tmp_path, env={"TOPICS_API_KEYS": "old", "TOPICD_API_KEYS": "new"})
    assert cfg.auth.api_keys == ("new",)


def test_env_integer_is_trimmed(tmp_path):
    cfg = load(tmp_path, env={"TOPICD_MAX_TOPICS": " 42 "})
    assert cfg.limits.max_topics == 42


# --------------------------------------------------------------------------------------
# Errors name the key
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ("[bogus]\nx = 1\n", "bogus"),
        ("[server]\nbogus = 1\n", "server.bogus"),
        ("port = 4000\n", "port"),
        ("[server.extra]\nx = 1\n", "server.extra"),
        ("[storage]\nwal = 1\n", "storage.wal"),
    ],
)
def test_unknown_section_or_key_is_an_error(tmp_path, toml, named):
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, toml)
    assert named in str(exc.value)


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ('[server]\nport = "4000"\n', "server.port"),
        ("[server]\nport = 4000.0\n", "server.port"),
        ("[server]\nport = true\n", "server.port"),
        ("[server]\nhost = 1\n", "server.host"),
        ('[server]\nhttp2 = "true"\n', "server.http2"),
        ("[server]\nhttp2 = 1\n", "server.http2"),
        ('[auth]\napi_keys = "k"\n', "auth.api_keys"),
        ("[auth]\napi_keys = [1]\n", "auth.api_keys"),
        ("server = 1\n", "server"),
        ("[logging]\nlevel = []\n", "logging.level"),
    ],
)
def test_wrong_type_is_an_error(tmp_path, toml, named):
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, toml)
    assert named in str(exc.value)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"TOPICD_PORT": "abc"}, "server.port"),
        ({"TOPICS_PORT": "4k"}, "server.port"),
        ({"TOPICD_MAX_TOPICS": "1e3"}, "limits.max_topics"),
        ({"TOPICD_MAX_TOPICS": ""}, "limits.max_topics"),
        ({"TOPICD_SCHEDULER_PRIORITY_MIN": "low"}, "scheduler.priority_min"),
        ({"TOPICD_HTTP2": "maybe"}, "server.http2"),
    ],
)
def test_unparsable_env_is_an_error(tmp_path, env, named):
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, env=env)
    assert named in str(exc.value)


@pytest.mark.parametrize(
    ("toml", "env", "flags", "named"),
    [
        ("[server]\nport = 65536\n", {}, {}, "server.port"),
        ("[server]\nport = -1\n", {}, {}, "server.port"),
        (None, {"TOPICD_PORT": "70000"}, {}, "server.port"),
        (None, {}, {"server.port": 70000}, "server.port"),
        ("[limits]\nmax_topics = -1\n", {}, {}, "limits.max_topics"),
        ("[limits]\nmax_body_bytes = 10\n", {}, {}, "limits.max_body_bytes"),
        ("[protocol]\nmax_batch_records = 0\n", {}, {}, "protocol.max_batch_records"),
        ("[server]\nheader_read_timeout_ms = 1\n", {}, {}, "server.header_read_timeout_ms"),
        ("[engine]\nhousekeeping_interval_ms = 5\n", {}, {}, "engine.housekeeping_interval_ms"),
        ('[logging]\nformat = "xml"\n', {}, {}, "logging.format"),
        ("[protocol]\ndefault_limit = 2000\n", {}, {}, "protocol.default_limit"),
        ("[queue]\nmin_lease_ms = 100000000\n", {}, {}, "queue.min_lease_ms"),
    ],
)
def test_out_of_range_is_an_error(tmp_path, toml, env, flags, named):
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, toml, env, flags)
    assert named in str(exc.value)


def test_flag_of_wrong_type_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"server\.port"):
        load(tmp_path, flags={"server.port": "4000"})


def test_bad_value_in_a_lower_layer_still_fails_closed(tmp_path):
    # The file is validated even where env overrides it: typos never hide.
    with pytest.raises(ConfigError, match=r"server\.port"):
        load(tmp_path, '[server]\nport = "x"\n', env={"TOPICD_PORT": "1"})


def test_toml_syntax_error_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"topicd\.toml"):
        load(tmp_path, "[server\n")
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        load_config(tmp_path / "nope.toml", env={}, flags={})


# --------------------------------------------------------------------------------------
# Which file (§5.1)
# --------------------------------------------------------------------------------------


def test_config_file_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path(None, {}) is None
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "topicd.toml").write_text("")
    assert str(resolve_config_path(None, {})) == "conf/topicd.toml"
    assert str(resolve_config_path(None, {"TOPICD_CONFIG": "/e.toml"})) == "/e.toml"
    assert str(resolve_config_path("/f.toml", {"TOPICD_CONFIG": "/e.toml"})) == "/f.toml"


# --------------------------------------------------------------------------------------
# server.host forms
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "want"),
    [
        ("0.0.0.0:8080", ("0.0.0.0", 8080)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:8080", ("::1", 8080)),
        ("[::]:9", ("::", 9)),
        ("::1", ("::1", 5000)),
        ("::", ("::", 5000)),
        ("fe80::1:2", ("fe80::1:2", 5000)),
        ("example.org", ("example.org", 5000)),
    ],
)
def test_server_host_forms(tmp_path, host, want):
    cfg = load(tmp_path, f'[server]\nhost = "{host}"\nport = 5000\n')
    assert (cfg.server.host, cfg.server.port) == want


def test_host_port_overrides_port_from_any_layer(tmp_path):
    # "the port setting is then ignored", even when the port comes from a higher layer.
    cfg = load(tmp_path, "[server]\nport = 5000\n", env={"TOPICD_HOST": "127.0.0.1:7000"})
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 7000)


@pytest.mark.parametrize("host", ["h:abc", "h:70000", "[::1", "[::1]x", "[::1]:", ":4000", ""])
def test_bad_server_host_is_an_error(tmp_path, host):
    with pytest.raises(ConfigError, match=r"server\.host"):
        load(tmp_path, env={"TOPICD_HOST": host})


# --------------------------------------------------------------------------------------
# logging.level
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["error", "warn", "info", "debug", "trace"])
def test_log_levels(tmp_path, level):
    assert load(tmp_path, env={"TOPICD_LOG": level}).logging.level == level
    assert parse_log_level(level) == (level, {})


def test_log_filters(tmp_path):
    text = "warn,topicd.http=debug, hypercorn.error=error"
    cfg = load(tmp_path, env={"TOPICD_LOG": text})
    assert parse_log_level(cfg.logging.level) == (
        "warn",
        {"topicd.http": "debug", "hypercorn.error": "error"},
    )
    # Filters alone keep the default root level.
    assert parse_log_level("topicd=trace") == ("info", {"topicd": "trace"})


@pytest.mark.parametrize("text", ["verbose", "topicd=loud", "=debug", "warning"])
def test_bad_log_level_is_an_error(tmp_path, text):
    with pytest.raises(ConfigError, match=r"logging\.level"):
        load(tmp_path, f'[logging]\nlevel = "{text}"\n')


# --------------------------------------------------------------------------------------
# [[auth.key]]
# --------------------------------------------------------------------------------------

DIGEST = hashlib.sha256(b"s3cret").hexdigest()


def test_auth_key_tables(tmp_path):
    cfg = load(
        tmp_path,
        f"""
[[auth.key]]
sha256 = "{DIGEST.upper()}"
scopes = ["read"]
prefixes = ["tenant42:", "shared."]

[[auth.key]]
sha256 = "{"ab" * 32}"
""",
    )
    assert cfg.auth.key == (
        HashedKey(DIGEST, ("read",), ("tenant42:", "shared.")),
        HashedKey("ab" * 32, (), ()),
    )


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ('sha256 = "abc"', "auth.key[0].sha256"),
        (f'sha256 = "{"zz" * 32}"', "auth.key[0].sha256"),
        ("scopes = []", "auth.key[0].sha256"),
        (f'sha256 = "{DIGEST}"\nscopes = "read"', "auth.key[0].scopes"),
        (f'sha256 = "{DIGEST}"\nprefixes = [1]', "auth.key[0].prefixes"),
        (f'sha256 = "{DIGEST}"\nsecret = "x"', "auth.key[0]"),
    ],
)
def test_bad_auth_key_table(tmp_path, table, named):
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, f"[[auth.key]]\n{table}\n")
    assert named in str(exc.value)


def test_auth_key_must_be_an_array_of_tables(tmp_path):
    with pytest.raises(ConfigError, match=r"auth\.key"):
        load(tmp_path, f'[auth.key]\nsha256 = "{DIGEST}"\n')


# --------------------------------------------------------------------------------------
# render_toml
# --------------------------------------------------------------------------------------


def test_render_defaults_round_trips(tmp_path):
    text = render_toml(DEFAULT, redact=False)
    assert load(tmp_path, text) == DEFAULT


def test_render_shows_every_key(tmp_path):
    table = tomllib.loads(render_toml(DEFAULT, redact=False))
    shown = set()

    def walk(t, prefix):
        for k, v in t.items():
            if isinstance(v, dict):
                walk(v, prefix + k + ".")
            else:
                shown.add(prefix + k)

    walk(table, "")
    assert shown == set(registry())


def test_render_non_default_config_round_trips(tmp_path):
    cfg = load(
        tmp_path,
        f"""
[server]
host = "[::1]:4444"
http2 = false
port_file = "/tmp/p \\"q\\" ü"
[auth]
api_keys = ["a:r", "b::x:|y"]
[[auth.key]]
sha256 = "{DIGEST}"
scopes = ["read", "w"]
prefixes = ["t:"]
[protocol]
max_limit = 500
[scheduler]
priority_min = -7
[logging]
level = "warn,topicd=debug"
format = "json"
""",
    )
    again = load(tmp_path, render_toml(cfg, redact=False))
    assert again == cfg
    assert (again.server.host, again.server.port) == ("::1", 4444)


def test_render_redacts_secrets():
    # (secrets no help text could contain: a common word here once failed on a comment)
    cfg = load_config(None, env={"TOPICD_API_KEYS": "s3cret-q7:rw,z9-0th3r::tenant:"}, flags={})
    text = render_toml(cfg, redact=True)
    assert "s3cret-q7" not in text
    assert "z9-0th3r" not in text
    assert len(tomllib.loads(text)["auth"]["api_keys"]) == 2


# --------------------------------------------------------------------------------------
# contract_warnings
# --------------------------------------------------------------------------------------


def test_no_warnings_for_the_defaults():
    assert contract_warnings(DEFAULT) == []


def test_changed_protocol_limit_warns(tmp_path):
    cfg = load(tmp_path, "[protocol]\nmax_limit = 500\n")
    warnings = contract_warnings(cfg)
    assert len(warnings) == 1
    assert "protocol.max_limit" in warnings[0]


def test_resource_cap_change_does_not_warn(tmp_path):
    cfg = load(tmp_path, "[limits]\nmax_topics = 5\nmax_total_bytes = 1000000\n")
    assert contract_warnings(cfg) == []


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ("[queue]\nmin_lease_ms = 50\n", "queue.min_lease_ms"),
        ("[queue]\nmax_lease_ms = 1000\n", "queue.max_lease_ms"),
        ("[queue]\nmax_claim_jitter_ms = 10\n", "queue.max_claim_jitter_ms"),
    ],
)
def test_changed_queue_protocol_limit_warns(tmp_path, toml, named):
    # api-ops §4.2: the [protocol], [watch] and [queue] defaults are the /v0 contract and
    # check-config warns when any differs (lease clamps and claim jitter are in that table).
    warnings = contract_warnings(load(tmp_path, toml))
    assert any(named in w for w in warnings), warnings


def test_insecure_switch_warns(tmp_path):
    cfg = load(tmp_path, env={"TOPICD_ALLOW_INSECURE_NO_AUTH": "1"})
    assert any("allow_insecure_no_auth" in w for w in contract_warnings(cfg))
