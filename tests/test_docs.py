"""Docs stay current: the key table in docs/configuration.md is the registry's own output,
conf/topicd.toml is exactly what `topicd print-default-config` prints, every link in the
docs resolves inside the repository (files and headings), nothing cites a document
outside it, docs/README.md lists every page, and docs/api.md lists every route the app
serves. (tests/test_console_docs.py runs the console examples.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from topicd.config import DEFAULT, markdown_table, render_toml

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_lists_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text("utf-8")
    begin = text.index("-->\n", text.index("<!-- BEGIN KEYS")) + 4
    end = text.index("<!-- END KEYS -->")
    assert text[begin:end] == markdown_table()


def test_default_config_file_matches_the_registry():
    assert (ROOT / "conf" / "topicd.toml").read_text("utf-8") == render_toml(DEFAULT, redact=False)


# --------------------------------------------------------------------------------------
# The docs stand alone: links resolve inside the repository, nothing points outside it
# --------------------------------------------------------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _outside_code(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to `-`, `-N` for
    repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_code(path.read_text("utf-8")):
        m = re.match(r"^#{1,6} (.+)$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchor_slugs_follow_github():
    doc = ROOT / "docs" / "api-topics.md"
    assert "put-v0topicstopic-create-or-configure" in anchors(doc)
    assert "the-match-syntax" in anchors(doc)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(doc: Path):
    for line in _outside_code(doc.read_text("utf-8")):
        for target in _LINK.findall(line):
            assert "://" not in target and not target.startswith("mailto:"), (
                f"{doc.name}: {target}: the docs link nothing outside the repository"
            )
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            assert dest.exists(), f"{doc.name}: {target}: no such file"
            assert dest.is_relative_to(ROOT), f"{doc.name}: {target}: outside the repository"
            if anchor:
                assert anchor in anchors(dest), f"{doc.name}: {target}: no such heading"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_nothing_outside_the_repository(doc: Path):
    text = doc.read_text("utf-8")
    for needle in ("shared/", "/work/", "api-ops §", "README §", "spec README"):
        assert needle not in text, f"{doc.name} mentions {needle!r}"
    assert not re.search(r"\bspec\b", text), f"{doc.name} cites a spec: the docs are the contract"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text("utf-8")
    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert listed >= pages, f"docs/README.md does not list {sorted(pages - listed)}"


async def test_api_doc_lists_every_served_route():
    """Every route the app serves is in docs/api.md's table (as `/v0/topics/:topic`)."""
    from topicd.testing.harness import open_app

    text = (ROOT / "docs" / "api.md").read_text("utf-8")
    served = text[text.index("## Routes served") : text.index("## Transport")]
    async with open_app() as h:
        for rule in h.app.url_map.iter_rules():
            if rule.endpoint == "static":
                continue
            path = re.sub(r"<(?:\w+:)?(\w+)>", r":\1", rule.rule)
            assert f"`{path}`" in served, f"docs/api.md does not list {path}"
            for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
                row = next(
                    (r for r in served.splitlines() if f"`{path}`" in r and f"`{method}`" in r),
                    None,
                )
                assert row is not None, f"docs/api.md has no `{method}` row for {path}"


NOT_SERVED: list[tuple[str, str]] = []  # routes documented ahead of the server: none today
