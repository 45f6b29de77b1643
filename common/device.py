"""Which device and number format a run uses, and the autocast context for it.

The GPU decisions are small functions of plain facts (a compute capability, a device name), so
the tests can check them on a CPU with the values real GPUs report.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .support.errors import CourseError

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def pick_device(requested: str = "auto") -> torch.device:
    """auto: the first CUDA GPU, else Apple's mps, else the CPU."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = parse_device(requested, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if device.type == "cuda" and device.index is not None:
        # Make it the current GPU now: pinned memory, capability queries and anything created on
        # plain "cuda" would otherwise land on GPU 0, which may be someone else's.
        torch.cuda.set_device(device)
    return device


def parse_device(requested: str, cuda_gpus: int) -> torch.device:
    """--device as a torch.device, checked against the `cuda_gpus` GPUs this machine has."""
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise CourseError(
            f"--device {requested!r} is not a device; use auto, cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "cuda" and cuda_gpus == 0:
        raise CourseError(
            f"--device {requested} asked for CUDA, but this PyTorch sees no CUDA GPU; use --device cpu"
        )
    if device.type == "cuda" and device.index is not None and device.index >= cuda_gpus:
        raise CourseError(f"--device {requested}: only {cuda_gpus} CUDA GPU(s) are visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CourseError("--device mps asked for Apple's GPU, which is not available here; use --device cpu")
    return device


def rank_device(requested: str, local_rank: int, local_world_size: int, cuda_gpus: int) -> torch.device:
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
    if device.index is not None:  # one GPU named by the reader: only for a single process per machine
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
    """Torch threads for each of `local_world_size` ranks sharing one CPU, and why (None: torch's choice).

    Torch alone would give every rank all the cores (oversubscribed); torchrun sets
    OMP_NUM_THREADS=1, which leaves a big CPU mostly idle. So when the threads are unset or 1, each
    rank gets an equal share of the cores; any other OMP_NUM_THREADS is the reader's choice.
    """
    if local_world_size > 1 and omp_num_threads in (None, "1"):
        return max(1, cpu_count // local_world_size), f"{cpu_count} cores / {local_world_size} rank(s)"
    return None, "OMP_NUM_THREADS" if omp_num_threads is not None else "torch's default"


def share_cpu_cores(local_world_size: int) -> str:
    """Give this rank its share of the CPU's cores; says how many threads it has, and why."""
    threads, why = cpu_threads_per_rank(
        local_world_size, os.cpu_count() or 1, os.environ.get("OMP_NUM_THREADS")
    )
    if threads is not None:
        torch.set_num_threads(threads)
    return f"{torch.get_num_threads()} CPU thread(s) per rank ({why})"


def auto_dtype(device_type: str, capability: tuple[int, int] | None = None) -> torch.dtype:
    """--dtype auto from the device's facts: bfloat16 where NVIDIA GPUs compute it in tensor cores.

    bfloat16 tensor cores came with compute capability 8.0 (Ampere: A100, RTX 30xx, then L4, H100,
    ...). Older GPUs (V100 is 7.0, T4 7.5) can store bfloat16 and emulate its arithmetic, which
    torch.cuda.is_bf16_supported() counts as support by default; there it is slow and
    torch.compile skips it, so they get float16 (with loss scaling) instead. The CPU and Apple's
    mps stay in float32.
    """
    if device_type == "cuda" and capability is not None:
        return torch.bfloat16 if capability >= (8, 0) else torch.float16
    return torch.float32


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on GPUs with bfloat16 tensor cores, float16 on older GPUs, float32 elsewhere."""
    if requested != "auto":
        dtype = DTYPES[requested]
        if device.type == "cpu" and dtype == torch.float16:
            raise CourseError("--dtype float16 is for GPUs; on the CPU use float32 or bfloat16")
        if device.type == "mps" and dtype == torch.float64:
            raise CourseError("--dtype float64: Apple's mps has no float64; use --device cpu for it")
        return dtype
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return auto_dtype(device.type, capability)


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass: matmuls in dtype, the weights stay float32.

    float32 and float64 need none: everything already computes in that format.
    """
    if dtype in (torch.float32, torch.float64):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def in_autocast(module, device: torch.device, dtype: torch.dtype):
    """`module`, called inside autocast(device, dtype): what nn.DataParallel's replicas need.

    The autocast number format belongs to the thread that entered it. DataParallel runs each
    replica in a thread of its own and turns autocast on there without saying which format, so a
    new thread gets the default (float16 on CUDA, bfloat16 on the CPU), whatever the run chose.
    Entering autocast inside the replica's call, in its own thread, gives it the run's format.
    """

    def call(*args, **kwargs):
        with autocast_context(device, dtype):
            return module(*args, **kwargs)

    return call


def setup_math(device: torch.device, dtype: torch.dtype | None = None) -> None:
    """TF32 matmuls on Ampere and newer: float32 ranges at tensor-core speed.

    --dtype float64 makes float64 torch's default, so the model, the optimizer's state and every
    tensor the loop creates are float64: slow, but with rounding errors about 1e-16 instead of
    float32's 1e-7, which shows what part of a difference between two runs is rounding.
    """
    if dtype == torch.float64:
        torch.set_default_dtype(torch.float64)
    if device.type == "cuda" and dtype != torch.float64:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return str(device)
