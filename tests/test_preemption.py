"""A scheduler's stop signal: the run saves the step it is in, stops with one line, and
resumes exactly.

- Under torchrun (2 ranks, chapter 04), SIGTERM to the whole process group mid-run: one line from
  rank 0, a checkpoint of the last step finished, and `--resume` ends with the parameters of
  chapter 01's run that was never stopped (float64: equal up to rounding).
- Chapter 01 alone: the same line, and exit status 75.
- In-process: the signal handling itself (every copy after the first is the same stop, however
  late), run_main's lines and statuses (a script without --resume, as the hang lab, does not offer
  it; an error while stopping is an error, with its own status), --stop-signal's names, the
  agreement's schedule, and a stop's finality (a restarted worker finds the stop's marker and
  stops), the ranks' part in a real gloo world of one process.
- Chapter 05 under torchrun --max-restarts=1, SIGTERM to the workers alone: torchrun restarts them,
  and they stop at once, without a step more (the stop's marker).
- 05_multinode/slurm.sbatch on a real Slurm: tests/test_slurm.py.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import io
import math
import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import read_until, start, tiny_run_args

from common.metrics import read_metrics
from common.support.errors import EXIT_STOPPED, Stopped, run_main
from common.support.preempt import Preemption, stop_signal
from common.support.preempt_ranks import (
    CHECK_SHARE,
    LONGEST_WAIT_S,
    STOP_MARKER,
    AgreedPreemption,
    steps_between_checks,
)
from tools.launch import run_python, run_torchrun, stop_launchers, torchrun_command

ITERS = 8
# float64: a resumed run repeats the uninterrupted one's numbers (exactly in the same world of
# processes, up to rounding between one process of 8 sequences and two of 4); a fixed schedule
FLAGS = {"dtype": "float64", "warmup_iters": 2, "lr_decay_iters": ITERS}
STOP_LINE = "stopped by SIGTERM at step {step}: checkpoint saved; continue with --resume"


def run_args(data_dir: Path, out_dir: Path, chapter: int) -> list:
    batch_size = 8 if chapter == 1 else 4  # two ranks of 4: chapter 01's global batch of 8
    return tiny_run_args(data_dir, out_dir, max_iters=ITERS, batch_size=batch_size, **FLAGS)


def checkpoint(out_dir: Path) -> dict:
    return torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)


def logged_losses(out_dir: Path) -> dict[int, float]:
    return {r["iter"]: r["loss"] for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r}


def stopped_after_step_two(cmd: list) -> tuple[int | None, str]:
    """Start `cmd` in a session of its own; once step 2 is logged, SIGTERM its whole process group
    (as a scheduler signals every process of a job). Returns its exit status and output."""
    proc = start(cmd)
    try:
        seen = read_until(proc, "iter      2 |")
        assert "iter      2 |" in seen, seen
        os.killpg(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        stop_launchers([proc])
    return proc.returncode, seen + rest


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """Chapter 01 never stopped (the reference), and chapters 04 (two ranks) and 01 stopped after
    step 2, side by side: what each stop left, and its exit status and output."""
    root = tmp_path_factory.mktemp("preempt")
    out = {name: root / name for name in ("reference", "ddp", "single")}
    ddp_cmd = torchrun_command("04_ddp/train.py", 2, run_args(data_dir, out["ddp"], 4))
    single_cmd = [sys.executable, "01_single_gpu/train.py", *run_args(data_dir, out["single"], 1)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        reference = pool.submit(
            run_python, ["01_single_gpu/train.py", *run_args(data_dir, out["reference"], 1)]
        )
        ddp, single = (
            pool.submit(stopped_after_step_two, ddp_cmd),
            pool.submit(stopped_after_step_two, single_cmd),
        )
        reference.result()
        return out, {"ddp": ddp.result(), "single": single.result()}


def test_sigterm_under_torchrun_saves_the_step_reached_and_resumes(data_dir, runs):
    out, stops = runs
    _, output = stops["ddp"]
    step = checkpoint(out["ddp"])["iter_num"]
    assert 2 <= step < ITERS, output
    # the checkpoint holds the last step finished
    assert step == max(logged_losses(out["ddp"])), output
    lines = output.splitlines()
    assert [line for line in lines if "stopped by" in line] == [
        "[rank 0] " + STOP_LINE.format(step=step)
    ]
    assert "[rank 0] Traceback" not in output
    assert "[rank 1] Traceback" not in output

    run_torchrun("04_ddp/train.py", 2, [*run_args(data_dir, out["ddp"], 4), "--resume"])
    resumed, uninterrupted = checkpoint(out["ddp"]), checkpoint(out["reference"])
    assert resumed["iter_num"] == uninterrupted["iter_num"] == ITERS
    # two processes of 4 against one of 8: rounding
    for name, tensor in uninterrupted["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, rtol=1e-9, atol=1e-12)
    ddp_losses, reference_losses = logged_losses(out["ddp"]), logged_losses(out["reference"])
    assert ddp_losses.keys() == reference_losses.keys()
    for i, loss in reference_losses.items():
        assert ddp_losses[i] == pytest.approx(loss, rel=1e-9)


def test_sigterm_stops_chapter_01_with_one_line_and_status_75(runs):
    out, stops = runs
    status, output = stops["single"]
    step = checkpoint(out["single"])["iter_num"]
    assert status == EXIT_STOPPED, output
    assert output.strip().splitlines()[-1] == STOP_LINE.format(step=step), output
    assert step == max(logged_losses(out["single"]))


# ---- in-process: the signal handling -------------------------------------------------------------


@pytest.fixture
def restore_signal_handlers():
    names = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    saved = {sig: signal.getsignal(sig) for sig in names}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture
def world_of_one():
    """A real gloo process group of one rank, in this process: the ranks' timeout."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield datetime.timedelta(seconds=60)
    dist.destroy_process_group()


def test_stop_signal_names():
    assert stop_signal("USR1") == stop_signal("sigusr1") == "SIGUSR1"
    assert stop_signal("TERM") == "SIGTERM"
    for wrong in ("INT", "KILL", "NOPE"):
        with pytest.raises(Exception, match="cannot ask the run to stop"):
            stop_signal(wrong)


def test_every_copy_of_the_stop_signal_is_the_same_stop(restore_signal_handlers):
    preemption = Preemption("USR1")
    assert not preemption.requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.requested()
    assert preemption.received == "SIGUSR1"
    os.kill(os.getpid(), signal.SIGTERM)  # a launcher passing the stop on: the same request
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGUSR1)  # later, while saving (Slurm's own TERM): nothing changes
    assert preemption.requested()
    assert preemption.received == "SIGUSR1"
    with pytest.raises(
        Stopped, match="stopped by SIGUSR1 at step 7: checkpoint saved; continue with --resume"
    ):
        preemption.stop(7)


def test_the_ranks_stop_marks_the_run_as_stopped(restore_signal_handlers, world_of_one, tmp_path):
    preemption = AgreedPreemption("USR1", tmp_path, ranks_agree_within=world_of_one)
    assert not preemption.requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # a launcher passing the stop on: the same request
    assert preemption.requested()
    assert preemption.received == "SIGUSR1"
    with pytest.raises(Stopped, match="stopped by SIGUSR1 at step 7: checkpoint saved"):
        preemption.stop(7)
    assert (tmp_path / STOP_MARKER).read_text() == "7 SIGUSR1\n"


def test_a_worker_restarted_after_a_stop_stops_at_once(
    restore_signal_handlers, world_of_one, tmp_path, monkeypatch
):
    (tmp_path / STOP_MARKER).write_text("7 SIGTERM\n")  # what the stop left
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the worker
    with pytest.raises(Stopped, match="stopped by SIGTERM before torchrun restarted this worker"):
        AgreedPreemption("TERM", tmp_path, ranks_agree_within=world_of_one)
    # a new launch (with --resume) is not a restart: the old stop is over, and its marker goes
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    AgreedPreemption("TERM", tmp_path, ranks_agree_within=world_of_one)
    assert not (tmp_path / STOP_MARKER).exists()
    # a restart after a failure, with no stop asked for, trains on
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert not AgreedPreemption("TERM", tmp_path, ranks_agree_within=world_of_one).requested()


def test_the_agreement_comes_every_k_steps():
    # a check of 1 ms and steps of 1 s: every step costs 0.1 %, so every step
    assert steps_between_checks(0.001, 1.0) == 1
    # a check of 50 ms (a thousand ranks) and steps of 0.5 s: 10 steps keep it at 1 %
    assert steps_between_checks(0.05, 0.5) == math.ceil(0.05 / (CHECK_SHARE * 0.5)) == 10
    # steps of 10 ms: 1 % would mean a check every 500 steps (5 s), under LONGEST_WAIT_S
    assert steps_between_checks(0.05, 0.01) == 500
    # a slower check: a stop still waits at most LONGEST_WAIT_S for it
    assert steps_between_checks(1.0, 0.01) == int(LONGEST_WAIT_S / 0.01)
    assert steps_between_checks(0.05, 60.0) == 1


def ends(main, resumable=False) -> tuple[int, str]:
    """run_main(main) in this process: its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        run_main(main, resumable=resumable)
    return exit_.value.code, err.getvalue()


def test_run_main_lines_and_statuses(restore_signal_handlers):
    def stopped_at_step_3():
        raise Stopped("SIGTERM", 3, speaks=True)

    def stopped_on_rank_1():
        raise Stopped("SIGTERM", 3, speaks=False)

    def signalled():
        os.kill(os.getpid(), signal.SIGTERM)

    assert ends(stopped_at_step_3) == (EXIT_STOPPED, STOP_LINE.format(step=3) + "\n")
    assert ends(stopped_on_rank_1) == (EXIT_STOPPED, "")  # rank 0 speaks for every rank
    # a script without --resume (the hang lab) does not tell the reader to use it
    assert ends(signalled) == (130, "stopped by SIGTERM\n")
    status, line = ends(signalled, resumable=True)
    assert (status, line) == (
        130,
        "stopped by SIGTERM: the last checkpoint written is intact; continue with --resume\n",
    )


def test_an_error_while_stopping_is_an_error(restore_signal_handlers):
    """A full disk in the stop's save is one line and status 1; a bug keeps its traceback."""

    def full_disk_while_saving():
        preemption = Preemption("TERM")
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested()
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    def bug_while_saving():
        preemption = Preemption("TERM")
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested()
        raise ValueError("a bug")

    status, output = ends(full_disk_while_saving, resumable=True)
    assert status == 1, output
    assert output.count("\n") == 1, output
    assert output.startswith("error while stopping after SIGTERM: [Errno 122] Disk quota exceeded")
    status, output = ends(bug_while_saving)
    assert status == 1, output
    assert "Traceback" in output, output
    assert "ValueError: a bug" in output, output
    assert output.splitlines()[-1] == "error while stopping after SIGTERM: a bug"


def test_workers_restarted_after_a_stop_stop_at_once(data_dir, tmp_path):
    """SIGTERM to the workers alone (not to torchrun): they save and exit 75, torchrun counts that
    as a failure and restarts them (--max-restarts=1), and the restarted workers find the stop's
    marker and stop at once, without a step more."""
    out = tmp_path / "run"
    args = tiny_run_args(data_dir, out, max_iters=100_000, batch_size=4)
    cmd = torchrun_command("05_multinode/train.py", 2, args, extra=["--max-restarts=1"])
    proc = start(cmd)
    try:
        seen = read_until(proc, "iter      2 |")
        workers = [int(pid) for pid in re.findall(r"\] process (\d+) on ", seen)]
        assert len(workers) == 2, seen
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=180)
    finally:
        stop_launchers([proc])
    output = seen + rest
    step = checkpoint(out)["iter_num"]
    assert f"[rank 0] stopped by SIGTERM at step {step}: checkpoint saved" in output, output
    # torchrun restarted the workers, which stopped at once: the same step, no step trained after it
    again = f"[rank 0] stopped by SIGTERM before torchrun restarted this worker at step {step}:"
    assert again in output, output
    assert max(logged_losses(out)) == step
    assert proc.returncode == 1  # torchrun, its restarts used up
