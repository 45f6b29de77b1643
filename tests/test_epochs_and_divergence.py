"""Across epoch boundaries and a resume every chapter is still chapter 01's run, and a diverging
run stops with one line and loses nothing."""

from __future__ import annotations

import math
import re
import runpy
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import (
    checkpoint,
    epoch_permutation,
    outputs_of,
    replace_statement,
    start,
    tiny_run_args,
    train_losses,
)

from common.chapters import CHAPTERS
from common.data import TokenWindows, load_splits, prepare
from common.metrics import read_metrics
from common.support.errors import CourseError
from common.training import check_finite
from layout import REPO
from tools.check import corpus_text
from tools.check.reference import hold_out
from tools.launch import child_env, run_python, torchrun_command, two_node_commands

ITERS, RESUME_AT = 8, 5
ACCUMULATE = {"batch_size": 2, "grad_accum": 2}  # with 2 ranks: the global batch of 8
GLOBAL_BATCH, N_WINDOWS, STEPS_PER_EPOCH = 8, 29, 3
SCHEDULE = {"warmup_iters": 2, "lr_decay_iters": ITERS, "eval_batches": 1}
SEED = 1337  # the default --seed
LOSS_RTOL = 1e-5  # float32, dropout 0: only the order of additions differs between the chapters
PARAM_RTOL = 1e-4  # of the whole parameter vector
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
# the broken copy of chapter 04: its statement SET_EPOCH (tests/helpers.py statement_lines) replaced
SET_EPOCH, FORGOTTEN = "sampler.set_epoch(epoch)", "pass  # sampler.set_epoch(epoch) forgotten"

CH = {f"{n:02d}": REPO / folder / "train.py" for n, folder in CHAPTERS.items()}


def torchrun(script: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    """torchrun --standalone with 2 ranks; env: extra environment variables."""
    cmd = torchrun_command(script, 2, args)
    return subprocess.run(cmd, cwd=REPO, env=child_env(**env), capture_output=True, text=True)


def succeeded(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}\n{proc.stdout}{proc.stderr}"


def two_nodes(args: list[str]) -> list[str]:
    """Chapter 05 as 2 nodes x 2 processes: two torchrun launches that meet on 127.0.0.1."""
    procs = [start(cmd) for cmd in two_node_commands(CH["05"], 2, args)]
    outputs = outputs_of(procs, timeout=300)
    assert all(proc.returncode == 0 for proc in procs), "\n".join(outputs)
    return outputs


def first_mismatch(reference: dict[int, float], other: dict[int, float]) -> int | None:
    """The first step whose loss differs from the reference's (by more than rounding), or None."""
    assert sorted(other) == sorted(reference) == list(range(1, ITERS + 1)), (other, reference)
    for i in sorted(reference):
        if abs(other[i] - reference[i]) > LOSS_RTOL * abs(reference[i]):
            return i
    return None


def parameter_distance(out_dir: Path, reference_dir: Path) -> float:
    """|a - b| / |b| of all parameters: rounding leaves ~1e-6, a step on wrong data ~1e-2."""
    a, b = checkpoint(out_dir)["model"], checkpoint(reference_dir)["model"]
    assert a.keys() == b.keys()
    a, b = (torch.cat([state[k].flatten() for k in sorted(state)]) for state in (a, b))
    return ((a - b).norm() / b.norm()).item()


DIVERGED_ITERS = ITERS + 6
DIVERGE = {"lr": 1e6, "warmup_iters": 0, "lr_decay_iters": 100}


def folder_state(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but run.lock's (each run that takes the folder writes who it is there)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "run.lock"}


# ---- the corpus and the runs, made once per module -----------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(the corpus file, a data root where it is prepared)."""
    root = tmp_path_factory.mktemp("epochs")
    path = root / "act1.txt"
    path.write_text(corpus_text(), encoding="utf-8")  # the checker's corpus (tools/check/)
    folder = prepare(str(path), root / "data", log=lambda *a: None)
    hold_out(folder)  # the checker's validation split: a whole batch of 8 windows and more
    train_set, _ = load_splits(folder, 32)  # the tiny preset's block size
    assert len(train_set) == N_WINDOWS
    assert N_WINDOWS % GLOBAL_BATCH
    assert N_WINDOWS // GLOBAL_BATCH == STEPS_PER_EPOCH
    return path, root / "data"


def chapter01_in_this_process(args: list[str]) -> list[int]:
    """`python 01_single_gpu/train.py ARGS`, run here, recording the training windows it reads."""
    read: list[int] = []
    original = TokenWindows.__getitem__

    def recording(self, i):
        if self.path.name == "train.bin":
            read.append(int(i))
        return original(self, i)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TokenWindows, "__getitem__", recording)
        mp.setattr("sys.argv", [str(CH["01"]), *args])
        # defines main() without running it
        namespace = runpy.run_path(str(CH["01"]), run_name="chapter01")
        namespace["main"]()
    return read


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict:
    """name -> out_dir of each run, "01_read" -> the windows 01 read, "diverged" -> name ->
    (folder, its files before, process)."""
    path, data = corpus
    root = tmp_path_factory.mktemp("epoch_runs")
    names = "01 02 03 04 01_resumed 05 04_no_set_epoch 01_diverged 04_diverged".split()
    out = {name: root / name for name in names}
    before = {}

    def args(name, iters=ITERS, **flags):
        return tiny_run_args(data, out[name], iters, dataset=path, **SCHEDULE, **flags)

    def diverge(name, base, **flags):
        shutil.copytree(out[base], out[name])
        before[name] = folder_state(out[name])
        flags = SCHEDULE | DIVERGE | flags
        return tiny_run_args(data, out[name], DIVERGED_ITERS, dataset=path, **flags, resume=True)

    def first_half():
        succeeded(torchrun(CH["04"], args("04", RESUME_AT, **ACCUMULATE)))
        shutil.copytree(out["04"], out["01_resumed"])  # chapter 04's checkpoint at step 5

    def resume_then_diverge(first_half_done):
        first_half_done.result()
        succeeded(torchrun(CH["04"], args("04", resume=True, **ACCUMULATE)))
        # logs every step: the training loss or the gradient norm shows the divergence first
        return torchrun(CH["04"], diverge("04_diverged", "04", dist_timeout=60, **ACCUMULATE))

    def without_set_epoch():
        broken = root / "broken" / "train.py"
        broken.parent.mkdir()
        broken.write_text(
            replace_statement(CH["04"].read_text(), SET_EPOCH, FORGOTTEN, "04_ddp/train.py")
        )
        # the copy puts its own folder on sys.path; PYTHONPATH lets it find the repository's common/
        succeeded(torchrun(broken, args("04_no_set_epoch", **ACCUMULATE), PYTHONPATH=str(REPO)))

    # two launches at a time; chapter 01 runs here meanwhile
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(first_half)
        futures = [
            pool.submit(job)
            for job in (
                lambda: two_nodes(args("05", batch_size=2, shared_fs=True)),
                without_set_epoch,
                lambda: run_python([CH["02"], *args("02", batch_size=2, grad_accum=4)]),
                lambda: run_python([CH["03"], *args("03", batch_size=8)], **CPU_ONLY),
                lambda: (
                    first.result(),
                    run_python([CH["01"], *args("01_resumed", batch_size=8, resume=True)]),
                ),
            )
        ]
        last = pool.submit(resume_then_diverge, first)
        read = chapter01_in_this_process(args("01", batch_size=8))
        # logs only every 100 steps and evaluates at step 12: its evaluation meets the
        # broken parameters first
        chapter01_diverged = run_python(
            [CH["01"], *diverge("01_diverged", "01", log_interval=100, eval_interval=12)],
            check=False,
        )
        for future in futures:
            future.result()
        chapter04_diverged = last.result()
    diverged = {
        "01": (out["01_diverged"], before["01_diverged"], chapter01_diverged),
        "04": (out["04_diverged"], before["04_diverged"], chapter04_diverged),
    }
    return out | {"01_read": read, "diverged": diverged}


# ---- every chapter is chapter 01's run, through the epoch boundaries -----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["02", "03", "04", "01_resumed", "05"])
def test_every_chapter_equals_chapter01_across_epoch_boundaries(runs, name):
    reference = runs["01"]
    step = first_mismatch(train_losses(reference), train_losses(runs[name]))
    assert step is None, f"{name}: the loss of step {step} differs from chapter 01's"
    assert parameter_distance(runs[name], reference) < PARAM_RTOL, (
        f"{name}: the final parameters differ from chapter 01's"
    )


@pytest.mark.slow
def test_chapter01_visits_every_epoch_in_a_new_order(runs):
    read = runs["01_read"]
    per_epoch = STEPS_PER_EPOCH * GLOBAL_BATCH  # 24 of the 29 windows; the other 5 are dropped
    assert len(read) == ITERS * GLOBAL_BATCH
    epochs = [read[start : start + per_epoch] for start in range(0, len(read), per_epoch)]
    for e, windows in enumerate(epochs):
        assert len(set(windows)) == len(windows), f"epoch {e} reads a window twice"
        assert windows == epoch_permutation(N_WINDOWS, SEED, e)[: len(windows)].tolist(), (
            f"epoch {e}"
        )
    assert epochs[0] != epochs[1]
    assert epochs[1][: len(epochs[2])] != epochs[2]
    # the dropped remainder is another 5 windows each epoch, so no window is left out for good
    dropped = [set(range(N_WINDOWS)) - set(epochs[e]) for e in (0, 1)]
    assert all(len(d) == N_WINDOWS - per_epoch for d in dropped)
    assert dropped[0] != dropped[1]


@pytest.mark.slow
def test_without_set_epoch_the_second_epoch_repeats_the_first(runs):
    """Chapter 04's text: parity fails at the second epoch's first step, not before."""
    step = first_mismatch(train_losses(runs["01"]), train_losses(runs["04_no_set_epoch"]))
    assert step == STEPS_PER_EPOCH + 1
    assert parameter_distance(runs["04_no_set_epoch"], runs["01"]) > 100 * PARAM_RTOL


# ---- the divergence guard ------------------------------------------------------------------------


def assert_finite_metrics(out_dir: Path) -> None:
    for record in read_metrics(out_dir / "metrics.jsonl"):
        assert all(math.isfinite(v) for k, v in record.items() if k in ("loss", "val_loss")), record


@pytest.mark.slow
def test_a_diverging_run_stops_with_one_line_and_keeps_the_checkpoint(runs):
    folder, before, proc = runs["diverged"]["01"]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(
        r"error: the run diverged at step 12: validation loss (nan|inf); "
        r"no checkpoint was written from it \(the last one, if any, is intact\); "
        r"try a lower --lr or --dtype float32, with --resume to continue from the checkpoint",
        lines[0],
    ), lines[0]
    assert folder_state(folder) == before, (
        "the checkpoint and metrics of the good run must stay as they were"
    )


@pytest.mark.slow
def test_every_rank_stops_at_the_same_step_under_ddp(runs):
    folder, before, proc = runs["diverged"]["04"]
    assert proc.returncode != 0, proc.stdout + proc.stderr
    stops = re.findall(
        r"\[rank (\d)\] error: the run diverged at step (\d+): training loss",
        proc.stderr,
    )
    # both ranks, none left waiting
    assert sorted(rank for rank, _ in stops) == ["0", "1"], proc.stderr
    assert len({step for _, step in stops}) == 1, stops
    assert ITERS < int(stops[0][1]) <= DIVERGED_ITERS
    assert "timed out" not in (proc.stdout + proc.stderr).lower()
    assert (folder / "ckpt.pt").read_bytes() == before["ckpt.pt"]
    # the good run's lines are kept; after them, only the steps that were still
    # finite are logged
    kept = before["metrics.jsonl"].decode()
    assert (folder / "metrics.jsonl").read_text().startswith(kept)
    assert_finite_metrics(folder)


def test_float16_skipped_steps_are_not_divergence():
    """A step GradScaler skips leaves the loss finite; a non-finite loss diverges."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    loss = model(torch.ones(2, 4)).mean()
    scaler.scale(loss).backward()
    model.weight.grad[0, 0] = float("inf")  # what an overflow in the scaled float16 backward leaves
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    weight = model.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    # the step was skipped
    assert torch.equal(model.weight, weight)
    assert scaler.get_scale() == 2.0**15
    assert not math.isfinite(grad_norm.item())
    assert math.isfinite(loss.item())

    check_finite(7, loss.item())  # a skipped step: no error
    with pytest.raises(CourseError) as err:
        check_finite(7, float("nan"))
    assert str(err.value) == (
        "the run diverged at step 7: training loss nan; no checkpoint was written from it "
        "(the last one, if any, is intact); try a lower --lr or --dtype float32, "
        "with --resume to continue from the checkpoint"
    )
    with pytest.raises(CourseError, match=r"^the run diverged at step 7: validation loss inf;"):
        check_finite(7, float("inf"), "validation loss")
