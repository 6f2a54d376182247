"""Rewrite the outputs of the ```console blocks of README.md / docs/*.md from a real run.

    python tools/regen_console.py README.md docs/api-topics.md

Each file's commands run in order against a fresh `topicd serve` (exactly as
tests/test_console_docs.py runs them), and the text under every command is replaced by
what the server printed. A stream (`curl -sN`) keeps the number of frames the file shows.
Review the diff: the new outputs are what a reader will see.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.crash.harness import serving  # noqa: E402
from tests.test_console_docs import console_steps, run_steps  # noqa: E402


async def regen(path: str) -> None:
    steps = console_steps(path)
    with tempfile.TemporaryDirectory() as tmp:
        async with serving(Path(tmp)) as server:
            wids: dict[str, str] = {}
            outcomes = await run_steps(steps, server, wids)
    for o in outcomes:  # keep the printed watch ids: commands further down use them
        for printed, real in wids.items():
            o.text = o.text.replace(real, printed)
    doc = ROOT / path
    lines = doc.read_text("utf-8").split("\n")
    # replace from the last step up, so earlier line numbers stay valid
    for o in reversed(outcomes):
        start = int(o.step.where.rsplit(":", 1)[1]) - 1  # the `$ ` line
        end = start + 1
        while lines[start].endswith("\\"):
            start += 1
            end += 1
        old = o.step.expected.split("\n") if o.step.expected else []
        assert lines[end : end + len(old)] == old, f"{o.step.where}: the file changed"
        lines[end : end + len(old)] = o.text.split("\n")
    doc.write_text("\n".join(lines), "utf-8")
    print(f"{path}: {len(outcomes)} outputs")


async def main(paths: list[str]) -> None:
    for path in paths:
        await regen(path)


if __name__ == "__main__":
    trio.run(main, sys.argv[1:] or ["README.md"])
