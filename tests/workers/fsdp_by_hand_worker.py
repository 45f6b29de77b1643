"""Run under torchrun by tests/test_fsdp_by_hand.py: small models trained with
07_fsdp/fsdp_by_hand.py, with one process on the whole batch and with FSDP2, from rank 0's model
(rank r builds its own from SEED + r: the broadcast must fix it), rank r on rows r::W."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from common.model import GPT, model_config
from layout import chapter_module
from tests.workers.worker_shared import gloo_group, state_bytes, write_results

FullyShardedDataParallel = chapter_module("07_fsdp", "fsdp_by_hand").FullyShardedDataParallel

STEPS = 3
SEED = 1234
ROWS_PER_RANK = 2  # sequences (GPT) or samples (MLP) per rank per step
SEQ_LEN = 16
# The course's tiny GPT, the tied matrix included, with 512 tokens instead of 50,304: that matrix
# is 98 % of the tiny model and most of a step's time. A block's 12,704 numbers: uneven for 3 ranks.
GPT_CONFIG = model_config("tiny", vocab_size=512, dropout=0.0)


class GainLayer(nn.Module):
    """tanh(linear(x)) * gain, where `gain` may be a parameter another layer shares."""

    def __init__(self, n_in: int, n_out: int, gain: nn.Parameter):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self.gain


class SharedGainMLP(nn.Module):
    """Not a GPT: odd sizes (neither 2 nor 3 divides a unit's count) and one gain vector shared
    by the two hidden layers, two units: by the wrapper's rule the root owns it."""

    def __init__(self):
        super().__init__()
        gain = nn.Parameter(torch.linspace(0.5, 1.5, 9))
        self.layer1 = GainLayer(7, 9, gain)
        self.layer2 = GainLayer(9, 9, gain)
        self.head = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(x)))


def build(kind: str, seed: int, dtype: torch.dtype) -> tuple[nn.Module, list[nn.Module]]:
    """The model from `seed`, and the submodules that are units (the root is one anyway)."""
    torch.manual_seed(seed)
    if kind == "gpt":
        model = GPT(GPT_CONFIG).to(dtype)
        return model, list(model.transformer.h)
    model = SharedGainMLP().to(dtype)
    return model, [model.layer1, model.layer2, model.head]


def global_batch(kind: str, gen: torch.Generator, world: int, dtype: torch.dtype):
    rows = ROWS_PER_RANK * world
    if kind == "gpt":
        data = torch.randint(0, GPT_CONFIG.vocab_size, (rows, SEQ_LEN + 1), generator=gen)
        return data[:, :-1], data[:, 1:]
    return torch.randn(rows, 7, generator=gen).to(dtype), torch.randn(rows, 3, generator=gen).to(
        dtype
    )


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        _, loss = model(x, y)
        return loss
    out = model(x)
    return F.mse_loss(out.to(y.dtype), y)  # the loss in the master dtype, also under bf16 compute


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def whole(module: nn.Module) -> dict[str, torch.Tensor]:
    """FSDP2's parameters whole (a DTensor's full_tensor() is a collective), by their names."""
    return {n: p.full_tensor().detach() for n, p in module.named_parameters()}


def run_case(
    kind: str, optim: str, dtype, compute_dtype, with_fsdp2: bool, forwards: int, rank, world
) -> dict:
    single, _ = build(kind, SEED, dtype)
    model, units = build(kind, SEED + rank, dtype)  # each rank starts elsewhere, on purpose
    n_params = sum(p.numel() for p in model.parameters())  # each parameter once
    fsdp = FullyShardedDataParallel(model, units, compute_dtype=compute_dtype)
    init_vs_single = max_diff(fsdp.full_state_dict(), single.state_dict())
    optimizer = make_optimizer(optim, fsdp.parameters())
    single_optimizer = make_optimizer(optim, single.parameters())
    if with_fsdp2:
        reference, reference_units = build(kind, SEED, dtype)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=dtype)
        # FSDP2 refuses a parameter in two fully_shard groups: the MLP's shared gain stays with
        # its root, beside the head's own group.
        if kind == "mlp":
            reference_units = [reference.head]
        for unit in [*reference_units, reference]:
            fully_shard(unit, mp_policy=policy)
        reference_optimizer = make_optimizer(optim, reference.parameters())
    gen = torch.Generator().manual_seed(SEED)  # the same global batches on every rank
    result = {"comm_bytes": [], "n_params": n_params, "grad_scale": 0.0}
    # the numbers each unit owns, root first, by the wrapper's rule (the test counts them by hand)
    result["owned_numels"] = [sum(unit.numels) for unit in fsdp.units]
    result["padded_numels"] = [unit.padded_numel for unit in fsdp.units]
    worst = dict.fromkeys(["loss_vs_single", "grad_vs_single", "params_vs_single"], 0.0)
    if with_fsdp2:
        worst.update(loss_vs_fsdp2=0.0, params_vs_fsdp2=0.0)
    for _ in range(STEPS):
        x, y = global_batch(kind, gen, world, dtype)
        fsdp.reset_comm_bytes()
        # `forwards` forwards over equal parts of this rank's rows, then one backward of their mean
        parts = zip(x[rank::world].chunk(forwards), y[rank::world].chunk(forwards))
        losses = [loss_of(kind, fsdp, x_part, y_part) for x_part, y_part in parts]
        loss = torch.stack(losses).mean()
        loss.backward()
        result["comm_bytes"].append(dict(fsdp.comm_bytes))
        mean_loss = loss.detach().to(dtype)
        dist.all_reduce(mean_loss)
        mean_loss /= world  # each rank's loss is the mean over its rows: the mean of the means
        single_loss = loss_of(kind, single, x, y)
        single_loss.backward()
        grads = {n: p.grad for n, p in single.named_parameters()}
        largest = max(g.abs().max().item() for g in grads.values())
        result["grad_scale"] = max(result["grad_scale"], largest)
        ours = fsdp.full_state_dict(grads=True)
        ours = {n: ours[n] for n in grads}  # the tied matrix under its first name, as single's
        worst["loss_vs_single"] = max(
            worst["loss_vs_single"], (mean_loss - single_loss).abs().item()
        )
        worst["grad_vs_single"] = max(worst["grad_vs_single"], max_diff(ours, grads))
        optimizer.step()
        single_optimizer.step()
        state = fsdp.full_state_dict()
        worst["params_vs_single"] = max(
            worst["params_vs_single"], max_diff(state, single.state_dict())
        )
        if with_fsdp2:
            reference_loss = loss_of(kind, reference, x[rank::world], y[rank::world])
            reference_loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad(set_to_none=True)
            reference_mean = reference_loss.detach().to(dtype)
            dist.all_reduce(reference_mean)
            worst["loss_vs_fsdp2"] = max(
                worst["loss_vs_fsdp2"], (mean_loss - reference_mean / world).abs().item()
            )
            theirs = whole(reference)
            worst["params_vs_fsdp2"] = max(
                worst["params_vs_fsdp2"], max_diff({n: state[n] for n in theirs}, theirs)
            )
        optimizer.zero_grad(set_to_none=True)
        single_optimizer.zero_grad(set_to_none=True)
    # what this rank holds: its shards and the optimizer state over them
    shard_numel = sum(p.numel() for p in fsdp.parameters())
    held = torch.tensor([shard_numel, state_bytes(optimizer.state)], dtype=torch.int64)
    per_rank = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(per_rank, held)
    gathered = torch.tensor(list(worst.values()) + [init_vs_single], dtype=torch.float64)
    dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    result.update(zip([*worst, "init_vs_single"], gathered.tolist()))
    result["shard_numel"] = [int(t[0]) for t in per_rank]
    result["state_bytes"] = [int(t[1]) for t in per_rank]
    return result


CASES = {
    # name: (model, optimizer, master dtype, compute dtype, against FSDP2 too, forwards a step)
    "gpt/sgd/float32": ("gpt", "sgd", torch.float32, None, False, 1),
    "gpt/adamw/float32": ("gpt", "adamw", torch.float32, None, True, 1),
    "gpt/adamw/float64": ("gpt", "adamw", torch.float64, None, True, 1),
    "gpt/adamw/bfloat16": ("gpt", "adamw", torch.float32, torch.bfloat16, True, 1),
    "mlp/sgd/float32": ("mlp", "sgd", torch.float32, None, False, 1),
    "mlp/adamw/float32": ("mlp", "adamw", torch.float32, None, True, 1),
    "mlp/adamw/bfloat16": ("mlp", "adamw", torch.float32, torch.bfloat16, False, 1),
    # two forwards before one backward: each forward's buffers are refilled for its backward
    "mlp/adamw/float32/two_forwards": ("mlp", "adamw", torch.float32, None, False, 2),
}


def main() -> None:
    with gloo_group() as (rank, world):
        torch.use_deterministic_algorithms(True)
        results = {}
        for name, case in CASES.items():
            results[name] = run_case(*case, rank, world)
            if rank == 0:
                keys = [
                    k for k in results[name] if k.startswith(("loss_vs", "grad_vs", "params_vs"))
                ]
                shown = ", ".join(f"{k} {results[name][k]:.2g}" for k in keys)
                print(f"{world} ranks, {name}: {shown}", flush=True)
        if len(sys.argv) > 1:
            write_results(Path(sys.argv[1]), results)


if __name__ == "__main__":
    main()
