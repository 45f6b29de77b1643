"""Peak FLOP/s of the GPUs the course knows, for MFU: a lookup, not a lesson."""

import torch

# Dense peak FLOP/s of the tensor cores from the data sheets, by dtype (float32 matmuls run as
# tf32). The first name that matches counts: a variant before its bare name (the SXM part).
# Unknown: no MFU.
COLUMNS = (torch.bfloat16, torch.float16, torch.float32)
PEAK_FLOPS = {
    "H200 NVL, H100 NVL": (835e12, 835e12, 418e12),
    "H100 PCIe": (756e12, 756e12, 378e12),
    "H200, H100": (989e12, 989e12, 494e12),
    "A100": (312e12, 312e12, 156e12),  # SXM and PCIe alike
    "A10G": (70e12, 70e12, 35e12),
    "L4": (121e12, 121e12, 60e12),
    "L40": (181e12, 181e12, 90.5e12),
    "L40S": (362e12, 362e12, 183e12),
    "RTX 4090": (165e12, 165e12, 83e12),
    "RTX 3090": (71e12, 71e12, 36e12),
    "V100 PCIe": (None, 112e12, 14e12),
    "V100": (None, 125e12, 15.7e12),
    "T4": (None, 65e12, 8.1e12),
}


def peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """The peak FLOP/s in `dtype` of the GPU torch.cuda.get_device_name calls `name`; None for a
    GPU the table does not know."""
    # "NVIDIA A100-SXM4-80GB" -> " NVIDIA A100 SXM4 80GB "
    name = f" {name.upper().replace('-', ' ')} "
    for gpus, peaks in PEAK_FLOPS.items():  # whole words: "NVIDIA L40" is not an "L4"
        if any(f" {gpu} " in name for gpu in gpus.upper().split(", ")):
            return dict(zip(COLUMNS, peaks)).get(dtype)
    return None
