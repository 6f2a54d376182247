"""The jetstream backend's configuration keys: loading and validation."""

from __future__ import annotations

import pytest

from topicd.config import ConfigError, load_config


def test_defaults_are_the_embedded_backend():
    cfg = load_config(None, env={})
    assert cfg.storage.backend == "embedded"
    assert cfg.storage.jetstream.servers == ("nats://127.0.0.1:4222",)
    assert cfg.storage.jetstream.prefix == "topicd"


def test_backend_and_servers_from_the_environment():
    cfg = load_config(
        None,
        env={
            "TOPICD_STORAGE_BACKEND": "jetstream",
            "TOPICD_JETSTREAM_SERVERS": "nats://a:4222, nats://b:4222",
            "TOPICD_JETSTREAM_PREFIX": "prod-1",
        },
    )
    assert cfg.storage.backend == "jetstream"
    assert cfg.storage.jetstream.servers == ("nats://a:4222", "nats://b:4222")
    assert cfg.storage.jetstream.prefix == "prod-1"


def test_servers_from_a_file(tmp_path):
    path = tmp_path / "topicd.toml"
    path.write_text(
        '[storage]\nbackend = "jetstream"\n[storage.jetstream]\nservers = ["nats://x:1"]\n'
    )
    assert load_config(path, env={}).storage.jetstream.servers == ("nats://x:1",)


def test_an_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match=r"storage\.backend"):
        load_config(None, env={"TOPICD_STORAGE_BACKEND": "raft"})


def test_jetstream_without_servers_is_refused(tmp_path):
    path = tmp_path / "topicd.toml"
    path.write_text('[storage]\nbackend = "jetstream"\n[storage.jetstream]\nservers = []\n')
    with pytest.raises(ConfigError, match=r"storage\.jetstream\.servers"):
        load_config(path, env={})


@pytest.mark.parametrize("prefix", ["", "a.b", "x*", "a" * 33, "é"])
def test_a_bad_prefix_is_refused(prefix):
    with pytest.raises(ConfigError, match=r"storage\.jetstream\.prefix"):
        load_config(None, env={"TOPICD_JETSTREAM_PREFIX": prefix})


def test_a_32_character_prefix_is_accepted():
    assert load_config(None, env={"TOPICD_JETSTREAM_PREFIX": "a" * 32}).storage.jetstream.prefix


@pytest.mark.parametrize(("value", "ok"), [("0", False), ("1", True), ("5", True), ("6", False)])
def test_replicas_bounds(value, ok):
    env = {"TOPICD_STORAGE_JETSTREAM_REPLICAS": value}
    if ok:
        assert load_config(None, env=env).storage.jetstream.replicas == int(value)
    else:
        with pytest.raises(ConfigError, match=r"storage\.jetstream\.replicas"):
            load_config(None, env=env)


@pytest.mark.parametrize(("value", "ok"), [("99", False), ("100", True)])
def test_request_timeout_lower_bound(value, ok):
    env = {"TOPICD_STORAGE_JETSTREAM_REQUEST_TIMEOUT_MS": value}
    if ok:
        assert load_config(None, env=env).storage.jetstream.request_timeout_ms == 100
    else:
        with pytest.raises(ConfigError, match=r"storage\.jetstream\.request_timeout_ms"):
            load_config(None, env=env)


def test_the_cold_tier_is_refused_with_jetstream(tmp_path):
    env = {"TOPICD_STORAGE_BACKEND": "jetstream", "TOPICD_COLD_DIR": str(tmp_path / "cold")}
    with pytest.raises(ConfigError, match=r"storage\.cold_dir"):
        load_config(None, env=env)
    env["TOPICD_STORAGE_BACKEND"] = "embedded"
    assert load_config(None, env=env).storage.cold_dir
