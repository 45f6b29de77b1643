"""Is your script chapter 01's run? Run it next to chapter 01 and compare them step by step.

    python -m tools.check 02_grad_accumulation/exercise.py
    python -m tools.check 04_ddp/exercise.py --nproc-per-node 2
    python -m tools.check my_ddp.py --nproc-per-node 2 --chapter 4

SCRIPT, a copy of a chapter's train.py, runs (under torchrun where N > 1) beside chapter 01 in
float64 on the tiny model: the same global batch of 8, seed and corpus of 29 windows, so 8 steps
cross two epoch boundaries and equal runs agree to the last digit. Compared: every logged row, the
optimizer steps, the windows each rank read, each step's gradient norm and parameters on every
rank, the GPU each rank would drive, and a run stopped at step 5 and resumed (chapter 06: a rank
killed and the group restarted). Chapter 03 splits batches over 2 stand-in replicas; 05 and 06 run
as two nodes; 07's shards are gathered whole. Exit 0: "same run", with what went unchecked; exit 1:
"not the same run", with the first difference, where it sits, the mistakes whose mechanism the
facts show and the nearest line of the script (a hang: each rank's line); exit 2: "could not run".
Logs, metrics, facts and a plot of both loss curves go to a new folder under out/check/.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from common.chapters import CHAPTERS
from tools.check import facts as gather
from tools.check import mistakes
from tools.check.facts import Facts
from tools.check.harness import Difference, Pair, first_difference, pair_of
from tools.check.mistakes import MISTAKES, code_statements, fits, known_failure, quoted
from tools.check.reference import (
    GLOBAL_BATCH,
    PLANS,
    RESTART_EVAL,
    RESTART_KILL,
    STEPS,
    CannotRun,
    Launch,
    Plan,
    Run,
    failure_line,
    shown,
)
from tools.launch import REPO


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
            f"(ratio {mistakes.close_to_one(a / b)})"
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
    return f"the ranks' copies: {mistakes.copies_words(s.facts)}"


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
    if mistakes.syncs_differ(f):
        out.append(mistakes.syncs_words(f))
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
    differ = mistakes.first_differences(f)
    said = []
    if differ:
        first = differ[0][0]
        said = [
            mistakes.step_place(first, f),
            mistakes.micro_batches(first, f),
            mistakes.epoch_orders(f),
            mistakes.rounding_words(f),
        ]
    if f.resume.resume_diff is not None:
        said.append(mistakes.resumed_words(f))
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
    found, notes = mistakes.diagnose(s.facts)
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
        out += [f"  {line}" for line in mistakes.describe(s.facts) if line not in said]
    out += [f"diagnosis: {mistake.name}: {mistake.did}" for mistake in found]
    kind = found[0].kind if found else None
    near = mistakes.nearest_line(s.facts, source, script, theirs, kind)
    if near is not None:
        out.append(f"  {near}")
    if not found:
        out.append(f"  (all the facts: {facts_file})")
    return out


def plotted_run(s: Seen) -> tuple[Run, str, int | None]:
    """The run the plot shows against the reference's: the resumed one where only it differs."""
    f = s.facts
    if (
        s.resumed is not None
        and mistakes.training_right(f)
        and mistakes.logging_right(f)
        and not mistakes.resume_right(f)
    ):
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


def written_as(source: str) -> tuple[int | None, int | None]:
    """(N, line) of the script's call that names its chapter (CourseParser(chapter=N, ...))."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None, None
    for node in ast.walk(tree):
        for word in node.keywords if isinstance(node, ast.Call) else []:
            if word.arg == "chapter" and isinstance(word.value, ast.Constant):
                return int(word.value.value), node.lineno
    return None, None


def chapter_of(script: Path, source: str, given: int | None) -> int:
    """--chapter, else the chapter folder the script is in, else the one its CourseParser names."""
    if given is not None:
        return given
    for number, name in CHAPTERS.items():
        if script.resolve().parent == REPO / name:
            return number
    number, _ = written_as(source)
    if number is None:
        raise CannotRun(
            f"cannot tell which chapter {shown(script)} is: give --chapter N (1-{max(CHAPTERS)})"
        )
    return number


def planned(args) -> tuple[Plan, int, str]:
    """The chapter's plan, the ranks to run and the script's source; or CannotRun saying why not."""
    script = Path(args.script)
    if not script.is_file():
        raise CannotRun(f"{args.script}: no such file")
    source = script.read_text(errors="replace")
    chapter = chapter_of(script, source, args.chapter)
    if chapter not in PLANS:
        raise CannotRun(f"--chapter {chapter}: the chapters are 1 to {max(PLANS)}")
    plan = PLANS[chapter]
    if args.nproc_per_node > 1 and not plan.distributed:
        raise CannotRun(f"chapter {chapter:02d} runs in one process: drop --nproc-per-node")
    nproc = plan.nproc(args.nproc_per_node)
    if GLOBAL_BATCH % nproc:
        raise CannotRun(
            f"--nproc-per-node {nproc}: the check's global batch of 8 needs 1, 2, 4 or 8 ranks"
        )
    says, line = written_as(source)
    if says is not None and says != chapter:
        raise CannotRun(
            f"{shown(script)} is still chapter {says:02d}'s script (line {line}: "
            f"CourseParser(chapter={says}, ...)) and is checked as chapter {chapter:02d}: "
            f"do its TODOs (one sets chapter={chapter})"
        )
    return plan, nproc, source


def hang_report(run: Run, script: Path, source: str, nproc: int) -> list[str]:
    """Each rank's line in the script and the collective it waits in (or how it ended)."""
    hangs, lines = run.hangs(), source.splitlines()
    nodes = {n.lineno: n for n in code_statements(source)}
    statuses = {r["rank"]: r.get("status") for r in run.ranks()}
    out = []
    for rank in range(nproc):
        if rank in hangs:
            where = hangs[rank]
            node = nodes.get(where["line"])
            said = quoted(node, lines) if node else lines[where["line"] - 1].strip()
            out.append(
                f"  rank {rank} waits in {where['collective']} at line {where['line']} of "
                f"{shown(script)}: `{said}`"
            )
        elif statuses.get(rank) == 0:
            out.append(f"  rank {rank} finished the script: nobody answers the others")
        else:
            out.append(f"  rank {rank} stopped: no line recorded")
    return out


class Check:
    """One check: the pair of runs (tools/check/harness.py), the script's source, the chapter's
    own train.py, and whether the stop-and-resume (or restart) check runs."""

    def __init__(self, pair: Pair, source: str, resume: bool):
        self.pair, self.source, self.resume = pair, source, resume
        self.plan, self.script, self.nproc = pair.plan, pair.script, pair.nproc
        self.theirs = (REPO / CHAPTERS[self.plan.chapter] / "train.py").read_text()

    def near(self, facts: gather.Facts, kind: str | None) -> str | None:
        return mistakes.nearest_line(facts, self.source, shown(self.script), self.theirs, kind)


def resumed_run(c: Check) -> Run:
    """Stopped at the plan's step, then resumed to the end: the resumed run, or the failed one
    where the catalogue names its failure."""
    _, resumed = c.pair.resumed()
    if resumed.status != 0 and known_failure(failure_line(resumed, c.script)) is None:
        raise CannotRun(
            f"the resume check failed: {failure_line(resumed, c.script)} (see {shown(resumed.log)})"
        )
    return resumed


def restart_check(c: Check, ref: Run) -> str | None:
    """Kill rank 1 after step 6 (checkpoint at step 4); torchrun restarts the group, which must
    continue from the checkpoint to the reference's end. None: it did."""
    env = (*c.pair.launch.env, ("CHECK_KILL", f"1:{RESTART_KILL}"))
    # as chapter 06 teaches restarts: under c10d, a fresh store for every attempt
    env = (*env, ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"))
    extra = ("--max-restarts=1",)
    launch = Launch(c.nproc, c.plan.nodes, env, extra, torchrun=True, rdzv_id="check-restart")
    run = c.pair.run("restarted", launch, eval_interval=RESTART_EVAL)
    if run.status == 0 and not any(r.get("restart") for r in run.ranks()):
        return "rank 1 was killed, yet the run ended without a restart"
    if run.status != 0:
        return f"after the restart: {failure_line(run, c.script)}"
    diff = gather.first_diff(run.losses(), ref.losses())
    if diff is not None:
        return f"the restarted run's loss differs from step {diff}"
    if gather.relative_distance(run.params(), ref.params()) > gather.RTOL:
        return f"the restarted run ends with other parameters than {c.plan.against}'s"
    return None


def hung(c: Check, run: Run, failure: str | None, stopped: gather.Facts) -> int:
    """The ranks hang in collectives that do not match, or gloo saw them not match and ended the
    run (where NCCL would hang): each rank's line, and the plan's hang entry."""
    if run.hangs():
        print("not the same run: the ranks hang, each waiting for the others in a collective")
        print(*hang_report(run, c.script, c.source, c.nproc), sep="\n")
        print(
            "  nothing is known to differ: the run was stopped at the hang "
            f"(the whole output: {shown(run.log)})"
        )
    else:
        print(
            "not the same run: the ranks' collectives do not match (gloo saw it and ended the "
            "run; on GPUs, NCCL's ranks would wait for each other forever)"
        )
        print(f"  {failure}")
        print(f"  (the whole output: {shown(run.log)})")
    hang = next(m for m in MISTAKES if m.kind == "hang" and fits(m, stopped))
    print(f"diagnosis: {hang.name}: {hang.did}")
    if not run.hangs():
        near = c.near(stopped, None)
        if near is not None:
            print(f"  {near}")
    return 1


def failed_early(c: Check, run: Run, when: str = "it stopped before step 1") -> int:
    """The run logged no step: a known failure is a diagnosis, any other cannot be compared."""
    failure = failure_line(run, c.script)
    known = known_failure(failure)
    if known is None:
        raise CannotRun(f"{failure} (the whole output: {shown(run.log)})")
    print(f"not the same run: {when}: {failure}")
    print(f"diagnosis: {known.name}: {known.did}")
    near = c.near(gather.Facts(plan=c.plan).but(failure=failure), known.kind)
    if near is not None:
        print(f"  {near}")
    return 1


def verdict(c: Check, run: Run, ref: Run, args) -> int:
    failure = failure_line(run, c.script) if run.status != 0 else None
    stopped = gather.Facts(plan=c.plan).but(hung=bool(run.hangs()), failure=failure)
    if run.status != 0 and mistakes.mismatched(stopped):
        return hung(c, run, failure, stopped)
    if not run.losses():
        return failed_early(c, run)
    facts = gather.gather(c.plan, c.nproc, run, ref, failure)
    first = first_difference(run, ref)
    resumed = None
    restarted = False
    # the stop and the resume (or the restart) are checked on a run whose plain part is right
    if first is None and run.status == 0 and c.resume and c.plan.restart:
        facts = gather.with_restart(facts, restart_check(c, ref))
        restarted = True
    elif first is None and run.status == 0 and c.resume:
        resumed = resumed_run(c)
        if resumed.status != 0:
            return failed_early(c, resumed, when="the resumed run failed")
        facts = gather.with_resume(facts, run, resumed, ref)
        first = first_difference(resumed, ref, offset=c.plan.resume_at)
    (c.pair.folder / "facts.json").write_text(json.dumps(asdict(facts), indent=1))
    if args.facts:
        print(json.dumps(asdict(facts), indent=1))
    seen = Seen(facts, run, ref, resumed, failure, restarted)
    if mistakes.same_run(facts):
        print(*same_lines(seen), sep="\n")
    else:
        facts_file = shown(c.pair.folder / "facts.json")
        said = different_lines(seen, c.source, shown(c.script), c.theirs, facts_file, first)
        print(*said, sep="\n")
    if not args.no_plot:
        png = c.pair.folder / "losses.png"
        drawn = plot(png, seen, f"{shown(c.script)} against {c.plan.against}")
        print(f"plot: {shown(png)}" if drawn else "plot: none (matplotlib is not installed)")
    return 0 if mistakes.same_run(facts) else 1


def tidy(folder: Path) -> None:
    """Keep what a learner looks at (logs, metrics, facts, the plot): the checkpoints and the
    parameter files, 100 MB a check, are deleted once compared."""
    for path in folder.rglob("*.pt"):
        path.unlink(missing_ok=True)


def check(args) -> int:
    plan, nproc, source = planned(args)
    script = Path(args.script)
    against = plan.against
    if plan.reference == plan.chapter:  # its run is not chapter 01's
        against = f"chapter {plan.chapter:02d}'s own train.py, run the same way"
    shape = plan.shape(nproc)
    print(f"checking {shown(script)} as chapter {plan.chapter:02d} ({shape}) against {against}")
    pair, ref = pair_of(script, plan.chapter, nproc, Path(args.out_root))
    print(
        f"  float64, tiny model, 8 steps over 3 epochs of a small corpus; in {shown(pair.folder)}/"
    )
    c = Check(pair, source, not args.no_resume)
    run = pair.run("run")
    try:
        return verdict(c, run, ref, args)
    finally:
        tidy(pair.folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("script", help="your copy of a chapter's train.py")
    p.add_argument(
        "--nproc-per-node", type=int, default=1, help="ranks (under torchrun when more than 1)"
    )
    p.add_argument(
        "--chapter", type=int, default=None, help="the chapter whose flags the script takes"
    )
    p.add_argument("--out-root", default=str(REPO / "out" / "check"), help="where the runs go")
    p.add_argument(
        "--no-resume", action="store_true", help="skip the stop-and-resume (06: restart) check"
    )
    p.add_argument("--no-plot", action="store_true", help="draw no plot")
    p.add_argument(
        "--facts", action="store_true", help="print the facts the diagnosis is made from"
    )
    args = p.parse_args(argv)
    try:
        return check(args)
    except CannotRun as err:
        print(f"could not run the script: {err}")
        return 2
    except KeyboardInterrupt:
        print("stopped (Ctrl-C)")
        return 130


if __name__ == "__main__":
    sys.exit(main())
