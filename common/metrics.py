"""What a run reports: metrics.jsonl for plots and notebooks, a line per log step, the speed and MFU
of each interval."""

import contextlib
import json
import time
from pathlib import Path

import torch

from .support.gpus import peak_flops


class Throughput:
    """Milliseconds per step, tokens/s and MFU between log lines; MFU against the peak of all
    `devices` (their tokens are in tokens_per_step; no MFU on a device the course does not know)."""

    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: float,
        device: torch.device,
        dtype: torch.dtype,
        devices: int = 1,
    ):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.device = device
        self.peak = None  # no MFU off CUDA, nor on a GPU the table does not know
        if device.type == "cuda":
            self.peak = peak_flops(torch.cuda.get_device_name(device), dtype)
        self.devices = devices
        self.restart_clock(0)

    def measure(self, iter_num: int) -> dict:
        """The figures since the last measure (or the start), for a metrics line; starts a
        new interval."""
        elapsed = time.perf_counter() - self.since
        steps = iter_num - self.since_iter
        tokens_per_sec = steps * self.tokens_per_step / elapsed
        # MFU: the model's FLOP/s over the hardware's (all `devices`: their tokens, their peaks)
        mfu = None
        if self.peak:
            mfu = self.flops_per_token * tokens_per_sec / (self.peak * self.devices)
        self.since_iter = iter_num
        self.since = time.perf_counter()
        return {
            "tokens_seen": iter_num * self.tokens_per_step,
            "dt_ms": 1000 * elapsed / steps,
            "tokens_per_sec": tokens_per_sec,
            "mfu": mfu,
        }

    def restart_clock(self, iter_num: int | None = None) -> None:
        """A new interval from now (from step `iter_num`, when given): the time since the last
        measure was not training time (an evaluation)."""
        if iter_num is not None:
            self.since_iter = iter_num
        self.since = time.perf_counter()


def read_metrics(path: str | Path) -> list[dict]:
    records = []
    for line in Path(path).read_text().splitlines():
        # a blank line, or one cut short by a crash mid-write
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


class RunLog:
    """What a run reports, one call per log step and one per evaluation: a line of metrics.jsonl,
    a printed line, and the speed and MFU since the last log step. Under torchrun `log`
    (common/distributed.RankLog) says who speaks: only rank 0 writes and prints, its lines carry
    its prefix; on the other ranks every call does nothing."""

    def __init__(self, out_dir: Path, start: int, speed: Throughput, log=None):
        self.log = log
        self.speaks = log is None or log.speaks
        self.speed = speed
        self.speed.restart_clock(start)
        self.metrics = out_dir / "metrics.jsonl"
        if not self.speaks:
            return
        if start > 0 and self.metrics.exists():
            # resumed: the lines after the checkpoint's step go, so that each step appears once
            kept = [record for record in read_metrics(self.metrics) if record["iter"] <= start]
            self.metrics.write_text("".join(json.dumps(record) + "\n" for record in kept))
        else:
            self.metrics.write_text("")  # a new run starts an empty file

    def step(self, iter_num: int, loss: float, lr: float) -> None:
        """A log step: its loss and learning rate, and the speed since the last one."""
        if not self.speaks:
            return
        figures = self.speed.measure(iter_num)
        # the most memory the run's tensors have held on a CUDA GPU, in MiB; None elsewhere
        memory = None
        if self.speed.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(self.speed.device) / 2**20
        self.write(iter=iter_num, loss=loss, lr=lr, **figures, max_mem_mb=memory)
        speed = f"{figures['tokens_per_sec']:,.0f} tokens/s"
        self.say(f"iter {iter_num:>6} | loss {loss:.4f} | lr {lr:.2e} | {speed}")

    def evaluation(self, iter_num: int, val_loss: float, checkpoint: Path) -> None:
        """An evaluation's loss and the checkpoint saved after it, in a line; the time they took is
        not training time."""
        if not self.speaks:
            return
        self.write(iter=iter_num, val_loss=val_loss)
        self.say(f"step {iter_num}: val loss {val_loss:.4f}, checkpoint saved to {checkpoint}")
        self.speed.restart_clock()

    def write(self, **fields) -> None:
        """One line of metrics.jsonl."""
        # None: a figure this device cannot give (MFU, GPU memory); round() keeps an int an int
        record = {name: round(value, 6) for name, value in fields.items() if value is not None}
        with open(self.metrics, "a") as f:
            f.write(json.dumps(record) + "\n")

    def say(self, line: str) -> None:
        """A printed line, at once: whoever reads the output (a log file, a test) sees it now."""
        if self.log is None:
            print(line, flush=True)
        else:
            self.log(line)
