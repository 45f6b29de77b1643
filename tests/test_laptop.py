"""The laptop path needs bash, POSIX tools and Python, nothing of Linux's own: the two-node
simulation runs, and keeps a second simulation out of its folder, without the `flock` command;
and chapter 07's peak-memory figure, read from Linux's /proc, says it cannot measure where /proc
is missing, and the run goes on.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import torch
from helpers import read_until, start, stop_launchers

from common.sharding import PeakMemory
from layout import REPO
from tools.launch import child_env


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
    # where Linux's /proc is, the same code measures: at least the 8 MB it allocates next
    measured = PeakMemory(torch.device("cpu"))
    more = torch.ones(2_000_000)
    assert measured.since_start() >= 7.9
    assert capsys.readouterr().err == ""
    del held, more
