r"""Run under torchrun by tests/test_zero.py: chapter 01's run with ZeRO-1 (04_ddp/zero1.py),
with ZeroRedundancyOptimizer, with DDP + AdamW and with three broken ZeRO-1s; rank 0 writes all
the results."""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import RandomSampler

from common.checkpoint import load_checkpoint, write_checkpoint
from common.config import CourseParser, gpt_config_from_args
from common.data import batch_loader, load_splits, prepare
from common.model import GPT
from common.training import lr_at
from layout import chapter_module
from tests.workers.worker_shared import flat, gloo_group, state_bytes, write_results

chapter_module("04_ddp", "ddp_by_hand")  # first: zero1 imports it
zero1 = chapter_module("04_ddp", "zero1")
ShardedOptimizer = zero1.ShardedOptimizer
ZeroOneDataParallel = zero1.ZeroOneDataParallel
reduce_scatter_single = zero1.reduce_scatter_single

# 10 KB: the small blocks' gradients fill several buckets, the tied matrix one of its own
BUCKET_MB = 0.01
SAVE_AT = 5


# --- deliberately broken variants: the tests must tell them apart from the real thing ----------


class LocalNormClip(ShardedOptimizer):
    """Clips each slice with its own norm (no all-reduce of the squares): wrong factors."""

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        squares = sum(b.grad_shard.float().pow(2).sum() for b in self.model.buckets)
        norm = squares.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for bucket in self.model.buckets:
            bucket.grad_shard.mul_(coef)
        return norm


class NoAllGather(ShardedOptimizer):
    """Updates this rank's slice and stops: the other ranks' updates never arrive."""

    @torch.no_grad()
    def step(self):
        self.model.grads_ready = False
        self.optimizer.step()


class SumNotAverage(ZeroOneDataParallel):
    """Reduce-scatters the SUM of the gradients: the division by W is forgotten."""

    @torch.no_grad()
    def _launch(self, bucket):
        self._pack(bucket)
        bucket.buffer[bucket.numel :].zero_()
        bucket.work = reduce_scatter_single(bucket.grad_shard, bucket.buffer, async_op=True)
        self.comm_calls += 1


class Run:
    """One implementation: a model, its optimizer, and one optimizer step of chapter 01's loop."""

    def __init__(self, impl: str, model: GPT, args):
        self.impl, self.args = impl, args
        groups = model.optimizer_groups(args.weight_decay)
        adamw = dict(lr=args.lr, betas=(args.beta1, args.beta2))
        if impl in ("ddp", "zero_redundancy"):
            self.model = DistributedDataParallel(model)
            if impl == "ddp":
                self.optimizer = torch.optim.AdamW(groups, **adamw)
            else:
                self.optimizer = ZeroRedundancyOptimizer(
                    groups, optimizer_class=torch.optim.AdamW, **adamw
                )
        else:
            wrapper = SumNotAverage if impl == "broken_sum_not_average" else ZeroOneDataParallel
            optimizer = {
                "broken_local_norm_clip": LocalNormClip,
                "broken_no_all_gather": NoAllGather,
            }.get(impl, ShardedOptimizer)
            self.model = wrapper(model, bucket_cap_mb=BUCKET_MB)
            self.optimizer = optimizer(self.model, groups, torch.optim.AdamW, **adamw)
        self.params = list(self.model.module.parameters())  # unique: the tied matrix once
        if isinstance(self.model, ZeroOneDataParallel):
            # How many gradients were final when each bucket's reduce-scatter was launched: fewer
            # than all of them means it started while backward was still running (the overlap).
            self.ready_at_launch = []
            launch = self.model._launch

            def traced_launch(bucket):
                if bucket is self.model.buckets[0]:
                    self.ready_at_launch.clear()  # a new backward
                self.ready_at_launch.append(sum(b.ready for b in self.model.buckets))
                launch(bucket)

            self.model._launch = traced_launch

    def step(
        self, iter_num: int, xs: torch.Tensor, ys: torch.Tensor, K: int
    ) -> tuple[torch.Tensor, float]:
        lr = lr_at(iter_num, self.args)
        for group in self.optimizer.param_groups:  # on every rank: each holds its own optimizer
            group["lr"] = lr
        B = len(xs) // K
        loss_sum = torch.zeros(())
        for micro in range(K):
            ctx = self.model.no_sync() if micro < K - 1 else contextlib.nullcontext()
            with ctx:
                _, loss = self.model(
                    xs[micro * B : (micro + 1) * B], ys[micro * B : (micro + 1) * B]
                )
                (loss / K).backward()
            loss_sum += loss.detach() / K
        if isinstance(self.model, DistributedDataParallel):
            # every rank holds the whole averaged gradient: clipping is chapter 01's
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        else:
            self.model.finish_gradient_sync()
            norm = self.optimizer.clip_grad_norm_(self.args.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm.item()

    def state_bytes(self) -> int:
        if self.impl == "ddp":
            return state_bytes(self.optimizer.state)
        if self.impl == "zero_redundancy":
            # the local optimizer over this rank's tensors
            return state_bytes(self.optimizer.optim.state)
        return self.optimizer.state_bytes()

    def full_optimizer_state(self) -> dict | None:
        """The whole optimizer state on rank 0 (None elsewhere): a collective when sharded."""
        if self.impl == "ddp":
            return self.optimizer.state_dict() if dist.get_rank() == 0 else None
        if self.impl == "zero_redundancy":
            self.optimizer.consolidate_state_dict(to=0)
            return self.optimizer.state_dict() if dist.get_rank() == 0 else None
        return self.optimizer.full_state_dict(to=0)

    def load_optimizer_state(self, state: dict) -> None:
        if self.impl == "zero_redundancy":
            # a deep copy: it overwrites entries it does not own
            self.optimizer.load_state_dict(copy.deepcopy(state))
        else:
            self.optimizer.load_full_state_dict(state)


def train(impl, K, args, config, batches, rank, world, start=0, checkpoint=None, save_dir=None):
    if checkpoint is None:
        # rank 0 starts from chapter 01's init, every other rank elsewhere
        torch.manual_seed(args.seed if rank == 0 else args.seed + 1000 + rank)
        model = GPT(config)
    else:
        model = GPT(config)
        model.load_state_dict(checkpoint["model"])
    run = Run(impl, model, args)
    if checkpoint is not None:
        run.load_optimizer_state(checkpoint["optimizer"])
    losses, norms = [], []
    for iter_num in range(start, args.max_iters):
        x, y = batches[iter_num]
        loss, norm = run.step(iter_num, x[rank::world], y[rank::world], K)
        losses.append(loss)
        norms.append(norm)
        if save_dir is not None and iter_num + 1 == SAVE_AT:
            full = run.full_optimizer_state()
            if rank == 0:
                write_checkpoint(
                    save_dir,
                    model_state=run.model.module.state_dict(),
                    optimizer_state=full,
                    iter_num=SAVE_AT,
                    model_config=config,
                    train_config=vars(args) | {"global_batch": args.batch_size, "chapter": 4},
                )
    losses = torch.stack(losses)
    # each rank's loss is the mean over its rows: the mean of the means is the global loss
    dist.all_reduce(losses)
    return run, (losses / world).tolist(), norms


def measure(run, losses, norms, rank, world, reference: torch.Tensor) -> dict:
    final = flat(run.params)
    rank0 = final.clone()
    dist.broadcast(rank0, src=0)
    worst = torch.tensor(
        [(final - reference).abs().max().item(), (final - rank0).abs().max().item()],
        dtype=torch.float64,
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    sharded = isinstance(run.model, ZeroOneDataParallel)
    mine = torch.tensor(
        [
            run.state_bytes(),
            sum(end - start for _, start, end, *_ in run.optimizer.pieces) if sharded else 0,
        ],
        dtype=torch.int64,
    )
    per_rank = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(per_rank, mine)
    result = {
        "losses": losses,
        "grad_norms": norms,
        "params_vs_reference": worst[0].item(),
        "params_across_ranks": worst[1].item(),
        "state_bytes": [int(t[0]) for t in per_rank],
        "n_elements": final.numel(),
        "n_params": len(run.params),
    }
    if sharded:
        # elements of the model each rank updates
        result["owned_numel"] = [int(t[1]) for t in per_rank]
        result["n_buckets"] = len(run.model.buckets)
        result["comm_calls_per_step"] = run.model.comm_calls / len(losses)
        result["grads_ready_at_each_launch"] = run.ready_at_launch  # of the last step
    return result


def compare_states(full: dict, reference: dict) -> float:
    """max |difference| of every state tensor; inf if the two do not hold the same entries."""
    if full["state"].keys() != reference["state"].keys():
        return float("inf")
    worst = 0.0
    for i, entry in reference["state"].items():
        if entry.keys() != full["state"][i].keys():
            return float("inf")
        for key, value in entry.items():
            worst = max(worst, (full["state"][i][key].float() - value.float()).abs().max().item())
    groups = [
        {k: v for k, v in g.items() if k not in ("lr", "initial_lr")} for g in full["param_groups"]
    ]
    wanted = [
        {k: v for k, v in g.items() if k not in ("lr", "initial_lr")}
        for g in reference["param_groups"]
    ]
    return worst if groups == wanted else float("inf")


def main() -> None:
    out_dir, ch01_step5, ch01_final = map(Path, sys.argv[1:4])
    extras = "--extras" in sys.argv[4 : sys.argv.index("--")]
    args = CourseParser(chapter=1, description="").parse_args(sys.argv[sys.argv.index("--") + 1 :])
    with gloo_group() as (rank, world):
        torch.use_deterministic_algorithms(True)
        config = gpt_config_from_args(args)
        train_set, _ = load_splits(
            prepare(args.dataset, args.data_dir, log=lambda *a: None), config.block_size
        )
        order = torch.Generator().manual_seed(args.seed)  # epoch 0, as chapter 01 seeds it
        loader = iter(
            batch_loader(train_set, RandomSampler(train_set, generator=order), args.batch_size)
        )
        # chapter 01's global batches, (G, T) each
        batches = [next(loader) for _ in range(args.max_iters)]
        # one implementation at K micro-steps on those batches, on this rank's rows
        train_here = functools.partial(
            train, args=args, config=config, batches=batches, rank=rank, world=world
        )
        results = {}
        for K in (1, 3):
            if args.batch_size % (K * world):
                raise SystemExit(
                    f"--batch-size {args.batch_size} is not a multiple of K * W = {K * world}"
                )
            ddp, losses, norms = train_here("ddp", K)
            ddp_params = flat(ddp.params)
            ddp_state = ddp.full_optimizer_state()
            results[f"ddp/K={K}"] = measure(ddp, losses, norms, rank, world, ddp_params)
            broken = ("broken_local_norm_clip", "broken_no_all_gather", "broken_sum_not_average")
            for impl in ("zero1", "zero_redundancy", *(broken if extras and K == 3 else ())):
                # with --extras, the two real ones save a gathered checkpoint at step 5,
                # which chapter 01 resumes
                save = extras and K == 3 and impl in ("zero1", "zero_redundancy")
                save_dir = out_dir / f"{impl}_step{SAVE_AT}" if save else None
                run, losses, norms = train_here(impl, K, save_dir=save_dir)
                results[f"{impl}/K={K}"] = measure(run, losses, norms, rank, world, ddp_params)
                if impl in ("zero1", "zero_redundancy"):
                    full = run.full_optimizer_state()  # the whole state, gathered on rank 0
                    if rank == 0:
                        results[f"{impl}/K={K}"]["state_vs_ddp"] = compare_states(full, ddp_state)
        # chapter 01's step-5 checkpoint, resumed under ZeRO-1 and ZeroRedundancyOptimizer
        if extras:
            checkpoint = load_checkpoint(ch01_step5)
            final = load_checkpoint(ch01_final)["model"]
            reference = flat(final[name] for name, _ in GPT(config).named_parameters())
            for impl in ("zero1", "zero_redundancy"):
                run, losses, norms = train_here(
                    impl, 3, start=checkpoint["iter_num"], checkpoint=checkpoint
                )
                results[f"{impl}/resumed_from_ch01"] = measure(
                    run, losses, norms, rank, world, reference
                )
        write_results(out_dir, results)


if __name__ == "__main__":
    main()
