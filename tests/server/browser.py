"""A real `topicd serve` in a subprocess and headless Chromium driven by Selenium, for the
dashboard's browser test and `tools/dashboard_screenshot.py`.

Chromium comes from the system (Debian's `chromium` and `chromium-driver` packages; `CHROMIUM`
and `CHROMEDRIVER` name other binaries). Selenium is told where the driver is, so it never
downloads one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
DRIVER_CANDIDATES = ("chromedriver", "/usr/lib/chromium/chromedriver")
BROWSER_CANDIDATES = ("chromium", "chromium-browser", "/usr/lib/chromium/chromium")


def find_chromium() -> tuple[str, str] | None:
    """(browser, driver) paths, or None when either is missing."""
    browser = os.environ.get("CHROMIUM") or next(
        (p for p in map(shutil.which, BROWSER_CANDIDATES) if p), None
    )
    driver = os.environ.get("CHROMEDRIVER") or next(
        (p for p in map(shutil.which, DRIVER_CANDIDATES) if p), None
    )
    if (
        browser is None
        or driver is None
        or not (os.path.exists(browser) and os.path.exists(driver))
    ):
        return None
    return browser, driver


@contextmanager
def open_browser(width: int = 1400, height: int = 1700):
    """A headless Chromium window of the given size (CSS pixels)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_chromium()
    assert found is not None
    browser, driver = found
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI containers run as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--force-device-scale-factor=1",
        "--hide-scrollbars",
    ):
        opts.add_argument(arg)
    d = webdriver.Chrome(options=opts, service=Service(executable_path=driver))
    try:
        yield d
    finally:
        d.quit()


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOPICD_", "TOPICS_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Server:
    """`topicd serve` on port 0 in a fresh data directory."""

    def __init__(self, work: Path, env: dict[str, str], port: int = 0) -> None:
        self.port_file = work / "port"
        self.port_file.unlink(missing_ok=True)
        self.log = (work / "server.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "topicd", "serve", "--port", str(port), "--data-dir", "data"],
            cwd=work,
            env=_child_env({"TOPICD_PORT_FILE": str(self.port_file), **env}),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        ready = threading.Event()

        def pump() -> None:
            """Copy the server's output to its log; `ready` once it says it serves."""
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                if b" listening on " in line:
                    ready.set()
            ready.set()  # it exited: the checks below say so

        threading.Thread(target=pump, daemon=True).start()
        assert ready.wait(30), "topicd did not turn ready within 30 s"
        assert self.proc.poll() is None, "topicd exited at start"
        self.port = int(self.port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=30)
        assert self.http.get("/v0/ready").status_code == 200

    def stop(self) -> int:
        """SIGTERM (a graceful drain), then the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            self.http.close()
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.http.close()
        self.log.close()

    # ---- load ---------------------------------------------------------------------------

    def write(self, topic: str, n: int, **config: object) -> None:
        body: dict[str, object] = {"records": [{"data": {"i": i}} for i in range(n)]}
        if config:
            body["config"] = config
        r = self.http.post(f"/v0/topics/{topic}", json=body)
        assert r.status_code in (200, 201), r.text

    def watch_from(self, topic: str, from_seq: int) -> str:
        """A watch session that nobody streams: its cursor stays, so the topic lags."""
        r = self.http.post("/v0/watch", json={"topics": {topic: {"from_seq": from_seq}}})
        assert r.status_code == 200, r.text
        return r.json()["wid"]

    def queue(self, name: str) -> None:
        r = self.http.put(f"/v0/topics/{name}", json={"type": "queue"})
        assert r.status_code in (200, 201), r.text

    def claim(self, name: str, n: int) -> None:
        r = self.http.post(f"/v0/topics/{name}/claim", json={"node": "w1", "max": n})
        assert r.status_code == 200, r.text

    def router(self, source: str, dest: str) -> None:
        r = self.http.put(f"/v0/routers/{source}->{dest}", json={"source": source, "dest": dest})
        assert r.status_code in (200, 201), r.text
