"""Shared fixtures: the default corpus prepared once per test session, and tiny-run flags."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One thread per process: the tests start many processes (ranks, notebooks, scripts) on few cores,
# and torch's default of a thread per core in each of them would oversubscribe the machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `import common` in tests, as the scripts do
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from launch import ...`


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A data root holding the prepared Shakespeare corpus (tokenized once for all tests)."""
    from common.data import prepare

    root = tmp_path_factory.mktemp("data")
    prepare("shakespeare", root, log=lambda *a: None)
    return root


def snapshot(folder: Path) -> dict:
    """Every file of a folder with its modification time and bytes: to show a run left them alone."""
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def tiny_run_args(data_dir: Path, out_dir: Path, max_iters: int = 10, **flags) -> list[str]:
    """Flags for a short, deterministic CPU run of any stage with the tiny model.

    Extra flags are given as keyword arguments: batch_size=4 -> --batch-size 4; True -> a bare flag.
    """
    args = ["--preset", "tiny", "--max-iters", max_iters, "--log-interval", 1, "--eval-interval", max_iters,
            "--eval-batches", 2, "--sample-tokens", 0, "--dropout", 0, "--device", "cpu", "--dtype", "float32",
            "--data-dir", data_dir, "--out-dir", out_dir]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [flag, value]
    return [str(a) for a in args]


@pytest.fixture
def one_thread():
    """One torch thread in the test process: small matmuls gain nothing from threads, and spinning
    threads suffer on a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_args():
    return tiny_run_args
