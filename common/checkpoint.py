"""ckpt.pt: written atomically, read without unpickling code, holding all a resumed run needs."""

import os
import re
import socket
from dataclasses import asdict
from pathlib import Path

import torch
from torch.optim import Optimizer

from .model import GPT, GPTConfig
from .support.errors import CourseError
from .support.rundir import CKPT_NAME


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names without the prefixes that wrappers add: "module." (DataParallel, DDP) and
    "_orig_mod." (torch.compile)."""
    return {re.sub(r"^((module|_orig_mod)\.)+", "", k): v for k, v in state.items()}


def save_checkpoint(
    out_dir: str | Path,
    iter_num: int,
    model: GPT,
    optimizer: Optimizer,
    scaler: torch.amp.GradScaler,
    train_config: dict,
    more: dict | None = None,
) -> None:
    """<out_dir>/ckpt.pt after step `iter_num`: all a resumed run needs (the model's weights and
    shape, AdamW's averages, the loss scale, the random state and the run's settings), and `more`
    that a chapter needs besides (chapter 08: every rank's own copy)."""
    write_checkpoint(
        out_dir,
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        iter_num=iter_num,
        model_config=model.config,
        train_config=train_config,
        scaler_state=scaler.state_dict(),
        more=more,
    )


def write_checkpoint(
    out_dir: str | Path,
    *,
    model_state: dict,
    optimizer_state: dict,
    iter_num: int,
    model_config: GPTConfig,
    train_config: dict,
    scaler_state: dict | None = None,
    more: dict | None = None,
) -> None:
    """Write <out_dir>/ckpt.pt through a temporary file: a crash while it writes leaves the old
    checkpoint intact."""
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
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": gpu_rng,
        "rng_cuda_all": every_gpu_rng,
        # float16's loss scale: a resumed run must not restart at 65,536
        "scaler": scaler_state or {},
        **(more or {}),
    }
    save_atomically(checkpoint, Path(out_dir) / CKPT_NAME)


def save_atomically(state: dict, path: Path) -> None:
    """torch.save(state) to `path` through a temporary file: a crash while it writes leaves the old
    file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)  # a node's folder that only its ranks write
    # the host and the process in the name: no two writers share a temporary file, even across nodes
    tmp = path.with_name(f".{path.name}.tmp.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
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
    """Put the optimizer (None: restored already, as chapter 07's shards are), the loss scaler and
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
    """Refuse a checkpoint (to resume or to start from) made by a model of another shape: one line
    names what differs."""
    saved = checkpoint["model_config"]
    now = asdict(config)
    fields = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "bias")
    differs = [f"{f} {saved[f]} (now {now[f]})" for f in fields if saved[f] != now[f]]
    if differs:
        raise CourseError(
            f"the checkpoint is for another model shape: {', '.join(differs)}; "
            "use the --preset and size overrides it was made with (a new run: a new --out-dir)"
        )
