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
"""

from __future__ import annotations

import posixpath
import re
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


def diff_label(path: Path) -> str:
    """A published diff's name in the navigation: the file it starts from (its `--- a/` line)."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("--- "):
            old = line[4:].strip().removeprefix("a/")
            return f"diff from {old.split('/')[0]}"
    return path.name


def chapter_section(folder: str) -> dict:
    """A chapter in the navigation: its README, its script, its diffs and its notebook."""
    entries: list = [f"{folder}/README.md", {"train.py": f"{folder}/train.py"}]
    number = folder.split("_")[0]
    for diff in sorted((ROOT / "docs" / "diffs").glob(f"{number}_*.diff")):
        entries.append({diff_label(diff): diff.relative_to(ROOT).as_posix()})
    if (ROOT / folder / "notebook.ipynb").is_file():
        entries.append({"notebook": f"{folder}/notebook.ipynb"})
    return {first_heading(ROOT / folder / "README.md"): entries}


def deep_dives() -> list[str]:
    """docs/deep/, in the order the README first links to them, then the rest by name."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "deep").glob("*.md"))
    linked = [m.group(1) for m in LINK.finditer(readme) if m.group(1)]
    order = {page: linked.index(page) if page in linked else len(linked) for page in pages}
    return sorted(pages, key=lambda page: order[page])


def navigation() -> list:
    return [
        {"Home": "README.md"},
        {"Chapters": [chapter_section(folder) for folder in FOLDERS]},
        {"Deep dives": deep_dives()},
        {"Troubleshooting": "docs/TROUBLESHOOTING.md"},
        {"The workshop": "docs/WORKSHOP.md"},
        {"Results": ["bench/RESULTS.md", "bench/GPU_CHECK.md", "bench/README.md"]},
    ]


def nav_paths(nav: list | dict | str) -> list[str]:
    """Every file path the navigation names."""
    if isinstance(nav, str):
        return [nav]
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
    """A script's or a diff's page: its path as the title, then the whole file, highlighted.

    A script has line numbers; a diff has its own in its `@@` lines. The page leaves out the
    table of contents (it has no headings) to give the code the width.
    """
    text = (ROOT / path).read_text(encoding="utf-8")
    language = LANGUAGES.get(Path(path).suffix, "text")
    options = "" if language == "diff" else ' linenums="1"'
    longest_backticks = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest_backticks + 1)
    front_matter = "---\nhide:\n  - toc\n---\n"
    return f"{front_matter}# {path}\n\n{fence}{language}{options}\n{text.rstrip()}\n{fence}\n"


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    config.site_name = first_heading(ROOT / "README.md")
    config.nav = navigation()
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which takes over the notebooks
def on_files(files: Files, config: MkDocsConfig) -> Files:
    # the theme's assets stay; what MkDocs found in docs_dir gives way to the course's own files
    kept = [file for file in files if file.src_dir != config.docs_dir]
    for path in site_paths(config.nav):
        suffix = Path(path).suffix
        if suffix in MARKDOWN or suffix in AS_IS:
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
    """A chapter's page ranks above its scripts and diffs in the search.

    A script says `LOCAL_RANK` more often than the page that explains it; a reader who searches
    for it wants the explanation first.
    """
    if re.fullmatch(r"\d\d_[^/]+/README\.md", page.file.src_uri):
        page.meta["search"] = {"boost": 10}
    return markdown


def on_page_content(html: str, page, config: MkDocsConfig, files: Files) -> str:
    """A notebook's table of contents, from the headings of its page as rendered.

    mkdocs-jupyter makes it from the notebook turned to Markdown, where a heading with code in it
    (chapter 03's, with `nn.DataParallel`) gets another id than nbconvert gives it in the page.
    """
    if page.file.src_uri.endswith(".ipynb"):
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


def on_serve(server, config: MkDocsConfig, builder):
    """`mkdocs serve` rebuilds when any of the site's files changes."""
    for path in site_paths(config.nav):
        server.watch(str(ROOT / path))
    server.watch(str(Path(__file__)))
    return server
