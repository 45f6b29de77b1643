"""The laptop path needs bash, POSIX tools and Python, nothing of Linux's own: the two-node
simulation runs, and keeps a second simulation out of its folder, without the `flock` command;
and chapter 07's peak-memory figure, read from Linux's /proc, says it cannot measure where /proc
is missing, and the run goes on: on its own, and in a whole run of chapter 07 with no /proc at
all (as root on Linux; skipped elsewhere)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import read_until, start, stop_launchers, tiny_run_args

from common.sharding import PeakMemory
from layout import REPO
from tools.launch import child_env, torchrun_command

# A command with no /proc at all, as on macOS: in a mount namespace of its own (Linux, as root),
# an empty folder is mounted over /proc; the host's /proc is untouched.
WITHOUT_PROC = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
WITHOUT_PROC += ['mount -t tmpfs none /proc && exec "$@"', "sh"]


def path_without(tmp_path: Path, hidden: str) -> str:
    """A PATH of one folder: a link to every command this PATH finds, except `hidden`."""
    folder = tmp_path / f"path-without-{hidden}"
    folder.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for name in sorted(os.listdir(directory)):
            command = Path(directory) / name
            link = folder / name
            if name == hidden or link.exists() or not os.access(command, os.X_OK):
                continue
            link.symlink_to(command)
    return str(folder)


def test_the_simulation_runs_and_keeps_its_folder_without_flock(data_dir, tmp_path):
    no_flock = path_without(tmp_path, "flock")
    found = subprocess.run(["sh", "-c", "command -v flock"], env={"PATH": no_flock})
    assert found.returncode != 0  # flock is hidden
    env = {"RUN_DIR": str(tmp_path / "sim"), "NPROC_PER_NODE": "1", "PATH": no_flock}
    flags = ["--max-iters", "100000", "--data-dir", str(data_dir), "--shared-fs"]
    flags += ["--eval-batches", "1"]
    first = start(["bash", "05_multinode/simulate_two_nodes.sh", *flags], **env)
    try:
        # both nodes met and train
        assert "iter" in read_until(first, "iter")
        # a second simulation in the same folder is refused: the lock holds without flock
        second = subprocess.run(
            ["bash", "05_multinode/simulate_two_nodes.sh", *flags],
            cwd=REPO,
            env=child_env(**env),
            text=True,
            capture_output=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"error: {tmp_path / 'sim'} is in use by another simulation that is still going; "
            "wait for it, or set RUN_DIR"
        ]
        assert first.poll() is None  # the first goes on
    finally:
        stop_launchers([first])


def test_peak_memory_without_proc_says_it_cannot_measure_and_the_run_goes_on(tmp_path, capsys):
    missing = tmp_path / "no-proc" / "self"  # as on macOS: no /proc/self at all
    memory = PeakMemory(torch.device("cpu"), proc=missing)
    held = torch.ones(1_000_000)
    assert math.isnan(memory.since_start())
    assert math.isnan(memory.since_start())  # asked again, it still goes on
    said = capsys.readouterr()
    assert said.err.strip().splitlines() == [
        f"peak memory: cannot measure it here ({missing}/clear_refs: No such file or "
        "directory), so its figures read nan; the run goes on"
    ]
    del held
    # where Linux's /proc is, the same code measures: at least the 8 MB it allocates next (in a
    # fresh process, whose allocator holds no freed memory it could reuse without growing)
    code = (
        "import torch; from common.sharding import PeakMemory; "
        "m = PeakMemory(torch.device('cpu')); x = torch.ones(2_000_000); print(m.since_start())"
    )
    measured = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert float(measured.stdout) >= 7.9
    assert measured.stderr == ""


@pytest.mark.slow
def test_chapter_07_runs_to_its_end_without_proc(data_dir, tmp_path):
    probe = subprocess.run([*WITHOUT_PROC, "test", "!", "-e", "/proc/self"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here (root on Linux): {probe.stderr.decode().strip()}")
    args = tiny_run_args(data_dir, tmp_path, max_iters=2, eval_interval=2, sample_tokens=0)
    run = subprocess.run(
        [*WITHOUT_PROC, *torchrun_command(REPO / "07_fsdp" / "train.py", 2, args)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout + run.stderr
    said = [line for line in out.splitlines() if line.startswith("peak memory: ")]
    missing = "/proc/self/clear_refs: No such file or directory"
    line = (
        f"peak memory: cannot measure it here ({missing}), so its figures read nan; the run goes on"
    )
    assert said == [line, line]  # once a rank
    assert (tmp_path / "ckpt.pt").exists()
