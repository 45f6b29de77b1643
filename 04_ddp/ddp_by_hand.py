"""Data parallelism by hand: what DistributedDataParallel does, built from torch.distributed.

Every rank holds a full copy of the model and runs forward and backward on its own shard of the
global batch. Two things keep the copies identical, step after step:

1. they START identical: rank 0's parameters are broadcast to every other rank;
2. they take the SAME optimizer step: before `optimizer.step()`, every rank replaces its local
   gradient by the average of all ranks' gradients. Because each rank's loss is a mean over an
   equal-sized shard, that average is exactly the gradient of the mean loss over the whole global
   batch, the gradient one process would compute on all of it.

Two wrappers do this, sharing a small base:

- `NaiveDataParallel` waits until backward has finished, then all-reduces the gradients one
  parameter at a time. Correct, simple, and slow: the network sits idle during backward and the
  compute sits idle during communication, and there is one collective call per parameter.
- `BucketedDataParallel` groups gradients into buckets of a few megabytes and starts an
  asynchronous all-reduce for a bucket the moment all its gradients are final, while backward is
  still computing the gradients of earlier layers. This is the core of DDP.

Both have `no_sync()` for gradient accumulation and need one call, `finish_gradient_sync()`,
between the last `backward()` and `optimizer.step()` (DDP hides that call inside backward).

    model = BucketedDataParallel(GPT(config), bucket_cap_mb=25)
    for micro_step in range(grad_accum):
        ctx = model.no_sync() if micro_step < grad_accum - 1 else contextlib.nullcontext()
        with ctx:
            _, loss = model(x, y)
            (loss / grad_accum).backward()
    model.finish_gradient_sync()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

The process group must be initialised (`torch.distributed.init_process_group`), and the model
moved to its device, before wrapping: the buckets' buffers are allocated where the parameters are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn


class _DataParallelBase(nn.Module):
    """What both wrappers share: the broadcast, forward, `no_sync()`, and the list of parameters."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        # as in DDP: the wrapped model is `.module`, state_dict keys get "module."
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        # `parameters()` yields each Parameter object once. That matters: the GPT ties
        # wte.weight and lm_head.weight (one Parameter under two names). Iterating
        # `named_parameters(remove_duplicate=False)` would visit it twice and, below, average its
        # gradient twice or wait for a hook that fires only once.
        self.params = [p for p in module.parameters() if p.requires_grad]
        # How many collective calls (all-reduces) this wrapper has issued: the chapter prints it,
        # and the tests check that no_sync() really defers communication.
        self.comm_calls = 0
        # no_sync() switches this off; forward() records it for the backward that follows.
        self._sync_enabled = True
        self._require_sync = True
        self._broadcast_from_rank0()

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        # Each rank built its model with its own random initialisation (or loaded a checkpoint on
        # rank 0 only). Averaging gradients keeps copies equal only if they start equal, so copy
        # rank 0's parameters and buffers everywhere. broadcast works in place on each tensor.
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            dist.broadcast(tensor.detach(), group=self.process_group, group_src=0)

    def forward(self, *args, **kwargs):
        # Decide now, at forward time, whether the backward of this forward will communicate. DDP
        # decides at the same moment, which is why its docs say to put the forward inside no_sync().
        # A forward under torch.no_grad() (evaluation) has no backward, so it changes nothing.
        if torch.is_grad_enabled():
            self._before_forward()
            self._require_sync = self._sync_enabled
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this context, backward only accumulates gradients locally, in `.grad`.

        With gradient accumulation, the K micro-steps of one optimizer step each add their
        gradient into `.grad`. Averaging across ranks is linear, so averaging the sum once, after
        the last micro-step, gives the same result as averaging each micro-step, with 1/K of the
        communication. So all micro-steps but the last run inside no_sync().
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _before_forward(self) -> None:
        """A hook for subclasses: checks and resets before a new forward."""

    def finish_gradient_sync(self) -> None:
        """Make every rank's `.grad` the average over ranks. Call before `optimizer.step()`."""
        raise NotImplementedError


class NaiveDataParallel(_DataParallelBase):
    """After backward has finished, all-reduce every gradient and divide by the world size."""

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        if not self._require_sync:
            return  # the last backward ran inside no_sync(): gradients stay local for now
        for p in self.params:
            if p.grad is None:
                # Every rank must make the same collective calls in the same order, or they
                # wait for each other forever; a parameter without a gradient would break that.
                raise RuntimeError(
                    "a parameter received no gradient; this wrapper needs every parameter used"
                )
            # SUM over ranks, in place, then divide: the average gradient. One blocking call per
            # parameter: for a small model most of the time goes into per-call latency.
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.process_group)
            p.grad.div_(self.world_size)
            self.comm_calls += 1


class _Bucket:
    """A group of parameters whose gradients travel together in one flat buffer."""

    def __init__(self, params: list[nn.Parameter], buffer_numel: int | None = None):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        # The flat buffer is allocated once and reused every step. Gradients are copied into it,
        # reduced there, and copied back out (DDP's gradient_as_bucket_view=True avoids both
        # copies by making each .grad a view into this buffer).
        self.buffer = torch.empty(
            buffer_numel or self.numel, dtype=params[0].dtype, device=params[0].device
        )
        self.ready = 0  # how many of `params` have their final gradient in this backward
        self.work: dist.Work | None = None  # the handle of the asynchronous all-reduce


class BucketedDataParallel(_DataParallelBase):
    """All-reduce gradients in buckets, asynchronously, while backward is still running."""

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(module, process_group)
        self.buckets = self._make_buckets(bucket_cap_mb)
        self._next_bucket = 0  # buckets are launched strictly in this order, see _mark_ready
        self._hook_handles = []
        for index, bucket in enumerate(self.buckets):
            for p in bucket.params:
                # register_post_accumulate_grad_hook fires after autograd has ADDED this
                # backward's gradient into p.grad: then p.grad is final for this backward. It fires
                # once per parameter per backward, however many times the parameter was used in
                # the forward (the tied wte/lm_head matrix included): autograd sums all uses first.
                self._hook_handles.append(
                    p.register_post_accumulate_grad_hook(self._make_hook(index))
                )

    def _make_buckets(self, bucket_cap_mb: float) -> list[_Bucket]:
        # Backward computes gradients roughly in the reverse of the order the layers were
        # created in (the output layer first, the embeddings last). Filling buckets in reverse
        # registration order puts gradients that are ready at about the same time together, so
        # the first bucket fills up early and its all-reduce overlaps with the rest of backward.
        cap_bytes = bucket_cap_mb * 1024 * 1024
        buckets, current, current_bytes = [], [], 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            same_kind = not current or (
                p.dtype == current[0].dtype and p.device == current[0].device
            )
            if current and (current_bytes + nbytes > cap_bytes or not same_kind):
                buckets.append(self._new_bucket(current))
                current, current_bytes = [], 0
            current.append(p)  # a parameter larger than the cap gets a bucket of its own
            current_bytes += nbytes
        if current:
            buckets.append(self._new_bucket(current))
        return buckets

    def _new_bucket(self, params: list[nn.Parameter]) -> _Bucket:
        return _Bucket(params)  # zero1.py's wrapper makes sharded buckets here

    def _make_hook(self, bucket_index: int):
        def hook(param: torch.Tensor) -> None:
            self._mark_ready(bucket_index)

        return hook

    def _before_forward(self) -> None:
        if any(b.work is not None for b in self.buckets):
            raise RuntimeError(
                "all-reduces from the last backward are still pending: "
                "call finish_gradient_sync() before optimizer.step()"
            )
        # A new forward, a new backward: no gradient of it is ready yet.
        for bucket in self.buckets:
            bucket.ready = 0
        self._next_bucket = 0

    def _mark_ready(self, bucket_index: int) -> None:
        if not self._require_sync:
            return  # inside no_sync(): the gradient just stays in .grad and accumulates
        bucket = self.buckets[bucket_index]
        bucket.ready += 1
        if bucket.ready > len(bucket.params):
            raise RuntimeError(
                "a gradient became ready twice in one backward (two backward passes "
                "through one forward?); call the wrapped model once per backward"
            )
        # Launch buckets strictly in bucket order, never out of it. Every rank must issue its
        # collectives in the same order: the k-th all-reduce of rank 0 is matched with the k-th of
        # rank 1. If the hooks fired in a different order on some rank (they can, e.g. when the
        # graph differs between ranks), launching "whichever bucket is full" could pair bucket 2
        # of one rank with bucket 3 of another: wrong sums or a hang. DDP does the same.
        while self._next_bucket < len(self.buckets):
            next_bucket = self.buckets[self._next_bucket]
            if next_bucket.ready != len(next_bucket.params):
                break  # not full yet: later buckets wait for it, however full they are
            self._launch(next_bucket)
            self._next_bucket += 1

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        # Flatten the bucket's gradients into its buffer: one big all-reduce instead of many
        # small ones. Divide first (by a power of two with 2 ranks, exact), so that the sum is
        # already the mean.
        self._pack(bucket)
        bucket.buffer.div_(self.world_size)
        # async_op=True returns at once with a handle; the reduction runs in the background (gloo's
        # or NCCL's own threads/streams) while autograd goes on with earlier layers.
        bucket.work = dist.all_reduce(
            bucket.buffer, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
        )
        self.comm_calls += 1

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        if not self._require_sync:
            return  # the last backward ran inside no_sync(): nothing was launched
        if self._next_bucket < len(self.buckets):
            # Some hook never fired: a parameter got no gradient in this backward (unused in the
            # forward). DDP's find_unused_parameters=True exists for exactly this case.
            missing = [i for i, b in enumerate(self.buckets) if b.ready < len(b.params)]
            raise RuntimeError(
                f"buckets {missing} never became ready: some parameters received no gradient"
            )
        for bucket in self.buckets:
            bucket.work.wait()  # the averaged values are in bucket.buffer from here on
            bucket.work = None
            self._unpack(bucket)
            bucket.ready = 0
        self._next_bucket = 0

    @torch.no_grad()
    def _pack(self, bucket: _Bucket) -> None:
        # Copy every parameter's .grad, flattened, into its place in the bucket's buffer.
        offset = 0
        for p in bucket.params:
            n = p.numel()
            bucket.buffer[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n

    @torch.no_grad()
    def _unpack(self, bucket: _Bucket) -> None:
        # Copy the averaged values from the flat buffer back into each parameter's .grad.
        offset = 0
        for p in bucket.params:
            n = p.numel()
            p.grad.copy_(bucket.buffer[offset : offset + n].view_as(p.grad))
            offset += n
