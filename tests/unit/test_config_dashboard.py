"""The `[dashboard]` section: its defaults, its environment names and its validation.

Method: `load_config` with no file and a given environment; failures are asserted as
`ConfigError` naming the key."""

from __future__ import annotations

import pytest

from topicd.config import ConfigError, load_config


def test_defaults_and_environment_names():
    d = load_config(None, {}).dashboard
    assert (d.enabled, d.path, d.interval_ms, d.top_n, d.max_viewers) == (
        True,
        "/_topicd/dashboard",
        1000,
        50,
        16,
    )
    assert (d.pressure_warn, d.pressure_pause, d.lag_warn, d.lag_pause) == (0.4, 0.8, 1000, 10000)
    assert (d.inflight_warn, d.inflight_pause, d.worker_stale_ms, d.stale_after_intervals) == (
        50,
        200,
        10000,
        3,
    )
    env = {
        "TOPICD_DASHBOARD_ENABLED": "false",
        "TOPICD_DASHBOARD_PATH": "/ops/dash",
        "TOPICD_DASHBOARD_INTERVAL_MS": "250",
        "TOPICD_DASHBOARD_MAX_VIEWERS": "2",
        "TOPICD_DASHBOARD_LAG_WARN": "5",
    }
    d = load_config(None, env).dashboard
    assert (d.enabled, d.path, d.interval_ms, d.max_viewers, d.lag_warn) == (
        False,
        "/ops/dash",
        250,
        2,
        5,
    )


@pytest.mark.parametrize(
    "path", ["dash", "/", "/dash/", "/a//b", "/dash?x=1", "/v0", "/v0/dash", "/healthz", "/a b"]
)
def test_bad_path_is_refused(path):
    with pytest.raises(ConfigError, match=r"dashboard\.path"):
        load_config(None, {"TOPICD_DASHBOARD_PATH": path})


@pytest.mark.parametrize(
    ("warn", "pause"),
    [
        ("pressure_warn", "pressure_pause"),
        ("lag_warn", "lag_pause"),
        ("inflight_warn", "inflight_pause"),
    ],
)
def test_warn_above_pause_is_refused(warn, pause):
    env = {f"TOPICD_DASHBOARD_{warn.upper()}": "0.9", f"TOPICD_DASHBOARD_{pause.upper()}": "0.5"}
    if not warn.startswith("pressure"):
        env = {f"TOPICD_DASHBOARD_{warn.upper()}": "9", f"TOPICD_DASHBOARD_{pause.upper()}": "5"}
    with pytest.raises(ConfigError, match=rf"dashboard\.{warn}"):
        load_config(None, env)
    # equal is allowed: the amber band is then empty
    same = {k: "5" if not warn.startswith("pressure") else "0.5" for k in env}
    load_config(None, same)


@pytest.mark.parametrize(
    ("key", "low", "high"),
    [
        ("INTERVAL_MS", "99", "60001"),
        ("TOP_N", "0", "1001"),
        ("MAX_VIEWERS", "0", None),
        ("WORKER_STALE_MS", "99", None),
        ("STALE_AFTER_INTERVALS", "1", None),
    ],
)
def test_bounds(key, low, high):
    for value in (low, high):
        if value is None:
            continue
        with pytest.raises(ConfigError, match=rf"dashboard\.{key.lower()}"):
            load_config(None, {f"TOPICD_DASHBOARD_{key}": value})
