"""The checker (tools/check/): the chapter scripts are chapter 01's run, the exercises as given are
not, every mistake of the catalogue (tools/check/mistakes.py) is named from the facts its plant
(tests/plants.py) leaves, and a selection of plants is caught and named by real runs.

Cheap first: every entry's patterns still find the chapter's statements and every plant applies, in
the chapter scripts as they are and reformatted at another line length (the catalogue names
statements by shape, so a restyle breaks no entry); every signature is tried on the facts its plant
leaves, written down here, with the rule-outs that keep the advice from contradicting itself. Then
real processes (torchrun with 2 ranks for chapter 04, two simulated nodes for chapter 05) on the
tiny model, 8 steps in float64: chapter 01's reference run is made once per test process and shared
by every check (the checker keeps it under its --out-root).
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plants import PLANTS, UNKNOWN
from statements import Pattern, rewrite

from common.chapters import CHAPTERS, NOT_CHAPTER_01S_RUN, base
from layout import REPO
from maintainer import REGENERATE, make_exercises
from tools.check import probe
from tools.check import reference as runner
from tools.check.__main__ import Seen, main, plotted_run, same_lines
from tools.check.facts import Facts
from tools.check.harness import fresh_folder
from tools.check.mistakes import MISTAKES, describe, diagnose, nearest_line
from tools.check.reference import PLANS, reference_of
from tools.launch import child_env

BY_NAME = {m.name: m for m in MISTAKES}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("check")


def run_check(capsys, out_root: Path, script: Path, *flags: str) -> tuple[int, str]:
    code = main([str(script), "--out-root", str(out_root), *flags])
    return code, capsys.readouterr().out


def chapter_script(chapter: int) -> str:
    return (REPO / CHAPTERS[chapter] / "train.py").read_text()


def planted(name: str, source: str | None = None) -> str:
    plant = PLANTS[name]
    source = source if source is not None else chapter_script(plant.chapter)
    return plant.applied(source, f"{CHAPTERS[plant.chapter]}/train.py")


def planted_copy(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "train.py").write_text(planted(name))
    return folder / "train.py"


# ---- cheap: the catalogue against the facts each plant leaves ---------------------------------


def test_every_entry_has_a_plant():
    assert set(PLANTS) == set(BY_NAME)


def same_facts(chapter: int = 4, **changes) -> Facts:
    """The facts of a run that is chapter 01's (2 ranks, K = 2, 3 steps an epoch, 8 steps), as
    chapter `chapter` plans it, with `changes` (each a field's name: Facts.but)."""
    return Facts(plan=PLANS[chapter]).but(**{"script_steps_per_epoch": 3, **changes})


TRAINING = dict(params_equal=False, first_param_diff=1, first_loss_diff=2, first_grad_diff=2)


def trained(**changes) -> dict:
    """The facts of a training mistake: other parameters from step 1, with `changes`."""
    return {**TRAINING, **changes}


# the facts each plant leaves (read from `python -m tools.check COPY --facts`)
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
    "no FSDP": dict(chapter=7, sharded=False, first_data_diff=1),
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
        chapter=7,
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
        first_data_diff=4,
        repeats_first_epoch=True,
        first_param_diff=4,
        first_loss_diff=4,
        epoch_orders=(0, 0, 0),
    ),
    "ranks' logged loss not averaged": dict(first_loss_diff=1, loss_ratio_at_1=2.0),
    "your evaluation differs; training is the same": dict(first_val_diff=8),
    # the resumed run fails: rank 0's shards do not load into the whole model
    "a checkpoint of rank 0's shards only": dict(
        chapter=7,
        sharded=True,
        params_equal=False,
        failure="RuntimeError: Error(s) in loading state_dict for GPT: (line 185 of copy/train.py)",
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
        chapter=2,
        world_size=1,
        grad_accum=4,
        resume_at=5,
        resume_diff=6,
        resume_reads_steps=[4],
        resume_first_data_diff=6,
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
        chapter=6, restart="after the restart: error: out/run holds another run"
    ),
    # the optimizer holds the meta-device tensors the model was built with: its first step fails
    "the optimizer built before fully_shard": dict(
        chapter=7,
        fsdp_forwards=True,
        params_equal=False,
        failure="RuntimeError: Tensor.item() cannot be called on meta tensors "
        "(line 349 of copy/train.py)",
    ),
    "the GPU chosen by RANK, not LOCAL_RANK": dict(chapter=5, devices=((0, 0, 0), (1, 0, 1))),
    # epoch 1 reads the order of epoch 3, epoch 2 that of epoch 6
    "set_epoch given the step, not the epoch": trained(
        first_data_diff=4,
        first_loss_diff=4,
        first_grad_diff=4,
        first_param_diff=4,
        epoch_orders=(0, 3, 6),
        first_data_micro=(0, 1),
    ),
    # step 1's loss is chapter 01's, its gradient norm differs by float32's rounding
    "gradients reduced in float32 in a float64 run": dict(
        chapter=7,
        sharded=True,
        params_equal=False,
        distance=3.4e-9,
        first_grad_diff=1,
        grad_rel_diff=1.7e-9,
        grad_ratio_at_1=1 - 1.7e-9,
        first_param_diff=2,
    ),
    # chapter 08, against its own run: a sync after steps 2, 4, 6 and 8
    "the sync on some ranks only": dict(
        chapter=8,
        params_equal=False,
        stopped_after=1,
        failure="[enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. "
        "934992 vs 8. Received data size doesn't match expected size. Is there a distributed "
        "collective mismatch in your code?",
    ),
    "the pseudo-gradient's sign flipped": trained(
        chapter=8,
        first_param_diff=3,
        first_loss_diff=3,
        first_grad_diff=3,
        outer_steps=4,
        ref_outer_steps=4,
        first_sync=2,
        sync_move_ratio=-1 + 2e-12,
    ),
    # the outer step is linear in its gradient: W = 2 times the mean moves it twice as far
    "the pseudo-gradients summed, never divided by the ranks": trained(
        chapter=8,
        first_param_diff=3,
        first_loss_diff=3,
        first_grad_diff=3,
        outer_steps=4,
        ref_outer_steps=4,
        first_sync=2,
        sync_move_ratio=2.0,
    ),
    "the outer step on the local copy": trained(
        chapter=8,
        first_param_diff=3,
        first_loss_diff=3,
        first_grad_diff=3,
        outer_steps=4,
        ref_outer_steps=4,
        first_sync=2,
        sync_move_ratio=-0.0,
    ),
    "the copies not reset after the outer step": trained(
        chapter=8,
        first_param_diff=3,
        first_loss_diff=3,
        first_grad_diff=3,
        ranks_drift_from=2,
        drifting=(1,),
        outer_steps=4,
        ref_outer_steps=4,
        first_sync=2,
        sync_move_ratio=-1.3158,
        kept_own_copy=True,
    ),
    # 1 / (0.7 x (1 + 0.9)): the average is an outer step of lr 1 without momentum
    "the parameters averaged, not the pseudo-gradients": trained(
        chapter=8,
        first_param_diff=3,
        first_loss_diff=3,
        first_grad_diff=3,
        outer_steps=0,
        ref_outer_steps=4,
        first_sync=2,
        sync_move_ratio=0.75188,
    ),
}

# the facts the plants the catalogue does not know leave (`python -m tools.check COPY --facts`)
UNKNOWN_FACTS = {
    # the loader of epoch 1 is built with epoch 0's order, that of epoch 2 with epoch 1's
    "set_epoch after the loader is built": trained(
        first_data_diff=4,
        first_loss_diff=4,
        first_grad_diff=4,
        first_param_diff=4,
        first_val_diff=8,
        repeats_first_epoch=True,
        epoch_orders=(0, 0, 1),
        first_data_micro=(0, 1),
    ),
    # the gradients rounded to float16 on their way between the ranks
    "gradients sent in float16": dict(
        params_equal=False,
        distance=2.7e-3,
        first_grad_diff=1,
        grad_rel_diff=1.5e-6,
        grad_ratio_at_1=1 + 1.5e-6,
        first_param_diff=1,
        first_loss_diff=2,
        loss_rel_diff=1.5e-6,
        first_val_diff=8,
    ),
}
# what the description of each must say: where the first difference sits, and the line planted
UNKNOWN_SAYS = {
    "set_epoch after the loader is built": (
        "step 4 is the first step of epoch 1 (an epoch is 3 steps here)",
        "epoch 1 read epoch 0's order (the permutation of seed + 0); epoch 2 read epoch 1's",
        "(the data order): `sampler.set_epoch(epoch)`; chapter 04 has it in another place after ",
    ),
    "gradients sent in float16": (
        "the gradient norm at step 1 differs by a relative 1.5e-06 in a float64 check",
        "the size of 16 bits' rounding",
        "look at dtypes, autocast, mixed-precision policies and DDP's communication hooks",
        "(the number format): `model.register_comm_hook(None, default_hooks.fp16_compress_hook)`",
        "; chapter 04 has no such line",
    ),
}


def test_every_entry_has_the_facts_of_its_plant():
    assert set(PLANT_FACTS) == set(BY_NAME)


@pytest.mark.parametrize("name", list(PLANT_FACTS))
def test_each_plant_is_named_from_its_facts_and_nothing_else(name):
    """The entries that fit the plant's facts, not ruled out, are the plant's own alone; the line
    quoted is the planted copy's code (never a comment or a docstring) or the one it left out."""
    facts = same_facts(**PLANT_FACTS[name])
    found, _ = diagnose(facts)
    assert [m.name for m in found] == [name]
    if PLANTS[name].edits:
        copy, theirs = planted(name), chapter_script(facts.plan.chapter)
        near = nearest_line(facts, copy, "copy.py", theirs, found[0].kind)
        quoted = re.match(r"look at line (\d+) of copy.py[^:]*: `(.*?)`", near or "")
        assert quoted or near.startswith("your script has no such line; "), near
        if quoted:
            line = copy.splitlines()[int(quoted.group(1)) - 1].strip()
            assert not line.startswith(("#", '"')), near


def test_facts_that_rule_an_entry_out_leave_it_out_and_say_why():
    # the parameters equal chapter 01's: a logged loss K = W = 2 times chapter 01's is logging
    facts = same_facts(first_loss_diff=1, loss_ratio_at_1=2.0, grad_ratio_at_1=1.0)
    found, notes = diagnose(facts)
    assert found == [BY_NAME["ranks' logged loss not averaged"]]
    assert any(n.startswith('not "loss not divided by K": the parameters equal') for n in notes)
    # rank 0's gradient is chapter 01's: the copies drift because of what a rank did with it
    facts = same_facts(**trained(ranks_drift_from=1))
    found, notes = diagnose(facts)
    assert found == [BY_NAME["clipping or stepping on some ranks only"]]
    assert any("the gradients were averaged" in n for n in notes)


def test_the_nearest_line_is_code_never_a_docstring_or_a_comment():
    """A copy whose docstring and comments are rewritten and one line changed: that line; the
    chapter itself: no line of its own is blamed."""
    theirs = chapter_script(8)
    facts = same_facts(**PLANT_FACTS["the pseudo-gradient's sign flipped"])
    copy = planted("the pseudo-gradient's sign flipped")
    copy = copy.replace('"""', '"""' + "A docstring of my own, far longer than a line. " * 20, 1)
    copy = re.sub(r"# .*", "# my own comment", copy)
    near = nearest_line(facts, copy, "copy.py", theirs, "training")
    assert near.startswith("look at line "), near
    assert "moved = " in near and "p.detach() - g.detach()" in near, near
    near = nearest_line(facts, theirs, "copy.py", theirs, "training")
    assert near.startswith("your script's statements are chapter 08's"), near


@pytest.mark.parametrize("name", list(UNKNOWN))
def test_a_mistake_the_catalogue_does_not_know_is_described_by_where_it_shows(name):
    """No entry fits the facts of the plant; the description places the first difference (an
    epoch boundary, the number format) and names the planted line."""
    plant = UNKNOWN[name]
    facts = same_facts(**{"chapter": plant.chapter, **UNKNOWN_FACTS[name]})
    chapter = chapter_script(plant.chapter)
    source = plant.applied(chapter, f"{CHAPTERS[plant.chapter]}/train.py")
    found, _ = diagnose(facts)
    assert found == [], [m.name for m in found]
    text = "\n".join([*describe(facts), nearest_line(facts, source, "copy.py", chapter) or ""])
    for says in UNKNOWN_SAYS[name]:
        assert says in text, text


def test_a_float32_sized_difference_is_named_as_float32():
    """The parameters alone differ, by 3e-9 in a float64 check: float32's rounding."""
    plain = dict(chapter=2, world_size=1, params_equal=False, distance=3e-9, first_param_diff=8)
    text = "\n".join(describe(same_facts(**plain)))
    assert "the final parameters differ by a relative 3.0e-09 in a float64 check" in text, text
    assert "something computes in float32; look at dtypes, autocast and mixed-precision" in text
    # other windows are no rounding, however small the difference
    facts = same_facts(
        chapter=2, world_size=1, params_equal=False, distance=3e-9, first_data_diff=2
    )
    assert "float32" not in "\n".join(describe(facts))


def test_the_first_difference_is_placed_among_the_epochs_and_the_resume():
    facts = same_facts(**trained(first_param_diff=5, first_loss_diff=6, first_grad_diff=5))
    assert "step 5 is step 2 of epoch 1 (an epoch is 3 steps here)" in describe(facts)
    resumed = same_facts(resume_at=5, resume_diff=7)
    said = "\n".join(describe(resumed))
    assert "after the resume at step 5: differs from step 7, 1 step(s) after the resume" in said
    assert "(step 7 is the first step of epoch 2" in said, said


def test_what_the_facts_show_when_nothing_fits():
    facts = same_facts(loss_ratio_at_1=0.5, grad_ratio_at_1=1.0, first_loss_diff=1, first_lr_diff=3)
    text = "\n".join(describe(facts))
    assert "loss 0.5 (= 1/W = 1/2)" in text, text
    assert "gradient norm 1 (equal)" in text, text
    assert "loss from step 1, learning rate from step 3" in text, text
    assert "only the logging differs" in text, text
    assert "the ranks' copies: equal on all 2 ranks at every step" in text, text


def test_a_relative_script_path_keeps_its_line_number(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "02_grad_accumulation/train.py", line 61, in main\n'
        "AttributeError: 'Namespace' object has no attribute 'grad_acum'\n"
    )
    run = runner.Run(tmp_path, tmp_path, log, 1)
    line = runner.failure_line(run, Path("02_grad_accumulation/train.py"))
    assert line.endswith("(line 61 of 02_grad_accumulation/train.py)"), line


def test_exercises_are_made_from_the_current_scripts():
    assert make_exercises.main(["--check"]) == 0, f"run {REGENERATE}"


def test_every_check_gets_a_folder_of_its_own(tmp_path):
    script = REPO / CHAPTERS[2] / "train.py"
    first, second = fresh_folder(tmp_path, script), fresh_folder(tmp_path, script)
    assert first != second
    assert first.is_dir()
    assert second.is_dir()


# ---- real runs -----------------------------------------------------------------------------


@pytest.mark.parametrize("chapter", list(CHAPTERS)[1:])
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
@pytest.mark.parametrize("chapter", [3, 6])
def test_an_exercise_with_only_its_chapter_set_fails_until_solved(
    capsys, out_root, tmp_path, chapter
):
    """03: no DataParallel splits a batch; 06: a killed rank's restart does not continue. (07's,
    "no FSDP", is named from its facts above: a real run of it would add half a minute.)"""
    source = (REPO / CHAPTERS[chapter] / "exercise.py").read_text()
    given = f"CourseParser(chapter={base(chapter)},"
    source = source.replace(given, f"CourseParser(chapter={chapter},")
    (tmp_path / "exercise.py").write_text(source)
    nproc = ["--nproc-per-node", "2"] if chapter >= 4 else []
    code, out = run_check(capsys, out_root, tmp_path / "exercise.py", *nproc, "--no-plot")
    assert code == 1, out
    name = "no DataParallel" if chapter == 3 else "a restart that does not continue the run"
    assert f"diagnosis: {name}: " in out, out


# 05's check (two nodes, a stop and a resume), 06's (two nodes, a killed rank, the restart) and
# 07's (a stop and a resume on shards) run in the slow stage
@pytest.mark.parametrize(
    "chapter",
    [
        2,
        3,
        pytest.param(5, marks=pytest.mark.slow),
        pytest.param(6, marks=pytest.mark.slow),
        pytest.param(7, marks=pytest.mark.slow),
        pytest.param(8, marks=pytest.mark.slow),
    ],
)
def test_the_chapter_scripts_are_the_same_run(capsys, out_root, chapter):
    """02 and 03 without the resume phase (chapter 04's test below runs it); 05 as two nodes,
    stopped and resumed; 06 as two nodes, with a killed rank and torchrun's restart; 07 with its
    shards gathered whole, and resumed from its ckpt.pt (where "a checkpoint of rank 0's shards
    only" must not fire); 08 against its own run, stopped at a sync and resumed."""
    nproc = ["--nproc-per-node", "2"] if chapter >= 4 else []
    resume = ["--no-resume"] if chapter < 5 else []
    script = REPO / CHAPTERS[chapter] / "train.py"
    code, out = run_check(capsys, out_root, script, *nproc, *resume, "--no-plot")
    assert code == 0, out
    assert "same run: all 8 losses, learning rates, the validation loss and the parameters" in out
    if chapter == 3:
        assert "split over 2 replicas" in out, out
    if chapter == 5:
        assert "(2 nodes x 1 rank(s) x " in out, out
        assert "stopped at step 5 and resumed: the same end" in out, out
        assert "rank 1 (LOCAL_RANK 0) cuda:0" in out, out  # read from its device statement
    if chapter == 6:
        assert "torchrun restarted the group, and it continued" in out, out
    if chapter == 7:
        assert "gathered whole from the shards of all 2 ranks" in out, out
        assert "stopped at step 5 and resumed: the same end" in out, out
    if chapter == 8:  # against its own run, whose copies train apart between the syncs
        assert "against chapter 08's own train.py, run the same way" in out, out
        assert "equal chapter 08's, on all 2 ranks" in out, out
        assert "stopped at step 4 and resumed: the same end" in out, out


@pytest.mark.slow
def test_chapter_04_with_two_ranks_is_the_same_run_and_resumes(capsys, out_root):
    code, out = run_check(
        capsys, out_root, REPO / CHAPTERS[4] / "train.py", "--nproc-per-node", "2"
    )
    assert code == 0, out
    assert "on all 2 ranks" in out, out
    assert "stopped at step 5 and resumed: the same end" in out, out
    png = re.search(r"^plot: (.*\.png)$", out, re.M)
    assert png, out
    assert (REPO / png.group(1)).is_file(), out  # a path relative to the course, or absolute
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
    "a checkpoint of rank 0's shards only",  # FSDP: the resumed run fails to load it
    "the optimizer built before fully_shard",  # FSDP: an optimizer of meta-device tensors
    "the GPU chosen by RANK, not LOCAL_RANK",  # two nodes: the GPU index each rank asked for
    "set_epoch given the step, not the epoch",  # the order each epoch read
    "gradients reduced in float32 in a float64 run",  # the size of a difference: float32's
    # chapter 08, against its own run: the outer steps and where each round's copy starts
    "the pseudo-gradient's sign flipped",  # the first sync's move, -1 times chapter 08's
    "the pseudo-gradients summed, never divided by the ranks",  # W times chapter 08's
    "the outer step on the local copy",  # the sync moved nothing
    "the copies not reset after the outer step",  # the next round starts from the copy's own
    "the parameters averaged, not the pseudo-gradients",  # no outer step; moved 0.75 times
    "the sync on some ranks only",  # gloo's collective mismatch, where NCCL hangs
]


# real runs of every plant: the slow stage's (python -m pytest -m slow); the suite matches each
# plant's signature from its facts (test_each_plant_is_named_from_its_facts_and_nothing_else)
@pytest.mark.slow
@pytest.mark.parametrize("name", RUN)
def test_planted_mistakes_are_caught_and_named(capsys, out_root, tmp_path, name):
    mistake = BY_NAME[name]
    script = planted_copy(tmp_path / "copy", name)
    code, out = run_check(
        capsys, out_root, script, "--nproc-per-node", str(PLANTS[name].ranks), "--no-plot"
    )
    assert code == 1, out
    assert "not the same run:" in out, out
    assert f"diagnosis: {mistake.name}: " in out, out
    # the line to look at: the planted one, found in the copy, or where the removed one belongs
    assert re.search(r"look at line \d+ of |your script has no such line; ", out), out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UNKNOWN))
def test_a_planted_mistake_the_catalogue_does_not_know_is_described(
    capsys, out_root, tmp_path, name
):
    plant = UNKNOWN[name]
    (tmp_path / "copy").mkdir()
    script = tmp_path / "copy" / "train.py"
    chapter = chapter_script(plant.chapter)
    script.write_text(plant.applied(chapter, f"{CHAPTERS[plant.chapter]}/train.py"))
    code, out = run_check(
        capsys, out_root, script, "--chapter", str(plant.chapter), "--nproc-per-node", "2"
    )
    assert code == 1, out
    assert "diagnosis: no known mistake fits; what the facts show:" in out, out
    for says in UNKNOWN_SAYS[name]:
        assert says in out, out


def test_a_collective_on_some_ranks_only_is_named_as_a_hang(capsys, out_root, tmp_path):
    """Each rank's line and the collective it waits in, in well under the gloo timeout."""
    script = planted_copy(tmp_path / "copy", "a collective called by only some ranks")
    began = time.monotonic()
    code, out = run_check(capsys, out_root, script, "--nproc-per-node", "2", "--no-plot")
    took = time.monotonic() - began
    assert code == 1, out
    assert "the ranks hang" in out, out
    assert "nothing is known to differ" in out, out
    assert re.search(r"rank 0 waits in all_reduce at line \d+ of .*: `dist.all_reduce\(loss", out)
    # rank 1 went on to the next step, whose forward waits for rank 0 inside DDP
    assert re.search(r"rank 1 waits in DDP's _pre_forward at line \d+ of .*: `_, micro_loss", out)
    assert "diagnosis: a collective called by only some ranks" in out, out
    print(f"the hang was named in {took:.0f} s")


def test_a_ranks_abort_is_the_failure_not_the_others_lost_connection(tmp_path):
    """gloo ends a rank whose collective receives more than it holds (a C++ abort); the others
    then fail on their lost connection: the abort's message is the failure, which the catalogue
    names as collectives that do not match."""
    log = tmp_path / "run.log"
    log.write_text(
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 934992 vs 8. "
        "Received data size doesn't match expected size. Is there a distributed collective "
        "mismatch in your code?\n"
        "[rank0]: RuntimeError: [pair.cc:537] Read error [127.0.0.1]:19878: Connection reset by "
        "peer.\n"
    )
    run = runner.Run(tmp_path, tmp_path, log, 1)
    line = runner.failure_line(run, Path("08_slow_link/train.py"))
    assert line.startswith("[enforce fail at pair.cc:456] "), line
    facts = same_facts(chapter=8, failure=line, stopped_after=1, params_equal=False)
    found, _ = diagnose(facts)
    assert found == [BY_NAME["the sync on some ranks only"]]
    found, _ = diagnose(same_facts(chapter=4, failure=line, stopped_after=1))
    assert found == [BY_NAME["a collective called by only some ranks"]]


def test_a_chapter_whose_run_is_not_chapter_01s_is_compared_with_its_own():
    """Chapter 08's reference is its own train.py, run as the check runs the script: the same
    ranks and flags (a sync every 2 steps, the outer momentum on); the others' is chapter 01's."""
    for number, plan in PLANS.items():
        ranks = 2 if plan.distributed else 1
        script, launch, flags = reference_of(plan, ranks)
        if number in NOT_CHAPTER_01S_RUN:
            assert script == REPO / CHAPTERS[number] / "train.py"
            assert (launch.nproc, launch.torchrun) == (2, True)
            assert flags == {**plan.split(2), **plan.extra_flags()}
        else:
            assert script == REPO / CHAPTERS[1] / "train.py"
            assert (launch.nproc, flags) == (1, {"batch_size": 8})
    assert PLANS[8].extra_flags()["sync_every"] == 2
    assert PLANS[8].extra_flags()["outer_momentum"] > 0


def test_a_script_that_fails_is_one_line_without_a_traceback(capsys, out_root, tmp_path):
    source = (REPO / CHAPTERS[2] / "train.py").read_text()
    typo = rewrite(
        source,
        Pattern(assigns="global_batch"),
        "args.grad_accum",
        "args.grad_acum",
        "02_grad_accumulation/train.py",
    )
    (tmp_path / "train.py").write_text(typo)
    code, out = run_check(capsys, out_root, tmp_path / "train.py", "--no-plot")
    assert code == 2, out
    last = out.splitlines()[-1]
    assert last.startswith("could not run the script: AttributeError: "), out
    assert "grad_acum" in last, out
    assert "Traceback" not in out


# ---- what the checker says, and what it cannot see -----------------------------------------


def test_a_torch_without_the_probes_private_hook_runs_nothing(tmp_path):
    """Where torch's private function is missing, the probe fails before the script runs: never a
    verdict on steps it could not tell from torch's own."""
    facts, script = str(tmp_path / "facts"), str(REPO / CHAPTERS[1] / "train.py")
    code = (
        "import runpy, sys\n"
        "import torch.distributed.checkpoint.state_dict as state_dict\n"
        "del state_dict._init_optim_state\n"
        f"sys.argv = ['probe', {facts!r}, {script!r}]\n"
        "runpy.run_module('tools.check.probe', run_name='__main__', alter_sys=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=child_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0, proc.stdout
    assert "_init_optim_state" in proc.stderr, proc.stderr
    assert not (tmp_path / "facts").exists()


def test_the_plot_shows_the_resumed_run_when_only_it_differs(tmp_path):
    run, ref, resumed = (runner.Run(tmp_path / n, tmp_path, tmp_path / n, 0) for n in "abc")
    facts = same_facts(resume_at=5, resume_diff=6)
    shown, label, first = plotted_run(Seen(facts, run, ref, resumed, None))
    assert shown is resumed, label
    assert "resumed" in label
    assert first == 6
    shown, _, _ = plotted_run(Seen(same_facts(**trained()), run, ref, resumed, None))
    assert shown is run


def test_every_same_run_verdict_names_what_it_did_not_check(tmp_path):
    run = runner.Run(tmp_path, tmp_path, tmp_path / "log", 0)
    unread = "no statement that chooses a GPU index"
    for plan in PLANS.values():
        facts = Facts(plan=plan).but(devices=((0, 0, None), (1, 1, None)), device_unread=unread)
        said = "\n".join(same_lines(Seen(facts, run, run, None, None)))
        assert "  unchecked: " in said, said
        if plan.picks_gpu:
            assert f"which GPU each rank drives: {unread}" in said, said
    # read from the script: what was read is said, and what a CPU still cannot show
    read = dict(devices=((0, 0, 0), (1, 0, 0)), device_statement=(84, "device = cuda(local)"))
    said = "\n".join(same_lines(Seen(Facts(plan=PLANS[5]).but(**read), run, run, None, None)))
    assert "which GPU each rank would drive: line 84's `device = cuda(local)`" in said, said
    assert "rank 1 (LOCAL_RANK 0) cuda:0" in said, said
    assert "the CPU runs drive none (their index was read, not used)" in said, said
    assert "on one machine RANK is LOCAL_RANK" not in said, said  # chapter 05 runs two nodes
    said = "\n".join(same_lines(Seen(Facts(plan=PLANS[4]).but(**read), run, run, None, None)))
    assert "on one machine RANK is LOCAL_RANK, so which of the two the index follows" in said


def test_the_probe_reads_the_gpu_index_a_cpu_never_uses(tmp_path, monkeypatch):
    """The GPU branch does not run on a CPU: the probe evaluates the index of the device statement
    with the script's variables where the branch is reached, and says why where it cannot."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os\n"
        "import torch\n\n\n"
        "def main():\n"
        '    rank = int(os.environ["RANK"])\n'
        "    device = torch.device('cpu')\n"
        "    if torch.cuda.device_count() > 64:\n"
        "        device = torch.device('cuda', rank % 2)\n"
        "        torch.cuda.set_device(device)\n"
        "    if torch.cuda.device_count() > 64:\n"
        "        gpu = rank\n"
        '        other = torch.device(f"cuda:{gpu}")\n\n\n'
        "main()\n"
    )
    monkeypatch.setenv("RANK", "3")
    read = []
    for source in (script.read_text(), script.read_text().replace("rank % 2", "len([rank])")):
        script.write_text(source)
        recorder = probe.Recorder()
        try:
            probe.read_devices(recorder, str(script))
            runpy.run_path(str(script))
        finally:
            sys.settrace(None)
        read.append(recorder.device)
    assert read[0] == {"line": 9, "code": "device = torch.device('cuda', rank % 2)", "index": 1}
    assert read[1]["error"] == "`len([rank])` calls a function: not evaluated", read[1]
