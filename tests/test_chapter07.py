"""Chapter 07: FSDP2 under torchrun is chapter 01's run, with each rank holding 1/W of the state."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch
from helpers import checkpoint, read_until, start, tiny_run_args, train_losses

from common.model import GPT, model_config
from layout import REPO
from tools.launch import run_python, run_torchrun, stop_launchers, torchrun_command

SCRIPT = REPO / "07_fsdp" / "train.py"
CHAPTER01 = REPO / "01_single_gpu" / "train.py"
ITERS = 8
REL = 1e-5  # float32, dropout 0: only the order of additions differs between the runs
# 8 steps of a fixed schedule, an evaluation and a checkpoint every 2
SCHEDULE = {"lr_decay_iters": ITERS, "warmup_iters": 2, "eval_interval": 2}
PER_RANK = {2: {"batch_size": 6}, 3: {"batch_size": 4}}  # a global batch of 12
STOP_ITERS = 24  # the float64 run: room for the SIGTERM after step 2 to come mid-run


def run_flags(data_dir: Path, out_dir: Path, max_iters: int, **extra) -> list[str]:
    return tiny_run_args(data_dir, out_dir, max_iters, **SCHEDULE, **extra)


def assert_same_losses(run: dict[int, float], reference: dict[int, float], rel: float) -> None:
    assert sorted(run) == sorted(reference), (sorted(run), sorted(reference))
    for it, loss in reference.items():
        assert run[it] == pytest.approx(loss, rel=rel), f"iteration {it}: {run[it]} vs {loss}"


def assert_same_model(state: dict, reference: dict, rtol: float, atol: float) -> None:
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=rtol, atol=atol, msg=name)


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ch07_reference")
    run_python([CHAPTER01, *run_flags(data_dir, out, ITERS, batch_size=12)])
    return out


@pytest.fixture(scope="module")
def chain(data_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """One folder: 07 on 2 ranks, chapter 01, 07 on 3 ranks with accumulation, each --resume-ing
    the ckpt.pt the one before wrote."""
    out = tmp_path_factory.mktemp("ch07_chain")
    first = run_torchrun(SCRIPT, 2, run_flags(data_dir, out, 2, **PER_RANK[2]))
    run_python([CHAPTER01, *run_flags(data_dir, out, 4, batch_size=12, resume=True)])
    accumulated = {"batch_size": 2, "grad_accum": 2, "resume": True}
    last = run_torchrun(SCRIPT, 3, run_flags(data_dir, out, ITERS, **accumulated))
    return out, [first.stdout, last.stdout]


@pytest.mark.quick
def test_two_and_three_ranks_with_accumulation_equal_chapter01_through_ckpt_pt(chain, reference):
    out, (two, three) = chain
    # steps 1-2 on 2 ranks, 3-4 in chapter 01, 5-8 on 3 ranks x 2 micro-batches: chapter 01's
    # losses, and its validation losses (each rank evaluates its share of the windows)
    assert_same_losses(train_losses(out), train_losses(reference), REL)
    assert_same_losses(train_losses(out, "val_loss"), train_losses(reference, "val_loss"), REL)
    # ckpt.pt holds whole tensors under chapter 01's names, gathered from the shards: the model
    # chapter 01 ends with, and the optimizer state numbered as chapter 01 numbers it
    saved = checkpoint(out)
    assert saved["iter_num"] == ITERS
    assert saved["train_config"]["chapter"] == 7
    assert_same_model(saved["model"], checkpoint(reference)["model"], 1e-4, 1e-5)
    assert not any(name.startswith(("module.", "_fsdp")) for name in saved["model"])
    assert saved["model"]["lm_head.weight"].shape == (50304, 32)  # whole, not a shard
    assert list(saved["optimizer"]["state"]) == list(range(len(saved["optimizer"]["state"])))
    # each rank says what it holds: 1/W of DDP's bytes, the uneven shards within a row
    for stdout, world in ((two, 2), (three, 3)):
        held = re.findall(
            r"rank (\d) local \d\] holds parameters ([\d.]+) MB \(DDP ([\d.]+)\)", stdout
        )
        assert sorted(int(rank) for rank, _, _ in held) == list(range(world)), stdout
        for _, mine, ddp in held:
            assert float(mine) == pytest.approx(float(ddp) / world, abs=0.02), stdout
        assert f"FSDP: {world} process(es), 1/{world} of the model each" in stdout


# ---- construction: no rank but rank 0 holds the whole model -------------------------------------


@pytest.mark.slow
def test_no_rank_but_rank0_allocates_the_whole_model(data_dir, tmp_path):
    """3 ranks build a 203 MB model: rank 0 holds it whole, once; the others their third of it (a
    whole model built on every rank and then sharded would show 203 MB on each)."""
    wide = {"n_embd": 256, "n_layer": 48, "batch_size": 1}
    args = tiny_run_args(data_dir, tmp_path, 1, sample_tokens=0, **wide)
    with torch.device("meta"):
        model = GPT(model_config("tiny", n_embd=256, n_layer=48))
    whole_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    largest_mb = model.lm_head.weight.numel() * 4 / 1e6
    assert largest_mb < whole_mb / 3, "the test needs a model whose largest tensor is small"
    proc = start(torchrun_command(SCRIPT, 3, args))
    peaks = {}
    output = ""
    try:
        while len(peaks) < 3:
            line = read_until(proc, "peak memory, construction:")
            output += line
            found = re.search(r"rank (\d) local \d\] peak memory, construction: ([\d.]+) MB", line)
            if found is None:
                break  # the run ended (or timed out) without the line
            peaks[int(found.group(1))] = float(found.group(2))
    finally:
        stop_launchers([proc])  # the rest of the run teaches nothing more here
    assert sorted(peaks) == [0, 1, 2], output
    assert peaks[0] > whole_mb, output
    for rank in (1, 2):
        assert peaks[rank] < whole_mb, f"rank {rank} held {peaks[rank]} MB of {whole_mb} MB"


# ---- float64: the control, and a resume after SIGTERM -----------------------------------------


@pytest.fixture(scope="module")
def float64(data_dir, tmp_path_factory) -> tuple[Path, Path, int, str, int]:
    root = tmp_path_factory.mktemp("ch07_float64")
    reference64, stopped = root / "ch01", root / "ch07"
    ch01_args = run_flags(data_dir, reference64, STOP_ITERS, batch_size=12, dtype="float64")
    run_python([CHAPTER01, *ch01_args])
    args = run_flags(data_dir, stopped, STOP_ITERS, dtype="float64", **PER_RANK[2])
    proc = start(torchrun_command(SCRIPT, 2, args))
    try:
        # chapter 05's stop ends at once: a checkpoint must be there to resume
        seen = read_until(proc, "step 2: val loss")
        assert "step 2: val loss" in seen, seen
        os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler signals every process of a job
        rest, _ = proc.communicate(timeout=120)
    finally:
        stop_launchers([proc])
    status = proc.returncode
    step = checkpoint(stopped)["iter_num"]
    run_torchrun(SCRIPT, 2, [*args, "--resume"])
    return reference64, stopped, step, seen + rest, status


@pytest.mark.slow
def test_float64_control_and_a_stopped_run_resumes_to_chapter01s_numbers(float64):
    reference64, stopped, step, output, status = float64
    assert status != 0, output
    # chapter 05's stop: at once, the last evaluation's checkpoint intact
    assert step % 2 == 0 and 2 <= step < STOP_ITERS, output
    stop_line = "stopped by SIGTERM: the last checkpoint written is intact; continue with --resume"
    assert f"[rank 0] {stop_line}" in output.splitlines(), output
    # the ranks' own (torchrun, signalled too, prints one of its own)
    assert "[rank 0] Traceback" not in output
    assert "[rank 1] Traceback" not in output
    # float64: sharded or not, 2 ranks of 6 or one process of 12 differ only by rounding
    assert_same_losses(train_losses(stopped), train_losses(reference64), 1e-12)
    assert_same_model(checkpoint(stopped)["model"], checkpoint(reference64)["model"], 1e-10, 1e-12)
    assert checkpoint(stopped)["model"]["lm_head.weight"].dtype == torch.float64
