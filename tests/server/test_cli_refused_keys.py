"""`serve` and `check-config` on the keys of features a version may not have yet, and on
the cold-tier keys that used to be refused.

Method: the real command in subprocesses, reusing test_cli.py's clean-environment runner
(`run_many`, concurrent one-shot commands). The cold-tier keys (once refused) are given
through the file, a `TOPICD_*` variable or a legacy `TOPICS_*` variable and must load; a
cold directory overlapping the data directory must exit 2 naming the key, and `serve`
must not have touched its data directory. No key is refused today (`NOT_IMPLEMENTED` is
empty; test_config_refused.py checks the mechanism with a stand-in entry).
"""

from __future__ import annotations

import pytest

from tests.server.test_cli import run_many

pytestmark = pytest.mark.slow


def test_the_cold_tier_keys_are_accepted_now(tmp_path):
    (tmp_path / "c.toml").write_text(
        '[storage]\ncold_dir = "cold"\n[storage.tiering]\nhot_retain_segments = 2\n'
        "hot_retain_bytes = 1048576\n"
    )
    (tmp_path / "e.toml").write_text("")
    results = run_many(
        tmp_path,
        [
            (["check-config", "--config", "c.toml"], {}),
            (
                ["check-config", "--config", "e.toml"],
                {"TOPICS_COLD_DIR": "cold2", "TOPICD_HOT_RETAIN_SEGMENTS": "0"},
            ),
            (["check-config", "--config", "e.toml"], {"TOPICS_HOT_RETAIN_BYTES": "4096"}),
        ],
    )
    assert [(r.returncode, r.stderr) for r in results if r.returncode != 0] == []


def test_a_cold_dir_overlapping_the_data_dir_exits_2(tmp_path):
    (tmp_path / "c.toml").write_text('[storage]\ndata_dir = "d"\ncold_dir = "d/cold"\n')
    results = run_many(
        tmp_path,
        [
            (["check-config", "--config", "c.toml"], {}),
            (["serve", "--config", "c.toml", "--port", "0"], {}),
            (["serve", "--port", "0", "--data-dir", "d"], {"TOPICD_COLD_DIR": "d"}),
        ],
    )
    wrong = [
        (r.args, r.returncode, r.stderr)
        for r in results
        if r.returncode != 2 or "storage.cold_dir" not in r.stderr
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
