"""The README's reading map: its totals paragraph counts the lines a learner of chapter 01 reads.

    python -m maintainer.reading_map          # rewrite the paragraph after `reading-map-totals`
    python -m maintainer.reading_map --check  # exit 1 if its figures are not the code's

Chapter 01's import closure follows every import of a repository module, at any depth of the code,
as a reader following the calls would.
"""

from __future__ import annotations

import argparse
import ast
import sys
import textwrap
from pathlib import Path

from layout import REPO
from maintainer import REGENERATE

MARKER = "reading-map-totals"
# what the map asks a learner to read for chapter 01, in its order
READ_FOR_01 = ["01_single_gpu/train.py"] + [
    f"common/{name}.py" for name in ("model", "data", "training", "checkpoint", "metrics", "device")
]


def repository_module(name: str, repo: Path = REPO) -> Path | None:
    base = repo.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_files(path: Path, repo: Path = REPO) -> set[Path]:
    """The repository files `path` imports, directly (module or function level)."""
    package = path.parent.relative_to(repo).parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = list(package[: len(package) - node.level + 1]) if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        modules = {repository_module(name, repo) for name in names}
        found |= {module for module in modules if module is not None}
    return found


def closure(script: str, repo: Path = REPO) -> set[Path]:
    """`script` and every repository file it imports, at any depth."""
    seen, todo = set(), [repo / script]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(imported_files(path, repo) - seen)
    return seen


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def totals(repo: Path = REPO) -> str:
    """The paragraph, with the code's figures."""
    files = closure(READ_FOR_01[0], repo)
    to_read = [lines(repo / f) for f in READ_FOR_01]
    text = (
        f"Chapter 01's script and every repository file it imports come to "
        f"{sum(map(lines, files)):,} lines in {len(files)} files. The map asks you to read "
        f"{sum(to_read):,} of them: the script's {to_read[0]:,} and {sum(to_read[1:]):,} "
        "in `common/`."
    )
    return textwrap.fill(text, 100)


def readme_with_totals(readme: str, repo: Path = REPO) -> str:
    """The README with the paragraph after its marker's line replaced by totals()."""
    start = readme.index("\n", readme.index(MARKER)) + 1
    end = readme.index("\n\n", start)
    return readme[:start] + totals(repo) + readme[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    p.add_argument("--root", type=Path, default=REPO, help="the course's root folder")
    args = p.parse_args(argv)
    path = args.root / "README.md"
    readme = path.read_text()
    wanted = readme_with_totals(readme, args.root)
    if readme == wanted:
        return 0
    if args.check:
        print(f"stale: README.md's reading-map totals (run {REGENERATE})", file=sys.stderr)
        return 1
    path.write_text(wanted)
    print("wrote README.md's reading-map totals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
