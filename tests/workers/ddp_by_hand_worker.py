"""Run under torchrun by tests/test_ddp_by_hand.py: the same tiny GPT trained with DDP, the
by-hand wrappers and broken variants, K in (1, 3), each rank from its own initialisation."""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.model import GPT, model_config
from layout import chapter_module
from tests.workers.worker_shared import flat, gloo_group, write_results

by_hand = chapter_module("04_ddp", "ddp_by_hand")
BucketedDataParallel = by_hand.BucketedDataParallel
NaiveDataParallel = by_hand.NaiveDataParallel

STEPS = 3
MICRO_BATCH = 2  # sequences per rank per micro-step
BUCKET_MB = 0.01  # 10 KB: the tiny model's gradients fill several buckets
CONFIG = model_config("tiny", n_embd=16, vocab_size=512, block_size=16, dropout=0.0)


# --- deliberately broken variants: the tests must tell them apart from the real thing ----------


class StaleGradHook(BucketedDataParallel):
    """`Tensor.register_hook` in place of a post-accumulate hook: it fires BEFORE autograd adds
    the gradient into .grad, so the bucket averages the stale .grad."""

    def __init__(self, module, bucket_cap_mb):
        super().__init__(module, bucket_cap_mb)
        for handle in self._hook_handles:
            handle.remove()
        for index, bucket in enumerate(self.buckets):
            for p in bucket.params:
                p.register_hook(lambda grad, index=index: self._mark_ready(index))

    def _launch(self, bucket):
        for p in bucket.params:
            if p.grad is None:  # the usual case at this moment: nothing accumulated yet
                p.grad = torch.zeros_like(p)
        super()._launch(bucket)


class IncomingGradHook(NaiveDataParallel):
    """All-reduce the incoming gradient in a `Tensor.register_hook`: right at K = 1; with no_sync()
    and K > 1 the earlier micro-steps' gradients, already in .grad, stay local."""

    def __init__(self, module):
        super().__init__(module)
        for p in self.params:
            p.register_hook(self._reduce_incoming)

    def _reduce_incoming(self, grad):
        if not self._require_sync:
            return None
        grad = grad.clone()
        dist.all_reduce(grad)
        self.comm_calls += 1
        return grad / self.world_size  # what autograd will add into .grad

    def finish_gradient_sync(self):
        pass  # the hooks did all the communication


class ReduceParameter(BucketedDataParallel):
    """Averages the (already equal) parameter, not its gradient: each rank steps with its own
    local gradient and the copies drift apart."""

    @torch.no_grad()
    def _launch(self, bucket):
        offset = 0
        for p in bucket.params:
            bucket.buffer[offset : offset + p.numel()].copy_(p.reshape(-1))
            offset += p.numel()
        bucket.buffer.div_(self.world_size)
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self.comm_calls += 1

    @torch.no_grad()
    def finish_gradient_sync(self):
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            offset = 0
            for p in bucket.params:
                p.copy_(bucket.buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            bucket.ready = 0
        self._next_bucket = 0


IMPLS = {
    "ddp": lambda m: DistributedDataParallel(m),
    "naive": lambda m: NaiveDataParallel(m),
    "bucketed": lambda m: BucketedDataParallel(m, bucket_cap_mb=BUCKET_MB),
    "bucketed_one_bucket": lambda m: BucketedDataParallel(m, bucket_cap_mb=25),
    "broken_stale_grad_hook": lambda m: StaleGradHook(m, bucket_cap_mb=BUCKET_MB),
    "broken_incoming_grad_hook": lambda m: IncomingGradHook(m),
    "broken_reduce_parameter": lambda m: ReduceParameter(m, bucket_cap_mb=BUCKET_MB),
}


def run(
    impl: str, K: int, rank: int, world: int, ddp_params: torch.Tensor | None
) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(100 + rank)  # a different initialisation on every rank, on purpose
    model = GPT(CONFIG)
    rank0 = flat(model.parameters())
    dist.broadcast(rank0, src=0)
    # > 0: the ranks start apart, so the check after the wrapper's broadcast means something
    init_before_wrap = (flat(model.parameters()) - rank0).abs().max().item()
    wrapped = IMPLS[impl](model)
    params = list(wrapped.module.parameters())  # unique: the tied matrix once
    init_across_ranks = (flat(params) - rank0).abs().max().item()

    # For the real bucketed wrapper, record how many gradients were final when each bucket's
    # all-reduce was launched: fewer than all of them means it started while backward was running.
    ready_at_launch, n_ready = [], [0]
    if type(wrapped) is BucketedDataParallel:
        mark_ready, launch = wrapped._mark_ready, wrapped._launch

        def traced_mark_ready(index):
            n_ready[0] += wrapped._require_sync
            mark_ready(index)

        def traced_launch(bucket):
            ready_at_launch.append(n_ready[0])
            launch(bucket)

        wrapped._mark_ready, wrapped._launch = traced_mark_ready, traced_launch

    single = copy.deepcopy(wrapped.module)  # one process, unwrapped, over the whole global batch
    single_params = list(single.parameters())
    assert single.transformer.wte.weight is single.lm_head.weight  # deepcopy keeps the tie
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1234)  # the same global batches on every rank
    G = MICRO_BATCH * K * world
    grad_vs_single = grad_across_ranks = 0.0
    for _ in range(STEPS):
        ready_at_launch.clear()
        n_ready[0] = 0
        data = torch.randint(0, CONFIG.vocab_size, (G, CONFIG.block_size + 1), generator=gen)
        x, y = data[:, :-1], data[:, 1:]
        xs, ys = x[rank::world], y[rank::world]  # this rank's shard: K micro-batches
        for micro in range(K):
            rows = slice(micro * MICRO_BATCH, (micro + 1) * MICRO_BATCH)
            ctx = wrapped.no_sync() if micro < K - 1 else contextlib.nullcontext()
            with ctx:
                _, loss = wrapped(xs[rows], ys[rows])
                (loss / K).backward()
        if impl != "ddp":
            wrapped.finish_gradient_sync()

        with torch.no_grad():
            for s, p in zip(single_params, params):
                s.copy_(p)
        single.zero_grad(set_to_none=True)
        _, loss = single(x, y)
        loss.backward()
        grads = flat(p.grad for p in params)
        grad_vs_single = max(
            grad_vs_single, (grads - flat(p.grad for p in single_params)).abs().max().item()
        )
        rank0 = grads.clone()
        dist.broadcast(rank0, src=0)
        grad_across_ranks = max(grad_across_ranks, (grads - rank0).abs().max().item())

        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    final = flat(params)
    params_vs_ddp = 0.0 if ddp_params is None else (final - ddp_params).abs().max().item()
    names = [
        "init_before_wrap",
        "init_across_ranks",
        "grad_vs_single",
        "grad_across_ranks",
        "params_vs_ddp",
    ]
    worst = torch.tensor(
        [init_before_wrap, init_across_ranks, grad_vs_single, grad_across_ranks, params_vs_ddp],
        dtype=torch.float64,
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    result = dict(zip(names, worst.tolist()))
    result["n_params"] = len(params)
    if ready_at_launch:
        result["grads_ready_at_each_launch"] = ready_at_launch  # of the last step
    if impl != "ddp":
        result["comm_calls_per_step"] = wrapped.comm_calls / STEPS
    if isinstance(wrapped, BucketedDataParallel):
        result["n_buckets"] = len(wrapped.buckets)
    result["grad_scale"] = flat(p.grad for p in single_params).abs().max().item()
    return result, final


def main() -> None:
    out_dir = Path(sys.argv[1])
    with gloo_group() as (rank, world):
        torch.use_deterministic_algorithms(True)
        results = {}
        for K in (1, 3):
            ddp_params = None
            for impl in IMPLS:  # "ddp" first: the others are compared with its parameters
                result, final = run(impl, K, rank, world, ddp_params)
                if impl == "ddp":
                    ddp_params = final
                results[f"{impl}/K={K}"] = result
        write_results(out_dir, results)


if __name__ == "__main__":
    main()
