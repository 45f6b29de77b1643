# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 08 — communicate rarely (DiLoCo)
#
# DDP sends every gradient at every step: over a slow link the ranks wait for the network. DiLoCo
# sends H times less. Every rank trains its own copy of the model with its own AdamW for H steps
# (`--sync-every H`), sending nothing. Then the copies meet: each computes how far it moved in the
# round, the **pseudo-gradient** Δ = θ_global − θ_local, one all-reduce averages it, and an outer
# SGD with Nesterov momentum (`--outer-lr 0.7 --outer-momentum 0.9`, the DiLoCo paper's: Douillard
# et al., 2023, arXiv 2311.08105) moves the global parameters along the mean Δ as if it were a
# gradient. Every copy starts the next round from the new global parameters.
#
# Below: the outer step on a toy tensor; H = 1 with plain SGD and an outer lr 1 without momentum,
# which is DDP; H = 10 against DDP; and the bytes each rank sends.

# %%
# Setup: import the notebooks' helpers (tools/notebook.py) from the course's root folder,
# the first folder above Jupyter's that holds common/
import sys
from pathlib import Path

sys.path.insert(
    0, str(next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "common").is_dir()), ""))
)
import torch

from tools.notebook import RUNS, TINY, clean_up, compare, plot_losses, setup, torchrun

setup()

# %% [markdown]
# ## The outer step, on a toy tensor
#
# Two copies start a round at the global parameters (1, 1) and end it apart. The outer step is
# `torch.optim.SGD` on the global parameters, their gradient the mean pseudo-gradient, as in the
# chapter's script. With lr 1 and no momentum it lands on the copies' mean: parameter averaging,
# known as local SGD. With the paper's Nesterov momentum it goes further.

# %%
start = torch.tensor([1.0, 1.0])  # the global parameters when the round begins
copies = [torch.tensor([0.6, 1.2]), torch.tensor([0.8, 0.6])]  # where the copies end it
mean_pseudo_grad = torch.stack([start - copy for copy in copies]).mean(dim=0)  # the all-reduce's


def outer_steps(lr: float, momentum: float, rounds: int) -> list[torch.Tensor]:
    """The global parameters after each round, when every round's copies move as these two."""
    global_params = torch.nn.Parameter(start.clone())
    outer = torch.optim.SGD([global_params], lr=lr, momentum=momentum, nesterov=momentum > 0)
    after = [start]
    for _ in range(rounds):
        global_params.grad = mean_pseudo_grad.clone()
        outer.step()
        after.append(global_params.detach().clone())
    return after


averaged = outer_steps(lr=1, momentum=0, rounds=1)[-1]
print(f"lr 1, no momentum: ({averaged[0]:.2f}, {averaged[1]:.2f}), the copies' mean")
assert torch.allclose(averaged, torch.stack(copies).mean(dim=0))
after = outer_steps(lr=0.7, momentum=0.9, rounds=40)
# how far each round moves the global parameters, in copies' mean moves
moves = [((a - b).norm() / mean_pseudo_grad.norm()).item() for a, b in zip(after, after[1:])]
print("lr 0.7, Nesterov 0.9:", ", ".join(f"{m:.2f}" for m in moves[:5]), f"... {moves[-1]:.2f}")
assert abs(moves[0] - 0.7 * (1 + 0.9)) < 1e-6  # the first round already goes 1.33 times as far
assert abs(moves[-1] - 0.7 / (1 - 0.9)) < 0.2  # when all rounds agree: up to lr / (1 - momentum)

# %% [markdown]
# Momentum adds up the rounds that point the same way (up to 7 times the copies' move when all
# agree), and rounds that disagree cancel out.
#
# ## H = 1 with SGD is DDP with SGD
#
# One inner SGD step a round, then an outer lr 1 without momentum: each copy takes one step on its
# own gradient, and the copies' mean is the step on the mean gradient, DDP's step. The reference
# is chapter 05 with SGD for AdamW (AdamW would not do: its step is not linear in the gradient).
# Both with 2 ranks of 4 sequences, SGD's lr 0.3, and no clipping (each copy would clip its own).

# %%
import re

from common.metrics import read_metrics

source = Path("../05_multinode/train.py").read_text()
# chapter 05's optimizer statement, AdamW(...) over several lines, becomes SGD
ddp_sgd_source, replaced = re.subn(
    r"torch\.optim\.AdamW\(.*?\n    \)",
    "torch.optim.SGD(model.optimizer_groups(args.weight_decay), lr=args.lr)",
    source,
    flags=re.DOTALL,
)
assert replaced == 1
ddp_sgd_script = RUNS / "05_with_sgd" / "train.py"
ddp_sgd_script.parent.mkdir()
ddp_sgd_script.write_text(ddp_sgd_source)

sgd = list(TINY)
sgd[sgd.index("--lr") + 1] = "0.3"
sgd += ["--grad-clip", "0", "--batch-size", "4"]
torchrun(ddp_sgd_script, 2, *sgd, "--out-dir", RUNS / "ddp_sgd", show=0)
h1 = ["--sync-every", "1", "--inner-optimizer", "sgd", "--outer-lr", "1", "--outer-momentum", "0"]
outputs = {"h1": torchrun("08_slow_link/train.py", 2, *sgd, *h1, "--out-dir", RUNS / "h1", show=2)}
ddp_sgd = read_metrics(RUNS / "ddp_sgd" / "metrics.jsonl")
h1_run = read_metrics(RUNS / "h1" / "metrics.jsonl")
plot_losses({"05 with SGD: DDP": ddp_sgd, "08: H = 1, SGD, outer lr 1": h1_run}, "H = 1 is DDP")
print(f"largest per-step loss difference: {compare(ddp_sgd, h1_run):.2e}")
assert compare(ddp_sgd, h1_run) < 1e-4

# %% [markdown]
# ## H = 10 against DDP
#
# Now each copy takes 10 AdamW steps alone, for 30 steps: 3 rounds. Chapter 05's DDP reads the same
# batches. Two outer steps: lr 1 without momentum (local SGD), and the paper's lr 0.7 with Nesterov
# momentum 0.9. A step's loss is the mean of the copies' losses on their own batches; the
# validation loss at step 30 is the global parameters'.

# %%
thirty = list(TINY)
thirty[thirty.index("--max-iters") + 1] = "30"
thirty += ["--batch-size", "4"]
torchrun("05_multinode/train.py", 2, *thirty, "--out-dir", RUNS / "ddp", show=0)
outer = {
    "local_sgd": ["--outer-lr", "1", "--outer-momentum", "0"],
    "diloco": [],  # the defaults: lr 0.7, momentum 0.9
}
for name, more in outer.items():
    h10 = ["--sync-every", "10", *more, "--out-dir", RUNS / name]
    outputs[name] = torchrun("08_slow_link/train.py", 2, *thirty, *h10, show=0)
runs = {name: read_metrics(RUNS / name / "metrics.jsonl") for name in ("ddp", *outer)}
labels = {"ddp": "05: DDP", "local_sgd": "08: outer lr 1", "diloco": "08: lr 0.7, Nesterov 0.9"}
plot_losses({labels[name]: runs[name] for name in labels}, "A sync every 10 steps")
val = {name: [m["val_loss"] for m in run if "val_loss" in m][-1] for name, run in runs.items()}
for name, loss in val.items():
    print(f"{name:>9}: validation loss at step 30 {loss:.3f}, {loss / val['ddp'] - 1:+.1%} vs DDP")
assert val["local_sgd"] != val["ddp"]
assert abs(val["local_sgd"] / val["ddp"] - 1) < 0.05

# %% [markdown]
# Local SGD stays close to DDP, not equal: each copy followed its own gradients for 10 steps.
# The paper's outer step does better after the first sync (step 11), then overshoots: besides 1.33
# times the second round's mean move, the second outer step adds 0.7 x 0.81 of the first round's,
# a long one from the random start. The paper tuned its lr and momentum on runs of 32 rounds or
# more (at most 176), not 3.
#
# ## The bytes
#
# DDP's all-reduce sends every gradient once a step: the parameters x 4 bytes in float32. Chapter
# 08 prints what each rank handed to all-reduce. `--sync-bf16` sends the pseudo-gradient in
# bfloat16: half of that again, here with local SGD's outer step.

# %%
from common.model import GPT, model_config

with torch.device("meta"):  # shapes only: nothing is allocated
    parameters = GPT(model_config("tiny")).num_params(non_embedding=False)
ddp_bytes = parameters * 4
print(f"the tiny model: {parameters:,} parameters; DDP sends {ddp_bytes:,} bytes per step")
in_bf16 = ["--sync-every", "10", *outer["local_sgd"], "--sync-bf16", "--out-dir", RUNS / "bf16"]
outputs["bf16"] = torchrun("08_slow_link/train.py", 2, *thirty, *in_bf16, show=0)
SENT = re.compile(r"sent ([\d,]+) bytes of pseudo-gradients in (\d+) steps")
for name, divisor in (("h1", 1), ("local_sgd", 10), ("bf16", 20)):
    sent, steps = SENT.search(outputs[name]).groups()
    per_step = int(sent.replace(",", "")) / int(steps)
    print(f"{name:>9}: {per_step:>11,.1f} bytes per step = DDP's / {divisor}")
    assert per_step == ddp_bytes / divisor
# rounded to bfloat16, the mean move takes the run on a slightly different path
bf16 = [m["val_loss"] for m in read_metrics(RUNS / "bf16" / "metrics.jsonl") if "val_loss" in m][-1]
print(f"     bf16: validation loss at step 30 {bf16:.3f}, {bf16 / val['ddp'] - 1:+.1%} vs DDP")
assert abs(bf16 / val["ddp"] - 1) < 0.05

# %% [markdown]
# ## Questions
#
# * The pseudo-gradient is θ_global − θ_local. What happens with the other sign? (The outer step
#   moves the global parameters back, against the copies' progress: the loss climbs.)
# * A sync could all-reduce the parameters themselves and keep their average. What is lost? (The
#   outer step: the run is local SGD whatever `--outer-lr` and `--outer-momentum` say. And in
#   bfloat16, a parameter between 1 and 2 is rounded to a multiple of 1/128, erasing any smaller
#   move; a pseudo-gradient's 8 significant bits are all the move's.)
# * The copies are not reset to the global parameters after the outer step. What do you see?
#   (Nothing fails at once: the next pseudo-gradient counts the earlier rounds' moves again, the
#   copies drift apart, and the run ends with "parameters identical on all 2 rank(s): NO".)
# * Rank 0 alone runs the sync, say to log it. What happens? (The other rank's next collective, the
#   loss's all-reduce, pairs with rank 0's all-reduce of another size: an error, or a hang until
#   `--dist-timeout`.)

# %%
# Clean up: the runs above (checkpoints included) were only for this notebook
clean_up()
