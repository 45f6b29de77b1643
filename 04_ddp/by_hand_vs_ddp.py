"""Train the course GPT with the by-hand data parallelism of ddp_by_hand.py and zero1.py, or with
torch's DDP and ZeroRedundancyOptimizer (docs/deep/DDP_BY_HAND.md, docs/deep/ZERO.md).

    torchrun --standalone --nproc_per_node=2 04_ddp/by_hand_vs_ddp.py --impl all  # side by side
    torchrun --standalone --nproc_per_node=2 04_ddp/by_hand_vs_ddp.py --impl zero1

The batches are random tokens from a seeded generator, the same global batch on every rank, which
takes its rows r::W: no data set is needed. Several implementations take turns, one optimizer step
each, so that a busy machine slows them alike. Rank 0 prints each one's step time, its final loss
(the same for all: they compute the same gradients and take the same AdamW steps) and the bytes of
optimizer state on every rank. Run it as a file: it imports ddp_by_hand.py and zero1.py from
beside it.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddp_by_hand as by_hand
import torch
import torch.distributed as dist
import zero1
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from common.model import GPT, PRESETS, model_config

IMPLS = {
    "naive": ["naive"],
    "bucketed": ["bucketed"],
    "ddp": ["ddp"],
    "zero1": ["ddp", "zero1"],
    "zero_redundancy": ["ddp", "zero_redundancy"],
    "all": ["naive", "bucketed", "ddp"],
}
# the implementations that count their own communication calls
BY_HAND = ("naive", "bucketed", "zero1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--impl", choices=list(IMPLS), default="bucketed")
    p.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (K)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MB")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the step time")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--grad-clip", type=float, default=0.0, help="clip the gradient norm; 0: off")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's block size")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error(f"--steps must be larger than --warmup ({args.warmup})")
    return args


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
    device_ids = [local_rank] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=args.bucket_mb)


def make_optimizer(impl: str, model, args):
    groups = model.module.optimizer_groups(weight_decay=0.1)  # decay on matrices only
    if impl == "zero1":  # AdamW on this rank's slice
        return zero1.ShardedOptimizer(model, groups, torch.optim.AdamW, lr=args.lr)
    if impl == "zero_redundancy":  # torch's ZeRO-1: whole tensors per rank
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=args.lr)
    return torch.optim.AdamW(groups, lr=args.lr)


def state_bytes(impl: str, optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds (AdamW: two moments and the steps)."""
    if impl == "zero1":
        return optimizer.state_bytes()
    state = optimizer.optim.state if impl == "zero_redundancy" else optimizer.state
    tensors = [t for s in state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def train_step(impl: str, model, optimizer, x, y, args) -> tuple[torch.Tensor, int]:
    """One optimizer step over K micro-steps: the mean loss, and the bytes of gradients held."""
    B = args.batch_size
    K = args.grad_accum
    loss_sum = torch.zeros((), device=x.device)
    for micro in range(K):
        # all micro-steps but the last only accumulate into .grad; the last one communicates
        sync = model.no_sync() if micro < K - 1 else contextlib.nullcontext()
        with sync:
            _, loss = model(x[micro * B : (micro + 1) * B], y[micro * B : (micro + 1) * B])
            (loss / K).backward()
        loss_sum += loss.detach() / K
    # every rank holds a full .grad of every parameter here (ZeRO-2 would not)
    grads = [p.grad for p in model.module.parameters() if p.grad is not None]
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    if impl in BY_HAND:
        model.finish_gradient_sync()  # wait for the all-reduces; DDP does this inside backward
    if args.grad_clip > 0 and impl == "zero1":
        optimizer.clip_grad_norm_(args.grad_clip)  # the whole gradient's norm, from every slice
    elif args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_bytes


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu")
    backend = "gloo"
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")  # LOCAL_RANK: the GPU on this node
        torch.cuda.set_device(device)  # before any CUDA work, so NCCL uses the right GPU
        backend = "nccl"
    dist.init_process_group(backend)
    config = model_config(args.preset, dropout=0.0)
    impls = IMPLS[args.impl]
    models = {impl: wrap(impl, args, rank, local_rank, device, config) for impl in impls}
    optimizers = {impl: make_optimizer(impl, m, args) for impl, m in models.items()}
    T = args.seq_len or config.block_size
    G = args.batch_size * args.grad_accum * world  # sequences per optimizer step, all ranks
    if rank == 0:
        params = list(models[impls[0]].module.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        print(
            f"impl {args.impl}, bucket {args.bucket_mb} MB | {world} ranks on {device.type} | "
            f"preset {args.preset}, {sum(p.numel() for p in params) / 1e6:.2f}M parameters | "
            f"global batch {G} sequences = {G * T} tokens | per rank: parameters "
            f"{param_bytes:,} bytes"
        )

    gen = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    step_ms = {impl: [] for impl in impls}
    losses = {}
    grad_bytes = {}
    for step in range(args.steps):
        data = torch.randint(0, config.vocab_size, (G, T + 1), generator=gen)
        x = data[rank::world, :-1].to(device)  # this rank's rows
        y = data[rank::world, 1:].to(device)
        for impl in impls[step % len(impls) :] + impls[: step % len(impls)]:  # rotate who is first
            started = time.perf_counter()
            losses[impl], grad_bytes[impl] = train_step(
                impl, models[impl], optimizers[impl], x, y, args
            )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= args.warmup:
                step_ms[impl].append(1000 * (time.perf_counter() - started))

    for impl in impls:
        dist.all_reduce(losses[impl])  # the last step's loss over the global batch
        per_rank = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(world)]
        mine = torch.tensor(state_bytes(impl, optimizers[impl]), dtype=torch.int64, device=device)
        dist.all_gather(per_rank, mine)
        if rank != 0:
            continue
        mean_ms = statistics.mean(step_ms[impl])
        calls = ""
        if impl in BY_HAND:
            kind = "reduce-scatters" if impl == "zero1" else "all-reduces"
            calls = f" | {models[impl].comm_calls / args.steps:.0f} {kind}/step"
        print(
            f"{impl:>15}: mean step time {mean_ms:.1f} ms "
            f"(median {statistics.median(step_ms[impl]):.1f}) over steps "
            f"{args.warmup + 1}..{args.steps} | {G * T / (mean_ms / 1000):,.0f} tokens/s | "
            f"final loss {losses[impl].item() / world:.6f}{calls}"
        )
        print(
            f"{'':>15}  per rank: gradients {grad_bytes[impl]:,} bytes | optimizer state "
            + " / ".join(f"{b.item():,}" for b in per_rank)
            + f" bytes (ranks 0..{world - 1})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
