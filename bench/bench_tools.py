"""What the measuring scripts of bench/ share: their parser, chapter 01's optimizer and update,
a result file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from common.model import PRESETS


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: the first paragraph of the script's docstring as its description, and
    --preset for the model's size."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    return p


def adamw(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    """Chapter 01's optimizer: AdamW with weight decay on the matrices only, fused on CUDA."""
    return torch.optim.AdamW(
        model.optimizer_groups(0.1), lr=lr, betas=(0.9, 0.99), fused=device.type == "cuda"
    )


def update(loss: torch.Tensor, model: torch.nn.Module, optimizer, scaler, grad_clip: float) -> None:
    """Chapter 01's update after a forward pass: backward, gradient clipping, optimizer step.

    The scaler is the GradScaler float16 needs (disabled for other dtypes, where it does nothing).
    """
    scaler.scale(loss).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def write_result(path: str | Path | None, result: dict) -> None:
    """The result as JSON at `path`, its folder made if missing; nothing when no path is given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def _children() -> list[int]:
    """The process ids of this process's children (Linux: /proc; elsewhere none are found)."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def _running(pid: int) -> bool:
    """Whether `pid` still runs (an exited child that nobody has waited for yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # the state comes after the command's name, which is in parentheses and may hold spaces
    state = stat.rpartition(")")[2].split()[0]
    return state != "Z"


def stop_children_on_sigterm(grace: float = 5) -> None:
    """On SIGTERM, stop every run this process started, then exit with status 143.

    The runs are started in sessions of their own (tools/launch.py), so a SIGTERM sent to this
    process alone, as `timeout` sends it, would leave them running. Each child's whole process group
    gets the SIGTERM (torchrun's workers and a compile's worker processes included), has `grace`
    seconds to end, and is then killed. Exiting through SystemExit also runs the `finally` blocks
    that wait for the runs."""

    def stop(signum: int, frame) -> None:
        groups = _children()
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(_running(pid) for pid in groups) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        print(f"stopped by SIGTERM: {len(groups)} run(s) stopped", file=sys.stderr, flush=True)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
