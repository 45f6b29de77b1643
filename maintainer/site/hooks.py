"""The course as a site (mkdocs.yml), built by MkDocs from the course's own files where they lie.

This hook hands MkDocs the files the navigation names and those they link to, where they lie (a
text's links work as on a code host); makes a script or a diff a highlighted page; titles a
chapter's pages by their chapter; makes a picture with the italic paragraph under it a figure.
"""

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

# `python -m mkdocs` from the course root puts the root on the import path
from common.chapters import FOLDERS
from layout import REPO as ROOT

AS_IS = {".md", ".png", ".jpg", ".svg", ".gif", ".ipynb", ".gz", ".css"}  # MkDocs's own kinds
LANGUAGES = {".py": "python", ".sh": "bash", ".sbatch": "bash", ".diff": "diff", ".json": "json"}
# a link in Markdown: [text](target) or [text](target "title"), or a reference [id]: target
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)
CHAPTER_HEADING = re.compile(r"(^|<h1[^>]*>\s*)Chapter (\d\d)\s*[—–:-]\s*")  # "Chapter 01 — "
# a picture alone in its paragraph, and the paragraph under it that begins in italics: its caption
PICTURE = re.compile(r'<p>(<img [^>]*?src="([^"]+)"[^>]*>)</p>(?:\s*<p>(<em>.*?)</p>)?', re.S)
# what nbconvert puts in a notebook's page that reaches for the network: Mermaid's and MathJax's
FETCHING = re.compile(
    r'<script type="module">(?:(?!</script>).)*jp-Mermaid.*?</script>|<script src=""> </script>',
    re.S,
)
log = logging.getLogger(f"mkdocs.hooks.{__name__}")  # a warning fails `mkdocs build --strict`


def heading(path: str) -> str:
    """A Markdown file's first `# ` line; a chapter's in the site's one style, "Chapter 01 · "."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    first = next(line[2:].strip() for line in lines if line.startswith("# "))
    return CHAPTER_HEADING.sub(r"Chapter \2 · ", first, count=1)


def page_title(path: str) -> str | None:
    """A chapter's page's title ("Chapter 04 · train.py", "... · diff from 02"), or None."""
    name = path.removeprefix("docs/diffs/").split("/")[0].split("_from_")[0].removesuffix(".diff")
    if name not in FOLDERS:
        return None  # no chapter's page: it keeps its heading
    if path == f"{name}/README.md":
        return heading(path)
    what = Path(path).stem if path.endswith(".ipynb") else path.removeprefix(f"{name}/")
    if path.startswith("docs/diffs/"):
        old = re.search(r"^--- a/(\w+)/", (ROOT / path).read_text(), re.M)[1]
        what = f"diff from {FOLDERS.index(old) + 1:02d}"
    return f"Chapter {FOLDERS.index(name) + 1:02d} · {what}"


def navigation(nav: list) -> list:
    """mkdocs.yml's navigation with the chapters after Home: README, script, diffs, notebook."""
    chapters = []
    for folder in FOLDERS:
        diffs = sorted((ROOT / "docs" / "diffs").glob(f"{folder}*.diff"))
        pages = [f"{folder}/train.py", *(d.relative_to(ROOT).as_posix() for d in diffs)]
        pages += [f"{folder}/notebook.ipynb"] * (ROOT / folder / "notebook.ipynb").is_file()
        named = [{page_title(page).split(" · ")[1]: page} for page in pages]
        chapters.append({heading(f"{folder}/README.md"): [f"{folder}/README.md", *named]})
    return [nav[0], {"Chapters": chapters}, *nav[1:]]


def site_paths(nav: list | dict | str) -> list[str]:
    """The navigation's files and, page by page, every file of the repository they link to."""
    todo = [nav]
    found: list[str] = []
    while todo:
        item = todo.pop(0)
        if isinstance(item, (list, dict)):
            todo += list(item.values() if isinstance(item, dict) else item)
        elif item not in found and not item.startswith("..") and (ROOT / item).is_file():
            found.append(item)  # (not an address on the web; a missing file is MkDocs's to report)
            for match in LINK.finditer((ROOT / item).read_text() if item.endswith(".md") else ""):
                target = (match.group(1) or match.group(2)).split("#")[0]
                if target and not re.match(r"[a-z][a-z0-9+.-]*:|/", target):
                    todo.append(posixpath.normpath(posixpath.join(posixpath.dirname(item), target)))
    return found


class SourcePage(File):  # a page made from a file that is not Markdown, under the file's path
    def is_documentation_page(self) -> bool:
        return True


def source_page(path: str, config) -> File:
    """A script's or a diff's page (`04_ddp/train.py/index.html`): the whole file, highlighted."""
    text = (ROOT / path).read_text(encoding="utf-8")
    language = LANGUAGES.get(Path(path).suffix, "text")
    fence = "`" * max([3] + [len(run) + 1 for run in re.findall(r"`+", text)])
    numbers = "" if language == "diff" else ' linenums="1"'
    head = f"---\nhide:\n  - toc\n---\n# {page_title(path) or path}\n\n`{path}`\n\n"
    code = f"{fence}{language}{numbers}\n{text.rstrip()}\n{fence}\n"
    page = SourcePage.generated(config, path, content=head + code)
    page.dest_uri = f"{path}/index.html"
    return page


def on_config(config):
    config.nav = navigation(config.nav)
    return config


@event_priority(100)  # before mkdocs-jupyter's, which takes over the notebooks
def on_files(files: Files, config) -> Files:
    kept = [file for file in files if file.src_dir != config.docs_dir]  # the theme's own files
    for path in [*site_paths(config.nav), "maintainer/site/site.css"]:
        if Path(path).suffix in AS_IS:
            kept.append(File(path, str(ROOT), config.site_dir, config.use_directory_urls))
        else:
            kept.append(source_page(path, config))
    return Files(kept)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A chapter's page is titled by its chapter, and its README ranks first in the search."""
    if page_title(page.file.src_uri):
        page.meta["title"] = page_title(page.file.src_uri)
    if re.fullmatch(r"\d\d_[^/]+/README\.md", page.file.src_uri):
        page.meta["search"] = {"boost": 10}
    return markdown


def on_page_content(html: str, page, config, files) -> str:
    """A chapter's heading in the site's one style; every picture a figure with its caption; a
    notebook without what reaches for the network, nor nbconvert's ¶ (the search quotes it), its
    contents pointing at its headings (mkdocs-jupyter's ids are not nbconvert's for code)."""
    if page.file.src_uri.endswith(".ipynb"):
        html = re.sub(r'<a class="anchor-link" href="[^"]*">¶</a>', "", FETCHING.sub("", html))
        ids = iter(re.findall(r'<h[1-6] id="([^"]+)"', html))
        links = list(page.toc)
        while links:
            link = links.pop(0)
            link.id = next(ids)
            links = link.children + links

    def figure(match: re.Match) -> str:
        image, source, caption = match.groups()
        if caption is None:
            log.warning(f"{page.file.src_uri}: {source} has no caption: write one under it, *...*")
        opens = f'<a class="course-figure__open" href="{source}" title="Open it full size">'
        under = f"<figcaption>{caption or ''}</figcaption>"
        return f'<figure class="course-figure">{opens}{image}</a>{under}</figure>'

    html = CHAPTER_HEADING.sub(r"\1Chapter \2 · ", html, count=1)
    return PICTURE.sub(figure, html) if page.file.src_uri.endswith(".md") else html
