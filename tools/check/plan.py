"""What the check does for each chapter: the one table that knows the chapters apart.

Every other part of the checker asks the plan, never the chapter's number: how many ranks and
nodes, what the probe stands in for on a CPU, whether a stopped run is resumed or a killed rank is
restarted, and what the check cannot observe there.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        return {"dist_timeout": 60} if self.distributed else {}

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
        return text

    def checked_more(self, restarted: bool) -> list[str]:
        """What a "same run" verdict adds, beyond the losses and the parameters."""
        said = []
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
        return out


PLANS = {
    1: Plan(1, accumulates=False),
    2: Plan(2),
    3: Plan(3, replicas=REPLICAS),
    4: Plan(4, distributed=True, picks_gpu=True),
    5: Plan(5, distributed=True, nodes=2, picks_gpu=True),
    6: Plan(6, distributed=True, nodes=2, restart=True, picks_gpu=True),
    7: Plan(7, distributed=True, shards=True, picks_gpu=True),
}
