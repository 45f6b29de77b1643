r"""Preflight: check that every process of a multi-node job can reach every other before a long run.

Run it under torchrun with the very launch line the training job will use, with preflight.py in
place of train.py. In a minute it tells you what a failed hour-long job would have told you late:

1. Every rank prints, before any communication, where it is and what it sees: host, global,
   local and node rank, device, backend, the versions of Python, torch and NCCL, and the
   torchrun and NCCL environment variables that decide how processes find each other. If the
   job then hangs, these lines say which ranks arrived and with what settings.
2. A correctness check: every rank contributes a known value to an all-reduce (rank + 1 as an
   integer, and a float tensor) and checks the sum against the formula (W(W+1)/2). A gloo group
   must work too, within --gloo-timeout (the training's stop agreement uses one). All ranks must
   also run the same torch and NCCL versions.
3. The all-reduce bandwidth for a few message sizes, as nccl-tests define it:
   algbw = bytes / time, and busbw = algbw * 2(W-1)/W, the traffic every link carries in a ring
   all-reduce, comparable across world sizes with the link speed of the slowest hop (NVLink,
   InfiniBand, Ethernet).

It exits with status 1 when a check fails, so a job script can refuse to start training.

    torchrun --standalone --nproc_per_node=2 05_multinode/preflight.py    # one machine
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=8 \
        --master_addr=HOST --master_port=29500 05_multinode/preflight.py   # on each node
"""

import argparse
import datetime
import os
import platform
import socket
import sys
import time
from pathlib import Path

# lets `import common` work from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from common.distributed import restart_store
from common.support.errors import CourseError, run_main

# The environment variables that decide how processes find each other and how NCCL talks.
WATCHED_VARIABLES = [
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_P2P_DISABLE",
    "NCCL_NET_GDR_LEVEL",
    "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "OMP_NUM_THREADS",
]


def parse_args() -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter  # the docstring's line breaks kept
    p = argparse.ArgumentParser(
        prog="05_multinode/preflight.py", description=__doc__, formatter_class=raw
    )
    p.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="auto: NCCL where CUDA is present, gloo otherwise (default: auto)",
    )
    p.add_argument(
        "--sizes-mb",
        default="1,16,128",
        help="comma-separated all-reduce message sizes in MB (10^6 bytes) (default: 1,16,128)",
    )
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per size (default: 10)")
    p.add_argument(
        "--gloo-timeout",
        type=int,
        default=30,
        help="seconds the gloo group's check may take before it fails (default: 30)",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=120,
        help="seconds a collective may wait for a peer before preflight fails (default: 120)",
    )
    args = p.parse_args()
    try:
        args.sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        raise CourseError(
            f"--sizes-mb {args.sizes_mb!r}: give numbers separated by commas, e.g. 1,16,128"
        ) from None
    if not args.sizes or min(args.sizes) <= 0 or args.iters < 1:
        raise CourseError("--sizes-mb needs positive sizes and --iters at least 1")
    return args


def torchrun_ranks() -> tuple[int, int, int, int]:
    """(global rank, local rank, node rank, world size) as torchrun hands them to each process."""
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        raise CourseError(
            "preflight.py runs under torchrun, e.g. "
            "torchrun --standalone --nproc_per_node=2 05_multinode/preflight.py"
        )
    # torchrun calls the node's rank GROUP_RANK; SLURM-style launchers often export NODE_RANK
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    return (
        int(os.environ["RANK"]),
        int(os.environ["LOCAL_RANK"]),
        node_rank,
        int(os.environ["WORLD_SIZE"]),
    )


def versions(device: torch.device) -> str:
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
    return f"python {platform.python_version()}, torch {torch.__version__}, nccl {nccl}"


def timed_all_reduce(tensor: torch.Tensor, iters: int, device: torch.device) -> float:
    """Seconds one all-reduce of `tensor` takes, the slowest rank's average over `iters`."""
    for _ in range(2):  # warm-up: the first calls set up connections and buffers
        dist.all_reduce(tensor)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # NCCL calls return at once; the work is queued on the GPU
    elapsed = torch.tensor(
        [(time.perf_counter() - start) / iters], dtype=torch.float64, device=device
    )
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective is as fast as its slowest rank
    return elapsed.item()


def check_gloo_group(rank: int, world_size: int, timeout_s: int) -> str | None:
    """A new gloo group, an all-reduce in it and its end, within `timeout_s`; what went wrong."""
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        ones = torch.ones(1)
        dist.all_reduce(ones, group=group)
        dist.destroy_process_group(group)
    except RuntimeError as err:  # gloo's timeouts and refused connections
        reason = str(err).splitlines()[0][:160]
        return (
            f"a gloo group failed within {timeout_s} s ({reason}); set GLOO_SOCKET_IFNAME to the "
            "interface the nodes reach each other on (as NCCL_SOCKET_IFNAME)"
        )
    if ones.item() != world_size:
        return f"gloo all-reduce gave {ones.item():g}, expected {world_size}"
    return None


def main():
    args = parse_args()
    rank, local_rank, node_rank, world_size = torchrun_ranks()
    prefix = f"[node {node_rank} rank {rank} local {local_rank}]"

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise CourseError(
            "--backend nccl needs CUDA GPUs, and this PyTorch sees none; use --backend gloo"
        )
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise CourseError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                "lower --nproc_per_node"
            )
        device = torch.device("cuda", local_rank)  # the LOCAL rank picks the GPU on this machine
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    # ---- 1. who is here: printed before any communication, so a hang still leaves these lines ----
    env = " ".join(f"{name}={os.environ.get(name, '-')}" for name in WATCHED_VARIABLES)
    print(
        f"{prefix} host {socket.gethostname()} pid {os.getpid()}, world size {world_size}, "
        f"device {device}, backend {backend}, {versions(device)}; {env}",
        flush=True,
    )

    timeout = datetime.timedelta(seconds=args.timeout)
    # as in train.py: torchrun's store outlives a restart (--max-restarts), so each attempt meets
    # under its own prefix instead of reading the addresses of the processes that failed
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    store = restart_store(world_size, restart_count, timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    try:
        failures = []
        # ---- 2. correctness: known contributions, known sums ----
        ints = torch.tensor([rank + 1], dtype=torch.int64, device=device)
        dist.all_reduce(ints)
        expected = world_size * (world_size + 1) // 2
        if ints.item() != expected:
            failures.append(f"integer all-reduce gave {ints.item()}, expected {expected}")
        # a float tensor of a million elements, whose sums are exact in float32 in any order
        pattern = (torch.arange(1_000_000, device=device) % 8).float()  # (1e6,)
        floats = pattern + (rank + 1)
        dist.all_reduce(floats)
        wrong = (floats != pattern * world_size + expected).sum().item()
        if wrong:
            failures.append(f"float all-reduce: {wrong:,} of {floats.numel():,} elements wrong")
        outcome = "; ".join(failures) if failures else f"OK (sum of rank+1 = {expected})"
        print(f"{prefix} all-reduce check: {outcome}", flush=True)

        # a gloo group as well, whatever the backend: the stop's agreement runs on one. gloo binds
        # to the address of the host's name, 127.0.1.1 on many clusters, so across nodes it can
        # hang where NCCL works; a short timeout turns that hang into a failed check
        gloo_failure = check_gloo_group(rank, world_size, args.gloo_timeout)
        if gloo_failure:
            failures.append(gloo_failure)
        print(f"{prefix} gloo group check: {gloo_failure or 'OK'}", flush=True)

        # every rank must run the same software: a torch or NCCL mismatch breaks
        # collectives or hangs them
        everyone = [None] * world_size
        dist.all_gather_object(everyone, versions(device))
        if len(set(everyone)) > 1:
            failures.append(
                "ranks run different software: "
                + "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
            )

        # one verdict for the whole job: the number of ranks that failed a check
        failed_ranks = torch.tensor([1 if failures else 0], dtype=torch.int64, device=device)
        dist.all_reduce(failed_ranks)

        # ---- 3. bandwidth ----
        rows = []
        for size_mb in args.sizes:
            n = max(1, int(size_mb * 1e6) // 4)
            tensor = torch.ones(n, dtype=torch.float32, device=device)  # (n,) float32: 4 bytes each
            seconds = timed_all_reduce(tensor, args.iters, device)
            algbw = n * 4 / seconds / 1e9  # GB/s, as nccl-tests count them (10^9 bytes)
            busbw = algbw * 2 * (world_size - 1) / world_size
            rows.append((n * 4 / 1e6, seconds * 1e3, algbw, busbw))
            del tensor

        if rank == 0:
            print(
                f"\nall-reduce of float32, {world_size} ranks, backend {backend}, "
                f"slowest rank's mean over {args.iters} calls:"
            )
            print(f"{'size (MB)':>12} {'time (ms)':>12} {'algbw (GB/s)':>14} {'busbw (GB/s)':>14}")
            for size, ms, algbw, busbw in rows:
                print(f"{size:>12.2f} {ms:>12.3f} {algbw:>14.3f} {busbw:>14.3f}")
            verdict = (
                "PASSED" if failed_ranks.item() == 0 else f"FAILED on {failed_ranks.item()} rank(s)"
            )
            nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            print(f"\npreflight {verdict}: {world_size} ranks on {nodes} node(s)", flush=True)
        for failure in failures:
            print(f"{prefix} FAILED: {failure}", file=sys.stderr, flush=True)
        return 1 if failed_ranks.item() else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
