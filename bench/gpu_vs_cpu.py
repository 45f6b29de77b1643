"""Does mixed-precision training on the GPU follow float32 training on the CPU?

    python -m bench.gpu_vs_cpu                                     # CPU float32 vs CUDA bfloat16
    python -m bench.gpu_vs_cpu --test-device cpu --test-dtype bfloat16 --preset tiny  # no GPU

Both sides start from the same weights (built once, on the CPU, in float32, and copied) and take
--steps optimizer steps on the same batches (chapter 01's first ones): forward under the side's
autocast, backward, gradient clipping, AdamW. The check passes when every step's loss on the test
side is within --rtol (relative) of the reference side's. bfloat16 keeps 8 bits of mantissa (about
2-3 significant digits), so its losses wander from float32's by a few parts in a thousand per step;
2e-2 over a few steps is the tolerance of a correct bf16 run, while a bug (wrong data, a missed
scaling, no gradient sync) moves the loss by far more. Exit status 0: pass, 1: fail.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch.utils.data import RandomSampler

from bench import bench_tools
from common.data import batch_loader, load_splits, prepare
from common.device import autocast_context, pick_device, pick_dtype, setup_math
from common.model import GPT, model_config
from common.support.errors import CourseError, run_main


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_tools.parser(__doc__)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps compared")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3, help="a constant learning rate")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--ref-device", default="cpu")
    p.add_argument("--ref-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--test-device", default="cuda")
    p.add_argument("--test-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--rtol", type=float, default=2e-2, help="largest relative loss difference allowed per step"
    )
    p.add_argument("--data-dir", default="data")
    p.add_argument("--out", default=None, help="write the losses and the verdict as JSON here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be positive")
    if args.rtol <= 0:
        p.error("--rtol must be positive")
    return args


def train_losses(
    model: GPT, batches, device: torch.device, dtype: torch.dtype, args
) -> list[float]:
    """The loss of every step of a short run of `model`. A copy is trained, so the original
    stays as it was."""
    setup_math(device)
    model = copy.deepcopy(model).to(device)
    optimizer = bench_tools.adamw(model, args.lr, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    autocast = autocast_context(device, dtype)
    model.train()
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast:
            _, loss = model(x, y)
        bench_tools.update(loss, model, optimizer, scaler, args.grad_clip)
        losses.append(loss.item())  # a check, not a benchmark: one sync per step is fine
    return losses


def main(argv=None) -> int:
    args = parse_args(argv)
    ref_device, test_device = pick_device(args.ref_device), pick_device(args.test_device)
    ref_dtype, test_dtype = (
        pick_dtype(args.ref_dtype, ref_device),
        pick_dtype(args.test_dtype, test_device),
    )
    # no dropout: both sides compute the same function
    config = model_config(args.preset, dropout=0.0)
    train_set, _ = load_splits(
        prepare("shakespeare", args.data_dir, log=lambda *a: None), config.block_size
    )
    if len(train_set) < args.steps * args.batch_size:
        raise CourseError(
            f"{args.steps} steps of {args.batch_size} need {args.steps * args.batch_size} windows; "
            f"the training split has {len(train_set)}"
        )
    loader = batch_loader(
        train_set,
        RandomSampler(train_set, generator=torch.Generator().manual_seed(args.seed)),
        args.batch_size,
    )
    batches = [b for _, b in zip(range(args.steps), loader)]
    torch.manual_seed(args.seed)
    model = GPT(config)  # float32 on the CPU: both sides start from exactly these weights

    ref = train_losses(model, batches, ref_device, ref_dtype, args)
    test = train_losses(model, batches, test_device, test_dtype, args)
    rel = [abs(t - r) / abs(r) for r, t in zip(ref, test)]
    passed = max(rel) <= args.rtol
    ref_name = f"{ref_device} {str(ref_dtype).removeprefix('torch.')}"
    test_name = f"{test_device} {str(test_dtype).removeprefix('torch.')}"
    run = f"{args.preset} preset, batch {args.batch_size}, {args.steps} steps"
    print(f"{run}: {ref_name} (reference) vs {test_name}")
    print(f"{'step':>4}  {'reference':>10}  {'test':>10}  {'rel. diff':>9}")
    for i, (r, t, d) in enumerate(zip(ref, test, rel), start=1):
        print(f"{i:>4}  {r:>10.5f}  {t:>10.5f}  {d:>9.2e}")
    print(
        f"{'PASS' if passed else 'FAIL'}: largest relative difference {max(rel):.2e} "
        f"{'<=' if passed else '>'} rtol {args.rtol:g}"
    )
    result = {
        "preset": args.preset,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "rtol": args.rtol,
        "reference": ref_name,
        "test": test_name,
        "reference_losses": ref,
        "test_losses": test,
        "rel_diff": rel,
        "max_rel_diff": max(rel),
        "passed": passed,
    }
    bench_tools.write_result(args.out, result)
    return 0 if passed else 1


if __name__ == "__main__":
    run_main(main)
