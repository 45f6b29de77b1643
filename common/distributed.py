"""What the DDP chapters need but do not teach: the refusal of a start without torchrun, lines that
say which rank wrote them, the refusal of devices the ranks cannot use and their CPU threads, the
check that no two ranks share a GPU, rank 0's claim of the run folder for all, one rank first,
each rank's own copy on its own disk (chapter 08), and what chapter 06 adds for torchrun's
restarts: a meeting point that survives them and the ranks' agreement on where to continue.

Every function here that takes no device facts is a collective or joins one: every rank of the
group must call it, in the same order, or the ranks that did wait for the others until the timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import load_checkpoint, save_atomically
from .device import parse_device
from .support.errors import CourseError
from .support.rundir import CKPT_NAME, folder_problem

# Tokenizing a large data set can take hours, far longer than a training collective may wait.
PREPARATION_TIMEOUT = datetime.timedelta(hours=6)


def require_torchrun() -> None:
    """Refuse, with one line, a DDP chapter started without torchrun, which tells each process its
    place (RANK, WORLD_SIZE, LOCAL_RANK, ...). A world of one is torchrun --nproc_per_node=1."""
    if "RANK" in os.environ:
        return
    script = sys.argv[0]
    raise CourseError(
        f"{script} runs under torchrun, which starts one process per device: "
        f"torchrun --standalone --nproc_per_node=N {script} (N=1 for a single process)"
    )


class RankLog:
    """Lines that say which rank wrote them: `log(text)` from rank 0 only (it speaks for every
    rank), `log.every_rank(text)` from each. Each line is one write, so the lines of ranks that
    share a terminal or a log file never run into each other."""

    def __init__(self, prefix: str, speaks: bool):
        self.prefix = prefix
        self.speaks = speaks

    def __call__(self, message: str) -> None:
        if self.speaks:
            self.every_rank(message)

    def every_rank(self, message: str) -> None:
        sys.stdout.write(f"{self.prefix} {message}\n")
        sys.stdout.flush()


def gpu_identity(device: torch.device) -> str:
    """The physical GPU behind `device`: its UUID where CUDA reports one, which stays the same
    whatever CUDA_VISIBLE_DEVICES numbers it, else its PCI address."""
    properties = torch.cuda.get_device_properties(device)
    uuid = getattr(properties, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    domain = getattr(properties, "pci_domain_id", 0)
    bus = getattr(properties, "pci_bus_id", 0)
    slot = getattr(properties, "pci_device_id", 0)
    return f"PCI {domain:04x}:{bus:02x}:{slot:02x}"


def ranks_sharing_a_gpu(gpus: list[tuple[str, str | None]]) -> list[list[int]]:
    """The groups of ranks that drive the same GPU, from every rank's (host, GPU identity) in rank
    order; [] when every GPU has one rank. An identity of None is a rank without a GPU, which
    shares nothing."""
    ranks_of_gpu: dict[tuple[str, str], list[int]] = {}
    for rank, (host, gpu) in enumerate(gpus):
        if gpu is None:
            continue
        ranks_of_gpu.setdefault((host, gpu), []).append(rank)
    return [ranks for ranks in ranks_of_gpu.values() if len(ranks) > 1]


def refuse_shared_gpus(device: torch.device, timeout: datetime.timedelta) -> None:
    """Refuse, with one line, a job in which two ranks drive the same GPU (a collective: every rank
    calls it; on the CPU it does nothing). Every rank's host and GPU are gathered to every rank,
    over a gloo group of their own, destroyed when done, so that no NCCL connection is made before
    the check.

    Two processes on one GPU would share its memory and take turns on it, and NCCL refuses them
    with a traceback. This happens when the GPUs a process sees are chosen per process
    (CUDA_VISIBLE_DEVICES) and two choices overlap, or when two torchruns on one machine (two
    simulated nodes) both count their GPUs from cuda:0.
    """
    if device.type != "cuda":
        return
    group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        gpus: list[tuple[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gpus, (platform.node(), gpu_identity(device)), group=group)
    finally:
        dist.destroy_process_group(group)
    shared = ranks_sharing_a_gpu(gpus)
    if shared:
        ranks = shared[0]
        host, gpu = gpus[ranks[0]]
        raise CourseError(
            f"ranks {ranks} drive the same GPU ({gpu} on {host}): start at most one process per "
            "GPU on each machine (--nproc_per_node, over all the torchruns there), and give "
            "processes that choose their GPUs (CUDA_VISIBLE_DEVICES) different ones"
        )


def claim_out_dir_on_rank0(out_dir: Path, resume: bool) -> None:
    """The run folder claimed for every rank (a collective): rank 0 checks it and locks it for as
    long as it lives (common/support/rundir.py), then tells the others whether the run may use it,
    so that a refusal is every rank's one line, not rank 0's alone."""
    verdict: list[str | None] = [None]
    if dist.get_rank() == 0:
        verdict = [folder_problem(out_dir, resume)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CourseError(verdict[0])


@contextlib.contextmanager
def one_rank_first(is_first: bool):
    """Run the block on the first rank, then on every other one: for work done once on disk.

    The others wait until the first rank has finished the block (the data preparation), then run
    it and find the work done. They wait in a group of their own (gloo: a CPU barrier, whatever the
    training backend) with a timeout of hours, so a slow preparation is not taken for a dead peer.
    The group holds a connection to every other rank, so it is destroyed as soon as it is done.
    """
    group = dist.new_group(backend="gloo", timeout=PREPARATION_TIMEOUT)
    try:
        if not is_first:
            dist.barrier(group=group)
        yield
        if is_first:
            dist.barrier(group=group)
    finally:
        dist.destroy_process_group(group)


def ranks_unlike_rank0(model: torch.nn.Module) -> int:
    """How many ranks hold parameters that differ from rank 0's, bit for bit (0 on every rank when
    DDP kept its promise: the same start and the same averaged gradients keep every copy equal).

    Each rank sends a 32-byte digest of its parameters' bytes, not the parameters: the check
    adds nothing worth counting to a slow link (chapter 08)."""
    digest = hashlib.sha256()
    for param in model.parameters():
        raw = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().tobytes())
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest.hexdigest())
    return sum(1 for found in digests if found != digests[0])


def own_copy_path(out_dir: Path, rank: int) -> Path:
    """Where a rank keeps its own copy of the model and its optimizer (chapter 08): beside ckpt.pt,
    in its own --out-dir, on the disk of the node it runs on."""
    return out_dir / f"ckpt.rank{rank}.pt"


def previous_copy_path(path: Path) -> Path:
    """The rank's copy before its latest, kept until ckpt.pt names the latest's step."""
    return path.with_name(path.name.replace(".pt", ".previous.pt"))


def save_own_copy(out_dir: Path, iter_num: int, model: torch.nn.Module, optimizer) -> None:
    """This rank's copy and optimizer after step `iter_num`, written where it runs: nothing is
    sent. With the rank, the number of ranks and the node, which a resume must have again.

    A collective: it returns when every rank has saved, so that ckpt.pt, written after it, never
    names a step some rank has no copy of. The copy before stays: a stop before ckpt.pt is
    written resumes from it."""
    rank = dist.get_rank()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "iter_num": iter_num,
        "rank": rank,
        "world_size": dist.get_world_size(),
        "node_rank": int(os.environ["GROUP_RANK"]),
    }
    path = own_copy_path(out_dir, rank)
    if path.exists():
        os.replace(path, previous_copy_path(path))
    save_atomically(state, path)
    dist.barrier()


def load_own_copy(out_dir: Path) -> tuple[dict, dict]:
    """ckpt.pt and this rank's own copy of its step, to resume (a collective: every rank calls it).

    A resume needs the same ranks on the same nodes: each rank finds, in its own --out-dir, the
    file it saved itself, of ckpt.pt's step. Otherwise every rank stops with the first problem
    that a rank found, in one line."""
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    node_rank = int(os.environ["GROUP_RANK"])
    path = own_copy_path(out_dir, rank)
    redo = "resume with the same ranks on the same nodes, or start a new run in a new --out-dir"
    checkpoint = None
    step = None
    own = None
    problem = None
    try:
        checkpoint = load_checkpoint(out_dir)
        step = checkpoint["iter_num"]
        for candidate in (path, previous_copy_path(path)):
            if own is None and candidate.exists():
                saved = torch.load(candidate, map_location="cpu", weights_only=True)
                if saved["iter_num"] == step:
                    own = saved
                    path = candidate
        if own is None:
            problem = (
                f"rank {rank} on node {node_rank} finds no copy of its own of step {step} "
                f"at {path}: {redo}"
            )
        else:
            saved_by = (own["rank"], own["world_size"], own["node_rank"])
            if saved_by != (rank, world_size, node_rank):
                problem = (
                    f"{path} was saved by rank {saved_by[0]} of {saved_by[1]} on node "
                    f"{saved_by[2]}, and this is rank {rank} of {world_size} on node {node_rank}: "
                    f"{redo}"
                )
    except CourseError as err:
        problem = f"rank {rank} on node {node_rank}: {err}"
    # every node's ckpt.pt must be of the same step: a stop between two nodes' writes is not
    found: list[tuple[str | None, int | None]] = [(None, None)] * world_size
    dist.all_gather_object(found, (problem, step))
    for problem_found, _ in found:
        if problem_found is not None:
            raise CourseError(problem_found)
    steps = sorted({step_found for _, step_found in found})
    if len(steps) > 1:
        raise CourseError(
            f"the nodes' ckpt.pt are of steps {steps} (the run stopped while they were saved): "
            "start a new run in a new --out-dir"
        )
    return checkpoint, own


def restart_store(
    world_size: int, restart_count: int, timeout: datetime.timedelta
) -> dist.Store | None:
    """Where the ranks of this attempt meet: chapter 04's init_process_group, safe for restarts.

    Made safe for torchrun's restarts (--max-restarts). None: init_process_group connects to
    MASTER_ADDR itself.

    Under torchrun the meeting point can be torchrun's own key-value store
    (TORCHELASTIC_USE_AGENT_STORE=True), and that store outlives a restart: the processes of a
    restarted group would meet where the failed group met, read their dead predecessors' keys and
    wait for them (pytorch/pytorch#135712). PR #135957 fixed it for the c10d rendezvous by a new
    store for every round, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (launch_c10d.sh sets it), but
    the static rendezvous still shares one. So every attempt meets under its own prefix, the
    restart count, which with the static rendezvous every node counts alike.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt_{restart_count}", agent_store)


def agree_on_restart(restart_count: int, out_dir: Path, resume: bool) -> tuple[bool, bool]:
    """What the ranks agree on after torchrun restarted them (a collective: every rank calls it).

    Returns whether torchrun restarted any node (each counts its own restarts: a node restarted
    because another failed counts none, pytorch/pytorch#108158), and whether every rank sees the
    checkpoint. Only rank 0 writes it, but every rank reads it to resume, so across machines
    --out-dir must be on a file system all nodes see: a checkpoint that some ranks see and others
    do not, when the run continues (--resume, or a restart), is refused with one line.
    """
    checkpoint = out_dir / CKPT_NAME
    seen: list[tuple[int, bool] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (restart_count, checkpoint.exists()))
    restarted = any(count > 0 for count, _ in seen)
    visible = [found for _, found in seen]
    if (resume or restarted) and any(visible) and not all(visible):
        blind = [rank for rank, found in enumerate(visible) if not found]
        raise CourseError(
            f"ranks {blind} cannot see {checkpoint}, which rank 0 wrote: "
            "put --out-dir on a file system that every node shares"
        )
    return restarted, all(visible)


def ranks_use_gpus(requested: str, local_rank: int, local_world_size: int, cuda_gpus: int) -> bool:
    """Whether this machine's ranks each drive a GPU (cuda:LOCAL_RANK), or all run on the CPU; the
    settings that cannot work are refused, each with one line.

    Refused: a LOCAL_RANK beyond the machine's GPUs, one GPU included (mapping it to cuda:0 would
    put several ranks on one GPU); one GPU named (--device cuda:N), as every rank takes its own;
    Apple's mps, whose tensors NCCL and gloo cannot send. The decision takes the machine's GPU
    count as a plain number, so the tests can check it on a CPU for machines they do not have.
    """
    if requested == "auto":
        requested = "cuda" if cuda_gpus else "cpu"
    device = parse_device(requested, cuda_gpus)
    if device.type == "mps":
        raise CourseError("DDP's backends (NCCL, gloo) cannot send mps tensors; use --device cpu")
    if device.type != "cuda":
        return False
    if device.index is not None:
        raise CourseError(
            f"--device {requested}: under torchrun every rank takes cuda:LOCAL_RANK; use "
            "--device cuda, and CUDA_VISIBLE_DEVICES to choose the GPUs a machine's ranks see"
        )
    if local_rank >= cuda_gpus:
        raise CourseError(
            f"LOCAL_RANK {local_rank}, but this machine has {cuda_gpus} GPU(s): "
            "start at most that many processes per machine (--nproc_per_node)"
        )
    return True


def cpu_threads_per_rank(
    local_world_size: int, cpu_count: int, omp_num_threads: str | None
) -> int | None:
    """Torch threads for each of `local_world_size` ranks sharing one CPU (None: torch's choice).

    Unset, torch gives every rank all the cores; torchrun's OMP_NUM_THREADS=1 leaves a big CPU idle.
    So then each rank gets an equal share; any other OMP_NUM_THREADS is the reader's choice.
    """
    if local_world_size > 1 and omp_num_threads in (None, "1"):
        return max(1, cpu_count // local_world_size)
    return None


def share_cpu_cores(device: torch.device, local_world_size: int) -> None:
    """On the CPU, give this rank its share of the cores (a GPU rank keeps torch's default)."""
    if device.type != "cpu":
        return
    threads = cpu_threads_per_rank(
        local_world_size, os.cpu_count() or 1, os.environ.get("OMP_NUM_THREADS")
    )
    if threads is not None:
        torch.set_num_threads(threads)
