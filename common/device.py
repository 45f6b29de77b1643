"""Which device and number format a run uses, and the autocast context for it."""

from __future__ import annotations

import contextlib

import torch

from .errors import CourseError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(requested: str = "auto") -> torch.device:
    """auto: the first CUDA GPU, else Apple's mps, else the CPU."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise CourseError(f"--device {requested!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CourseError(f"--device {requested} asked for CUDA, but this PyTorch sees no CUDA GPU; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CourseError(f"--device {requested}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CourseError("--device mps asked for Apple's GPU, which is not available here; use --device cpu")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on GPUs that support it, float16 on older GPUs, float32 elsewhere."""
    if requested != "auto":
        dtype = DTYPES[requested]
        if device.type == "cpu" and dtype == torch.float16:
            raise CourseError("--dtype float16 is for GPUs; on the CPU use float32 or bfloat16")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass: matmuls in dtype, the weights stay float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def setup_math(device: torch.device) -> None:
    """TF32 matmuls on Ampere and newer: float32 ranges at tensor-core speed."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return str(device)
