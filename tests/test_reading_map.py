"""The README's reading map: its line counts are the code's (maintainer/reading_map.py counts them,
following every import of a repository module, as a reader following the calls would)."""

from layout import REPO
from maintainer import REGENERATE, reading_map


def test_the_map_names_files_chapter_01_imports():
    files = reading_map.closure("01_single_gpu/train.py")
    not_imported = [f for f in reading_map.READ_FOR_01 if REPO / f not in files]
    assert not_imported == [], f"the map names files chapter 01 does not import: {not_imported}"


def test_readme_totals_are_the_codes():
    assert reading_map.main(["--check"]) == 0, f"run {REGENERATE}"


def test_the_totals_check_fails_on_a_figure_that_is_not_the_codes(tmp_path):
    readme = (REPO / "README.md").read_text()
    right = reading_map.totals()
    (tmp_path / "README.md").write_text(readme.replace(right, right.replace(" files.", "0 files.")))
    for script in reading_map.closure("01_single_gpu/train.py"):
        copy = tmp_path / script.relative_to(REPO)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(script.read_text())
    assert reading_map.main(["--check", "--root", str(tmp_path)]) == 1
    assert reading_map.main(["--root", str(tmp_path)]) == 0
    assert (tmp_path / "README.md").read_text() == readme


def test_every_common_module_serves_a_chapter():
    """common/ holds what the chapters use: every module is imported by a chapter script."""
    chapters = sorted(p.parent.name for p in REPO.glob("0*/train.py"))
    used = set().union(*(reading_map.closure(f"{c}/train.py") for c in chapters))
    modules = {p for p in (REPO / "common").rglob("*.py") if p.name != "__init__.py"}
    # python -m common.sample and python -m common.gpt2: the learner's own commands
    learner_commands = {REPO / "common/sample.py", REPO / "common/gpt2.py"}
    assert modules - used - learner_commands == set()
