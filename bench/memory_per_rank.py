"""What one rank holds under DDP, ZeRO-1 and FSDP: parameters, gradients and AdamW's state.

    python -m bench.memory_per_rank                # tiny and small measured, gpt2 counted, 2 ranks

`tiny` and `small` are measured: chapter 07 trains each for 2 steps on 2 ranks (CPU, float32) and
every rank prints the bytes it holds and a DDP rank's (common/sharding.py). `gpt2` is counted from
the parameters' shapes, as FSDP2 cuts them: each tensor's rows in W pieces of ceil(rows / W), the
last ones shorter. ZeRO-1 holds DDP's parameters and gradients and FSDP's optimizer-state shard.
Figures in MB (10^6 bytes), float32 (4 bytes a number) as the optimizer keeps them.
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import torch

from common.data import prepare
from common.model import GPT, model_config
from tools.launch import REPO, flags, run_torchrun

WORLD = 2
HOLDS = re.compile(
    r"rank (\d) local \d\] holds parameters ([\d.]+) MB \(DDP ([\d.]+)\), gradients ([\d.]+) MB "
    r"\(DDP ([\d.]+)\), optimizer state ([\d.]+) MB \(DDP ([\d.]+)\): ([\d.]+) MB of DDP's "
    r"([\d.]+) MB"
)


def measured(preset: str, data_dir: Path, out_dir: Path) -> dict[str, list[float]]:
    """Rank 0's figures of a 2-step run: kind -> [FSDP rank 0, DDP]."""
    args = flags(
        preset=preset,
        device="cpu",
        dtype="float32",
        max_iters=2,
        batch_size=2,
        eval_interval=2,
        eval_batches=1,
        sample_tokens=0,
        data_dir=data_dir,
        out_dir=out_dir,
    )
    proc = run_torchrun(REPO / "07_fsdp" / "train.py", WORLD, args, timeout=900)
    rank0 = next(m for m in HOLDS.finditer(proc.stdout) if m.group(1) == "0")
    numbers = [float(x) for x in rank0.groups()[1:]]
    return {
        "parameters": numbers[0:2],
        "gradients": numbers[2:4],
        "optimizer state": numbers[4:6],
        "total": numbers[6:8],
    }


def counted(preset: str) -> dict[str, list[float]]:
    """The same figures counted from the shapes (on the meta device: no memory, no training)."""
    with torch.device("meta"):
        model = GPT(model_config(preset))
    mine = 0
    full = 0
    for param in model.parameters():
        rows = param.shape[0]
        per_row = param.numel() // rows
        piece = math.ceil(rows / WORLD)
        mine += min(piece, rows) * per_row * 4  # rank 0's piece
        full += param.numel() * 4
    tensors = len(list(model.parameters()))
    # AdamW: two averages per number, and a 4-byte step count per parameter tensor on every rank
    state_mine = 2 * mine + 4 * tensors
    state_full = 2 * full + 4 * tensors
    return {
        "parameters": [mine / 1e6, full / 1e6],
        "gradients": [mine / 1e6, full / 1e6],
        "optimizer state": [state_mine / 1e6, state_full / 1e6],
        "total": [(2 * mine + state_mine) / 1e6, (2 * full + state_full) / 1e6],
    }


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare("shakespeare", data_dir, log=lambda *a: None)
        for preset in ("tiny", "small", "gpt2"):
            if preset == "gpt2":
                held = counted(preset)
                how = "counted"
            else:
                held = measured(preset, data_dir, Path(tmp) / preset)
                how = "measured"
            params = held["parameters"]
            grads = held["gradients"]
            state = held["optimizer state"]
            fsdp = held["total"][0]
            ddp = held["total"][1]
            zero1 = params[1] + grads[1] + state[0]
            cells = [f"{figure:,.2f} MB" for figure in (params[1], ddp, zero1, fsdp)]
            rows.append(f"| `{preset}` ({how}) | {' | '.join(cells)} |")
    print(f"per rank, {WORLD} ranks; FSDP and ZeRO-1: rank 0")
    print("| model | parameters (DDP) | DDP | ZeRO-1 | FSDP |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
