"""The classic mistakes of data-parallel training, each with its signature in the numbers.

tools/check.py compares a learner's run with chapter 01's and gathers the facts below (Facts). An
entry of MISTAKES is the diagnosis when its signature fits the facts, the facts do not rule it out
(ruled_out: parameters equal to chapter 01's rule out every training mistake, a gradient equal to
chapter 01's rules out "never averaged", ...) and the learner's script does not already have the
chapter's line there (where_to_look). The first such entry wins. None fits: the checker describes
what the facts show (describe) rather than guess.

To add a mistake: plant it in a copy of a chapter script, run `python tools/check.py COPY --facts`,
read the facts, and write the entry: what the learner did, the signature as a small test of the
facts, the right line and how to find the learner's, and the plant (the statements you changed).
Put specific signatures before general ones: the first that fits wins. tests/test_check.py checks
that every entry's lines and plant still match the chapter scripts, and that each signature fits
the facts its plant leaves.
"""

from __future__ import annotations

import ast
import copy
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Facts:
    """What the comparison of a run with chapter 01's found. Steps count from 1."""

    chapter: int
    world_size: int
    grad_accum: int  # K: micro-batches per optimizer step on each rank
    steps_per_epoch: int  # chapter 01's
    # what the script printed ("N steps per epoch"), None if not found
    script_steps_per_epoch: int | None
    first_loss_diff: int | None  # the first step whose logged loss differs from chapter 01's
    loss_ratio_at_1: float  # the script's logged loss at step 1 / chapter 01's
    # rank 0's gradient norm (before clipping) at step 1 / chapter 01's
    grad_ratio_at_1: float | None
    # the first step whose windows (all ranks together) are not chapter 01's
    first_data_diff: int | None
    # rank 0 read only windows of chapter 01's batch at every step of epoch 0
    rank0_reads_its_share: bool
    # two ranks read the same window in epoch 0 (one permutation cut in pieces cannot)
    ranks_overlap: bool
    repeats_first_epoch: bool  # the second epoch's first step read the windows of the first epoch's
    zero_grads_per_step: int  # the most zero_grad calls between two optimizer steps on rank 0
    # the first step after which some rank's parameters differ from rank 0's
    ranks_drift_from: int | None
    params_equal: bool  # the final parameters equal chapter 01's
    stopped_after: int | None  # the script failed after logging this many steps; None: it finished
    resume_at: int | None  # where the resume check stopped and resumed; None: not run
    resume_diff: int | None  # the first step after resuming that differs (loss or parameters)
    # ---- everything else the run wrote, step by step (rank 0 unless said)
    first_grad_diff: int | None = None  # the first step whose gradient norm differs
    first_param_diff: int | None = None  # the first step after which the parameters differ
    first_lr_diff: int | None = None  # the first logged step whose learning rate differs
    # the logged lr of step s is chapter 01's of step (s - 1) * lr_speed + 1: the schedule runs
    # lr_speed times too fast (None: no such whole number)
    lr_speed: int | None = None
    first_val_diff: int | None = None  # the first step whose validation loss differs
    val_ratio: float | None = None  # the validation loss there / chapter 01's
    logged_steps: int = 0  # training-loss rows in metrics.jsonl
    optimizer_steps: int = 0  # optimizer.step() calls on rank 0
    ranks_same_windows: bool = False  # every rank read the same windows at step 1
    ranks_clip_differ: bool = False  # some ranks clipped the gradient and others did not
    ranks_steps_differ: bool = False  # the ranks took different numbers of optimizer steps
    # under DDP, a step whose last micro-step did not average the gradients while another did
    last_micro_step_unsynced: bool = False
    replicas: int | None = None  # chapter 03: DataParallel's stand-in replicas; 0: never used
    hung: bool = False  # the ranks waited in collectives that do not match
    failure: str | None = None  # the line that says why the run failed
    # the resumed run: its first step read these steps' windows (chapter 01's numbering)
    resume_reads_steps: list[int] = field(default_factory=list)
    resume_first_data_diff: int | None = None
    resume_first_grad_diff: int | None = None
    resume_first_param_diff: int | None = None
    restart: str | None = None  # chapter 05: what the killed-and-restarted run did wrong
    # the ranks' parameters are shards (FSDP's DTensors), compared whole (gathered from every rank)
    sharded: bool = False
    # the resumed run's first step starts from other parameters than the stopped run ended with
    resume_start_differs: bool = False


@dataclass
class Mistake:
    name: str
    did: str  # what the learner did, and why the numbers show it
    signature: Callable[[Facts], bool]  # does this mistake explain the facts?
    # the chapter whose train.py shows the right line, and where the mistake is planted
    chapter: int
    # the right statement(s), as that chapter has them (code, one statement a line; a compound
    # statement by its header, ending in ":")
    line: str
    look_for: tuple[str, ...]  # text that finds the learner's version of that line
    near: str  # text of a neighbouring line: where the line belongs when the learner has none
    # the mistake planted in a copy of the chapter's train.py (tests/test_check.py): statements of
    # the script, each replaced by new lines ("": removed)
    plant: tuple[tuple[str, str], ...]
    # the ranks the planted copy is checked with: 2 where the signature needs them
    plant_ranks: int = 1
    # what the mistake changes: "training" (the parameters), "logging", "evaluation", "resume",
    # "hang", "idea" (the chapter's new part is missing)
    kind: str = "training"
    fails_with: str | None = None  # a failure (regex) the mistake causes, where it stops the run


def near(value: float | None, target: float, rel: float = 1e-6) -> bool:
    return value is not None and not math.isnan(value) and abs(value - target) <= rel * abs(target)


def training_right(f: Facts) -> bool:
    """Chapter 01's parameters after every step, on every rank: the training is right."""
    return (
        f.params_equal
        and f.first_param_diff is None
        and f.ranks_drift_from is None
        and f.stopped_after is None
    )


MISTAKES = [
    Mistake(
        name="a collective called by only some ranks",
        did="a collective (all_reduce, barrier, ...) that every rank must call is called by some "
        "only, or by each at a different place: the ranks wait for each other forever",
        signature=lambda f: f.hung,
        chapter=4,
        line="dist.all_reduce(val_stats, op=dist.ReduceOp.SUM)",
        look_for=("all_reduce(", "barrier(", "broadcast(", "all_gather"),
        near="val_stats = ",
        plant=(
            (
                "dist.all_reduce(val_stats, op=dist.ReduceOp.SUM)",
                "if is_rank0:\n    dist.all_reduce(val_stats, op=dist.ReduceOp.SUM)",
            ),
        ),
        plant_ranks=2,
        kind="hang",
    ),
    Mistake(
        name="the replicas' losses not reduced",
        did="DataParallel returns one loss per replica (a vector); without .mean() backward() "
        "refuses it: on GPUs as here, where the check splits each batch over 2 stand-in replicas",
        signature=lambda f: False,
        chapter=3,
        line="micro_loss = micro_loss.mean()",
        look_for=("micro_loss = micro_loss.", "micro_loss.sum()"),
        near="_, micro_loss = model(",
        plant=(("micro_loss = micro_loss.mean()", ""),),
        fails_with=r"only for scalar outputs|doesn't match the broadcast shape",
    ),
    Mistake(
        name="the replicas' losses summed, not averaged",
        did="each replica returns the mean loss of its share: their sum is R times the batch's "
        "mean loss (R replicas), and so is the gradient from step 1",
        signature=lambda f: (
            f.chapter == 3
            and bool(f.replicas)
            and near(f.loss_ratio_at_1, 2)
            and near(f.grad_ratio_at_1, 2)
        ),
        chapter=3,
        line="micro_loss = micro_loss.mean()",
        look_for=("micro_loss = micro_loss.", "micro_loss.sum()"),
        near="_, micro_loss = model(",
        plant=(("micro_loss = micro_loss.mean()", "micro_loss = micro_loss.sum()"),),
    ),
    Mistake(
        name="no DataParallel",
        did="the model is never called through nn.DataParallel: the script is still chapter 02's "
        "(the check splits every DataParallel batch over 2 stand-in replicas, and saw none)",
        signature=lambda f: f.chapter == 3 and f.replicas == 0,
        chapter=3,
        line="model = AutocastDataParallel(model, device, dtype, device_ids=gpu_ids)",
        look_for=("DataParallel(",),
        near="raw_model = ",
        plant=(),
        kind="idea",
    ),
    Mistake(
        name="no FSDP",
        did="the model is never sharded with fully_shard: every rank still holds the whole model "
        "(the script is still chapter 05's); under FSDP each rank's parameters are shards "
        "(DTensors), and the check found none",
        signature=lambda f: f.chapter == 6 and not f.sharded and f.optimizer_steps > 0,
        chapter=6,
        line="fully_shard(model, mp_policy=precision)",
        look_for=("fully_shard(",),
        near="raw_model = ",
        plant=(),
        kind="idea",
    ),
    Mistake(
        name="optimizer.step() inside the micro-loop",
        did="the optimizer steps after every micro-batch instead of once per global batch: more "
        "optimizer steps than logged steps, each on a part of the batch",
        signature=lambda f: f.logged_steps > 0 and f.optimizer_steps > f.logged_steps,
        chapter=2,
        line="scaler.step(optimizer)",
        look_for=("scaler.step(", "optimizer.step("),
        near="scaler.update()",
        plant=(
            (
                "scaler.scale(micro_loss).backward()",
                "scaler.scale(micro_loss).backward()\nscaler.step(optimizer)\nscaler.update()",
            ),
        ),
    ),
    Mistake(
        name="zero_grad inside the micro-loop",
        did="the gradients are zeroed on every micro-step, so only the last micro-batch's gradient "
        "reaches the optimizer: step 1's loss is right, its gradient is not",
        signature=lambda f: f.grad_accum > 1 and f.zero_grads_per_step > 1,
        chapter=2,
        line="optimizer.zero_grad(set_to_none=True)",
        look_for=("zero_grad(",),
        near="scaler.update()",
        plant=(
            ("x, y = next(batches)", "optimizer.zero_grad(set_to_none=True)\nx, y = next(batches)"),
        ),
    ),
    Mistake(
        name="the learning rate advanced per micro-step",
        did="the schedule counts micro-steps, not optimizer steps: the logged lr of step s is "
        "chapter 01's of a later step, and warmup and decay end K times too early",
        signature=lambda f: f.lr_speed is not None and f.lr_speed > 1,
        chapter=2,
        line="lr = lr_at(iter_num, args)",
        look_for=("lr_at(", "scheduler.step("),
        near="for group in optimizer.param_groups",
        plant=(("lr = lr_at(iter_num, args)", "lr = lr_at(iter_num * args.grad_accum, args)"),),
    ),
    Mistake(
        name="the gradient-sync switch off on the last micro-step",
        did="FSDP reduce-scatters the gradients in the backward of a micro-step whose gradient "
        "sync is on; here the last micro-step's is off, so what it adds stays in this rank's "
        "unsharded gradient and never reaches the shards the optimizer steps on: the gradient "
        "is not the batch's from step 1",
        signature=lambda f: f.chapter == 6 and f.last_micro_step_unsynced,
        chapter=6,
        line="model.set_requires_gradient_sync(micro_step == args.grad_accum - 1)",
        look_for=("set_requires_gradient_sync(",),
        near="for micro_step in range(args.grad_accum)",
        plant=(
            (
                "model.set_requires_gradient_sync(micro_step == args.grad_accum - 1)",
                "model.set_requires_gradient_sync(micro_step == 0)",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="no_sync on the wrong micro-step",
        did="DDP averages the gradients in the backward of a micro-step outside no_sync(); here "
        "the last micro-step is inside it, so what it adds stays this rank's own and the copies "
        "drift",
        signature=lambda f: f.last_micro_step_unsynced and not f.sharded,
        chapter=4,
        line="sync = (model.no_sync() if micro_step < args.grad_accum - 1 "
        "else contextlib.nullcontext())",
        look_for=("no_sync",),
        near="for micro_step in range(args.grad_accum)",
        plant=(
            (
                "sync = (model.no_sync() if micro_step < args.grad_accum - 1 "
                "else contextlib.nullcontext())",
                "sync = (model.no_sync() if micro_step > 0 else contextlib.nullcontext())",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="gradients never averaged",
        did="each rank steps with its own gradient (no DDP wrapper, or no_sync() on every "
        "micro-step), so the ranks' copies drift apart from the first step",
        signature=lambda f: (
            f.world_size > 1
            and f.ranks_drift_from is not None
            and not f.ranks_clip_differ
            and not f.ranks_steps_differ
        ),
        chapter=4,
        line="sync = (model.no_sync() if micro_step < args.grad_accum - 1 "
        "else contextlib.nullcontext())",
        look_for=("no_sync", "DDP(", "DistributedDataParallel("),
        near="for micro_step in range(args.grad_accum)",
        plant=(
            (
                "sync = (model.no_sync() if micro_step < args.grad_accum - 1 "
                "else contextlib.nullcontext())",
                "sync = model.no_sync()",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="clipping or stepping on some ranks only",
        did="the gradient is clipped (or the optimizer steps) on some ranks only: the averaged "
        "gradient is right on every rank, what each rank does with it is not, and the copies drift",
        signature=lambda f: (
            f.world_size > 1
            and (
                f.ranks_clip_differ
                or f.ranks_steps_differ
                or (f.ranks_drift_from is not None and near(f.grad_ratio_at_1, 1, 1e-9))
            )
        ),
        chapter=4,
        line="if args.grad_clip > 0:\nscaler.step(optimizer)",
        look_for=("if args.grad_clip", "clip_grad_norm_(", "scaler.step(", "optimizer.step("),
        near="scaler.update()",
        plant=(
            (
                "if args.grad_clip > 0:\n"
                "    scaler.unscale_(optimizer)\n"
                "    grad_norm = torch.nn.utils.clip_grad_norm_(\n"
                "        model.parameters(), args.grad_clip)",
                "if args.grad_clip > 0 and is_rank0:\n"
                "    scaler.unscale_(optimizer)\n"
                "    grad_norm = torch.nn.utils.clip_grad_norm_(\n"
                "        model.parameters(), args.grad_clip)",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="a global batch that forgets world_size or grad_accum",
        did="global_batch leaves out a factor, so the epoch is longer than chapter 01's: the ranks "
        "read past the end of chapter 01's epoch (or run out of windows there)",
        signature=lambda f: (f.script_steps_per_epoch or 0) > f.steps_per_epoch,
        chapter=4,
        line="global_batch = args.batch_size * args.grad_accum * world_size",
        look_for=("global_batch = ",),
        near="tokens_per_step = ",
        plant=(
            (
                "global_batch = args.batch_size * args.grad_accum * world_size",
                "global_batch = args.batch_size * args.grad_accum",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="all ranks reading the same windows",
        did="every rank reads the same share of the batch (a sampler without this rank's place: "
        "rank=0, a local rank, or one replica), so a step sees fewer distinct windows than "
        "chapter 01's",
        signature=lambda f: f.world_size > 1 and f.ranks_same_windows,
        chapter=4,
        line="sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, "
        "shuffle=True, seed=args.seed, drop_last=True)",
        look_for=("DistributedSampler(",),
        near="sampler",
        plant=(
            (
                "sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, "
                "shuffle=True, seed=args.seed, drop_last=True)",
                "sampler = DistributedSampler(train_set, num_replicas=world_size, rank=0, "
                "shuffle=True, seed=args.seed, drop_last=True)",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="loss divided by world_size by hand",
        did="the loss is divided by world_size, but DDP already averages the gradients over the "
        "ranks: the loss and the gradient are 1/world_size of chapter 01's from step 1",
        signature=lambda f: (
            f.world_size > 1
            and near(f.loss_ratio_at_1, 1 / f.world_size)
            and near(f.grad_ratio_at_1, 1 / f.world_size)
        ),
        chapter=4,
        line="micro_loss = micro_loss / args.grad_accum",
        look_for=("micro_loss = micro_loss /", "/ world_size"),
        near="_, micro_loss = model(",
        plant=(
            (
                "micro_loss = micro_loss / args.grad_accum",
                "micro_loss = micro_loss / args.grad_accum / world_size",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="loss not divided by K",
        did="each micro-batch's loss is not divided by --grad-accum: the summed gradient is K "
        "times too large from step 1 (AdamW hides most of it; clipping and the logged loss do not)",
        signature=lambda f: (
            f.grad_accum > 1
            and f.first_data_diff is None
            and (near(f.loss_ratio_at_1, f.grad_accum) or near(f.grad_ratio_at_1, f.grad_accum))
        ),
        chapter=2,
        line="micro_loss = micro_loss / args.grad_accum",
        look_for=("micro_loss = micro_loss /", "* args.grad_accum).backward"),
        near="_, micro_loss = model(",
        plant=(("micro_loss = micro_loss / args.grad_accum", ""),),
    ),
    Mistake(
        name="samplers seeded per rank",
        did="each rank's sampler draws its own permutation (a seed that depends on the rank), so "
        "the ranks' shares are not one permutation cut in world_size pieces: other windows from "
        "step 1",
        signature=lambda f: (
            f.world_size > 1
            and f.first_data_diff == 1
            and (f.rank0_reads_its_share or f.ranks_overlap)
        ),
        chapter=4,
        line="sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, "
        "shuffle=True, seed=args.seed, drop_last=True)",
        look_for=("DistributedSampler(", "seed="),
        near="sampler",
        plant=(
            (
                "sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, "
                "shuffle=True, seed=args.seed, drop_last=True)",
                "sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, "
                "shuffle=True, seed=args.seed + rank, drop_last=True)",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="a forgotten set_epoch",
        did="the sampler is not told the epoch, so every epoch repeats epoch 0's order: the same "
        "run for one epoch, then different",
        signature=lambda f: (
            f.first_loss_diff == f.steps_per_epoch + 1
            and f.first_data_diff == f.steps_per_epoch + 1
            and f.repeats_first_epoch
        ),
        chapter=4,
        line="sampler.set_epoch(epoch)",
        look_for=("set_epoch(", "manual_seed(args.seed + epoch)"),
        near="epoch, step_in_epoch = divmod(",
        plant=(("sampler.set_epoch(epoch)", "pass"),),
    ),
    Mistake(
        name="ranks' logged loss not averaged",
        did="the logged loss is not the mean over the ranks (rank 0's share alone, or the sum): "
        "the training is right (chapter 01's parameters, the same on every rank), the logged "
        "number is not",
        signature=lambda f: (
            f.world_size > 1 and f.first_loss_diff is not None and f.first_data_diff is None
        ),
        chapter=4,
        line="dist.all_reduce(loss, op=dist.ReduceOp.SUM)\nloss_value = loss.item() / world_size",
        look_for=("all_reduce(loss", "loss_value = "),
        near="stop_if_diverged(iter_num, loss_value",
        plant=(
            ("dist.all_reduce(loss, op=dist.ReduceOp.SUM)", ""),
            ("loss_value = loss.item() / world_size", "loss_value = loss.item()"),
        ),
        plant_ranks=2,
        kind="logging",
    ),
    Mistake(
        name="your evaluation differs; training is the same",
        did="every training loss and the parameters are chapter 01's, the validation loss is not: "
        "with several ranks, each evaluates its part of the windows, and the parts must be added "
        "up over the ranks (the loss sums and the counts) before dividing",
        signature=lambda f: f.first_val_diff is not None and f.first_loss_diff is None,
        chapter=4,
        line="dist.all_reduce(val_stats, op=dist.ReduceOp.SUM)",
        look_for=("all_reduce(val", "val_loss = "),
        near="val_stats = ",
        plant=(("dist.all_reduce(val_stats, op=dist.ReduceOp.SUM)", ""),),
        plant_ranks=2,
        kind="evaluation",
    ),
    Mistake(
        name="a checkpoint of rank 0's shards only",
        did="under FSDP each rank holds a shard of every tensor: model.state_dict() on rank 0 is "
        "rank 0's shards, not the model. Saved as ckpt.pt, the resumed run starts from other "
        "parameters than the stopped run ended with; the whole tensors must be gathered from "
        "every rank first (get_model_state_dict with full_state_dict=True, on every rank)",
        signature=lambda f: f.chapter == 6 and f.resume_start_differs,
        chapter=6,
        line="model_state = get_model_state_dict(model, options=full)",
        look_for=("model_state = ", "state_dict()"),
        near="full = StateDictOptions(",
        plant=(
            (
                "model_state = get_model_state_dict(model, options=full)",
                "model_state = model.state_dict()",
            ),
        ),
        plant_ranks=2,
        kind="resume",
    ),
    Mistake(
        name="resume skipping steps instead of micro-batches",
        did="a resumed run skips step_in_epoch batches of the loader, but every step read "
        "grad_accum micro-batches: after the resume it reads windows it already trained on",
        signature=lambda f: (
            f.grad_accum > 1
            and f.resume_at is not None
            and f.resume_diff == f.resume_at + 1
            and len(f.resume_reads_steps) > 1
            and max(f.resume_reads_steps) <= f.resume_at
        ),
        chapter=2,
        line="skip = step_in_epoch * args.grad_accum",
        look_for=("skip = ",),
        near="epoch, step_in_epoch = divmod(",
        plant=(("skip = step_in_epoch * args.grad_accum", "skip = step_in_epoch"),),
        kind="resume",
    ),
    Mistake(
        name="a resume that re-reads an earlier step's windows",
        did="the resumed run does not skip what this epoch already trained on: its first step "
        "reads the windows of an earlier step again",
        signature=lambda f: (
            f.resume_at is not None
            and f.resume_diff == f.resume_at + 1
            and bool(f.resume_reads_steps)
            and max(f.resume_reads_steps) <= f.resume_at
        ),
        chapter=2,
        line="skip = step_in_epoch * args.grad_accum",
        look_for=("skip = ",),
        near="epoch, step_in_epoch = divmod(",
        plant=(("skip = step_in_epoch * args.grad_accum", "skip = 0"),),
        kind="resume",
    ),
    Mistake(
        name="a resume that does not restore the optimizer state",
        did="the resumed run starts AdamW afresh (its running averages lost): the first step after "
        "the resume reads the right windows and has the right gradient, yet moves the parameters "
        "differently",
        signature=lambda f: (
            f.resume_at is not None
            and f.resume_first_data_diff is None
            and f.resume_first_param_diff == f.resume_at + 1
            and f.resume_first_grad_diff in (None, f.resume_at + 2)
        ),
        chapter=2,
        line="iter_num = restore_training_state(checkpoint, optimizer, scaler)",
        look_for=("restore_training_state(", "iter_num = "),
        near="checkpoint = load_checkpoint(",
        plant=(
            (
                "iter_num = restore_training_state(checkpoint, optimizer, scaler)",
                'iter_num = checkpoint["iter_num"]',
            ),
        ),
        kind="resume",
    ),
    Mistake(
        name="a restart that does not continue the run",
        did="torchrun restarted the group after a rank was killed, and the run did not continue "
        "from its checkpoint to chapter 01's end: a restarted process must find the checkpoint "
        "and resume as --resume would (chapter 05)",
        signature=lambda f: f.restart is not None,
        chapter=5,
        line="checkpoint = load_checkpoint(out_dir)",
        look_for=("checkpoint = load_checkpoint(", "TORCHELASTIC_RESTART_COUNT"),
        near="claim_out_dir(",
        plant=(
            (
                "checkpoint = load_checkpoint(out_dir)",
                "checkpoint = load_checkpoint(out_dir) if args.resume else None",
            ),
        ),
        plant_ranks=2,
        kind="resume",
    ),
]


def ruled_out(mistake: Mistake, f: Facts) -> str | None:
    """Why the facts rule the entry out although its signature fits, or None."""
    if mistake.kind == "training" and training_right(f):
        return "the parameters equal chapter 01's after every step: the training is right"
    if mistake.kind in ("logging", "evaluation") and not training_right(f):
        return "the parameters differ from chapter 01's: more than the logging differs"
    if mistake.name == "gradients never averaged" and near(f.grad_ratio_at_1, 1, 1e-9):
        return "rank 0's gradient at step 1 equals chapter 01's: the gradients were averaged"
    return None


# ---- the learner's statements, compared with the chapter's -----------------------------------


def _header(node: ast.stmt) -> str:
    """A statement as normalized code; a compound statement by its header alone."""
    if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.AsyncFor, ast.AsyncWith)):
        bare = copy.copy(node)
        bare.body = [ast.Pass()]
        if hasattr(bare, "orelse"):
            bare.orelse = []
        return ast.unparse(bare).split("\n")[0]
    if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Try)):
        return type(node).__name__
    return ast.unparse(node)


def normalized(code: str) -> list[str]:
    """The statements of `code` (one or more; a header ending in ":" stands for its statement)."""
    out = []
    for line in code.split("\n"):
        text = line.strip()
        if text.endswith(":"):
            text += " pass"
        out.extend(_header(node) for node in ast.parse(text).body)
    return out


@functools.lru_cache(maxsize=16)
def statements(source: str) -> dict[int, tuple[ast.stmt, tuple[str, ...]]]:
    """Every line of the source -> the innermost statement on it and its key: the headers of the
    statements it sits in, then its own."""
    found: dict[int, tuple[ast.stmt, tuple[str, ...]]] = {}

    def visit(nodes, outer: tuple[str, ...]):
        for node in nodes:
            key = (*outer, _header(node))
            last = node.end_lineno
            if hasattr(node, "body") and isinstance(node.body, list) and node.body:
                last = node.body[0].lineno - 1
            for n in range(node.lineno, last + 1):
                found[n] = (node, key)
            for name in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, name, None)
                if isinstance(inner, list):
                    visit([i for i in inner if isinstance(i, ast.stmt)], key)
                    for handler in inner:
                        if isinstance(handler, ast.ExceptHandler):
                            visit(handler.body, key)

    visit(ast.parse(source).body, ())
    return found


@functools.lru_cache(maxsize=16)
def keys(source: str) -> set[tuple[str, ...]]:
    return {key for _, key in statements(source).values()}


def quoted(node: ast.stmt, lines: list[str]) -> str:
    """The statement as the learner wrote it, on one line (a compound one by its header)."""
    last = node.end_lineno
    if hasattr(node, "body") and isinstance(node.body, list) and node.body:
        last = node.body[0].lineno - 1
    text = " ".join(line.split("#")[0].strip() for line in lines[node.lineno - 1 : last])
    return re.sub(r"([(\[{]) | ([)\]}])|,([)\]}])", r"\1\2\3", text).strip()


@dataclass
class Look:
    fits: bool  # False: the learner's lines are the chapter's, the entry does not fit
    text: str  # where to look, for the learner


def header_end(node: ast.stmt) -> int:
    """The last line of a statement; of a compound statement, the last line of its header."""
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        return body[0].lineno - 1
    return node.end_lineno or node.lineno


def where_to_look(
    mistake: Mistake, source: str, script: str, chapter_source: str | None = None
) -> Look:
    """The line of the learner's script to look at (the first found by look_for that is not the
    chapter's own statement in the chapter's place), and what the chapter has there."""
    lines = source.splitlines()
    right_code = "`; `".join(mistake.line.split("\n"))
    right = f"chapter {mistake.chapter:02d} has `{right_code}`"
    mine = statements(source)
    theirs = keys(chapter_source) if chapter_source is not None else set()
    nodes = {id(node): node for node, _ in mine.values()}
    for text in mistake.look_for:
        for node in sorted(nodes.values(), key=lambda n: n.lineno):
            _, key = mine[node.lineno]
            said = quoted(node, lines)
            if text not in " ".join(lines[node.lineno - 1 : header_end(node)]):
                continue
            # the first statement, from the outside in, that the chapter does not have there
            for depth in range(1, len(key) + 1):
                if key[:depth] not in theirs:
                    outer = outer_node(mine, key[:depth], node)
                    said = quoted(outer, lines)
                    at = f"look at line {outer.lineno} of {script}: `{said}`"
                    if key[-1] in normalized(mistake.line) and depth == len(key):
                        # the chapter's statement, in another place: say where each has it
                        at += f" inside `{key[-2]}`" if len(key) > 1 else ""
                        places = [k[-2] for k in theirs if k[-1] == key[-1] and len(k) > 1]
                        inside = f" inside `{places[0]}`" if places else ""
                        return Look(True, f"{at}; chapter {mistake.chapter:02d} has it{inside}")
                    return Look(True, f"{at}; {right}")
    have = {key[-1] for key in keys(source)}
    if all(statement in have for statement in normalized(mistake.line)):
        return Look(False, f"your script has chapter {mistake.chapter:02d}'s own `{right_code}`")
    for number, line in enumerate(lines, 1):
        if mistake.near in line and not line.lstrip().startswith("#"):
            return Look(True, f"your script has no such line; {right}, near line {number}")
    return Look(True, f"your script has no such line; {right}")


def outer_node(mine: dict, key: tuple[str, ...], node: ast.stmt) -> ast.stmt:
    """The statement of `mine` whose key is `key` and that holds `node`'s line."""
    best = node
    for candidate, k in mine.values():
        if k == key and candidate.lineno <= node.lineno <= (candidate.end_lineno or 0):
            best = candidate
    return best


def diagnose(
    facts: Facts, source: str = "", script: str = "", chapter_source: str | None = None
) -> tuple[Mistake | None, list[str], str]:
    """(the first entry that fits, notes on the entries the facts or the script ruled out, where
    to look)."""
    notes = []
    for mistake in MISTAKES:
        fails = bool(mistake.fails_with and facts.failure)
        fails = fails and re.search(mistake.fails_with, facts.failure) is not None
        if not fails and not mistake.signature(facts):
            continue
        why = ruled_out(mistake, facts)
        if why is not None:
            notes.append(f'not "{mistake.name}": {why}')
            continue
        if not source:
            return mistake, notes, ""
        look = where_to_look(mistake, source, script, chapter_source)
        if not look.fits:
            notes.append(f'not "{mistake.name}": {look.text}')
            continue
        return mistake, notes, look.text
    return None, notes, ""


def ratio_words(value: float | None, f: Facts) -> str:
    """A ratio to chapter 01's, with the whole-number reading that fits it exactly, if any."""
    if value is None or math.isnan(value):
        return "not measured"
    text = f"{value:.6g}"
    names = {"W": f.world_size, "K": f.grad_accum, "W*K": f.world_size * f.grad_accum}
    if f.replicas:
        names["R (replicas)"] = f.replicas
    if near(value, 1, 1e-9):
        return f"{text} (equal)"
    for name, n in names.items():
        if n > 1 and near(value, n):
            return f"{text} (= {name} = {n})"
        if n > 1 and near(value, 1 / n):
            return f"{text} (= 1/{name} = 1/{n})"
    return text


def describe(f: Facts) -> list[str]:
    """What the facts show, when no entry fits: ratios, first differences, the ranks' copies."""
    out = [
        f"at step 1: loss {ratio_words(f.loss_ratio_at_1, f)} x chapter 01's, "
        f"gradient norm {ratio_words(f.grad_ratio_at_1, f)} x"
    ]
    first = {
        "loss": f.first_loss_diff,
        "gradient": f.first_grad_diff,
        "parameters": f.first_param_diff,
        "windows": f.first_data_diff,
        "learning rate": f.first_lr_diff,
        "validation loss": f.first_val_diff,
    }
    differ = sorted((s, name) for name, s in first.items() if s is not None)
    same = [name for name, s in first.items() if s is None]
    if differ:
        parts = ", ".join(f"{name} from step {s}" for s, name in differ)
        out.append(f"first differences: {parts}; the same throughout: {', '.join(same)}")
    if f.optimizer_steps != f.logged_steps and f.logged_steps:
        out.append(f"{f.optimizer_steps} optimizer steps for {f.logged_steps} logged steps")
    if f.world_size > 1:
        if f.sharded:
            out.append("the ranks hold shards of the parameters (FSDP), compared whole")
        elif f.ranks_drift_from is None:
            out.append("the ranks' copies agree at every step")
        else:
            out.append(f"the ranks' copies differ from step {f.ranks_drift_from}")
    if training_right(f) and (f.first_loss_diff or f.first_lr_diff or f.first_val_diff):
        out.append("only the logging differs: the parameters equal chapter 01's after every step")
    if f.resume_diff is not None:
        out.append(f"after the resume at step {f.resume_at}: differs from step {f.resume_diff}")
    if f.resume_start_differs:
        out.append("the resumed run starts from other parameters than the stopped run ended with")
    return out
