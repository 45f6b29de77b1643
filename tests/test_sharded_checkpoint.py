"""07_fsdp/sharded_checkpoint.py: 2 ranks write their shards with torch.distributed.checkpoint, and
3 ranks, cut another way, read back exactly what the 2 ranks held (real torchrun, gloo, the CPU)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tools.launch import REPO, run_torchrun

# long end-to-end runs: the slow stage's (python -m pytest -m slow; CI runs it)
pytestmark = pytest.mark.slow

SCRIPT = REPO / "07_fsdp" / "sharded_checkpoint.py"


def test_three_ranks_read_two_ranks_shards(tmp_path):
    saved = run_torchrun(SCRIPT, 2, ["save", "--out-dir", tmp_path]).stdout
    folder = tmp_path / "ckpt_sharded"
    # a file of shards per rank that wrote, beside the map of which rows each holds
    wrote = f"2 ranks wrote {folder}: .metadata, __0_0.distcp, __1_0.distcp"
    assert f"[rank 0] {wrote}" in saved.splitlines(), saved
    # the folder was put in place whole: no temporary one left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_sharded", "whole.pt"]
    # the shards hold the model whole, as DCP's own converter (one process, no ranks) reads them
    converted = tmp_path / "converted.pt"
    dcp_to_torch_save(folder, converted)
    model = torch.load(converted, weights_only=True)["model"]
    whole_model, _ = torch.load(tmp_path / "whole.pt", weights_only=True)
    torch.testing.assert_close(model, whole_model, rtol=0, atol=0)

    loaded = run_torchrun(SCRIPT, 3, ["load", "--out-dir", tmp_path]).stdout
    same = "the 29 model tensors and the optimizer state equal the saved ones exactly"
    assert f"[rank 0] 3 ranks read {folder}: {same}" in loaded.splitlines(), loaded
