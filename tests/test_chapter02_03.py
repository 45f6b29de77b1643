"""Chapters 02 (gradient accumulation) and 03 (nn.DataParallel) are chapter 01's run."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_same_run,
    checkpoint,
    indentation,
    replace_statement,
    statement_lines,
    tiny_run_args,
    train_losses,
)

from common.chapters import CHAPTERS
from common.support.errors import CourseError
from layout import REPO
from tools.check.harness import parity
from tools.launch import run_python

ITERS = 10
RESUMED_ITERS = 14
SCHEDULE = {"warmup_iters": 2, "lr_decay_iters": RESUMED_ITERS}
# CPU runs everywhere: on a machine with GPUs, chapter 03 would otherwise (rightly)
# refuse --device cpu
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
BROKEN_FLAGS = {"batch_size": 2, "grad_accum": 4}

CH01, CH02, CH03 = (REPO / CHAPTERS[n] / "train.py" for n in (1, 2, 3))


def in_parallel(*jobs):
    """Run independent callables two at a time (the runs are single-threaded processes)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return [f.result() for f in [pool.submit(job) for job in jobs]]


# ---- the runs, made once per module -------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory) -> dict:
    """name -> (out_dir, the finished process): each chapter's 10-step run, for the resumes."""
    root = tmp_path_factory.mktemp("ch02_03")
    plan = {
        "01_b8": (CH01, {"batch_size": 8}),
        "02_b2x4": (CH02, {"batch_size": 2, "grad_accum": 4}),
        "03_b8": (CH03, {"batch_size": 8}),
    }

    def run(name):
        script, flags = plan[name]
        out = root / name
        args = tiny_run_args(data_dir, out, ITERS, **flags, **SCHEDULE)
        return name, (out, run_python([script, *args], **CPU_ONLY))

    return dict(in_parallel(*[lambda n=n: run(n) for n in plan]))


# ---- parity with chapter 01 ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def check_root(tmp_path_factory) -> Path:
    """The parity harness's folder: chapter 01's float64 run is made once there, for every test."""
    return tmp_path_factory.mktemp("parity")


@pytest.mark.parametrize(
    "script, flags",
    [
        # and tests/test_check.py runs chapter 02 with the checker's own micro-batches
        (CH02, {"batch_size": 4, "grad_accum": 2}),
        (CH03, {}),  # 4 micro-batches of 2, each split over 2 stand-in replicas
    ],
    ids=["02_b4x2", "03"],
)
def test_same_losses_and_parameters_as_chapter_01(check_root, script, flags):
    """Windows, loss, learning rate, gradient norm and parameters at every step, in float64."""
    assert parity(script, root=check_root, **flags) is None


def test_global_batch_is_printed(runs):
    assert (
        "4 micro-batches x 2 = 8 sequences x 32 tokens = 256 tokens per step"
        in runs["02_b2x4"][1].stdout
    )
    assert "1 micro-batches x 1 replica(s) x 8 = 8 sequences" in runs["03_b8"][1].stdout


def test_dataparallel_on_the_cpu_says_it_has_nothing_to_split(runs):
    assert "DataParallel has nothing to split" in runs["03_b8"][1].stdout


# ---- the comparison can fail: broken copies of chapter 02 ----------------------------------------

# Statements of the micro-step loop and the optimizer step, found as code whatever their
# layout (tests/helpers.py statement_lines)
SCRIPT = "02_grad_accumulation/train.py"
SCALE = "micro_loss = micro_loss / args.grad_accum"
BACKWARD = "scaler.scale(micro_loss).backward()"
ACCUMULATE = "loss += micro_loss.detach()"  # the last statement of the micro-step loop
STEP_END = "optimizer.zero_grad(set_to_none=True)"  # the last statement of the optimizer step


def loss_not_scaled(src: str) -> str:
    """Each micro-step's loss is not divided by K: gradient and logged loss are K times too big."""
    return replace_statement(src, SCALE, "", SCRIPT)


def gradient_not_scaled(src: str) -> str:
    """The logged loss is divided by K, the gradient is not (backward of K times the loss)."""
    return replace_statement(
        src, BACKWARD, "scaler.scale(micro_loss * args.grad_accum).backward()", SCRIPT
    )


def step_every_micro_batch(src: str) -> str:
    """The clipping, optimizer step and zero_grad moved into the micro-step loop: every line after
    the loop's last statement, to zero_grad's last line, indented to the loop's body."""
    lines = src.splitlines(keepends=True)
    loop_end, step_end = (
        statement_lines(src, ACCUMULATE, SCRIPT),
        statement_lines(src, STEP_END, SCRIPT),
    )
    block = lines[loop_end.stop : step_end.stop]
    assert "scaler.step(optimizer)" in "".join(block), (
        f"{SCRIPT} changed: no optimizer step after the loop"
    )
    deeper = len(indentation(lines[loop_end.start])) - len(indentation(lines[step_end.start]))
    assert deeper > 0, f"{SCRIPT} changed: zero_grad is not after the micro-step loop"
    moved = [" " * deeper + line if line.strip() else line for line in block]
    return "".join(lines[: loop_end.stop] + moved + lines[step_end.stop :])


BREAKAGES = {
    "loss_not_scaled": loss_not_scaled,
    "gradient_not_scaled": gradient_not_scaled,
    "step_every_micro_batch": step_every_micro_batch,
}


# what the harness finds first in each: (the quantity, the step)
FIRST = {
    "loss_not_scaled": ("loss", 1),  # the logged loss is the sum over the micro-steps: K times
    "gradient_not_scaled": ("gradient norm", 1),  # the loss is right, its gradient K times
    "step_every_micro_batch": ("windows", 1),  # a step reads one micro-batch
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_parity_check_fails_for_a_broken_accumulation(check_root, tmp_path, name):
    source = CH02.read_text()
    broken = BREAKAGES[name](source)
    assert broken != source
    (tmp_path / "train.py").write_text(broken)
    found = parity(tmp_path / "train.py", chapter=2, root=check_root, **BROKEN_FLAGS)
    assert found is not None
    assert (found.quantity, found.step) == FIRST[name], found


# ---- checkpoints load across chapters ------------------------------------------------------------


@pytest.fixture(scope="module")
def resumed(runs, data_dir, tmp_path_factory) -> dict:
    """(from, to) -> (out_dir, process): a copy of one chapter's 10-step run resumed to 14 steps."""
    root = tmp_path_factory.mktemp("ch02_03_resume")
    flags = {
        "01": (CH01, {"batch_size": 8}),
        "02": (CH02, {"batch_size": 2, "grad_accum": 4}),
        "03": (CH03, {"batch_size": 8}),
    }
    source = {"01": "01_b8", "02": "02_b2x4", "03": "03_b8"}

    def run(frm, to):
        out = root / f"{frm}_to_{to}"
        shutil.copytree(runs[source[frm]][0], out)
        script, extra = flags[to]
        proc = run_python(
            [
                script,
                *tiny_run_args(data_dir, out, RESUMED_ITERS, resume=True, **extra, **SCHEDULE),
            ],
            **CPU_ONLY,
        )
        return (frm, to), (out, proc)

    pairs = [("03", "01"), ("03", "02"), ("01", "03"), ("02", "03")]
    return dict(in_parallel(*[lambda p=p: run(*p) for p in pairs]))


def test_checkpoints_resume_in_the_other_chapters(resumed):
    runs_ = list(resumed.values())
    for out, proc in runs_:
        assert f"resuming from {out / 'ckpt.pt'} at step {ITERS}" in proc.stdout
        assert sorted(train_losses(out)) == list(range(1, RESUMED_ITERS + 1))
    # all four continue the same run: the same losses for steps 11..14 and the same parameters
    (ref_dir, _), *others = runs_
    for out, _ in others:
        assert_same_run(out, ref_dir)


def test_no_module_prefix_in_any_checkpoint(runs, resumed):
    reference = checkpoint(runs["01_b8"][0])["model"].keys()
    for out, _ in [*runs.values(), *resumed.values()]:
        keys = checkpoint(out)["model"].keys()
        assert not [k for k in keys if "module." in k], out
        assert keys == reference, out


# ---- mistakes the reader can make ----------------------------------------------------------------


def test_gpus_without_gpus_is_one_clear_line(data_dir, tmp_path):
    proc = run_python(
        [CH03, *tiny_run_args(data_dir, tmp_path, 2, gpus=2)], check=False, **CPU_ONLY
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: --gpus 2"), lines[0]
    assert "DataParallel splits over CUDA GPUs" in lines[0], lines[0]


# ---- the memory measurement of chapter 02 --------------------------------------------------------


def test_measure_memory_prints_a_table(data_dir):
    proc = run_python(
        [
            REPO / "02_grad_accumulation" / "measure_memory.py",
            "--preset",
            "tiny",
            "--batch-size",
            "4",
            "--micro-batch-sizes",
            "4",
            "1",
            "--steps",
            "1",
            "--device",
            "cpu",
            "--data-dir",
            data_dir,
        ],
        **CPU_ONLY,
    )
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 2, proc.stdout  # header, rule, one row per configuration
    full, micro = ([cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:])
    assert full[0] == "4 x 1"
    assert micro[0] == "1 x 4"
    # both rows train on the same 4 sequences, so the loss is the same; one sequence at a
    # time needs less memory
    assert float(full[2]) == pytest.approx(float(micro[2]), rel=1e-4)
    assert float(full[3].replace(",", "")) > float(micro[3].replace(",", ""))
    # the profiler library's own lines are hidden
    assert "profiler_start" not in proc.stderr + proc.stdout


def test_the_validation_windows_are_whole_batches_so_dataparallel_splits_them_evenly():
    """DataParallel cuts each batch into one share per replica, and chapter 03 takes the plain
    mean of the replicas' mean losses: right only when the shares are equal."""
    from common.data import validation_windows

    class Split:  # a validation split of n windows: all validation_windows asks is its length
        def __init__(self, n: int):
            self.n = n

        def __len__(self) -> int:
            return self.n

    assert len(validation_windows(Split(10_000), 5, 8)) == 40
    windows = validation_windows(Split(29), 5, 8)  # room for 3 whole batches of 8, not 5
    assert len(windows) == 24
    assert windows[0] == 0
    assert windows[-1] == 28  # spread over the whole split
    with pytest.raises(CourseError, match="fewer than one batch of 8; lower --batch-size"):
        validation_windows(Split(7), 5, 8)


def test_the_mean_of_dataparallels_replicas_is_the_batchs_mean_or_refused():
    """The mean of DataParallel's replicas' mean losses (torch.chunk's shares) is the batch's mean,
    or the batch is refused in one line."""
    from common.dataparallel import mean_of_replicas

    generator = torch.Generator().manual_seed(0)
    refused = 0
    for sequences in range(1, 41):
        per_sequence = torch.rand(sequences, generator=generator, dtype=torch.float64)
        for gpus in range(1, 9):
            shares = per_sequence.chunk(gpus)
            replica_losses = torch.stack([share.mean() for share in shares])
            if len({len(share) for share in shares}) == 1:
                mean = mean_of_replicas(replica_losses, sequences)
                assert mean.item() == pytest.approx(per_sequence.mean().item(), rel=1e-12)
                continue
            refused += 1
            with pytest.raises(CourseError) as error:
                mean_of_replicas(replica_losses, sequences)
            assert str(error.value) == (
                f"a batch of {sequences} sequences does not split evenly over DataParallel's "
                f"{len(shares)} replicas, so the mean of their losses is not the batch's: give "
                "every batch a multiple of the GPUs' count of sequences"
            )
        # on a CPU, or one GPU: one loss, the batch's own
        assert mean_of_replicas(per_sequence.mean(), sequences) == per_sequence.mean()
    assert refused > 0  # 10 sequences on 4 GPUs: shares of 3, 3, 3 and 1
