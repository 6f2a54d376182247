"""Settings of features this version does not have are refused unless left at default.

Method: `load_config` with a TOML file in `tmp_path` and an explicit environment, as in
test_config.py. No key is refused in this version, so the mechanism is checked with a
stand-in `NOT_IMPLEMENTED` entry (the `storage.tiering` section, patched in): every key
under it is set to a value other than its default, once in the file and once through its
canonical environment variable, and must raise `ConfigError` naming that key; the same
keys at their defaults, and the shipped `conf/topicd.toml`, load. The table itself is
checked against the registry (no entry names a key that does not exist) and against
docs/configuration.md. The cold-tier keys (refused until this version) load, and a cold
directory overlapping the data directory is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from topicd.config import (
    DEFAULT,
    NOT_IMPLEMENTED,
    ConfigError,
    KeySpec,
    _toml_value,
    env_names,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]


def leaves(obj=DEFAULT, prefix=""):
    """(path, default, KeySpec) of every plain key."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if "section" in f.metadata:
            yield from leaves(value, f"{prefix}{f.name}.")
        elif "key" in f.metadata:
            yield prefix + f.name, value, f.metadata["key"]


def refused(path: str) -> bool:
    return any(path == e or path.startswith(e + ".") for e in NOT_IMPLEMENTED)


# a stand-in entry for the mechanism tests (no key is refused in this version)
STAND_IN = {"storage.tiering": "a feature under test"}
STAND_IN_KEYS = [(p, d, s) for p, d, s in leaves() if p.startswith("storage.tiering.")]


@pytest.fixture
def stand_in(monkeypatch):
    for entry, feature in STAND_IN.items():
        monkeypatch.setitem(NOT_IMPLEMENTED, entry, feature)


def other_value(default):
    if isinstance(default, str):
        return "/elsewhere"
    assert isinstance(default, int) and not isinstance(default, bool)
    return default + 1


def toml_setting(path: str, value) -> str:
    section, _, name = path.rpartition(".")
    return f"[{section}]\n{name} = {_toml_value(value)}\n"


def test_every_entry_names_a_key_or_a_section():
    paths = [p for p, _, _ in leaves()]
    for entry in [*NOT_IMPLEMENTED, *STAND_IN]:
        assert any(p == entry or p.startswith(entry + ".") for p in paths), entry


def test_no_key_is_refused_in_this_version():
    # the cold tier (storage.cold_dir, storage.tiering.*) was the last one
    assert {p for p, _, _ in leaves() if refused(p)} == set()


@pytest.mark.parametrize(
    ("path", "default", "spec"), STAND_IN_KEYS, ids=[r[0] for r in STAND_IN_KEYS]
)
def test_a_non_default_value_in_the_file_is_refused_naming_the_key(
    tmp_path, stand_in, path, default, spec
):
    file = tmp_path / "topicd.toml"
    file.write_text(toml_setting(path, other_value(default)))
    with pytest.raises(ConfigError, match=rf"^{path}: not implemented") as exc:
        load_config(file, env={}, flags={})
    assert _toml_value(default) in str(exc.value)


@pytest.mark.parametrize(
    ("path", "default", "spec"), STAND_IN_KEYS, ids=[r[0] for r in STAND_IN_KEYS]
)
def test_a_non_default_value_from_the_environment_is_refused(stand_in, path, default, spec):
    assert isinstance(spec, KeySpec)
    for var in env_names(path, spec):
        with pytest.raises(ConfigError, match=rf"^{path}: not implemented"):
            load_config(None, env={var: str(other_value(default))}, flags={})


@pytest.mark.parametrize(
    ("path", "default", "spec"), STAND_IN_KEYS, ids=[r[0] for r in STAND_IN_KEYS]
)
def test_the_default_value_written_out_is_accepted(tmp_path, stand_in, path, default, spec):
    file = tmp_path / "topicd.toml"
    file.write_text(toml_setting(path, default))
    assert load_config(file, env={}, flags={}) == DEFAULT


def test_the_cold_tier_keys_are_accepted(tmp_path):
    file = tmp_path / "topicd.toml"
    file.write_text(
        '[storage]\ndata_dir = "/srv/hot"\ncold_dir = "/srv/cold"\n'
        "[storage.tiering]\nhot_retain_segments = 0\nhot_retain_bytes = 1048576\n"
    )
    cfg = load_config(file, env={}, flags={})
    assert cfg.storage.cold_dir == "/srv/cold"
    assert (cfg.storage.tiering.hot_retain_segments, cfg.storage.tiering.hot_retain_bytes) == (
        0,
        1048576,
    )
    env = {"TOPICS_COLD_DIR": "/srv/c2", "TOPICD_HOT_RETAIN_SEGMENTS": "7"}
    cfg = load_config(None, env=env, flags={})
    assert (cfg.storage.cold_dir, cfg.storage.tiering.hot_retain_segments) == ("/srv/c2", 7)


@pytest.mark.parametrize(
    ("data_dir", "cold_dir"),
    [("/srv/d", "/srv/d"), ("/srv/d", "/srv/d/cold"), ("/srv/d", "/srv"), ("/srv/d", "/srv/d/")],
)
def test_a_cold_dir_overlapping_the_data_dir_is_refused(data_dir, cold_dir):
    env = {"TOPICD_DATA_DIR": data_dir, "TOPICD_COLD_DIR": cold_dir}
    with pytest.raises(ConfigError, match=r"^storage.cold_dir: .* overlaps storage.data_dir"):
        load_config(None, env=env, flags={})


def test_a_blank_cold_dir_is_refused_and_a_sibling_accepted():
    with pytest.raises(ConfigError, match=r"^storage.cold_dir: blank"):
        load_config(None, env={"TOPICD_COLD_DIR": "  "}, flags={})
    env = {"TOPICD_DATA_DIR": "/srv/d", "TOPICD_COLD_DIR": "/srv/d-cold"}
    assert load_config(None, env=env, flags={}).storage.cold_dir == "/srv/d-cold"


def test_the_shipped_config_file_loads():
    assert load_config(ROOT / "conf" / "topicd.toml", env={}, flags={}) == DEFAULT


def test_implemented_neighbours_stay_accepted(tmp_path):
    # the queue lease clamps shape every topic's stored config today
    file = tmp_path / "topicd.toml"
    file.write_text("[queue]\nmin_lease_ms = 50\nmax_claim_jitter_ms = 10\n")
    cfg = load_config(file, env={}, flags={})
    assert (cfg.queue.min_lease_ms, cfg.queue.max_claim_jitter_ms) == (50, 10)


def test_the_configuration_doc_lists_every_refused_entry():
    text = (ROOT / "docs" / "configuration.md").read_text("utf-8")
    missing = [e for e in NOT_IMPLEMENTED if f"`{e}`" not in text and f"`{e}.*`" not in text]
    assert missing == []
    if not NOT_IMPLEMENTED:
        assert "No key is refused in this version" in text
