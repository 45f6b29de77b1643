"""Is your script chapter 01's run? Run it next to chapter 01 and compare them step by step.

    python tools/check.py 02_grad_accumulation/exercise.py
    python tools/check.py 04_ddp/exercise.py --nproc-per-node 2
    python tools/check.py my_ddp.py --nproc-per-node 2 --chapter 4

SCRIPT is a copy of a chapter's train.py that takes the course's flags. It runs (under torchrun with
--nproc-per-node N > 1) next to chapter 01, both in float64 on the tiny model, with the same global
batch of 8 sequences, the same seed and a corpus of 29 windows, so that 8 steps cross two epoch
boundaries. Equal runs then agree to the last digit. Compared: every row the script logs (loss,
learning rate, validation loss), the optimizer steps per logged step, the windows every rank read,
every step's gradient norm and parameters, every rank's copy of them, and a run stopped at step 5
and resumed. What a CPU cannot show is stood in for: chapter 03's DataParallel splits each batch
over 2 replicas; chapter 05 runs as two nodes of one process each (so LOCAL_RANK is not RANK), and
instead of a plain resume, one rank is killed after step 6 and torchrun restarts the group. Chapter
06's ranks hold shards of the parameters (FSDP): they are gathered whole to be compared. A hang
(ranks waiting in collectives that do not match) is named with each rank's line within seconds.
The verdict: "same run" (exit 0), "not the same run" (exit 1) with what differs first and a
diagnosis from tools/mistakes.py (or, where no entry fits, what the facts show), or "could not
run" (exit 2). The logs, metrics, facts and a plot of both loss curves go to a new folder under
out/check/ (about 1 MB; the checkpoints and parameter files are deleted once compared).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common` and `tools` from anywhere

from common.chapters import CHAPTERS
from tools.launch import REPO, child_env, free_port, shown_command, torchrun_command
from tools.mistakes import MISTAKES, Facts, describe, diagnose, quoted, statements, where_to_look

STEPS, RESUME_AT, GLOBAL_BATCH = 8, 5, 8
CORPUS_CHARS = 3500  # the first 3500 characters of the first play: 29 training windows of 32 tokens
# float64: runs that take the same steps agree to about 1e-15; the order of additions differs
# between the chapters (micro-batches, ranks), so allow a little more, still far below any real
# difference
LOSS_RTOL, PARAM_RTOL = 1e-10, 1e-9
PROBE = REPO / "tools" / "check_probe.py"
REPLICAS = 2  # chapter 03: the stand-in replicas DataParallel splits each batch over
# chapter 05: the restart check checkpoints at step 4, kills rank 1 after step 6; torchrun restarts
RESTART_EVAL, RESTART_KILL = 4, 6
# a collective that waits this long while the other ranks wait in others is a hang; the run's
# --dist-timeout ends it anyway after DIST_TIMEOUT
HANG_AFTER, DIST_TIMEOUT = 15, 60
REFERENCE = REPO / CHAPTERS[1] / "train.py"
RUN_TIMEOUT = 600


class CannotRun(Exception):
    """The script (or the check itself) could not run: one line for the learner."""


# ---- what to run
# ----------------------------------------------------------------------------------


def shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def written_as(source: str) -> tuple[int | None, int | None]:
    """(N, line) of the script's parse_args(chapter=N, ...), or (None, None)."""
    for number, line in enumerate(source.splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue  # an exercise's TODO quotes the line it asks for
        found = re.search(r"parse_args\(\s*chapter\s*=\s*(\d+)", line)
        if found:
            return int(found.group(1)), number
    return None, None


def chapter_of(script: Path, source: str, given: int | None) -> int:
    """--chapter, else the chapter folder the script is in, else the one its parse_args names."""
    if given is not None:
        return given
    folder = script.resolve().parent
    for number, name in CHAPTERS.items():
        if folder == REPO / name:
            return number
    number, _ = written_as(source)
    if number is None:
        raise CannotRun(
            f"cannot tell which chapter {shown(script)} is: give --chapter N (1-{max(CHAPTERS)})"
        )
    return number


def batch_split(chapter: int, nproc: int) -> dict[str, int]:
    """The script's flags for a global batch of 8: with K > 1 wherever the chapter accumulates."""
    if chapter == 1:
        return {"batch_size": GLOBAL_BATCH}
    per_rank = GLOBAL_BATCH // nproc
    batch = 2 if per_rank >= 2 else 1
    return {"batch_size": batch, "grad_accum": per_rank // batch}


def run_flags(corpus: Path, data: Path, out: Path, iters: int = STEPS, **more) -> list[str]:
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
        **more,
    }
    words = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return words


@dataclass
class Run:
    out: Path  # the script's --out-dir
    facts: Path  # the probe's files, one pair per rank
    log: Path  # everything the run printed
    status: int

    def rows(self) -> list[dict]:
        """metrics.jsonl, every row."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
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


@dataclass
class Launch:
    """How the script is started: ranks, as one node or two, and what the probe stands in for."""

    nproc: int
    nodes: int = 1
    env: dict | None = None
    torchrun_extra: tuple[str, ...] = ()


def start(
    script: Path, launch: Launch, args: list[str], folder: Path, name: str
) -> tuple[list[subprocess.Popen], Run]:
    facts, log = folder / f"{name}_facts", folder / f"{name}.log"
    probe_args = [str(facts), str(script.resolve()), *args]
    if launch.nodes > 1:
        port = free_port()
        cmds = [
            torchrun_command(
                PROBE,
                launch.nproc // launch.nodes,
                probe_args,
                nnodes=launch.nodes,
                node_rank=node,
                port=port,
                extra=list(launch.torchrun_extra),
            )
            for node in range(launch.nodes)
        ]
    elif launch.nproc > 1:
        cmds = [
            torchrun_command(PROBE, launch.nproc, probe_args, extra=list(launch.torchrun_extra))
        ]
    else:
        cmds = [[sys.executable, str(PROBE), *probe_args]]
    # the CPU, even where GPUs are visible (chapter 03 would refuse --device cpu next to them)
    env = child_env(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", **(launch.env or {}))
    if launch.nproc > 1:
        env["CHECK_HANG_AFTER"] = str(HANG_AFTER)
    procs = []
    with log.open("w") as out:
        for cmd in cmds:
            out.write(f"$ {shown_command(cmd)}\n")
        out.flush()
        for cmd in cmds:
            # in the checker's process group: Ctrl-C in the terminal stops the runs too
            procs.append(
                subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            )
    return procs, Run(folder / name, facts, log, -1)


def stop(procs: list[subprocess.Popen]) -> None:
    """End runs that are still going (torchrun passes the SIGTERM on to its ranks)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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


def finish(procs: list[subprocess.Popen], run: Run, nproc: int = 1) -> Run:
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while any(proc.poll() is None for proc in procs):
            failed = [proc.returncode for proc in procs if proc.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break  # one node failed: the other would wait for it
            if end_hang(run, nproc):
                break
            time.sleep(0.25)
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes):
            run.status = next((code for code in codes if code != 0), 0)
        else:
            run.status = (
                124
                if time.monotonic() > deadline
                else next((code for code in codes if code not in (None, 0)), 1)
            )
    finally:
        stop(procs)  # interrupted while waiting: the run does not outlive the check
    if run.status not in (0, 124) and finished_script(run, nproc):
        # every rank's script returned: what failed came after it (a process that aborted on its
        # way out of the interpreter), which is not the script's run
        with run.log.open("a") as log:
            log.write(f"check: exit status {run.status} after every rank's script had ended\n")
        run.status = 0
    return run


def finished_script(run: Run, nproc: int) -> bool:
    """Every rank's script returned (the probe wrote status 0 for each)."""
    ranks = run.ranks()
    return len(ranks) == nproc and all(r.get("status") == 0 for r in ranks)


def run_one(script: Path, launch: Launch, args: list[str], folder: Path, name: str) -> Run:
    return finish(*start(script, launch, args, folder, name), nproc=launch.nproc)


def failure_line(run: Run, script: Path) -> str:
    """The one line that says why a run failed: its `error:` line, else its exception, else its last
    line."""
    text = run.output()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if re.match(r"(\[[^\]]*\] )?error: ", line):
            return re.sub(r"^(\[[^\]]*\] )", "", line)
    exception = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]*(Error|Exception)|StopIteration)\b(: .*)?$")
    found = [line for line in lines if exception.match(line) and "ChildFailedError" not in line]
    if found:
        message = exception.match(found[0])
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


# ---- chapter 01, made once per version of the course --------------------------------------------


def corpus_text() -> str:
    """The small corpus the epoch tests use too: it crosses two epoch boundaries in 8 steps."""
    from common.support.corpus import shakespeare_texts

    return shakespeare_texts()[0][:CORPUS_CHARS]


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
        prepare(str(corpus), data, log=lambda *a: None)
    return corpus, data, text


def reference_run(root: Path, corpus_file: Path, data: Path, corpus: str) -> Run:
    """Chapter 01's run, kept under root/reference/ by a hash of everything it depends on."""
    digest = hashlib.sha256()
    sources = [REFERENCE, PROBE, *sorted((REPO / "common").rglob("*.py"))]
    for path in sources:
        digest.update(path.read_bytes())
    digest.update(corpus.encode())
    digest.update(
        " ".join(run_flags(Path("c"), Path("d"), Path("o"), batch_size=GLOBAL_BATCH)).encode()
    )
    final = root / "reference" / digest.hexdigest()[:16]
    if (final / "ok").exists():
        os.utime(final)  # in use: see the pruning below
        return Run(final / "01", final / "01_facts", final / "01.log", 0)
    building = root / "reference" / f".building-{os.getpid()}-{time.time_ns()}"
    building.mkdir(parents=True)
    args = run_flags(corpus_file, data, building / "01", batch_size=GLOBAL_BATCH)
    run = run_one(REFERENCE, Launch(1), args, building, "01")
    if run.status != 0 or len(run.losses()) != STEPS:
        raise CannotRun(
            f"chapter 01 itself did not run: {failure_line(run, REFERENCE)} (see {run.log})"
        )
    for checkpoint in building.rglob("ckpt.pt"):
        checkpoint.unlink()  # kept: its metrics, facts and parameters
    (building / "ok").write_text("")
    try:
        building.rename(final)
    except OSError:  # another check made it at the same time: use theirs
        shutil.rmtree(building, ignore_errors=True)
    # made by an earlier version of the course, and not used for longer than a check can take
    for older in (root / "reference").iterdir():
        unused = time.time() - older.stat().st_mtime > 2 * RUN_TIMEOUT
        if older != final and not older.name.startswith(".") and unused:
            shutil.rmtree(older, ignore_errors=True)
    return Run(final / "01", final / "01_facts", final / "01.log", 0)


# ---- the comparison
# ---------------------------------------------------------------------------------


def relative_distance(a, b) -> float:
    if a is None or b is None or a.shape != b.shape:
        return math.inf
    return ((a - b).norm() / b.norm()).item()


def differs(a: float | None, b: float | None, rtol: float) -> bool:
    if a is None or b is None:
        return a is not b
    return abs(a - b) > rtol * abs(b)


def first_diff(run: dict[int, float], ref: dict[int, float], after: int = 0, rtol=LOSS_RTOL):
    """The first step after `after` where the two columns differ (a missing row differs)."""
    for step in sorted(set(ref) | set(run)):
        if step > after and differs(run.get(step), ref.get(step), rtol):
            return step
    return None


def first_step_diff(steps: list[dict], ref_steps: list[dict], read, offset: int = 0, rtol=1e-9):
    """The first optimizer step (numbered as chapter 01's) where read(step) differs."""
    for i, step in enumerate(steps):
        if offset + i >= len(ref_steps):
            return offset + i + 1
        mine, theirs = read(step), read(ref_steps[offset + i])
        if isinstance(mine, list):
            if any(differs(a, b, rtol) for a, b in zip(mine, theirs)) or len(mine) != len(theirs):
                return offset + i + 1
        elif differs(mine, theirs, rtol):
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


def gather_facts(
    chapter: int, nproc: int, split: dict, run: Run, ref: Run, resumed: Run | None
) -> tuple[Facts, dict]:
    """The facts for the catalogue, and details for the report."""
    losses, ref_losses = run.losses(), ref.losses()
    ranks, ref_steps = run.ranks(), ref.ranks()[0]["steps"]
    ranks_steps = [r["steps"] for r in ranks]
    steps_per_epoch = int(re.search(r"(\d+) steps per epoch", ref.output()).group(1))
    found = re.search(r"(\d+) steps per epoch", run.output())
    script_epoch = int(found.group(1)) if found else None

    def windows(step: int) -> list[int] | None:  # every rank's windows of a step, together
        if any(len(steps) < step for steps in ranks_steps) or not ranks_steps:
            return None
        return sorted(w for steps in ranks_steps for w in steps[step - 1]["windows"])

    first_data = next(
        (
            s
            for s in range(1, len(ref_steps) + 1)
            if windows(s) != sorted(ref_steps[s - 1]["windows"])
        ),
        None,
    )
    if (
        first_data is not None
        and windows(first_data) is None
        and first_data > max(map(len, ranks_steps), default=0)
    ):
        first_data = None  # the script stopped before this step: nothing was read differently
    rank0 = ranks_steps[0] if ranks_steps else []
    share = all(
        set(rank0[s]["windows"]) <= set(ref_steps[s]["windows"])
        for s in range(min(len(rank0), steps_per_epoch))
    )
    repeats = len(rank0) > steps_per_epoch and all(len(s) > steps_per_epoch for s in ranks_steps)
    repeats = repeats and sorted(
        w for steps in ranks_steps for w in steps[steps_per_epoch]["windows"]
    ) == sorted(w for steps in ranks_steps for w in steps[0]["windows"])
    epoch0 = [
        {w for step in steps[:steps_per_epoch] for w in step["windows"]} for steps in ranks_steps
    ]
    overlap = any(
        epoch0[a] & epoch0[b] for a in range(len(epoch0)) for b in range(a + 1, len(epoch0))
    )
    same_windows = (
        len(ranks_steps) > 1
        and all(steps and steps[0]["windows"] for steps in ranks_steps)
        and all(steps[0]["windows"] == ranks_steps[0][0]["windows"] for steps in ranks_steps)
    )
    if not any(step["windows"] for steps in ranks_steps for step in steps):
        # the script reads its data some other way than common.data: no facts about the data
        first_data, share, repeats, overlap = None, False, False, False
    drift, drifting = None, []
    for step in range(1, min(map(len, ranks_steps), default=0) + 1):
        sums = [steps[step - 1].get("checksum") for steps in ranks_steps]
        drifting = [r for r, s in enumerate(sums) if s != sums[0]]
        if drifting:
            drift = step
            break
    params = run.params()
    ref_params = ref.params()
    if drift is None and ranks_steps:  # every rank's final copy, whole, against rank 0's
        import torch

        finals = [run.params(r) for r in range(len(ranks))]
        drifting = [
            r
            for r, p in enumerate(finals)
            if p is None or params is None or not torch.equal(p, params)
        ]
        drift = STEPS if drifting else None
    data_ranks = []
    if first_data is not None and windows(first_data) is not None:
        wanted = set(ref_steps[first_data - 1]["windows"])
        data_ranks = [
            r
            for r, steps in enumerate(ranks_steps)
            if not set(steps[first_data - 1]["windows"]) <= wanted
        ]
    distance = relative_distance(params, ref_params)
    first_loss = first_diff(losses, ref_losses)
    stopped = None if run.status == 0 and len(losses) == STEPS else len(losses)
    grad = (
        rank0[0]["grad_norm"] / ref_steps[0]["grad_norm"]
        if rank0 and ref_steps[0]["grad_norm"]
        else None
    )
    lrs, ref_lrs = run.column("lr"), ref.column("lr")
    vals, ref_vals = run.column("val_loss"), ref.column("val_loss")
    first_val = first_diff(vals, ref_vals)
    val_ratio = None
    if first_val is not None and vals.get(first_val) and ref_vals.get(first_val):
        val_ratio = vals[first_val] / ref_vals[first_val]
    clipped = [{s.get("clipped") for s in steps} for steps in ranks_steps]
    syncs = [s.get("syncs") or [] for s in rank0]
    unsynced_last = any(flags and not flags[-1] and any(flags) for flags in syncs)

    facts = Facts(
        chapter=chapter,
        world_size=nproc,
        grad_accum=split.get("grad_accum", 1),
        steps_per_epoch=steps_per_epoch,
        script_steps_per_epoch=script_epoch,
        first_loss_diff=first_loss,
        loss_ratio_at_1=losses[1] / ref_losses[1] if 1 in losses else math.nan,
        grad_ratio_at_1=grad,
        first_data_diff=first_data,
        rank0_reads_its_share=share,
        ranks_overlap=overlap,
        repeats_first_epoch=repeats,
        zero_grads_per_step=max((s["zero_grads"] for s in rank0[1:]), default=0),
        ranks_drift_from=drift,
        params_equal=distance <= PARAM_RTOL,
        stopped_after=stopped,
        resume_at=RESUME_AT if resumed is not None else None,
        resume_diff=None,
        first_grad_diff=first_step_diff(rank0, ref_steps, lambda s: s["grad_norm"]),
        first_param_diff=first_step_diff(rank0, ref_steps, lambda s: s.get("checksum")),
        first_lr_diff=first_diff(lrs, ref_lrs, rtol=1e-9),
        lr_speed=lr_speed(lrs, ref_lrs),
        first_val_diff=first_val,
        val_ratio=val_ratio,
        logged_steps=len(losses),
        optimizer_steps=len(rank0),
        ranks_same_windows=same_windows,
        ranks_clip_differ=len({frozenset(c) for c in clipped}) > 1,
        ranks_steps_differ=len({len(steps) for steps in ranks_steps}) > 1,
        last_micro_step_unsynced=unsynced_last,
        replicas=(ranks[0].get("replicated", 0) and REPLICAS) if chapter == 3 and ranks else None,
        sharded=bool(ranks and ranks[0].get("sharded")),
    )
    if facts.first_param_diff is None and not facts.params_equal:
        facts.first_param_diff = len(rank0) or STEPS
    if resumed is not None:
        resumed_losses = resumed.losses()
        facts.resume_diff = first_diff(resumed_losses, ref_losses, after=RESUME_AT)
        if (
            facts.resume_diff is None
            and relative_distance(resumed.params(), ref_params) > PARAM_RTOL
        ):
            facts.resume_diff = STEPS
        resumed_ranks = [r["steps"] for r in resumed.ranks()]
        if resumed_ranks and all(resumed_ranks):
            mine = resumed_ranks[0]
            facts.resume_first_grad_diff = first_step_diff(
                mine, ref_steps, lambda s: s["grad_norm"], offset=RESUME_AT
            )
            facts.resume_first_param_diff = first_step_diff(
                mine, ref_steps, lambda s: s.get("checksum"), offset=RESUME_AT
            )
            facts.resume_first_data_diff = next(
                (
                    RESUME_AT + i + 1
                    for i in range(min(map(len, resumed_ranks)))
                    if RESUME_AT + i < len(ref_steps)
                    and sorted(w for steps in resumed_ranks for w in steps[i]["windows"])
                    != sorted(ref_steps[RESUME_AT + i]["windows"])
                ),
                None,
            )
            # the stopped run's last parameters are what its checkpoint must give the resumed run
            ended = rank0[RESUME_AT - 1].get("checksum") if len(rank0) >= RESUME_AT else None
            start = mine[0].get("checksum_before") if mine else None
            facts.resume_start_differs = (
                ended is not None
                and start is not None
                and any(differs(a, b, 1e-12) for a, b in zip(start, ended))
            )
            first_read = {w for steps in resumed_ranks for w in steps[0]["windows"]}
            epoch = RESUME_AT // steps_per_epoch
            facts.resume_reads_steps = [
                s + 1
                for s in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
                if s < len(ref_steps) and first_read & set(ref_steps[s]["windows"])
            ]
    details = {
        "distance": distance,
        "drifting": drifting,
        "ranks": len(ranks),
        "data_ranks": data_ranks,
        "lrs": (lrs, ref_lrs),
        "vals": (vals, ref_vals),
    }
    return facts, details


# ---- the report
# ------------------------------------------------------------------------------------


def plot(
    path: Path,
    losses: dict[int, float],
    ref: dict[int, float],
    first: int | None,
    epoch: int,
    title: str,
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sorted(ref), [ref[s] for s in sorted(ref)], "o-", label="chapter 01", color="tab:blue")
    ax.plot(
        sorted(losses),
        [losses[s] for s in sorted(losses)],
        "x--",
        label="your script",
        color="tab:red",
    )
    for boundary in range(epoch, STEPS, epoch):
        label = "a new epoch" if boundary == epoch else None  # starts after this step
        ax.axvspan(boundary + 0.45, boundary + 0.55, color="0.9", label=label)
    if first is not None:
        ax.axvline(first, color="gray", linestyle=":")
        where = (first, 0.03)  # at the bottom of the plot, beside the line
        ax.annotate(
            f"first difference: step {first}",
            where,
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


def fresh_folder(root: Path, script: Path) -> Path:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{script.resolve().parent.name}_{script.stem}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        folder = root / f"{stem}_{stamp}" if n == 0 else root / f"{stem}_{stamp}_{n}"
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise CannotRun(f"no free folder under {root}")


def hang_report(run: Run, script: Path, source: str, nproc: int) -> list[str]:
    """Each rank's line in the script and the collective it waits in (or how it ended)."""
    hangs = run.hangs()
    lines = source.splitlines()
    mine = statements(source)
    statuses = {r["rank"]: r.get("status") for r in run.ranks()}
    out = []
    for rank in range(nproc):
        if rank in hangs:
            where = hangs[rank]
            node = mine.get(where["line"])
            said = quoted(node[0], lines) if node else lines[where["line"] - 1].strip()
            out.append(
                f"  rank {rank} waits in {where['collective']} at line {where['line']} of "
                f"{shown(script)}: `{said}`"
            )
        elif statuses.get(rank) == 0:
            out.append(f"  rank {rank} finished the script: nobody answers the others")
        else:
            out.append(f"  rank {rank} stopped: no line recorded")
    return out


def restart_check(
    script: Path, launch: Launch, corpus: Path, data: Path, split: dict, folder: Path, ref: Run
) -> tuple[str | None, Run]:
    """Chapter 05's idea: kill rank 1 after step 6 (checkpoint at step 4); torchrun restarts the
    group, which must continue from the checkpoint to chapter 01's end. None: it did."""
    restart = Launch(
        launch.nproc,
        launch.nodes,
        {**(launch.env or {}), "CHECK_KILL": f"1:{RESTART_KILL}"},
        ("--max-restarts=1",),
    )
    flags = run_flags(corpus, data, folder / "restarted", eval_interval=RESTART_EVAL, **split)
    run = run_one(script, restart, flags, folder, "restarted")
    losses, ref_losses = run.losses(), ref.losses()
    if run.status == 0 and not any(r.get("restart") for r in run.ranks()):
        return "rank 1 was killed, yet the run ended without a restart", run
    if run.status != 0:
        return f"after the restart: {failure_line(run, script)}", run
    diff = first_diff(losses, ref_losses)
    if diff is not None:
        return f"the restarted run's loss differs from step {diff}", run
    if relative_distance(run.params(), ref.params()) > PARAM_RTOL:
        return "the restarted run ends with other parameters than chapter 01's", run
    return None, run


def tidy(folder: Path) -> None:
    """Keep what a learner looks at (logs, metrics, facts, the plot): the checkpoints and the
    parameter files, 100 MB a check, are deleted once compared."""
    for path in folder.rglob("*.pt"):
        path.unlink(missing_ok=True)


def check(args) -> int:
    script = Path(args.script)
    if not script.is_file():
        raise CannotRun(f"{args.script}: no such file")
    source = script.read_text(errors="replace")
    chapter = chapter_of(script, source, args.chapter)
    if chapter not in CHAPTERS:
        raise CannotRun(f"--chapter {chapter}: the chapters are 1 to {max(CHAPTERS)}")
    nproc = args.nproc_per_node
    if nproc > 1 and chapter < 4:
        raise CannotRun(f"chapter {chapter:02d} runs in one process: drop --nproc-per-node")
    if chapter == 5 and nproc % 2:
        nproc = 2 * nproc  # two nodes of the same size
    if GLOBAL_BATCH % nproc:
        raise CannotRun(
            f"--nproc-per-node {nproc}: the check's global batch of 8 needs 1, 2, 4 or 8 ranks"
        )
    says, line = written_as(source)
    if says is not None and says != chapter:
        raise CannotRun(
            f"{shown(script)} is still chapter {says:02d}'s script (line {line}: "
            f"parse_args(chapter={says}, ...)) and is checked as chapter {chapter:02d}: "
            f"do its TODOs (one sets chapter={chapter})"
        )
    split = batch_split(chapter, nproc)
    launch = Launch(nproc)
    if chapter == 3:
        launch.env = {"CHECK_REPLICAS": str(REPLICAS)}
    if chapter == 5:
        launch.nodes = 2
    root = Path(args.out_root)
    corpus_file, data, corpus = prepared_corpus(root)
    folder = fresh_folder(root, script)
    shape = f"{nproc} rank(s) x " if chapter >= 4 else ""
    if chapter == 5:
        shape = f"2 nodes x {nproc // 2} rank(s) x "
    if chapter >= 2:
        shape += f"{split['grad_accum']} micro-batch(es) x {split['batch_size']}"
    else:
        shape = f"--batch-size {split['batch_size']}"
    if chapter == 3:
        shape += f", DataParallel split over {REPLICAS} stand-in replicas"
    print(f"checking {shown(script)} as chapter {chapter:02d} ({shape}) against chapter 01")
    print(
        f"  float64, tiny model, {STEPS} steps over 3 epochs of a small corpus; in {shown(folder)}/"
    )

    more = {"dist_timeout": DIST_TIMEOUT} if chapter >= 4 else {}
    script_args = run_flags(corpus_file, data, folder / "run", **split, **more)
    procs, run = start(script, launch, script_args, folder, "run")
    try:
        # meanwhile, unless an earlier check made it
        ref = reference_run(root, corpus_file, data, corpus)
    except BaseException:
        stop(procs)
        raise
    run = finish(procs, run, nproc)
    try:
        return verdict(args, script, source, chapter, launch, split, folder, run, ref, more)
    finally:
        tidy(folder)


def verdict(args, script, source, chapter, launch, split, folder, run, ref, more) -> int:
    nproc = launch.nproc
    corpus_file, data = Path(args.out_root) / "corpus.txt", Path(args.out_root) / "data"
    chapter_source = (REPO / CHAPTERS[chapter] / "train.py").read_text()
    if run.status != 0 and run.hangs():
        print("not the same run: the ranks hang, each waiting for the others in a collective")
        print(*hang_report(run, script, source, nproc), sep="\n")
        print(
            f"  nothing is known to differ: the run was stopped at the hang "
            f"(the whole output: {shown(run.log)})"
        )
        hang = MISTAKES[0]
        print(f"diagnosis: {hang.name}: {hang.did}")
        look = where_to_look(hang, source, shown(script), chapter_source)
        if look.text.startswith("look at"):  # the statement around the collective that differs
            where = look.text.split("; chapter")[0]
            print(
                f"  {where}; chapter {chapter:02d} has no such statement: "
                "every rank reaches the collective"
            )
        return 1
    losses, ref_losses = run.losses(), ref.losses()
    failure = failure_line(run, script) if run.status != 0 else None
    if not losses:
        known = next(
            (m for m in MISTAKES if m.fails_with and re.search(m.fails_with, failure or "")), None
        )
        if known is None:
            raise CannotRun(f"{failure_line(run, script)} (the whole output: {shown(run.log)})")
        print(f"not the same run: it stopped before step 1: {failure}")
        print(f"diagnosis: {known.name}: {known.did}")
        print(f"  {where_to_look(known, source, shown(script), chapter_source).text}")
        return 1

    resumed, restart = None, None
    plain = (
        run.status == 0
        and first_diff(losses, ref_losses) is None
        and relative_distance(run.params(), ref.params()) <= PARAM_RTOL
    )
    if plain and chapter == 5 and not args.no_resume:
        restart, _ = restart_check(script, launch, corpus_file, data, split, folder, ref)
    elif plain and not args.no_resume:
        first = run_one(
            script,
            launch,
            run_flags(corpus_file, data, folder / "resumed", RESUME_AT, **split, **more),
            folder,
            "resumed",
        )
        if first.status == 0:
            resumed = run_one(
                script,
                launch,
                run_flags(corpus_file, data, folder / "resumed", resume=True, **split, **more),
                folder,
                "resumed",
            )
        if first.status != 0 or resumed.status != 0:
            failed = first if first.status != 0 else resumed
            raise CannotRun(
                f"the resume check failed: {failure_line(failed, script)} (see {shown(failed.log)})"
            )

    facts, details = gather_facts(chapter, nproc, split, run, ref, resumed)
    facts.failure = failure
    facts.restart = restart
    (folder / "facts.json").write_text(json.dumps(asdict(facts), indent=1))
    if args.facts:
        print(json.dumps(asdict(facts), indent=1))

    same = (
        facts.first_loss_diff is None
        and facts.params_equal
        and facts.first_param_diff is None
        and facts.ranks_drift_from is None
        and facts.stopped_after is None
        and facts.resume_diff is None
        and facts.first_lr_diff is None
        and facts.first_val_diff is None
        and facts.optimizer_steps == facts.logged_steps
        and facts.replicas != 0
        and facts.restart is None
        and (facts.sharded or chapter != 6)
    )
    first = facts.first_loss_diff
    where = None
    if not args.no_plot:
        png = folder / "losses.png"
        title = f"{shown(script)} against chapter 01"
        if plot(png, losses, ref_losses, first, facts.steps_per_epoch, title):
            where = f"plot: {shown(png)}"
        else:
            where = "plot: none (matplotlib is not installed)"
    ranks = f"on all {details['ranks']} ranks" if nproc > 1 else "in its one process"
    if facts.sharded:
        ranks = f"gathered whole from the shards of all {details['ranks']} ranks"
    if same:
        print(
            f"same run: all {STEPS} losses, learning rates, the validation loss and the parameters "
            f"after every step equal chapter 01's, {ranks}"
        )
        if resumed is not None:
            print(f"  stopped at step {RESUME_AT} and resumed: the same end")
        if chapter == 3:
            print(f"  DataParallel's batches split over {REPLICAS} replicas: the same losses")
        if chapter == 5 and not args.no_resume:
            print(
                f"  as 2 nodes; rank 1 killed after step {RESTART_KILL}, torchrun restarted the "
                f"group, and it continued from step {RESTART_EVAL}'s checkpoint to the same end"
            )
        if where:
            print(where)
        return 0
    print("not the same run:")
    if first is not None:
        if first in losses and first in ref_losses:
            a, b = losses[first], ref_losses[first]
            print(
                f"  the loss differs from step {first}: {a:.6f} here, {b:.6f} in chapter 01 "
                f"(ratio {a / b:.6g})"
            )
        else:
            print(f"  steps 1-{first - 1} are chapter 01's, then the script logged no more")
    elif not facts.params_equal:
        print(
            "  every loss equals chapter 01's, but the final parameters differ "
            f"(relative {details['distance']:.1e})"
        )
    if facts.first_lr_diff is not None:
        lrs, ref_lrs = details["lrs"]
        s = facts.first_lr_diff
        print(
            f"  the learning rate differs from step {s}: {lrs.get(s, math.nan):.6g} here, "
            f"{ref_lrs.get(s, math.nan):.6g} in chapter 01"
        )
    if facts.first_val_diff is not None:
        vals, ref_vals = details["vals"]
        s = facts.first_val_diff
        print(
            f"  the validation loss differs at step {s}: {vals.get(s, math.nan):.6f} here, "
            f"{ref_vals.get(s, math.nan):.6f} in chapter 01"
        )
    if facts.optimizer_steps != facts.logged_steps:
        print(f"  {facts.optimizer_steps} optimizer steps for {facts.logged_steps} logged steps")
    if facts.stopped_after is not None:
        print(f"  the script stopped after step {facts.stopped_after}: {failure_line(run, script)}")
    if nproc > 1:
        if facts.sharded:
            print(
                f"  the ranks' parameters: sharded (each rank holds 1/{nproc}), compared whole "
                "at every step"
            )
        elif facts.ranks_drift_from is not None:
            others = ", ".join(map(str, details["drifting"]))
            print(
                f"  the ranks' copies: rank(s) {others} differ from rank 0's "
                f"from step {facts.ranks_drift_from}"
            )
        else:
            print(f"  the ranks' copies: equal on all {details['ranks']} ranks at every step")
    if facts.first_data_diff is not None:
        who = ""
        if nproc > 1 and details["data_ranks"]:
            ranks_off = ", ".join(map(str, details["data_ranks"]))
            who = f" (rank(s) {ranks_off} read windows outside that step's batch)"
        print(f"  the windows read: other than chapter 01's from step {facts.first_data_diff}{who}")
    if facts.resume_diff is not None:
        print(
            f"  uninterrupted it is chapter 01's run; stopped at step {RESUME_AT} and resumed, "
            f"it differs from step {facts.resume_diff}"
        )
    if facts.restart is not None:
        print(
            f"  uninterrupted it is chapter 01's run; as 2 nodes with rank 1 killed after step "
            f"{RESTART_KILL} and torchrun --max-restarts=1: {facts.restart}"
        )
    if facts.replicas == 0:
        print("  DataParallel: never called (the check splits its batches over stand-in replicas)")
    if chapter == 6 and not facts.sharded:
        print("  FSDP: no rank's parameters are shards (DTensors): the model was not sharded")
    mistake, notes, look = diagnose(facts, source, shown(script), chapter_source)
    for note in notes:
        print(f"  {note}")
    if mistake is None:
        print("diagnosis: no known mistake fits; what the facts show:")
        for line in describe(facts):
            print(f"  {line}")
        print(f"  (all the facts: {shown(folder / 'facts.json')})")
    else:
        print(f"diagnosis: {mistake.name}: {mistake.did}")
        print(f"  {look}")
    if where:
        print(where)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
        "--no-resume", action="store_true", help="skip the stop-and-resume (05: restart) check"
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
