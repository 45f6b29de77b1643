"""What the ranks' agreement on a stop costs per step (common/support/preempt_ranks.py),
under torchrun.

Every rank runs `--steps` stand-in steps of `--step-ms` milliseconds (a sleep: the host is free, as
it is while a GPU computes) and asks `AgreedPreemption.requested()` after each, as the chapters do.
It prints the mean time per step spent in that call, on the slowest rank: with the agreement every K
steps (the course's), and on every step (what the chapters did before: one all-reduce per step).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m bench.stop_check
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 -m bench.stop_check
"""

import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist

from common.support import preempt_ranks


def mean_check_us(steps: int, step_s: float, out_dir: str) -> tuple[float, int]:
    """The mean microseconds per step spent in requested(), and the last interval K."""
    preemption = preempt_ranks.AgreedPreemption(
        "TERM", out_dir, ranks_agree_within=datetime.timedelta(60)
    )
    spent = 0.0
    for _ in range(steps):
        time.sleep(step_s)
        started = time.perf_counter()
        preemption.requested()
        spent += time.perf_counter() - started
    slowest = torch.tensor(spent / steps * 1e6)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item(), preemption.interval


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-ms", type=float, default=20.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with tempfile.TemporaryDirectory() as out_dir:
        every_k, interval = mean_check_us(args.steps, args.step_ms / 1e3, out_dir)
        every_step_plan = preempt_ranks.steps_between_checks
        preempt_ranks.steps_between_checks = lambda check_s, step_s: 1  # the old schedule
        every_step, _ = mean_check_us(args.steps, args.step_ms / 1e3, out_dir)
        preempt_ranks.steps_between_checks = every_step_plan
    if rank == 0:
        world = dist.get_world_size()
        print(
            f"{world} ranks, steps of {args.step_ms:g} ms: the agreement costs "
            f"{every_step:.0f} µs per step on every step, "
            f"{every_k:.1f} µs per step every K steps (K = {interval})",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
