"""The README's reading map: its line counts are the code's.

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


def totals_paragraph() -> str:
    """The README's paragraph after its `reading-map-totals` marker."""
    readme = (REPO / "README.md").read_text()
    marker = readme.index("reading-map-totals")
    after = readme[readme.index("\n", marker) + 1 :]
    return after.split("\n\n")[0]


def test_the_map_names_files_chapter_01_imports():
    files = closure("01_single_gpu/train.py")
    not_imported = [f for f in READ_FOR_01 if REPO / f not in files]
    assert not_imported == [], f"the map names files chapter 01 does not import: {not_imported}"


def test_readme_totals_are_the_codes():
    files = closure("01_single_gpu/train.py")
    to_read = [lines(REPO / f) for f in READ_FOR_01]
    figures = {
        "lines in chapter 01's import closure": sum(map(lines, files)),
        "files in it": len(files),
        "lines the map asks to read": sum(to_read),
        "lines of the script": to_read[0],
        "lines of common/ the map asks to read": sum(to_read[1:]),
    }
    paragraph = totals_paragraph()
    numbers = {int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*\d|\d", paragraph)}
    for what, figure in figures.items():
        assert figure in numbers, f"README.md's reading map should give the {what}: {figure:,}"


def test_every_common_module_serves_a_chapter():
    """common/ holds what the chapters use: every module is imported by a chapter script."""
    used = set().union(
        *(closure(f"{c}/train.py") for c in sorted(p.parent.name for p in REPO.glob("0*/train.py")))
    )
    modules = {p for p in (REPO / "common").rglob("*.py") if p.name != "__init__.py"}
    # python -m common.sample: the learner's own command
    learner_commands = {REPO / "common/sample.py"}
    assert modules - used - learner_commands == set()
