"""The bare training step: forward + backward + clip + AdamW of the course model, nothing else.

    python -m bench.bare_step --preset small --batch-size 8 --iters 30 --warmup 5 --out bare.json

The reference a chapter's step is divided by: chapter 01's model, optimizer and clipping on
windows of the corpus already on the device (no DataLoader, schedule, logging or evaluation). The
median of groups of --group steps after --warmup steps, in wall and CPU milliseconds per step (the
process's CPU time, all threads, which a shared machine disturbs less).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import RandomSampler

from common.data import batch_loader, load_splits, prepare
from common.device import autocast_context, pick_device, pick_dtype, setup_math
from common.model import GPT, PRESETS, model_config


def clocks(device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the GPU's queued work belongs to the steps
    return time.perf_counter(), time.process_time()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="small")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--iters", type=int, default=30, help="steps, the warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    p.add_argument("--group", type=int, default=5, help="steps per timed group")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.iters <= args.warmup:
        p.error("--warmup must be at least 1, and --iters larger than --warmup")

    torch.manual_seed(1337)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    setup_math(device)
    autocast = autocast_context(device, dtype)
    if dtype == torch.float32:
        autocast = contextlib.nullcontext()
    config = model_config(args.preset, dropout=0.0)
    train_set, _ = load_splits(
        prepare("shakespeare", args.data_dir, log=lambda *a: None), config.block_size
    )
    # random windows, drawn with replacement so that a tiny corpus serves a big batch
    sampler = RandomSampler(train_set, replacement=True, num_samples=args.iters * args.batch_size)
    batches = [
        (x.to(device), y.to(device)) for x, y in batch_loader(train_set, sampler, args.batch_size)
    ]

    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(
        model.optimizer_groups(0.1), lr=2e-3, betas=(0.9, 0.99), fused=device.type == "cuda"
    )
    # float16 needs a GradScaler; for other dtypes it is disabled and does nothing
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    step_model = model
    if args.compile:
        step_model = torch.compile(model)
    model.train()

    wall_ms = []
    cpu_ms = []
    start = 0
    while start < args.iters:
        group = args.warmup if start == 0 else min(args.group, args.iters - start)
        wall, cpu = clocks(device)
        for x, y in batches[start : start + group]:
            with autocast:
                _, loss = step_model(x, y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        wall_end, cpu_end = clocks(device)
        if start > 0:  # the first group is the warm-up
            wall_ms.append(1000 * (wall_end - wall) / group)
            cpu_ms.append(1000 * (cpu_end - cpu) / group)
        start += group

    result = {
        "preset": args.preset,
        "batch_size": args.batch_size,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "compile": args.compile,
        "step_ms": statistics.median(wall_ms),
        "group_ms": [round(ms, 3) for ms in wall_ms],
        "step_cpu_ms": statistics.median(cpu_ms),
        "final_loss": loss.item(),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"bare step: {result['step_ms']:.1f} ms (median of {len(wall_ms)} groups of {args.group} "
        f"steps; {args.preset}, batch {args.batch_size}, {result['threads']} threads, {device})"
    )


if __name__ == "__main__":
    main()
