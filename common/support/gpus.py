"""Peak FLOP/s of the GPUs the course knows, for MFU: a lookup, not a lesson."""

from __future__ import annotations

import torch

# Dense peak FLOP/s (no sparsity) of the tensor cores, by data type, from the vendors' data sheets,
# keyed by (model, variant). "tf32" is float32 matmuls: TF32 tensor cores from Ampere on, plain
# float32 units on the V100 and T4. MFU is claimed only for devices listed here: an unknown device
# gets no MFU rather than a guess.
PEAK_FLOPS = {
    ("H200", "SXM"): {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12},
    ("H200", "NVL"): {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12},
    ("H100", "SXM"): {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12},
    ("H100", "PCIe"): {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12},
    ("H100", "NVL"): {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12},
    ("A100", "SXM"): {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12},
    ("A100", "PCIe"): {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12},
    ("A10G", ""): {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12},
    ("L4", ""): {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12},
    ("L40", ""): {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12},
    ("L40S", ""): {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12},
    ("RTX 4090", ""): {"bf16": 165e12, "fp16": 165e12, "tf32": 83e12},
    ("RTX 3090", ""): {"bf16": 71e12, "fp16": 71e12, "tf32": 36e12},
    ("V100", "SXM"): {"fp16": 125e12, "tf32": 15.7e12},
    ("V100", "PCIe"): {"fp16": 112e12, "tf32": 14e12},
    ("T4", ""): {"fp16": 65e12, "tf32": 8.1e12},
}
# The variant a bare name means: "NVIDIA H200" and "NVIDIA H100 80GB HBM3" are the SXM parts.
_DEFAULT_VARIANT = {"H200": "SXM", "H100": "SXM", "A100": "SXM", "V100": "SXM"}


def gpu_model(name: str) -> tuple[str, str] | None:
    """(model, variant) from a name as torch.cuda.get_device_name reports it, or None if unknown.

    Whole words only: "NVIDIA L40" is not an "L4", and "NVIDIA H200 NVL" is not the SXM H200.
    """
    words = name.upper().replace("-", " ").split()  # "NVIDIA A100-SXM4-80GB" -> NVIDIA A100 SXM4 80GB

    def named(model: str) -> bool:  # the model's words appear, whole and in order
        wanted = model.upper().split()
        return any(words[i : i + len(wanted)] == wanted for i in range(len(words)))

    known = [(model, variant) for model, variant in PEAK_FLOPS if named(model)]
    for model, variant in known:  # a variant the name spells out: "PCIE", "NVL", "SXM4"
        if variant and any(w.startswith(variant.upper()) for w in words):
            return model, variant
    for model, variant in known:  # else the part a bare name means
        if variant == _DEFAULT_VARIANT.get(model, ""):
            return model, variant
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak FLOP/s for this dtype, or None where we do not know it."""
    return peak_flops_of(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None


def peak_flops_of(name: str, dtype: torch.dtype) -> float | None:
    model = gpu_model(name)
    key = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "tf32"}.get(dtype)
    return PEAK_FLOPS[model].get(key) if model else None
