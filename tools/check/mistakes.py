"""The classic mistakes of data-parallel training, each named by its mechanism in the numbers.

An entry is named when its signature, a small test of the facts (tools/check/facts.py), fits and
the facts do not rule it out; an entry drops the more general ones it names in `over`; one whose
mistake stops the run is named by its failure message (FailsWith). Where none fits, `describe` says
what the facts show. Either way `nearest_line` quotes the learner's line nearest the first
difference: code only, never a comment or a docstring.

To add a mistake: plant it in a copy of a chapter script, read `python -m tools.check COPY --facts`,
write the entry, and add the plant to tests/plants.py and its facts to tests/test_check.py.
"""

from __future__ import annotations

import ast
import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from tools.check.facts import ORDERS, Facts
from tools.check.reference import GLOBAL_BATCH


@dataclass(frozen=True)
class FailsWith:
    """An entry named by its failure: the run stops (regex of the failure line) before a fact can
    show the mistake."""

    message: str


@dataclass(frozen=True)
class Mistake:
    name: str
    did: str  # what the learner did, and why the numbers show it
    signature: Callable[[Facts], bool] | FailsWith  # does this mistake explain the facts?
    # what the mistake changes: "training" (the parameters), "logging", "evaluation", "resume",
    # "hang", "idea" (the chapter's new part is missing), "device" (what a CPU run cannot show)
    kind: str = "training"
    # facts that rule the entry out although its signature fits: why, or None
    unless: Callable[[Facts], str | None] | None = None
    over: tuple[str, ...] = ()  # the more general entries this one explains, where both fit


def near(value: float | None, target: float, rel: float = 1e-6) -> bool:
    return value is not None and not math.isnan(value) and abs(value - target) <= rel * abs(target)


# ---- what "the same run" is: the predicates the verdict and the catalogue share -----------------


def training_right(f: Facts) -> bool:
    """Chapter 01's parameters after every step, on every rank: the training is right."""
    return (
        f.grads.params_equal
        and f.grads.first_param_diff is None
        and f.ranks.ranks_drift_from is None
        and f.log.stopped_after is None
    )


def logging_right(f: Facts) -> bool:
    """Every logged row is chapter 01's: loss, learning rate, validation loss, one per step."""
    return (
        f.log.first_loss_diff is None
        and f.log.first_lr_diff is None
        and f.log.first_val_diff is None
        and f.grads.optimizer_steps == f.log.logged_steps
    )


def resume_right(f: Facts) -> bool:
    """Stopped and resumed (or killed and restarted), the run ends as chapter 01's."""
    return f.resume.resume_diff is None and f.resume.restart is None


def idea_present(f: Facts) -> bool:
    """The chapter's own idea is in the run: DataParallel's replicas, FSDP's shards, the GPU
    chosen by the local rank."""
    return (
        f.ranks.replicas != 0
        and (f.ranks.sharded or not f.plan.shards)
        and not f.ranks.gpu_by_global_rank
    )


def same_run(f: Facts) -> bool:
    return training_right(f) and logging_right(f) and resume_right(f) and idea_present(f)


def averaged(f: Facts) -> str | None:
    if near(f.grads.grad_ratio_at_1, 1, 1e-9):
        return f"rank 0's gradient at step 1 equals {f.plan.against}'s: the gradients were averaged"
    return None


# gloo's words when a rank's collective receives more than it holds: the collectives do not match
MISMATCH = re.compile(r"collective mismatch|doesn't match expected size")


def mismatched(f: Facts) -> bool:
    """The ranks called collectives that do not match: they hang (NCCL), or gloo saw it."""
    return f.log.hung or (f.log.failure is not None and MISMATCH.search(f.log.failure) is not None)


def moved_by(f: Facts, ratio: float, rel: float = 1e-6) -> bool:
    """Chapter 08: the first sync moved the copy `ratio` times as far as the reference's did
    (within rel, of 1 where the ratio is 0)."""
    value = f.syncs.sync_move_ratio
    return f.plan.rounds and value is not None and abs(value - ratio) <= rel * max(abs(ratio), 1)


MISTAKES = [
    # chapter 08's sync, first: its signatures hold only where the plan has DiLoCo's rounds
    Mistake(
        name="the sync on some ranks only",
        did="the sync (the all-reduce of the pseudo-gradient) is called by some ranks only; the "
        "others' next collective does not match it: on GPUs the ranks wait forever, gloo sees "
        "the sizes differ and ends the run. Every rank must reach the sync, at the same step",
        signature=lambda f: f.plan.rounds and mismatched(f),
        kind="hang",
        over=("a collective called by only some ranks",),
    ),
    Mistake(
        name="the pseudo-gradient's sign flipped",
        did="the pseudo-gradient is local - global, the way the copy moved; the outer SGD steps "
        "against it, so the first sync moves the parameters as far as chapter 08's, the other "
        "way (-1 times its move). It is global - local",
        signature=lambda f: moved_by(f, -1),
    ),
    Mistake(
        name="the pseudo-gradients summed, never divided by the ranks",
        did="the all-reduce sums the ranks' pseudo-gradients and the sum is never divided by the "
        "W ranks: the first sync moves the global parameters W times as far as chapter 08's. "
        "The mean is the sum divided by world_size",
        signature=lambda f: f.ranks.world_size > 1 and moved_by(f, f.ranks.world_size),
    ),
    Mistake(
        name="the outer step on the local copy",
        did="the outer optimizer steps this rank's copy (built on raw_model's parameters), not "
        "the global ones: the global parameters never move and every sync resets the copies "
        "to the run's start (the sync moved them 0 times as far as chapter 08's). Build it on "
        "global_model's parameters",
        signature=lambda f: moved_by(f, 0, rel=1e-9),
    ),
    Mistake(
        name="the copies not reset after the outer step",
        did="after the outer step each copy goes on from where its own round ended: the ranks "
        "start the next round apart, and the outer step never reaches them. Every copy starts "
        "each round from the global parameters",
        signature=lambda f: f.plan.rounds and f.syncs.kept_own_copy,
        over=("clipping or stepping on some ranks only",),
    ),
    Mistake(
        name="the parameters averaged, not the pseudo-gradients",
        did="the sync averages the copies' parameters with no outer optimizer: an outer SGD of lr "
        "1 without momentum, not --outer-lr with Nesterov --outer-momentum (with 0.7 and 0.9 "
        "the first sync moves 1 / (0.7 x 1.9) = 0.75 times as far as chapter 08's). Average "
        "the pseudo-gradients and step the outer optimizer",
        signature=lambda f: (
            f.plan.rounds
            and f.syncs.outer_steps == 0 < f.syncs.ref_outer_steps
            and f.syncs.sync_move_ratio is not None
            and f.syncs.sync_move_ratio > 0
        ),
    ),
    Mistake(
        name="a collective called by only some ranks",
        did="a collective (all_reduce, barrier, ...) that every rank must call is called by some "
        "only, or at different places: the ranks wait for each other forever (or gloo sees "
        "the sizes differ and ends the run)",
        signature=mismatched,
        kind="hang",
    ),
    Mistake(
        name="the replicas' losses not reduced",
        did="DataParallel returns one loss per replica (a vector); without .mean() backward() "
        "refuses it (the check splits each batch over 2 stand-in replicas)",
        signature=FailsWith(r"only for scalar outputs|doesn't match the broadcast shape"),
    ),
    Mistake(
        name="the replicas' losses summed, not averaged",
        did="each replica returns the mean loss of its share: their sum is R times the batch's "
        "mean loss (R replicas), and so is the gradient from step 1",
        signature=lambda f: (
            bool(f.ranks.replicas)
            and near(f.log.loss_ratio_at_1, 2)
            and near(f.grads.grad_ratio_at_1, 2)
        ),
    ),
    Mistake(
        name="no DataParallel",
        did="the model is never called through nn.DataParallel: the script is still chapter 02's "
        "(the check saw no batch split over its stand-in replicas)",
        signature=lambda f: f.ranks.replicas == 0,
        kind="idea",
    ),
    Mistake(
        name="the optimizer built before fully_shard",
        did="the optimizer was built on the model's parameters before fully_shard replaced them "
        "with shards: it holds the meta-device tensors, which get no gradient, so its first "
        "step fails",
        signature=FailsWith(r"on meta tensors"),
    ),
    Mistake(
        name="no FSDP",
        did="the model is never sharded with fully_shard: every rank holds the whole model (the "
        "script is still chapter 06's); the check found no shards (DTensors)",
        signature=lambda f: (
            f.plan.shards
            and not f.ranks.sharded
            and not f.ranks.fsdp_forwards
            and f.grads.optimizer_steps > 0
        ),
        kind="idea",
    ),
    Mistake(
        name="gradients reduced in float32 in a float64 run",
        did="a MixedPrecisionPolicy with reduce_dtype=torch.float32 whatever --dtype is: FSDP "
        "reduce-scatters the gradients in float32, so from step 1 they carry float32's "
        "rounding while step 1's loss is chapter 01's. The policy belongs to the 16-bit runs",
        signature=lambda f: (
            f.plan.shards
            and rounding(f) == "float32"
            and near(f.grads.grad_ratio_at_1, 1, FLOAT32_SIZED)
            and f.grads.first_grad_diff == 1
            and f.log.first_loss_diff != 1
        ),
    ),
    Mistake(
        name="optimizer.step() inside the micro-loop",
        did="the optimizer steps after every micro-batch instead of once per global batch: more "
        "optimizer steps than logged steps, each on a part of the batch",
        signature=lambda f: f.log.logged_steps > 0 and f.grads.optimizer_steps > f.log.logged_steps,
    ),
    Mistake(
        name="zero_grad inside the micro-loop",
        did="the gradients are zeroed on every micro-step, so only the last micro-batch's "
        "gradient reaches the optimizer: step 1's loss is right, its gradient is not",
        signature=lambda f: f.grads.grad_accum > 1 and f.grads.zero_grads_per_step > 1,
    ),
    Mistake(
        name="the learning rate advanced per micro-step",
        did="the schedule counts micro-steps, not optimizer steps: the logged lr of step s is "
        "chapter 01's of a later step, and warmup and decay end K times too early",
        signature=lambda f: f.log.lr_speed is not None and f.log.lr_speed > 1,
    ),
    Mistake(
        name="the gradient-sync switch off on the last micro-step",
        did="FSDP reduce-scatters the gradients on a micro-step whose gradient sync is on; here "
        "the last one's is off, so what it adds never reaches the shards the optimizer steps "
        "on",
        signature=lambda f: f.plan.shards and f.grads.last_micro_step_unsynced,
    ),
    Mistake(
        name="no_sync on the wrong micro-step",
        did="DDP averages the gradients on a micro-step outside no_sync(); here the last "
        "micro-step is inside it, so what it adds stays this rank's own and the copies drift",
        signature=lambda f: f.grads.last_micro_step_unsynced and not f.ranks.sharded,
        over=("gradients never averaged",),
    ),
    Mistake(
        name="gradients never averaged",
        did="each rank steps with its own gradient (no DDP wrapper, or no_sync() on every "
        "micro-step), so the ranks' copies drift apart from the first step",
        signature=lambda f: (
            f.ranks.world_size > 1
            and f.ranks.ranks_drift_from is not None
            and not f.ranks.ranks_clip_differ
            and not f.ranks.ranks_steps_differ
        ),
        unless=averaged,
    ),
    Mistake(
        name="clipping or stepping on some ranks only",
        did="the gradient is clipped (or the optimizer steps) on some ranks only: the averaged "
        "gradient is right on every rank, what each rank does with it is not, and the copies "
        "drift",
        signature=lambda f: (
            f.ranks.world_size > 1
            and (
                f.ranks.ranks_clip_differ
                or f.ranks.ranks_steps_differ
                or (f.ranks.ranks_drift_from is not None and near(f.grads.grad_ratio_at_1, 1, 1e-9))
            )
        ),
    ),
    Mistake(
        name="a global batch that forgets world_size or grad_accum",
        did="global_batch leaves out a factor, so the epoch is longer than chapter 01's: the "
        "ranks read past the end of chapter 01's epoch (or run out of windows there)",
        signature=lambda f: (f.log.script_steps_per_epoch or 0) > f.data.steps_per_epoch,
        over=("samplers seeded per rank",),
    ),
    Mistake(
        name="all ranks reading the same windows",
        did="every rank reads the same share of the batch (a sampler without this rank's place: "
        "rank=0, a local rank), so a step sees fewer distinct windows than chapter 01's",
        signature=lambda f: f.ranks.world_size > 1 and f.data.ranks_same_windows,
        over=("samplers seeded per rank",),
    ),
    Mistake(
        name="loss divided by world_size by hand",
        did="the loss is divided by world_size, but DDP already averages the gradients over the "
        "ranks: the loss and the gradient are 1/world_size of chapter 01's from step 1",
        signature=lambda f: (
            f.ranks.world_size > 1
            and near(f.log.loss_ratio_at_1, 1 / f.ranks.world_size)
            and near(f.grads.grad_ratio_at_1, 1 / f.ranks.world_size)
        ),
    ),
    Mistake(
        name="loss not divided by K",
        did="each micro-batch's loss is not divided by --grad-accum: the summed gradient is K "
        "times too large from step 1 (AdamW hides most of it; clipping and the logged loss do "
        "not)",
        signature=lambda f: (
            f.grads.grad_accum > 1
            and f.data.first_data_diff is None
            and (
                near(f.log.loss_ratio_at_1, f.grads.grad_accum)
                or near(f.grads.grad_ratio_at_1, f.grads.grad_accum)
            )
        ),
    ),
    Mistake(
        name="samplers seeded per rank",
        did="each rank's sampler draws its own permutation (a seed that depends on the rank), not "
        "one permutation cut in world_size pieces: other windows from step 1",
        signature=lambda f: (
            f.ranks.world_size > 1
            and f.data.first_data_diff == 1
            and (f.data.rank0_reads_its_share or f.data.ranks_overlap)
        ),
    ),
    Mistake(
        name="a forgotten set_epoch",
        did="the sampler is not told the epoch, so every epoch repeats epoch 0's order: the same "
        "run for one epoch, then different",
        signature=lambda f: (
            f.log.first_loss_diff == f.data.steps_per_epoch + 1
            and f.data.first_data_diff == f.data.steps_per_epoch + 1
            and f.data.repeats_first_epoch
            and not any(f.data.epoch_orders)  # every epoch read epoch 0's order
        ),
    ),
    Mistake(
        name="set_epoch given the step, not the epoch",
        did="the sampler is told the steps taken so far (iter_num), not the epoch: epoch 0 is "
        "chapter 01's, every later one reads the order of the epoch numbered by the steps "
        "taken when it starts",
        signature=lambda f: (
            len(f.data.epoch_orders) > 1
            and f.data.first_data_diff == f.data.steps_per_epoch + 1
            and all(k == e * f.data.steps_per_epoch for e, k in enumerate(f.data.epoch_orders))
        ),
    ),
    Mistake(
        name="ranks' logged loss not averaged",
        did="the logged loss is not the mean over the ranks (rank 0's share alone, or the sum): "
        "the training is right, the logged number is not",
        signature=lambda f: (
            f.ranks.world_size > 1
            and f.log.first_loss_diff is not None
            and f.data.first_data_diff is None
        ),
        kind="logging",
    ),
    Mistake(
        name="your evaluation differs; training is the same",
        did="every training loss and the parameters are chapter 01's, the validation loss is not: "
        "every rank must evaluate chapter 01's windows (or add up the ranks' loss sums and "
        "counts before dividing)",
        signature=lambda f: f.log.first_val_diff is not None and f.log.first_loss_diff is None,
        kind="evaluation",
    ),
    Mistake(
        name="a checkpoint of rank 0's shards only",
        did="under FSDP model.state_dict() on rank 0 is rank 0's shards, not the model: saved as "
        "ckpt.pt it does not load, so the resume fails. Gather the whole tensors on every "
        "rank first (get_model_state_dict with full_state_dict=True), then rank 0 writes",
        signature=FailsWith(r"Error\(s\) in loading state_dict"),
        kind="resume",
    ),
    Mistake(
        name="resume skipping steps instead of micro-batches",
        did="a resumed run skips step_in_epoch batches of the loader, but every step read "
        "grad_accum micro-batches: after the resume it reads windows it already trained on",
        signature=lambda f: (
            f.grads.grad_accum > 1
            and f.resume.resume_at is not None
            and f.resume.resume_diff == f.resume.resume_at + 1
            and len(f.resume.resume_reads_steps) > 1
            and max(f.resume.resume_reads_steps) <= f.resume.resume_at
        ),
        kind="resume",
        over=("a resume that re-reads an earlier step's windows",),
    ),
    Mistake(
        name="a resume that re-reads an earlier step's windows",
        did="the resumed run does not skip what this epoch already trained on: its first step "
        "reads the windows of an earlier step again",
        signature=lambda f: (
            f.resume.resume_at is not None
            and f.resume.resume_diff == f.resume.resume_at + 1
            and bool(f.resume.resume_reads_steps)
            and max(f.resume.resume_reads_steps) <= f.resume.resume_at
        ),
        kind="resume",
    ),
    Mistake(
        name="a resume that does not restore the optimizer state",
        did="the resumed run starts AdamW afresh: the first step after the resume reads the right "
        "windows and has the right gradient, yet moves the parameters differently",
        signature=lambda f: (
            f.resume.resume_at is not None
            and f.resume.resume_first_data_diff is None
            and f.resume.resume_first_param_diff == f.resume.resume_at + 1
            and f.resume.resume_first_grad_diff in (None, f.resume.resume_at + 2)
        ),
        kind="resume",
    ),
    Mistake(
        name="a restart that does not continue the run",
        did="torchrun restarted the group after a rank was killed, and the run did not continue "
        "from its checkpoint to chapter 01's end: a restarted process must resume as --resume "
        "would (chapter 06)",
        signature=lambda f: f.resume.restart is not None,
        kind="resume",
    ),
    Mistake(
        name="the GPU chosen by RANK, not LOCAL_RANK",
        did="a rank asks for the GPU of its global RANK: on every machine but the first, RANK is "
        "past the machine's GPUs. Here rank 1 of the second node has LOCAL_RANK 0, yet its "
        "device statement gives cuda:1. On GPUs the run fails or stacks ranks on one GPU",
        signature=lambda f: f.ranks.gpu_by_global_rank,
        kind="device",
    ),
]


def ruled_out(mistake: Mistake, f: Facts) -> str | None:
    """Why the facts rule the entry out although its signature fits, or None."""
    if mistake.kind == "training" and training_right(f):
        return f"the parameters equal {f.plan.against}'s after every step: the training is right"
    if mistake.kind in ("logging", "evaluation") and not training_right(f):
        return f"the parameters differ from {f.plan.against}'s: more than the logging differs"
    return mistake.unless(f) if mistake.unless is not None else None


def fits(mistake: Mistake, f: Facts) -> bool:
    """The entry's signature fits the facts; an entry named by its failure: the run failed so."""
    if isinstance(mistake.signature, FailsWith):
        return (
            f.log.failure is not None
            and re.search(mistake.signature.message, f.log.failure) is not None
        )
    return mistake.signature(f)


def known_failure(failure: str | None) -> Mistake | None:
    """The entry named by this failure, if any."""
    for mistake in MISTAKES:
        if isinstance(mistake.signature, FailsWith) and failure is not None:
            if re.search(mistake.signature.message, failure):
                return mistake
    return None


def diagnose(facts: Facts) -> tuple[list[Mistake], list[str]]:
    """(the entries that fit, notes on those the facts rule out): every fitting entry but the more
    general ones another fitting entry explains (`over`)."""
    found, notes = [], []
    for mistake in MISTAKES:
        if not fits(mistake, facts):
            continue
        why = ruled_out(mistake, facts)
        if why is not None:
            notes.append(f'not "{mistake.name}": {why}')
            continue
        found.append(mistake)
    general = {name for mistake in found for name in mistake.over}
    return [m for m in found if m.name not in general], notes


def close_to_one(value: float) -> str:
    """A ratio in 6 digits; within 1e-5 of 1 as `1 + 1.5e-06`, which 6 digits would show as 1."""
    if value != 1 and abs(value - 1) < 1e-5:
        sign = "+" if value > 1 else "-"
        return f"1 {sign} {abs(value - 1):.1e}"
    return f"{value:.6g}"


def ratio_words(value: float | None, f: Facts) -> str:
    """A ratio to chapter 01's, with the whole-number reading that fits it exactly, if any."""
    if value is None or math.isnan(value):
        return "not measured"
    text = close_to_one(value)
    w, k = f.ranks.world_size, f.grads.grad_accum
    names = {"W": w, "K": k, "W*K": w * k}
    if f.ranks.replicas:
        names["R (replicas)"] = f.ranks.replicas
    if near(value, 1, 1e-9):
        return f"{text} (equal)"
    for name, n in names.items():
        if n > 1 and near(value, n):
            return f"{text} (= {name} = {n})"
        if n > 1 and near(value, 1 / n):
            return f"{text} (= 1/{name} = 1/{n})"
    return text


# ---- what the facts show, when no entry fits ---------------------------------------------------

# the differences a run can show, causes before effects: a step reads its windows, its learning rate
# is set, its loss computed, then its gradient, then the step moves the parameters
FIRSTS = ("windows", "learning rate", "loss", "gradient", "parameters", "validation loss")


def first_differences(f: Facts) -> list[tuple[int, str]]:
    """(step, what) for each column that differs, the first first."""
    first = {
        "windows": f.data.first_data_diff,
        "learning rate": f.log.first_lr_diff,
        "loss": f.log.first_loss_diff,
        "gradient": f.grads.first_grad_diff,
        "parameters": f.grads.first_param_diff,
        "validation loss": f.log.first_val_diff,
    }
    return sorted(
        ((s, name) for name, s in first.items() if s is not None),
        key=lambda d: (d[0], FIRSTS.index(d[1])),
    )


def step_place(step: int, f: Facts) -> str:
    """Where a step sits among the epochs: "step 4 is the first step of epoch 1"."""
    per = f.data.steps_per_epoch
    epoch, nth = (step - 1) // per, (step - 1) % per + 1
    if step == 1:
        return "step 1 is the run's first step, before any epoch boundary: every step differs"
    h = f.syncs.first_sync
    if f.plan.rounds and h and (step - 1) % h == 0:
        return (
            f"step {step} is the first step after a sync (one every {h} steps here): look at the "
            "sync (the pseudo-gradient, its all-reduce, the outer step, the copies' reset)"
        )
    if nth == 1:
        return (
            f"step {step} is the first step of epoch {epoch} (an epoch is {per} steps here): "
            "look at what changes from one epoch to the next (the sampler's set_epoch, its seed, "
            "the loader built for each epoch)"
        )
    return f"step {step} is step {nth} of epoch {epoch} (an epoch is {per} steps here)"


def micro_batches(step: int, f: Facts) -> str | None:
    """The first differing step and the accumulation: which micro-batch first read other windows,
    and, at an epoch's first step, the micro-batches an epoch holds that its steps leave unread."""
    k, w, per = f.grads.grad_accum, f.ranks.world_size, f.data.steps_per_epoch
    if k < 2:
        return None
    said = []
    if f.data.first_data_micro is not None and step == f.data.first_data_diff:
        rank, m = f.data.first_data_micro
        said.append(
            f"rank {rank}'s micro-batch {m} of {k} is the first to read windows outside "
            f"{f.plan.against}'s step {step}"
        )
    if step > 1 and (step - 1) % per == 0 and f.data.train_windows:
        batch = max(GLOBAL_BATCH // (w * k), 1)
        held = f.data.train_windows // w // batch
        if held > per * k:
            said.append(
                f"each rank's loader holds {held} micro-batches of {batch} an epoch and its {per} "
                f"steps of K = {k} use {per * k}: the {held - per * k} left over must not reach "
                "the next epoch's steps"
            )
    return "; ".join(said) or None


def epoch_orders(f: Facts) -> str | None:
    """Which sampler order each epoch read, where it is not the epoch's own."""
    wrong = [(e, k) for e, k in enumerate(f.data.epoch_orders) if k != e]
    if not wrong:
        return None
    parts = []
    for e, k in wrong:
        if k is None:
            parts.append(
                f"epoch {e} read no epoch's order (the permutation of no seed + k, k < {ORDERS})"
            )
        else:
            parts.append(f"epoch {e} read epoch {k}'s order (the permutation of seed + {k})")
    return f"{'; '.join(parts)}: chapter 01's epoch e reads the permutation of seed + e"


# the relative size of a first difference, against the number format whose rounding it is (the
# loss and the gradient norm sum over many elements, so their rounding is well below the format's
# epsilon): below FLOAT32_SIZED, float32's (float64's is about 1e-16); below ROUNDING_SIZED, 16
# bits'; above, a different computation
FLOAT32_SIZED, ROUNDING_SIZED = 5e-7, 1e-3


def first_size(f: Facts) -> tuple[str, float] | None:
    """(what, relative size) of the first difference measured before the optimizer's steps can
    amplify it: the loss or the gradient norm at the first step where either differs (the larger,
    where both do), else the final parameters."""
    early = [
        (step, what, size)
        for step, what, size in (
            (f.log.first_loss_diff, "the loss", f.log.loss_rel_diff),
            (f.grads.first_grad_diff, "the gradient norm", f.grads.grad_rel_diff),
        )
        if step is not None and size is not None and math.isfinite(size)
    ]
    if early:
        step = min(s for s, _, _ in early)
        size, what = max((z, w) for s, w, z in early if s == step)
        return f"{what} at step {step}", size
    if not f.grads.params_equal and math.isfinite(f.grads.distance):
        return "the final parameters", f.grads.distance
    return None


def rounding(f: Facts) -> str | None:
    """The number format whose rounding the first difference is the size of: "float32" or "16
    bits" (float16, bfloat16); None: other windows or other steps, or too large for rounding."""
    size = first_size(f)
    if size is None or f.data.first_data_diff is not None:
        return None
    if f.grads.optimizer_steps != f.log.logged_steps:
        return None
    if size[1] < FLOAT32_SIZED:
        return "float32"
    if size[1] < ROUNDING_SIZED:
        return "16 bits"
    return None


def rounding_words(f: Facts) -> str | None:
    kind = rounding(f)
    if kind is None:
        return None
    what, size = first_size(f)
    verb = "differ" if what == "the final parameters" else "differs"
    text = f"{what} {verb} by a relative {size:.1e} in a float64 check"
    if what != "the final parameters" and not f.grads.params_equal:
        text += f" (the final parameters by {f.grads.distance:.1e})"
    if kind == "float32":
        return (
            f"{text}: far above float64's rounding (about 1e-16), the size of float32's (its "
            "epsilon is 1.2e-7, and a norm over many numbers rounds well below it), not a "
            "different computation: something computes in float32; look at dtypes, autocast and "
            "mixed-precision policies"
        )
    return (
        f"{text}: the size of 16 bits' rounding (float16's epsilon is 9.8e-4, bfloat16's "
        "7.8e-3), not a different computation: something computes or communicates in float16 or "
        "bfloat16; look at dtypes, autocast, mixed-precision policies and DDP's communication "
        "hooks"
    )


def describe(f: Facts) -> list[str]:
    """What the facts show, when no entry fits: ratios, first differences and where they sit
    (epochs, micro-batches, the resume), their size against the number format, and the ranks'
    own copies."""
    out = [
        f"at step 1: loss {ratio_words(f.log.loss_ratio_at_1, f)} x {f.plan.against}'s, "
        f"gradient norm {ratio_words(f.grads.grad_ratio_at_1, f)} x"
    ]
    differ = first_differences(f)
    same = [name for name in FIRSTS if name not in {n for _, n in differ}]
    if differ:
        parts = ", ".join(f"{name} from step {s}" for s, name in differ)
        out.append(f"first differences: {parts}; the same throughout: {', '.join(same)}")
        first = differ[0][0]
        out.append(step_place(first, f))
        for said in (micro_batches(first, f), epoch_orders(f), rounding_words(f)):
            if said:
                out.append(said)
    if f.grads.optimizer_steps != f.log.logged_steps and f.log.logged_steps:
        out.append(
            f"{f.grads.optimizer_steps} optimizer steps for {f.log.logged_steps} logged steps"
        )
    if f.ranks.world_size > 1:
        if f.ranks.sharded:
            out.append("the ranks hold shards of the parameters (FSDP), compared whole")
        else:
            out.append(f"the ranks' copies: {copies_words(f)}")
    if training_right(f) and not logging_right(f):
        out.append(
            f"only the logging differs: the parameters equal {f.plan.against}'s after every step"
        )
    if syncs_differ(f):
        out.append(syncs_words(f))
    if f.resume.resume_diff is not None:
        out.append(resumed_words(f))
    if f.resume.resume_start_differs:
        out.append("the resumed run starts from other parameters than the stopped run ended with")
    return out


def syncs_differ(f: Facts) -> bool:
    """Chapter 08: the syncs are not the reference's (the outer steps, the first sync's move, the
    copy the next round starts from)."""
    y = f.syncs
    return f.plan.rounds and (
        y.outer_steps != y.ref_outer_steps or not moved_by(f, 1) or y.kept_own_copy
    )


def syncs_words(f: Facts) -> str:
    """Chapter 08's syncs against the reference's, in words."""
    y, against = f.syncs, f.plan.against
    ratio = "?" if y.sync_move_ratio is None else close_to_one(y.sync_move_ratio)
    if y.sync_move_ratio is not None and abs(y.sync_move_ratio) < 1e-9:
        ratio = "0"  # not -0
    text = (
        f"the syncs: {y.outer_steps} outer optimizer step(s) on rank 0 ({against}: "
        f"{y.ref_outer_steps}); the first sync, after step {y.first_sync}, moved rank 0's copy "
        f"{ratio} times as far as {against}'s"
    )
    if y.kept_own_copy:
        text += "; the next round started from the copy's own parameters, not the global ones"
    return text


def copies_words(f: Facts) -> str:
    """The ranks' copies against each other, where the reference's are equal: at every step
    (chapter 01's one copy), after every sync (chapter 08's)."""
    r, plan = f.ranks, f.plan
    own = plan.reference == plan.chapter
    if r.ranks_drift_from is None:
        if own:
            return f"equal on all {r.world_size} ranks wherever {plan.against}'s are"
        return f"equal on all {r.world_size} ranks at every step"
    others = ", ".join(map(str, r.drifting))
    since = r.ranks_drift_from
    when = "before step 1" if since == 0 else f"from step {since}"
    if own:
        when = "before step 1" if since == 0 else f"after step {since}"
        when += f", where {plan.against}'s copies are equal"
    return f"rank(s) {others} differ from rank 0's {when}"


def resumed_words(f: Facts) -> str:
    at, diff = f.resume.resume_at, f.resume.resume_diff
    text = f"after the resume at step {at}: differs from step {diff}"
    if diff == at + 1:
        return f"{text}, the first step the resumed run took ({step_place(diff, f)})"
    return f"{text}, {diff - at - 1} step(s) after the resume ({step_place(diff, f)})"


# ---- the learner's line nearest the first difference: code only, each on one line ----------


def header_end(node: ast.stmt) -> int:
    """The last line (from 1) of a statement; of a compound one, the last line of its header."""
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        return body[0].lineno - 1
    return node.end_lineno or node.lineno


def quoted(node: ast.stmt, lines: list[str]) -> str:
    """The statement as the script has it, on one line (a compound one by its header)."""
    text = " ".join(
        line.split("#")[0].strip() for line in lines[node.lineno - 1 : header_end(node)]
    )
    return re.sub(r"([(\[{]) | ([)\]}])|,([)\]}])", r"\1\2\3", text).strip()


def docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def code_statements(source: str) -> list[ast.stmt]:
    """Every statement but the docstrings and the bare constants, in line order; [] where the
    source does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and not docstring(n)]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def header(node: ast.stmt) -> str:
    """A statement's code, formatting aside: a compound statement's first line alone."""
    return ast.unparse(node).split("\n")[0]


# the names a statement behind each kind of first difference is likely to use
CONCERNS = {
    "windows": {
        *("sampler", "set_epoch", "batch_loader", "loader", "batches", "skip", "epoch"),
        *("step_in_epoch", "DistributedSampler", "RandomSampler", "seed", "manual_seed"),
        *("global_batch", "world_size", "rank"),
    },
    "precision": {
        *("dtype", "float", "float32", "float16", "bfloat16", "half", "double", "to"),
        *("autocast", "MixedPrecisionPolicy", "param_dtype", "reduce_dtype", "register_comm_hook"),
    },
    "learning rate": {"lr", "lr_at", "param_groups", "warmup_iters", "lr_decay_iters", "min_lr"},
    "loss": {"loss", "micro_loss", "loss_value", "all_reduce", "mean", "sum"},
    "gradient": {
        *("backward", "grad", "clip_grad_norm_", "no_sync", "grad_accum", "micro_loss", "sync"),
        *("all_reduce", "set_requires_gradient_sync", "scale", "unscale_", "DDP", "fully_shard"),
        *("zero_grad", "step"),
    },
    "parameters": {"step", "optimizer", "zero_grad", "AdamW", "weight_decay", "scaler", "is_rank0"},
    "validation loss": {"evaluate", "val_loss", "val_windows", "val_set"},
    "sync": {
        *("moved", "pseudo_grad", "sent", "mean_pseudo_grad", "all_reduce", "outer_optimizer"),
        *("global_model", "global_params", "copy_", "grad", "world_size"),
    },
    "resume": {"skip", "resume", "checkpoint", "load_checkpoint", "restore_training_state"},
    "device": {"device", "local_rank", "rank", "set_device", "cuda"},
}
CONCERN_WORDS = {
    "windows": "the data order",
    "precision": "the number format",
    "learning rate": "the learning rate",
    "loss": "the loss",
    "gradient": "the gradient",
    "parameters": "the optimizer step",
    "validation loss": "the evaluation",
    "sync": "the sync",
    "resume": "the resume",
    "device": "the GPU a rank drives",
}
KIND_CONCERNS = {
    "resume": "resume",
    "device": "device",
    "logging": "loss",
    "evaluation": "validation loss",
}


def names_in(node: ast.stmt) -> set[str]:
    """The names, attributes and keywords a statement (a compound one: its header) uses."""
    used = set()
    parts = [node.test] if isinstance(node, (ast.If, ast.While)) else [node]
    if isinstance(node, (ast.For, ast.With, ast.Try, ast.FunctionDef, ast.ClassDef)):
        parts = [n for n in ast.iter_child_nodes(node) if not isinstance(n, ast.stmt)]
    for part in parts:
        for n in ast.walk(part):
            if isinstance(n, ast.Name):
                used.add(n.id)
            elif isinstance(n, ast.Attribute):
                used.add(n.attr)
            elif isinstance(n, ast.keyword) and n.arg:
                used.add(n.arg)
    return used


def concern_of(f: Facts, kind: str | None) -> str | None:
    """What the first difference is about: the named mistake's kind, the sync in DiLoCo's rounds,
    the number format where it is rounding's size, else the first quantity that differs."""
    if kind in KIND_CONCERNS:
        return KIND_CONCERNS[kind]
    if f.resume.resume_diff is not None and training_right(f):
        return "resume"
    if f.plan.rounds and (syncs_differ(f) or kind == "training"):
        return "sync"
    if rounding(f):
        return "precision"
    differ = first_differences(f)
    return differ[0][1] if differ else None


def nearest_line(
    f: Facts, source: str, script: str, theirs: str, kind: str | None = None
) -> str | None:
    """Of the learner's statements that are not the chapter's own (compared as code in order), the
    first that uses a name of what differs first; else the first that is not the chapter's; where
    the learner has left one of the chapter's out, that one. None where nothing can be named."""
    mine, chapter = code_statements(source), code_statements(theirs)
    if not mine or not chapter:
        return None
    concern = concern_of(f, kind)
    words = CONCERNS.get(concern, set())
    matcher = difflib.SequenceMatcher(
        None, [header(n) for n in chapter], [header(n) for n in mine], autojunk=False
    )
    changed = []  # (the learner's statement, the chapter's in its place or None)
    missing = []  # (the chapter's statement the learner left out, the learner's before it)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2) if op != "equal" else ():
            there = chapter[i1 + j - j1] if op == "replace" and i2 - i1 == j2 - j1 else None
            changed.append((mine[j], there))
        if op == "delete":
            missing += [(chapter[i], mine[j1 - 1] if j1 else None) for i in range(i1, i2)]
    number = f"{f.plan.chapter:02d}"
    lines, their_lines = source.splitlines(), theirs.splitlines()
    relevant = [(n, t) for n, t in changed if names_in(n) & words]
    gone = [(n, a) for n, a in missing if names_in(n) & words] or missing
    if gone and not relevant and (not changed or gone is not missing):
        node, after = gone[0]
        where = f" after your line {after.lineno}, `{quoted(after, lines)}`" if after else ""
        return (
            f"your script has no such line; chapter {number} has "
            f"`{quoted(node, their_lines)}`{where}"
        )
    if not changed:
        return (
            f"your script's statements are chapter {number}'s: what differs comes from elsewhere "
            "(a module it imports, the flags)"
        )
    node, there = (relevant or changed)[0]
    about = f" ({CONCERN_WORDS[concern]})" if relevant else ""
    text = f"look at line {node.lineno} of {script}{about}: `{quoted(node, lines)}`"
    if there is not None:
        return f"{text}; chapter {number} has `{quoted(there, their_lines)}` there"
    elsewhere = [n for n in chapter if header(n) == header(node)]
    if elsewhere:
        before = [n for n in chapter if n.lineno < elsewhere[0].lineno]
        after = f" after `{quoted(before[-1], their_lines)}`" if before else ""
        return f"{text}; chapter {number} has it in another place{after}"
    return f"{text}; chapter {number} has no such line"
