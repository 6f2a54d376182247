"""Regenerate docs/dashboard.png: start `topicd serve`, drive a mixed load (steady writes,
a watch session that falls behind, a queue nobody works, a router), open the dashboard in
headless Chromium (Debian's `chromium` and `chromium-driver`) and photograph it.

    python tools/dashboard_screenshot.py [OUT.png] [--seconds N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.browser import Server, find_chromium, open_browser  # noqa: E402

ENV = {
    "TOPICD_DASHBOARD_INTERVAL_MS": "500",
    "TOPICD_DASHBOARD_HISTORY_POINTS": "240",  # the charts span two minutes
    "TOPICD_DASHBOARD_WORKER_STALE_MS": "3000",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=str(ROOT / "docs" / "dashboard.png"))
    ap.add_argument("--seconds", type=float, default=40.0, help="load before the picture")
    args = ap.parse_args()
    if find_chromium() is None:
        print("chromium and chromedriver are needed: apt-get install chromium chromium-driver")
        return 1
    with tempfile.TemporaryDirectory() as work:
        server = Server(Path(work), ENV)
        stop = threading.Event()
        try:
            server.write("orders", 1)
            server.write("audit", 1)
            server.watch_from("orders", 1)  # never streamed: its lag grows with the writes
            server.write("billing", 1, durability="fsync")
            server.watch_from("billing", 1)
            server.router("orders", "audit")
            server.queue("jobs")
            server.queue("emails")
            server.write("jobs", 120)
            server.write("emails", 30)
            server.claim("emails", 8)

            def load() -> None:
                n = 0
                while not stop.is_set():
                    burst = 200 + 150 * ((n // 20) % 3)  # a changing rate for the chart
                    server.write("orders", burst)
                    if n % 5 == 0:
                        server.write("billing", 20)
                    n += 1
                    time.sleep(0.1)

            thread = threading.Thread(target=load, daemon=True)
            thread.start()
            with open_browser(1400, 1500) as page:
                page.get(server.url + "/_topicd/dashboard")
                deadline = time.monotonic() + args.seconds
                while time.monotonic() < deadline:
                    time.sleep(1)
                    server.claim("emails", 1)  # one queue has a (slow) worker
                page.save_screenshot(args.out)
            stop.set()
            thread.join(timeout=10)
        finally:
            stop.set()
            server.kill()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
