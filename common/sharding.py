"""Chapter 07's ckpt.pt from and into a sharded model (load_checkpoint_on_rank0, shard_full_state,
gather_and_save: collectives, every rank calls them), and what the chapter measures but does not
teach: the bytes of state each rank holds, and the most memory a rank held while it built its
shards and took a step (these read only this rank's tensors or this process's figures).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from .checkpoint import check_same_shape, load_checkpoint, write_checkpoint
from .model import GPTConfig
from .support.errors import CourseError


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


def describe_held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """One line: what this rank holds, against what a DDP rank holds, in MB (10^6 bytes)."""
    held = held_bytes(model, optimizer)
    parts = [
        f"{kind} {mine / 1e6:.2f} MB (DDP {ddp / 1e6:.2f})" for kind, (mine, ddp) in held.items()
    ]
    mine = sum(pair[0] for pair in held.values())
    ddp = sum(pair[1] for pair in held.values())
    return f"holds {', '.join(parts)}: {mine / 1e6:.2f} MB of DDP's {ddp / 1e6:.2f} MB"


def _proc_status_mb(proc: Path, field: str) -> float:
    """A memory figure of this process from Linux's /proc/self/status, in MB (10^6 bytes)."""
    for line in (proc / "status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024 / 1e6  # the kernel counts in KiB
    raise RuntimeError(f"{proc}/status has no {field}")


class PeakMemory:
    """The most memory this rank held since it was made, above what it held then, in MB: on a GPU
    the tensors' bytes there, on the CPU the process's resident memory (Linux's /proc/self).

    Where the CPU's figure cannot be read (macOS and the BSDs have no /proc), it says so in one
    line and reads nan: the run goes on without it."""

    def __init__(self, device: torch.device, proc: Path = Path("/proc/self")):
        self.device = device
        self.proc = proc
        self.before = float("nan")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.before = torch.cuda.memory_allocated(device) / 1e6
            return
        try:
            (proc / "clear_refs").write_text("5")  # resets VmHWM, the peak resident memory
        except OSError as err:
            print(
                f"peak memory: cannot measure it here ({proc / 'clear_refs'}: {err.strerror}), "
                "so its figures read nan; the run goes on",
                file=sys.stderr,
                flush=True,
            )
            return
        self.before = _proc_status_mb(proc, "VmRSS")

    def since_start(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e6 - self.before
        if math.isnan(self.before):  # not measurable here
            return self.before
        return _proc_status_mb(self.proc, "VmHWM") - self.before


# ---- ckpt.pt from and into a sharded model (FSDP) ---------------------------------------------
# Every rank holds a shard of every tensor, so every rank takes part in both directions. Rank 0
# alone holds the whole tensors, in CPU memory; the optimizer state is numbered as chapter 01's
# optimizer.state_dict() numbers it, so that every chapter reads the same ckpt.pt.


def gather_full_state(model: torch.nn.Module, optimizer: Optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's whole tensors, gathered from every rank's shards into rank
    0's CPU memory one tensor at a time, as ckpt.pt holds them; the other ranks get empty dicts."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=full)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=full)
    return model_state, optimizer_state_by_index(optimizer_state)


def shard_full_state(
    model: torch.nn.Module,
    optimizer: Optimizer,
    model_state: dict,
    checkpoint: dict | None,
) -> None:
    """Fill this rank's shards from rank 0's whole tensors (a fresh model's, or ckpt.pt's and its
    optimizer state), which rank 0 broadcasts one tensor at a time: each rank keeps its rows of each
    and frees the rest.

    The other ranks pass an empty model_state. Every rank passes the checkpoint it has, or None for
    a fresh run, whose optimizer has no state to load."""
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_state, options=from_rank0)
    if checkpoint is None:
        return
    optimizer_state = checkpoint["optimizer"]  # rank 0's; the other ranks' is empty
    if dist.get_rank() == 0:
        optimizer_state = optimizer_state_by_name(optimizer_state, model, optimizer)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=from_rank0)


def load_checkpoint_on_rank0(out_dir: str | Path, config: GPTConfig) -> dict:
    """ckpt.pt, read by rank 0 alone: the other ranks get the rest of it (the step, the settings,
    the random state) with empty model and optimizer states, so no rank but rank 0 ever holds the
    whole model. A checkpoint rank 0 cannot read, or one of another shape than `config`, is every
    rank's error."""
    shared = [None]
    if dist.get_rank() == 0:
        try:
            checkpoint = load_checkpoint(out_dir)
            rest = {k: v for k, v in checkpoint.items() if k not in ("model", "optimizer")}
            shared = [rest | {"model": {}, "optimizer": {}}]
        except CourseError as err:
            shared = [str(err)]
    dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], str):
        raise CourseError(shared[0])
    check_same_shape(shared[0], config)
    if dist.get_rank() == 0:
        return checkpoint
    return shared[0]


def gather_and_save(
    out_dir: str | Path,
    iter_num: int,
    model: torch.nn.Module,
    optimizer: Optimizer,
    scaler,
    train_config: dict,
) -> None:
    """ckpt.pt from a sharded model, as every chapter writes it: the whole tensors, gathered into
    rank 0's CPU memory one tensor at a time, and rank 0 writes them (save_checkpoint's file)."""
    model_state, optimizer_state = gather_full_state(model, optimizer)
    if dist.get_rank() == 0:  # the others' dicts are empty
        write_checkpoint(
            out_dir,
            model_state=model_state,
            optimizer_state=optimizer_state,
            iter_num=iter_num,
            model_config=model.config,
            train_config=train_config,
            scaler_state=scaler.state_dict(),
        )


def optimizer_state_by_index(state: dict) -> dict:
    """An optimizer state keyed by parameter names (torch.distributed.checkpoint's layout) in the
    layout of optimizer.state_dict(): parameters numbered 0, 1, 2, ... through the groups in
    order. That is what ckpt.pt holds: chapters 01 to 05 load it with optimizer.load_state_dict.
    """
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


def optimizer_state_by_name(state: dict, model: torch.nn.Module, optimizer: Optimizer) -> dict:
    """The inverse of optimizer_state_by_index: ckpt.pt's numbered optimizer state keyed by the
    names of this optimizer's parameters, as set_optimizer_state_dict reads it."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    names = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    groups = []
    for group in state["param_groups"]:
        groups.append(group | {"params": [names[index] for index in group["params"]]})
    per_param = {names[index]: value for index, value in state["state"].items()}
    return {"state": per_param, "param_groups": groups}
