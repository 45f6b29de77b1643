"""Plain helpers the tests share: the flags of a tiny run, and a snapshot of a run folder."""

from __future__ import annotations

from pathlib import Path


def snapshot(folder: Path) -> dict:
    """Every file of a folder with its modification time and bytes: to show a run left them alone."""
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def tiny_run_args(data_dir: Path, out_dir: Path, max_iters: int = 10, **flags) -> list[str]:
    """Flags for a short, deterministic CPU run of any chapter with the tiny model.

    Extra flags are given as keyword arguments: batch_size=4 -> --batch-size 4; True -> a bare flag.
    """
    args = [
        "--preset",
        "tiny",
        "--max-iters",
        max_iters,
        "--log-interval",
        1,
        "--eval-interval",
        max_iters,
        "--eval-batches",
        2,
        "--sample-tokens",
        0,
        "--dropout",
        0,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--data-dir",
        data_dir,
        "--out-dir",
        out_dir,
    ]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [flag, value]
    return [str(a) for a in args]
