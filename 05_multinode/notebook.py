# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 05 — several machines
#
# Across machines nothing in the training step changes: DDP averages over every process in the
# job, wherever it runs. What changes is how the processes meet (one `torchrun` per machine, all
# pointed at node 0's address and port) and which number means what:
#
# * `RANK`: the process's place in the whole job. It decides which share of each batch the process
#   reads, and rank 0 writes the files.
# * `LOCAL_RANK`: its place on its own machine. It picks the GPU: `cuda:LOCAL_RANK`.
# * `GROUP_RANK`: the machine's place (the node rank).
#
# Here two "nodes" are simulated on this one machine: two `torchrun` commands with `--nnodes 2`
# that meet at a free port on 127.0.0.1, exactly as two machines meet at node 0's address.

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
    train,
    two_nodes,
)

setup()

# %% [markdown]
# ## Who is who: 2 nodes x 2 processes
#
# Chapter 04's small program again, now started by two `torchrun` commands with 2 processes each:
# a world of 4.

# %%
from common.data import prepare
from tools.notebook import WORKER, full_batch_gradient, results

prepare("shakespeare", DATA_DIR)  # both "nodes" use this folder (--shared-fs below)

grad_file = RUNS / "averaged_grad.pt"  # rank 0 saves the averaged gradient here
outputs = two_nodes(2, WORKER, "--data-dir", DATA_DIR, "--save-grad", grad_file, show=0)
ranks = results("\n".join(outputs))
print(
    f"{'node':>4} {'RANK':>4} {'LOCAL_RANK':>10}   device   cuda:RANK would be"
    "                   windows"
)
for r in ranks:
    wrong = f"cuda:{r['rank']}" + (" (no such GPU on a 2-GPU node)" if r["rank"] >= 2 else "")
    ranks_of = f"{r['node']:>4} {r['rank']:>4} {r['local_rank']:>10}"
    print(f"{ranks_of}   cuda:{r['local_rank']}   {wrong:<36} {r['windows']}")

order, full = full_batch_gradient()
interleaved = [w for group in zip(*(r["windows"] for r in ranks)) for w in group]
assert interleaved == order, (interleaved, order)
averaged = torch.load(grad_file, weights_only=True)
print(f"\nthe 4 ranks on 2 nodes read chapter 01's first batch {order};")
print(
    "their averaged gradient differs from the whole-batch gradient by "
    f"{(averaged - full).abs().max():.2e}"
)
assert torch.allclose(averaged, full, atol=1e-6)

# %% [markdown]
# ## The chapter's script on two nodes
#
# One process per node, 4 sequences each: the global batch is 8 again, and the run is chapter
# 01's. `--shared-fs` says both nodes see one data folder, so only global rank 0 prepares it
# (without it, local rank 0 of *each* node prepares its node-local copy, as
# `05_multinode/simulate_two_nodes.sh` shows).

# %%
# Chapter 01's run with a global batch of 8 sequences: the reference every chapter must match
ref = train("01_single_gpu", "ch01", "--batch-size", "8")

# %%
from common.metrics import read_metrics

outputs = two_nodes(
    1,
    "05_multinode/train.py",
    *TINY,
    "--batch-size",
    "4",
    "--shared-fs",
    "--out-dir",
    RUNS / "ch05",
    show=3,
)
print("\nevery process's first line, from each node's output:")
for node, out in enumerate(outputs):
    for line in out.splitlines():
        if line.startswith("[") and " process " in line:
            print(f"  node {node}: {line}")
ch05 = read_metrics(RUNS / "ch05" / "metrics.jsonl")
plot_losses(
    {"01: 1 process, batch 8": ref, "05: 2 nodes x 1 process x batch 4": ch05},
    "Chapter 05 matches chapter 01",
)
print(f"largest per-step loss difference: {compare(ref, ch05):.2e}")
assert compare(ref, ch05) < 1e-4

# %% [markdown]
# ## Questions
#
# * Which rank writes the checkpoint, and why not "rank 0 of every node"? (Global rank 0 only: on a
#   shared file system one writer per node would race on the same file.)
# * Node 1 cannot reach `MASTER_ADDR:MASTER_PORT`. What do you see, and what do you check first?
#   (Both torchruns wait at the rendezvous until it times out. Check that the address is node 0's
#   reachable interface and the port is open; for NCCL, that `NCCL_SOCKET_IFNAME` names the right
#   interface.)
# * Going from one node to two doubles `WORLD_SIZE`. What happens to the global batch, and what do
#   you change to keep chapter 01's run?

# %%
# Clean up: the runs above (checkpoints included) were only for this notebook
clean_up()
