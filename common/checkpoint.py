"""ckpt.pt: written atomically, read without unpickling code, holding all a resumed run needs."""

import os
import re
import socket
from dataclasses import asdict
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
from torch.optim import Optimizer

from .model import GPTConfig
from .support.errors import CourseError
from .support.rundir import CKPT_NAME


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names without the prefixes that wrappers add: "module." (DataParallel, DDP) and
    "_orig_mod." (torch.compile)."""
    return {re.sub(r"^((module|_orig_mod)\.)+", "", k): v for k, v in state.items()}


def save_checkpoint(
    out_dir: str | Path,
    *,
    model_state: dict,
    optimizer_state: dict,
    iter_num: int,
    model_config: GPTConfig,
    train_config: dict,
    best_val_loss: float | None = None,
    scaler_state: dict | None = None,
) -> None:
    """Write <out_dir>/ckpt.pt through a temporary file: a crash while it writes leaves the old
    checkpoint intact."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    # the host and the process in the name: no two writers share a temporary file, even across nodes
    tmp = Path(out_dir, f".{CKPT_NAME}.tmp.{socket.gethostname()}.{os.getpid()}")
    # a Path or an object would need unpickling code to read back
    plain = {k: v for k, v in train_config.items() if v is None or isinstance(v, (int, float, str))}
    # the GPUs' generators draw dropout's masks there: a resumed run continues their streams
    gpu_rng = None
    every_gpu_rng = None
    if torch.cuda.is_initialized():
        gpu_rng = torch.cuda.get_rng_state()  # this process's GPU
        every_gpu_rng = torch.cuda.get_rng_state_all()  # chapter 03: one process, every GPU
    checkpoint = {
        "model": clean_state_dict(model_state),
        "optimizer": optimizer_state,
        "iter_num": iter_num,
        "model_config": asdict(model_config),
        "train_config": plain,
        "best_val_loss": best_val_loss,
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": gpu_rng,
        "rng_cuda_all": every_gpu_rng,
        # float16's loss scale: a resumed run must not restart at 65,536
        "scaler": scaler_state or {},
    }
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, tmp.with_name(CKPT_NAME))
    finally:
        tmp.unlink(missing_ok=True)  # after a failure (a full disk): no half-written file left


def load_checkpoint(out_dir_or_file: str | Path) -> dict:
    """Read a checkpoint to the CPU; every way it can be missing or broken is one clear line."""
    path = Path(out_dir_or_file)
    if path.is_dir() or path.suffix != ".pt":
        path = path / CKPT_NAME
    if not path.exists():
        raise CourseError(
            f"no checkpoint at {path}: train first (a run writes one at every evaluation), "
            "or point --out-dir at a run's folder"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load alone is tried: whatever it raises, the file is broken
        reason = (str(err) or type(err).__name__).splitlines()[0][:120]
        raise CourseError(
            f"checkpoint {path} is unreadable, truncated or corrupted ({reason}); "
            "delete it to start over, or restore a good copy"
        ) from None
    required = {"model", "model_config", "iter_num"}
    if not isinstance(checkpoint, dict) or not required.issubset(checkpoint):
        raise CourseError(
            f"{path} is not a checkpoint of this course (it lacks model, model_config or iter_num)"
        )
    return checkpoint


def restore_training_state(checkpoint: dict, optimizer: Optimizer | None, scaler) -> int:
    """Put the optimizer (None: restored already, as chapter 06's shards are), the loss scaler and
    the random generators back; return the step to go on from."""
    if optimizer is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint.get("scaler") and scaler.is_enabled():  # a float32/bf16 run saved an empty one
        scaler.load_state_dict(checkpoint["scaler"])
    torch.set_rng_state(checkpoint["rng_cpu"])
    if torch.cuda.is_available():
        plan = gpu_rng_plan(checkpoint, torch.cuda.device_count(), torch.cuda.current_device())
        for index, state in plan:
            torch.cuda.set_rng_state(state, index)
    return checkpoint["iter_num"]


def gpu_rng_plan(checkpoint: dict, gpus: int, current: int) -> list[tuple[int, torch.Tensor]]:
    """Which saved random state goes back to which GPU: (GPU index, state) pairs, set in order.

    Chapter 03 (one process driving every GPU) saved each GPU's state: each GPU this machine has
    gets its own back. Chapters 04 and 05 (one process per GPU): rank 0 alone saved, the state of
    its own GPU. Every rank seeded its GPU alike and has drawn from it as often as rank 0, so each
    rank's current GPU gets rank 0's state. That pair comes last: on the current GPU it is the one
    that stays. A CPU run saved neither, and nothing is set.
    """
    plan = []
    every_gpu = checkpoint.get("rng_cuda_all")
    if every_gpu is not None:
        plan = list(enumerate(every_gpu[:gpus]))
    saver = checkpoint.get("rng_cuda")
    if saver is not None:
        plan.append((current, saver))
    return plan


def check_same_shape(checkpoint: dict, config: GPTConfig) -> None:
    """Refuse to resume a checkpoint into a model of another shape, naming what differs."""
    saved = checkpoint["model_config"]
    now = asdict(config)
    fields = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "bias")
    differs = [f"{f} {saved[f]} (now {now[f]})" for f in fields if saved[f] != now[f]]
    if differs:
        raise CourseError(
            f"the checkpoint is for another model shape: {', '.join(differs)}; "
            "resume with the same --preset and overrides, or use a new --out-dir"
        )


# ---- chapter 06: ckpt.pt from and into a sharded model (FSDP) -----------------------------------
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
    optimizer_state: dict | None,
) -> None:
    """Fill this rank's shards from rank 0's whole tensors (a fresh model's or ckpt.pt's), which
    rank 0 broadcasts one tensor at a time: each rank keeps its rows of each and frees the rest.

    The other ranks pass empty dicts. Every rank passes None as optimizer_state for a fresh
    optimizer, which then has no state to load."""
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_state, options=from_rank0)
    if optimizer_state is None:
        return
    if dist.get_rank() == 0:
        optimizer_state = optimizer_state_by_name(optimizer_state, model, optimizer)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=from_rank0)


def load_checkpoint_on_rank0(out_dir: str | Path) -> dict:
    """ckpt.pt, read by rank 0 alone: the other ranks get the rest of it (the step, the settings,
    the random state) with empty model and optimizer states, so no rank but rank 0 ever holds the
    whole model. A checkpoint rank 0 cannot read is every rank's error."""
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
    if dist.get_rank() == 0:
        return checkpoint
    return shared[0]


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
