"""What a run reports: metrics.jsonl for plots and notebooks, a progress bar for people, MFU."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

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

    for model, variant in PEAK_FLOPS:  # a variant the name spells out: "PCIE", "NVL", "SXM4"
        if variant and named(model) and any(w.startswith(variant.upper()) for w in words):
            return model, variant
    for model, variant in PEAK_FLOPS:  # else the part a bare name means
        if named(model) and variant == _DEFAULT_VARIANT.get(model, ""):
            return model, variant
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak FLOP/s for this dtype, or None where we do not know it."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), dtype)


def peak_flops_of(name: str, dtype: torch.dtype) -> float | None:
    model = gpu_model(name)
    key = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "tf32"}[dtype]
    return PEAK_FLOPS[model].get(key) if model else None


def model_flops_utilization(
    flops_per_token: float, tokens_per_sec: float, peak: float | None, devices: int = 1
) -> float | None:
    """MFU: the model's FLOP/s over the hardware's peak. tokens_per_sec counts the tokens of all
    `devices` together, so it is measured against all of their peaks: peak x devices."""
    return flops_per_token * tokens_per_sec / (peak * devices) if peak else None


class Throughput:
    """The speed between two log lines: milliseconds per step, tokens per second and MFU.

    `devices` run side by side (DataParallel's replicas, DDP's ranks) and tokens_per_step counts the
    tokens of all of them, so the MFU is measured against the peak of all of them together.
    """

    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: float,
        peak: float | None,
        devices: int = 1,
        start: int = 0,
    ):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.devices = peak, devices
        self.since_iter, self.since = start, time.perf_counter()

    def measure(self, iter_num: int) -> dict:
        """The figures since the last measure (or the start), for a metrics line; starts a new interval."""
        elapsed = time.perf_counter() - self.since
        steps = iter_num - self.since_iter
        tokens_per_sec = steps * self.tokens_per_step / elapsed
        mfu = model_flops_utilization(self.flops_per_token, tokens_per_sec, self.peak, self.devices)
        self.since_iter, self.since = iter_num, time.perf_counter()
        return {
            "tokens_seen": iter_num * self.tokens_per_step,
            "dt_ms": 1000 * elapsed / steps,
            "tokens_per_sec": tokens_per_sec,
            "mfu": mfu,
        }

    def restart_clock(self) -> None:
        """Time spent from here back to the last measure is not training time (an evaluation)."""
        self.since = time.perf_counter()


def max_memory_mb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


METRICS_NAME = "metrics.jsonl"  # in every run's --out-dir


def _parse(line: str) -> dict | None:
    """One metrics line, or None for a blank line or one cut short by a crash mid-write."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


class MetricsLog:
    """Appends one JSON object per line to <out-dir>/metrics.jsonl (only where `enabled`)."""

    def __init__(self, path: str | Path, enabled: bool = True, resume_from: int | None = None):
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from is None:
            self.path.write_text("")
        elif self.path.exists():
            # a resumed run rewrites what came after its checkpoint, so each iteration appears once
            keep = [
                line
                for line in self.path.read_text().splitlines()
                if (record := _parse(line)) is not None and record.get("iter", 0) <= resume_from
            ]
            self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, **fields) -> None:
        if not self.enabled:
            return
        record = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in fields.items() if v is not None}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    return [record for line in Path(path).read_text().splitlines() if (record := _parse(line)) is not None]


def _terminal_columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        return 0


class Progress:
    """A tqdm bar on a terminal; plain lines every log interval when output goes to a file."""

    def __init__(self, total: int, initial: int, enabled: bool = True, prefix: str = ""):
        self.prefix = prefix
        self.enabled = enabled
        # a bar needs a terminal that knows its width; a pseudo-terminal without a size (`script`,
        # some CI runners and IDE consoles) reports 0 columns, where tqdm would draw nothing at all
        self.on_terminal = enabled and sys.stderr.isatty() and _terminal_columns(sys.stderr) > 0
        self.bar = tqdm(
            total=total,
            initial=initial,
            disable=not self.on_terminal,
            dynamic_ncols=True,
            desc=prefix.strip() or None,
        )

    def step(
        self, iter_num: int, loss: float | None = None, figures: dict | None = None, lr: float | None = None
    ) -> None:
        """Advance one step; the loss and the speed (Throughput's figures) are shown when given."""
        if not self.enabled:
            return
        self.bar.update(1)
        if loss is None:
            return
        tokens_per_sec = figures["tokens_per_sec"]
        if self.on_terminal:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_sec:,.0f}", refresh=False)
        else:
            speed = f"{tokens_per_sec:,.0f} tokens/s"
            print(f"{self.prefix}iter {iter_num:>6} | loss {loss:.4f} | lr {lr:.2e} | {speed}", flush=True)

    def print(self, message: str) -> None:
        """A line that does not tear the bar."""
        if self.enabled:
            (self.bar.write if self.on_terminal else print)(f"{self.prefix}{message}")
            sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
