"""The built site, served on 127.0.0.1 and opened in Debian's Chromium, driven by Selenium.

tests/test_site.py checks every page this way; maintainer/site/screenshot.py takes the README's
picture of the home page. Nothing is downloaded: the browser is the system's
(`apt-get install chromium chromium-driver`) and it resolves no host but 127.0.0.1.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from layout import REPO as ROOT

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = "apt-get install chromium chromium-driver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    # the site must read offline: any host but the local server fails to resolve
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]


def why_no_browser() -> str | None:
    """Why the site cannot be opened in a browser here, or None when it can."""
    for program in (CHROMIUM, CHROMEDRIVER):
        if not program.is_file():
            return f"no {program}: install Debian's Chromium with `{INSTALL}`"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "Selenium is not installed: pip install -r requirements-dev.txt"
    return None


def build(site_dir: Path) -> float:
    """`mkdocs build --strict` into site_dir; returns the seconds it took."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)]
    # Material's notice about a future MkDocs 2.0: mkdocs is pinned below it
    env = dict(os.environ, NO_MKDOCS_2_WARNING="true")
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(f"`mkdocs build --strict` failed:\n{done.stdout}{done.stderr}")
    return seconds


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:
        pass


@contextmanager
def serve(folder: Path) -> Iterator[str]:
    """Serve folder on 127.0.0.1 on a free port; yields its address, ending in '/'."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def chromium(profile_dir: Path, width: int = 1280, height: int = 900) -> Iterator:
    """A headless Chromium with a fresh profile in profile_dir, its console log kept, showing
    pages width x height pixels."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver named, so that Selenium looks nothing up and downloads nothing
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        # the page's own area width x height (the window's size includes the browser's frame)
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        yield driver
    finally:
        driver.quit()
