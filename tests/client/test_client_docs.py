"""The client's documentation stays true: the README's Python example and the first
program of docs/client.md run as printed, and the shell examples of docs/client.md
print what the page shows.

Method: a real server in this process (port 0). Python examples run in a child
interpreter with the printed URL replaced by the server's. Shell examples are the
```text blocks of docs/client.md whose lines start with `$ `: each command runs under
`bash -c` (with `topicd` meaning this interpreter's `-m topicd` and `TOPICD_URL` set),
in page order against one fresh server, and its output must equal the lines under it,
except `$ts` values (compared as "some integer").
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import trio

from tests.server.helpers import served
from topicd.testing.harness import make_config

ROOT = Path(__file__).resolve().parents[2]
PRINTED_URL = "http://127.0.0.1:4000"

pytestmark = pytest.mark.slow


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text("utf-8"), re.M | re.S)


def shell_steps(path: Path) -> list[tuple[str, str]]:
    steps = []
    for block in re.findall(r"^```text\n(.*?)^```", path.read_text("utf-8"), re.M | re.S):
        if not block.startswith("$ "):
            continue
        command, _, output = block.partition("\n")
        steps.append((command[2:], output))
    return steps


def env(url: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TOPICD_", "TOPICS_"))}
    return clean | {"TOPICD_URL": url}


async def run(args: list[str], url: str) -> tuple[int, str, str]:
    with trio.fail_after(30):
        proc = await trio.run_process(
            args, capture_stdout=True, capture_stderr=True, env=env(url), check=False
        )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


@pytest.mark.parametrize(("doc", "index"), [("README.md", 0), ("docs/client.md", 0)])
async def test_python_example_runs_as_printed(doc, index):
    code = python_blocks(ROOT / doc)[index]
    assert PRINTED_URL in code
    async with served(make_config(server={"port": 0})) as (_e, _a, host, port):
        url = f"http://{host}:{port}"
        rc, out, err = await run([sys.executable, "-c", code.replace(PRINTED_URL, url)], url)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert len(lines) == 2, out
    assert lines[0].startswith("Record(topic='events', seq=1, ")
    assert 'data_json=b\'{"hello":"world"}\'' in lines[0]
    assert lines[1] == "job 1 {'n': 1}"


def normalize(text: str) -> str:
    return re.sub(r'"\$ts":\d+', '"$ts":0', text)


async def test_shell_examples_print_what_the_page_shows():
    steps = shell_steps(ROOT / "docs" / "client.md")
    assert [c.split(" | ")[-1].split()[1] for c, _ in steps] == ["write", "tail", "topics"]
    topicd = f"{sys.executable} -m topicd"
    async with served(make_config(server={"port": 0})) as (_e, _a, host, port):
        url = f"http://{host}:{port}"
        for command, expected in steps:
            real = re.sub(r"(^|\| )topicd ", lambda m: f"{m.group(1)}{topicd} ", command)
            rc, out, err = await run(["bash", "-c", real], url)
            assert (rc, err) == (0, ""), command
            assert normalize(out) == normalize(expected), f"{command}:\n{out}"
