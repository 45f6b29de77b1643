"""What a run reports: metrics.jsonl for plots and notebooks, the speed and MFU of each interval."""

import contextlib
import json
import time
from pathlib import Path

import torch

from .support.gpus import peak_flops as peak_flops  # a table lookup; re-exported for the chapters
from .support.progress import Progress as Progress  # plumbing; re-exported for the chapters
from .support.rundir import METRICS_NAME as METRICS_NAME  # in every run's --out-dir


def model_flops_utilization(flops_per_token: float, tokens_per_sec: float, peak, devices: int = 1):
    """MFU: the model's FLOP/s over the hardware's: tokens of all `devices` against all their peaks."""
    return flops_per_token * tokens_per_sec / (peak * devices) if peak else None


class Throughput:
    """Milliseconds per step, tokens/s and MFU between log lines; the tokens of all `devices`
    together."""

    def __init__(
        self, tokens_per_step: int, flops_per_token: float, peak, devices: int = 1, start: int = 0
    ):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.devices = peak, devices
        self.since_iter, self.since = start, time.perf_counter()

    def measure(self, iter_num: int) -> dict:
        """The figures since the last measure (or the start), for a metrics line; starts a new
        interval."""
        elapsed, steps = time.perf_counter() - self.since, iter_num - self.since_iter
        tokens_per_sec = steps * self.tokens_per_step / elapsed
        mfu = model_flops_utilization(self.flops_per_token, tokens_per_sec, self.peak, self.devices)
        self.since_iter, self.since = iter_num, time.perf_counter()
        dt_ms, tokens_seen = 1000 * elapsed / steps, iter_num * self.tokens_per_step
        return {
            "tokens_seen": tokens_seen,
            "dt_ms": dt_ms,
            "tokens_per_sec": tokens_per_sec,
            "mfu": mfu,
        }

    def restart_clock(self) -> None:
        """Time spent from here back to the last measure is not training time (an evaluation)."""
        self.since = time.perf_counter()


def max_memory_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


class MetricsLog:
    def __init__(self, path: str | Path, enabled: bool = True, resume_from: int | None = None):
        self.path, self.enabled = Path(path), enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a resumed run drops what came after its checkpoint, so each iteration appears once
        old = [] if resume_from is None or not self.path.exists() else read_metrics(self.path)
        self.path.write_text(
            "".join(json.dumps(r) + "\n" for r in old if r.get("iter", 0) <= resume_from)
        )

    def write(self, **fields) -> None:
        if not self.enabled:
            return
        record = {
            k: round(v, 6) if isinstance(v, float) else v
            for k, v in fields.items()
            if v is not None
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    records = []
    for line in Path(path).read_text().splitlines():
        # a blank line, or one cut short by a crash mid-write
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records
