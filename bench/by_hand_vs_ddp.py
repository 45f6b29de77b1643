"""Train the course GPT with the by-hand data parallelism of ddp_by_hand.py, or with DDP.

    torchrun --standalone --nproc_per_node=2 -m bench.by_hand_vs_ddp --impl bucketed
    torchrun --standalone --nproc_per_node=2 -m bench.by_hand_vs_ddp --impl naive
    torchrun --standalone --nproc_per_node=2 -m bench.by_hand_vs_ddp --impl ddp
    torchrun --standalone --nproc_per_node=2 -m bench.by_hand_vs_ddp --impl all  # side by side
    torchrun --standalone --nproc_per_node=2 -m bench.by_hand_vs_ddp --impl zero1
    torchrun --standalone --nproc_per_node=2 -m bench.by_hand_vs_ddp --impl zero_redundancy

A measuring bench, not a training run: the batches are random tokens from a seeded generator, so
the script needs no data set. Every rank draws the same global batch and takes its rows r::W.
Rank 0 prints the mean step time, the final loss and the bytes of optimizer state on each rank;
with the same seed, every --impl prints the same loss (up to rounding), because they compute the
same gradients and take the same AdamW steps. zero1 (zero1.py, ZeRO-1 by hand) and
zero_redundancy (torch's ZeroRedundancyOptimizer with DDP) run next to DDP, taking turns with it.
"""

import argparse
import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from bench.step_timer import StepTimer
from common.model import GPT, PRESETS, model_config
from layout import chapter_module

# 04_ddp is no package name: its modules are imported as `python 04_ddp/...` sees them
by_hand = chapter_module("04_ddp", "ddp_by_hand")
zero1 = chapter_module("04_ddp", "zero1")  # after ddp_by_hand, which it imports

IMPLS = {
    "naive": ["naive"],
    "bucketed": ["bucketed"],
    "ddp": ["ddp"],
    "zero1": ["ddp", "zero1"],
    "zero_redundancy": ["ddp", "zero_redundancy"],
    "all": ["naive", "bucketed", "ddp"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--impl",
        choices=list(IMPLS),
        default="bucketed",
        help="naive/bucketed: ddp_by_hand.py; ddp: torch's DistributedDataParallel; "
        "all: the three taking turns, step by step; zero1 (zero1.py) and "
        "zero_redundancy (ZeroRedundancyOptimizer): each taking turns with ddp",
    )
    p.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    p.add_argument(
        "--batch-size", type=int, default=4, help="micro-batch: sequences per rank per forward"
    )
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (K)")
    p.add_argument(
        "--bucket-mb", type=float, default=25.0, help="bucket size in MB (bucketed and ddp)"
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument(
        "--warmup", type=int, default=2, help="first steps left out of the mean step time"
    )
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument(
        "--grad-clip", type=float, default=0.0, help="clip the gradient norm to this; 0: off"
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: the preset's block size)",
    )
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error(f"--steps must be larger than --warmup ({args.warmup})")
    return args


def main() -> None:
    args = parse_args()
    rank, world, local_rank = (
        int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    )
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
        return by_hand.NaiveDataParallel(model)
    if impl == "bucketed":
        return by_hand.BucketedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    if impl == "zero1":
        return zero1.ZeroOneDataParallel(model, bucket_cap_mb=args.bucket_mb)
    return DistributedDataParallel(
        model,
        device_ids=[local_rank] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_mb,
    )


def make_optimizer(impl: str, model, args):
    groups = model.module.optimizer_groups(weight_decay=0.1)  # decay on matrices only
    if impl == "zero1":
        # AdamW on this rank's slice
        return zero1.ShardedOptimizer(model, groups, torch.optim.AdamW, lr=args.lr)
    if impl == "zero_redundancy":
        # torch's ZeRO-1: whole tensors per rank
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=args.lr)
    return torch.optim.AdamW(groups, lr=args.lr)


def state_bytes(impl: str, optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds (for AdamW: two moments and the
    step counts)."""
    if impl == "zero1":
        return optimizer.state_bytes()
    state = optimizer.optim.state if impl == "zero_redundancy" else optimizer.state
    return sum(
        t.numel() * t.element_size()
        for s in state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )


def train_step(
    impl: str, model, optimizer, x, y, B: int, K: int, clip: float
) -> tuple[torch.Tensor, int]:
    loss_sum = torch.zeros((), device=x.device)
    for micro in range(K):
        # all micro-steps but the last only accumulate into .grad; the last one communicates
        ctx = model.no_sync() if micro < K - 1 else contextlib.nullcontext()
        with ctx:
            _, loss = model(x[micro * B : (micro + 1) * B], y[micro * B : (micro + 1) * B])
            (loss / K).backward()
        loss_sum += loss.detach() / K
    # every rank holds a full .grad of every parameter here (ZeRO-2 would not)
    grad_bytes = sum(
        p.grad.numel() * p.grad.element_size()
        for p in model.module.parameters()
        if p.grad is not None
    )
    if impl not in ("ddp", "zero_redundancy"):
        model.finish_gradient_sync()  # wait for the all-reduces; DDP does this inside backward
    if clip > 0 and impl == "zero1":
        optimizer.clip_grad_norm_(clip)  # the norm of the whole gradient, from every rank's slice
    elif clip > 0:
        # every rank holds the whole gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_bytes


def train(args, rank: int, world: int, local_rank: int, device: torch.device) -> None:
    config = model_config(args.preset, dropout=0.0)
    # --impl all: the three side by side, taking turns step by step, so that a busy machine slows
    # them all alike and the comparison stays fair.
    impls = IMPLS[args.impl]
    models = {impl: wrap(impl, args, rank, local_rank, device, config) for impl in impls}
    optimizers = {impl: make_optimizer(impl, m, args) for impl, m in models.items()}

    B, K, T = args.batch_size, args.grad_accum, args.seq_len or config.block_size
    G = B * K * world  # the global batch: sequences per optimizer step, over all ranks
    if rank == 0:
        n_params = sum(p.numel() for p in models[impls[0]].module.parameters())
        print(
            f"impl {args.impl}, bucket {args.bucket_mb} MB | {world} ranks on {device.type} | "
            f"preset {args.preset}, {n_params / 1e6:.2f}M parameters | "
            f"global batch {G} sequences = {G * T} tokens "
            f"(batch {B} x grad_accum {K} x {world} ranks)"
        )
        param_bytes = sum(
            p.numel() * p.element_size() for p in models[impls[0]].module.parameters()
        )
        print(
            f"per rank: parameters {param_bytes:,} bytes"
            + (f" | gradient clipping at {args.grad_clip}" if args.grad_clip > 0 else "")
        )

    gen = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    timer = StepTimer(device)  # each step of each implementation, after the first --warmup steps
    losses, grad_bytes = {}, {}
    for step in range(args.steps):
        data = torch.randint(0, config.vocab_size, (G, T + 1), generator=gen)
        # this rank's rows
        x, y = data[rank::world, :-1].to(device), data[rank::world, 1:].to(device)
        # rotate who goes first
        for impl in impls[step % len(impls) :] + impls[: step % len(impls)]:
            with timer.group(kind=impl, keep=step >= args.warmup):
                losses[impl], grad_bytes[impl] = train_step(
                    impl, models[impl], optimizers[impl], x, y, B, K, args.grad_clip
                )

    for impl in impls:
        dist.all_reduce(losses[impl], op=dist.ReduceOp.SUM)  # the last step's loss, global batch
        per_rank = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(
            per_rank,
            torch.tensor(state_bytes(impl, optimizers[impl]), dtype=torch.int64, device=device),
        )
        if rank == 0:
            # the median: robust to a busy machine
            mean_ms, median_ms = timer.mean(impl), timer.median(impl)
            kind = "reduce-scatters" if impl == "zero1" else "all-reduces"
            calls = (
                f" | {models[impl].comm_calls / args.steps:.0f} {kind}/step"
                if impl in ("naive", "bucketed", "zero1")
                else ""
            )
            print(
                f"{impl:>15}: mean step time {mean_ms:.1f} ms (median {median_ms:.1f}) over steps "
                f"{args.warmup + 1}..{args.steps} | {G * T / (mean_ms / 1000):,.0f} tokens/s | "
                f"final loss {losses[impl].item() / world:.6f}{calls}"
            )
            print(
                f"{'':>15}  per rank: gradients {grad_bytes[impl]:,} bytes | optimizer state "
                + " / ".join(f"{b.item():,}" for b in per_rank)
                + f" bytes (ranks 0..{world - 1})"
            )


if __name__ == "__main__":
    main()
