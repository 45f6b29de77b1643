"""Run a training script as `python SCRIPT ARGS` would, and write down what each optimizer step did.

    python tools/check_probe.py FACTS_DIR SCRIPT [ARGS...]        (or the same under torchrun)

tools/check.py starts the learner's script and chapter 01 through this, so that it can compare
more than the logged loss: for every optimizer step of every rank, which training windows were
read, the gradient's norm, how often the gradients were zeroed and a checksum of the parameters;
at the end, every rank's parameters. It only watches: nothing of the script's run changes.
Each rank writes FACTS_DIR/rank<R>.json and FACTS_DIR/rank<R>.pt, even when the script fails.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.optim.optimizer as optim_hooks

REPO = Path(__file__).resolve().parents[1]


class Recorder:
    def __init__(self):
        self.steps: list[dict] = []
        self.windows: list[int] = []  # training windows read since the last optimizer step
        self.zero_grads = 0  # zero_grad calls since the last optimizer step
        self.clip_norm: float | None = None  # the norm clip_grad_norm_ measured before clipping
        self.params: list[torch.Tensor] = []

    def pre_step(self, optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.params = params
        grads = [p.grad.detach().double().norm() for p in params if p.grad is not None]
        norm = torch.stack(grads).norm().item() if grads else 0.0
        self.steps.append(
            {
                "windows": self.windows,
                "zero_grads": self.zero_grads,
                "grad_norm": self.clip_norm if self.clip_norm is not None else norm,
            }
        )
        self.windows, self.zero_grads, self.clip_norm = [], 0, None

    def post_step(self, optimizer, args, kwargs):
        flat = torch.cat([p.detach().double().reshape(-1) for p in self.params])
        self.steps[-1]["checksum"] = [flat.sum().item(), flat.square().sum().item()]

    def save(self, folder: Path, rank: int, status: int | None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        facts = {"rank": rank, "status": status, "steps": self.steps}
        (folder / f"rank{rank}.json").write_text(json.dumps(facts))
        if self.params:
            flat = torch.cat([p.detach().double().reshape(-1).cpu() for p in self.params])
            torch.save(flat, folder / f"rank{rank}.pt")


def watch(recorder: Recorder) -> None:
    """Hooks on what every training script calls: the data set, zero_grad, clipping, the optimizer."""
    from common.data import TokenWindows

    read = TokenWindows.__getitem__

    def reading(self, i):
        if self.path.name == "train.bin":
            recorder.windows.append(int(i))
        return read(self, i)

    TokenWindows.__getitem__ = reading

    for owner in (torch.optim.Optimizer, torch.nn.Module):
        zero = owner.zero_grad

        def zeroing(self, *args, _zero=zero, **kwargs):
            recorder.zero_grads += 1
            return _zero(self, *args, **kwargs)

        owner.zero_grad = zeroing

    clip = torch.nn.utils.clip_grad_norm_

    def clipping(*args, **kwargs):
        norm = clip(*args, **kwargs)
        recorder.clip_norm = float(norm)
        return norm

    torch.nn.utils.clip_grad_norm_ = clipping
    optim_hooks.register_optimizer_step_pre_hook(recorder.pre_step)
    optim_hooks.register_optimizer_step_post_hook(recorder.post_step)


def main() -> None:
    folder, script, *args = sys.argv[1:]
    sys.path.insert(0, str(REPO))  # common/, for a learner's copy kept outside the course
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python SCRIPT` puts it first
    sys.argv = [script, *args]
    recorder = Recorder()
    watch(recorder)
    status: int | None = 1
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        raise
    finally:
        recorder.save(Path(folder), int(os.environ.get("RANK", 0)), status)


if __name__ == "__main__":
    main()
