"""A scheduler's stop signal: the run saves the step it is in, stops with one line, and resumes
exactly.

- Under torchrun (2 ranks, chapter 04), SIGTERM to the whole process group mid-run: one line from
  rank 0, a checkpoint of the last step finished, and `--resume` ends with the parameters of
  chapter 01's run that was never stopped (float64: equal up to rounding).
- Chapter 01 alone: the same line, and exit status 75.
- In-process: the signal handling itself (a repeat passed on by a launcher is the same stop, a
  later one stops at once), run_main's lines and statuses (a script without --resume, as the
  hang lab, does not offer it), and --stop-signal's names.
- 05_multinode/slurm.sbatch, with stand-ins for srun and scontrol: USR1 to the batch shell becomes a
  SIGTERM to the training, the job is requeued, and the requeued job passes --resume.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import start, tiny_run_args

from common.metrics import read_metrics
from common.support import preempt
from common.support.errors import EXIT_STOPPED, Stopped, run_main
from common.support.preempt import Preemption, stop_signal
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
    seen = ""
    try:
        deadline = time.monotonic() + 240
        while "iter      2 |" not in seen and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
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
    assert "[rank 0] Traceback" not in output and "[rank 1] Traceback" not in output

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


# ---- in-process: the signal handling
# ----------------------------------------------------------------


@pytest.fixture
def restore_signal_handlers():
    names = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    saved = {sig: signal.getsignal(sig) for sig in names}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_stop_signal_names():
    assert stop_signal("USR1") == stop_signal("sigusr1") == "SIGUSR1"
    assert stop_signal("TERM") == "SIGTERM"
    for wrong in ("INT", "KILL", "NOPE"):
        with pytest.raises(Exception, match="cannot ask the run to stop"):
            stop_signal(wrong)


def test_a_repeat_is_the_same_stop_and_a_later_signal_stops_at_once(
    restore_signal_handlers, monkeypatch
):
    preemption = Preemption("USR1")
    assert not preemption.requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.requested() and preemption.received == "SIGUSR1"
    os.kill(os.getpid(), signal.SIGTERM)  # a launcher passing the stop on: the same request
    assert preemption.requested()
    monkeypatch.setattr(preempt, "SAME_STOP_S", 0.0)
    with pytest.raises(KeyboardInterrupt):  # a second stop, later: at once
        os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(
        Stopped, match="stopped by SIGUSR1 at step 7: checkpoint saved; continue with --resume"
    ):
        preemption.stop(7)


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


# ---- 05_multinode/slurm.sbatch: the job stops, is requeued, and the next one resumes
# ---------------

FAKE_SRUN = """#!/bin/bash
# srun as far as the script needs it: the preflight ends at once; the training records its words,
# then runs until SIGTERM, as a training run that saves and stops does (status 75)
if [[ "$*" == *preflight* ]]; then exit 0; fi
echo "$*" >> "$LOG"
trap 'echo stopped >> "$LOG"; exit 75' TERM
echo started >> "$LOG"
while true; do sleep 0.1; done
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ "$1" == show ]]; then echo node1; exit 0; fi
echo "scontrol $*" >> "$LOG"
"""


def test_slurm_script_passes_the_stop_on_requeues_and_the_next_job_resumes(tmp_path):
    bin_dir, out_dir, log = tmp_path / "bin", tmp_path / "out", tmp_path / "log"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG": str(log),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node1",
        "OUT_DIR": str(out_dir),
    }
    script = Path(__file__).resolve().parents[1] / "05_multinode" / "slurm.sbatch"

    def job(restart_count: int) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", str(script), "--max-iters", "9"],
            env={**env, "SLURM_RESTART_COUNT": str(restart_count)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = job(0)
    deadline = time.monotonic() + 30
    while not (log.exists() and "started" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    first.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@90 sends, to the batch shell only
    output, _ = first.communicate(timeout=30)
    words = log.read_text().splitlines()
    assert words[1:] == ["started", "stopped", "scontrol requeue 42"], output
    assert "--resume" not in words[0] and "--max-iters 9" in words[0]
    assert first.returncode == 75, output

    # the requeued job: the same job id, so the same folder, where the stopped run left its
    # checkpoint
    out_dir.mkdir()
    (out_dir / "ckpt.pt").write_bytes(b"")
    log.unlink()
    second = job(1)
    deadline = time.monotonic() + 30
    while not (log.exists() and "started" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    second.send_signal(signal.SIGUSR1)
    second.communicate(timeout=30)
    assert "--resume --max-iters 9" in log.read_text().splitlines()[0]
