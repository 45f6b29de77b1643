"""tools/check.py: the chapter scripts are chapter 01's run, the exercises as given are not, every
mistake of the catalogue (tools/mistakes.py) is named from the facts its plant leaves, and a
selection of plants is caught and named by real runs.

Cheap first: every entry's lines and plant must still match the chapter scripts (after a restyle
of a chapter, this is the test that says which entry to update), and every signature is tried on
the facts its plant leaves, written down here, with the rule-outs that keep the advice from
contradicting itself. Then real processes (torchrun with 2 ranks for chapter 04, two simulated
nodes for chapter 05) on the tiny model, 8 steps in float64: chapter 01's reference run is made
once per test process and shared by every check (the checker keeps it under its --out-root).
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest
from helpers import replace_statement

from common.chapters import CHAPTERS
from layout import REPO
from maintainer import REGENERATE, make_exercises
from tools import check
from tools.mistakes import (
    MISTAKES,
    Facts,
    describe,
    diagnose,
    keys,
    normalized,
    where_to_look,
)

BY_NAME = {m.name: m for m in MISTAKES}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("check")


def run_check(capsys, out_root: Path, script: Path, *flags: str) -> tuple[int, str]:
    code = check.main([str(script), "--out-root", str(out_root), *flags])
    return code, capsys.readouterr().out


def chapter_script(chapter: int) -> str:
    return (REPO / CHAPTERS[chapter] / "train.py").read_text()


def planted(mistake) -> str:
    source = chapter_script(mistake.chapter)
    for old, new in mistake.plant:
        source = replace_statement(source, old, new, f"{CHAPTERS[mistake.chapter]}/train.py")
    return source


def planted_copy(folder: Path, mistake) -> Path:
    folder.mkdir(parents=True)
    (folder / "train.py").write_text(planted(mistake))
    return folder / "train.py"


# ---- cheap: the catalogue against the chapter scripts, the signatures against facts ----------


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_every_entry_still_matches_the_chapter_scripts(mistake):
    """The right line is the chapter's statement, look_for and near find lines there, the plant
    applies, and the planted line is found and quoted (not the chapter's own line)."""
    source = chapter_script(mistake.chapter)
    have = {key[-1] for key in keys(source)}
    for statement in normalized(mistake.line):
        assert statement in have, f"{CHAPTERS[mistake.chapter]}/train.py has no `{statement}`"
    assert any(text in source for text in mistake.look_for), mistake.look_for
    assert mistake.near in source, mistake.near
    script = f"{CHAPTERS[mistake.chapter]}/train.py"
    assert not where_to_look(mistake, source, script, source).fits  # the chapter is right
    if mistake.plant:
        look = where_to_look(mistake, planted(mistake), "copy.py", source)
        assert look.fits, look.text
        quoted = re.search(r"look at line \d+ of copy.py: `(.*?)`[;i ]", look.text)
        if quoted:
            assert quoted.group(1) not in mistake.line.split("\n") or " inside `" in look.text


def same_facts(**changes) -> Facts:
    """The facts of a run that is chapter 01's (2 ranks, K = 2), with `changes`."""
    facts = Facts(
        chapter=4,
        world_size=2,
        grad_accum=2,
        steps_per_epoch=3,
        script_steps_per_epoch=3,
        first_loss_diff=None,
        loss_ratio_at_1=1.0,
        grad_ratio_at_1=1.0,
        first_data_diff=None,
        rank0_reads_its_share=True,
        ranks_overlap=False,
        repeats_first_epoch=False,
        zero_grads_per_step=1,
        ranks_drift_from=None,
        params_equal=True,
        stopped_after=None,
        resume_at=None,
        resume_diff=None,
        logged_steps=8,
        optimizer_steps=8,
    )
    return dataclasses.replace(facts, **changes)


TRAINING = dict(params_equal=False, first_param_diff=1, first_loss_diff=2, first_grad_diff=2)


def trained(**changes) -> dict:
    """The facts of a training mistake: other parameters from step 1, with `changes`."""
    return {**TRAINING, **changes}


# the facts each plant leaves (read from `python tools/check.py COPY --facts`)
PLANT_FACTS = {
    "a collective called by only some ranks": dict(hung=True),
    "the replicas' losses not reduced": dict(
        chapter=3,
        world_size=1,
        stopped_after=0,
        failure="RuntimeError: grad can be implicitly created only for scalar outputs",
    ),
    "the replicas' losses summed, not averaged": trained(
        chapter=3,
        world_size=1,
        grad_accum=4,
        replicas=2,
        loss_ratio_at_1=2.0,
        grad_ratio_at_1=2.0,
        first_loss_diff=1,
        first_grad_diff=1,
    ),
    "no DataParallel": dict(chapter=3, world_size=1, grad_accum=4, replicas=0),
    "no FSDP": dict(chapter=6, sharded=False, first_data_diff=1),
    "optimizer.step() inside the micro-loop": trained(
        chapter=2, world_size=1, grad_accum=4, optimizer_steps=32, grad_ratio_at_1=0.25
    ),
    "zero_grad inside the micro-loop": trained(
        chapter=2, world_size=1, grad_accum=4, zero_grads_per_step=4, grad_ratio_at_1=0.3
    ),
    "the learning rate advanced per micro-step": trained(
        chapter=2, world_size=1, grad_accum=4, first_lr_diff=2, lr_speed=4
    ),
    "the gradient-sync switch off on the last micro-step": trained(
        chapter=6,
        sharded=True,
        last_micro_step_unsynced=True,
        first_grad_diff=1,
        grad_ratio_at_1=0.56,
    ),
    "no_sync on the wrong micro-step": trained(
        last_micro_step_unsynced=True, ranks_drift_from=1, grad_ratio_at_1=0.9
    ),
    "gradients never averaged": trained(ranks_drift_from=1, grad_ratio_at_1=1.3),
    "clipping or stepping on some ranks only": trained(ranks_drift_from=1, ranks_clip_differ=True),
    "a global batch that forgets world_size or grad_accum": trained(
        script_steps_per_epoch=7, first_data_diff=1
    ),
    "all ranks reading the same windows": trained(
        ranks_same_windows=True, first_data_diff=1, ranks_overlap=True
    ),
    "loss divided by world_size by hand": trained(
        loss_ratio_at_1=0.5, grad_ratio_at_1=0.5, first_loss_diff=1
    ),
    "loss not divided by K": trained(
        chapter=2, world_size=1, grad_accum=4, loss_ratio_at_1=4.0, grad_ratio_at_1=4.0
    ),
    "samplers seeded per rank": trained(first_data_diff=1, ranks_overlap=True),
    "a forgotten set_epoch": trained(
        first_data_diff=4, repeats_first_epoch=True, first_param_diff=4, first_loss_diff=4
    ),
    "ranks' logged loss not averaged": dict(first_loss_diff=1, loss_ratio_at_1=2.0),
    "your evaluation differs; training is the same": dict(first_val_diff=8, val_ratio=0.998),
    "a checkpoint of rank 0's shards only": dict(
        chapter=6,
        sharded=True,
        resume_at=5,
        resume_diff=6,
        resume_reads_steps=[6],
        resume_first_grad_diff=6,
        resume_first_param_diff=6,
        resume_start_differs=True,
    ),
    "resume skipping steps instead of micro-batches": dict(
        chapter=2,
        world_size=1,
        grad_accum=4,
        resume_at=5,
        resume_diff=6,
        resume_reads_steps=[4, 5],
        resume_first_data_diff=6,
    ),
    "a resume that re-reads an earlier step's windows": dict(
        resume_at=5, resume_diff=6, resume_reads_steps=[4], resume_first_data_diff=6
    ),
    "a resume that does not restore the optimizer state": dict(
        chapter=2,
        world_size=1,
        grad_accum=4,
        resume_at=5,
        resume_diff=7,
        resume_first_param_diff=6,
        resume_first_grad_diff=7,
    ),
    "a restart that does not continue the run": dict(
        chapter=5, restart="after the restart: error: out/run holds another run"
    ),
}


def test_every_entry_has_the_facts_of_its_plant():
    assert set(PLANT_FACTS) == set(BY_NAME)


@pytest.mark.parametrize("name", list(PLANT_FACTS))
def test_each_signature_names_its_plant_from_the_facts(name):
    """The first entry that fits the plant's facts, not ruled out, is the plant's own; and the
    planted script's line is quoted (tried on the planted copy, where the entry has a plant)."""
    mistake = BY_NAME[name]
    facts = same_facts(**PLANT_FACTS[name])
    source = planted(mistake) if mistake.plant else ""
    chapter = chapter_script(facts.chapter) if source else None
    found, _, look = diagnose(facts, source, "copy.py", chapter)
    assert found is mistake, (found and found.name, look)


def test_facts_that_rule_an_entry_out_leave_it_out_and_say_why():
    # the parameters equal chapter 01's: a logged loss K = W = 2 times chapter 01's is logging
    facts = same_facts(first_loss_diff=1, loss_ratio_at_1=2.0, grad_ratio_at_1=1.0)
    found, notes, _ = diagnose(facts)
    assert found is BY_NAME["ranks' logged loss not averaged"]
    assert any(n.startswith('not "loss not divided by K": the parameters equal') for n in notes)
    # rank 0's gradient is chapter 01's: the copies drift because of what a rank did with it
    facts = same_facts(**trained(ranks_drift_from=1))
    found, notes, _ = diagnose(facts)
    assert found is BY_NAME["clipping or stepping on some ranks only"]
    assert any("the gradients were averaged" in n for n in notes)


def test_the_chapters_right_line_is_not_a_diagnosis():
    """A plant-like mistake elsewhere: the entry's lines are the chapter's, so it falls through."""
    facts = same_facts(first_loss_diff=1, loss_ratio_at_1=2.0)
    source = chapter_script(4)
    found, notes, _ = diagnose(facts, source, "copy.py", source)
    assert found is None
    assert any("own `dist.all_reduce(loss" in n for n in notes), notes


def test_what_the_facts_show_when_nothing_fits():
    facts = same_facts(loss_ratio_at_1=0.5, grad_ratio_at_1=1.0, first_loss_diff=1, first_lr_diff=3)
    text = "\n".join(describe(facts))
    assert "loss 0.5 (= 1/W = 1/2)" in text, text
    assert "gradient norm 1 (equal)" in text, text
    assert "loss from step 1, learning rate from step 3" in text, text
    assert "only the logging differs" in text, text
    assert "the ranks' copies agree" in text, text


def test_a_relative_script_path_keeps_its_line_number(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "02_grad_accumulation/train.py", line 61, in main\n'
        "AttributeError: 'Namespace' object has no attribute 'grad_acum'\n"
    )
    run = check.Run(tmp_path, tmp_path, log, 1)
    line = check.failure_line(run, Path("02_grad_accumulation/train.py"))
    assert line.endswith("(line 61 of 02_grad_accumulation/train.py)"), line


def test_exercises_are_made_from_the_current_scripts():
    assert make_exercises.main(["--check"]) == 0, f"run {REGENERATE}"


def test_every_check_gets_a_folder_of_its_own(tmp_path):
    script = REPO / CHAPTERS[2] / "train.py"
    first, second = check.fresh_folder(tmp_path, script), check.fresh_folder(tmp_path, script)
    assert first != second
    assert first.is_dir()
    assert second.is_dir()


# ---- real runs -----------------------------------------------------------------------------


@pytest.mark.parametrize("chapter", [2, 3, 4, 5, 6])
def test_each_exercise_as_given_is_not_chapter_01s_run(capsys, out_root, chapter):
    exercise = REPO / CHAPTERS[chapter] / "exercise.py"
    assert "TODO" in exercise.read_text()
    nproc = ["--nproc-per-node", "2"] if chapter >= 4 else []
    code, out = run_check(capsys, out_root, exercise, *nproc)
    assert code == 2, out
    assert out.startswith("could not run the script: "), out
    assert f"one sets chapter={chapter}" in out, out
    assert len(out.splitlines()) == 1, out


@pytest.mark.slow
@pytest.mark.parametrize("chapter", [3, 5])
def test_an_exercise_with_only_its_chapter_set_fails_until_solved(
    capsys, out_root, tmp_path, chapter
):
    """03: no DataParallel splits a batch; 05: a killed rank's restart does not continue. (06's,
    "no FSDP", is named from its facts above: a real run of it would add half a minute.)"""
    source = (REPO / CHAPTERS[chapter] / "exercise.py").read_text()
    source = source.replace(f"parse_args(chapter={chapter - 1},", f"parse_args(chapter={chapter},")
    (tmp_path / "exercise.py").write_text(source)
    nproc = ["--nproc-per-node", "2"] if chapter >= 4 else []
    code, out = run_check(capsys, out_root, tmp_path / "exercise.py", *nproc, "--no-plot")
    assert code == 1, out
    name = "no DataParallel" if chapter == 3 else "a restart that does not continue the run"
    assert f"diagnosis: {name}: " in out, out


# 05's check (two nodes, a killed rank, the restart) and 06's (a stop and a resume on shards) run in
# the slow stage
@pytest.mark.parametrize(
    "chapter",
    [2, 3, pytest.param(5, marks=pytest.mark.slow), pytest.param(6, marks=pytest.mark.slow)],
)
def test_the_chapter_scripts_are_the_same_run(capsys, out_root, chapter):
    """02 and 03 without the resume phase (chapter 04's test below runs it); 05 as two nodes, with
    a killed rank and torchrun's restart; 06 with its shards gathered whole, and resumed from its
    ckpt.pt (where "a checkpoint of rank 0's shards only" must not fire)."""
    nproc = ["--nproc-per-node", "2"] if chapter >= 4 else []
    resume = ["--no-resume"] if chapter < 5 else []
    script = REPO / CHAPTERS[chapter] / "train.py"
    code, out = run_check(capsys, out_root, script, *nproc, *resume, "--no-plot")
    assert code == 0, out
    assert "same run: all 8 losses, learning rates, the validation loss and the parameters" in out
    if chapter == 3:
        assert "split over 2 replicas" in out, out
    if chapter == 5:
        assert "torchrun restarted the group, and it continued" in out, out
    if chapter == 6:
        assert "gathered whole from the shards of all 2 ranks" in out, out
        assert "stopped at step 5 and resumed: the same end" in out, out


def test_chapter_04_with_two_ranks_is_the_same_run_and_resumes(capsys, out_root):
    code, out = run_check(
        capsys, out_root, REPO / CHAPTERS[4] / "train.py", "--nproc-per-node", "2"
    )
    assert code == 0, out
    assert "on all 2 ranks" in out, out
    assert "stopped at step 5 and resumed: the same end" in out, out
    png = re.search(r"^plot: (.*\.png)$", out, re.M)
    # a path relative to the course, or absolute
    assert png, out
    assert (REPO / png.group(1)).is_file(), out
    # what a learner looks at stays; the checkpoints and parameter files (100 MB) do not
    folder = (REPO / png.group(1)).parent
    assert (folder / "facts.json").is_file()
    assert (folder / "run.log").is_file()
    assert not list(folder.rglob("*.pt"))


# the plants checked by real runs: one of each kind of fact the probe must deliver
RUN = [
    "your evaluation differs; training is the same",  # val_loss
    "ranks' logged loss not averaged",  # every row, the parameters equal
    "clipping or stepping on some ranks only",  # per-rank clipping, the gradient's ratio 1
    "the learning rate advanced per micro-step",  # the logged lr
    "optimizer.step() inside the micro-loop",  # optimizer steps per logged step
    "the replicas' losses summed, not averaged",  # chapter 03's stand-in replicas
    "a resume that does not restore the optimizer state",  # the resumed run's steps
    "a checkpoint of rank 0's shards only",  # FSDP: the resumed run's start, gathered whole
]


# the suite runs the first; the others run in the slow stage (python -m pytest -m slow)
@pytest.mark.parametrize(
    "name",
    [RUN[0], *(pytest.param(name, marks=pytest.mark.slow) for name in RUN[1:])],
)
def test_planted_mistakes_are_caught_and_named(capsys, out_root, tmp_path, name):
    mistake = BY_NAME[name]
    script = planted_copy(tmp_path / "copy", mistake)
    code, out = run_check(
        capsys, out_root, script, "--nproc-per-node", str(mistake.plant_ranks), "--no-plot"
    )
    assert code == 1, out
    assert "not the same run:" in out, out
    assert f"diagnosis: {mistake.name}: " in out, out
    # the line to look at: the planted one, found in the copy, or where the removed one belongs
    assert re.search(r"look at line \d+ of |your script has no such line; ", out), out


def test_a_collective_on_some_ranks_only_is_named_as_a_hang(capsys, out_root, tmp_path):
    """Each rank's line and the collective it waits in, in well under the gloo timeout."""
    script = planted_copy(tmp_path / "copy", MISTAKES[0])
    began = time.monotonic()
    code, out = run_check(capsys, out_root, script, "--nproc-per-node", "2", "--no-plot")
    took = time.monotonic() - began
    assert code == 1, out
    assert "the ranks hang" in out, out
    assert "nothing is known to differ" in out, out
    assert re.search(r"rank 0 waits in all_reduce at line \d+ of .*: `dist.all_reduce\(val_", out)
    assert re.search(r"rank 1 waits in \w+ at line \d+ of ", out), out
    assert "diagnosis: a collective called by only some ranks" in out, out
    print(f"the hang was named in {took:.0f} s")


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
    assert last.startswith("could not run the script: AttributeError: "), out
    assert "grad_acum" in last, out
    assert "Traceback" not in out
