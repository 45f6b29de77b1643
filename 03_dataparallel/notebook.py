# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 03 — `nn.DataParallel`
#
# `nn.DataParallel` wraps a model so that one Python process uses several GPUs: each forward
# pass cuts the batch into one chunk per GPU, copies the model onto every GPU, runs the copies
# in threads and gathers the outputs on GPU 0, where the loss and the optimizer step happen.
#
# In this notebook: what the wrapper is (`model.module`, the `module.` prefix in its state dict
# and why checkpoints must not keep it), what it computes (simulated on the CPU: chunks of the
# batch give the same loss and gradient), and the chapter's script against chapter 01.

# %%
# Setup: import the notebooks' helpers (tools/notebook.py) from the course's root folder,
# the first folder above Jupyter's that holds common/
import sys
from pathlib import Path

sys.path.insert(
    0, str(next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "common").is_dir()), ""))
)
import torch

from tools.notebook import RUNS, clean_up, compare, first_batch, plot_losses, setup, train

setup()

# %%
from torch import nn

from common.model import GPT, model_config

torch.manual_seed(1337)
model = GPT(model_config("tiny", dropout=0.0))
wrapped = nn.DataParallel(model)  # on a machine without GPUs it simply calls the model
print("wrapped.module is the model itself:", wrapped.module is model)
print("GPUs it would use:", wrapped.device_ids or "none (CPU)")

plain_keys = list(model.state_dict())
wrapped_keys = list(wrapped.state_dict())
print("model.state_dict():  ", plain_keys[:2])
print("wrapped.state_dict():", wrapped_keys[:2])

# %% [markdown]
# ## The `module.` prefix
#
# The wrapper's state dict names every tensor `module.<name>`. A checkpoint saved from it does
# not load into a plain model — the classic error below. The chapter's script saves
# `model.module.state_dict()` instead, and `common.checkpoint.clean_state_dict` strips wrapper
# prefixes from old checkpoints.

# %%
fresh = GPT(model_config("tiny", dropout=0.0))
try:
    fresh.load_state_dict(wrapped.state_dict())
except RuntimeError as err:
    print("loading the wrapper's state dict into a plain model fails:")
    print("  " + str(err).splitlines()[1][:110] + " ...")

from common.checkpoint import clean_state_dict

fresh.load_state_dict(clean_state_dict(wrapped.state_dict()))
print(
    "after stripping the prefix it loads; same weights:",
    all(
        torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values())
    ),
)

# %% [markdown]
# ## What DataParallel computes, simulated on the CPU
#
# With 2 GPUs and `--batch-size 4`, each step's batch of 8 is scattered as two chunks of 4. Each
# replica returns the mean loss of its chunk; the script averages the two. Since the chunks have
# equal size, the average of their means is the mean over all 8, and backward through the
# gathered result sums the replicas' gradients into the one model on GPU 0: the gradient of
# chapter 01's batch.

# %%
_, x, y = first_batch()  # chapter 01's first global batch: (8, T) each

_, full_loss = model(x, y)
full_loss.backward()
full_grad = [p.grad.clone() for p in model.parameters()]
model.zero_grad(set_to_none=True)

# (2,): one loss per "GPU"
replica_losses = torch.stack([model(xc, yc)[1] for xc, yc in zip(x.chunk(2), y.chunk(2))])
replica_losses.mean().backward()
difference = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), full_grad))
mean = replica_losses.mean().item()
print(
    f"per-replica losses {replica_losses.tolist()} -> mean {mean:.6f}; "
    f"full batch {full_loss.item():.6f}"
)
print(f"largest gradient difference: {difference:.2e}")
assert difference < 1e-5

# %% [markdown]
# ## The chapter's script against chapter 01
#
# On a CPU (or one GPU) there is nothing to split: chapter 03 runs chapter 02's computation
# through the wrapper, and with `--batch-size 8` it matches chapter 01. On a machine with 2 GPUs,
# `python 03_dataparallel/train.py --batch-size 4` is the same run again.

# %%
# Chapter 01's run with a global batch of 8 sequences: the reference every chapter must match
ref = train("01_single_gpu", "ch01", "--batch-size", "8")

# %%
ch03 = train("03_dataparallel", "ch03", "--batch-size", "8")
plot_losses(
    {"01: batch 8": ref, "03: DataParallel, batch 8": ch03}, "Chapter 03 matches chapter 01"
)
print(f"largest per-step loss difference: {compare(ref, ch03):.2e}")
assert compare(ref, ch03) < 1e-4

saved = torch.load(RUNS / "ch03" / "ckpt.pt", weights_only=True)["model"]
print("the checkpoint's names carry no prefix:", list(saved)[:2])
assert not any(k.startswith("module.") for k in saved)

# %% [markdown]
# ## Questions
#
# * Why does GPU 0 run out of memory first with DataParallel? (It holds the gathered outputs,
#   the loss, the optimizer state, and its own replica.)
# * Why does DataParallel scale poorly beyond a few GPUs? (One Python process: the GIL, copying
#   the model to every GPU every step, and gathering everything on GPU 0.)
# * What would happen if the last chunk were smaller than the others, and why does the course
#   drop incomplete batches?

# %%
# Clean up: the runs above (checkpoints included) were only for this notebook
clean_up()
