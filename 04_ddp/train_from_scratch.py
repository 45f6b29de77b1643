"""Train the course GPT with the from-scratch data parallelism of from_scratch.py, or with DDP.

    torchrun --standalone --nproc_per_node=2 04_ddp/train_from_scratch.py --impl bucketed
    torchrun --standalone --nproc_per_node=2 04_ddp/train_from_scratch.py --impl naive
    torchrun --standalone --nproc_per_node=2 04_ddp/train_from_scratch.py --impl ddp
    torchrun --standalone --nproc_per_node=2 04_ddp/train_from_scratch.py --impl all  # side by side

A measuring bench, not a training run: the batches are random tokens from a seeded generator, so
the script needs no data set. Every rank draws the same global batch and takes its rows r::W.
Rank 0 prints the mean step time and the final loss; with the same seed, all three --impl choices
print the same loss (up to rounding), because they compute the same gradients.
"""

import argparse
import contextlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `common`
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder, for `from_scratch`

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.model import GPT, PRESETS, model_config
from from_scratch import BucketedDataParallel, NaiveDataParallel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--impl", choices=["naive", "bucketed", "ddp", "all"], default="bucketed",
                   help="naive/bucketed: from_scratch.py; ddp: torch's DistributedDataParallel; "
                        "all: the three taking turns, step by step")
    p.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch: sequences per rank per forward")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (K)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MB (bucketed and ddp)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the mean step time")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error(f"--steps must be larger than --warmup ({args.warmup})")
    return args


def main() -> None:
    args = parse_args()
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")  # LOCAL_RANK: the GPU on this node
        torch.cuda.set_device(device)  # before any CUDA work, so NCCL uses the right GPU
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # The timeout turns a dead peer into an error instead of a hang.
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    try:
        train(args, rank, world, local_rank, device)
    finally:
        dist.destroy_process_group()


def wrap(impl: str, args, rank: int, local_rank: int, device: torch.device, config):
    # A different initialisation on every rank, on purpose: the wrapper's broadcast from rank 0
    # is what makes the copies equal (DDP broadcasts in its constructor too).
    torch.manual_seed(args.seed + rank)
    model = GPT(config).to(device)
    if impl == "naive":
        return NaiveDataParallel(model)
    if impl == "bucketed":
        return BucketedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    return DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None,
                                   bucket_cap_mb=args.bucket_mb)


def train_step(impl: str, model, optimizer, x, y, B: int, K: int) -> torch.Tensor:
    loss_sum = torch.zeros((), device=x.device)
    for micro in range(K):
        # all micro-steps but the last only accumulate into .grad; the last one communicates
        ctx = model.no_sync() if micro < K - 1 else contextlib.nullcontext()
        with ctx:
            _, loss = model(x[micro * B:(micro + 1) * B], y[micro * B:(micro + 1) * B])
            (loss / K).backward()
        loss_sum += loss.detach() / K
    if impl != "ddp":
        model.finish_gradient_sync()  # wait for the all-reduces; DDP does this inside backward
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum


def train(args, rank: int, world: int, local_rank: int, device: torch.device) -> None:
    config = model_config(args.preset, dropout=0.0)
    # --impl all: the three side by side, taking turns step by step, so that a busy machine slows
    # them all alike and the comparison stays fair.
    impls = ["naive", "bucketed", "ddp"] if args.impl == "all" else [args.impl]
    models = {impl: wrap(impl, args, rank, local_rank, device, config) for impl in impls}
    optimizers = {impl: torch.optim.AdamW(m.module.optimizer_groups(weight_decay=0.1), lr=args.lr)
                  for impl, m in models.items()}

    B, K, T = args.batch_size, args.grad_accum, config.block_size
    G = B * K * world  # the global batch: sequences per optimizer step, over all ranks
    if rank == 0:
        n_params = sum(p.numel() for p in models[impls[0]].module.parameters())
        print(f"impl {args.impl}, bucket {args.bucket_mb} MB | {world} ranks on {device.type} | preset "
              f"{args.preset}, {n_params / 1e6:.2f}M parameters | global batch {G} sequences = {G * T} tokens "
              f"(batch {B} x grad_accum {K} x {world} ranks)")

    gen = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    step_times = {impl: [] for impl in impls}
    losses = {}
    for step in range(args.steps):
        data = torch.randint(0, config.vocab_size, (G, T + 1), generator=gen)
        x, y = data[rank::world, :-1].to(device), data[rank::world, 1:].to(device)  # this rank's rows
        for impl in impls[step % len(impls):] + impls[:step % len(impls)]:  # rotate who goes first
            t0 = time.perf_counter()
            losses[impl] = train_step(impl, models[impl], optimizers[impl], x, y, B, K)
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_times[impl].append(time.perf_counter() - t0)

    for impl in impls:
        dist.all_reduce(losses[impl], op=dist.ReduceOp.SUM)  # the last step's loss, global batch
        if rank == 0:
            timed = step_times[impl][args.warmup:]
            mean_ms = 1000 * sum(timed) / len(timed)
            median_ms = 1000 * sorted(timed)[len(timed) // 2]  # robust to a busy machine's outliers
            calls = f" | {models[impl].comm_calls / args.steps:.0f} all-reduces/step" if impl != "ddp" else ""
            print(f"{impl:>8}: mean step time {mean_ms:.1f} ms (median {median_ms:.1f}) over steps "
                  f"{args.warmup + 1}..{args.steps} | {G * T / (mean_ms / 1000):,.0f} tokens/s | "
                  f"final loss {losses[impl].item() / world:.6f}{calls}")


if __name__ == "__main__":
    main()
