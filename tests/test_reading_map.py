"""The README's reading map: its line counts are the code's, and chapter 01's path stays light.

A learner who follows chapter 01 reads its script and, through its imports, files of common/. The
README says how many lines that is in all, and how many of them the map asks to read; this test
counts them again, following every import of a repository module (at any depth of the code, as a
reader following the calls would), so the figures cannot go stale.
"""

import ast
import re
from pathlib import Path

from tools.launch import REPO

# what the map asks a learner to read for chapter 01, in its order
READ_FOR_01 = ["01_single_gpu/train.py"] + [
    f"common/{name}.py" for name in ("model", "data", "training", "checkpoint", "metrics", "device")
]
LIMIT = 1500  # issue: chapter 01's whole import closure, nanoGPT's weight with the course's safety


def repository_module(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_files(path: Path) -> set[Path]:
    """The repository files `path` imports, directly (module or function level)."""
    package = path.parent.relative_to(REPO).parts
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
        found |= {module for module in map(repository_module, names) if module is not None}
    return found


def closure(script: str) -> set[Path]:
    seen, todo = set(), [REPO / script]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(imported_files(path) - seen)
    return seen


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_readme_totals_are_the_codes():
    files = closure("01_single_gpu/train.py")
    total = sum(map(lines, files))
    assert total <= LIMIT, f"chapter 01's reading path grew to {total} lines (limit {LIMIT})"
    assert {REPO / f for f in READ_FOR_01} <= files, (
        "the map names a file chapter 01 does not import"
    )
    to_read = [lines(REPO / f) for f in READ_FOR_01]
    expected = (
        f"Chapter 01's script and every repository file it imports come to {total:,} lines in "
        f"{len(files)} files. The map asks you to read {sum(to_read):,} of them: the script's "
        f"{to_read[0]} and {sum(to_read[1:])} in `common/`."
    )
    readme = re.sub(r"\s+", " ", (REPO / "README.md").read_text())
    assert expected in readme, f"README.md's reading map should say: {expected}"


def test_every_common_module_serves_a_chapter():
    """common/ holds what the chapters use: every module is imported by a chapter script."""
    used = set().union(
        *(closure(f"{c}/train.py") for c in sorted(p.parent.name for p in REPO.glob("0*/train.py")))
    )
    modules = {p for p in (REPO / "common").rglob("*.py") if p.name != "__init__.py"}
    # python -m common.sample: the learner's own command
    learner_commands = {REPO / "common/sample.py"}
    assert modules - used - learner_commands == set()
