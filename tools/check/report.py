"""The verdict a learner reads: "same run" with what was compared and what could not be, or "not
the same run" with each difference the facts show (a table of rules: when, and what it says), the
diagnosis, and a plot of the loss curves."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tools.check.facts import Facts
from tools.check.harness import Difference
from tools.check.mistakes import (
    close_to_one,
    copies_words,
    describe,
    diagnose,
    epoch_orders,
    first_differences,
    logging_right,
    micro_batches,
    nearest_line,
    resume_right,
    resumed_words,
    rounding_words,
    step_place,
    syncs_differ,
    syncs_words,
    training_right,
)
from tools.check.plan import RESTART_KILL, STEPS
from tools.check.runner import Run


@dataclass(frozen=True)
class Seen:
    """The facts and the columns the report quotes."""

    facts: Facts
    run: Run
    ref: Run
    resumed: Run | None
    failure: str | None  # the run's failure line, if it failed
    restarted: bool = False  # the killed-and-restarted run was checked


def ranks_compared(s: Seen) -> str:
    if s.facts.ranks.sharded:
        return f"gathered whole from the shards of all {s.facts.ranks.world_size} ranks"
    if s.facts.ranks.world_size > 1:
        return f"on all {s.facts.ranks.world_size} ranks"
    return "in its one process"


def loss_line(s: Seen) -> str:
    first, losses, ref = s.facts.log.first_loss_diff, s.run.losses(), s.ref.losses()
    if first in losses and first in ref:
        a, b = losses[first], ref[first]
        return (
            f"the loss differs from step {first}: {a:.6f} here, {b:.6f} in {s.facts.plan.against} "
            f"(ratio {close_to_one(a / b)})"
        )
    return f"steps 1-{first - 1} are {s.facts.plan.against}'s, then the script logged no more"


def column_line(s: Seen, name: str, step: int, what: str, digits: str) -> str:
    mine, theirs = s.run.column(name).get(step, math.nan), s.ref.column(name).get(step, math.nan)
    return f"{what} {step}: {mine:{digits}} here, {theirs:{digits}} in {s.facts.plan.against}"


def ranks_line(s: Seen) -> str:
    r = s.facts.ranks
    if r.sharded:
        return (
            f"the ranks' parameters: sharded (each rank holds 1/{r.world_size}), compared whole "
            "at every step"
        )
    return f"the ranks' copies: {copies_words(s.facts)}"


def data_line(s: Seen) -> str:
    who = ""
    if s.facts.ranks.world_size > 1 and s.facts.ranks.data_ranks:
        off = ", ".join(map(str, s.facts.ranks.data_ranks))
        who = f" (rank(s) {off} read windows outside that step's batch)"
    return (
        f"the windows read: other than {s.facts.plan.against}'s from step "
        f"{s.facts.data.first_data_diff}{who}"
    )


def gpus_read(s: Seen) -> str:
    """Each rank's GPU, as the probe read it from the script's device statement."""
    line, code = s.facts.ranks.device_statement
    each = ", ".join(f"rank {r} (LOCAL_RANK {lr}) cuda:{i}" for r, lr, i in s.facts.ranks.devices)
    return f"line {line}'s `{code}`, evaluated with each rank's own variables there: {each}"


def gpus_unchecked(s: Seen) -> str:
    if s.facts.ranks.gpu_read:
        said = "the GPUs themselves: the CPU runs drive none (their index was read, not used)"
        if s.facts.plan.nodes == 1:
            said += (
                "; on one machine RANK is LOCAL_RANK, so which of the two the index follows shows "
                "only in the checks that run two nodes"
            )
        return said
    why = s.facts.ranks.device_unread or "not read"
    return (
        f"which GPU each rank drives: {why} (the check reads it from a statement such as "
        '`torch.device("cuda", local_rank)`)'
    )


def fsdp_line(s: Seen) -> str:
    if s.facts.ranks.fsdp_forwards:
        return (
            "FSDP: the model was sharded, but the optimizer's parameters are not shards: it "
            "holds the tensors from before fully_shard"
        )
    return "FSDP: no rank's parameters are shards (DTensors): the model was not sharded"


def differences(s: Seen) -> list[str]:
    """What a run that is not the reference's shows, in this order."""
    f, against = s.facts, s.facts.plan.against
    out = []
    if f.log.first_loss_diff is not None:
        out.append(loss_line(s))
    elif not f.grads.params_equal:
        out.append(
            f"every loss equals {against}'s, but the final parameters differ "
            f"(relative {f.grads.distance:.1e})"
        )
    if f.log.first_lr_diff is not None:
        step = f.log.first_lr_diff
        out.append(column_line(s, "lr", step, "the learning rate differs from step", ".6g"))
    if f.log.first_val_diff is not None:
        step = f.log.first_val_diff
        out.append(column_line(s, "val_loss", step, "the validation loss differs at step", ".6f"))
    if f.grads.optimizer_steps != f.log.logged_steps:
        out.append(
            f"{f.grads.optimizer_steps} optimizer steps for {f.log.logged_steps} logged steps"
        )
    if f.log.stopped_after is not None:
        out.append(f"the script stopped after step {f.log.stopped_after}: {s.failure}")
    if f.ranks.world_size > 1:
        out.append(ranks_line(s))
    if syncs_differ(f):
        out.append(syncs_words(f))
    if f.data.first_data_diff is not None:
        out.append(data_line(s))
    if f.resume.resume_diff is not None:
        out.append(
            f"uninterrupted it is {against}'s run; stopped at step {f.plan.resume_at} and "
            f"resumed, it differs from step {f.resume.resume_diff}"
        )
    if f.resume.restart is not None:
        out.append(
            f"uninterrupted it is {against}'s run; as 2 nodes with rank 1 killed after step "
            f"{RESTART_KILL} and torchrun --max-restarts=1: {f.resume.restart}"
        )
    if f.ranks.replicas == 0:
        out.append(
            "DataParallel: never called (the check splits its batches over stand-in replicas)"
        )
    if f.plan.shards and not f.ranks.sharded:
        out.append(fsdp_line(s))
    if f.ranks.gpu_by_global_rank:
        out.append(f"the GPUs the ranks would drive: {gpus_read(s)}")
    return out


def same_lines(s: Seen) -> list[str]:
    """A "same run" verdict: what was compared, and what the check could not observe."""
    plan = s.facts.plan
    lines = [
        f"same run: all {STEPS} losses, learning rates, the validation loss and the parameters "
        f"after every step equal {plan.against}'s, {ranks_compared(s)}"
    ]
    if s.resumed is not None:
        lines.append(f"  stopped at step {plan.resume_at} and resumed: the same end")
    lines += [f"  {line}" for line in plan.checked_more(s.restarted)]
    if plan.picks_gpu and s.facts.ranks.gpu_read:
        lines.append(f"  which GPU each rank would drive: {gpus_read(s)}")
    lines.append(f"  unchecked: {'; '.join(plan.unchecked(gpus_unchecked(s)))}")
    return lines


def placed(f: Facts) -> list[str]:
    """Where the first difference sits: the epochs, the micro-batches, the sampler's orders, the
    number format, the resume."""
    differ = first_differences(f)
    said = []
    if differ:
        first = differ[0][0]
        said = [step_place(first, f), micro_batches(first, f), epoch_orders(f), rounding_words(f)]
    if f.resume.resume_diff is not None:
        said.append(resumed_words(f))
    return [line for line in said if line]


def different_lines(
    s: Seen, source: str, script: str, theirs: str, facts_file: str, first: Difference | None
) -> list[str]:
    """A "not the same run" verdict: what differs, first the harness's first difference, where it
    sits, the mistakes whose mechanism the facts show (or what the facts show), the line to look
    at. Each fact once."""
    lines = ["not the same run:"]
    if first is not None:
        lines.append(first.words(s.facts.plan.against))
    for line in differences(s):
        # the first difference's own column, said above already
        if first is not None and line.startswith(f"the {first.quantity} differs"):
            continue
        lines.append(line)
    found, notes = diagnose(s.facts)
    lines += placed(s.facts) + notes
    said = []
    for line in lines:
        if line not in said:
            said.append(line)
    out = [said[0]] + [f"  {line}" for line in said[1:]]
    if len(found) > 1:
        out.append(f"{len(found)} mistakes fit the facts (one of them, or both):")
    if not found:
        out.append("diagnosis: no known mistake fits; what the facts show:")
        out += [f"  {line}" for line in describe(s.facts) if line not in said]
    out += [f"diagnosis: {mistake.name}: {mistake.did}" for mistake in found]
    kind = found[0].kind if found else None
    near = nearest_line(s.facts, source, script, theirs, kind)
    if near is not None:
        out.append(f"  {near}")
    if not found:
        out.append(f"  (all the facts: {facts_file})")
    return out


def plotted_run(s: Seen) -> tuple[Run, str, int | None]:
    """The run the plot shows against the reference's: the resumed one where only it differs."""
    f = s.facts
    if s.resumed is not None and training_right(f) and logging_right(f) and not resume_right(f):
        return (
            s.resumed,
            f"your script, stopped at step {f.plan.resume_at} and resumed",
            f.resume.resume_diff,
        )
    return s.run, "your script", f.log.first_loss_diff


def plot(path: Path, s: Seen, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    run, label, first = plotted_run(s)
    losses, ref = run.losses(), s.ref.losses()
    fig, ax = plt.subplots(figsize=(7, 4))
    against = s.facts.plan.against
    ax.plot(sorted(ref), [ref[i] for i in sorted(ref)], "o-", label=against, color="tab:blue")
    ax.plot(
        sorted(losses), [losses[i] for i in sorted(losses)], "x--", label=label, color="tab:red"
    )
    epoch = s.facts.data.steps_per_epoch
    for boundary in range(epoch, STEPS, epoch):
        name = "a new epoch" if boundary == epoch else None  # starts after this step
        ax.axvspan(boundary + 0.45, boundary + 0.55, color="0.9", label=name)
    if first is not None:
        ax.axvline(first, color="gray", linestyle=":")
        ax.annotate(
            f"first difference: step {first}",
            (first, 0.03),  # at the bottom of the plot, beside the line
            xycoords=("data", "axes fraction"),
            xytext=(4, 0),
            textcoords="offset points",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
