"""Every expected mistake: one `error:` line, exit status 2, no traceback, and nothing lost."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import snapshot, tiny_run_args

from common.support.errors import CourseError
from tools.launch import run_python

SCRIPT = "01_single_gpu/train.py"


@pytest.fixture(scope="module")
def earlier_run(data_dir, tmp_path_factory) -> Path:
    """The folder of a finished 2-step run: a failed run pointed at it must leave it as it was."""
    out_dir = tmp_path_factory.mktemp("earlier") / "run"
    run_python([SCRIPT, *tiny_run_args(data_dir, out_dir, 2)])
    assert (out_dir / "ckpt.pt").exists()
    assert (out_dir / "metrics.jsonl").exists()
    return out_dir


@pytest.fixture
def earlier_copy(earlier_run, tmp_path) -> Path:
    """This test's copy of the earlier run's folder, contents and modification times kept."""
    out_dir = tmp_path / "run"
    shutil.copytree(earlier_run, out_dir)
    return out_dir


def fails_cleanly(args: list, message: str) -> str:
    proc = run_python([SCRIPT, *args], check=False)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    assert message in lines[0], lines[0]
    assert "val loss" not in proc.stdout  # it stopped before training
    return lines[0]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def latin1(path: Path) -> Path:
    path.write_bytes(
        "Café crème, à la française. Où est la bibliothèque ?\n".encode("latin-1") * 200
    )
    return path


def binary(path: Path) -> Path:
    # as a saved array would be
    path.write_bytes(torch.arange(4096, dtype=torch.int32).numpy().tobytes())
    return path


# name -> (the flags, or a function that makes them in the test's tmp_path; the words that
# the error line must hold)
CASES = {
    "unknown corpus name": (["--dataset", "no_such_corpus!"], "unknown corpus 'no_such_corpus!'"),
    "missing file": (lambda tmp: ["--dataset", tmp / "missing.txt"], "no corpus file at"),
    "directory given as the file": (
        lambda tmp: ["--dataset", (tmp / "folder.txt").mkdir() or tmp / "folder.txt"],
        "no corpus file at",
    ),
    "unknown file type": (
        lambda tmp: ["--dataset", write(tmp / "table.csv", "a,b\n1,2\n")],
        "unknown file type '.csv'",
    ),
    "empty file": (lambda tmp: ["--dataset", write(tmp / "empty.txt", "")], "is empty"),
    "corpus smaller than one window": (
        lambda tmp: ["--dataset", write(tmp / "small.txt", "Hello world. " * 3)],
        "fewer than one window of block_size + 1 = 33",
    ),
    # 9 training windows of 32 tokens, and a validation split just long enough for one window
    "corpus smaller than one batch": (
        lambda tmp: [
            "--batch-size",
            16,
            "--dataset",
            write(tmp / "few.txt", "To be, or not to be. " * 40),
        ],
        "9 windows, fewer than one batch of 16",
    ),
    "zero batch size": (
        ["--batch-size", 0],
        "--batch-size: must be a positive whole number, got 0",
    ),
    "negative max iters": (
        ["--max-iters", -1],
        "--max-iters: must be a positive whole number, got -1",
    ),
    "grad accum in chapter 01": (
        ["--grad-accum", 2],
        "introduced in chapter 02 (02_grad_accumulation)",
    ),
    "latin-1 text": (
        lambda tmp: ["--dataset", latin1(tmp / "francais.txt")],
        "is not UTF-8 (byte 0xe9 at offset 3); "
        "convert it, e.g. from Latin-1: iconv -f latin1 -t utf-8",
    ),
    "binary file": (
        lambda tmp: ["--dataset", binary(tmp / "weights.txt")],
        "is not text (it looks like a binary file)",
    ),
}
if not torch.cuda.is_available():
    CASES["cuda asked for without a GPU"] = (["--device", "cuda"], "sees no CUDA GPU")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, data_dir, earlier_copy, tmp_path):
    flags, message = CASES[case]
    out_dir = earlier_copy
    before = snapshot(out_dir)
    extra = flags(tmp_path) if callable(flags) else flags
    data_root = tmp_path / "data" if "--dataset" in extra else data_dir
    fails_cleanly([*tiny_run_args(data_root, out_dir, 5), *extra], message)
    assert snapshot(out_dir) == before, "a failed run must not touch what an earlier run wrote"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_file(tmp_path, data_dir):
    path = write(tmp_path / "secret.txt", "To be, or not to be. " * 200)
    path.chmod(0)
    try:
        fails_cleanly(
            tiny_run_args(tmp_path / "data", tmp_path / "run", 5) + ["--dataset", path],
            "cannot read",
        )
    finally:
        path.chmod(0o600)


def test_starting_from_weights_of_another_shape(earlier_run, data_dir, tmp_path):
    """--init-from: the earlier run's tiny model into the small one is refused in one line."""
    args = tiny_run_args(data_dir, tmp_path / "run", 5) + ["--init-from", earlier_run]
    fails_cleanly([*args, "--preset", "small"], "the checkpoint is for another model shape")


def test_resume_without_checkpoint(data_dir, tmp_path):
    out_dir = tmp_path / "never_ran"
    fails_cleanly(tiny_run_args(data_dir, out_dir, 5, resume=True), "no checkpoint at")
    # nothing but the claim on the folder (run.lock, tests/test_run_folder.py)
    assert not out_dir.exists() or [f.name for f in out_dir.iterdir()] in ([], ["run.lock"])


@pytest.mark.parametrize(
    "change, message",
    [({"n_embd": 64}, "n_embd 32 (now 64)"), ({"block_size": 64}, "block_size 32 (now 64)")],
    ids=["wider", "longer-block"],
)
def test_resume_another_model_shape(change, message, data_dir, earlier_copy):
    before = snapshot(earlier_copy)
    fails_cleanly(tiny_run_args(data_dir, earlier_copy, 5, resume=True, **change), message)
    assert snapshot(earlier_copy) == before


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_resume_damaged_checkpoint(damage, data_dir, earlier_copy):
    out_dir = earlier_copy
    ckpt = out_dir / "ckpt.pt"
    if damage == "truncated":
        with open(ckpt, "r+b") as f:
            f.truncate(ckpt.stat().st_size // 2)
    else:
        ckpt.write_bytes(b"not a checkpoint at all" * 100)
    before = snapshot(out_dir)
    fails_cleanly(
        tiny_run_args(data_dir, out_dir, 5, resume=True), "unreadable, truncated or corrupted"
    )
    assert snapshot(out_dir) == before  # left for the reader to inspect or restore


def test_out_dir_that_is_a_file(data_dir, earlier_copy):
    """--out-dir naming an existing file (an earlier run's metrics.jsonl), or a path under one."""
    out_dir = earlier_copy
    before = snapshot(out_dir)
    fails_cleanly(
        tiny_run_args(data_dir, out_dir / "metrics.jsonl", 5),
        f"{out_dir / 'metrics.jsonl'} is a file, not a folder",
    )
    assert snapshot(out_dir) == before
    from common.config import CourseParser

    # every chapter checks it first
    with pytest.raises(CourseError, match="metrics.jsonl is a file, not a folder"):
        CourseParser(4, "").parse_args(["--out-dir", str(out_dir / "metrics.jsonl" / "run2")])


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--lr", "-1", "must be a finite number, zero or more, got -1"),
        ("--min-lr", "-0.0001", "must be a finite number, zero or more, got -0.0001"),
        ("--weight-decay", "-0.1", "must be a finite number, zero or more, got -0.1"),
        ("--grad-clip", "-1", "must be a finite number, zero or more, got -1"),
        ("--lr", "nan", "must be a finite number, zero or more, got nan"),
        ("--beta1", "-0.9", "must be in [0, 1), got -0.9"),
        ("--beta2", "1.5", "must be in [0, 1), got 1.5"),
    ],
)
def test_optimizer_values_are_checked_before_anything_runs(flag, value, message, capsys):
    """Values AdamW would refuse with a traceback (or train on as nan), in every chapter."""
    from common.config import CourseParser

    for chapter in range(1, 6):
        with pytest.raises(SystemExit) as stop:
            CourseParser(chapter, "").parse_args([flag, value])
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip() == f"error: argument {flag}: {message} (see --help)"


def test_resume_with_another_global_batch_or_seed_is_refused():
    """The data order continues only with the same global batch and seed (checked first)."""
    from common.training import check_resume

    checkpoint = {"train_config": {"global_batch": 8, "seed": 1337}}
    check_resume(checkpoint, 8, 1337)  # e.g. chapter 01 with 8, or 2 ranks x 2 x K=2 in chapter 04
    with pytest.raises(
        CourseError,
        match="trained with global_batch 8, this run has 16; resume with the same batch",
    ):
        check_resume(checkpoint, 16, 1337)
    with pytest.raises(CourseError, match="trained with seed 1337, this run has 7"):
        check_resume(checkpoint, 8, 7)
