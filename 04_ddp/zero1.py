"""ZeRO-1 by hand: data parallelism with the optimizer state sharded across ranks.

DDP (and ddp_by_hand.py) keeps a full copy of everything on every rank: the parameters, the
gradients and the optimizer state. With AdamW the state is two running averages per parameter,
twice the model's size, and every rank computes the very same update for every parameter. ZeRO
stage 1 removes that redundancy: each rank OWNS 1/W of the parameters (a contiguous slice of
each bucket's flat layout) and keeps AdamW's state for that slice only. One step is

1. backward, as in BucketedDataParallel; when a bucket's gradients are final, a
   **reduce-scatter** (instead of an all-reduce) leaves on each rank only the averaged gradient of
   the slice it owns;
2. AdamW on the owned slice alone (after clipping with the GLOBAL gradient norm);
3. an **all-gather** of the updated slices, so every rank holds the whole updated model again.

A reduce-scatter and an all-gather move the same bytes as one all-reduce (which is usually built
from exactly these two halves), so ZeRO-1 saves memory at no extra communication.

AdamW is elementwise: each number's update depends only on that number's gradient and state. That
is why the slices may cut straight through a matrix: a rank updating half of a matrix computes
exactly what DDP computes for that half. The one step that is not elementwise is gradient
clipping, which needs the norm of the whole gradient.

    model = ZeroOneDataParallel(GPT(config), bucket_cap_mb=25)
    groups = model.module.optimizer_groups(0.1)
    optimizer = ShardedOptimizer(model, groups, torch.optim.AdamW, lr=6e-4)
    for micro_step in range(grad_accum):
        ctx = model.no_sync() if micro_step < grad_accum - 1 else contextlib.nullcontext()
        with ctx:
            _, loss = model(x, y)
            (loss / grad_accum).backward()
    model.finish_gradient_sync()      # wait for the reduce-scatters
    optimizer.clip_grad_norm_(1.0)    # the norm of the WHOLE gradient, from every rank's slice
    optimizer.step()                  # AdamW on this rank's slice, then the all-gather
    optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from ddp_by_hand import BucketedDataParallel, _Bucket

# The flat-tensor collectives got these names after torch 2.11. Torch 2.11, the oldest the course
# supports, has the very same functions as reduce_scatter_tensor and all_gather_into_tensor.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _ShardedBucket(_Bucket):
    """A bucket whose flat layout is padded to a multiple of W and cut into W equal slices."""

    def __init__(self, params: list[nn.Parameter], world_size: int, rank: int):
        # W may not divide the bucket's size: pad with zeros up to a multiple of W, so every rank
        # gets a slice of the same length (the collectives need that); the last rank's slice ends
        # in padding, which is never a parameter. Uneven shards, by at most W - 1 numbers.
        numel = sum(p.numel() for p in params)
        self.shard_numel = math.ceil(numel / world_size)
        super().__init__(params, buffer_numel=self.shard_numel * world_size)
        self.lo = rank * self.shard_numel  # this rank owns [lo, hi) of the flat layout
        self.hi = min(self.lo + self.shard_numel, self.numel)
        # The reduce-scatter writes this rank's slice of the averaged gradient here.
        self.grad_shard = torch.zeros(
            self.shard_numel, dtype=params[0].dtype, device=params[0].device
        )
        # (param, start, end, at): the pieces of parameters that fall in [lo, hi): values start..end
        # of the flattened parameter, which sit at position `at` of this rank's slice.
        self.pieces: list[tuple[nn.Parameter, int, int, int]] = []
        offset = 0
        for p in params:
            start, end = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if start < end:
                self.pieces.append((p, start - offset, end - offset, start - self.lo))
            offset += p.numel()


class ZeroOneDataParallel(BucketedDataParallel):
    """BucketedDataParallel whose buckets are REDUCE-SCATTERED: each rank gets only its slice."""

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ):
        self.rank = dist.get_rank(process_group)
        super().__init__(module, bucket_cap_mb, process_group)
        self.grads_ready = False  # set by finish_gradient_sync, consumed by ShardedOptimizer.step

    def _new_bucket(self, params: list[nn.Parameter]) -> _ShardedBucket:
        # The same grouping into buckets as BucketedDataParallel's, each bucket sharded.
        return _ShardedBucket(params, self.world_size, self.rank)

    @torch.no_grad()
    def _launch(self, bucket: _ShardedBucket) -> None:
        self._pack(bucket)  # the gradients, flattened into the buffer as for an all-reduce
        bucket.buffer[bucket.numel :].zero_()  # the padding: zeros, so it sums to zero
        bucket.buffer.div_(self.world_size)  # the sum of the 1/W's is the average
        # reduce-scatter: rank r receives the sum over ranks of slice r of everyone's buffer, and
        # nothing else. Half the traffic of an all-reduce (which is a reduce-scatter followed by an
        # all-gather of the sums).
        bucket.work = reduce_scatter_single(
            bucket.grad_shard,
            bucket.buffer,
            op=dist.ReduceOp.SUM,
            group=self.process_group,
            async_op=True,
        )
        self.comm_calls += 1

    def _unpack(self, bucket: _ShardedBucket) -> None:
        pass  # the reduce-scatter wrote this rank's averaged slice straight into bucket.grad_shard

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        if not self._require_sync:
            return  # the last backward ran inside no_sync(): nothing was launched
        super().finish_gradient_sync()  # wait for every bucket's reduce-scatter
        # The full .grad of every parameter still holds this rank's LOCAL gradient, never averaged:
        # drop it, so that nothing (a clip_grad_norm_ over model.parameters(), say) reads it by
        # mistake. Only the slices in grad_shard are the gradient from here on.
        for p in self.params:
            p.grad = None
        self.grads_ready = True


class ShardedOptimizer:
    """Any elementwise torch optimizer (AdamW here) over the slices this rank owns.

    `param_groups` are the groups one process would give the optimizer (the GPT's
    `optimizer_groups`: weight decay on matrices, none on biases and LayerNorm gains). Each owned
    piece goes into the group of the parameter it comes from, so the groups survive sharding
    even where a slice holds the end of a matrix and the start of a bias.
    """

    def __init__(
        self,
        model: ZeroOneDataParallel,
        param_groups: list[dict],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        **defaults,
    ):
        self.model = model
        self.world_size, self.process_group = model.world_size, model.process_group
        # The order of the parameters in the groups is the order a plain optimizer's state_dict
        # numbers them in: the gathered checkpoint uses it, so it loads in chapter 01.
        self.global_params = [p for group in param_groups for p in group["params"]]
        self.group_sizes = [len(group["params"]) for group in param_groups]
        group_of = {id(p): i for i, group in enumerate(param_groups) for p in group["params"]}
        if sorted(map(id, self.global_params)) != sorted(map(id, model.params)):
            raise ValueError("param_groups must hold each of the model's parameters exactly once")
        local_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in param_groups
        ]
        # piece = (param, start, end, bucket, offset in the slice). Its optimizer tensor is a VIEW
        # of the live parameter, so AdamW updates the model in place, and its gradient a view of the
        # bucket's grad_shard, refilled by every reduce-scatter.
        self.pieces = []
        for bucket in model.buckets:
            for p, start, end, at in bucket.pieces:
                view = p.detach().view(-1)[start:end]
                view.grad = bucket.grad_shard[at : at + end - start]
                local_groups[group_of[id(p)]]["params"].append(view)
                self.pieces.append((p, start, end, bucket, at, view))
        # A group may be empty on some rank (it owns no bias at all): torch accepts that. Keeping
        # every group on every rank keeps the groups' indices the same on all ranks, and with
        # them the LR schedule's loop.
        self.optimizer = optimizer_class(local_groups, **defaults)

    @property
    def param_groups(self) -> list[dict]:
        """This rank's groups: the LR schedule must be set here on EVERY rank, each step."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The slices' gradients are overwritten by the next reduce-scatter; only the model's
        # full gradients (accumulated by backward) need clearing.
        self.model.module.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient so that the norm of the WHOLE gradient is at most max_norm.

        Each rank sees only its slice. The squared norm of the whole gradient is the sum of the
        slices' squared norms, so one all-reduce of a single number gives every rank the same
        total norm, and every slice is scaled by the same factor, as clip_grad_norm_ would scale
        the full gradient in one process.
        """
        squares = torch.zeros((), dtype=torch.float32, device=self.model.buckets[0].buffer.device)
        for bucket in self.model.buckets:
            squares += bucket.grad_shard.float().pow(2).sum()  # the padding holds zeros
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.process_group)
        total_norm = squares.sqrt()
        # the same coefficient as torch.nn.utils.clip_grad_norm_
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for bucket in self.model.buckets:
            bucket.grad_shard.mul_(coef.to(bucket.grad_shard.dtype))
        return total_norm

    @torch.no_grad()
    def step(self) -> None:
        if not self.model.grads_ready:
            raise RuntimeError(
                "call model.finish_gradient_sync() before optimizer.step(): the averaged "
                "gradient slices are not there yet"
            )
        self.model.grads_ready = False
        self.optimizer.step()  # AdamW on this rank's pieces only, in place in the parameters
        self._all_gather_parameters()

    @torch.no_grad()
    def _all_gather_parameters(self) -> None:
        # Every rank has updated only its own slice. Each sends it and receives all the others:
        # the bucket's buffer (free now, the gradients have been reduced) receives the whole
        # updated layout, which is copied back into the parameters.
        works = []
        for bucket in self.model.buckets:
            mine = bucket.buffer.new_zeros(bucket.shard_numel)
            for p, start, end, at in bucket.pieces:
                mine[at : at + end - start].copy_(p.detach().view(-1)[start:end])
            works.append(
                all_gather_single(bucket.buffer, mine, group=self.process_group, async_op=True)
            )
        for bucket, work in zip(self.model.buckets, works):
            work.wait()
            offset = 0
            for p in bucket.params:
                p.detach().view(-1).copy_(bucket.buffer[offset : offset + p.numel()])
                offset += p.numel()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (for AdamW: two moments of its slice, and
        the step counts)."""
        return sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t)
        )

    # ---- checkpoints: the full state, in the format of one process's optimizer.state_dict() ----

    @torch.no_grad()
    def full_state_dict(self, to: int = 0) -> dict | None:
        """Gather the whole optimizer state on rank `to`, as a plain optimizer over all parameters
        would have it; other ranks get None. Every rank must call it (it is a collective)."""
        state = self.optimizer.state
        keys = sorted(
            {k for s in state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0}
        )
        gathered: dict[str, list[torch.Tensor]] = {}
        for key in keys:  # exp_avg, exp_avg_sq: one gather per bucket and per kind of state
            for bucket in self.model.buckets:
                mine = bucket.buffer.new_zeros(bucket.shard_numel)
                for _, start, end, b, at, view in self.pieces:
                    if b is bucket:
                        mine[at : at + end - start].copy_(state[view][key])
                parts = None  # where the slices arrive: on rank `to` only
                if self.model.rank == to:
                    parts = [torch.empty_like(mine) for _ in range(self.world_size)]
                dist.gather(mine, parts, group=self.process_group, group_dst=to)
                gathered.setdefault(key, []).append(torch.cat(parts) if parts else None)
        if self.model.rank != to:
            return None
        full: dict[int, dict] = {}
        if keys:
            index = {id(p): i for i, p in enumerate(self.global_params)}
            scalars = next(iter(state.values()))  # "step": the same in every piece, on every rank
            for bucket_index, bucket in enumerate(self.model.buckets):
                offset = 0
                for p in bucket.params:
                    entry = {
                        k: v.clone() if torch.is_tensor(v) else v
                        for k, v in scalars.items()
                        if not (torch.is_tensor(v) and v.dim() > 0)
                    }
                    for key in keys:
                        bucket_state = gathered[key][bucket_index]  # every rank's slice, in order
                        entry[key] = bucket_state[offset : offset + p.numel()].view_as(p).clone()
                    full[index[id(p)]] = entry
                    offset += p.numel()
        # The hyperparameters of each group (the LR the schedule set last, betas, weight decay),
        # with the parameters numbered as a plain optimizer numbers them: in group order, from 0.
        groups, first = [], 0
        for group, size in zip(self.optimizer.param_groups, self.group_sizes):
            hyperparameters = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyperparameters, "params": list(range(first, first + size))})
            first += size
        return {"state": dict(sorted(full.items())), "param_groups": groups}

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full optimizer state (a chapter 01 checkpoint's, or full_state_dict()'s): every
        rank reads all of it and keeps the slices it owns."""
        sizes = [len(g["params"]) for g in state_dict["param_groups"]]
        if sizes != self.group_sizes:
            raise ValueError(
                f"the saved optimizer has groups of {sizes} parameters, this one {self.group_sizes}"
            )
        index = {id(p): i for i, p in enumerate(self.global_params)}
        piece_of = {id(view): (p, start, end) for p, start, end, _, _, view in self.pieces}
        local_state, groups, first = {}, [], 0
        for saved_group, group in zip(state_dict["param_groups"], self.optimizer.param_groups):
            for i, view in enumerate(group["params"], start=first):
                p, start, end = piece_of[id(view)]
                saved = state_dict["state"].get(index[id(p)])
                if saved is not None:  # a state saved before any step has no entries
                    # clone() everything, the step counts too: AdamW increments "step" in place,
                    # and a tensor shared with the caller's dict would change the caller's copy
                    local_state[i] = {k: _own_part(v, start, end) for k, v in saved.items()}
            hyperparameters = {k: v for k, v in saved_group.items() if k != "params"}
            groups.append(
                {**hyperparameters, "params": list(range(first, first + len(group["params"])))}
            )
            first += len(group["params"])
        self.optimizer.load_state_dict({"state": local_state, "param_groups": groups})


def _own_part(value, start: int, end: int):
    """This rank's copy of one saved state entry: elements start:end of a per-element tensor
    (exp_avg, exp_avg_sq), a whole 0-dim tensor (the step count), any other value as it is."""
    if not torch.is_tensor(value):
        return value
    return (value.reshape(-1)[start:end] if value.dim() > 0 else value).clone()
