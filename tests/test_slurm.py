"""06_fault_tolerance/slurm.sbatch on a real one-node Slurm: the stop near the time limit saves
the step (the training ends with status 0), the script that asked for the stop requeues the job
under its id, and the requeued job resumes from that step and completes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_run_args

from common.metrics import read_metrics
from layout import REPO
from tools.launch import child_env, free_port

START = "sudo bash .ci/slurm/start.sh /tmp/course-slurm"
# sbatch options that fit the script to the test cluster; the script itself is not changed
ONE_SMALL_NODE = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2"]
ITERS = 16


def why_no_slurm() -> str | None:
    """Why no Slurm can take jobs here (None: one can)."""
    if shutil.which("sbatch") is None:
        return "no Slurm commands (sbatch)"
    if not os.environ.get("SLURM_CONF"):
        return "SLURM_CONF is not set"
    nodes = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if nodes.returncode != 0 or not re.search(r"idle|mix|alloc", nodes.stdout):
        return f"no Slurm node takes jobs (sinfo: {(nodes.stdout + nodes.stderr).strip()})"
    return None


@pytest.fixture(scope="module")
def slurm():
    """A Slurm that takes jobs: skipped without one, but a failure in CI, which brings one up."""
    why = why_no_slurm()
    if why is None:
        return
    message = f"{why}: bring the test cluster up with `{START}`, then export SLURM_CONF"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def submit(data_dir: Path, out_dir: Path, log: Path, sbatch_options: list, train_args: list) -> str:
    """Submit slurm.sbatch from the repository root, as a reader does; returns the job id."""
    env = child_env(
        OUT_DIR=str(out_dir),
        DATA_DIR=str(data_dir),
        GPUS_PER_NODE="2",
        PREFLIGHT_SIZES_MB="1",
        MASTER_PORT=str(free_port()),
    )
    cmd = [
        "sbatch",
        "--parsable",
        *ONE_SMALL_NODE,
        f"--output={log}",
        *sbatch_options,
        "06_fault_tolerance/slurm.sbatch",
        *map(str, train_args),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_fields(job: str) -> dict[str, str]:
    """`scontrol show job`'s KEY=VALUE fields (empty once Slurm has forgotten the job)."""
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30
    )
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def wait_for_line(log: Path, pattern: str, job: str, limit: float) -> re.Match:
    """The first match of `pattern` in the job's log, waiting up to `limit` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        found = re.search(pattern, text, re.MULTILINE)
        if found:
            return found
        time.sleep(0.5)
    subprocess.run(["scancel", job], timeout=30)
    raise AssertionError(f"no {pattern!r} in the job's log after {limit} s:\n{text}")


def wait_until_done(job: str, log: Path, limit: float) -> dict[str, str]:
    deadline = time.monotonic() + limit
    fields = job_fields(job)
    while fields.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], timeout=30)
            raise AssertionError(f"job {job} still {fields.get('JobState')}:\n{log.read_text()}")
        time.sleep(1)
        fields = job_fields(job)
    return fields


@pytest.mark.slow
def test_a_stop_near_the_limit_saves_the_step_and_the_requeued_job_resumes_it(
    slurm, data_dir, tmp_path
):
    out_dir = tmp_path / "out"
    log = tmp_path / "job.log"
    train_args = tiny_run_args(data_dir, out_dir, max_iters=ITERS, batch_size=4)
    job = submit(data_dir, out_dir, log, [], train_args)
    wait_for_line(log, r"\] iter +2 \|", job, limit=240)
    # what --signal=B:USR1@90 delivers near the limit, now
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=30)

    fields = wait_until_done(job, log, limit=300)
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED", text
    assert fields["ExitCode"] == "0:0", text
    # requeued once, under the same id (the requeued job's SLURM_RESTART_COUNT is 1)
    assert fields["Restarts"] == "1", text
    # the training saved the step it was in, and said so
    stopped = re.search(
        r"^\[node 0 rank 0 local 0\] stopped by SIGTERM: step (\d+) saved", text, re.M
    )
    assert stopped, text
    step = int(stopped.group(1))
    assert 2 <= step < ITERS, text
    # the requeued job resumed from that step and completed; the log holds both attempts, in order
    resumed = f"resuming from {out_dir / 'ckpt.pt'} at step {step}"
    assert text.count(f"job {job}: 1 nodes x 2 GPUs") == 2, text
    assert text.index(stopped.group(0)) < text.index(resumed) < text.index("all 2 rank(s): yes")
    checkpoint = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)
    assert checkpoint["iter_num"] == ITERS
    steps = [r["iter"] for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, ITERS + 1)), steps  # each step once: nothing lost, none twice
    assert not list(out_dir.glob(".*tmp*"))


@pytest.mark.skipif(
    os.environ.get("COURSE_SLURM_TIME_LIMIT") != "1",
    reason="the real time limit costs minutes: run with COURSE_SLURM_TIME_LIMIT=1",
)
def test_the_real_time_limit_signal_stops_and_requeues(slurm, data_dir, tmp_path):
    out_dir = tmp_path / "out"
    log = tmp_path / "job.log"
    train_args = tiny_run_args(data_dir, out_dir, max_iters=1_000_000, batch_size=4)
    options = ["--time=3", "--signal=B:USR1@90"]
    job = submit(data_dir, out_dir, log, options, train_args)
    try:
        stopped = wait_for_line(
            log, r"^\[node 0 rank 0 local 0\] stopped by SIGTERM: step (\d+) saved", job, limit=240
        )
        step = int(stopped.group(1))
        wait_for_line(
            log, f"resuming from {re.escape(str(out_dir))}/ckpt.pt at step {step}$", job, 120
        )
        assert job_fields(job)["Restarts"] == "1"
    finally:
        subprocess.run(["scancel", job], timeout=30)


def start_cluster(folder: Path, ports: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", ".ci/slurm/start.sh", str(folder)],
        cwd=REPO,
        env={**os.environ, **ports},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(os.geteuid() != 0, reason="start.sh starts daemons: as root only")
def test_start_sh_keeps_a_cluster_that_answers_and_restarts_one_that_does_not(slurm, tmp_path):
    """A second cluster, in its own folder on its own ports, so the one the other tests use is
    left alone: start.sh run again keeps it; when its controller no longer answers, start.sh stops
    it and starts the cluster afresh."""
    ctld_port = free_port()
    slurmd_port = free_port()
    while slurmd_port == ctld_port:
        slurmd_port = free_port()
    ports = {"SLURMCTLD_PORT": str(ctld_port), "SLURMD_PORT": str(slurmd_port)}
    folder = tmp_path / "cluster"
    try:
        first = start_cluster(folder, ports)
        assert first.returncode == 0, first.stderr
        assert "idle" in first.stderr
        controller = int((folder / "slurmctld.pid").read_text())

        again = start_cluster(folder, ports)
        assert again.returncode == 0, again.stderr
        assert "running already" in again.stderr
        assert int((folder / "slurmctld.pid").read_text()) == controller

        # a controller that is there but no longer answers (as when munged was stopped under it)
        os.kill(controller, signal.SIGSTOP)
        revived = start_cluster(folder, ports)
        assert revived.returncode == 0, revived.stderr
        assert "running already" not in revived.stderr
        assert "idle" in revived.stderr
        assert not is_running(controller)
        assert int((folder / "slurmctld.pid").read_text()) != controller
    finally:
        subprocess.run(["bash", ".ci/slurm/stop.sh", str(folder)], cwd=REPO, timeout=60)
    assert not (folder / "slurmctld.pid").exists()
    assert not (folder / "slurmd.pid").exists()
