"""What chapter 06 needs around FSDP but does not teach: the bytes each rank holds, the optimizer
state in the layout of every chapter's ckpt.pt, and a sharded checkpoint folder put in place whole.

The functions that take a model or an optimizer read only this rank's tensors: they need no peer.
sharded_checkpoint_folder is a collective: every rank enters it, in the same order.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# The folder of a sharded checkpoint (--sharded-checkpoint), inside --out-dir: one file of shards
# per rank that wrote it, the layout that reads them back, and a ckpt.pt without model or optimizer.
SHARDED_NAME = "ckpt_sharded"


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


def optimizer_state_by_index(state: dict) -> dict:
    """An optimizer state keyed by parameter names (torch.distributed.checkpoint's layout) in the
    layout of optimizer.state_dict(): parameters numbered 0, 1, 2, ... through the groups in
    order. That is what ckpt.pt holds: chapters 01 to 05 load it with optimizer.load_state_dict."""
    index_of = {}
    groups = []
    for group in state.get("param_groups", []):  # rank 0's; the other ranks' are empty
        numbers = []
        for name in group["params"]:
            index_of[name] = len(index_of)
            numbers.append(index_of[name])
        groups.append(group | {"params": numbers})
    per_param = {index_of[name]: value for name, value in state.get("state", {}).items()}
    return {"state": per_param, "param_groups": groups}


def optimizer_state_by_name(
    state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    """The inverse of optimizer_state_by_index: ckpt.pt's numbered optimizer state keyed by the
    names of this optimizer's parameters, as set_optimizer_state_dict reads it."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    names = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    groups = []
    for group in state["param_groups"]:
        groups.append(group | {"params": [names[index] for index in group["params"]]})
    per_param = {names[index]: value for index, value in state["state"].items()}
    return {"state": per_param, "param_groups": groups}


@contextlib.contextmanager
def sharded_checkpoint_folder(out_dir: Path):
    """A new, empty folder for every rank to write its shards into; put in place of
    <out_dir>/ckpt_sharded only once every rank has finished writing.

    The old checkpoint is moved aside first and deleted last, so a crash at any moment leaves a
    whole checkpoint: the old one, the new one, or (between the two renames) the new one under its
    temporary name and the old one under `.ckpt_sharded.old`. A failure inside the block leaves the
    old one in place."""
    final = Path(out_dir) / SHARDED_NAME
    tmp = final.with_name(f".{SHARDED_NAME}.tmp")
    old = final.with_name(f".{SHARDED_NAME}.old")
    is_rank0 = dist.get_rank() == 0
    if is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left
        tmp.mkdir(parents=True)
    dist.barrier()  # the folder exists and is empty before anyone writes into it
    yield tmp
    dist.barrier()  # every rank's shards are written
    if is_rank0:
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # no rank goes on (and perhaps saves again) before the new one is in place
