"""Fully sharded data parallelism (FSDP, ZeRO-3) by hand, built from torch.distributed.

DDP keeps the whole model, its gradients and the optimizer state on every rank. FSDP keeps 1/W of
each: the parameters of every wrapped UNIT (a submodule, such as a transformer block, plus the
root for whatever no unit holds) are flattened into one buffer, padded to a multiple of W, and
each rank keeps one 1/W slice of it, its SHARD. A unit's whole parameters exist only while the
unit computes:

1. forward pre-hook: all-gather the unit's shards into the whole flat buffer, and point the
   unit's modules at views of it (`module.weight` becomes a slice of the buffer);
2. forward post-hook: free the buffer's memory (autograd keeps the views, now empty);
3. a hook on the unit's output fires when backward reaches the unit: all-gather again into the
   same memory, so the views autograd saved hold the weights again;
4. the all-gather is an autograd Function whose backward is a reduce-scatter: once the unit's
   whole gradient is summed, each rank receives the average over ranks of its own slice, in the
   shard's `.grad`, and the buffer is freed;
5. the optimizer (any torch optimizer) steps on the shards alone.

A parameter belongs to the innermost unit that holds every place it is registered. A parameter
shared by two units (the GPT's tied wte/lm_head matrix, if both were units) therefore belongs to
a unit around both, at worst the root: the root's buffer is gathered during the whole forward and
the whole backward, so every use finds it.

    gpt = GPT(config)
    # each block a unit, and the root for the rest
    model = FullyShardedDataParallel(gpt, units=list(gpt.transformer.h))
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)  # the shards: 1/W of the model
    _, loss = model(x, y)
    loss.backward()  # all-gathers and reduce-scatters, unit by unit
    optimizer.step()
    state = model.full_state_dict()  # the whole model on every rank, named as gpt.state_dict()

Between steps the modules hold no whole parameters at all: `gpt.lm_head.weight` is an
AttributeError, and full_state_dict() gathers them. Every rank must run every unit, in the same
order: each gather is a collective that waits for all ranks. One flat shard per unit means one
optimizer group per unit: the GPT's optimizer_groups (no weight decay on biases) cannot apply.
Run it: torchrun --standalone --nproc_per_node=2 07_fsdp/fsdp_by_hand.py
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

# The flat-tensor collectives got these names after torch 2.11, which has the very same functions
# as all_gather_into_tensor and reduce_scatter_tensor (04_ddp/zero1.py does the same).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# What the byte counter counts: per step, per rank, the bytes each kind of collective sends.
KINDS = ("all_gather_forward", "all_gather_backward", "reduce_scatter")


class Place(NamedTuple):
    """One place a parameter is registered: `owner.name`, called `full_name` in the state dict,
    inside `units` (the units around it, the root first)."""

    owner: nn.Module
    name: str
    full_name: str
    units: list[nn.Module]


def ring_bytes(padded_numel: int, world_size: int, element_size: int) -> int:
    """The bytes each rank sends in a ring all-gather (or reduce-scatter) of `padded_numel` numbers:
    (W - 1) / W of them, since the slice a rank holds (or keeps) never travels."""
    return padded_numel // world_size * (world_size - 1) * element_size


class _GatherShards(torch.autograd.Function):
    """Forward: all-gather the shards into the unit's whole flat buffer. Backward: reduce-scatter
    the buffer's gradient into the shard's gradient. In autograd's terms the reduce-scatter is
    the all-gather's derivative: shard r's numbers were copied to every rank, so their gradient is
    the sum over ranks of slice r (divided by W: each rank's loss is the mean of its 1/W)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: FlatShardedUnit) -> torch.Tensor:
        # `shard` is an input only so that autograd links the gathered buffer back to it
        ctx.unit = unit
        full = unit.all_gather(torch.empty(unit.padded_numel, dtype=unit.compute_dtype))
        ctx.memory = full.untyped_storage()  # the memory, not the tensor: no reference cycle
        return full

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor) -> tuple[torch.Tensor, None]:
        unit = ctx.unit
        # The gradient arrives in the compute dtype (bf16, say): reduce it in the master dtype.
        grad_full = grad_full.to(unit.shard.dtype).contiguous()  # (padded_numel,)
        grad_shard = torch.empty_like(unit.shard)  # (padded_numel / W,)
        reduce_scatter_single(grad_shard, grad_full, op=dist.ReduceOp.SUM, group=unit.group)
        unit.count("reduce_scatter", grad_shard.dtype)
        # the sum, then one division: the mean over ranks, as FSDP2 computes it
        grad_shard.div_(unit.world_size)
        ctx.memory.resize_(0)  # nothing after this point of backward reads the unit's weights
        return grad_shard, None


class FlatShardedUnit:
    """The parameters one module owns, as a flat shard, gathered around its forward and backward."""

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        places: list[list[Place]],
        counter: dict[str, int],
        compute_dtype: torch.dtype | None,
        group: dist.ProcessGroup | None,
    ):
        self.module = module
        self.places = places  # for each parameter, every place it is registered
        self.counter = counter
        self.group = group
        self.world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        # Pad the flat layout up to a multiple of W: the collectives need equal slices. The last
        # rank's slice ends in up to W - 1 zeros that belong to no parameter.
        self.shard_numel = math.ceil(sum(self.numels) / self.world_size)
        self.padded_numel = self.shard_numel * self.world_size
        padding = self.padded_numel - sum(self.numels)
        flat = torch.cat([p.detach().reshape(-1) for p in params] + [params[0].new_zeros(padding)])
        # Every rank must shard the same model: rank 0's values, as DDP's constructor broadcasts.
        dist.broadcast(flat, group=group, group_src=0)
        start = rank * self.shard_numel
        # The master copy of this rank's slice, in the parameters' dtype: the optimizer's tensor.
        self.shard = nn.Parameter(flat[start : start + self.shard_numel].clone())
        self.compute_dtype = compute_dtype or self.shard.dtype
        # The whole parameters leave the modules: from here on only the shard holds memory.
        self.forget_views()
        module.register_parameter("flat_shard", self.shard)  # so model.parameters() yields it
        module.register_forward_pre_hook(self.before_forward, with_kwargs=True)
        module.register_forward_hook(self.after_forward)

    def count(self, kind: str, dtype: torch.dtype) -> None:
        """Add one collective of this unit, its numbers sent in `dtype`, to the byte counter."""
        self.counter[kind] += ring_bytes(self.padded_numel, self.world_size, dtype.itemsize)

    def all_gather(self, out: torch.Tensor) -> torch.Tensor:
        # Cast before sending: a bf16 all-gather moves half the bytes of a float32 one.
        mine = self.shard.detach().to(self.compute_dtype)
        all_gather_single(out, mine, group=self.group)
        return out

    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if torch.is_grad_enabled():
            # in the autograd graph: its backward is this unit's reduce-scatter
            full = _GatherShards.apply(self.shard, self)
        else:
            full = self.all_gather(torch.empty(self.padded_numel, dtype=self.compute_dtype))
        self.count("all_gather_forward", full.dtype)
        self.memory = full.untyped_storage()  # this forward's buffer, for after_forward
        # Views, not copies: every gradient that flows into them sums into the one buffer's.
        pieces = full.split([*self.numels, self.padded_numel - sum(self.numels)])
        for piece, shape, where in zip(pieces, self.shapes, self.places):
            view = piece.view(shape)
            for place in where:
                # a plain tensor attribute: nn.Linear's forward reads self.weight and finds it
                setattr(place.owner, place.name, view)
        # The inputs in the compute dtype too (an fp32 input times a bf16 weight is an error).
        args = tuple(self.cast(a) for a in args)
        kwargs = {k: self.cast(v) for k, v in kwargs.items()}
        return args, kwargs

    def cast(self, value):
        if torch.is_tensor(value) and value.is_floating_point():
            return value.to(self.compute_dtype)
        return value

    def after_forward(self, module: nn.Module, args: tuple, output):
        memory = self.memory
        if torch.is_grad_enabled():
            # The first gradient that reaches any of the unit's outputs means backward is about to
            # enter the unit: its weights must be back by then. Each hook carries the memory of
            # its own forward's buffer, so two forwards before one backward refill both.
            outputs = output if isinstance(output, (tuple, list)) else [output]
            if isinstance(output, dict):
                outputs = list(output.values())
            hooked = [t for t in outputs if torch.is_tensor(t) and t.requires_grad]
            if not hooked:
                # backward would reach the weights with no hook to gather them first
                raise RuntimeError(
                    f"{type(module).__name__}, an FSDP unit, returned no tensor that requires "
                    "grad; a unit must return a tensor, or a tuple, list or dict of tensors"
                )
            for tensor in hooked:
                tensor.register_hook(lambda grad: self.before_backward(memory))
        # Give the buffer's memory back but keep the tensor: autograd holds views of it, and
        # before_backward refills the same memory. FSDP frees and refills the same way.
        memory.resize_(0)
        # The modules forget the views: reading `linear.weight` between steps is then a clear
        # AttributeError, not a read of freed memory.
        self.forget_views()
        return output

    def forget_views(self) -> None:
        for where in self.places:
            for place in where:
                if hasattr(place.owner, place.name):  # a module registered twice is met twice
                    delattr(place.owner, place.name)

    def before_backward(self, memory: torch.UntypedStorage) -> None:
        if memory.size() > 0:
            return  # another output's hook has gathered the weights already
        memory.resize_(self.padded_numel * self.compute_dtype.itemsize)
        # Write through a new tensor on that memory: writing into the buffer autograd saved would
        # bump its version counter, and autograd would refuse the views ("modified by an inplace
        # operation"). The numbers written are the very ones the forward used.
        alias = torch.empty(0, dtype=self.compute_dtype).set_(memory, 0, (self.padded_numel,))
        self.all_gather(alias)
        self.count("all_gather_backward", alias.dtype)


class FullyShardedDataParallel(nn.Module):
    """Shard `module` across the ranks: `units` (submodules) and the root each own a flat shard."""

    def __init__(
        self,
        module: nn.Module,
        units: list[nn.Module],
        compute_dtype: torch.dtype | None = None,
        process_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size(process_group)
        # bytes sent per rank, by kind (KINDS), since the last reset
        self.comm_bytes = dict.fromkeys(KINDS, 0)
        # Buffers (a BatchNorm's statistics) are not sharded, only made equal, as DDP does.
        for buffer in module.buffers():
            dist.broadcast(buffer, group=process_group, group_src=0)
        # Every place each parameter is registered (a tied matrix has two), in state-dict order.
        places: dict[nn.Parameter, list[Place]] = {}
        self._walk(module, "", [module], [module, *units], places)
        for param in places:
            if not param.requires_grad:
                raise ValueError("every parameter must require grad: a unit shards them together")
        owned: dict[nn.Module, list[nn.Parameter]] = {unit: [] for unit in [module, *units]}
        for param, where in places.items():
            owned[self._owner([place.units for place in where])].append(param)
        self.units: list[FlatShardedUnit] = []
        index: dict[nn.Parameter, tuple[int, int]] = {}  # parameter -> (its unit, its place there)
        for unit_module, params in owned.items():
            if not params:
                continue  # a unit that owns nothing has nothing to gather
            where = [places[p] for p in params]
            unit = FlatShardedUnit(
                unit_module, params, where, self.comm_bytes, compute_dtype, process_group
            )
            index.update({p: (len(self.units), i) for i, p in enumerate(params)})
            self.units.append(unit)
        # (full name, unit, index) for every name, both names of a tied matrix included, in
        # model.state_dict()'s order: the keys of full_state_dict().
        self._names = [(pl.full_name, *index[p]) for p, where in places.items() for pl in where]

    def _walk(
        self,
        module: nn.Module,
        prefix: str,
        around: list[nn.Module],
        units: list[nn.Module],
        places: dict[nn.Parameter, list[Place]],
    ) -> None:
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(param, []).append(Place(module, name, prefix + name, around))
        for name, child in module.named_children():
            inner = around + [child] if any(child is u for u in units) else around
            self._walk(child, f"{prefix}{name}.", inner, units, places)

    @staticmethod
    def _owner(chains: list[list[nn.Module]]) -> nn.Module:
        """The innermost unit around every place: the last unit all the chains share."""
        common = chains[0]
        for chain in chains[1:]:
            n = 0
            while n < min(len(common), len(chain)) and common[n] is chain[n]:
                n += 1
            common = common[:n]
        return common[-1]  # the root is in every chain

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def reset_comm_bytes(self) -> None:
        self.comm_bytes.update(dict.fromkeys(KINDS, 0))

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter whole (or, with grads=True, its averaged gradient), in the master dtype,
        under the names model.state_dict() gives it, on every rank. A collective: every rank must
        call it. Its bytes are not a training step's and are not counted."""
        pieces = []
        for unit in self.units:
            mine = unit.shard.grad if grads else unit.shard
            flat = mine.new_empty(unit.padded_numel)  # (padded_numel,)
            all_gather_single(flat, mine.detach(), group=unit.group)
            # the padding's zeros are the last piece, dropped
            parts = flat.split([*unit.numels, unit.padded_numel - sum(unit.numels)])
            pieces.append([part.view(shape) for part, shape in zip(parts, unit.shapes)])
        state = {name: pieces[unit][i].clone() for name, unit, i in self._names}
        if not grads:
            state.update({name: b.clone() for name, b in self.module.named_buffers()})
        return state


def bytes_held(
    model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer
) -> list[list[int]]:
    """[parameters, gradients, optimizer state]: the bytes each rank holds, on every rank (a
    collective). Call it between optimizer.step() and zero_grad(), when all three exist."""
    shards = list(model.parameters())
    params = sum(p.numel() * p.element_size() for p in shards)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in shards if p.grad is not None)
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    mine = torch.tensor([params, grads, state], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def main() -> None:
    """A few AdamW steps of the course's GPT on random tokens (no data set needed). Rank 0 prints
    what each rank holds and the bytes each step sent, next to the formula and to DDP's."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `common`
    from common.model import GPT, PRESETS, model_config

    p = argparse.ArgumentParser(description=main.__doc__.split(".")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    dist.init_process_group("gloo")  # the CPU's backend: this is a demonstration, not a trainer
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(1337)
    config = model_config(args.preset, dropout=0.0)
    gpt = GPT(config)
    n_params = sum(p.numel() for p in gpt.parameters())  # the tied matrix once
    n_tensors = len(list(gpt.parameters()))
    compute_dtype = getattr(torch, args.compute_dtype)
    model = FullyShardedDataParallel(gpt, list(gpt.transformer.h), compute_dtype=compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
    gen = torch.Generator().manual_seed(1337)  # the same global batch on every rank
    for _ in range(args.steps):
        shape = (args.batch_size * world, args.seq_len + 1)
        data = torch.randint(0, config.vocab_size, shape, generator=gen)
        model.reset_comm_bytes()
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(data[rank::world, :-1], data[rank::world, 1:])
        loss.backward()
        optimizer.step()
    held = bytes_held(model, optimizer)  # the last step's gradients, and AdamW's state
    padded = sum(unit.padded_numel for unit in model.units)
    sent = model.comm_bytes
    if rank == 0:
        print(
            f"preset {args.preset}: {n_params:,} parameters, {len(model.units)} units (the root, "
            f"{len(model.units) - 1} blocks), padded to {padded:,} | {world} ranks | compute "
            f"{args.compute_dtype}, master weights float32"
        )
        print("per rank, bytes: parameters | gradients | AdamW state")
        for r in range(world):
            print(f"  rank {r}: {held[r][0]:,} | {held[r][1]:,} | {held[r][2]:,}")
        print(f"  DDP:    {4 * n_params:,} | {4 * n_params:,} | {8 * n_params + 4 * n_tensors:,}")
        print("bytes each rank sent in the last step (in a ring):")
        for kind in KINDS:
            print(f"  {kind}: {sent[kind]:,}")
        c = compute_dtype.itemsize
        formula = (world - 1) * padded // world * (2 * c + 4)
        total = sum(sent.values())
        print(f"  total {total:,} = (W - 1)/W x padded x (2 x {c} + 4 bytes) = {formula:,}")
        print(
            f"  DDP's all-reduce: 2 (W - 1)/W x Psi = {2 * (world - 1) * n_params * 4 // world:,}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
