"""How the check runs a script, and the run it compares it with.

The plan: what the check does for each chapter (the one table that knows the chapters apart). The
runner: a script started under the probe (tools/check/probe.py) as `python`, torchrun or two nodes,
and what it left (metrics, the probe's facts, its log). The reference: chapter 01's run (one
process, the global batch of 8) or, for a chapter whose run is not chapter 01's, its own train.py
run as the script is; made once per version of the course, kept under the check's root.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.chapters import CHAPTERS, NOT_CHAPTER_01S_RUN
from tools.launch import (
    REPO,
    child_env,
    flags,
    free_port,
    shown_command,
    start_together,
    torchrun_command,
    wait_together,
)

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


# ---- the runner ------------------------------------------------------------------------------

PROBE_MODULE = "tools.check.probe"
# a collective that waits this long while the other ranks wait in others is a hang (the run's
# --dist-timeout, 60 s, would end it anyway)
HANG_AFTER = 15
RUN_TIMEOUT = 600


class CannotRun(Exception):
    """The script (or the check itself) could not run: one line for the learner."""


def shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Launch:
    """How a script is started: ranks, as one node or two, under torchrun (a world of one too) or as
    `python`, the probe's stand-ins, torchrun's extra flags."""

    nproc: int
    nodes: int = 1
    env: tuple[tuple[str, str], ...] = ()
    torchrun_extra: tuple[str, ...] = ()
    torchrun: bool = False
    rdzv_id: str | None = None  # c10d's rendezvous (restarts need its fresh store), not static's

    def commands(self, probe_args: list[str]) -> list[list[str]]:
        if not self.torchrun and self.nodes == 1 and self.nproc == 1:
            return [[sys.executable, "-m", PROBE_MODULE, *probe_args]]
        port = free_port() if self.nodes > 1 else None
        return [
            torchrun_command(
                "-m",
                self.nproc // self.nodes,
                [PROBE_MODULE, *probe_args],
                nnodes=self.nodes,
                node_rank=node,
                port=port,
                extra=list(self.torchrun_extra),
                rdzv_id=self.rdzv_id,
            )
            for node in range(self.nodes)
        ]


@dataclass
class Run:
    out: Path  # the script's --out-dir
    facts: Path  # the probe's files, one pair per rank
    log: Path  # everything the run printed
    status: int

    def rows(self) -> list[dict]:
        """metrics.jsonl, every row."""
        path = self.out / "metrics.jsonl"
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows

    def column(self, name: str) -> dict[int, float]:
        return {row["iter"]: row[name] for row in self.rows() if name in row and "iter" in row}

    def losses(self) -> dict[int, float]:
        return self.column("loss")

    def ranks(self) -> list[dict]:
        files = [p for p in self.facts.glob("rank*.json") if p.stem[4:].isdigit()]
        files.sort(key=lambda p: int(p.stem[4:]))
        return [json.loads(p.read_text()) for p in files]

    def hangs(self) -> dict[int, dict]:
        found = {}
        for path in self.facts.glob("rank*.hang.json"):
            try:
                found[int(path.name[4:].split(".")[0])] = json.loads(path.read_text())
            except (ValueError, json.JSONDecodeError):
                continue
        return found

    def params(self, rank: int = 0):
        import torch

        path = self.facts / f"rank{rank}.pt"
        return torch.load(path, weights_only=True) if path.exists() else None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def finished_script(self, nproc: int) -> bool:
        """Every rank's script returned (the probe wrote status 0 for each)."""
        ranks = self.ranks()
        return len(ranks) == nproc and all(r.get("status") == 0 for r in ranks)


def run_one(script: Path, launch: Launch, args: list[str], folder: Path, name: str) -> Run:
    """The script run under the probe: every rank waited for (a hang ended), its status read."""
    run = Run(folder / name, folder / f"{name}_facts", folder / f"{name}.log", -1)
    commands = launch.commands([str(run.facts), str(script.resolve()), *args])
    # the CPU, even where GPUs are visible (chapter 03 would refuse --device cpu next to them)
    env = child_env(CUDA_VISIBLE_DEVICES="", **dict(launch.env))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if launch.nproc > 1:
        env["CHECK_HANG_AFTER"] = str(HANG_AFTER)
    with run.log.open("w") as out:
        for cmd in commands:
            out.write(f"$ {shown_command(cmd)}\n")
        out.flush()
        procs = start_together(commands, env, [out] * len(commands))
    run.status = wait_together(procs, RUN_TIMEOUT, give_up=lambda: end_hang(run, launch.nproc))
    if run.status not in (0, 124) and run.finished_script(launch.nproc):
        # every rank's script returned: what failed came after it (a process that aborted on its
        # way out of the interpreter), which is not the script's run
        with run.log.open("a") as log:
            log.write(f"check: exit status {run.status} after every rank's script had ended\n")
        run.status = 0
    return run


def end_hang(run: Run, nproc: int) -> bool:
    """Every rank has waited HANG_AFTER seconds in a collective: kill the ranks (they would wait
    until --dist-timeout) and say so."""
    hangs = run.hangs()
    if nproc < 2 or len(hangs) < nproc:
        return False
    for where in hangs.values():
        try:
            os.kill(where["pid"], signal.SIGKILL)  # a rank this check started, by its id
        except (KeyError, ProcessLookupError, PermissionError):
            pass
    return True


ERROR = re.compile(r"(\[[^\]]*\] )?error: ")
# a C++ exception that ended a rank (gloo's, where a collective receives more than it holds): the
# cause, where the other ranks' errors (their connection reset) are its effect
ABORT = re.compile(r"^(\[rank\d+\]:\s*)?what\(\):\s*(.+)$")
EXCEPTION = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]*(Error|Exception)|StopIteration)\b(: .*)?$")


def failure_line(run: Run, script: Path) -> str:
    """The one line that says why a run failed: its `error:` line, else the message of a rank's
    C++ abort, else its exception, else the last line it printed."""
    text = run.output()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if ERROR.match(line):
            return re.sub(r"^(\[[^\]]*\] )", "", line)
    for line in lines:
        aborted = ABORT.match(line)
        if aborted:
            return aborted.group(2)
    found = [line for line in lines if EXCEPTION.match(line) and "ChildFailedError" not in line]
    if found:
        message = EXCEPTION.match(found[0])
        target = script.resolve()
        where = [
            number
            for path, number in re.findall(r'File "([^"]+)", line (\d+)', text)
            if (REPO / path).resolve() == target or Path(path).resolve() == target
        ]
        at = f" (line {where[-1]} of {shown(script)})" if where else ""
        return f"{message.group(2)}{message.group(4) or ''}{at}"
    if run.status == 124:
        return f"it ran for more than {RUN_TIMEOUT} s"
    return lines[-1] if lines else f"it exited with status {run.status} and printed nothing"


# ---- the reference ---------------------------------------------------------------------------

CORPUS_CHARS = 3500  # the first 3500 characters of the first play: 29 training windows of 32 tokens
# its last tenth, common.data's validation split, is 3 windows, fewer than the one whole batch of
# 8 an evaluation reads: the check's validation split is the play's next 1200 characters instead
VAL_CHARS = 1200


def run_flags(corpus: Path, data: Path, out: Path, iters: int = STEPS, **more) -> list[str]:
    """The flags of a checked run: tiny, float64, every step logged, one evaluation at the end."""
    values = {
        "preset": "tiny",
        "device": "cpu",
        "dtype": "float64",
        "dataset": corpus,
        "data_dir": data,
        "out_dir": out,
        "max_iters": iters,
        "lr_decay_iters": STEPS,
        "warmup_iters": 2,
        "log_interval": 1,
        "eval_interval": STEPS,
        "eval_batches": 1,
        "sample_tokens": 0,
        "dropout": 0,
        "seed": SEED,
        **more,
    }
    return flags(**values)


def corpus_text() -> str:
    """The small corpus the epoch tests use too: it crosses two epoch boundaries in 8 steps."""
    from common.support.corpus import shakespeare_texts

    return shakespeare_texts()[0][:CORPUS_CHARS]


def held_out_text() -> str:
    """The check's validation text: what follows the corpus in the play."""
    from common.support.corpus import shakespeare_texts

    return shakespeare_texts()[0][CORPUS_CHARS : CORPUS_CHARS + VAL_CHARS]


def hold_out(folder: Path) -> None:
    """The prepared folder's val.bin made of held_out_text()'s tokens (ending with <|endoftext|>,
    as prepare() ends a document), and meta.json saying so; train.bin stays prepare()'s."""
    import json

    import numpy as np

    from common.tokenizer import get_tokenizer

    tokenizer = get_tokenizer()
    ids = np.array(tokenizer.encode_ordinary(held_out_text()) + [tokenizer.eot_token], np.uint16)
    val = folder / "val.bin"
    if val.exists() and np.array_equal(np.fromfile(val, dtype=np.uint16), ids):
        return
    ids.tofile(folder / "val.bin.tmp")
    os.replace(folder / "val.bin.tmp", val)
    meta = json.loads((folder / "meta.json").read_text())
    meta["val_tokens"] = len(ids)
    meta["val_source"] = f"tools/check: characters {CORPUS_CHARS}-{CORPUS_CHARS + VAL_CHARS}"
    (folder / "meta.json.tmp").write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(folder / "meta.json.tmp", folder / "meta.json")


def prepared_corpus(root: Path) -> tuple[Path, Path, str]:
    """(the corpus file, the data root where it is prepared, its text), made once under root: every
    run then finds the token files ready (one check after another, or two at once)."""
    from common.data import prepare

    root.mkdir(parents=True, exist_ok=True)
    corpus, data, text = root / "corpus.txt", root / "data", corpus_text()
    with open(root / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second check waits here until the files are written
        if not corpus.exists() or corpus.read_text(encoding="utf-8") != text:
            corpus.write_text(text, encoding="utf-8")
        hold_out(prepare(str(corpus), data, log=lambda *a: None))
    return corpus, data, text


def checked_launch(plan: Plan, nproc: int) -> Launch:
    """How the check starts a script of this plan with nproc ranks."""
    return Launch(nproc, plan.nodes, plan.env(), torchrun=plan.distributed)


def reference_of(plan: Plan, nproc: int) -> tuple[Path, Launch, dict]:
    """The script, the launch and the flags (beyond run_flags') of the run compared with: chapter
    01's in one process with the global batch of 8, or the chapter's own run as the check's."""
    script = REPO / CHAPTERS[plan.reference] / "train.py"
    if plan.reference != plan.chapter:
        return script, Launch(1), {"batch_size": GLOBAL_BATCH}
    return script, checked_launch(plan, nproc), {**plan.split(nproc), **plan.extra_flags()}


def version(corpus: str, script: Path, how: Launch, more: dict) -> str:
    """A hash of what the reference run depends on: its script, the checker, common/, the corpus,
    its flags and its launch."""
    digest = hashlib.sha256()
    checker = sorted((REPO / "tools" / "check").glob("*.py"))
    for path in [script, *checker, *sorted((REPO / "common").rglob("*.py"))]:
        digest.update(path.read_bytes())
    digest.update(corpus.encode())
    digest.update(held_out_text().encode())
    digest.update(" ".join(run_flags(Path("c"), Path("d"), Path("o"), **more)).encode())
    digest.update(repr(how).encode())
    return digest.hexdigest()[:16]


def made(folder: Path, name: str) -> Run:
    return Run(folder / name, folder / f"{name}_facts", folder / f"{name}.log", 0)


def reference_run(
    root: Path, corpus_file: Path, data: Path, corpus: str, plan: Plan, nproc: int
) -> Run:
    """The run compared with (reference_of), kept under root/reference/ by a hash of everything it
    depends on."""
    script, how, more = reference_of(plan, nproc)
    name = f"{plan.reference:02d}"
    final = root / "reference" / version(corpus, script, how, more)
    if (final / "ok").exists():
        os.utime(final)  # in use: see prune()
        return made(final, name)
    building = root / "reference" / f".building-{os.getpid()}-{time.time_ns()}"
    building.mkdir(parents=True)
    args = run_flags(corpus_file, data, building / name, **more)
    run = run_one(script, how, args, building, name)
    if run.status != 0 or len(run.losses()) != STEPS:
        raise CannotRun(
            f"{plan.against} itself did not run: {failure_line(run, script)} (see {run.log})"
        )
    for checkpoint in (building / name).rglob("*.pt"):
        checkpoint.unlink()  # whatever its checkpoints are called; kept: metrics, facts, parameters
    (building / "ok").write_text("")
    try:
        building.rename(final)
    except OSError:  # another check made it at the same time: use theirs
        shutil.rmtree(building, ignore_errors=True)
    prune(root / "reference", final)
    return made(final, name)


def prune(folder: Path, final: Path) -> None:
    """Remove the runs an earlier version of the course made, unused for longer than a check."""
    for older in folder.iterdir():
        unused = time.time() - older.stat().st_mtime > 2 * RUN_TIMEOUT
        if older != final and not older.name.startswith(".") and unused:
            shutil.rmtree(older, ignore_errors=True)
