# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 04 — DistributedDataParallel under `torchrun`
#
# DDP runs **one process per device**. `torchrun` starts them and tells each its place through
# environment variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`). Every
# process builds the same model, reads its own share of each global batch (the
# `DistributedSampler` gives rank r the positions r, r+W, r+2W, … of the epoch's order), and
# during `backward()` DDP averages the gradients over all processes, so every copy takes the
# same step.
#
# In this notebook, on the CPU with two processes and the gloo backend:
#
# 1. a small program under `torchrun` shows what each rank is told, which sequences it reads, and
#    that the all-reduced gradient is the gradient of the whole batch;
# 2. the chapter's script runs as 2 ranks of 4 sequences and matches chapter 01 with 8.

# %%
# Setup: import the notebooks' helpers (tools/notebook.py) from the course's root folder,
# the first folder above Jupyter's that holds common/
import sys
from pathlib import Path

sys.path.insert(
    0, str(next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "common").is_dir()), ""))
)
import torch

from tools.notebook import (
    DATA_DIR,
    RUNS,
    TINY,
    clean_up,
    compare,
    plot_losses,
    setup,
    torchrun,
    train,
)

setup()

# %% [markdown]
# ## What each rank does
#
# The next cell shows a small program, `tests/workers/rank_worker.py`; the one after starts it
# twice with `torchrun --nproc-per-node=2 --standalone`. Each process prints one `RESULT` line.

# %%
from tools.notebook import WORKER, full_batch_gradient, results, show_source

show_source(WORKER)

# %%
from common.data import prepare

prepare("shakespeare", DATA_DIR)  # prepared before the ranks start, so none of them has to

grad_file = RUNS / "averaged_grad.pt"  # rank 0 saves the averaged gradient here
output = torchrun(WORKER, 2, "--data-dir", DATA_DIR, "--save-grad", grad_file, show=0)
ranks = results(output)
for r in ranks:
    print(
        f"rank {r['rank']} (local rank {r['local_rank']}, process {r['pid']}): "
        f"windows {r['windows']}, "
        f"loss {r['loss']:.4f}, own gradient norm {r['own_grad_norm']:.4f}, "
        f"after the all-reduce {r['averaged_grad_norm']:.4f}"
    )
assert len(ranks) == 2

# %% [markdown]
# The two ranks read different sequences, compute different losses and different gradients —
# and after the all-reduce they hold the same one. Interleaved, their windows are the first 8
# positions of the epoch's order, the batch chapter 01 reads, and the averaged gradient is the
# gradient chapter 01 computes on it:

# %%
order, full = full_batch_gradient()
interleaved = [w for pair in zip(*(r["windows"] for r in ranks)) for w in pair]
print("chapter 01's first batch:      ", order)
print("rank 0 and rank 1, interleaved:", interleaved)
assert interleaved == order

averaged = torch.load(grad_file, weights_only=True)
print(f"largest difference, averaged vs whole-batch gradient: {(averaged - full).abs().max():.2e}")
assert torch.allclose(averaged, full, atol=1e-6)

# %% [markdown]
# ## The chapter's script: 2 ranks x 4 sequences = chapter 01's 8
#
# Every rank prints its own first line (`[rank r] process …`); after that, rank 0 speaks for all
# (it logs, and writes `metrics.jsonl` and the checkpoint). At the end the script checks that the
# parameters are bit for bit the same on all ranks.

# %%
# Chapter 01's run with a global batch of 8 sequences: the reference every chapter must match
ref = train("01_single_gpu", "ch01", "--batch-size", "8")

# %%
from common.metrics import read_metrics

output = torchrun(
    "04_ddp/train.py", 2, *TINY, "--batch-size", "4", "--out-dir", RUNS / "ch04", show=3
)
print("\neach rank's own line:")
# the ranks share one output pipe, so a line can start right after another rank's text:
# cut there too
for line in output.replace("[rank ", "\n[rank ").splitlines():
    if line.startswith("[rank ") and " process " in line:
        print(" ", line)
assert "parameters identical on all 2 rank(s): yes" in output
ch04 = read_metrics(RUNS / "ch04" / "metrics.jsonl")

# %%
plot_losses(
    {"01: 1 process, batch 8": ref, "04: 2 processes x batch 4": ch04},
    "Chapter 04 matches chapter 01",
)
print(f"largest per-step loss difference: {compare(ref, ch04):.2e}")
assert compare(ref, ch04) < 1e-4
print(
    "files in the run folder (only rank 0 writes):",
    sorted(p.name for p in (RUNS / "ch04").iterdir()),
)

# %% [markdown]
# ## Inside one step
#
# One optimizer step of 2 micro-steps on 2 ranks, traced by `torch.profiler`
# (the trace is kept beside it; its run and caption are in `docs/figures/CAPTIONS.md`). The first
# backward, under `no_sync()`, sends nothing; in the last one each bucket's all-reduce starts while
# backward is still computing the earlier layers. A busy CPU's durations; what a GPU shares is the
# order and the overlap.

# %%
from IPython.display import Image

Image(filename="../docs/figures/ddp_step.png")

# %% [markdown]
# ## Questions
#
# * Why must every rank call `sampler.set_epoch(epoch)`? (Without it every epoch repeats epoch 0's
#   order. The loss still falls, so nothing crashes: the model just sees less variety.)
# * With `--grad-accum 4`, why run the first three micro-steps under `model.no_sync()`? (Otherwise
#   every micro-step all-reduces: the same result, four times the communication.)
# * The device is `cuda:LOCAL_RANK`. Why not `cuda:RANK`? (Chapter 05: on the second machine the
#   ranks start at 8, but its GPUs are numbered from 0.)
# * What happens if only rank 0 all-reduces the logged loss? (Rank 0 waits in the all-reduce; rank
#   1 goes on to the next step, whose forward waits for rank 0: a hang until the timeout.)

# %%
# Clean up: the runs above (checkpoints included) were only for this notebook
clean_up()
