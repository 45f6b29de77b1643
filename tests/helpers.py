"""Plain helpers the tests share: the flags of a tiny run, a snapshot of a run folder, launches
whose output is read as it comes, and edits of a script's statements (for the broken copies that
show a check can fail)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

# indentation: the one, re-exported for the tests that import it from here
from statements import Pattern, lines_of, replace, the_one
from statements import indentation as indentation

from common.metrics import read_metrics
from layout import REPO
from tools.launch import child_env, flags, measured_run_flags, stop_launchers


def epoch_permutation(n_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch e's order of the windows, in every chapter (README.md, "How the chapters stay the
    same run"): randperm(N) from a generator seeded with seed + e."""
    return torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed + epoch))


def train_losses(out_dir: Path, key: str = "loss") -> dict[int, float]:
    """step -> training loss (or `key`), from a run's metrics.jsonl; a step logged twice fails."""
    lines = [m for m in read_metrics(out_dir / "metrics.jsonl") if key in m]
    iters = [m["iter"] for m in lines]
    assert len(iters) == len(set(iters)), f"an iteration is logged twice: {iters}"
    return {m["iter"]: m[key] for m in lines}


def checkpoint(out_dir: Path) -> dict:
    """A run folder's ckpt.pt, on the CPU."""
    return torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)


def snapshot(folder: Path) -> dict:
    """Every file of a folder with its modification time and bytes: a run left them alone. Not
    run.lock: the folder's claim, where every run that takes the folder writes who it is."""
    files = [p for p in sorted(folder.iterdir()) if p.name != "run.lock"]
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}


def assert_same_run(
    run: Path, reference: Path, rel: float = 1e-5, rtol: float = 1e-4, atol: float = 1e-5
) -> None:
    """The same steps with the same losses (within `rel`) and the same final parameters."""
    expected = train_losses(reference)
    assert sorted(train_losses(run)) == sorted(expected), (sorted(train_losses(run)), expected)
    assert train_losses(run) == pytest.approx(expected, rel=rel)
    final, wanted = checkpoint(run), checkpoint(reference)
    assert final["iter_num"] == wanted["iter_num"]
    assert final["model"].keys() == wanted["model"].keys()
    for name, value in wanted["model"].items():
        torch.testing.assert_close(final["model"][name], value, rtol=rtol, atol=atol, msg=name)


def tiny_run_args(data_dir: Path, out_dir: Path, max_iters: int = 10, **extra) -> list[str]:
    """Flags of a short, deterministic CPU run with the tiny model, then `extra` (batch_size=4 ->
    --batch-size 4; True: a bare flag), which come last and so override (eval_interval=5)."""
    tiny = {
        "preset": "tiny",
        "device": "cpu",
        "dtype": "float32",
        "data_dir": data_dir,
        "out_dir": out_dir,
    }
    return measured_run_flags(max_iters, log_interval=1, eval_batches=2, **tiny) + flags(**extra)


def start(
    cmd: list, stderr=subprocess.STDOUT, new_session: bool = True, **env: str
) -> subprocess.Popen:
    """Start a command from the repository root, one thread a process, its output in a text pipe
    (stderr merged into it unless given), in a session of its own so stop_launchers ends it all."""
    return subprocess.Popen(
        [str(word) for word in cmd],
        cwd=REPO,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=new_session,
    )


def read_until(proc: subprocess.Popen, text: str, timeout: float = 240) -> str:
    """A started process's output, line by line, up to the first line holding `text` (or until it
    ends, or `timeout` seconds pass: the caller checks that `text` came)."""
    seen = ""
    deadline = time.monotonic() + timeout
    while text not in seen and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    return seen


def outputs_of(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each started process's whole output, once it ends; any still running after `timeout` seconds
    (or when reading fails) is stopped with what it started."""
    try:
        return [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        stop_launchers(procs)


def statement_lines(source: str, statement: str, script: str) -> range:
    """The lines (from 0) of the one statement of `source` that is `statement`, compared as code;
    anything but one such statement alone on its lines fails, naming the script that changed."""
    try:
        return lines_of(source, the_one(source, Pattern(code=statement), script), script)
    except ValueError as err:
        raise AssertionError(f"{err}: {script} changed") from None


def replace_statement(source: str, old: str, new: str, script: str) -> str:
    """`source` with its one statement `old` (see statement_lines) replaced by the lines of `new`,
    at that statement's indentation (its comment goes with it); an empty `new` removes it."""
    statement_lines(source, old, script)  # one, alone on its lines, or the test fails here
    return replace(source, Pattern(code=old), new, script)
