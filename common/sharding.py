"""What chapter 06 measures around FSDP but does not teach: the bytes of state each rank holds,
and the most memory a rank held while it built its shards and took a step.

Every function reads only this rank's tensors or this process's figures: none needs a peer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


def local_and_full_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes this rank stores for `tensor`, and the bytes of the whole tensor."""
    full = tensor.numel() * tensor.element_size()
    if isinstance(tensor, DTensor):  # a shard: its local piece is all this rank stores
        local = tensor.to_local()
        return local.numel() * local.element_size(), full
    return full, full


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Parameter, gradient and optimizer-state bytes: [this rank's, every DDP rank's] for each.

    DDP's figures are the whole tensors, which every DDP rank holds. A gradient has its parameter's
    shape and type (FSDP reduces it to the shard of its parameter), so it is counted from the
    parameter: between steps zero_grad has freed it, and during the step it is as large.
    """
    held = {"parameters": [0, 0], "gradients": [0, 0], "optimizer state": [0, 0]}
    for param in model.parameters():  # each tensor once: a tied matrix counts once
        local, full = local_and_full_bytes(param)
        for kind in ("parameters", "gradients"):
            held[kind][0] += local
            held[kind][1] += full
    for state in optimizer.state.values():  # AdamW: exp_avg and exp_avg_sq per parameter, and step
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local, full = local_and_full_bytes(value)
                held["optimizer state"][0] += local
                held["optimizer state"][1] += full
    return held


def describe_held_bytes(held: dict[str, list[int]]) -> str:
    """One line: what this rank holds, against what a DDP rank holds, in MB (10^6 bytes)."""
    parts = [
        f"{kind} {mine / 1e6:.2f} MB (DDP {ddp / 1e6:.2f})" for kind, (mine, ddp) in held.items()
    ]
    mine = sum(pair[0] for pair in held.values())
    ddp = sum(pair[1] for pair in held.values())
    return f"holds {', '.join(parts)}: {mine / 1e6:.2f} MB of DDP's {ddp / 1e6:.2f} MB"


def _proc_status_mb(field: str) -> float:
    """A memory figure of this process from Linux's /proc/self/status, in MB (10^6 bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024 / 1e6  # the kernel counts in KiB
    raise RuntimeError(f"/proc/self/status has no {field}")


def start_peak_memory(device: torch.device) -> float:
    """Forget the peak so far and return the memory held now, in MB: on a GPU the tensors' bytes
    there, on the CPU the process's resident memory (Linux: /proc/self/status)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 1e6
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident memory
    return _proc_status_mb("VmRSS")


def peak_memory(device: torch.device) -> float:
    """The most memory held at any moment since start_peak_memory, in MB, counted as it counts."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    return _proc_status_mb("VmHWM")
