"""A newcomer's first hour: runs never destroy each other (a folder that holds or runs a run is
refused, the lock of a killed run dies with it, a file system that cannot lock is named), Ctrl-C
and SIGTERM under torchrun are one line per rank, and progress shows in a terminal of no size."""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import signal
import subprocess
import sys

import pytest
from helpers import read_until, snapshot, start, tiny_run_args

from common.support import rundir
from common.support.errors import CourseError
from layout import REPO
from tools.launch import child_env, run_python, run_torchrun, stop_launchers, torchrun_command


def test_a_new_run_refuses_a_folder_that_holds_a_run(data_dir, tmp_path):
    out = tmp_path / "run"
    run_python(["01_single_gpu/train.py", *tiny_run_args(data_dir, out, max_iters=2)])
    before = snapshot(out)
    assert {"ckpt.pt", "metrics.jsonl"} <= before.keys()

    # the classic sequence: a different quick run with the same --out-dir
    proc = run_python(
        ["01_single_gpu/train.py", *tiny_run_args(data_dir, out, max_iters=3, preset="tiny")],
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("error: ")
    assert "already holds a run" in proc.stderr
    assert "--resume" in proc.stderr
    assert "--out-dir" in proc.stderr
    assert snapshot(out) == before  # nothing of the earlier run lost

    # under torchrun every rank stops with rank 0's verdict (none is left waiting in a collective)
    args = tiny_run_args(data_dir, out, batch_size=4)
    proc = run_torchrun("04_ddp/train.py", 2, args, timeout=180, check=False)
    assert proc.returncode != 0
    assert "[rank 0] error: " in proc.stderr
    assert "[rank 1] error: " in proc.stderr
    assert "already holds a run" in proc.stderr
    assert snapshot(out) == before

    # continuing it is what --resume is for
    run_python(["01_single_gpu/train.py", *tiny_run_args(data_dir, out, max_iters=3), "--resume"])
    assert snapshot(out)["ckpt.pt"] != before["ckpt.pt"]


def test_the_two_node_simulation_refuses_a_folder_that_holds_a_run(data_dir, tmp_path):
    run_dir = tmp_path / "two_nodes"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"iter": 1, "loss": 10.0}\n')
    (run_dir / "node0.log").write_text("the earlier run's log\n")
    proc = subprocess.run(
        ["bash", "05_multinode/simulate_two_nodes.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=child_env(RUN_DIR=str(run_dir)),
        timeout=60,
    )
    assert proc.returncode == 2
    assert "already holds a run" in proc.stderr
    assert "--resume" in proc.stderr
    assert (run_dir / "node0.log").read_text() == "the earlier run's log\n"


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_runs_lock_goes_with_it(
    data_dir, tmp_path
):
    out = tmp_path / "busy"
    args = tiny_run_args(data_dir, out, max_iters=100_000, eval_interval=2)
    first = start([sys.executable, "01_single_gpu/train.py", *args], new_session=False)
    try:
        assert "checkpoint saved" in read_until(first, "checkpoint saved")
        second = run_python(
            ["01_single_gpu/train.py", *tiny_run_args(data_dir, out, max_iters=2), "--resume"],
            check=False,
        )
        assert second.returncode == 2
        assert second.stderr.startswith("error: ")
        assert "in use by a run that is still going" in second.stderr
        # the lock file says who holds the folder
        assert f"pid {first.pid}" in second.stderr
        assert "run.lock" in second.stderr
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()  # kill -9: no chance to clean up
        first.wait()
    # the operating system dropped the dead run's lock: continuing its run works
    proc = run_python(
        ["01_single_gpu/train.py", *tiny_run_args(data_dir, out, max_iters=2), "--resume"],
        check=False,
    )
    assert "in use" not in proc.stderr


def test_ctrl_c_and_sigterm_under_torchrun_give_one_line_per_rank(data_dir, tmp_path):
    for sig in (signal.SIGINT, signal.SIGTERM):
        out = tmp_path / sig.name
        cmd = torchrun_command(
            "04_ddp/train.py", 2, tiny_run_args(data_dir, out, max_iters=100_000, batch_size=4)
        )
        proc = start(cmd)
        try:
            seen = read_until(proc, "iter")
            assert "iter" in seen, seen
            if sig == signal.SIGINT:
                # Ctrl-C: the terminal signals the whole foreground job
                os.killpg(proc.pid, signal.SIGINT)
            else:
                # torchrun alone: it passes SIGTERM on to its workers
                proc.send_signal(signal.SIGTERM)
            rest, _ = proc.communicate(timeout=60)
        finally:
            stop_launchers([proc])
        lines = (seen + rest).splitlines()
        # either signal: every rank stops at once (that it saves the step is chapter 06's idea,
        # proven in tests/test_preemption.py)
        for rank in (0, 1):
            assert sum(f"[rank {rank}] stopped by {sig.name}" in line for line in lines) == 1, (
                seen + rest
            )
        assert not [
            line for line in lines if "stopped by" in line and not line.startswith("[rank ")
        ]
        assert "[rank 0] Traceback" not in seen + rest
        assert "[rank 1] Traceback" not in seen + rest


def test_progress_shows_under_a_pseudo_terminal_without_a_size(data_dir, tmp_path):
    """As `script -qc "python 01_single_gpu/train.py ..."` runs it: in a terminal that
    reports 0 columns."""
    parent, child = pty.openpty()
    assert os.get_terminal_size(child).columns == 0
    proc = subprocess.Popen(
        [
            sys.executable,
            "01_single_gpu/train.py",
            *tiny_run_args(data_dir, tmp_path / "pty", max_iters=4),
        ],
        cwd=REPO,
        env=child_env(),
        stdin=child,
        stdout=child,
        stderr=child,
    )
    os.close(child)
    output = b""
    while True:
        try:
            chunk = os.read(parent, 4096)
        except OSError:  # the child side closed
            break
        if not chunk:
            break
        output += chunk
    assert proc.wait(timeout=120) == 0
    text = output.decode(errors="replace")
    assert "iter      4 | loss" in text, text


def test_a_file_system_that_cannot_lock_is_named_and_can_be_run_without_the_lock(
    tmp_path, monkeypatch
):
    """lockf's own errors, planted: only EAGAIN (or EACCES) means another run; ENOLCK (NFS without
    its lock service) and ENOSYS (Lustre mounted with noflock) mean the file system cannot lock."""

    def failing(code):
        def lockf(fd, operation):
            raise OSError(code, os.strerror(code))

        return lockf

    for code in (errno.ENOLCK, errno.ENOSYS):
        monkeypatch.setattr(fcntl, "lockf", failing(code))
        with pytest.raises(CourseError) as err:
            rundir.claim_out_dir(tmp_path / "run", resume=False)
        assert "cannot lock the folder" in str(err.value)
        assert "COURSE_NO_LOCK=1" in str(err.value)
        assert "in use" not in str(err.value)
    monkeypatch.setattr(fcntl, "lockf", failing(errno.EAGAIN))
    with pytest.raises(CourseError, match="in use by a run that is still going"):
        rundir.claim_out_dir(tmp_path / "run", resume=False)
    # the documented way on: no lock taken, and the folder's other rule still holds
    monkeypatch.setenv("COURSE_NO_LOCK", "1")
    rundir.claim_out_dir(tmp_path / "run", resume=False)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"iter": 1, "loss": 10.0}\n')
    with pytest.raises(CourseError, match="already holds a run"):
        rundir.claim_out_dir(tmp_path / "run", resume=False)
