"""Regenerate the files that mirror the config registry: conf/topicd.toml and the key
table of docs/configuration.md (tests/test_docs.py fails until this is run)."""

from __future__ import annotations

from pathlib import Path

from topicd.config import DEFAULT, markdown_table, render_toml

ROOT = Path(__file__).resolve().parents[1]

(ROOT / "conf" / "topicd.toml").write_text(render_toml(DEFAULT, redact=False), "utf-8")
doc = ROOT / "docs" / "configuration.md"
text = doc.read_text("utf-8")
begin = text.index("-->\n", text.index("<!-- BEGIN KEYS")) + 4
end = text.index("<!-- END KEYS -->")
doc.write_text(text[:begin] + markdown_table() + text[end:], "utf-8")
