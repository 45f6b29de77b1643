"""One training step under torch.profiler, as chapter 04 (DDP) or chapter 07 (FSDP2) takes it.

    torchrun --standalone --nproc-per-node=2 -m workers.step_trace --mode ddp --out out/trace
    torchrun --standalone --nproc-per-node=2 -m workers.step_trace --mode fsdp --out out/trace

A maintainer's twin of the chapters' step (the lesson scripts get no profiler flags), run by
maintainer/step_pictures.py, which draws what it writes. The course model from `common`, real
batches from `DistributedSampler`, AdamW, on the CPU with gloo:

    ddp   wrapped in DistributedDataParallel as chapter 04 wraps it (--bucket-mb sets its bucket
          cap, so that a small model still has several buckets); --grad-accum micro-steps, all
          but the last under no_sync(), as chapter 04 takes them
    fsdp  fully_shard on every transformer block, then on the whole model (the root unit), as
          chapter 07 shards it; one micro-step

--warmup steps run first (DDP rebuilds its buckets in the order backward makes the gradients
after its first synced step; FSDP initialises itself lazily), then one step is profiled. Every
rank writes its trace, <out>/<mode>_rank<R>.json (Chrome's trace format, which Perfetto opens).
Labels mark each micro-step's forward and backward and the optimizer step. With --memory, rank 0
writes <out>/<mode>_memory_<preset>.json: the bytes it holds (common/sharding.py's held_bytes),
and which parameters it holds whole between the end of forward and the start of backward (FSDP2
gathers each unit's parameters and frees them again after forward, except the root unit's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data.distributed import DistributedSampler

from common.data import batch_loader, load_splits, prepare
from common.model import GPT, PRESETS, model_config
from common.sharding import held_bytes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["ddp", "fsdp"], required=True)
    p.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-steps per step (ddp)")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's bucket_cap_mb (ddp)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the profiled one")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="only --memory")
    p.add_argument("--memory", action="store_true", help="rank 0 writes <mode>_memory.json")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--out", required=True, help="folder for the traces")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    try:
        run(args, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


def held_whole(model: torch.nn.Module) -> dict[str, int]:
    """The parameters this rank holds whole right now, and their bytes: under FSDP2 a unit's
    parameters are plain tensors while it is gathered, DTensor shards while it is not."""
    whole = {}
    for name, param in model.named_parameters():  # a tied matrix once
        if not isinstance(param, DTensor):
            whole[name] = param.numel() * param.element_size()
    return whole


def run(args: argparse.Namespace, rank: int, world: int) -> None:
    torch.manual_seed(args.seed)  # the same start on every rank
    config = model_config(args.preset, dropout=0.0)
    train_set, _ = load_splits(
        prepare("shakespeare", args.data_dir, log=lambda *a: None), config.block_size
    )
    sampler = DistributedSampler(
        train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    batches = iter(batch_loader(train_set, sampler, args.batch_size))
    model = GPT(config)
    if args.mode == "ddp":
        micro_steps = args.grad_accum
        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    else:
        micro_steps = 1
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    optimizer = torch.optim.AdamW(model.optimizer_groups(0.1), lr=1e-3)
    whole_after_forward: dict[str, int] = {}

    def step() -> None:
        for micro_step in range(micro_steps):
            last = micro_step == micro_steps - 1
            quiet = args.mode == "ddp" and not last
            sync = wrapped.no_sync() if quiet else contextlib.nullcontext()
            x, y = next(batches)  # (B, T) each
            label = f"micro-step {micro_step + 1} of {micro_steps}"
            if quiet:
                label += ", no_sync"
            with sync:
                with record_function(f"forward ({label})"):
                    _, loss = wrapped(x, y)
                whole_after_forward.clear()
                whole_after_forward.update(held_whole(model))
                with record_function(f"backward ({label})"):
                    (loss / micro_steps).backward()
        with record_function("optimizer step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        dist.barrier()  # both ranks start the profiled step together
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        prof.export_chrome_trace(str(out / f"{args.mode}_rank{rank}.json"))
    else:
        step()
    if args.memory and rank == 0:
        held = held_bytes(model, optimizer)
        facts = {
            "mode": args.mode,
            "preset": args.preset,
            "world_size": world,
            "held_bytes": held,
            "whole_after_forward": whole_after_forward,
        }
        (out / f"{args.mode}_memory_{args.preset}.json").write_text(
            json.dumps(facts, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
