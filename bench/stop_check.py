"""What chapter 06's agreement on a stop costs, under torchrun: one all-reduce of the stop flag over
the ranks' CPU (gloo) group, every 10 steps as the chapter does it, and on every step.

Every rank runs `--steps` stand-in steps of `--step-ms` milliseconds (a sleep: the host is free, as
it is while a GPU computes) and, after every `--every`-th of them, all-reduces its flag (MAX), as
06_fault_tolerance/train.py does. It prints, on the slowest rank: the all-reduce itself (the ranks
lined up by a barrier first), one check as the chapter makes it (the wait for a rank whose steps
ran late included), and the mean time per step spent in the checks, for the chapter's interval and
for a check on every step.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m bench.stop_check
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 -m bench.stop_check
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

# 06_fault_tolerance/train.py's stop_check_every
CHAPTER_INTERVAL = 10


def check_cost_us(
    steps: int, step_s: float, every: int, group: dist.ProcessGroup
) -> tuple[float, float]:
    """Microseconds per check and per step spent in the checks, on this rank."""
    spent = 0.0
    checks = 0
    for step in range(1, steps + 1):
        time.sleep(step_s)
        if step % every != 0:
            continue
        started = time.perf_counter()
        stop_flag = torch.tensor(0.0)
        dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX, group=group)
        stop_flag.item()
        spent += time.perf_counter() - started
        checks += 1
    return spent / checks * 1e6, spent / steps * 1e6


def all_reduce_us(repeats: int, group: dist.ProcessGroup) -> float:
    """Microseconds of the stop flag's all-reduce alone, on this rank: every rank starts it at once
    (after a barrier), so no rank waits for another's late step."""
    spent = 0.0
    for _ in range(repeats):
        dist.barrier(group=group)
        started = time.perf_counter()
        stop_flag = torch.tensor(0.0)
        dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX, group=group)
        stop_flag.item()
        spent += time.perf_counter() - started
    return spent / repeats * 1e6


def slowest(value: float) -> float:
    """The largest value over all ranks."""
    tensor = torch.tensor(value)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-ms", type=float, default=20.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    step_s = args.step_ms / 1e3
    per_check, per_step = check_cost_us(args.steps, step_s, CHAPTER_INTERVAL, group)
    _, every_step = check_cost_us(args.steps, step_s, 1, group)
    alone = all_reduce_us(args.steps // CHAPTER_INTERVAL, group)
    per_check, per_step, every_step = slowest(per_check), slowest(per_step), slowest(every_step)
    alone = slowest(alone)
    if dist.get_rank() == 0:
        print(
            f"{dist.get_world_size()} ranks, steps of {args.step_ms:g} ms: the all-reduce itself "
            f"{alone:.0f} µs; one check {per_check:.0f} µs, the wait for a late rank included; "
            f"{per_step:.1f} µs per step with a check every "
            f"{CHAPTER_INTERVAL} steps, {every_step:.0f} µs per step with one on every step",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
