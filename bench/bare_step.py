"""The bare training step: forward + backward + clip + optimizer step of the course model,
nothing else.

    python -m bench.bare_step --preset small --batch-size 8 --iters 30 --warmup 5 --out bare.json

The reference a chapter's step time is divided by. Same model, initialisation, optimizer and
micro-batch as chapter 01 (built with `common`), fed the batches chapter 01 would read, but all
built and moved to the device before the clock starts: no DataLoader, no learning-rate schedule,
no logging, no `.item()`, no evaluation. bench/step_timer.py times it as the chapters time their
steps (wall time over groups of --group steps, after --warmup steps) and reports the median group,
and the CPU time of the process (all its threads) per step, which a shared machine disturbs less.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import resource

import torch
from torch.utils.data import RandomSampler

from bench import bench_tools
from bench.step_timer import StepTimer, schedule
from common.data import batch_loader, load_splits, prepare
from common.device import autocast_context, pick_device, pick_dtype, setup_math
from common.model import GPT, model_config


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_tools.parser(__doc__)
    p.add_argument("--n-layer", type=int, default=None, help="override the preset's layers")
    p.add_argument("--n-embd", type=int, default=None, help="override the preset's width")
    p.add_argument(
        "--chunked-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the model's chunked output layer + loss; --no-chunked-loss: the plain one",
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--iters", type=int, default=30, help="steps timed, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    p.add_argument(
        "--group", type=int, default=5, help="steps per timed group (the chapters' --log-interval)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.iters <= args.warmup:
        p.error("--iters must be larger than --warmup")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    setup_math(device)
    autocast = autocast_context(device, dtype)
    config = model_config(
        args.preset,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        dropout=0.0,
        chunked_loss=args.chunked_loss,
    )

    # chapter 01's first batches, all in device memory before timing starts
    train_set, _ = load_splits(
        prepare("shakespeare", args.data_dir, log=lambda *a: None), config.block_size
    )
    order = torch.Generator().manual_seed(args.seed)
    loader = iter(
        batch_loader(train_set, RandomSampler(train_set, generator=order), args.batch_size)
    )
    batches = []
    for _ in range(args.iters):
        try:
            x, y = next(loader)
        except StopIteration:  # a tiny corpus for a big batch: start the same order again
            loader = iter(
                batch_loader(
                    train_set,
                    RandomSampler(train_set, generator=order.manual_seed(args.seed)),
                    args.batch_size,
                )
            )
            x, y = next(loader)
        batches.append((x.to(device), y.to(device)))

    model = GPT(config).to(device)
    optimizer = bench_tools.adamw(model, args.lr, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    step_model = torch.compile(model) if args.compile else model
    model.train()

    timer = StepTimer(device)
    steps = iter(batches)
    for n_steps, keep in schedule(args.iters, args.warmup, args.group):
        with timer.group(n_steps, keep=keep):
            for x, y in itertools.islice(steps, n_steps):
                with autocast if dtype != torch.float32 else contextlib.nullcontext():
                    _, loss = step_model(x, y)
                bench_tools.update(loss, model, optimizer, scaler, args.grad_clip)
    result = {
        "preset": args.preset,
        "batch_size": args.batch_size,
        "block_size": config.block_size,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "compile": args.compile,
        "chunked_loss": args.chunked_loss,
        "n_layer": config.n_layer,
        "n_embd": config.n_embd,
        "timed_steps": args.iters - args.warmup,
        "step_ms": timer.median(),
        "group_ms": timer.groups(),
        "step_cpu_ms": timer.median(cpu=True),
        "group_cpu_ms": timer.groups(cpu=True),
        "final_loss": loss.item(),
        # ru_maxrss is in KiB on Linux
        "maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cuda_max_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20
        if device.type == "cuda"
        else None,
    }
    bench_tools.write_result(args.out, result)
    groups = len(timer.groups())
    print(
        f"bare step: {result['step_ms']:.1f} ms (median of {groups} groups of {args.group} steps; "
        f"{args.preset}, batch {args.batch_size}, {result['threads']} threads, {device}, "
        f"{result['dtype']})"
    )
    return result


if __name__ == "__main__":
    main()
