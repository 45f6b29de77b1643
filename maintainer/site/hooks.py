"""The course as a site: MkDocs builds it from the course's own files, read where they lie.

    python -m mkdocs serve            # read it at http://127.0.0.1:8000
    python -m mkdocs build --strict   # into out/site/; a broken link, file or anchor fails

mkdocs.yml names this file as its hook. Nothing of the course is copied into a docs folder:
`on_files` hands MkDocs the course's files under their paths in the repository, so every relative
link a text uses on a code host (`train.py`, `../docs/diffs/04_ddp.diff`, `#an-anchor`) resolves
to the same file in the site, and MkDocs rewrites it to that file's page. What a text links to
becomes a page of its own: a script with line numbers and syntax highlighting, a published diff
with its added and removed lines coloured, a notebook with its stored outputs (mkdocs-jupyter),
a figure as itself. MkDocs validates every link and anchor of every page.

The chapters come from common/chapters.py. Each chapter's page is titled by its chapter, in the
browser's tab, the sticky header and the search alike ("Chapter 04 · train.py", "Chapter 04 · diff
from 02"); a picture with the italic paragraph under it becomes a figure with its caption, which
a click opens full size; a notebook's page offers the notebook for download. The navigation
links to the repository this copy was cloned from, where git knows its web address.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.toc import get_toc

# `python -m mkdocs` from the course root puts the root on the import path
from common.chapters import FOLDERS
from layout import REPO as ROOT

# how each kind of linked file becomes part of the site
MARKDOWN = {".md"}
# copied as they are: figures, notebooks (mkdocs-jupyter renders them), raw profiler traces (a
# reader downloads them and opens them in Perfetto)
AS_IS = {".png", ".jpg", ".jpeg", ".svg", ".gif", ".ipynb", ".gz"}
LANGUAGES = {
    ".py": "python",
    ".sh": "bash",
    ".sbatch": "bash",
    ".diff": "diff",
    ".toml": "toml",
    ".ini": "ini",
    ".json": "json",
    ".txt": "text",
}
# a link in Markdown: [text](target) or [text](target "title"), or a reference [id]: target
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)


# nbconvert's script that imports Mermaid from a CDN (on_post_page)
MERMAID_LOADER = re.compile(
    r'<script type="module">(?:(?!</script>).)*jp-Mermaid.*?</script>', re.S
)
# a chapter's heading, in any of the styles the texts use: "Chapter 01 — ", "Chapter 02: "
CHAPTER_HEADING = re.compile(r"^Chapter (\d\d)\s*[—–:-]\s*")
# the same at the start of a rendered page's first heading
CHAPTER_H1 = re.compile(r"(<h1[^>]*>\s*)Chapter (\d\d)\s*[—–:-]\s*")
# a picture alone in its paragraph, and the paragraph under it when that begins in italics: its
# caption. On a code host the two read as a picture and its caption; on the site they become a
# <figure>, the picture a link to itself (a click opens it full size)
PICTURE = re.compile(r'<p>(<img [^>]*?src="([^"]+)"[^>]*>)</p>(?:\s*<p>(<em>.*?)</p>)?', re.S)
# the site's own styles: the figures and their captions, the notebooks' printed source
STYLESHEET = "maintainer/site/site.css"
log = logging.getLogger(f"mkdocs.hooks.{__name__}")  # a warning fails `mkdocs build --strict`


class SourcePage(File):
    """A page made at build time from a course file that is not Markdown: a script or a diff.

    Its source path stays the file's own (`04_ddp/train.py`), so links to the file find it, and
    it is written to `04_ddp/train.py/index.html`.
    """

    def is_documentation_page(self) -> bool:
        return True


def first_heading(path: Path) -> str:
    """A Markdown file's title: its first `# ` line."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    raise SystemExit(f"{path.relative_to(ROOT)} has no '# ' title line: give it one")


def chapter_number(folder: str) -> str:
    """A chapter's number as the course writes it, from common/chapters.py: 04_ddp -> "04"."""
    return f"{FOLDERS.index(folder) + 1:02d}"


def chapter_name(heading: str) -> str:
    """A chapter's heading in the site's one style: "Chapter 01 — one device" and "Chapter 01:
    one device" both read "Chapter 01 · one device"."""
    return CHAPTER_HEADING.sub(r"Chapter \1 · ", heading, count=1)


def diff_label(path: Path) -> str:
    """A published diff's name in the navigation: the chapter it starts from (its `--- a/` line),
    "diff from 02"."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("--- "):
            old = line[4:].strip().removeprefix("a/").split("/")[0]
            return f"diff from {chapter_number(old)}" if old in FOLDERS else f"diff from {old}"
    return path.name


def chapter_of(path: str) -> str | None:
    """The chapter folder a site path belongs to: its own folder, or the chapter a published diff
    leads to (docs/diffs/04_ddp_from_02.diff -> 04_ddp); None for the course's other files."""
    first = path.split("/")[0]
    if first in FOLDERS:
        return first
    if path.startswith("docs/diffs/"):
        name = Path(path).stem.split("_from_")[0]
        return name if name in FOLDERS else None
    return None


def page_title(path: str) -> str | None:
    """The title of a chapter's page in the browser's tab, the sticky header and the search:
    "Chapter 04 · DistributedDataParallel, ...", "Chapter 04 · train.py", "Chapter 04 · diff from
    02", "Chapter 04 · notebook". None for a page that is no chapter's (it keeps its heading)."""
    folder = chapter_of(path)
    if folder is None:
        return None
    if path == f"{folder}/README.md":
        return chapter_name(first_heading(ROOT / path))
    if path.startswith("docs/diffs/"):
        what = diff_label(ROOT / path)
    elif Path(path).suffix == ".ipynb":
        what = Path(path).stem
    else:
        what = path.removeprefix(f"{folder}/")
    return f"Chapter {chapter_number(folder)} · {what}"


def chapter_section(folder: str) -> dict:
    """A chapter in the navigation: its README, its script, its diffs and its notebook."""
    entries: list = [f"{folder}/README.md", {"train.py": f"{folder}/train.py"}]
    for diff in sorted((ROOT / "docs" / "diffs").glob("*.diff")):
        path = diff.relative_to(ROOT).as_posix()
        if chapter_of(path) == folder:
            entries.append({diff_label(diff): path})
    if (ROOT / folder / "notebook.ipynb").is_file():
        entries.append({"notebook": f"{folder}/notebook.ipynb"})
    return {chapter_name(first_heading(ROOT / folder / "README.md")): entries}


def deep_dives() -> list[str]:
    """docs/deep/, in the order the README first links to them, then the rest by name."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "deep").glob("*.md"))
    linked = [m.group(1) for m in LINK.finditer(readme) if m.group(1)]
    order = {page: linked.index(page) if page in linked else len(linked) for page in pages}
    return sorted(pages, key=lambda page: order[page])


def repository_url(root: Path = ROOT) -> str | None:
    """The web address of the repository this copy of the course was cloned from (git's `origin`),
    or None where it has none: a clone of a folder, or no git at all."""
    done = subprocess.run(
        ["git", "-C", str(root), "remote", "get-url", "origin"], capture_output=True, text=True
    )
    url = done.stdout.strip()
    ssh = re.fullmatch(r"[\w.-]+@([\w.-]+):(.+)", url)  # git@github.com:owner/name.git
    if ssh:
        url = f"https://{ssh.group(1)}/{ssh.group(2)}"
    if done.returncode != 0 or not re.match(r"https?://", url):
        return None
    return url.removesuffix(".git")


def navigation() -> list:
    nav = [
        {"Home": "README.md"},
        {"Chapters": [chapter_section(folder) for folder in FOLDERS]},
        {"Deep dives": deep_dives()},
        {"Troubleshooting": "docs/TROUBLESHOOTING.md"},
        {"The workshop": "docs/WORKSHOP.md"},
        {
            "Results": [
                "bench/RESULTS.md",
                "docs/figures/CAPTIONS.md",
                "bench/GPU_CHECK.md",
                "bench/README.md",
            ]
        },
    ]
    url = repository_url()
    if url is not None:
        nav.append({"The repository": url})
    return nav


def nav_paths(nav: list | dict | str) -> list[str]:
    """Every file path the navigation names."""
    if isinstance(nav, str):
        return [] if re.match(r"https?://", nav) else [nav]
    items = nav.values() if isinstance(nav, dict) else nav
    return [path for item in items for path in nav_paths(item)]


def linked_paths(page: str) -> list[str]:
    """The repository paths a Markdown page links to that exist (a link that does not is
    MkDocs's to report)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    found = []
    for match in LINK.finditer(text):
        target = (match.group(1) or match.group(2)).split("#")[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            continue  # an anchor on the same page, an external address, an absolute path
        path = posixpath.normpath(posixpath.join(posixpath.dirname(page), target))
        if not path.startswith("../") and (ROOT / path).is_file():
            found.append(path)
    return found


def site_paths(nav: list) -> list[str]:
    """The navigation's files and, page by page, every file they link to."""
    todo = nav_paths(nav)
    seen: set[str] = set()
    ordered = []
    while todo:
        path = todo.pop(0)
        if path in seen or not (ROOT / path).is_file():
            continue  # a missing navigation file is MkDocs's to report
        seen.add(path)
        ordered.append(path)
        if Path(path).suffix in MARKDOWN:
            todo.extend(linked_paths(path))
    return ordered


def source_markdown(path: str) -> str:
    """A script's or a diff's page: its title (its chapter's, or its path), the path, then the
    whole file, highlighted.

    A script has line numbers; a diff has its own in its `@@` lines. The page leaves out the
    table of contents (it has no headings) to give the code the width.
    """
    text = (ROOT / path).read_text(encoding="utf-8")
    language = LANGUAGES.get(Path(path).suffix, "text")
    options = "" if language == "diff" else ' linenums="1"'
    longest_backticks = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest_backticks + 1)
    front_matter = "---\nhide:\n  - toc\n---\n"
    title = page_title(path) or path
    where = f"`{path}`\n\n" if title != path else ""
    code = f"{fence}{language}{options}\n{text.rstrip()}\n{fence}\n"
    return f"{front_matter}# {title}\n\n{where}{code}"


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    config.site_name = first_heading(ROOT / "README.md")
    config.nav = navigation()
    config.extra_css.append(STYLESHEET)
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which takes over the notebooks
def on_files(files: Files, config: MkDocsConfig) -> Files:
    # the theme's assets stay; what MkDocs found in docs_dir gives way to the course's own files
    kept = [file for file in files if file.src_dir != config.docs_dir]
    for path in [*site_paths(config.nav), STYLESHEET]:
        suffix = Path(path).suffix
        if suffix in MARKDOWN or suffix in AS_IS or path == STYLESHEET:
            kept.append(File(path, str(ROOT), config.site_dir, config.use_directory_urls))
            continue
        page = SourcePage(
            path,
            src_dir=None,
            dest_dir=config.site_dir,
            use_directory_urls=config.use_directory_urls,
            dest_uri=f"{path}/index.html",
        )
        page.generated_by = "maintainer/site/hooks.py"
        page.content_string = source_markdown(path)
        kept.append(page)
    return Files(kept)


class Headings(HTMLParser):
    """The headings of a rendered page, as MkDocs's table-of-contents tokens (level, id, name)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[dict] = []
        self._heading: dict | None = None
        self._in_anchor_link = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attributes = dict(attrs)
        if re.fullmatch(r"h[1-6]", tag) and attributes.get("id"):
            level = int(tag[1])
            self._heading = {"level": level, "id": attributes["id"], "name": "", "children": []}
        if tag == "a" and "anchor-link" in (attributes.get("class") or ""):
            self._in_anchor_link = True  # nbconvert's pilcrow, not the heading's text

    def handle_endtag(self, tag: str) -> None:
        if tag == "a":
            self._in_anchor_link = False
        if self._heading is not None and tag == f"h{self._heading['level']}":
            self._heading["name"] = self._heading["name"].strip()
            self.tokens.append(self._heading)
            self._heading = None

    def handle_data(self, data: str) -> None:
        if self._heading is not None and not self._in_anchor_link:
            self._heading["name"] += data


def nested(tokens: list[dict]) -> list[dict]:
    """Flat heading tokens nested by level: each heading holds the deeper ones after it."""
    roots: list[dict] = []
    open_headings: list[dict] = []
    for token in tokens:
        while open_headings and open_headings[-1]["level"] >= token["level"]:
            open_headings.pop()
        parent = open_headings[-1]["children"] if open_headings else roots
        parent.append(token)
        open_headings.append(token)
    return roots


def on_page_markdown(markdown: str, page, config: MkDocsConfig, files: Files) -> str:
    """A chapter's page is titled by its chapter, and ranks above its scripts and diffs in the
    search.

    A script says `LOCAL_RANK` more often than the page that explains it; a reader who searches
    for it wants the explanation first.
    """
    title = page_title(page.file.src_uri)
    if title is not None:
        page.meta["title"] = title
    if re.fullmatch(r"\d\d_[^/]+/README\.md", page.file.src_uri):
        page.meta["search"] = {"boost": 10}
    return markdown


def figures(html: str, page) -> str:
    """Every picture of a Markdown page as a figure: the picture a link to itself, so that a click
    opens it full size, and the italic paragraph under it as its caption. A picture without one
    is a warning (an error under --strict)."""

    def figure(match: re.Match) -> str:
        image, source, caption = match.groups()
        if caption is None:
            log.warning(
                f"{page.file.src_uri}: the picture {source} has no caption: write it in the "
                "paragraph right under the picture, beginning in italics (*...*)"
            )
            caption = ""
        opens = f'<a class="course-figure__open" href="{source}" title="Open it full size">'
        return (
            f'<figure class="course-figure">{opens}{image}</a>'
            f"<figcaption>{caption}</figcaption></figure>"
        )

    return PICTURE.sub(figure, html)


def on_page_content(html: str, page, config: MkDocsConfig, files: Files) -> str:
    """A chapter's heading in the site's one style; a Markdown page's pictures as figures; a
    notebook's download link, and its table of contents from the headings of its page as rendered.

    mkdocs-jupyter makes the contents from the notebook turned to Markdown, where a heading with
    code in it (chapter 03's, with `nn.DataParallel`) gets another id than nbconvert gives it in
    the page.
    """
    path = page.file.src_uri
    if chapter_of(path) is not None:
        html = CHAPTER_H1.sub(r"\1Chapter \2 · ", html, count=1)
    if Path(path).suffix in MARKDOWN:
        html = figures(html, page)
    if path.endswith(".ipynb"):
        name = Path(path).name  # mkdocs-jupyter's include_source puts it beside the page
        download = (
            f'<p class="course-download"><a href="{name}" download>Download {name}</a>, '
            "with its outputs; it runs from the course's root folder (<code>jupyter lab</code> "
            "there).</p>"
        )
        html = download + html
        headings = Headings()
        headings.feed(html)
        page.toc = get_toc(nested(headings.tokens))
    return html


def on_post_page(output: str, page, config: MkDocsConfig) -> str:
    """A notebook's page as nbconvert writes it, less two scripts that would reach for the network.

    nbconvert's page loads Mermaid from a CDN once it finds a Mermaid diagram, and MathJax from the
    address mkdocs-jupyter gives it (none: an empty `src`). The site loads nothing from the network,
    so a notebook draws its diagrams as images, and its formulas as text.
    """
    if "jp-Mermaid" not in output:
        return output
    if 'class="jp-Mermaid' in output:
        raise PluginError(
            f"{page.file.src_uri} has a Mermaid diagram, which nbconvert loads from a CDN: "
            "draw it as an image"
        )
    output = MERMAID_LOADER.sub("", output)
    return output.replace('<script src=""> </script>', "")


@event_priority(-100)  # after the search plugin has written its index
def on_post_build(config: MkDocsConfig) -> None:
    """The search's titles as plain text: Material keeps a heading's markup (`<code>`) in them, and
    a notebook's headings bring nbconvert's pilcrow (¶)."""
    path = Path(config.site_dir) / "search" / "search_index.json"
    if not path.is_file():
        return
    index = json.loads(path.read_text(encoding="utf-8"))
    for entry in index["docs"]:
        entry["title"] = re.sub(r"<[^>]+>", "", entry["title"]).replace("¶", "").strip()
    path.write_text(json.dumps(index, ensure_ascii=False), encoding="utf-8")


def on_serve(server, config: MkDocsConfig, builder):
    """`mkdocs serve` rebuilds when any of the site's files changes."""
    for path in site_paths(config.nav):
        server.watch(str(ROOT / path))
    server.watch(str(Path(__file__)))
    return server
