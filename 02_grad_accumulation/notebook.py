# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 02 — gradient accumulation
#
# A batch too big for memory can still be **one** optimizer step: run it as K micro-batches,
# let `backward()` add their gradients into `.grad`, and step once. Dividing each micro-batch's
# loss by K makes the sum of their gradients the gradient of the mean loss over the whole batch.
#
# In this notebook: one gradient computed with the full batch and with accumulated
# micro-batches (they match), what happens if you forget to divide by K, and the chapter's
# script with 4 micro-batches of 2 against chapter 01 with one batch of 8.

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
    clean_up,
    compare,
    first_batch,
    plot_losses,
    setup,
    tiny_model,
    train,
)

setup()

# %%
# The global batch: chapter 01's first 8 windows (x, and y one token later), each (8, T)
_, x, y = first_batch()
model = tiny_model()  # the tiny GPT, seeded as every run in these notebooks


def gradients():
    """A copy of every parameter's .grad, then clear them for the next experiment."""
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def largest_difference(a, b):
    return max((ga - gb).abs().max().item() for ga, gb in zip(a, b))


def norm(grads):
    return torch.sqrt(sum((g**2).sum() for g in grads)).item()


# %% [markdown]
# ## The same gradient, two ways

# %%
K = 4  # micro-batches of 8 / K = 2 sequences

_, loss = model(x, y)  # the whole batch at once
loss.backward()
full = gradients()

for x_micro, y_micro in zip(x.chunk(K), y.chunk(K)):  # (2, T) each
    _, micro_loss = model(x_micro, y_micro)
    (micro_loss / K).backward()  # backward() ADDS into .grad
accumulated = gradients()

print(f"largest difference between the two gradients: {largest_difference(full, accumulated):.2e}")
print(f"gradient norms: full {norm(full):.5f}, accumulated {norm(accumulated):.5f}")
assert largest_difference(full, accumulated) < 1e-5  # equal up to float32 rounding

# %% [markdown]
# ## Forgetting to divide by K
#
# Without the division the micro-gradients add up to **K times** the gradient. With plain SGD
# that is a K-times larger learning rate. AdamW hides most of it (its step divides by a running
# size of the gradient), which is why the bug survives: but gradient clipping now sees a K-times
# larger norm and clips far more often, the logged loss is K times too large, and the run no
# longer matches the single-batch run.

# %%
for x_micro, y_micro in zip(x.chunk(K), y.chunk(K)):
    _, micro_loss = model(x_micro, y_micro)
    micro_loss.backward()  # the mistake: no division by K
unscaled = gradients()
print(
    f"norm without dividing: {norm(unscaled):.5f} = "
    f"{norm(unscaled) / norm(full):.3f} x the true gradient's"
)

# %% [markdown]
# ## The chapter's script against chapter 01
#
# Chapter 01 with `--batch-size 8` and chapter 02 with `--batch-size 2 --grad-accum 4` take the
# same optimizer steps on the same 8 sequences per step: the loss curves lie on top of each other.

# %%
# Chapter 01's run with a global batch of 8 sequences: the reference every chapter must match
ref = train("01_single_gpu", "ch01", "--batch-size", "8")

# %%
ch02 = train("02_grad_accumulation", "ch02", "--batch-size", "2", "--grad-accum", "4")
plot_losses({"01: batch 8": ref, "02: 4 micro-batches of 2": ch02}, "Chapter 02 matches chapter 01")
print(f"largest per-step loss difference: {compare(ref, ch02):.2e}")
assert compare(ref, ch02) < 1e-4

# %% [markdown]
# ## Questions
#
# * What does accumulation save, and what does it cost? (Memory for activations of one
#   micro-batch only; the same compute, in K smaller and usually less efficient passes.)
# * Why does the learning-rate schedule count optimizer steps, not micro-steps?
# * With `dropout > 0`, would chapter 02 still match chapter 01 exactly? (No: the dropout masks
#   are drawn in another order; the runs agree in distribution, not number for number.)

# %%
# Clean up: the runs above (checkpoints included) were only for this notebook
clean_up()
