"""Shared fixtures: the default corpus prepared once per test session, and one torch thread."""

from __future__ import annotations

import os
from pathlib import Path

# One thread per process: the tests start many processes (ranks, notebooks, scripts) on few cores,
# and torch's default of a thread per core in each of them would oversubscribe the machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, worker_id) -> Path:
    """A data root holding the prepared Shakespeare corpus, tokenized once for all tests: with
    pytest-xdist, once for all its workers (the first prepares it, the others wait for it)."""
    from filelock import FileLock

    from common.data import prepare

    if worker_id == "master":  # one process: its own folder
        root = tmp_path_factory.mktemp("data")
        prepare("shakespeare", root, log=lambda *a: None)
        return root
    # the workers' folders share a parent, made for this session
    root = tmp_path_factory.getbasetemp().parent / "data"
    with FileLock(f"{root}.lock"):
        prepare("shakespeare", root, log=lambda *a: None)
    return root


@pytest.fixture
def one_thread():
    """One torch thread in the test process: small matmuls gain nothing from threads, and spinning
    threads suffer on a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
