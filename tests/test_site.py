"""The course as a site (mkdocs.yml, maintainer/site/), read in a real browser.

The site is built with `mkdocs build --strict` (a broken link, file or anchor fails the build),
served on 127.0.0.1 and opened page by page in Debian's Chromium, driven by Selenium. The browser
resolves no host but 127.0.0.1, so a page that reached for the network would log an error.

    python -m pytest -q -n 0 -m site tests/test_site.py     # CI runs it as a stage of its own

The README's suite leaves these tests out (pytest.ini). Without Chromium they skip with the reason;
with CI=true they fail instead, as CI installs it. The last lines of the run give the build's
time, the browser's time, the site's size and what was checked; the screenshots of a home page, a
chapter, a diff, a notebook, and a chapter's figure as its page shows it and opened by a click, go
to out/site_check/.
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

from common.chapters import FOLDERS
from layout import REPO as ROOT
from maintainer.site.browser import build, chromium, serve, why_no_browser
from maintainer.site.hooks import repository_url

SHOTS = ROOT / "out" / "site_check"
CHAPTER = "04_ddp/"
DIFF = "docs/diffs/04_ddp.diff/"
NOTEBOOK = "04_ddp/notebook/"
FSDP = next(folder for folder in FOLDERS if folder.endswith("_fsdp"))  # its page shows its step
OPENED_WIDTH = 1000  # pixels: a figure opened by a click is at least this wide (or an SVG)

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


# what the browser finds on a page once it has loaded: its images, what it fetched, its links,
# its title in the tab and in the header, and its figures (the notebooks' plots are theirs)
PAGE_FACTS = """
const topic = document.querySelector("[data-md-component=header-topic] .md-ellipsis");
const site = document.querySelector(".md-header__topic .md-ellipsis");
return {
    images: [...document.images].map(
        i => [i.currentSrc || i.src, i.complete && i.naturalWidth > 0]),
    fetched: performance.getEntriesByType("resource").map(e => e.name),
    links: [...document.querySelectorAll("a[href]")].map(a => a.href),
    tab: document.title,
    header: topic ? topic.textContent.trim() : null,
    site: site ? site.textContent.trim() : null,
    pictures: [...document.querySelectorAll(".md-content img")]
        .filter(i => !i.closest(".jupyter-wrapper"))
        .map(i => {
            const figure = i.closest("figure");
            const link = i.closest("a");
            const caption = figure && figure.querySelector("figcaption");
            return {src: i.currentSrc || i.src, link: link ? link.href : null,
                    caption: caption ? caption.textContent.trim() : "",
                    loaded: i.complete && i.naturalWidth > 0};
        }),
};
"""


@pytest.fixture(scope="module")
def visited(browser, site) -> dict[str, dict]:
    """Every page of the site opened once in the browser: page -> PAGE_FACTS, with its status and
    what it logged as errors; None for a page the server does not give."""
    driver, address = browser
    facts: dict[str, dict] = {}
    for page in pages(site):
        status, _ = fetch(address + page)
        if status != 200:
            facts[page] = {"status": status}
            continue
        driver.get(address + page)
        facts[page] = driver.execute_script(PAGE_FACTS)
        facts[page]["status"] = status
        # read last, so that what the page logs while it settles counts as well
        facts[page]["console"] = console_errors(driver)
    return facts


def test_every_page_opens_in_a_browser_with_its_images_links_and_anchors(browser, visited, summary):
    driver, address = browser
    targets: dict[str, tuple[int, set[str]]] = {}  # address -> (status, ids of that page)

    def target(url: str) -> tuple[int, set[str]]:
        if url not in targets:
            status, text = fetch(url)
            targets[url] = (status, parse(text).ids if text else set())
        return targets[url]

    problems = []
    images = links = anchors = 0
    for page, facts in visited.items():
        if facts["status"] != 200:
            problems.append(f"{page or '/'}: status {facts['status']}")
            continue
        for source, loaded in facts["images"]:
            images += 1
            if not loaded:
                problems.append(f"{page}: image not loaded: {source[:100]}")
        for resource in facts["fetched"]:
            if not resource.startswith((address, "data:", "blob:")):
                problems.append(f"{page}: fetched from another host: {resource}")
        for href in facts["links"]:
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
        problems += [f"{page}: console: {message}" for message in facts["console"]]
    summary["pages"] = str(len(visited))
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


def test_every_notebook_page_shows_its_plot_and_offers_the_notebook(browser, site):
    import json

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
        downloads = driver.execute_script(
            "return [...document.querySelectorAll('a[download]')].map(a => a.href)"
        )
        assert downloads, f"{page}: no link to download the notebook"
        status, text = fetch(downloads[0])
        assert status == 200, f"{page}: its download {downloads[0]} answers {status}"
        assert json.loads(text)["cells"], f"{page}: {downloads[0]} is not a notebook"
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


def chapter_of_page(page: str) -> str | None:
    """The chapter folder a page of the site belongs to: 04_ddp/, 04_ddp/train.py/,
    04_ddp/notebook/, docs/diffs/04_ddp_from_02.diff/ -> 04_ddp; None for the others."""
    first = page.split("/")[0]
    if first in FOLDERS:
        return first
    if page.startswith("docs/diffs/"):
        name = page.split("/")[2].removesuffix(".diff").split("_from_")[0]
        return name if name in FOLDERS else None
    return None


def test_every_page_has_one_title_of_its_own_which_names_its_chapter(visited, site, summary):
    """The browser's tab, the sticky header and the search name a page alike, no two pages the
    same, and a chapter's pages by their chapter: "Chapter 04 · train.py"."""
    import json

    titles: dict[str, str] = {}
    problems = []
    for page, facts in visited.items():
        if page == "404.html" or facts["status"] != 200:
            continue  # the page for an address the site does not have
        title = facts["tab"].removesuffix(f" - {facts['site']}")
        titles[page] = title
        if page and facts["header"] != title:
            problems.append(f"{page}: the header says {facts['header']!r}, the tab {title!r}")
        folder = chapter_of_page(page)
        if folder is not None:
            number = f"{FOLDERS.index(folder) + 1:02d}"
            if not title.startswith(f"Chapter {number} · "):
                problems.append(f"{page}: titled {title!r}, not after chapter {number}")
        elif title.startswith("Chapter"):
            problems.append(f"{page}: titled {title!r}, which is no chapter's page")
    assert titles[""] == visited[""]["site"], "the home page is titled by the site's name"
    seen: dict[str, str] = {}
    for page, title in titles.items():
        if title in seen:
            problems.append(f"{page} and {seen[title]} are both titled {title!r}")
        seen.setdefault(title, page)
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    for entry in index["docs"]:
        if "¶" in entry["title"] or re.search(r"<[^>]+>", entry["title"]):
            problems.append(f"search: {entry['location']} is titled {entry['title']!r}")
        location = entry["location"]
        page_entry = "#" not in location and location in titles
        if page_entry and chapter_of_page(location) and entry["title"] != titles[location]:
            problems.append(
                f"search: {location or '/'} is {entry['title']!r}, its page {titles[location]!r}"
            )
    chapter_names = [t for t in titles.values() if t.startswith("Chapter")]
    odd = [t for t in chapter_names if not re.match(r"Chapter \d\d · \S", t)]
    problems += [f"a chapter's name in another style: {t!r}" for t in odd]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:50])
    # after the check: the summary says "all different" only of titles that are
    summary["titles"] = f"{len(titles)} pages, all different"


def test_every_figure_has_its_caption_and_opens_full_size_on_a_click(browser, visited, summary):
    """A page's every picture is a figure with its caption under it, and a link to the picture
    itself; opened, it shows at least OPENED_WIDTH pixels wide (an SVG at any width). The
    notebooks' plots are their outputs, shown as the notebook stores them."""
    driver, address = browser
    problems = []
    opened: dict[str, str] = {}  # picture's address -> the first page that shows it
    for page, facts in visited.items():
        for picture in facts.get("pictures", []):
            name = picture["src"].removeprefix(address)
            if not picture["loaded"]:
                problems.append(f"{page}: {name} does not load")
            if not picture["caption"]:
                problems.append(f"{page}: {name} has no caption under it")
            if picture["link"] != picture["src"]:
                problems.append(f"{page}: {name} opens {picture['link']} on a click, not itself")
            opened.setdefault(picture["src"], page)
    assert opened, "no figures on the site"
    for source, page in opened.items():
        name = source.removeprefix(address)
        if name.endswith(".svg"):
            continue
        driver.get(source)  # what the click opens: the picture alone, in the browser's window
        natural, shown = driver.execute_script(
            "const i = document.images[0]; return [i.naturalWidth, i.getBoundingClientRect().width]"
        )
        if shown < OPENED_WIDTH:
            problems.append(
                f"{name} (on {page or '/'}): opened, it is {shown:.0f} px wide ({natural} px "
                f"drawn), under {OPENED_WIDTH}: draw it about 7 in wide at 150-200 dpi"
            )
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)
    # after the check: the summary claims the width only of figures that have it
    summary["figures"] = f"{len(opened)}, each opened at {OPENED_WIDTH} px or more"


def test_chapter_07_shows_the_fsdp_step_and_the_memory_bars(browser):
    driver, address = browser
    driver.get(address + FSDP + "/")
    shown = driver.execute_script(
        """
        return [...document.querySelectorAll(".md-content figure img")].map(i => [
            i.getAttribute("src").split("/").pop(), i.complete && i.naturalWidth > 0,
            i.getBoundingClientRect().width]);
        """
    )
    loaded = {name: width for name, ok, width in shown if ok}
    for name in ("fsdp_step.png", "fsdp_step_gpu.png", "memory_per_rank.png"):
        assert name in loaded, f"{FSDP}'s page does not show {name}: it shows {shown}"
        assert loaded[name] >= 400, f"{name} is shown {loaded[name]:.0f} px wide"


def test_a_figure_as_its_page_shows_it_and_opened_by_a_click(browser):
    """Screenshots: chapter 07's step in its page's column, then opened by clicking it."""
    from selenium.webdriver.common.by import By

    driver, address = browser
    driver.get(address + FSDP + "/")
    link = driver.find_element(By.CSS_SELECTOR, "figure.course-figure a")
    # down to the figure in one move, clear of the sticky header (scrolling up shows Material's
    # "back to top" button over it)
    driver.execute_script(
        "window.scrollTo(0, arguments[0].getBoundingClientRect().top + window.scrollY - 64)", link
    )
    time.sleep(1)  # the header's title changes as the page scrolls: a picture after it settles
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / "figure_on_its_page.png"))
    target = link.get_attribute("href")
    link.click()
    assert driver.current_url == target, f"the click opened {driver.current_url}, not {target}"
    width = driver.execute_script("return document.images[0].getBoundingClientRect().width")
    assert width >= OPENED_WIDTH, f"opened, the figure is {width:.0f} px wide"
    driver.save_screenshot(str(SHOTS / "figure_opened.png"))


def test_a_notebooks_printed_source_and_output_keep_their_words_whole(browser, site):
    """tools/notebook.py's show_source prints a program as an editor shows it: its lines whole,
    the box scrolls sideways; printed output breaks lines between words, never inside one."""
    driver, address = browser
    styles = []
    for page in [page for page in pages(site) if page.endswith("/notebook/")]:
        driver.get(address + page)
        styles += driver.execute_script(
            """
            return [...document.querySelectorAll(".jupyter-wrapper .jp-OutputArea-output pre")]
                .map(p => {
                    const s = getComputedStyle(p);
                    const source = p.closest(".jp-RenderedMarkdown") !== null;
                    return [source, s.whiteSpace, s.wordBreak];
                });
            """
        )
    assert any(source for source, _, _ in styles), "no notebook shows a program's source"
    for source, white_space, word_break in styles:
        assert word_break != "break-all", "a notebook's output breaks words"
        if source:
            assert white_space == "pre", f"a printed program's lines wrap ({white_space})"


def test_the_site_links_to_the_repository_it_was_cloned_from(tmp_path):
    """The navigation's link to the repository is git's `origin`, as a web address; a clone of a
    folder has none to give."""

    def clone_with(origin: str | None) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        subprocess.run(["git", "init", "-q", str(folder)], check=True)
        if origin is not None:
            subprocess.run(
                ["git", "-C", str(folder), "remote", "add", "origin", origin], check=True
            )
        return folder

    web = "https://github.com/someone/course"
    assert repository_url(clone_with(web + ".git")) == web
    assert repository_url(clone_with("git@github.com:someone/course.git")) == web
    assert repository_url(clone_with("/srv/git/course")) is None
    assert repository_url(clone_with(None)) is None
