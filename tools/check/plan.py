"""What the check does for each chapter: the one table that knows the chapters apart.

Every other part of the checker asks the plan, never the chapter's number: how many ranks and
nodes, which run the script is compared with (chapter 01's, or the chapter's own), the chapter's
own flags, what the probe stands in for on a CPU, whether a stopped run is resumed or a killed rank
is restarted, and what the check cannot observe there.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.chapters import NOT_CHAPTER_01S_RUN

STEPS, RESUME_AT, GLOBAL_BATCH = 8, 5, 8
SEED = 1337  # every run's --seed: epoch e visits the windows in randperm(N) drawn with SEED + e
REPLICAS = 2  # chapter 03: the stand-in replicas DataParallel splits each batch over
# chapter 06: the restart check checkpoints at step 4, kills rank 1 after step 6; torchrun restarts
RESTART_EVAL, RESTART_KILL = 4, 6


@dataclass(frozen=True)
class Plan:
    chapter: int
    accumulates: bool = True  # the script takes --grad-accum
    distributed: bool = False  # torchrun's ranks: --nproc-per-node, --dist-timeout
    nodes: int = 1  # started as this many torchruns that meet as nodes
    replicas: int = 0  # DataParallel's batches split over this many stand-in replicas
    shards: bool = False  # the ranks' parameters must be FSDP's shards
    restart: bool = False  # after the plain run: a killed rank restarted, not a stop and resume
    # the ranks choose a GPU by their local rank (read from the script, though a CPU drives none)
    picks_gpu: bool = False
    # DiLoCo: the ranks' copies train apart and meet at a sync every --sync-every steps
    rounds: bool = False
    # the chapter's own flags, given to the checked run and to its reference alike
    flags: tuple[tuple[str, int | float], ...] = ()
    resume_at: int = RESUME_AT  # the stop-and-resume check stops after this step

    @property
    def reference(self) -> int:
        """The chapter whose train.py makes the run compared with: chapter 01, in one process with
        the global batch of 8; a chapter whose run is not chapter 01's (NOT_CHAPTER_01S_RUN) is
        compared with its own train.py, run as the check runs the script (ranks, flags)."""
        return self.chapter if self.chapter in NOT_CHAPTER_01S_RUN else 1

    @property
    def against(self) -> str:
        """The reference's name in the check's sentences: "chapter 01", "chapter 08"."""
        return f"chapter {self.reference:02d}"

    def nproc(self, asked: int) -> int:
        """The ranks the check runs: two nodes of the same size where the plan has two."""
        if asked % self.nodes:
            return asked * self.nodes
        return asked

    def split(self, nproc: int) -> dict[str, int]:
        """The script's flags for a global batch of 8: K > 1 wherever the chapter accumulates."""
        if not self.accumulates:
            return {"batch_size": GLOBAL_BATCH}
        per_rank = GLOBAL_BATCH // nproc
        batch = 2 if per_rank >= 2 else 1
        return {"batch_size": batch, "grad_accum": per_rank // batch}

    def env(self) -> tuple[tuple[str, str], ...]:
        """What the probe stands in for: the CPU has no GPUs for DataParallel to split over."""
        return (("CHECK_REPLICAS", str(self.replicas)),) if self.replicas else ()

    def extra_flags(self) -> dict:
        # a hang ends by the script's own timeout at the latest
        timeout = {"dist_timeout": 60} if self.distributed else {}
        return timeout | dict(self.flags)

    def flag_words(self) -> str:
        """The chapter's own flags as a command line has them: "--sync-every 3 ..."."""
        return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in self.flags)

    def shape(self, nproc: int) -> str:
        """How the run is laid out, in words: ranks, micro-batches, stand-ins."""
        split = self.split(nproc)
        if not self.accumulates:
            return f"--batch-size {split['batch_size']}"
        text = f"{split['grad_accum']} micro-batch(es) x {split['batch_size']}"
        if self.nodes > 1:
            text = f"{self.nodes} nodes x {nproc // self.nodes} rank(s) x {text}"
        elif self.distributed:
            text = f"{nproc} rank(s) x {text}"
        if self.replicas:
            text += f", DataParallel split over {self.replicas} stand-in replicas"
        if self.flags:
            text += f", {self.flag_words()}"
        return text

    def checked_more(self, restarted: bool) -> list[str]:
        """What a "same run" verdict adds, beyond the losses and the parameters."""
        said = []
        if self.reference == self.chapter:
            said.append(
                f"against chapter {self.chapter:02d}'s own train.py, run the same way (its run is "
                "not chapter 01's): rank 0's copy after every step, between the syncs too, and "
                "the ranks' copies equal wherever its are"
            )
        if self.replicas:
            said.append(
                f"DataParallel's batches split over {self.replicas} replicas: the same losses"
            )
        if restarted:
            said.append(
                f"as {self.nodes} nodes; rank 1 killed after step {RESTART_KILL}, torchrun "
                f"restarted the group, and it continued from step {RESTART_EVAL}'s checkpoint to "
                "the same end"
            )
        return said

    def unchecked(self, gpus: str) -> list[str]:
        """What the check cannot observe on a CPU for this chapter: every "same run" names it
        (`gpus`: what it could not see of the GPUs the ranks choose, in words)."""
        out = ["speed and memory (the check runs on CPUs, in float64)"]
        if self.replicas:
            out.append("DataParallel's real scatter over GPUs (stand-in replicas share one model)")
        if self.picks_gpu:
            out.append(gpus)
        if self.distributed:
            out.append("NCCL: the ranks talk over gloo on 127.0.0.1")
        if self.flags:
            out.append(f"the chapter's flags at other values than {self.flag_words()}")
        return out


PLANS = {
    1: Plan(1, accumulates=False),
    2: Plan(2),
    3: Plan(3, replicas=REPLICAS),
    4: Plan(4, distributed=True, picks_gpu=True),
    5: Plan(5, distributed=True, nodes=2, picks_gpu=True),
    6: Plan(6, distributed=True, nodes=2, restart=True, picks_gpu=True),
    7: Plan(7, distributed=True, shards=True, picks_gpu=True),
    # four syncs in 8 steps (after steps 2, 4, 6, 8) with the outer momentum on, as the DiLoCo
    # paper has it: an outer step that is no plain average. A round of 2 steps is not an epoch
    # of 3: a sync's mistake first shows inside an epoch. A run's last step is a sync, so a run
    # stopped by --max-iters ends with one: the stop (after step 4, inside epoch 1) is at a sync
    # the uninterrupted run has too
    8: Plan(
        8,
        distributed=True,
        picks_gpu=True,
        rounds=True,
        flags=(("sync_every", 2), ("outer_lr", 0.7), ("outer_momentum", 0.9)),
        resume_at=4,
    ),
}
