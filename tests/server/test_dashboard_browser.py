"""The dashboard in a real browser: headless Chromium, driven by Selenium, on the page a
real `topicd serve` subprocess serves.

Method: start the server with small thresholds (lag amber from 5 and red from 20, in
flight amber from 1 and red from 3, worker off after 1 s, a snapshot every 250 ms), open
the page, drive load over HTTP and wait (bounded, polling the page as a user would see
it) for the page to show it: zones change colour, numbers move, a queue nobody works
shows "worker off", the charts get drawn, and when the server stops the page turns
"stale". A screenshot goes to the test's temporary directory, never into the tree.

Skips only when no Chromium or chromedriver is installed; with
`TOPICD_REQUIRE_BROWSER=1` (set by `.ci/run`) a missing browser fails instead.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.server.browser import Server, find_chromium, open_browser

pytestmark = pytest.mark.slow

WAIT_S = 20
ENV = {
    "TOPICD_DASHBOARD_INTERVAL_MS": "250",
    "TOPICD_DASHBOARD_LAG_WARN": "5",
    "TOPICD_DASHBOARD_LAG_PAUSE": "20",
    "TOPICD_DASHBOARD_INFLIGHT_WARN": "1",
    "TOPICD_DASHBOARD_INFLIGHT_PAUSE": "3",
    "TOPICD_DASHBOARD_WORKER_STALE_MS": "1000",
}
GREEN, AMBER, RED = "rgba(46, 125, 50, 1)", "rgba(230, 149, 0, 1)", "rgba(198, 40, 40, 1)"


@pytest.fixture
def chromium():
    required = os.environ.get("TOPICD_REQUIRE_BROWSER") == "1"
    missing = None
    if find_chromium() is None:
        missing = (
            "chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
        )
    elif importlib.util.find_spec("selenium") is None:
        missing = "selenium is not installed (pip install -e '.[dev]')"
    if missing is not None:
        if required:
            pytest.fail(missing)
        pytest.skip(missing)


def test_dashboard_live_zones_worker_off_charts_and_stale(chromium, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = Server(tmp_path, ENV)
    try:
        server.write("orders", 1)
        server.watch_from("orders", 1)  # a reader at the head: lag 0
        server.queue("jobs")
        with open_browser() as page:
            wait = WebDriverWait(page, WAIT_S, poll_frequency=0.05)
            page.get(server.url + "/_topicd/dashboard")

            def text(css: str) -> str:
                return page.find_element(By.CSS_SELECTOR, css).text

            def zone_of(css: str) -> tuple[str | None, str]:
                """(data-zone, the colour the page paints for it) of an element's dot."""
                el = page.find_element(By.CSS_SELECTOR, css)
                dot = el.find_element(By.CSS_SELECTOR, ".zone")
                return el.get_attribute("data-zone"), dot.value_of_css_property("background-color")

            def until(what: str, check) -> None:
                def ok(_):
                    try:
                        return check()
                    except Exception:  # the row is being re-rendered: look again
                        return False

                wait.until(ok, message=what)

            until("the feed is live", lambda: text("#feed-state").lower() == "live")
            assert "stale" not in page.find_element(By.TAG_NAME, "body").get_attribute("class")
            until(
                "orders is listed, green",
                lambda: zone_of('tr[data-topic="orders"]') == ("green", GREEN),
            )
            appended = int(text("#appended").replace(",", ""))
            clock = text("#server-time")

            # lag 10: amber; lag 30: red (and the header says backpressure)
            server.write("orders", 10)
            until(
                "orders turns amber", lambda: zone_of('tr[data-topic="orders"]') == ("amber", AMBER)
            )
            assert text('tr[data-topic="orders"] td.lag') == "10"
            server.write("orders", 20)
            until("orders turns red", lambda: zone_of('tr[data-topic="orders"]') == ("red", RED))
            until("the header turns red", lambda: text("#status") == "BACKPRESSURE")
            assert (
                page.find_element(By.ID, "status").value_of_css_property("background-color") == RED
            )

            # the numbers are live
            until(
                "the appended count moves",
                lambda: int(text("#appended").replace(",", "")) >= appended + 30,
            )
            until("the server clock moves", lambda: text("#server-time") != clock)

            # a queue with jobs and nobody working it: worker off; then a claim: active, in flight
            server.write("jobs", 4)
            until("worker off", lambda: "worker off" in text('tr[data-queue="jobs"] .worker'))
            server.claim("jobs", 2)
            until("the worker is active", lambda: text('tr[data-queue="jobs"] .worker') == "active")
            until(
                "2 in flight: amber", lambda: zone_of('tr[data-queue="jobs"]') == ("amber", AMBER)
            )
            assert text('tr[data-queue="jobs"] .in-flight') == "2"

            # the charts are drawn on their canvases (the series line is blue)
            drawn = page.execute_script(
                """
                const c = document.getElementById(arguments[0]);
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0;
                for (let i = 0; i < d.length; i += 4) {
                  if (d[i] < 80 && d[i + 1] < 120 && d[i + 2] > 180 && d[i + 3] > 0) n++;
                }
                return n;
                """,
                "chart-rate",
            )
            assert drawn > 20, drawn
            page.save_screenshot(str(tmp_path / "dashboard.png"))

            # the server stops: the page greys out as stale instead of showing old numbers
            assert server.stop() == 0
            until("the page turns stale", lambda: text("#feed-state").lower() == "stale")
            assert "stale" in page.find_element(By.TAG_NAME, "body").get_attribute("class")
            assert page.find_element(By.ID, "stale-banner").is_displayed()
            until(
                "zones grey out",
                lambda: zone_of('tr[data-topic="orders"]')[1] not in (RED, AMBER, GREEN),
            )

            # a server on the same port again: the page reconnects by itself and is live
            server = Server(tmp_path, ENV, port=server.port)
            until("live again after the restart", lambda: text("#feed-state").lower() == "live")
            # (the queue's jobs were recovered; its leases, not durable, were not)
            until("jobs are back", lambda: text('tr[data-queue="jobs"] .ready') == "4")
    finally:
        server.kill()


def test_dashboard_with_keys_needs_the_header(chromium, tmp_path):
    """With keys on, the page and its feed need a `read` key as the header (here sent by
    the browser itself, as an authenticating proxy would add it)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = Server(tmp_path, {**ENV, "TOPICD_API_KEYS": "reader:read,writer:write"})
    try:
        with open_browser() as page:
            page.get(server.url + "/_topicd/dashboard")
            assert '"unauthorized"' in page.find_element(By.TAG_NAME, "body").text
            page.execute_cdp_cmd("Network.enable", {})
            page.execute_cdp_cmd(
                "Network.setExtraHTTPHeaders", {"headers": {"Authorization": "Bearer writer"}}
            )
            page.get(server.url + "/_topicd/dashboard")
            assert '"forbidden"' in page.find_element(By.TAG_NAME, "body").text
            page.execute_cdp_cmd(
                "Network.setExtraHTTPHeaders", {"headers": {"Authorization": "Bearer reader"}}
            )
            page.get(server.url + "/_topicd/dashboard")
            WebDriverWait(page, WAIT_S, poll_frequency=0.05).until(
                lambda p: p.find_element(By.ID, "feed-state").text.lower() == "live",
                message="the feed is live with the reader key",
            )
    finally:
        server.kill()
