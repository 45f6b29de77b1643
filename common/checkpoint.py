"""ckpt.pt: written atomically, read without unpickling code, holding all a resumed run needs to go
on."""

import os
import re
import socket
from dataclasses import asdict
from pathlib import Path

import torch

from .model import GPTConfig
from .support.errors import CourseError
from .support.rundir import CKPT_NAME as CKPT_NAME  # the run folder's file names live there


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names without the prefixes wrappers add: "module." (DataParallel, DDP), "_orig_mod."
    (compile)."""
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
    """Write <out_dir>/ckpt.pt through a temporary file: a crash mid-write leaves the old one
    intact."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    # the host and the process in the name: no two writers share a temporary file, even across nodes
    tmp = Path(out_dir, f".{CKPT_NAME}.tmp.{socket.gethostname()}.{os.getpid()}")
    cuda = torch.cuda.is_initialized()
    plain = {k: v for k, v in train_config.items() if v is None or isinstance(v, (int, float, str))}
    checkpoint = {
        "model": clean_state_dict(model_state),
        "optimizer": optimizer_state,
        "iter_num": iter_num,
        "model_config": asdict(model_config),
        "train_config": plain,  # a Path or an object would need unpickling code
        "best_val_loss": best_val_loss,
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state() if cuda else None,  # GPU dropout draws from it
        "rng_cuda_all": torch.cuda.get_rng_state_all() if cuda else None,  # chapter 03: every GPU's
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
    path = path / CKPT_NAME if path.is_dir() or path.suffix != ".pt" else path
    if not path.exists():
        raise CourseError(
            f"no checkpoint at {path}: train first (a run writes one at every evaluation), "
            "or point --out-dir at a run's folder"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load alone is tried: whatever it raises, the file is broken
        reason = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        raise CourseError(
            f"checkpoint {path} is unreadable, truncated or corrupted ({reason}); "
            "delete it to start over, or restore a good copy"
        ) from None
    if (
        not isinstance(checkpoint, dict)
        or not {"model", "model_config", "iter_num"} <= checkpoint.keys()
    ):
        raise CourseError(
            f"{path} is not a checkpoint of this course (it lacks model, model_config or iter_num)"
        )
    return checkpoint


def restore_training_state(checkpoint: dict, optimizer: torch.optim.Optimizer, scaler) -> int:
    """Put the optimizer, the loss scaler and the random generators back; returns the step to go on
    from."""
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint.get("scaler") and scaler.is_enabled():  # a float32/bf16 run saved an empty one
        scaler.load_state_dict(checkpoint["scaler"])
    torch.set_rng_state(checkpoint["rng_cpu"])
    if torch.cuda.is_available():
        for index, state in gpu_rng_plan(
            checkpoint, torch.cuda.device_count(), torch.cuda.current_device()
        ):
            torch.cuda.set_rng_state(state, index)
    return checkpoint["iter_num"]


def gpu_rng_plan(checkpoint: dict, gpus: int, current: int) -> list[tuple[int, torch.Tensor]]:
    """(GPU, saved state) to set in order: each GPU its own (chapter 03), then the current GPU the
    saver's."""
    # DDP: rank 0 alone saved its GPU's state, and every rank's GPU has drawn as often from the same
    # seed
    saver = [(current, checkpoint["rng_cuda"])] if checkpoint.get("rng_cuda") is not None else []
    return list(enumerate(checkpoint.get("rng_cuda_all") or []))[:gpus] + saver


def check_same_shape(checkpoint: dict, config: GPTConfig) -> None:
    """Refuse to resume a checkpoint into a model of another shape, naming what differs."""
    saved, now = checkpoint["model_config"], asdict(config)
    fields = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "bias")
    differs = [f"{f} {saved[f]} (now {now[f]})" for f in fields if saved[f] != now[f]]
    if differs:
        raise CourseError(
            f"the checkpoint is for another model shape: {', '.join(differs)}; "
            "resume with the same --preset and overrides, or use a new --out-dir"
        )
