"""ckpt.pt: written atomically, read without unpickling code (plain tensors and values only),
loadable by every chapter; with the random state, a resumed run continues the very same run."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch

from .model import GPTConfig
from .support.errors import CourseError

CKPT_NAME = "ckpt.pt"


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names without the prefixes wrappers add: "module." (DataParallel, DDP), "_orig_mod." (compile)."""
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
) -> Path:
    """Write <out_dir>/ckpt.pt through a temporary file: a crash mid-write leaves the old one intact."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CKPT_NAME
    tmp = out_dir / f".{CKPT_NAME}.tmp.{os.getpid()}"
    checkpoint = {
        "model": clean_state_dict(model_state),
        "optimizer": optimizer_state,
        "iter_num": iter_num,
        "model_config": asdict(model_config),
        "train_config": {
            k: v for k, v in train_config.items() if isinstance(v, (int, float, str, bool, type(None)))
        },
        "best_val_loss": best_val_loss,
        "rng_cpu": torch.get_rng_state(),
        # the current GPU's generator, where this process has used CUDA (dropout on the GPU draws from it)
        "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        # and every visible GPU's: chapter 03's replicas draw their dropout masks on their own GPUs
        "rng_cuda_all": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        # float16's loss scale, grown and cut during training: a resumed run must not restart at 65,536
        "scaler": scaler_state or {},
    }
    with open(tmp, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    os.replace(tmp, path)
    return path


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
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, ValueError) as err:
        reason = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        raise CourseError(
            f"checkpoint {path} is unreadable, truncated or corrupted ({reason}); "
            "delete it to start over, or restore a good copy"
        ) from None
    if not isinstance(checkpoint, dict) or not {"model", "model_config", "iter_num"} <= checkpoint.keys():
        raise CourseError(
            f"{path} is not a checkpoint of this course (it lacks model, model_config or iter_num)"
        )
    return checkpoint


def restore_training_state(
    checkpoint: dict, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> int:
    """Put the optimizer, the loss scaler and the random generators back where the checkpoint left
    them, so the run continues as if it had never stopped; returns the step to continue from."""
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint.get("scaler") and scaler.is_enabled():  # a float32/bf16 run saved an empty one
        scaler.load_state_dict(checkpoint["scaler"])
    torch.set_rng_state(checkpoint["rng_cpu"])
    if torch.cuda.is_available():  # the current GPU: each chapter has set it
        for index, state in gpu_rng_plan(checkpoint, torch.cuda.device_count(), torch.cuda.current_device()):
            torch.cuda.set_rng_state(state, index)
    return checkpoint["iter_num"]


def gpu_rng_plan(checkpoint: dict, gpus: int, current: int) -> list[tuple[int, torch.Tensor]]:
    """The saved GPU random states to set, as (GPU index, state) in order, for a process that sees
    `gpus` GPUs and computes on GPU `current`.

    Every GPU gets the state saved for the GPU of its number (chapter 03's replicas, one process
    driving all GPUs), as far as both runs have it. Then the current GPU gets the saving process's
    current GPU's state: under DDP rank 0 alone saves, and in its process only its own GPU's
    generator has drawn; every rank's GPU has drawn just as often from the same seed, so its state
    is the one each rank continues from. A checkpoint of a CPU run has none: nothing is set.
    """
    plan = list(enumerate(checkpoint.get("rng_cuda_all") or []))[:gpus]
    if checkpoint.get("rng_cuda") is not None:
        plan.append((current, checkpoint["rng_cuda"]))
    return plan


def checkpoint_model_config(checkpoint: dict) -> GPTConfig:
    return GPTConfig(**checkpoint["model_config"])


def check_same_shape(checkpoint: dict, config: GPTConfig) -> None:
    """Refuse to resume a checkpoint into a model of another shape, naming what differs."""
    saved = checkpoint_model_config(checkpoint)
    fields = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "bias")
    differs = [
        f"{f} {getattr(saved, f)} (now {getattr(config, f)})"
        for f in fields
        if getattr(saved, f) != getattr(config, f)
    ]
    if differs:
        raise CourseError(
            f"the checkpoint is for another model shape: {', '.join(differs)}; "
            "resume with the same --preset and overrides, or use a new --out-dir"
        )
