"""`serve` and `check-config` refuse settings of features this version does not have.

Method: the real command in subprocesses, reusing test_cli.py's clean-environment runner
(`run_many`, concurrent one-shot commands). Each refused key is given a non-default value
through the file, a `TOPICD_*` variable or a legacy `TOPICS_*` variable; both commands must
exit 2 with the key named on stderr, and `serve` must not have touched its data directory.
"""

from __future__ import annotations

import pytest

from tests.server.test_cli import run_many

pytestmark = pytest.mark.slow

# (file text, environment, key named)
CASES = [
    ('[storage]\ncold_dir = "/mnt/cold"\n', {}, "storage.cold_dir"),
    ("[storage.tiering]\nhot_retain_bytes = 1\n", {}, "storage.tiering.hot_retain_bytes"),
]


def test_check_config_and_serve_exit_2_naming_the_key(tmp_path):
    calls = []
    for i, (toml, env, _) in enumerate(CASES):
        (tmp_path / f"c{i}.toml").write_text(toml)
        calls.append((["check-config", "--config", f"c{i}.toml"], env))
        calls.append((["serve", "--config", f"c{i}.toml", "--port", "0", "--data-dir", "d"], env))
    results = run_many(tmp_path, calls)
    wrong = [
        (CASES[n // 2], r.args[3], r.returncode, r.stderr)
        for n, r in enumerate(results)
        if r.returncode != 2 or f"{CASES[n // 2][2]}: not implemented" not in r.stderr
    ]
    assert wrong == []
    assert not (tmp_path / "d").exists()


def test_defaults_written_out_are_accepted(tmp_path):
    (tmp_path / "c.toml").write_text(
        '[storage]\ncold_dir = ""\n[routers]\ntick_ms = 50\n[queue]\nmax_claim = 1000\n'
    )
    (result,) = run_many(tmp_path, [(["check-config", "--config", "c.toml"], {})])
    assert result.returncode == 0, result.stderr


def test_router_keys_are_accepted_now(tmp_path):
    (tmp_path / "c.toml").write_text("[limits]\nmax_routers = 5\n[routers]\nbatch = 64\n")
    (result,) = run_many(
        tmp_path,
        [(["check-config", "--config", "c.toml"], {"TOPICD_ROUTER_TICK_MS": "10"})],
    )
    assert result.returncode == 0, result.stderr


def test_segment_keys_are_accepted_now(tmp_path):
    (tmp_path / "c.toml").write_text(
        "[storage.segments]\nmax_events = 100\nmax_bytes = 1048576\nmax_age_ms = 0\n"
    )
    (result,) = run_many(
        tmp_path,
        [(["check-config", "--config", "c.toml"], {"TOPICD_SEGMENT_MAX_EVENTS": "50"})],
    )
    assert result.returncode == 0, result.stderr
