"""The parity harness: a script run beside its reference, compared step by step and rank by rank.

For every optimizer step and rank, in the order a step computes them: the windows read, the logged
loss, the learning rate, the gradient norm and the parameters; then the validation loss and every
rank's final parameters. The first quantity that differs (its step and rank) is the answer; None:
the same run. The tests call `parity()`; `python -m tools.check` adds a diagnosis on top.
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common.chapters import CHAPTERS
from tools.check.reference import (
    PLANS,
    CannotRun,
    Launch,
    Plan,
    Run,
    checked_launch,
    failure_line,
    prepared_corpus,
    reference_run,
    run_flags,
    run_one,
)
from tools.launch import REPO

# float64: runs that take the same steps agree to about 1e-15; the order of additions differs
# between the chapters (micro-batches, ranks), so allow a little more, still far below float32's
# rounding (1e-7) and any real difference
LOSS_RTOL, RTOL = 1e-10, 1e-9


def differs(a, b, rtol: float = RTOL) -> bool:
    """Numbers, or lists of them (a parameter checksum), further apart than rtol; None differs
    from anything but None."""
    if a is None or b is None:
        return a is not b
    if isinstance(a, list):
        return len(a) != len(b) or any(differs(x, y, rtol) for x, y in zip(a, b))
    return abs(a - b) > rtol * abs(b)


def relative_distance(a, b) -> float:
    """|a - b| / |b| of two parameter vectors; inf where one is missing or the shapes differ."""
    if a is None or b is None or a.shape != b.shape:
        return math.inf
    return ((a - b).norm() / b.norm()).item()


@dataclass(frozen=True)
class Difference:
    """The first quantity that differs: at optimizer step `step` (from 1; the validation loss and
    the final parameters after the last step), on `rank` (None: every rank's together)."""

    quantity: str
    step: int
    rank: int | None
    mine: object = None
    theirs: object = None

    def words(self, against: str) -> str:
        who = "" if self.rank is None else f" on rank {self.rank}"
        said = f"the first difference: the {self.quantity} at step {self.step}{who}"
        if isinstance(self.mine, float) and isinstance(self.theirs, float):
            said += f": {self.mine:.10g} here, {self.theirs:.10g} in {against}"
            if self.theirs:
                said += f" (ratio {self.mine / self.theirs:.10g})"
        return said


def ranks_steps(run: Run) -> list[list[dict]]:
    return [r["steps"] for r in run.ranks()]


def windows_of(ranks_steps: list[list[dict]], i: int) -> list[int]:
    """Every rank's windows of step i (from 0), together, sorted."""
    return sorted(w for steps in ranks_steps for w in steps[i]["windows"])


def together(steps: list[list[dict]], i: int) -> list[int] | None:
    """windows_of, or None where a rank did not take step i."""
    if any(i >= len(s) for s in steps):
        return None
    return windows_of(steps, i)


def first_difference(run: Run, ref: Run, offset: int = 0) -> Difference | None:
    """The first quantity of `run` that is not `ref`'s. `offset`: the steps `run` did not take (a
    resumed run's probe starts at step offset + 1; its metrics hold every step)."""
    mine, theirs = ranks_steps(run), ranks_steps(ref)
    if not mine or not theirs:
        return Difference("steps", offset + 1, None)
    losses, ref_losses = run.losses(), ref.losses()
    same_layout = len(mine) == len(theirs)  # chapter 08's: against its own run, rank by rank
    last = max(offset + max(map(len, mine)), len(theirs[0]))
    for step in range(offset + 1, last + 1):
        i = step - 1 - offset
        wanted = together(theirs, step - 1)
        read = together(mine, i)
        if read is None or wanted is None:  # a step one of the runs (or a rank) did not take
            rank = next((r for r, s in enumerate(mine) if i >= len(s)), None)
            return Difference("optimizer steps", step, rank)
        if read != wanted:
            batch = set(wanted)
            rank = next((r for r, s in enumerate(mine) if not set(s[i]["windows"]) <= batch), None)
            return Difference("windows", step, rank)
        if differs(losses.get(step), ref_losses.get(step), LOSS_RTOL):
            return Difference("loss", step, 0, losses.get(step), ref_losses.get(step))
        for rank, steps in enumerate(mine):
            other = theirs[rank if same_layout else 0][step - 1]
            for quantity, key in (
                ("learning rate", "lr"),
                ("gradient norm", "grad_norm"),
                ("parameters", "checksum"),
            ):
                a, b = steps[i].get(key), other.get(key)
                if differs(a, b):
                    return Difference(quantity, step, rank, a, b)
    vals, ref_vals = run.column("val_loss"), ref.column("val_loss")
    for step in sorted(s for s in set(vals) | set(ref_vals) if s > offset):
        if differs(vals.get(step), ref_vals.get(step), LOSS_RTOL):
            return Difference("validation loss", step, 0, vals.get(step), ref_vals.get(step))
    return final_params(run, ref, last, same_layout, len(mine))


def final_params(run: Run, ref: Run, last: int, same_layout: bool, ranks: int):
    """Every rank's parameters at the end, whole, against the reference's."""
    for rank in range(ranks):
        distance = relative_distance(run.params(rank), ref.params(rank if same_layout else 0))
        if distance > RTOL:
            return Difference("final parameters", last, rank)
    return None


def fresh_folder(root: Path, script: Path) -> Path:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{script.resolve().parent.name}_{script.stem}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{stem}_{stamp}_", dir=root))


@dataclass(frozen=True)
class Pair:
    """A script and its reference: the plan, the ranks, the flags, where the runs go."""

    script: Path
    plan: Plan
    nproc: int
    folder: Path
    corpus: Path
    data: Path
    more: tuple[tuple[str, object], ...] = ()  # flags beyond the plan's (batch_size=4, ...)

    @property
    def launch(self) -> Launch:
        return checked_launch(self.plan, self.nproc)

    def flags(self, out: str, iters: int | None = None, **more) -> list[str]:
        values = self.plan.split(self.nproc) | self.plan.extra_flags() | dict(self.more) | more
        if iters is not None:
            values["iters"] = iters
        return run_flags(self.corpus, self.data, self.folder / out, **values)

    def run(self, name: str, launch: Launch | None = None, **more) -> Run:
        return run_one(
            self.script, launch or self.launch, self.flags(name, **more), self.folder, name
        )

    def resumed(self) -> tuple[Run, Run]:
        """(the run stopped after the plan's resume_at step, the same run resumed to the end)."""
        first = self.run("resumed", iters=self.plan.resume_at)
        if first.status != 0:
            return first, first
        return first, self.run("resumed", resume=True)


def pair_of(script: Path, chapter: int, nproc: int, root: Path, **more) -> tuple[Pair, Run]:
    """The pair for a script checked as `chapter` with nproc ranks, and the reference's run."""
    plan = PLANS[chapter]
    corpus_file, data, corpus = prepared_corpus(root)
    if more and plan.reference == plan.chapter:
        raise CannotRun(f"chapter {chapter:02d} is compared with its own run: no other flags")
    folder = fresh_folder(root, script)
    ref = reference_run(root, corpus_file, data, corpus, plan, nproc)
    return Pair(script, plan, nproc, folder, corpus_file, data, tuple(more.items())), ref


def parity(
    script: Path | str,
    chapter: int | None = None,
    nproc: int = 1,
    root: Path | None = None,
    resume: bool = False,
    **more,
) -> Difference | None:
    """Run `script` (a chapter's train.py, or a copy checked as `chapter`) beside its reference:
    the first difference, None where it is the same run. `resume`: stopped after the plan's
    resume_at step and resumed, too. `more`: the script's own flags (batch_size=2, grad_accum=4)
    within the global batch of 8. A run that fails is its failure line, as a CannotRun."""
    script = Path(script)
    if chapter is None:
        folders = {REPO / name: n for n, name in CHAPTERS.items()}
        if script.resolve().parent not in folders:
            raise CannotRun(f"{script} is in no chapter's folder: give chapter=N")
        chapter = folders[script.resolve().parent]
    pair, ref = pair_of(script, chapter, nproc, Path(root or REPO / "out" / "check"), **more)
    run = pair.run("run")
    if run.status != 0:
        raise CannotRun(f"{failure_line(run, script)} (see {run.log})")
    found = first_difference(run, ref)
    if found is not None or not resume:
        return found
    _, resumed = pair.resumed()
    if resumed.status != 0:
        raise CannotRun(f"the resumed run: {failure_line(resumed, script)} (see {resumed.log})")
    return first_difference(resumed, ref, offset=pair.plan.resume_at)
