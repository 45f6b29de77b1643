"""The pieces of a run around the loop that each chapter writes out: the model, the schedule, the
guards, the evaluation."""

import argparse
import contextlib
import math

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from .checkpoint import check_same_shape, load_checkpoint
from .dataparallel import mean_of_replicas
from .model import GPT, GPTConfig
from .support.errors import CourseError
from .tokenizer import decode, encode


def build_model(config: GPTConfig, init_from: str, checkpoint: dict | None) -> GPT:
    """A fresh model, a checkpoint's to resume, or the weights of another run's (or GPT-2's, which
    `python -m common.gpt2` writes as a checkpoint) to start from; the same shape in both cases."""
    model = GPT(config)
    if checkpoint is None and init_from != "scratch":
        checkpoint = load_checkpoint(init_from)
    if checkpoint is not None:
        check_same_shape(checkpoint, config)
        model.load_state_dict(checkpoint["model"])
    return model


def check_resume(checkpoint: dict, global_batch: int, seed: int) -> None:
    """A resumed run continues the data order only with the same global batch and seed."""
    saved = checkpoint.get("train_config", {})
    for name, now in (("global_batch", global_batch), ("seed", seed)):
        if name in saved and saved[name] != now:
            raise CourseError(
                f"the checkpoint was trained with {name} {saved[name]}, this run has {now}; "
                "resume with the same batch settings and --seed so the data order continues"
            )


def check_same_flags(checkpoint: dict, args: argparse.Namespace, names: list[str]) -> None:
    """A resumed run goes on with the settings it was trained with: one line names the first flag
    of `names` whose value differs from the checkpoint's."""
    saved = checkpoint.get("train_config", {})
    for name in names:
        now = getattr(args, name)
        if name in saved and saved[name] != now:
            flag = "--" + name.replace("_", "-")
            raise CourseError(
                f"the checkpoint was trained with {flag} {saved[name]}, this run has {flag} "
                f"{now}: resume with the same {flag}, or start a new run in a new --out-dir"
            )


def lr_at(iteration: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then cosine decay to --min-lr over --lr-decay-iters steps."""
    if iteration < args.warmup_iters:
        return args.lr * (iteration + 1) / (args.warmup_iters + 1)
    if iteration >= args.lr_decay_iters:
        return args.min_lr
    # here warmup_iters <= iteration < lr_decay_iters: the span is at least one step
    progress = (iteration - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def check_finite(step: int, loss: float, what: str = "training loss") -> None:
    """Stop with one line when `loss` is NaN or infinite: the run has diverged. Checked before any
    checkpoint is written, so a diverged model never replaces the last good checkpoint."""
    if math.isfinite(loss):
        return
    raise CourseError(
        f"the run diverged at step {step}: {what} {loss}; no checkpoint was written from it "
        "(the last one, if any, is intact); try a lower --lr or --dtype float32, "
        "with --resume to continue from the checkpoint"
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset: Dataset,
    windows: list[int],
    batch_size: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager | None = None,
) -> torch.Tensor:
    """Mean loss over the given windows, as a 0-dim tensor on `device` (no host sync here)."""
    if autocast is None:  # chapter 07: FSDP casts the parameters itself (MixedPrecisionPolicy)
        autocast = contextlib.nullcontext()
    model.eval()
    total = torch.zeros((), device=device)
    for x, y in DataLoader(Subset(dataset, windows), batch_size=batch_size):
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with autocast:
            _, loss = model(x, y)
        # DataParallel (chapter 03) returns one loss per GPU: their mean, where it is the batch's
        total += mean_of_replicas(loss, len(x)).to(total.dtype) * len(x)
    model.train()  # every caller goes on training
    return total / len(windows)


def sample_text(
    model: GPT,
    prompt: str,
    max_new_tokens: int,
    device: torch.device,
    temperature: float = 0.8,
    top_k: int = 200,
    seed: int = 1337,
) -> str:
    """Text the model writes after `prompt` (seeded, so the same weights give the same text)."""
    context = torch.tensor([encode(prompt) or [50256]], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    model.eval()  # no dropout; its callers train no more after it
    out = model.generate(
        context, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator
    )
    return decode(out[0].tolist())
