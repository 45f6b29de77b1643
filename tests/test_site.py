"""The course as a site (mkdocs.yml, maintainer/site/), read in a real browser.

The site is built with `mkdocs build --strict` (a broken link, file or anchor fails the build),
served on 127.0.0.1 and opened page by page in Debian's Chromium, driven by Selenium. The browser
resolves no host but 127.0.0.1, so a page that reached for the network would log an error.

    python -m pytest -q -n 0 -m site tests/test_site.py     # CI runs it as a stage of its own

The README's suite leaves these tests out (pytest.ini). Without Chromium they skip with the reason;
with CI=true they fail instead, as CI installs it.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag

import pytest

from common.chapters import FOLDERS
from maintainer.site.browser import build, chromium, serve, why_no_browser

FSDP = next(folder for folder in FOLDERS if folder.endswith("_fsdp"))  # its page shows its step
OPENED_WIDTH = 1000  # pixels: a figure opened by a click is at least this wide (or an SVG)
REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)  # http://, https://, //host
# a script or a style that fetches from another host: import("https://…"), src = "//…", url(http…)
FETCHES_REMOTE = re.compile(
    r"(?:import\s*\(|\bsrc\s*=|\burl\s*\(|@import)\s*[\"']?(?:https?:)?//", re.I
)

pytestmark = pytest.mark.site


class PageParser(HTMLParser):
    """A page's ids (the anchors it offers), the addresses of what it loads, and its scripts."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.loads: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attributes = dict(attrs)
        self.ids |= {attributes[n] for n in ("id", "name") if attributes.get(n)}
        if attributes.get("src") or tag == "link" and attributes.get("href"):
            self.loads.append(attributes.get("src") or attributes["href"])
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built by `mkdocs build --strict` into a folder of its own."""
    folder = tmp_path_factory.mktemp("site") / "site"
    build(folder)
    return folder


@pytest.fixture(scope="module")
def browser(site, tmp_path_factory):
    """(driver, address of the served site): skipped without Chromium, but a failure in CI."""
    why = why_no_browser()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    with serve(site) as address, chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        driver.set_page_load_timeout(60)
        yield driver, address


def fetch(url: str) -> tuple[int, str]:
    """The status and text of url, from the server itself (the browser gives no status)."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        return error.code, ""


def test_the_site_loads_nothing_from_the_network(site):
    """No page or stylesheet names a script, font, stylesheet or image on another host."""
    remote = []
    for page in site.rglob("*.html"):
        parsed = PageParser(page.read_text(encoding="utf-8"))
        name = page.relative_to(site).as_posix()
        remote += [f"{name}: {address}" for address in parsed.loads if REMOTE.match(address)]
        if any(FETCHES_REMOTE.search(script) for script in parsed.scripts):
            remote.append(f"{name}: a script fetches from another host")
    for sheet in site.rglob("*.css"):
        if FETCHES_REMOTE.search(sheet.read_text(encoding="utf-8")):
            remote.append(f"{sheet.relative_to(site).as_posix()}: loads from another host")
    assert not remote, "the site must read offline:\n" + "\n".join(remote)


# what the browser finds on a page once it has loaded: its images, what it fetched, its links,
# its title in the tab and in the header, its figures (the notebooks' plots are theirs), its
# notebook's download, and how a command in a table wraps
PAGE_FACTS = """
const all = selector => [...document.querySelectorAll(selector)];
const text = selector => all(selector).map(e => e.textContent.trim())[0] || null;
const loaded = i => i.complete && i.naturalWidth > 0;
return {
    images: [...document.images].map(i => [i.currentSrc || i.src, loaded(i)]),
    fetched: performance.getEntriesByType("resource").map(e => e.name),
    links: all("a[href]").map(a => a.href),
    tab: document.title,
    header: text("[data-md-component=header-topic] .md-ellipsis"),
    site: text(".md-header__topic .md-ellipsis"),
    pictures: all(".md-content img").filter(i => !i.closest(".jupyter-wrapper")).map(i => ({
        src: i.currentSrc || i.src, link: i.closest("a")?.href || null, loaded: loaded(i),
        caption: i.closest("figure")?.querySelector("figcaption")?.textContent.trim() || "",
        width: i.getBoundingClientRect().width})),
    downloads: all("a[download]").map(a => a.href),
    table_code: all(".md-typeset table code").map(c => getComputedStyle(c).whiteSpace),
};
"""


@pytest.fixture(scope="module")
def visited(browser, site) -> dict[str, dict]:
    """Every page of the site opened once in the browser: page -> PAGE_FACTS, with its status and
    what it logged as errors (Chromium's level SEVERE)."""
    driver, address = browser
    facts: dict[str, dict] = {}
    for path in sorted(site.rglob("*.html")):
        page = path.relative_to(site).as_posix().removesuffix("index.html")
        status, _ = fetch(address + page)
        facts[page] = {"status": status}
        if status == 200:
            driver.get(address + page)
            facts[page].update(driver.execute_script(PAGE_FACTS))
            # read last, so that what the page logs while it settles counts as well
            logged = driver.get_log("browser")
            facts[page]["console"] = [e["message"] for e in logged if e["level"] == "SEVERE"]
    return facts


def test_every_page_opens_with_its_images_links_and_anchors_and_no_console_error(browser, visited):
    _, address = browser
    targets: dict[str, tuple[int, set[str]]] = {}  # address -> (status, ids of that page)
    problems = []
    for page, facts in visited.items():
        if facts["status"] != 200:
            problems.append(f"{page or '/'}: status {facts['status']}")
            continue
        problems += [
            f"{page}: image not loaded: {src[:100]}" for src, ok in facts["images"] if not ok
        ]
        elsewhere = [r for r in facts["fetched"] if not r.startswith((address, "data:", "blob:"))]
        problems += [f"{page}: fetched from another host: {resource}" for resource in elsewhere]
        for href in [href for href in facts["links"] if href.startswith(address)]:
            location, fragment = urldefrag(href)  # (an address on the web is the reader's to open)
            if location not in targets:
                status, text = fetch(location)
                targets[location] = (status, PageParser(text).ids if text else set())
            if targets[location][0] != 200:
                problems.append(f"{page}: link to a missing page: {href}")
            elif fragment and unquote(fragment) not in targets[location][1]:
                problems.append(f"{page}: link to a missing anchor: {href}")
        problems += [f"{page}: console: {message}" for message in facts["console"]]
        wraps = [white_space for white_space in facts["table_code"] if white_space != "nowrap"]
        problems += [f"{page}: a command in a table wraps ({white_space})" for white_space in wraps]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:50])


def test_every_notebook_page_offers_its_notebook(visited):
    notebooks = {page: facts for page, facts in visited.items() if page.endswith("/notebook/")}
    assert len(notebooks) == len(FOLDERS), sorted(notebooks)
    for page, facts in notebooks.items():
        assert facts["downloads"], f"{page}: no link to download the notebook"
        status, text = fetch(facts["downloads"][0])
        assert status == 200 and json.loads(text)["cells"], f"{page}: {facts['downloads'][0]}"


def test_every_page_has_one_title_of_its_own_which_names_its_chapter(visited, site):
    """The browser's tab, the sticky header and the search name a page alike, no two pages the
    same, and a chapter's pages by their chapter: "Chapter 04 · train.py"."""
    titles: dict[str, str] = {}
    problems = []
    for page, facts in visited.items():
        if page == "404.html" or facts["status"] != 200:
            continue  # the page for an address the site does not have
        title = titles[page] = facts["tab"].removesuffix(f" - {facts['site']}")
        if page and facts["header"] != title:
            problems.append(f"{page}: the header says {facts['header']!r}, the tab {title!r}")
        # its chapter: 04_ddp/, 04_ddp/train.py/, docs/diffs/04_ddp_from_02.diff/ -> 04_ddp
        name = re.split(r"/|_from_|\.diff", page.removeprefix("docs/diffs/"))[0]
        number = f"{FOLDERS.index(name) + 1:02d}" if name in FOLDERS else None
        if number and not re.fullmatch(rf"Chapter {number} · \S.*", title):
            problems.append(f"{page}: titled {title!r}, not after chapter {number}")
        elif number is None and title.startswith("Chapter"):
            problems.append(f"{page}: titled {title!r}, which is no chapter's page")
    assert titles[""] == visited[""]["site"], "the home page is titled by the site's name"
    for title in {title for title in titles.values() if list(titles.values()).count(title) > 1}:
        problems.append(f"{sorted(p for p in titles if titles[p] == title)} are titled {title!r}")
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    for entry in index["docs"]:  # (Material shows a title's code as code: its markup stays)
        location, title = entry["location"], re.sub(r"<[^>]+>", "", entry["title"])
        if "¶" in title:
            problems.append(f"search: {location} is titled {title!r}")
        elif titles.get(location, "").startswith("Chapter") and title != titles[location]:
            problems.append(f"search: {location} is {title!r}, its page {titles[location]!r}")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:50])


def test_every_figure_has_its_caption_and_opens_full_size_on_a_click(browser, visited):
    """A page's every picture is a figure with its caption under it, and a link to the picture
    itself; opened, it shows at least OPENED_WIDTH pixels wide (an SVG at any width)."""
    driver, address = browser
    problems = []
    opened: dict[str, str] = {}  # picture's address -> the first page that shows it
    for page, facts in visited.items():
        for picture in facts.get("pictures", []):
            if not picture["loaded"] or not picture["caption"] or picture["link"] != picture["src"]:
                problems.append(f"{page}: loaded, with its caption, opening itself? {picture}")
            opened.setdefault(picture["src"], page)
    assert opened, "no figures on the site"
    for source, page in opened.items():
        if not source.endswith(".svg"):
            driver.get(source)  # what the click opens: the picture alone, in the browser's window
            shown = driver.execute_script("return document.images[0].getBoundingClientRect().width")
            if shown < OPENED_WIDTH:
                problems.append(f"{source} (on {page or '/'}): opened, {shown:.0f} px wide")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_chapter_07_shows_the_fsdp_step_and_the_memory_bars(visited):
    pictures = visited[f"{FSDP}/"]["pictures"]
    shown = {picture["src"].split("/")[-1]: picture for picture in pictures if picture["loaded"]}
    for name in ("fsdp_step.png", "fsdp_step_gpu.svg", "memory_per_rank.png"):
        assert name in shown, f"{FSDP}'s page does not show {name}: it shows {sorted(shown)}"
        assert shown[name]["width"] >= 400, f"{name} is shown {shown[name]['width']:.0f} px wide"
