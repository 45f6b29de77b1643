"""A scheduler's stop signal."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import assert_same_run, checkpoint, read_until, start, tiny_run_args, train_losses

from common.support.errors import run_main
from common.support.preempt import Preemption, stop_signal
from tools.launch import run_python, run_torchrun, stop_launchers, torchrun_command

# chapter 06's ranks check for a stop every 10 steps: a stop asked for after step 2 is taken after
# step 10 (or 20, on a slow machine), before the end
ITERS = 24
# float64: a resumed run repeats the uninterrupted one's numbers (exactly in the same world of
# processes, up to rounding between one process of 8 sequences and two of 4); a fixed schedule
FLAGS = {"dtype": "float64", "warmup_iters": 2, "lr_decay_iters": ITERS}
STOP_LINE = "stopped by SIGTERM: step {step} saved; continue with --resume"
ENDED_LINE = "stopped by SIGTERM: the last checkpoint written is intact; continue with --resume"


def run_args(data_dir: Path, out_dir: Path, chapter: int, **more) -> list:
    batch_size = 8 if chapter == 1 else 4  # two ranks of 4: chapter 01's global batch of 8
    return tiny_run_args(data_dir, out_dir, ITERS, batch_size=batch_size, **FLAGS, **more)


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
    assert_same_run(out["single"], out["reference"], 1e-9, 1e-9, 1e-12)


@pytest.mark.slow
def test_sigterm_under_torchrun_saves_the_step_reached_and_resumes(data_dir, runs):
    out, stops = runs
    status, output = stops["ranks"]
    step = checkpoint(out["ranks"])["iter_num"]
    # the ranks check every 10 steps
    assert step in (10, 20), output
    # the checkpoint holds the last step finished
    assert step == max(train_losses(out["ranks"])), output
    lines = output.splitlines()
    assert [line for line in lines if "stopped by" in line] == [
        "[node 0 rank 0 local 0] " + STOP_LINE.format(step=step)
    ]
    # the workers ended with status 0: torchrun reports no failed worker. (torchrun, signalled
    # too, ends with its own SignalException and status 1, as it does for any signal to it.)
    assert "exitcode" not in output, output
    assert status == 1, output
    assert "[rank 0] Traceback" not in output
    assert "[rank 1] Traceback" not in output

    run_torchrun(
        "06_fault_tolerance/train.py", 2, [*run_args(data_dir, out["ranks"], 5), "--resume"]
    )
    # two processes of 4 against one of 8: rounding
    assert_same_run(out["ranks"], out["reference"], 1e-9, 1e-9, 1e-12)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(runs):
    out, stops = runs
    status, output = stops["one_rank"]
    step = checkpoint(out["one_rank"])["iter_num"]
    assert step in (10, 20), output
    assert step == max(train_losses(out["one_rank"])), output
    # rank 0 was not signalled: it names the signal rank 1 received, as the ranks agreed on it
    assert "[node 0 rank 0 local 0] " + STOP_LINE.format(step=step) in output, output
    # both ranks ended with status 0 (torchrun reports no failure), after that step alone
    assert status == 0, output
    assert "exitcode" not in output, output
    assert f"iter {step + 1:>6} |" not in output, output


# ---- in-process: the signal handling -------------------------------------------------------------


@pytest.fixture
def restore_signal_handlers():
    names = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    saved = {sig: signal.getsignal(sig) for sig in names}
    hook = sys.excepthook  # an agreed stop sets its own
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    sys.excepthook = hook


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
    hook = sys.excepthook
    assert preemption.signal_number() == signal.SIGUSR1.value
    assert sys.excepthook is hook  # a question, not a decision: the ranks have not agreed yet


def ends(main, resumable=False) -> tuple[int, str]:
    """run_main(main) in this process: its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        run_main(main, resumable=resumable)
    return exit_.value.code, err.getvalue()


def test_run_main_lines_and_statuses(restore_signal_handlers):
    def signalled():
        os.kill(os.getpid(), signal.SIGTERM)

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
    assert preemption.stopping(preemption.signal_number()) == "SIGTERM"  # the ranks agreed
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


def test_a_stop_is_final_torchrun_restarts_nothing(data_dir, tmp_path):
    """SIGTERM to the workers alone (not to torchrun), with --max-restarts=1: they save and end with
    status 0, so torchrun, which restarts only failed workers, ends too, without a step more."""
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
    assert f"[node 0 rank 0 local 0] {STOP_LINE.format(step=step)}" in output, output
    # no restart: each worker started once, and no step was trained after the stop's
    assert len(re.findall(r"\] process (\d+) on ", output)) == 2, output
    assert max(train_losses(out)) == step
    assert proc.returncode == 0, output
