"""`topicd.client` stands alone: it imports nothing of the server.

Method: a text scan of `topicd/client/*.py` for imports of `topicd.` modules outside
`topicd.client`, and a fresh interpreter that imports `topicd.client` and reports which
server modules (and Quart, Hypercorn) ended up in `sys.modules`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "topicd" / "client"


def test_client_modules_import_only_the_client():
    rx = re.compile(r"^\s*(?:from|import)\s+topicd\.(?!client\b)", re.M)
    offenders = [p.name for p in sorted(CLIENT.glob("*.py")) if rx.search(p.read_text("utf-8"))]
    assert not offenders


def test_importing_the_client_loads_no_server_module():
    code = (
        "import sys, topicd.client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('quart', 'quart_trio', "
        "'hypercorn') or (m.startswith('topicd.') and not m.startswith('topicd.client')))\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
