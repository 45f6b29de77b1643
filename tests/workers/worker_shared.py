"""What the workers that tests run under torchrun share: a gloo process group around their work,
rank 0's results file, a flat copy of tensors to compare, and an optimizer state's bytes."""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


@contextlib.contextmanager
def gloo_group(timeout_s: float = 60):
    """A gloo process group of torchrun's ranks, destroyed on the way out. It yields the rank
    and the world size."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def write_results(out_dir: Path, results: dict) -> None:
    """Rank 0 writes OUT_DIR/results.json for the test to assert on; the other ranks nothing."""
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))


def flat(tensors) -> torch.Tensor:
    """The tensors' values, detached, in one 1-D tensor."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def state_bytes(state: dict) -> int:
    """The bytes of the tensors of an optimizer's state (its `state` dict)."""
    return sum(
        t.numel() * t.element_size()
        for s in state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
