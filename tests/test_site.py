"""The course as a site (mkdocs.yml, maintainer/site/), read in a real browser.

The site is built with `mkdocs build --strict` (a broken link, file or anchor fails the build),
served on 127.0.0.1 and opened page by page in Debian's Chromium, driven by Selenium. The browser
resolves no host but 127.0.0.1, so a page that reached for the network would log an error.

    python -m pytest -q -n 0 -m site tests/test_site.py     # CI runs it as a stage of its own

The README's suite leaves these tests out (pytest.ini). Without Chromium they skip with the reason;
with CI=true they fail instead, as CI installs it. The last lines of the run give the build's
time, the browser's time, the site's size and what was checked; the screenshots of a home page, a
chapter, a diff and a notebook go to out/site_check/.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag

import pytest

from layout import REPO as ROOT
from maintainer.site.browser import build, chromium, serve, why_no_browser

SHOTS = ROOT / "out" / "site_check"
CHAPTER = "04_ddp/"
DIFF = "docs/diffs/04_ddp.diff/"
NOTEBOOK = "04_ddp/notebook/"

pytestmark = pytest.mark.site


class PageParser(HTMLParser):
    """A page's ids (the anchors it offers) and the addresses of what it loads."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.loads: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attributes = dict(attrs)
        for name in ("id", "name") if tag == "a" else ("id",):
            if attributes.get(name):
                self.ids.add(attributes[name])
        if tag == "link" and attributes.get("href"):
            self.loads.append(attributes["href"])
        if tag in ("script", "img", "iframe", "source", "audio", "video", "embed"):
            if attributes.get("src"):
                self.loads.append(attributes["src"])
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)


def parse(html: str) -> PageParser:
    parser = PageParser()
    parser.feed(html)
    return parser


REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)  # http://, https://, //host
# a script or a style that fetches from another host: import("https://…"), src = "//…", url(http…)
FETCHES_REMOTE = re.compile(
    r"""(?:import\s*\(|\bsrc\s*=|\burl\s*\(|@import)\s*["']?(?:https?:)?//""", re.I
)


@pytest.fixture(scope="module")
def summary(pytestconfig):
    """What the run measured, written at its end to out/site_check/summary.txt and shown."""
    figures: dict[str, str] = {}
    yield figures
    SHOTS.mkdir(parents=True, exist_ok=True)
    line = "site: " + ", ".join(f"{key} {value}" for key, value in figures.items())
    (SHOTS / "summary.txt").write_text(line + "\n", encoding="utf-8")
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}\n(also in {SHOTS.relative_to(ROOT)}/summary.txt)")


@pytest.fixture(scope="module")
def site(tmp_path_factory, summary) -> Path:
    """The site, built by `mkdocs build --strict` into a folder of its own."""
    folder = tmp_path_factory.mktemp("site") / "site"
    seconds = build(folder)
    size = subprocess.run(["du", "-sh", str(folder)], capture_output=True, text=True, check=True)
    summary["built in"] = f"{seconds:.1f} s"
    summary["size on disk"] = size.stdout.split()[0]
    return folder


@pytest.fixture(scope="module")
def browser(site, tmp_path_factory, summary):
    """(driver, address of the served site): skipped without Chromium, but a failure in CI."""
    why = why_no_browser()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    start = time.monotonic()
    with serve(site) as address, chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        driver.set_page_load_timeout(60)
        yield driver, address
    summary["browser"] = f"{time.monotonic() - start:.1f} s"


def fetch(url: str) -> tuple[int, str]:
    """The status and text of url, from the server itself (the browser gives no status)."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        return error.code, ""


def console_errors(driver) -> list[str]:
    """What the open page logged as errors (Chromium's level SEVERE) since the last call."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def pages(site: Path) -> list[str]:
    """Every page of the site, as its address relative to the site's root."""
    paths = []
    for page in sorted(site.rglob("*.html")):
        relative = page.relative_to(site).as_posix()
        paths.append(relative.removesuffix("index.html"))
    return paths


def test_the_site_loads_nothing_from_the_network(site):
    """No page or stylesheet names a script, font, stylesheet or image on another host."""
    remote = []
    for page in site.rglob("*.html"):
        parsed = parse(page.read_text(encoding="utf-8"))
        name = page.relative_to(site).as_posix()
        remote += [f"{name}: {address}" for address in parsed.loads if REMOTE.match(address)]
        remote += [f"{name}: a script fetches from another host" for script in parsed.scripts
                   if FETCHES_REMOTE.search(script)]  # fmt: skip
    for sheet in site.rglob("*.css"):
        if FETCHES_REMOTE.search(sheet.read_text(encoding="utf-8")):
            remote.append(f"{sheet.relative_to(site).as_posix()}: loads from another host")
    assert not remote, "the site must read offline:\n" + "\n".join(remote)


def test_every_page_opens_in_a_browser_with_its_images_links_and_anchors(browser, site, summary):
    driver, address = browser
    targets: dict[str, tuple[int, set[str]]] = {}  # address -> (status, ids of that page)

    def target(url: str) -> tuple[int, set[str]]:
        if url not in targets:
            status, text = fetch(url)
            targets[url] = (status, parse(text).ids if text else set())
        return targets[url]

    problems = []
    images = links = anchors = 0
    all_pages = pages(site)
    for page in all_pages:
        url = address + page
        status, _ = target(url)
        if status != 200:
            problems.append(f"{page or '/'}: status {status}")
            continue
        driver.get(url)
        for source, loaded in driver.execute_script(
            "return [...document.images].map(i => [i.currentSrc || i.src,"
            " i.complete && i.naturalWidth > 0])"
        ):
            images += 1
            if not loaded:
                problems.append(f"{page}: image not loaded: {source[:100]}")
        for resource in driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        ):
            if not resource.startswith((address, "data:", "blob:")):
                problems.append(f"{page}: fetched from another host: {resource}")
        for href in driver.execute_script(
            "return [...document.querySelectorAll('a[href]')].map(a => a.href)"
        ):
            if not href.startswith(address):
                continue  # an address on the web: a reader's browser opens it
            links += 1
            location, fragment = urldefrag(href)
            status, ids = target(location)
            if status != 200:
                problems.append(f"{page}: link to a missing page: {href}")
            elif fragment and unquote(fragment) not in ids:
                problems.append(f"{page}: link to a missing anchor: {href}")
            if fragment:
                anchors += 1
        # read last, so that what the page logs while it settles counts as well
        problems += [f"{page}: console: {message}" for message in console_errors(driver)]
    summary["pages"] = str(len(all_pages))
    summary["images"] = str(images)
    summary["internal links"] = f"{links} (to {len(targets)} addresses, {anchors} with an anchor)"
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:50])


def test_searching_local_rank_lists_chapters_04_and_05(browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver, address = browser
    driver.get(address)
    search = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
    driver.execute_script("arguments[0].focus()", search)
    search.send_keys("LOCAL_RANK")
    WebDriverWait(driver, 60).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
    )
    # Material lists the first results and adds more as the list scrolls: scroll to its end
    shown = 0
    while True:
        items = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
        if len(items) == shown:
            break
        shown = len(items)
        driver.execute_script("arguments[0].scrollIntoView()", items[-1])
        time.sleep(1)
    found = set()
    for link in driver.find_elements(By.CSS_SELECTOR, ".md-search-result__link"):
        location = urldefrag(link.get_attribute("href"))[0]
        found.add(location.removeprefix(address).split("?")[0])  # less its ?h=local_rank
    assert {"04_ddp/", "05_multinode/"} <= found, f"search for LOCAL_RANK lists {sorted(found)}"
    assert not console_errors(driver)


def test_a_diff_shows_its_added_and_removed_lines_in_colour(browser):
    driver, address = browser
    driver.get(address + DIFF)
    colours = driver.execute_script(
        """
        const block = document.querySelector(".md-typeset .highlight code");
        const style = element => {
            const s = getComputedStyle(element);
            return [s.color, s.backgroundColor];
        };
        const added = document.querySelectorAll(".highlight .gi");
        const removed = document.querySelectorAll(".highlight .gd");
        return {
            text: [getComputedStyle(block).color, getComputedStyle(block).backgroundColor],
            added: added.length ? style(added[0]) : null,
            removed: removed.length ? style(removed[0]) : null,
            counts: [added.length, removed.length],
        };
        """
    )
    assert colours["added"] and colours["removed"], f"no added or removed lines: {colours}"
    assert colours["added"] != colours["text"], colours
    assert colours["removed"] != colours["text"], colours
    assert colours["added"] != colours["removed"], colours
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / "diff.png"))


def test_every_notebook_page_shows_its_plot(browser, site):
    driver, address = browser
    notebooks = [page for page in pages(site) if page.endswith("/notebook/")]
    assert notebooks, "no notebook pages"
    for page in notebooks:
        driver.get(address + page)
        plots = driver.execute_script(
            "return [...document.querySelectorAll('.jupyter-wrapper .jp-OutputArea-output img')]"
            ".map(i => i.complete && i.naturalWidth > 0)"
        )
        assert plots and all(plots), f"{page}: plots loaded: {plots}"
    driver.get(address + NOTEBOOK)
    driver.execute_script(
        "document.querySelector('.jupyter-wrapper .jp-OutputArea-output img')"
        ".scrollIntoView({block: 'center'})"
    )
    time.sleep(1)  # the header's title changes as the page scrolls: a picture after it settles
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / "notebook.png"))


def test_screenshots_of_the_home_page_and_a_chapter(browser):
    driver, address = browser
    SHOTS.mkdir(parents=True, exist_ok=True)
    for page, name in (("", "home.png"), (CHAPTER, "chapter.png")):
        driver.get(address + page)
        driver.save_screenshot(str(SHOTS / name))
        assert (SHOTS / name).stat().st_size > 10_000, f"{name}: an empty screenshot"
