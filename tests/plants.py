"""The mistakes of the checker's catalogue (tools/check/mistakes.py), planted: for each entry, the
chapter script it is planted in, the ranks it is checked with, and the edits that plant it.

Each edit finds its statement by shape (tests/statements.py), never by its text, so a chapter
reformatted or rewrapped still takes every plant. An entry with no edits is a mistake of leaving the
chapter's idea out: its plant is the previous chapter's script (the exercise as given).
"""

from __future__ import annotations

from dataclasses import dataclass

from statements import Pattern as P
from statements import insert, move, replace, replace_each, rewrite, wrap


@dataclass(frozen=True)
class Plant:
    chapter: int  # the chapter script the edits change
    edits: tuple[tuple, ...]  # each (edit, pattern, *its arguments) of tests/statements.py
    ranks: int = 1  # the ranks the planted copy is checked with: 2 where the signature needs them

    def applied(self, source: str, script: str) -> str:
        for edit, *args in self.edits:
            source = edit(source, *args, script)
        return source


MICRO_LOSS_MEAN = P(assigns="micro_loss", call="mean")
NO_SYNC = P(call="no_sync")
# the `if` that chooses no_sync() on every micro-step but the last
SYNC_SWITCH = P(kind="if", uses="micro_step")
SAMPLER = P(call="DistributedSampler")
SKIP = P(assigns="skip")
DIVIDED = P(assigns="micro_loss", uses="grad_accum")

PLANTS = {
    "a collective called by only some ranks": Plant(
        4, ((wrap, P(call="all_reduce", arg="loss"), "if is_rank0:"),), ranks=2
    ),
    "the replicas' losses not reduced": Plant(3, ((replace, MICRO_LOSS_MEAN, ""),)),
    "the replicas' losses summed, not averaged": Plant(
        3, ((rewrite, MICRO_LOSS_MEAN, "micro_loss.mean()", "micro_loss.sum()"),)
    ),
    "no DataParallel": Plant(3, ()),
    "the optimizer built before fully_shard": Plant(
        7,
        ((move, P(assigns="optimizer"), P(kind="for", uses="block")),),
        ranks=2,
    ),
    "no FSDP": Plant(7, ()),
    "optimizer.step() inside the micro-loop": Plant(
        2,
        ((insert, P(call="backward"), "scaler.step(optimizer)\nscaler.update()", True),),
    ),
    "zero_grad inside the micro-loop": Plant(
        2, ((insert, P(assigns="x", call="next"), "optimizer.zero_grad(set_to_none=True)"),)
    ),
    "the learning rate advanced per micro-step": Plant(
        2, ((rewrite, P(call="lr_at"), "iter_num", "iter_num * args.grad_accum"),)
    ),
    "the gradient-sync switch off on the last micro-step": Plant(
        7,
        (
            (
                rewrite,
                P(call="set_requires_gradient_sync"),
                "micro_step == args.grad_accum - 1",
                "micro_step == 0",
            ),
        ),
        ranks=2,
    ),
    "no_sync on the wrong micro-step": Plant(
        4, ((rewrite, SYNC_SWITCH, "micro_step < args.grad_accum - 1", "micro_step > 0"),), ranks=2
    ),
    "gradients never averaged": Plant(
        4, ((replace, SYNC_SWITCH, "sync = model.no_sync()"),), ranks=2
    ),
    "clipping or stepping on some ranks only": Plant(
        4,
        (
            (
                rewrite,
                P(kind="if", uses="grad_clip"),
                "args.grad_clip > 0",
                "args.grad_clip > 0 and is_rank0",
            ),
        ),
        ranks=2,
    ),
    "a global batch that forgets world_size or grad_accum": Plant(
        4,
        (
            (
                rewrite,
                P(assigns="global_batch"),
                "args.batch_size * args.grad_accum * world_size",
                "args.batch_size * args.grad_accum",
            ),
        ),
        ranks=2,
    ),
    "all ranks reading the same windows": Plant(4, ((rewrite, SAMPLER, "rank", "0"),), ranks=2),
    "loss divided by world_size by hand": Plant(
        4,
        (
            (
                rewrite,
                DIVIDED,
                "micro_loss / args.grad_accum",
                "micro_loss / args.grad_accum / world_size",
            ),
        ),
        ranks=2,
    ),
    "loss not divided by K": Plant(2, ((replace, DIVIDED, ""),)),
    "samplers seeded per rank": Plant(
        4, ((rewrite, SAMPLER, "args.seed", "args.seed + rank"),), ranks=2
    ),
    "a forgotten set_epoch": Plant(4, ((replace, P(call="set_epoch"), "pass"),)),
    "ranks' logged loss not averaged": Plant(
        4,
        (
            (replace, P(call="all_reduce", arg="loss"), ""),
            (rewrite, P(assigns="loss_value"), "loss.item() / world_size", "loss.item()"),
        ),
        ranks=2,
    ),
    "your evaluation differs; training is the same": Plant(
        4,
        (
            (
                rewrite,
                P(assigns="val_loss", call="evaluate"),
                "val_windows",
                "val_windows[rank::world_size]",
            ),
        ),
        ranks=2,
    ),
    # chapter 06's saves kept in chapter 07 (and 06's import of save_checkpoint)
    "a checkpoint of rank 0's shards only": Plant(
        7,
        (
            (
                replace_each,
                P(call="gather_and_save"),
                "from common.checkpoint import save_checkpoint\n"
                "if is_rank0:\n"
                "    save_checkpoint(\n"
                "        out_dir, iter_num, raw_model, optimizer, scaler, train_config\n"
                "    )",
            ),
        ),
        ranks=2,
    ),
    "resume skipping steps instead of micro-batches": Plant(
        2, ((rewrite, SKIP, "step_in_epoch * args.grad_accum", "step_in_epoch"),)
    ),
    "a resume that re-reads an earlier step's windows": Plant(
        2, ((rewrite, SKIP, "step_in_epoch * args.grad_accum", "0"),)
    ),
    "a resume that does not restore the optimizer state": Plant(
        2,
        (
            (
                replace,
                P(assigns="iter_num", call="restore_training_state"),
                'iter_num = checkpoint["iter_num"]',
            ),
        ),
    ),
    "a restart that does not continue the run": Plant(
        6,
        (
            (
                rewrite,
                P(assigns="checkpoint", call="load_checkpoint"),
                "load_checkpoint(out_dir)",
                "load_checkpoint(out_dir) if args.resume else None",
            ),
        ),
        ranks=2,
    ),
    "the GPU chosen by RANK, not LOCAL_RANK": Plant(
        5, ((rewrite, P(assigns="device", uses="local_rank"), "local_rank", "rank"),), ranks=2
    ),
    "set_epoch given the step, not the epoch": Plant(
        4, ((rewrite, P(call="set_epoch"), "epoch", "iter_num"),), ranks=2
    ),
    "gradients reduced in float32 in a float64 run": Plant(
        7,
        (
            (
                rewrite,
                P(assigns="precision", code="precision = MixedPrecisionPolicy()"),
                "MixedPrecisionPolicy()",
                "MixedPrecisionPolicy(reduce_dtype=torch.float32)",
            ),
        ),
        ranks=2,
    ),
    # chapter 08: DiLoCo's sync
    "the pseudo-gradient's sign flipped": Plant(
        8,
        ((rewrite, P(assigns="moved"), "g.detach() - p.detach()", "p.detach() - g.detach()"),),
        ranks=2,
    ),
    # a new user's own mistake: the sum of the ranks' pseudo-gradients taken as their mean
    "the pseudo-gradients summed, never divided by the ranks": Plant(
        8,
        (
            (
                rewrite,
                P(assigns="sent", uses="world_size"),
                "pseudo_grad / world_size",
                "pseudo_grad",
            ),
        ),
        ranks=2,
    ),
    "the outer step on the local copy": Plant(
        8,
        (
            (
                rewrite,
                P(assigns="outer_optimizer"),
                "global_model.parameters()",
                "raw_model.parameters()",
            ),
        ),
        ranks=2,
    ),
    "the copies not reset after the outer step": Plant(
        8, ((replace, P(call="copy_"), "pass"),), ranks=2
    ),
    # the sum of the copies' parameters, divided by world_size, made the global parameters
    "the parameters averaged, not the pseudo-gradients": Plant(
        8,
        (
            (rewrite, P(assigns="moved"), "g.detach() - p.detach()", "p.detach()"),
            (replace, P(assigns="grad"), "g.data.copy_(chunk.view_as(g))"),
            (replace, P(call="step", uses="outer_optimizer"), ""),
        ),
        ranks=2,
    ),
    "the sync on some ranks only": Plant(
        8, ((wrap, P(call="all_reduce", arg="sent"), "if is_rank0:"),), ranks=2
    ),
}

# mistakes the catalogue does not know: no entry fits, and what the checker says of them is the
# description of what the facts show (mistakes.describe)
UNKNOWN = {
    # batch_loader reads the sampler's order when it is built: the loader of epoch e is built with
    # the order of epoch e - 1
    "set_epoch after the loader is built": Plant(
        4, ((move, P(call="set_epoch"), P(assigns="batches")),), ranks=2
    ),
    # DDP sends the gradients as float16 (half the bytes) and averages them so
    "gradients sent in float16": Plant(
        4,
        (
            (
                insert,
                P(assigns="model", call="DDP"),
                "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
                "model.register_comm_hook(None, default_hooks.fp16_compress_hook)",
                True,
            ),
        ),
        ranks=2,
    ),
}
