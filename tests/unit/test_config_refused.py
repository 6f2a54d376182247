"""Settings of features this version does not have are refused unless left at default.

Method: `load_config` with a TOML file in `tmp_path` and an explicit environment, as in
test_config.py. Every key under a `NOT_IMPLEMENTED` entry is set to a value other than
its default, once in the file and once through its canonical environment variable, and
must raise `ConfigError` naming that key; the same keys at their defaults, and the
shipped `conf/topicd.toml`, load. The table itself is checked against the registry (no
entry names a key that does not exist) and against docs/configuration.md.
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


REFUSED = [(p, d, s) for p, d, s in leaves() if refused(p)]


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
    for entry in NOT_IMPLEMENTED:
        assert any(p == entry or p.startswith(entry + ".") for p in paths), entry


def test_the_refused_keys_are_the_expected_ones():
    assert {p for p, _, _ in REFUSED} == {
        "storage.cold_dir",
        "storage.tiering.hot_retain_segments",
        "storage.tiering.hot_retain_bytes",
    }


@pytest.mark.parametrize(("path", "default", "spec"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_non_default_value_in_the_file_is_refused_naming_the_key(tmp_path, path, default, spec):
    file = tmp_path / "topicd.toml"
    file.write_text(toml_setting(path, other_value(default)))
    with pytest.raises(ConfigError, match=rf"^{path}: not implemented") as exc:
        load_config(file, env={}, flags={})
    assert _toml_value(default) in str(exc.value)


@pytest.mark.parametrize(("path", "default", "spec"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_non_default_value_from_the_environment_is_refused(path, default, spec):
    assert isinstance(spec, KeySpec)
    for var in env_names(path, spec):
        with pytest.raises(ConfigError, match=rf"^{path}: not implemented"):
            load_config(None, env={var: str(other_value(default))}, flags={})


@pytest.mark.parametrize(("path", "default", "spec"), REFUSED, ids=[r[0] for r in REFUSED])
def test_the_default_value_written_out_is_accepted(tmp_path, path, default, spec):
    file = tmp_path / "topicd.toml"
    file.write_text(toml_setting(path, default))
    assert load_config(file, env={}, flags={}) == DEFAULT


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
