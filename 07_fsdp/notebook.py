# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 07 — shard the state (FSDP)
#
# Under DDP every rank holds the whole model, its gradients and AdamW's two averages. FSDP cuts
# each of them in W pieces, one per rank, and gathers a block's parameters from all ranks just
# before the block runs (for its forward, then again for its backward). The gradients are averaged
# over the ranks and cut in one step, a reduce-scatter, so each rank ends with the average for its
# own piece, and the optimizer updates only that piece.
#
# Below: how FSDP cuts a tensor, what each rank of the chapter's script holds, and a short run
# against chapter 01.

# %%
# Setup: import the notebooks' helpers (tools/notebook.py) from the course's root folder,
# the first folder above Jupyter's that holds common/
import sys
from pathlib import Path

sys.path.insert(
    0, str(next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "common").is_dir()), ""))
)
import torch

from tools.notebook import RUNS, TINY, clean_up, compare, plot_losses, setup, torchrun, train

setup()

# %% [markdown]
# ## How a tensor is cut
#
# FSDP2 cuts every parameter along its first dimension, its rows, in W pieces of ceil(rows / W)
# rows, the last ones shorter when W does not divide the rows (`torch.chunk` cuts the same way).
# The tiny model's output matrix has 50,304 rows; its position table 32.

# %%
from common.model import GPT, model_config

with torch.device("meta"):  # shapes only: nothing is allocated
    model = GPT(model_config("tiny"))
for name in ("lm_head.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.bias"):
    param = model.get_parameter(name)
    for world in (2, 3):
        rows = [len(piece) for piece in torch.arange(param.shape[0]).chunk(world)]
        print(f"{name:<36} {tuple(param.shape)!s:<12} W={world}: rows per rank {rows}")

# %% [markdown]
# ## What each rank holds
#
# The chapter's script, on 2 ranks and then 3, for 3 steps: at the end every rank prints the bytes
# of the parameters, gradients and optimizer state it holds, against what a DDP rank holds.

# %%
import re

three_steps = list(TINY)
three_steps[three_steps.index("--max-iters") + 1] = "3"  # 3 steps, not the notebooks' usual run
for world, batch in ((2, "6"), (3, "4")):  # a global batch of 12 either way
    out = torchrun(
        "07_fsdp/train.py",
        world,
        *three_steps,
        "--batch-size",
        batch,
        "--out-dir",
        RUNS / f"held{world}",
        show=0,
    )
    print(f"{world} ranks:")
    # the ranks share one output, so one rank's line may run into another's: cut at each line's end
    for line in sorted(re.findall(r"\[node 0 rank \d local \d\] holds .*?of DDP's [\d.]+ MB", out)):
        print("  " + line)

# %% [markdown]
# ## The same run as chapter 01
#
# 2 ranks of 4 sequences: chapter 01's global batch of 8. Sharded or not, the ranks compute the
# same sums of the same numbers: the losses are chapter 01's.

# %%
from common.metrics import read_metrics

ref = train("01_single_gpu", "ch01", "--batch-size", "8")
torchrun("07_fsdp/train.py", 2, *TINY, "--batch-size", "4", "--out-dir", RUNS / "ch07", show=3)
ch07 = read_metrics(RUNS / "ch07" / "metrics.jsonl")
plot_losses(
    {"01: 1 process, batch 8": ref, "07: FSDP, 2 ranks x batch 4": ch07},
    "Chapter 07 matches chapter 01",
)
print(f"largest per-step loss difference: {compare(ref, ch07):.2e}")
assert compare(ref, ch07) < 1e-4

# %% [markdown]
# ## ckpt.pt holds whole tensors
#
# Before saving, `gather_and_save` gathers the shards into rank 0's memory (`gather_full_state`:
# `get_model_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))`), so the
# file is the one chapter 01 writes: the same names and whole shapes, so chapter 01 resumes it.

# %%
saved = torch.load(RUNS / "ch07" / "ckpt.pt", weights_only=True)
reference = torch.load(RUNS / "ch01" / "ckpt.pt", weights_only=True)
for name in ("lm_head.weight", "transformer.wpe.weight"):
    print(f"{name}: {tuple(saved['model'][name].shape)} in ckpt.pt, as in chapter 01's")
shapes = {name: tensor.shape for name, tensor in saved["model"].items()}
assert shapes == {name: tensor.shape for name, tensor in reference["model"].items()}

# %% [markdown]
# ## Inside one step
#
# One FSDP2 step on 2 ranks, traced by `torch.profiler` (its run and
# captions in `docs/figures/CAPTIONS.md`): each block is gathered before its forward and again
# before its backward, and its gradient is reduce-scattered right after. The root unit is gathered
# once and stays whole until its backward. Then what one rank holds under DDP, ZeRO-1 and FSDP,
# with that root unit hatched.

# %%
from IPython.display import Image, display

display(Image(filename="../docs/figures/fsdp_step.png"))
display(Image(filename="../docs/figures/memory_per_rank.png"))

# %% [markdown]
# ## Questions
#
# * With 3 ranks, which rank holds the fewest bytes, and why by so little? (The last: each
#   tensor's rows are cut in pieces of ceil(rows / 3), so only the last piece is shorter, by
#   less than 3 rows.)
# * `sum(p.numel() for p in model.parameters())` on a sharded model: the whole model's count,
#   or a rank's? (The whole: a DTensor reports its whole shape. `p.to_local().numel()` counts
#   the rank's piece.)
# * Rank 0 alone runs a forward to print a sample. What happens? (gloo and NCCL pair collectives
#   by their order, so its all-gathers pair with the other ranks' next collectives: the forward
#   returns, and the run hangs later, somewhere else, until the timeout. Every rank must run
#   every forward, the sample's included.)

# %%
# Clean up: the runs above (checkpoints included) were only for this notebook
clean_up()
