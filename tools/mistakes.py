"""The classic mistakes of data-parallel training, each with its signature in the numbers.

tools/check.py compares a learner's run with chapter 01's and gathers the facts below (Facts); the
first entry of MISTAKES whose signature fits the facts is the diagnosis. No entry fits: the checker
says so ("no known signature") rather than guess.

To add a mistake: plant it in a copy of a chapter script, run `python tools/check.py COPY --facts`,
read the facts, and write the entry: what the learner did, the signature as a small test of the
facts, the right line and how to find the learner's, and the plant (the statements you changed).
Put specific signatures before general ones: the first that fits wins. tests/test_check.py plants
every entry in a copy of its chapter's script and expects the entry's name back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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


@dataclass
class Mistake:
    name: str
    did: str  # what the learner did, and why the numbers show it
    signature: Callable[[Facts], bool]  # does this mistake explain the facts?
    # the chapter whose train.py shows the right line, and where the mistake is planted
    chapter: int
    line: str  # the right line, as that chapter has it
    look_for: tuple[str, ...]  # text that finds the learner's version of that line
    near: str  # text of a neighbouring line: where the line belongs when the learner has none
    # the mistake planted in a copy of the chapter's train.py (tests/test_check.py): statements of
    # the script, each replaced by new lines ("": removed)
    plant: tuple[tuple[str, str], ...]
    # the ranks the planted copy is checked with: 2 where the signature needs them
    plant_ranks: int = 1


def near(value: float | None, target: float, rel: float = 1e-6) -> bool:
    return value is not None and abs(value - target) <= rel * abs(target)


MISTAKES = [
    Mistake(
        name="gradients never averaged",
        did="each rank steps with its own gradient (no DDP wrapper, or no_sync() on every micro-step), "
        "so the ranks' copies drift apart from the first step",
        signature=lambda f: f.world_size > 1 and f.ranks_drift_from is not None,
        chapter=4,
        line="sync = model.no_sync() if micro_step < args.grad_accum - 1 else contextlib.nullcontext()",
        look_for=("no_sync", "DDP(", "DistributedDataParallel("),
        near="for micro_step in range(args.grad_accum)",
        plant=(
            (
                "sync = model.no_sync() if micro_step < args.grad_accum - 1 else contextlib.nullcontext()",
                "sync = model.no_sync()",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="a global batch that forgets world_size or grad_accum",
        did="global_batch leaves out a factor, so the epoch is longer than chapter 01's: the ranks read "
        "past the end of chapter 01's epoch (or run out of windows there)",
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
        name="loss not divided by K",
        did="each micro-batch's loss is not divided by --grad-accum: the summed gradient is K times too "
        "large from step 1 (AdamW hides most of it; clipping and the logged loss do not)",
        signature=lambda f: (
            f.grad_accum > 1
            and f.first_data_diff is None
            and (near(f.loss_ratio_at_1, f.grad_accum) or near(f.grad_ratio_at_1, f.grad_accum))
        ),
        chapter=2,
        line="micro_loss = micro_loss / args.grad_accum",
        look_for=("/ args.grad_accum", "* args.grad_accum).backward"),
        near="_, micro_loss = model(",
        plant=(("micro_loss = micro_loss / args.grad_accum", ""),),
    ),
    Mistake(
        name="zero_grad inside the micro-loop",
        did="the gradients are zeroed on every micro-step, so only the last micro-batch's gradient "
        "reaches the optimizer: step 1's loss is right, its gradient is not",
        signature=lambda f: f.grad_accum > 1 and f.zero_grads_per_step > 1,
        chapter=2,
        line="optimizer.zero_grad(set_to_none=True)  # once per step, after the optimizer step",
        look_for=("zero_grad(",),
        near="scaler.update()",
        plant=(
            ("x, y = next(batches)", "optimizer.zero_grad(set_to_none=True)\nx, y = next(batches)"),
        ),
    ),
    Mistake(
        name="samplers seeded per rank",
        did="each rank's sampler draws its own permutation (a seed that depends on the rank), so the "
        "ranks' shares are not one permutation cut in world_size pieces: other windows from step 1",
        signature=lambda f: (
            f.world_size > 1
            and f.first_data_diff == 1
            and (f.rank0_reads_its_share or f.ranks_overlap)
        ),
        chapter=4,
        line="sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, "
        "seed=args.seed, drop_last=True)",
        look_for=("DistributedSampler(", "seed="),
        near="sampler",
        plant=(
            (
                "sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, "
                "seed=args.seed, drop_last=True)",
                "sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, "
                "seed=args.seed + rank, drop_last=True)",
            ),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="a forgotten set_epoch",
        did="the sampler is not told the epoch, so every epoch repeats epoch 0's order: the same run "
        "for one epoch, then different",
        signature=lambda f: (
            f.first_loss_diff == f.steps_per_epoch + 1
            and f.first_data_diff == f.steps_per_epoch + 1
            and f.repeats_first_epoch
        ),
        chapter=4,
        line="sampler.set_epoch(epoch)  # at the start of every epoch",
        look_for=("set_epoch(", "manual_seed(args.seed + epoch)"),
        near="epoch, step_in_epoch = divmod(",
        plant=(("sampler.set_epoch(epoch)", "pass"),),
    ),
    Mistake(
        name="ranks' logged loss not averaged",
        did="rank 0 logs the loss of its own share of the batch, not the mean over all ranks: the "
        "training is right (chapter 01's parameters, the same on every rank), the logged number is not",
        signature=lambda f: (
            f.world_size > 1
            and f.first_loss_diff is not None
            and f.first_data_diff is None
            and f.params_equal
            and f.ranks_drift_from is None
        ),
        chapter=4,
        line="dist.all_reduce(loss, op=dist.ReduceOp.SUM), then loss_value = loss.item() / world_size",
        look_for=("all_reduce(loss", "loss_value = "),
        near="if iter_num % args.log_interval == 0",
        plant=(
            ("dist.all_reduce(loss, op=dist.ReduceOp.SUM)", ""),
            ("loss_value = loss.item() / world_size", "loss_value = loss.item()"),
        ),
        plant_ranks=2,
    ),
    Mistake(
        name="resume skipping steps instead of micro-batches",
        did="a resumed run skips step_in_epoch batches of the loader, but every step read "
        "grad_accum micro-batches: after the resume it reads windows it already trained on",
        signature=lambda f: (
            f.grad_accum > 1
            and f.first_loss_diff is None
            and f.params_equal
            and f.resume_at is not None
            and f.resume_diff == f.resume_at + 1
        ),
        chapter=2,
        line="skip = step_in_epoch * args.grad_accum",
        look_for=("skip = ",),
        near="epoch, step_in_epoch = divmod(",
        plant=(("skip = step_in_epoch * args.grad_accum", "skip = step_in_epoch"),),
    ),
]


def diagnose(facts: Facts) -> Mistake | None:
    """The first catalogue entry whose signature fits, or None."""
    return next((m for m in MISTAKES if m.signature(facts)), None)


def where_to_look(mistake: Mistake, source: str, script: str) -> str:
    """The line of the learner's script to look at, and what chapter's script has there."""
    lines = source.splitlines()
    code = [
        (n, line.strip()) for n, line in enumerate(lines, 1) if not line.lstrip().startswith("#")
    ]
    right = f"chapter {mistake.chapter:02d} has `{mistake.line}`"
    for text in mistake.look_for:
        for number, line in code:
            if text in line:
                return f"look at line {number} of {script}: `{line}`; {right}"
    for number, line in code:
        if mistake.near in line:
            return f"your script has no such line; {right}, near line {number}: `{line}`"
    return f"your script has no such line; {right}"
