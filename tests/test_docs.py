"""Docs stay current: the key table in docs/configuration.md is the registry's own output,
and conf/topicd.toml is exactly what `topicd print-default-config` prints."""

from __future__ import annotations

from pathlib import Path

from topicd.config import DEFAULT, markdown_table, render_toml

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_lists_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text("utf-8")
    begin = text.index("-->\n", text.index("<!-- BEGIN KEYS")) + 4
    end = text.index("<!-- END KEYS -->")
    assert text[begin:end] == markdown_table()


def test_default_config_file_matches_the_registry():
    assert (ROOT / "conf" / "topicd.toml").read_text("utf-8") == render_toml(DEFAULT, redact=False)
