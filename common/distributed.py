"""What the DDP chapters need but do not teach: each rank's device and CPU threads, one rank first,
the copies check, and a meeting point that survives torchrun's restarts.

Every function here that takes no device facts is a collective or joins one: every rank of the
group must call it, in the same order, or the ranks that did wait for the others until the timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from .device import parse_device
from .support.errors import CourseError

# Tokenizing a large data set can take hours, far longer than a training collective may wait.
PREPARATION_TIMEOUT = datetime.timedelta(hours=6)


@contextlib.contextmanager
def one_rank_first(is_first: bool):
    """Run the block on the first rank, then on every other one: for work done once on disk.

    The others wait until the first rank has finished the block (the data preparation), then run
    it and find the work done. They wait in a group of their own (gloo: a CPU barrier, whatever the
    training backend) with a timeout of hours, so a slow preparation is not taken for a dead peer.
    """
    group = dist.new_group(backend="gloo", timeout=PREPARATION_TIMEOUT)
    if not is_first:
        dist.barrier(group=group)
    yield
    if is_first:
        dist.barrier(group=group)


def ranks_unlike_rank0(model: torch.nn.Module) -> int:
    """How many ranks hold parameters that differ from rank 0's, bit for bit (0 on every rank when
    DDP
    kept its promise: the same start and the same averaged gradients keep every copy equal)."""
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0_params = params.clone()
    dist.broadcast(rank0_params, src=0)
    differing = torch.tensor(
        0.0 if torch.equal(params, rank0_params) else 1.0, device=params.device
    )
    dist.all_reduce(differing, op=dist.ReduceOp.SUM)  # SUM works on every backend
    return int(differing.item())


def restart_store(
    world_size: int, restart_count: int, timeout: datetime.timedelta
) -> dist.Store | None:
    """Where the ranks of this attempt meet; None: init_process_group connects to MASTER_ADDR
    itself.

    Under torchrun the meeting point can be torchrun's own key-value store
    (TORCHELASTIC_USE_AGENT_STORE=True), and that store outlives a restart (--max-restarts): the
    processes of a restarted group would meet where the failed group met, read their dead
    predecessors' addresses and wait for them. So every attempt meets under its own prefix, the
    restart count. (That count is per node: with the static rendezvous every node counts the same
    failures; with c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which launch_c10d.sh sets, gives
    every
    attempt a new store instead, and this is not needed.)
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt_{restart_count}", agent_store)


def rank_device(
    requested: str, local_rank: int, local_world_size: int, cuda_gpus: int
) -> torch.device:
    """The device of one DDP process: cuda:LOCAL_RANK on a machine with GPUs, else the CPU.

    LOCAL_RANK, never RANK: on the second machine RANK starts at 8, but its GPUs are 0..7. A
    process that sees a single GPU takes it, whatever its LOCAL_RANK (with a one-line note). The
    decision takes the machine's GPU count as a plain number, so the tests can check it on a CPU
    for machines they do not have. Apple's mps is refused: NCCL and gloo cannot send its tensors.
    """
    if requested == "auto":
        requested = "cuda" if cuda_gpus else "cpu"
    device = parse_device(requested, cuda_gpus)
    if device.type == "mps":
        raise CourseError("DDP's backends (NCCL, gloo) cannot send mps tensors; use --device cpu")
    if device.type != "cuda":
        return device
    # one GPU named by the reader: only for a single process per machine
    if device.index is not None:
        if local_world_size > 1:
            raise CourseError(
                f"--device {requested}: under torchrun every rank takes cuda:LOCAL_RANK; use --device cuda"
            )
        return device
    if cuda_gpus == 1 and local_rank > 0:
        # A launcher that gives each process its own GPU (SLURM's --gpus-per-task, or
        # CUDA_VISIBLE_DEVICES set per task) leaves each of them one GPU, always numbered 0.
        print(
            f"note: LOCAL_RANK {local_rank} sees one GPU, its own (CUDA_VISIBLE_DEVICES per process): "
            "using it as cuda:0; ranks sharing one GPU would be refused by NCCL",
            flush=True,
        )
        return torch.device("cuda", 0)
    if local_rank >= cuda_gpus:
        raise CourseError(
            f"LOCAL_RANK {local_rank}, but this machine has {cuda_gpus} GPU(s): "
            "start at most that many processes per machine (--nproc_per_node)"
        )
    return torch.device("cuda", local_rank)


def cpu_threads_per_rank(
    local_world_size: int, cpu_count: int, omp_num_threads: str | None
) -> tuple[int | None, str]:
    """Torch threads for each of `local_world_size` ranks sharing one CPU, and why (None: torch's
    choice).

    Unset, torch gives every rank all the cores; torchrun's OMP_NUM_THREADS=1 leaves a big CPU idle.
    So then each rank gets an equal share; any other OMP_NUM_THREADS is the reader's choice.
    """
    if local_world_size > 1 and omp_num_threads in (None, "1"):
        return max(
            1, cpu_count // local_world_size
        ), f"{cpu_count} cores / {local_world_size} rank(s)"
    return None, "OMP_NUM_THREADS" if omp_num_threads is not None else "torch's default"


def share_cpu_cores(local_world_size: int) -> str:
    """Give this rank its share of the CPU's cores; says how many threads it has, and why."""
    threads, why = cpu_threads_per_rank(
        local_world_size, os.cpu_count() or 1, os.environ.get("OMP_NUM_THREADS")
    )
    if threads is not None:
        torch.set_num_threads(threads)
    return f"{torch.get_num_threads()} CPU thread(s) per rank ({why})"
