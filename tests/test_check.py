"""tools/check.py: the chapter scripts are chapter 01's run, the exercises as given are not, and
every
mistake of the catalogue (tools/mistakes.py), planted in a copy of a chapter script, is caught and
named.

Every check runs real processes (torchrun with 2 ranks for chapter 04) on the tiny model, 8 steps
in float64. Chapter 01's reference run is made once per test process and reused by every check (the
checker keeps it under its --out-root). Only the checks that pass, and the planted resume mistake,
run the stop-and-resume phase; the checker skips it for a run that already differs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import replace_statement

from common.chapters import CHAPTERS
from tools import check, make_exercises
from tools.launch import REPO
from tools.mistakes import MISTAKES, Facts, diagnose


@pytest.fixture(scope="module")
def out_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("check")


def run_check(capsys, out_root: Path, script: Path, *flags: str) -> tuple[int, str]:
    code = check.main([str(script), "--out-root", str(out_root), *flags])
    return code, capsys.readouterr().out


def test_exercises_are_made_from_the_current_scripts():
    assert make_exercises.main(["--check"]) == 0, "run python maintainer/make_exercises.py"


@pytest.mark.parametrize("chapter", [2, 3, 4, 5])
def test_each_exercise_as_given_is_not_chapter_01s_run(capsys, out_root, chapter):
    exercise = REPO / CHAPTERS[chapter] / "exercise.py"
    assert "TODO" in exercise.read_text()
    nproc = ["--nproc-per-node", "2"] if chapter >= 4 else []
    code, out = run_check(capsys, out_root, exercise, *nproc)
    assert code == 2, out
    assert out.startswith("could not run the script: ") and f"one sets chapter={chapter}" in out, (
        out
    )
    assert len(out.splitlines()) == 1, out


@pytest.mark.parametrize("chapter", [2, 3, 5])
def test_the_chapter_scripts_are_the_same_run(capsys, out_root, chapter):
    """Without the resume phase: chapter 04's test below runs it, and the resume mistake's too."""
    nproc = ["--nproc-per-node", "2"] if chapter >= 4 else []
    script = REPO / CHAPTERS[chapter] / "train.py"
    code, out = run_check(capsys, out_root, script, *nproc, "--no-resume", "--no-plot")
    assert code == 0, out
    assert "same run: all 8 losses and the final parameters equal chapter 01's" in out, out


def test_chapter_04_with_two_ranks_is_the_same_run_and_resumes(capsys, out_root):
    code, out = run_check(
        capsys, out_root, REPO / CHAPTERS[4] / "train.py", "--nproc-per-node", "2"
    )
    assert code == 0, out
    assert "on all 2 ranks; stopped at step 5 and resumed: the same end" in out, out
    png = re.search(r"^plot: (.*\.png)$", out, re.M)
    # a path relative to the course, or absolute
    assert png and (REPO / png.group(1)).is_file(), out


def planted_copy(folder: Path, mistake) -> Path:
    source = (REPO / CHAPTERS[mistake.chapter] / "train.py").read_text()
    for old, new in mistake.plant:
        source = replace_statement(source, old, new, f"{CHAPTERS[mistake.chapter]}/train.py")
    folder.mkdir(parents=True)
    (folder / "train.py").write_text(source)
    return folder / "train.py"


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_every_planted_mistake_is_caught_and_named(capsys, out_root, tmp_path, mistake):
    script = planted_copy(tmp_path / "copy", mistake)
    code, out = run_check(
        capsys, out_root, script, "--nproc-per-node", str(mistake.plant_ranks), "--no-plot"
    )
    assert code == 1, out
    assert "not the same run:" in out, out
    assert f"diagnosis: {mistake.name}: " in out, out
    # the line to look at: the planted one, found in the copy, or where the removed one belongs
    assert re.search(r"look at line \d+ of |your script has no such line; ", out), out


def test_a_script_that_fails_is_one_line_without_a_traceback(capsys, out_root, tmp_path):
    source = (REPO / CHAPTERS[2] / "train.py").read_text()
    typo = replace_statement(
        source,
        "global_batch = args.batch_size * args.grad_accum",
        "global_batch = args.batch_size * args.grad_acum",
        "02_grad_accumulation/train.py",
    )
    (tmp_path / "train.py").write_text(typo)
    code, out = run_check(capsys, out_root, tmp_path / "train.py", "--no-plot")
    assert code == 2, out
    last = out.splitlines()[-1]
    assert last.startswith("could not run the script: AttributeError: ") and "grad_acum" in last, (
        out
    )
    assert "Traceback" not in out


def test_no_known_signature_is_said_as_such():
    facts = Facts(
        chapter=4,
        world_size=2,
        grad_accum=2,
        steps_per_epoch=3,
        script_steps_per_epoch=3,
        first_loss_diff=2,
        loss_ratio_at_1=1.0,
        grad_ratio_at_1=1.3,
        first_data_diff=None,
        rank0_reads_its_share=True,
        ranks_overlap=False,
        repeats_first_epoch=False,
        zero_grads_per_step=1,
        ranks_drift_from=None,
        params_equal=False,
        stopped_after=None,
        resume_at=None,
        resume_diff=None,
    )
    assert diagnose(facts) is None


def test_every_check_gets_a_folder_of_its_own(tmp_path):
    script = REPO / CHAPTERS[2] / "train.py"
    first, second = check.fresh_folder(tmp_path, script), check.fresh_folder(tmp_path, script)
    assert first != second and first.is_dir() and second.is_dir()
