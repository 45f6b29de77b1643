"""What the comparison of a run with chapter 01's found, in small groups: each a frozen dataclass,
computed where it is defined (`of`). Steps count from 1. The catalogue (tools/check/mistakes.py)
reads these facts; nothing changes them once computed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace

from tools.check.harness import LOSS_RTOL, RTOL, differs, relative_distance, windows_of
from tools.check.reference import GLOBAL_BATCH, SEED, STEPS, Plan, Run


def rel_diff(a: float | None, b: float | None) -> float | None:
    """|a / b - 1|; None where either is missing."""
    if a is None or b is None or not b:
        return None
    return abs(a / b - 1)


def first_diff(run: dict[int, float], ref: dict[int, float], after: int = 0, rtol=LOSS_RTOL):
    """The first step after `after` where the two columns differ (a missing row differs)."""
    for step in sorted(set(ref) | set(run)):
        if step > after and differs(run.get(step), ref.get(step), rtol):
            return step
    return None


def first_step_diff(steps: list[dict], ref_steps: list[dict], key: str, offset: int = 0):
    """The first optimizer step (numbered as chapter 01's) whose `key` differs."""
    for i, step in enumerate(steps):
        if offset + i >= len(ref_steps) or differs(step.get(key), ref_steps[offset + i].get(key)):
            return offset + i + 1
    return None


def lr_speed(lrs: dict[int, float], ref_lrs: dict[int, float]) -> int | None:
    """k > 1 if the logged lr of every step s is chapter 01's of step (s - 1) * k + 1."""
    for k in range(2, STEPS + 1):
        pairs = [(s, (s - 1) * k + 1) for s in lrs if (s - 1) * k + 1 in ref_lrs]
        if len(pairs) >= 2 and all(not differs(lrs[s], ref_lrs[t], 1e-9) for s, t in pairs):
            if any(s != t for s, t in pairs):
                return k
    return None


def reference_steps(ref: Run) -> list[dict]:
    """The reference's steps as rank 0 took them, each with the windows that every rank of the
    reference read in it (chapter 01's one process: its own)."""
    ranks_steps = [r["steps"] for r in ref.ranks()]
    return [step | {"windows": windows_of(ranks_steps, i)} for i, step in enumerate(ranks_steps[0])]


def unlike_rank0(ranks_steps: list[list[dict]], i: int, key: str) -> list[int]:
    """The ranks whose checksum `key` of step i (from 0) is not rank 0's."""
    sums = [steps[i].get(key) if i < len(steps) else None for steps in ranks_steps]
    return [r for r, s in enumerate(sums) if s != sums[0]]


ORDERS = 64  # the seeds SEED + k that epoch_order tries


def epoch_order(ranks_steps: list[list[dict]], steps: range, windows: int) -> int | None:
    """k where these steps (one epoch's) read the sampler's order of epoch k: randperm(windows)
    drawn with SEED + k, the global batch's 8 windows a step, in turn; None: no k < ORDERS."""
    import torch

    wanted = [windows_of(ranks_steps, s) for s in steps]
    for k in range(ORDERS):
        order = torch.randperm(windows, generator=torch.Generator().manual_seed(SEED + k)).tolist()
        batches = [order[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH] for i in range(len(steps))]
        if all(sorted(b) == w for b, w in zip(batches, wanted)):
            return k
    return None


@dataclass(frozen=True)
class Logged:
    """What metrics.jsonl and the log say, against chapter 01's."""

    logged_steps: int = 8  # training-loss rows in metrics.jsonl
    first_loss_diff: int | None = None  # the first step whose logged loss differs
    loss_ratio_at_1: float = 1.0  # the script's logged loss at step 1 / chapter 01's
    loss_rel_diff: float | None = None  # |loss / chapter 01's - 1| at first_loss_diff
    first_lr_diff: int | None = None  # the first logged step whose learning rate differs
    # the logged lr of step s is chapter 01's of step (s - 1) * lr_speed + 1 (None: no such number)
    lr_speed: int | None = None
    first_val_diff: int | None = None  # the first step whose validation loss differs
    stopped_after: int | None = None  # the script failed after this many logged steps
    failure: str | None = None  # the line that says why the run failed
    hung: bool = False  # the ranks waited in collectives that do not match
    # what the script printed ("N steps per epoch"), None if not found
    script_steps_per_epoch: int | None = None

    @classmethod
    def of(cls, run: Run, ref: Run, failure: str | None) -> Logged:
        losses, ref_losses = run.losses(), ref.losses()
        lrs, ref_lrs = run.column("lr"), ref.column("lr")
        vals, ref_vals = run.column("val_loss"), ref.column("val_loss")
        found = re.search(r"(\d+) steps per epoch", run.output())
        first_loss = first_diff(losses, ref_losses)
        return cls(
            logged_steps=len(losses),
            first_loss_diff=first_loss,
            loss_rel_diff=rel_diff(losses.get(first_loss), ref_losses.get(first_loss)),
            loss_ratio_at_1=losses[1] / ref_losses[1] if 1 in losses else math.nan,
            first_lr_diff=first_diff(lrs, ref_lrs, rtol=RTOL),
            lr_speed=lr_speed(lrs, ref_lrs),
            first_val_diff=first_diff(vals, ref_vals),
            stopped_after=None if run.status == 0 and len(losses) == STEPS else len(losses),
            failure=failure,
            script_steps_per_epoch=int(found.group(1)) if found else None,
        )


@dataclass(frozen=True)
class Data:
    """The training windows every rank read, against chapter 01's."""

    steps_per_epoch: int = 3  # chapter 01's
    first_data_diff: int | None = None  # the first step whose windows (all ranks) differ
    rank0_reads_its_share: bool = True  # rank 0 read only windows of chapter 01's batch in epoch 0
    ranks_overlap: bool = False  # two ranks read the same window in epoch 0
    repeats_first_epoch: bool = False  # the second epoch's first step read epoch 0's first windows
    ranks_same_windows: bool = False  # every rank read the same windows at step 1
    # epoch e of the run read the sampler's order of epoch epoch_orders[e] (None: of none);
    # chapter 01's: 0, 1, 2
    epoch_orders: tuple[int | None, ...] = (0, 1, 2)
    train_windows: int = 29  # the windows of the training split, which each epoch permutes
    # in the first step whose windows differ: (the rank, its micro-batch from 1) that first read a
    # window outside chapter 01's step; None: no micro-batches, or no such step
    first_data_micro: tuple[int, int] | None = None

    @classmethod
    def of(
        cls,
        ranks_steps: list[list[dict]],
        ref_steps: list[dict],
        per_epoch: int,
        micro: int,
        windows: int,
    ) -> Data:
        """`micro`: the windows of one micro-batch (--batch-size); `windows`: those of the
        training split."""
        if not any(step["windows"] for steps in ranks_steps for step in steps):
            # the script reads its data some other way than common.data: no facts about the data
            return cls(
                per_epoch, None, False, False, False, False, epoch_orders=(), first_data_micro=None
            )
        done = min(map(len, ranks_steps), default=0)
        first = next(
            (
                s + 1
                for s in range(min(done, len(ref_steps)))
                if windows_of(ranks_steps, s) != sorted(ref_steps[s]["windows"])
            ),
            None,
        )
        if first is None and done < max(map(len, ranks_steps)) and done < len(ref_steps):
            first = done + 1  # a rank took fewer steps than another: it read nothing there
        rank0 = ranks_steps[0]
        epoch0 = [{w for st in steps[:per_epoch] for w in st["windows"]} for steps in ranks_steps]
        firsts = [steps[0]["windows"] if steps else [] for steps in ranks_steps]
        return cls(
            steps_per_epoch=per_epoch,
            first_data_diff=first,
            rank0_reads_its_share=all(
                set(rank0[s]["windows"]) <= set(ref_steps[s]["windows"])
                for s in range(min(len(rank0), per_epoch))
            ),
            ranks_overlap=any(a & b for i, a in enumerate(epoch0) for b in epoch0[i + 1 :]),
            repeats_first_epoch=done > per_epoch
            and windows_of(ranks_steps, per_epoch) == windows_of(ranks_steps, 0),
            ranks_same_windows=len(firsts) > 1
            and all(firsts)
            and all(f == firsts[0] for f in firsts),
            epoch_orders=tuple(
                epoch_order(ranks_steps, range(e, min(e + per_epoch, done)), windows)
                for e in range(0, done, per_epoch)
            ),
            train_windows=windows,
            first_data_micro=first_outside(ranks_steps, ref_steps, first, micro),
        )


def first_outside(ranks_steps, ref_steps, step: int | None, micro: int) -> tuple[int, int] | None:
    """(rank, micro-batch from 1) of the first micro-batch in `step` (from 1) that read a window
    outside chapter 01's step, in micro-batch order, then rank order; None where a step is a
    single batch."""
    if step is None or step > len(ref_steps) or not micro:
        return None
    wanted = set(ref_steps[step - 1]["windows"])
    reads = [steps[step - 1]["windows"] if len(steps) >= step else [] for steps in ranks_steps]
    if max(map(len, reads), default=0) <= micro:
        return None  # one micro-batch a step: nothing to tell apart
    for m in range(max(map(len, reads)) // micro):
        for rank, read in enumerate(reads):
            if not set(read[m * micro : (m + 1) * micro]) <= wanted:
                return rank, m + 1
    return None


@dataclass(frozen=True)
class Gradients:
    """Rank 0's optimizer steps: gradients, parameters, zero_grad, the sync switch."""

    grad_accum: int = 2  # K: micro-batches per optimizer step on each rank
    grad_ratio_at_1: float | None = 1.0  # the gradient norm (before clipping) at step 1 / ch. 01's
    first_grad_diff: int | None = None  # the first step whose gradient norm differs
    grad_rel_diff: float | None = None  # |norm / chapter 01's - 1| at first_grad_diff
    first_param_diff: int | None = None  # the first step after which the parameters differ
    params_equal: bool = True  # the final parameters equal chapter 01's
    optimizer_steps: int = 8  # optimizer.step() calls on rank 0
    zero_grads_per_step: int = 1  # the most zero_grad calls between two optimizer steps
    # a step whose last micro-step did not reduce the gradients while another did
    last_micro_step_unsynced: bool = False
    distance: float = 0.0  # the final parameters' relative distance to chapter 01's

    @classmethod
    def of(cls, rank0: list[dict], ref_steps: list[dict], run: Run, ref: Run, k: int) -> Gradients:
        distance = relative_distance(run.params(), ref.params())
        ref_norm = ref_steps[0]["grad_norm"]
        first_param = first_step_diff(rank0, ref_steps, "checksum")
        if first_param is None and distance > RTOL:
            first_param = len(rank0) or STEPS
        syncs = [s.get("syncs") or [] for s in rank0]
        first_grad = first_step_diff(rank0, ref_steps, "grad_norm")
        grad_rel = None
        if first_grad is not None and first_grad <= min(len(rank0), len(ref_steps)):
            grad_rel = rel_diff(
                rank0[first_grad - 1]["grad_norm"], ref_steps[first_grad - 1]["grad_norm"]
            )
        return cls(
            grad_accum=k,
            grad_ratio_at_1=rank0[0]["grad_norm"] / ref_norm if rank0 and ref_norm else None,
            first_grad_diff=first_grad,
            grad_rel_diff=grad_rel,
            first_param_diff=first_param,
            params_equal=distance <= RTOL,
            optimizer_steps=len(rank0),
            zero_grads_per_step=max((s["zero_grads"] for s in rank0[1:]), default=0),
            last_micro_step_unsynced=any(f and not f[-1] and any(f) for f in syncs),
            distance=distance,
        )


@dataclass(frozen=True)
class Ranks:
    """The ranks against each other: their copies, what they did, the GPU each asked for."""

    world_size: int = 2
    # the first step after which a rank's copy differs from rank 0's where the reference's copies
    # are equal (chapter 01's, one copy: always; chapter 08's: at each sync); 0: before step 1
    ranks_drift_from: int | None = None
    drifting: tuple[int, ...] = ()  # the ranks whose copies differ from rank 0's there
    ranks_clip_differ: bool = False  # some ranks clipped the gradient and others did not
    ranks_steps_differ: bool = False  # the ranks took different numbers of optimizer steps
    sharded: bool = False  # the optimizer's parameters are FSDP's shards (DTensors)
    fsdp_forwards: bool = False  # a module sharded by fully_shard ran forward
    replicas: int | None = None  # DataParallel's stand-in replicas used (0: never; None: no plan)
    # each rank: (its RANK, its LOCAL_RANK, the GPU index its device statement gives it, or None)
    devices: tuple[tuple[int, int, int | None], ...] = ()
    # the device statement the probe read the indices from: (its line, its code), None: none found
    device_statement: tuple[int, str] | None = None
    device_unread: str | None = None  # why a rank has no index: the probe's words
    # the data ranks that read windows outside the first differing step's batch
    data_ranks: tuple[int, ...] = ()

    @property
    def gpu_by_global_rank(self) -> bool:
        """A rank asked for the GPU of its global rank where that is not its local rank."""
        return any(i is not None and i == r != lr for r, lr, i in self.devices)

    @property
    def gpu_read(self) -> bool:
        """Every rank's GPU index was read from the script's device statement."""
        return bool(self.devices) and all(i is not None for _, _, i in self.devices)

    @classmethod
    def of(
        cls, run: Run, ref: Run, nproc: int, plan: Plan, first_data: int | None, ref_steps
    ) -> Ranks:
        ranks = run.ranks()
        ranks_steps = [r["steps"] for r in ranks]
        ref_ranks_steps = [r["steps"] for r in ref.ranks()]
        drift, drifting = None, []
        for step in range(1, min(map(len, ranks_steps), default=0) + 1):
            # the copies a step starts from (after a sync, chapter 08's), then the step's own
            for key, after in (("checksum_before", step - 1), ("checksum", step)):
                drifting = unlike_rank0(ranks_steps, step - 1, key)
                if drifting and not unlike_rank0(ref_ranks_steps, step - 1, key):
                    drift = after
                    break
            if drift is not None:
                break
        if drift is None:
            drifting = []
        if drift is None and ranks_steps:  # every rank's final copy, whole, against rank 0's
            import torch

            params = run.params()
            finals = [run.params(r) for r in range(len(ranks))]
            drifting = [
                r
                for r, p in enumerate(finals)
                if p is None or params is None or not torch.equal(p, params)
            ]
            drift = STEPS if drifting else None
        data_ranks = []
        if first_data is not None and all(len(s) >= first_data for s in ranks_steps):
            wanted = set(ref_steps[first_data - 1]["windows"])
            data_ranks = [
                r
                for r, steps in enumerate(ranks_steps)
                if not set(steps[first_data - 1]["windows"]) <= wanted
            ]
        clipped = [{s.get("clipped") for s in steps} for steps in ranks_steps]
        return cls(
            world_size=nproc,
            ranks_drift_from=drift,
            drifting=tuple(drifting),
            ranks_clip_differ=len({frozenset(c) for c in clipped}) > 1,
            ranks_steps_differ=len({len(steps) for steps in ranks_steps}) > 1,
            sharded=bool(ranks and ranks[0].get("sharded")),
            fsdp_forwards=bool(ranks and ranks[0].get("fsdp_forwards")),
            replicas=(ranks[0].get("replicated", 0) and plan.replicas)
            if plan.replicas and ranks
            else None,
            devices=tuple(
                (r["rank"], r.get("local_rank", r["rank"]), (r.get("device") or {}).get("index"))
                for r in ranks
            ),
            device_statement=next(
                ((d["line"], d["code"]) for r in ranks if (d := r.get("device"))), None
            ),
            device_unread=next(
                (
                    (r.get("device") or {}).get("error", "no statement that chooses a GPU index")
                    for r in ranks
                    if (r.get("device") or {}).get("index") is None
                ),
                None,
            ),
            data_ranks=tuple(data_ranks),
        )


@dataclass(frozen=True)
class Resume:
    """The run stopped after the plan's resume_at and resumed, or, where the plan says so, a rank
    killed and the group restarted."""

    resume_at: int | None = None  # where the resume check stopped and resumed; None: not run
    resume_diff: int | None = None  # the first step after resuming that differs
    resume_reads_steps: tuple[int, ...] = ()  # its first step read these steps' windows
    resume_first_data_diff: int | None = None
    resume_first_grad_diff: int | None = None
    resume_first_param_diff: int | None = None
    # the resumed run's first step starts from other parameters than the stopped run ended with
    resume_start_differs: bool = False
    restart: str | None = None  # what the killed-and-restarted run did wrong

    @classmethod
    def of(cls, resumed: Run, ref: Run, rank0: list[dict], per_epoch: int, at: int) -> Resume:
        """`at`: the step after which the run was stopped."""
        ref_steps = reference_steps(ref)
        diff = first_diff(resumed.losses(), ref.losses(), after=at)
        if diff is None and relative_distance(resumed.params(), ref.params()) > RTOL:
            diff = STEPS
        steps = [r["steps"] for r in resumed.ranks()]
        if not steps or not all(steps):
            return cls(resume_at=at, resume_diff=diff)
        mine = steps[0]
        # where the uninterrupted run's next step starts: after step `at`, and after its sync
        ended = rank0[at].get("checksum_before") if len(rank0) > at else None
        start = mine[0].get("checksum_before")
        first_read = {w for s in steps for w in s[0]["windows"]}
        epoch = at // per_epoch
        done = min(map(len, steps))
        return cls(
            resume_at=at,
            resume_diff=diff,
            resume_reads_steps=tuple(
                s + 1
                for s in range(epoch * per_epoch, (epoch + 1) * per_epoch)
                if s < len(ref_steps) and first_read & set(ref_steps[s]["windows"])
            ),
            resume_first_data_diff=next(
                (
                    at + i + 1
                    for i in range(done)
                    if at + i < len(ref_steps)
                    and windows_of(steps, i) != sorted(ref_steps[at + i]["windows"])
                ),
                None,
            ),
            resume_first_grad_diff=first_step_diff(mine, ref_steps, "grad_norm", offset=at),
            resume_first_param_diff=first_step_diff(mine, ref_steps, "checksum", offset=at),
            resume_start_differs=ended is not None
            and start is not None
            and any(differs(a, b, 1e-12) for a, b in zip(start, ended)),
        )


@dataclass(frozen=True)
class Syncs:
    """DiLoCo's syncs (chapter 08) on rank 0, against the reference's: the outer optimizer's steps
    (another optimizer than the training one, the probe's outer_steps) and where each round's
    copy starts from."""

    outer_steps: int = 0  # the outer optimizer's steps
    ref_outer_steps: int = 0  # the reference's
    first_sync: int | None = None  # the training step after which the reference first syncs
    # how far the first sync moved the copy (the sum of its parameters, from the first round's
    # start to the second's) as a multiple of the reference's: -1: as far the other way; 0: not
    sync_move_ratio: float | None = None
    # the second round starts where this copy ended the first: the copy was not reset
    kept_own_copy: bool = False

    @classmethod
    def of(cls, run: Run, ref: Run) -> Syncs:
        ref_outer = ref.ranks()[0].get("outer_steps") or []
        ranks = run.ranks()
        if not ref_outer or not ranks:
            return cls()
        outer = ranks[0].get("outer_steps") or []
        mine, theirs = ranks[0]["steps"], ref.ranks()[0]["steps"]
        h = ref_outer[0]["after"]
        ratio, kept = None, False
        if 0 < h < len(mine) and h < len(theirs):
            moved = mine[h]["checksum_before"][0] - mine[0]["checksum_before"][0]
            ref_moved = theirs[h]["checksum_before"][0] - theirs[0]["checksum_before"][0]
            ratio = moved / ref_moved if ref_moved else None
            kept = mine[h]["checksum_before"] == mine[h - 1].get("checksum")
        return cls(
            outer_steps=len(outer),
            ref_outer_steps=len(ref_outer),
            first_sync=h,
            sync_move_ratio=ratio,
            kept_own_copy=kept,
        )


GROUPS = {
    "log": Logged,
    "data": Data,
    "grads": Gradients,
    "ranks": Ranks,
    "resume": Resume,
    "syncs": Syncs,
}


@dataclass(frozen=True)
class Facts:
    plan: Plan
    log: Logged = field(default_factory=Logged)
    data: Data = field(default_factory=Data)
    grads: Gradients = field(default_factory=Gradients)
    ranks: Ranks = field(default_factory=Ranks)
    resume: Resume = field(default_factory=Resume)
    syncs: Syncs = field(default_factory=Syncs)

    def but(self, **changes) -> Facts:
        """These facts with some fields changed, each named alone (`first_loss_diff=1`): every
        field's name is unique over the groups."""
        groups = {}
        for name, value in changes.items():
            group = next(g for g, kind in GROUPS.items() if name in {f.name for f in fields(kind)})
            groups.setdefault(group, {})[name] = value
        return replace(self, **{g: replace(getattr(self, g), **c) for g, c in groups.items()})


def gather(plan: Plan, nproc: int, run: Run, ref: Run, failure: str | None) -> Facts:
    """The facts of a plain run (no resume yet) against chapter 01's."""
    ranks, ref_steps = run.ranks(), reference_steps(ref)
    ranks_steps = [r["steps"] for r in ranks]
    per_epoch = int(re.search(r"(\d+) steps per epoch", ref.output()).group(1))
    rank0 = ranks_steps[0] if ranks_steps else []
    split = plan.split(nproc)
    windows = max((r.get("train_windows", 0) for r in ranks), default=0)
    data = Data.of(ranks_steps, ref_steps, per_epoch, split["batch_size"], windows)
    k = split.get("grad_accum", 1)
    return Facts(
        plan=plan,
        log=Logged.of(run, ref, failure),
        data=data,
        grads=Gradients.of(rank0, ref_steps, run, ref, k),
        ranks=Ranks.of(run, ref, nproc, plan, data.first_data_diff, ref_steps),
        syncs=Syncs.of(run, ref),
    )


def with_resume(facts: Facts, run: Run, resumed: Run, ref: Run) -> Facts:
    rank0 = run.ranks()[0]["steps"] if run.ranks() else []
    per_epoch, at = facts.data.steps_per_epoch, facts.plan.resume_at
    return replace(facts, resume=Resume.of(resumed, ref, rank0, per_epoch, at))


def with_restart(facts: Facts, restart: str | None) -> Facts:
    return replace(facts, resume=Resume(restart=restart))
