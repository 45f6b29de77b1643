"""A scheduler's stop signal. Chapters 01-05: it ends the run at once, and the last checkpoint
stays intact for --resume. Chapter 06 (and 07): the run saves the step every rank has reached,
stops with one line and status 75, and resumes exactly.

- Chapter 01, SIGTERM mid-run: one line, status 130, the checkpoint of the last evaluation intact,
  and `--resume` ends with the parameters of the run that was never stopped.
- Chapter 06 under torchrun (2 ranks), SIGTERM to the whole process group (as a scheduler signals
  every process of a job): one line from rank 0, a checkpoint of the step the ranks stopped after,
  and `--resume` ends with the parameters of chapter 01's run that was never stopped (float64:
  equal up to rounding).
- Chapter 06, the signal to one rank only: every rank stops after the same step (the all-reduced
  flag), that step saved, and rank 0 names the signal the other rank received.
- In-process: the signal handling itself (every copy after the first is the same stop, however
  late), run_main's lines and statuses (a script without --resume, as the hang lab, does not offer
  it; an error while stopping is an error, with its own status), --stop-signal's names, and a
  stop's finality (a restarted worker finds the stop's marker and stops), the ranks' part in a real
  gloo world of one process.
- Chapter 06 under torchrun --max-restarts=1, SIGTERM to the workers alone: torchrun restarts them,
  and they stop at once, without a step more (the stop's marker).
- 06_fault_tolerance/slurm.sbatch on a real Slurm: tests/test_slurm.py.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import read_until, start, tiny_run_args

from common.metrics import read_metrics
from common.support.errors import run_main
from common.support.preempt import EXIT_STOPPED, Preemption, exit_stopped, stop_signal
from common.support.preempt_ranks import STOP_MARKER, stop_after_saving, stop_if_stopped_before
from tools.launch import run_python, run_torchrun, stop_launchers, torchrun_command

# chapter 06's ranks check for a stop every 10 steps: a stop asked for after step 2 is taken after
# step 10 (or 20, on a slow machine), before the end
ITERS = 24
# float64: a resumed run repeats the uninterrupted one's numbers (exactly in the same world of
# processes, up to rounding between one process of 8 sequences and two of 4); a fixed schedule
FLAGS = {"dtype": "float64", "warmup_iters": 2, "lr_decay_iters": ITERS}
STOP_LINE = "stopped by SIGTERM at step {step}: checkpoint saved; continue with --resume"
ENDED_LINE = "stopped by SIGTERM: the last checkpoint written is intact; continue with --resume"


def run_args(data_dir: Path, out_dir: Path, chapter: int, **more) -> list:
    batch_size = 8 if chapter == 1 else 4  # two ranks of 4: chapter 01's global batch of 8
    return tiny_run_args(data_dir, out_dir, ITERS, batch_size=batch_size, **FLAGS, **more)


def checkpoint(out_dir: Path) -> dict:
    return torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)


def logged_losses(out_dir: Path) -> dict[int, float]:
    return {r["iter"]: r["loss"] for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r}


def stopped_after_step(cmd: list, step: int, ranks: str = "all") -> tuple[int | None, str]:
    """Start `cmd` in a session of its own; once `step` is logged, send SIGTERM to its whole
    process group (as a scheduler signals every process of a job), or with ranks="rank 1" to that
    worker alone. Returns its exit status and output."""
    proc = start(cmd)
    try:
        logged = f"iter {step:>6} |"
        seen = read_until(proc, logged)
        assert logged in seen, seen
        if ranks == "all":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            worker = re.search(r"rank 1 local 1\] process (\d+) on ", seen)
            assert worker, seen
            os.kill(int(worker.group(1)), signal.SIGTERM)
        rest, _ = proc.communicate(timeout=180)
    finally:
        stop_launchers([proc])
    return proc.returncode, seen + rest


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """Chapter 01 never stopped (the reference); chapter 01 stopped after step 5 (an evaluation
    every 2 steps); chapter 06 (two ranks) stopped after step 2, its whole group and one rank
    alone: what each stop left, and its exit status and output."""
    root = tmp_path_factory.mktemp("preempt")
    names = ("reference", "single", "ranks", "one_rank")
    out = {name: root / name for name in names}
    single_cmd = [
        sys.executable,
        "01_single_gpu/train.py",
        *run_args(data_dir, out["single"], 1, eval_interval=2),
    ]
    ranks_cmd = torchrun_command(
        "06_fault_tolerance/train.py", 2, run_args(data_dir, out["ranks"], 5)
    )
    one_cmd = torchrun_command(
        "06_fault_tolerance/train.py", 2, run_args(data_dir, out["one_rank"], 5)
    )
    with ThreadPoolExecutor(max_workers=2) as pool:
        reference = pool.submit(
            run_python, ["01_single_gpu/train.py", *run_args(data_dir, out["reference"], 1)]
        )
        single = pool.submit(stopped_after_step, single_cmd, 5)
        reference.result()
        ranks = pool.submit(stopped_after_step, ranks_cmd, 2)
        one_rank = pool.submit(stopped_after_step, one_cmd, 2, "rank 1")
        stops = {"single": single.result(), "ranks": ranks.result(), "one_rank": one_rank.result()}
    return out, stops


def assert_resumes_to_the_reference(out: Path, reference: Path) -> None:
    """The resumed run's parameters and logged losses are the uninterrupted run's."""
    resumed, uninterrupted = checkpoint(out), checkpoint(reference)
    assert resumed["iter_num"] == uninterrupted["iter_num"] == ITERS
    # two processes of 4 against one of 8: rounding
    for name, tensor in uninterrupted["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, rtol=1e-9, atol=1e-12)
    losses, reference_losses = logged_losses(out), logged_losses(reference)
    assert losses.keys() == reference_losses.keys()
    for i, loss in reference_losses.items():
        assert losses[i] == pytest.approx(loss, rel=1e-9)


@pytest.mark.slow
def test_sigterm_ends_chapter_01_at_once_and_the_last_checkpoint_resumes(data_dir, runs):
    out, stops = runs
    status, output = stops["single"]
    assert status == 130, output
    assert output.strip().splitlines()[-1] == ENDED_LINE, output
    assert "Traceback" not in output
    # the last evaluation's checkpoint, intact; the steps after it are trained again
    step = checkpoint(out["single"])["iter_num"]
    assert step % 2 == 0 and 4 <= step < ITERS, output
    run_python(["01_single_gpu/train.py", *run_args(data_dir, out["single"], 1), "--resume"])
    assert_resumes_to_the_reference(out["single"], out["reference"])


@pytest.mark.slow
def test_sigterm_under_torchrun_saves_the_step_reached_and_resumes(data_dir, runs):
    out, stops = runs
    _, output = stops["ranks"]
    step = checkpoint(out["ranks"])["iter_num"]
    # the ranks check every 10 steps
    assert step in (10, 20), output
    # the checkpoint holds the last step finished
    assert step == max(logged_losses(out["ranks"])), output
    lines = output.splitlines()
    assert [line for line in lines if "stopped by" in line] == [
        "[rank 0] " + STOP_LINE.format(step=step)
    ]
    assert "[rank 0] Traceback" not in output
    assert "[rank 1] Traceback" not in output

    run_torchrun(
        "06_fault_tolerance/train.py", 2, [*run_args(data_dir, out["ranks"], 5), "--resume"]
    )
    assert_resumes_to_the_reference(out["ranks"], out["reference"])


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(runs):
    out, stops = runs
    _, output = stops["one_rank"]
    step = checkpoint(out["one_rank"])["iter_num"]
    assert step in (10, 20), output
    assert step == max(logged_losses(out["one_rank"])), output
    # rank 0 was not signalled: it names the signal rank 1 received, as the ranks agreed on it
    assert "[rank 0] " + STOP_LINE.format(step=step) in output, output
    assert (out["one_rank"] / STOP_MARKER).read_text() == f"{step} SIGTERM\n"
    # rank 0 spoke after the stop's barrier, so both had saved and stopped after that step. The
    # first rank out ended with the stop's status (torchrun's summary); torchrun then ends the
    # other itself, which may be exiting still, so its status there is 75 or SIGTERM's
    statuses = re.findall(r"rank\s+: \d \(local_rank: \d\)\s+exitcode\s+: (-?\d+) ", output)
    assert str(EXIT_STOPPED) in statuses, output
    assert set(statuses) <= {str(EXIT_STOPPED), "-15"}, output


# ---- in-process: the signal handling -------------------------------------------------------------


@pytest.fixture
def restore_signal_handlers():
    names = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    saved = {sig: signal.getsignal(sig) for sig in names}
    hook = sys.excepthook  # a stop's check sets its own
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    sys.excepthook = hook


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
    assert preemption.received is None
    assert preemption.signal_number() == 0
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.received == "SIGUSR1"
    os.kill(os.getpid(), signal.SIGTERM)  # a launcher passing the stop on: the same request
    os.kill(os.getpid(), signal.SIGUSR1)  # later, while saving (Slurm's own TERM): nothing changes
    assert preemption.received == "SIGUSR1"
    assert preemption.signal_number() == signal.SIGUSR1.value


def test_the_ranks_stop_marks_the_run_as_stopped(world_of_one, tmp_path, capsys):
    group = dist.new_group(backend="gloo", timeout=world_of_one)
    with pytest.raises(SystemExit) as stop:
        stop_after_saving(7, signal.SIGUSR1.value, tmp_path, group)
    assert stop.value.code == EXIT_STOPPED
    said = capsys.readouterr().err
    assert said == "stopped by SIGUSR1 at step 7: checkpoint saved; continue with --resume\n"
    assert (tmp_path / STOP_MARKER).read_text() == "7 SIGUSR1\n"


def test_a_worker_restarted_after_a_stop_stops_at_once(world_of_one, tmp_path, capsys):
    group = dist.new_group(backend="gloo", timeout=world_of_one)
    (tmp_path / STOP_MARKER).write_text("7 SIGTERM\n")  # what the stop left
    # torchrun restarted the worker
    with pytest.raises(SystemExit) as stop:
        stop_if_stopped_before(tmp_path, 1, group)
    assert stop.value.code == EXIT_STOPPED
    said = capsys.readouterr().err
    assert said.startswith("stopped by SIGTERM before torchrun restarted this worker at step 7")
    # a new launch (with --resume) is not a restart: the old stop is over, and its marker goes
    stop_if_stopped_before(tmp_path, 0, group)
    assert not (tmp_path / STOP_MARKER).exists()
    # a restart after a failure, with no stop asked for, trains on
    stop_if_stopped_before(tmp_path, 2, group)


def ends(main, resumable=False) -> tuple[int, str]:
    """run_main(main) in this process: its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        run_main(main, resumable=resumable)
    return exit_.value.code, err.getvalue()


def test_run_main_lines_and_statuses(restore_signal_handlers):
    def stopped_at_step_3():
        exit_stopped("SIGTERM", 3, speaks=True)

    def stopped_on_rank_1():
        exit_stopped("SIGTERM", 3, speaks=False)

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


ERROR_WHILE_STOPPING = """
import errno, os, signal, sys
from common.support.errors import run_main
from common.support.preempt import Preemption

def main():
    preemption = Preemption("TERM")
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.signal_number() == signal.SIGTERM.value  # the check: the run stops
    if sys.argv[1] == "full disk":
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    raise ValueError("a bug")

run_main(main, resumable=True)
"""


@pytest.mark.parametrize("error", ["full disk", "bug"])
def test_an_error_while_stopping_is_an_error(error):
    """After the stop signal, an error that ends the run says it came while stopping, status 1: a
    full disk in the stop's save is one line; a bug keeps its traceback, then that line."""
    proc = run_python(["-c", ERROR_WHILE_STOPPING, error], check=False)
    output = proc.stderr
    assert proc.returncode == 1, output
    intact = ": the last checkpoint written is intact; continue with --resume"
    if error == "full disk":
        assert output.count("\n") == 1, output
        disk = "error while stopping after SIGTERM: [Errno 122] Disk quota exceeded"
        assert output == f"{disk}{intact}\n"
    else:
        assert "Traceback" in output, output
        assert "ValueError: a bug" in output, output
        assert output.splitlines()[-1] == f"error while stopping after SIGTERM: a bug{intact}"


def test_workers_restarted_after_a_stop_stop_at_once(data_dir, tmp_path):
    """SIGTERM to the workers alone (not to torchrun): they save and exit 75, torchrun counts that
    as a failure and restarts them (--max-restarts=1), and the restarted workers find the stop's
    marker and stop at once, without a step more."""
    out = tmp_path / "run"
    args = tiny_run_args(data_dir, out, max_iters=100_000, batch_size=4)
    cmd = torchrun_command("06_fault_tolerance/train.py", 2, args, extra=["--max-restarts=1"])
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
