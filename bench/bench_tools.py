"""What the measuring scripts of bench/ share: their parser, chapter 01's optimizer and update, a
result file.

Imported after the script has put the repository on sys.path (for `common`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common.model import PRESETS


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser, described by the first paragraph of its docstring, with --preset (the
    model)."""
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
    """The result as JSON at `path`, its folder made if missing; nothing when no path was asked for."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1) + "\n")
