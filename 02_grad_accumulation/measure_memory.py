r"""Chapter 02 in numbers: the memory and the time of one optimizer step, whole or accumulated.

One optimizer step over a global batch of --batch-size sequences is taken in several ways: the
whole batch in one forward and backward pass (K = 1), or K micro-batches of --batch-size / K
sequences with their gradients added up, as 02_grad_accumulation/train.py does it. Every way
starts from the same model (same seed) and reads the same real windows of the training data, so
the loss of the first step is the same in every row; what differs is the memory and the time.

    python 02_grad_accumulation/measure_memory.py                       # small model, CPU: ~30 s
    python 02_grad_accumulation/measure_memory.py --preset gpt2 --batch-size 32 \
        --micro-batch-sizes 32 8 2 1
    python 02_grad_accumulation/measure_memory.py --no-chunked-loss   # the plain loss's full logits

How memory is measured. "Resting" memory is what lives between steps: the weights and AdamW's
two running averages per weight. The step adds the gradients, the activations every layer keeps
for the backward pass and the temporaries of each operation; the table reports the peak of the
step, and how far it rises above the resting state.
- CUDA: torch.cuda.reset_peak_memory_stats(), then torch.cuda.max_memory_allocated() after the
  step: the high-water mark of the bytes held by tensors (the caching allocator's spare blocks
  are not counted).
- CPU: PyTorch keeps no such counter, so the step runs once under torch.profiler with
  profile_memory=True, which records every allocation and free of PyTorch's CPU allocator with
  the running total of the bytes allocated since profiling began; the peak of that total is what
  the step added, and resting memory is the size of the weights and the AdamW state. This counts
  the same thing as CUDA's counter: the bytes of live tensors. The process's resident memory
  (RSS) is not used, because the C library keeps freed blocks for reuse, so RSS tells the history
  of the process rather than what one step needs.
Time is the mean wall-clock time of --steps further steps, measured without
the profiler, after one warm-up step (which creates AdamW's state and pays one-off costs). On the
CPU the table also gives the CPU time the process used per step (all its threads): on a machine
shared with other work the wall-clock time says as much about the neighbours as about the step, the
CPU time less."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import sys
import time
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from common.data import load_splits, prepare
from common.device import DTYPES, autocast_context, describe, pick_device, pick_dtype, setup_math
from common.model import GPT, PRESETS, model_config
from common.support.errors import CourseError, run_main

MiB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset", choices=list(PRESETS), default="small", help="model size (default: small)"
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="override the preset's context length"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="the global batch: sequences per optimizer step (default: 16)",
    )
    p.add_argument(
        "--micro-batch-sizes",
        type=int,
        nargs="+",
        default=[16, 4, 2, 1],
        help="micro-batch sizes to try; each must divide --batch-size (default: 16 4 2 1)",
    )
    p.add_argument(
        "--steps", type=int, default=2, help="timed optimizer steps per configuration (default: 2)"
    )
    p.add_argument("--dataset", default="shakespeare")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--chunked-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the model's chunked output layer + loss (the default); "
        "--no-chunked-loss: the plain one",
    )
    args = p.parse_args()
    if args.batch_size < 1 or args.steps < 1:
        raise CourseError("--batch-size and --steps must be positive")
    for micro in args.micro_batch_sizes:
        if micro < 1 or args.batch_size % micro:
            raise CourseError(
                f"micro-batch size {micro} does not divide --batch-size {args.batch_size}"
            )
    return args


def optimizer_step(model, optimizer, micro_batches, autocast) -> torch.Tensor:
    """One optimizer step as chapter 02 takes it: K micro-batches, each loss divided by K."""
    loss = 0.0
    for x, y in micro_batches:
        with autocast:
            _, micro_loss = model(x, y)
            micro_loss = micro_loss / len(micro_batches)
        micro_loss.backward()  # gradients add up in .grad; this micro-batch's activations are freed
        loss += micro_loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def tensor_bytes(model, optimizer) -> int:
    """The weights and the optimizer state: what stays allocated between steps."""
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *state])


@contextlib.contextmanager
def native_stderr_hidden():
    """The profiler's C++ library writes a `profiler_start` / `profiler_stop` line straight to the
    process's stderr (file descriptor 2) on every use, with no setting to turn it off: point
    descriptor 2 at /dev/null meanwhile. Python's own errors are raised after it is restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cpu_peak_added(step) -> int:
    """Peak bytes the CPU allocator held during step(), above what it held when step() began."""
    with (
        native_stderr_hidden(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        step()
    from torch._C._profiler import _EventType  # the profiler's record of each allocation

    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            peak = max(peak, event.typed[1].total_allocated)  # running total since profiling began
    return peak


def main():
    args = parse_args()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    setup_math(device)
    autocast = autocast_context(device, dtype)
    config = model_config(args.preset, block_size=args.block_size, chunked_loss=args.chunked_loss)

    # real windows of the training data, in the order the training scripts visit them
    train_set, _ = load_splits(prepare(args.dataset, args.data_dir), config.block_size)
    G, T = args.batch_size, config.block_size
    # epoch 0's order, as every chapter draws it
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed))
    if len(order) < (args.steps + 2) * G:
        raise CourseError(
            f"the training split has {len(order)} windows, fewer than {(args.steps + 2) * G}"
        )

    def batch(step: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Global batch number `step`, cut into micro-batches: K pairs of (micro, T) tensors."""
        xs, ys = zip(*(train_set[int(i)] for i in order[step * G : (step + 1) * G]))
        x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
        return list(zip(x.split(micro), y.split(micro)))

    rows = []
    for micro in args.micro_batch_sizes:
        torch.manual_seed(args.seed)  # the same initial weights for every configuration
        model = GPT(config).to(device)
        optimizer = torch.optim.AdamW(
            model.optimizer_groups(0.1), lr=1e-3, fused=device.type == "cuda"
        )
        first_loss = optimizer_step(model, optimizer, batch(0, micro), autocast).item()  # warm-up

        timed = [batch(1 + s, micro) for s in range(args.steps)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the warm-up's queued work is not the timed steps'
        wall_start = time.perf_counter()
        cpu_start = time.process_time()  # the CPU time of the process: all its threads
        for micro_batches in timed:
            optimizer_step(model, optimizer, micro_batches, autocast)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU's queued work belongs to the steps
        seconds = (time.perf_counter() - wall_start) / args.steps
        cpu_seconds = (time.process_time() - cpu_start) / args.steps

        last = batch(args.steps + 1, micro)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            resting = torch.cuda.memory_allocated(device)
            optimizer_step(model, optimizer, last, autocast)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            resting = tensor_bytes(model, optimizer)
            peak = resting + cpu_peak_added(
                functools.partial(optimizer_step, model, optimizer, last, autocast)
            )
        rows.append((micro, G // micro, first_loss, peak, peak - resting, seconds, cpu_seconds))
        del model, optimizer, timed, last
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    n_params = sum(p.numel() for p in GPT(config).parameters())
    loss_kind = "chunked" if args.chunked_loss else "plain"
    print(
        f"device {describe(device)}, {str(dtype).removeprefix('torch.')}; model {args.preset}: "
        f"{n_params / 1e6:.2f}M parameters, block {T}, {loss_kind} loss; "
        f"global batch {G} sequences = {G * T:,} tokens per step"
    )
    print(
        f"resting memory (weights + AdamW state): {rows[0][3] - rows[0][4]:,.0f} bytes = "
        f"{(rows[0][3] - rows[0][4]) / MiB:,.1f} MiB; memory measured with "
        + (
            "torch.cuda.max_memory_allocated"
            if device.type == "cuda"
            else "torch.profiler (CPU allocator)"
        )
    )
    print()
    on_cpu = device.type == "cpu"  # there the CPU time is the work done, even on a busy machine
    print(
        "| micro-batch x K | sequences per step | loss of step 1 | peak memory (MiB) "
        "| above resting (MiB) | time per step (ms) | tokens/s |"
        + (" CPU time per step (ms) |" if on_cpu else "")
    )
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if on_cpu else ""))
    for micro, k, loss, peak, added, seconds, cpu_seconds in rows:
        print(
            f"| {micro} x {k} | {G} | {loss:.4f} | {peak / MiB:,.1f} | {added / MiB:,.1f} "
            f"| {1000 * seconds:,.0f} | {G * T / seconds:,.0f} |"
            + (f" {1000 * cpu_seconds:,.0f} |" if on_cpu else "")
        )


if __name__ == "__main__":
    run_main(main)
