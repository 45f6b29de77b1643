"""Which device and number format a run uses; GPU decisions take plain facts, so that a CPU
can test them."""

import contextlib

import torch

from .support.errors import CourseError

DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float64")}


def pick_device(requested: str) -> torch.device:
    """--device: auto takes a CUDA GPU, else Apple's GPU (mps), else the CPU."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = parse_device(requested, torch.cuda.device_count())  # 0 without CUDA
    if device.type == "cuda" and device.index is not None:
        # now, or pinned memory and tensors made on plain "cuda" land on GPU 0, which may
        # be someone else's
        torch.cuda.set_device(device)
    return device


def parse_device(requested: str, cuda_gpus: int) -> torch.device:
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise CourseError(
            f"--device {requested!r} is not a device; use auto, cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "cuda" and cuda_gpus == 0:
        raise CourseError(
            f"--device {requested} asked for CUDA, but this PyTorch sees no CUDA GPU; "
            "use --device cpu"
        )
    if device.type == "cuda" and device.index is not None and device.index >= cuda_gpus:
        raise CourseError(f"--device {requested}: only {cuda_gpus} CUDA GPU(s) are visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CourseError(
            "--device mps asked for Apple's GPU, which is not available here; use --device cpu"
        )
    return device


def auto_dtype(capability: tuple[int, int]) -> torch.dtype:
    """--dtype auto on a CUDA GPU of this compute capability: bfloat16 where GPUs have its tensor
    cores (8.0 on); older ones emulate it, slowly."""
    if capability >= (8, 0):
        return torch.bfloat16
    return torch.float16


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested != "auto":
        dtype = DTYPES[requested]
        if device.type == "cpu" and dtype == torch.float16:
            raise CourseError("--dtype float16 is for GPUs; on the CPU use float32 or bfloat16")
        if device.type == "mps" and dtype == torch.float64:
            raise CourseError(
                "--dtype float64: Apple's mps has no float64; use --device cpu for it"
            )
        return dtype
    if device.type != "cuda":
        return torch.float32  # auto off CUDA
    return auto_dtype(torch.cuda.get_device_capability(device))


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass: matmuls in dtype, the weights stay float32."""
    if dtype in (torch.float32, torch.float64):
        return contextlib.nullcontext()  # full precision: nothing to switch on
    return torch.autocast(device_type=device.type, dtype=dtype)


def setup_math(device: torch.device, dtype: torch.dtype | None = None) -> None:
    """TF32 matmuls on Ampere on; --dtype float64: every tensor float64, rounding errors
    1e-16, not 1e-7."""
    if dtype == torch.float64:
        torch.set_default_dtype(torch.float64)
    elif device.type == "cuda":
        # cuDNN's TF32 is on by default, and the GPT has no convolution for it anyway
        torch.backends.cuda.matmul.allow_tf32 = True


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return str(device)
