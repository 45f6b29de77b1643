"""What a run reports: metrics.jsonl for plots and notebooks, the speed and MFU of each interval."""

import contextlib
import json
import time
from pathlib import Path

import torch


def model_flops_utilization(
    flops_per_token: float, tokens_per_sec: float, peak: float | None, devices: int = 1
) -> float | None:
    """MFU: the model's FLOP/s over the hardware's (all `devices`: their tokens, their peaks)."""
    if not peak:  # a device whose peak the course does not know
        return None
    return flops_per_token * tokens_per_sec / (peak * devices)


class Throughput:
    """Milliseconds per step, tokens/s and MFU between log lines; the tokens of all `devices`."""

    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: float,
        peak: float | None,
        devices: int = 1,
        start: int = 0,
    ):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.devices = devices
        self.since_iter = start  # the interval's first step
        self.since = time.perf_counter()  # and when it began

    def measure(self, iter_num: int) -> dict:
        """The figures since the last measure (or the start), for a metrics line; starts a
        new interval."""
        elapsed = time.perf_counter() - self.since
        steps = iter_num - self.since_iter
        tokens_per_sec = steps * self.tokens_per_step / elapsed
        mfu = model_flops_utilization(self.flops_per_token, tokens_per_sec, self.peak, self.devices)
        self.since_iter = iter_num
        self.since = time.perf_counter()
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
    """The most memory the run's tensors have held on a CUDA GPU, in MiB; None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


class MetricsLog:
    """metrics.jsonl, one JSON line per record. `resume_from`: the step a resumed run continues
    from (0: a new run)."""

    def __init__(self, path: str | Path, resume_from: int, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        if resume_from > 0 and self.path.exists():
            # the lines after the checkpoint's step go, so that each step appears once
            kept = [r for r in read_metrics(self.path) if r.get("iter", 0) <= resume_from]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        else:
            self.path.write_text("")  # a new run starts an empty file

    def write(self, **fields) -> None:
        if not self.enabled:
            return
        # None: a figure this device cannot give (MFU, GPU memory); round() keeps an int an int
        record = {name: round(value, 6) for name, value in fields.items() if value is not None}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    records = []
    for line in Path(path).read_text().splitlines():
        # a blank line, or one cut short by a crash mid-write
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records
