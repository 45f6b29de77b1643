r"""How much of a DDP step is communication: the same step with and without the gradient all-reduce.

    torchrun --standalone --nproc-per-node=2 -m workers.ddp_worker --preset small --batch-size 4 \
        --out comm.json

A benchmark-only twin of chapter 04's training step (the lesson scripts get no benchmark flags):
the course model from `common`, wrapped in DistributedDataParallel as chapter 04 wraps it, fed by
`DistributedSampler` batches, with AdamW and gradient clipping. After --warmup steps it times
groups of --group steps (bench/step_timer.py), alternating between two kinds of step:

    sync     the real step: DDP all-reduces the gradients during backward
    no_sync  every micro-step runs under `model.no_sync()`: no all-reduce at all, so each rank
             steps with its own gradients (the weights drift apart, which does not matter here)

Alternating groups inside one run puts both kinds under the same machine load. The communication
share of a step is 1 - no_sync / sync (median group step times): the time the all-reduce adds
to a step, the part that backward does not hide. Rank 0 writes the result to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from bench import bench_tools
from bench.step_timer import StepTimer, schedule
from common.data import batch_loader, load_splits, prepare
from common.device import autocast_context, pick_dtype, setup_math
from common.model import GPT, model_config


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_tools.parser(__doc__)
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--iters", type=int, default=25, help="steps, warm-up included")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--group", type=int, default=5, help="steps per timed group; groups alternate sync/no_sync"
    )
    p.add_argument(
        "--device", default="auto", help="auto: cuda:LOCAL_RANK where CUDA is present, else cpu"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.iters < args.warmup + 2 * args.group:
        p.error(
            "--iters must leave room for at least one sync and one no_sync group after --warmup"
        )
    return args


def main() -> None:
    args = parse_args()
    rank, world, local_rank = (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ["LOCAL_RANK"]),
    )
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    try:
        result = run(args, rank, world, device)
        if rank == 0:
            result.update(backend=backend, world_size=world)
            bench_tools.write_result(args.out, result)
            steps = f"sync {result['sync_ms']:.1f} ms, no_sync {result['no_sync_ms']:.1f} ms"
            share = f"communication {100 * result['comm_share']:.1f}% of the step"
            print(f"DDP step over {world} rank(s): {steps} -> {share}")
    finally:
        dist.destroy_process_group()


def run(args, rank: int, world: int, device: torch.device) -> dict:
    dtype = pick_dtype(args.dtype, device)
    setup_math(device)
    autocast = autocast_context(device, dtype)
    torch.manual_seed(args.seed)
    config = model_config(args.preset, dropout=0.0)
    train_set, _ = load_splits(
        prepare("shakespeare", args.data_dir, log=lambda *a: None), config.block_size
    )
    sampler = DistributedSampler(
        train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    model = GPT(config).to(device)
    optimizer = bench_tools.adamw(model, 1e-3, device)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from batch_loader(train_set, sampler, args.batch_size, device=device)
            epoch += 1

    data = batches()
    timer = StepTimer(device)
    kept = 0  # timed groups so far: after the warm-up they alternate sync, no_sync, sync, ...
    for n_steps, keep in schedule(args.iters, args.warmup, args.group):
        mode = "no_sync" if keep and kept % 2 else "sync"
        kept += keep
        with timer.group(n_steps, kind=mode, keep=keep):
            for _ in range(n_steps):
                for micro_step in range(args.grad_accum):
                    x, y = next(data)
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    skip = mode == "no_sync" or micro_step < args.grad_accum - 1
                    with ddp.no_sync() if skip else contextlib.nullcontext():
                        with autocast:
                            _, loss = ddp(x, y)
                        (loss / args.grad_accum).backward()
                if args.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    sync_ms, no_sync_ms = timer.median("sync"), timer.median("no_sync")
    return {
        "preset": args.preset,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "sync_ms": sync_ms,
        "no_sync_ms": no_sync_ms,
        "comm_ms": sync_ms - no_sync_ms,
        "comm_share": (sync_ms - no_sync_ms) / sync_ms,
        "sync_cpu_ms": timer.median("sync", cpu=True),
        "no_sync_cpu_ms": timer.median("no_sync", cpu=True),
        "groups_ms": {k: timer.groups(k) for k in ("sync", "no_sync")},
    }


if __name__ == "__main__":
    main()
