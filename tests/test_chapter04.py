"""Chapter 04: DistributedDataParallel under torchrun is chapter 01's run, on several processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import epoch_permutation, start, tiny_run_args

from common.metrics import read_metrics
from layout import REPO
from tools.check.harness import parity
from tools.launch import run_python, run_torchrun, torchrun_command

SCRIPT = REPO / "04_ddp" / "train.py"
ITERS = 4


@pytest.fixture(scope="module")
def ddp_run(data_dir, tmp_path_factory) -> Path:
    """Two ranks of chapter 04, their output kept beside the run's own files."""
    out = tmp_path_factory.mktemp("chapter04") / "ddp"
    ddp = run_torchrun(
        SCRIPT, 2, tiny_run_args(data_dir, out, ITERS, batch_size=4, lr_decay_iters=ITERS)
    )
    # written after the run: until then the folder held only the run's own files
    (out / "stdout.txt").write_text(ddp.stdout)
    return out


@pytest.fixture(scope="module")
def check_root(tmp_path_factory) -> Path:
    """The parity harness's folder: chapter 01's float64 run is made once there, for every test."""
    return tmp_path_factory.mktemp("parity")


@pytest.mark.quick
def test_two_ranks_equal_chapter01_step_for_step(check_root):
    assert parity(SCRIPT, nproc=2, root=check_root, batch_size=4, grad_accum=1) is None


def test_two_ranks_with_accumulation_and_resume_equal_chapter01(check_root):
    """2 ranks x 2 micro-batches of 2, and the same run stopped after step 5 and resumed."""
    assert parity(SCRIPT, nproc=2, root=check_root, resume=True) is None


def test_only_rank0_writes_and_all_ranks_agree(ddp_run):
    folder = ddp_run
    assert sorted(p.name for p in folder.iterdir()) == [
        "ckpt.pt",
        "metrics.jsonl",
        "run.lock",
        "stdout.txt",
    ]
    metrics = read_metrics(folder / "metrics.jsonl")
    assert [m["iter"] for m in metrics if "loss" in m] == list(range(1, ITERS + 1))
    assert [m["iter"] for m in metrics if "val_loss" in m] == [ITERS]
    stdout = (folder / "stdout.txt").read_text()
    # the ranks share one pipe and write text and newline separately, so one rank's line can land in
    # the middle of another's: start a new line at every rank prefix found mid-line
    stdout = re.sub(r"(?<=[^\n])(\[rank \d+\] )", r"\n\1", stdout)
    # every rank announces itself; after that only rank 0 speaks, and every line says who speaks
    assert re.search(r"^\[rank 1\] process \d+ on .*rank 1 of 2, local rank 1", stdout, re.M), (
        stdout
    )
    ours = [line for line in stdout.splitlines() if line and not line.startswith("*")]
    assert all(line.startswith("[rank ") for line in ours), stdout
    assert sum(line.startswith("[rank 1]") for line in ours) == 1, stdout
    assert "[rank 0] parameters identical on all 2 rank(s): yes" in stdout


def test_ranks_share_each_global_batch_as_chapter01_does(tmp_path):
    """The script's DistributedSampler + batch_loader in 2 real processes, on a token file that
    says which window each row came from."""
    T, B, W, N = 4, 2, 2, 50  # N is not a multiple of the global batch: an epoch drops its tail
    np.arange(N * T + 1, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    worker = "tests.workers.ddp_sampler_worker"  # a module: `torchrun -m` from the repository root
    run_torchrun(worker, W, [tmp_path / "tokens.bin", T, B, tmp_path], timeout=120, extra=["-m"])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(W)]
    assert [r["n_windows"] for r in ranks] == [N, N]

    for epoch in (0, 1):
        order = epoch_permutation(N, 1337, epoch).tolist()  # chapter 01's order for this epoch
        seen = [r[f"epoch{epoch}"] for r in ranks]
        assert not set(seen[0]) & set(seen[1]), "the ranks must see disjoint windows"
        for K in (1, 2):  # micro-steps per optimizer step
            G = B * K * W
            steps = N // G
            for s in range(steps):  # one optimizer step: every rank's K micro-batches
                union = [i for rank in seen for i in rank[s * K * B : (s + 1) * K * B]]
                assert sorted(union) == sorted(order[s * G : (s + 1) * G]), (epoch, K, s)
            # over the epoch the ranks cover the training set, except what chapter 01 drops too
            used = set(seen[0][: steps * K * B]) | set(seen[1][: steps * K * B])
            assert used == set(range(N)) - set(order[steps * G :])
    for r in ranks:
        assert r["epoch0"] != r["epoch1"], "set_epoch must give every epoch its own order"
        assert r["epoch0_skip2"] == r["epoch0"][2 * B :], (
            "a resumed epoch continues where it stopped"
        )


def test_plain_python_gives_the_torchrun_command(data_dir, tmp_path):
    proc = run_python([SCRIPT, *tiny_run_args(data_dir, tmp_path, 2)], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {SCRIPT} runs under torchrun, which starts one process per device: "
        f"torchrun --standalone --nproc_per_node=N {SCRIPT} (N=1 for a single process)"
    ]
    assert not (tmp_path / "metrics.jsonl").exists()


# ---- a rank that fails: the run must end with an error, never hang ----------------------------


def start_long_run(data_dir: Path, out_dir: Path, timeout_s: int):
    """Start 2 ranks on a long run; return the process and each rank's pid once both train."""
    args = tiny_run_args(
        data_dir, out_dir, 100_000, batch_size=4, dist_timeout=timeout_s, eval_interval=100_000
    )
    proc = start(torchrun_command(SCRIPT, 2, args))
    pids, output = {}, []
    for line in proc.stdout:  # ranks print "[rank R] process PID on HOST: ..." first
        output.append(line)
        # two ranks write to one pipe, so their lines can interleave: look anywhere in the line
        for m in re.finditer(r"\[rank (\d+)\] process (\d+) ", line):
            pids[int(m.group(1))] = int(m.group(2))
        if "[rank 0] iter      2 " in line:  # training is under way, gradients flowing
            break
    assert set(pids) == {0, 1}, "".join(output)
    return proc, pids, output


def finish(proc: subprocess.Popen, output: list[str], within_s: float) -> tuple[int, str]:
    try:
        for line in proc.stdout:
            output.append(line)
        return proc.wait(timeout=within_s), "".join(output)
    finally:
        if proc.poll() is None:  # a hang: end the whole process group this test started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_killed_rank_ends_the_run_with_an_error(data_dir, tmp_path):
    proc, pids, output = start_long_run(data_dir, tmp_path, timeout_s=30)
    os.kill(pids[1], signal.SIGKILL)
    returncode, text = finish(proc, output, within_s=60)
    assert returncode != 0, text
    assert not (tmp_path / "ckpt.pt").exists()


def test_a_stuck_rank_ends_the_run_after_the_timeout(data_dir, tmp_path):
    """Rank 1 freezes (SIGSTOP) but its process lives: only the process group's timeout can tell
    rank 0, waiting for rank 1's gradients, that nothing will come."""
    timeout_s = 10
    proc, pids, output = start_long_run(data_dir, tmp_path, timeout_s=timeout_s)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s + 60
        while Path(f"/proc/{pids[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{pids[0]}").exists(), "rank 0 still waits after the timeout"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)  # so that torchrun's SIGTERM reaches it now
    returncode, text = finish(proc, output, within_s=60)
    assert returncode != 0, text
    assert "timed out" in text.lower(), text
