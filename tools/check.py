"""Is your script chapter 01's run? Run it next to chapter 01 and compare them step by step.

    python tools/check.py 02_grad_accumulation/exercise.py
    python tools/check.py 04_ddp/exercise.py --nproc-per-node 2
    python tools/check.py my_ddp.py --nproc-per-node 2 --chapter 4

SCRIPT is a copy of a chapter's train.py that takes the course's flags. It runs (under torchrun with
--nproc-per-node N > 1) next to chapter 01, both in float64 on the tiny model, with the same global
batch of 8 sequences, the same seed and a corpus of 29 windows, so that 8 steps cross two epoch
boundaries. Equal runs then agree to the last digit. Compared: every step's loss, the windows every
rank read, the final parameters and every rank's copy of them, and a run stopped at step 5 and
resumed. The verdict: "same run" (exit 0), "not the same run" (exit 1) with the first step that
differs and a diagnosis from tools/mistakes.py, or "could not run" (exit 2). The runs and a plot of
both loss curves go to a new folder under out/check/.
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
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common` and `tools` from anywhere

from common.chapters import CHAPTERS
from tools.launch import REPO, child_env, shown_command, torchrun_command
from tools.mistakes import Facts, diagnose, where_to_look

STEPS, RESUME_AT, GLOBAL_BATCH = 8, 5, 8
CORPUS_CHARS = 3500  # the first 3500 characters of the first play: 29 training windows of 32 tokens
# float64: runs that take the same steps agree to about 1e-15; the order of additions differs
# between the chapters (micro-batches, ranks), so allow a little more, still far below any real
# difference
LOSS_RTOL, PARAM_RTOL = 1e-10, 1e-9
PROBE = REPO / "tools" / "check_probe.py"
# what a check on one CPU machine cannot see: there the new part of these chapters changes no number
NOT_SEEN_HERE = {
    3: "on a CPU DataParallel has nothing to split: this shows your script is still chapter 01's run, "
    "not that its split works (that needs 2 GPUs and --gpus 2)",
    5: "on one machine the check is one node: it shows the training is chapter 01's run, not the "
    "multi-node launch (05_multinode/simulate_two_nodes.sh runs that)",
}
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
    """--chapter, else the chapter folder the script is in, else the chapter its parse_args names."""
    if given is not None:
        return given
    folder = script.resolve().parent
    for number, name in CHAPTERS.items():
        if folder == REPO / name:
            return number
    number, _ = written_as(source)
    if number is None:
        raise CannotRun(f"cannot tell which chapter {shown(script)} is: give --chapter N (1-5)")
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

    def losses(self) -> dict[int, float]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return {}
        losses = {}
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in record:
                losses[record["iter"]] = record["loss"]
        return losses

    def ranks(self) -> list[dict]:
        files = sorted(self.facts.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        return [json.loads(p.read_text()) for p in files]

    def params(self, rank: int = 0):
        import torch

        path = self.facts / f"rank{rank}.pt"
        return torch.load(path, weights_only=True) if path.exists() else None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start(
    script: Path, nproc: int, args: list[str], folder: Path, name: str
) -> tuple[subprocess.Popen, Run]:
    facts, log = folder / f"{name}_facts", folder / f"{name}.log"
    probe_args = [str(facts), str(script), *args]
    if nproc > 1:
        cmd = torchrun_command(PROBE, nproc, probe_args)
    else:
        cmd = [sys.executable, str(PROBE), *probe_args]
    # the CPU, even where GPUs are visible (chapter 03 would refuse --device cpu next to them)
    env = child_env(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    with log.open("w") as out:
        out.write(f"$ {shown_command(cmd)}\n")
        out.flush()
        # in the checker's process group: Ctrl-C in the terminal stops the runs too
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, Run(folder / name, facts, log, -1)


def stop(proc: subprocess.Popen) -> None:
    """End a run that is still going (torchrun passes the SIGTERM on to its ranks)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def finish(proc: subprocess.Popen, run: Run) -> Run:
    try:
        run.status = proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        stop(proc)
        run.status = 124
    finally:
        stop(proc)  # interrupted while waiting: the run does not outlive the check
    return run


def run_one(script: Path, nproc: int, args: list[str], folder: Path, name: str) -> Run:
    return finish(*start(script, nproc, args, folder, name))


def failure_line(run: Run, script: Path) -> str:
    """The one line that says why a run failed: its `error:` line, else its exception, else its last
    line."""
    text = run.output()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if re.match(r"(\[rank \d+\] )?error: ", line):
            return re.sub(r"^(\[rank \d+\] )", "", line)
    exception = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]*(Error|Exception)|StopIteration)\b(: .*)?$")
    found = [line for line in lines if exception.match(line) and "ChildFailedError" not in line]
    if found:
        message = exception.match(found[0])
        where = re.findall(rf'File "{re.escape(str(script.resolve()))}", line (\d+)', text)
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
        return Run(final / "01", final / "01_facts", final / "01.log", 0)
    building = root / "reference" / f".building-{os.getpid()}-{time.time_ns()}"
    building.mkdir(parents=True)
    args = run_flags(corpus_file, data, building / "01", batch_size=GLOBAL_BATCH)
    run = run_one(REFERENCE, 1, args, building, "01")
    if run.status != 0 or len(run.losses()) != STEPS:
        raise CannotRun(
            f"chapter 01 itself did not run: {failure_line(run, REFERENCE)} (see {run.log})"
        )
    (building / "ok").write_text("")
    try:
        building.rename(final)
    except OSError:  # another check made it at the same time: use theirs
        shutil.rmtree(building, ignore_errors=True)
    return Run(final / "01", final / "01_facts", final / "01.log", 0)


# ---- the comparison
# ---------------------------------------------------------------------------------


def relative_distance(a, b) -> float:
    if a is None or b is None or a.shape != b.shape:
        return math.inf
    return ((a - b).norm() / b.norm()).item()


def first_loss_diff(run: dict[int, float], ref: dict[int, float], after: int = 0) -> int | None:
    for step in range(after + 1, STEPS + 1):
        if step not in run or abs(run[step] - ref[step]) > LOSS_RTOL * abs(ref[step]):
            return step
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
        and first_data > max(map(len, ranks_steps))
    ):
        first_data = None  # the script stopped before this step: nothing was read differently
    rank0 = ranks_steps[0] if ranks_steps else []
    share = all(
        set(rank0[s]["windows"]) <= set(ref_steps[s]["windows"])
        for s in range(min(len(rank0), steps_per_epoch))
    )
    repeats = len(rank0) > steps_per_epoch and sorted(
        w for steps in ranks_steps for w in steps[steps_per_epoch]["windows"]
    ) == sorted(w for steps in ranks_steps for w in steps[0]["windows"])
    epoch0 = [
        {w for step in steps[:steps_per_epoch] for w in step["windows"]} for steps in ranks_steps
    ]
    overlap = any(
        epoch0[a] & epoch0[b] for a in range(len(epoch0)) for b in range(a + 1, len(epoch0))
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
    first_loss = first_loss_diff(losses, ref_losses)
    stopped = None if run.status == 0 and len(losses) == STEPS else len(losses)
    grad = (
        rank0[0]["grad_norm"] / ref_steps[0]["grad_norm"]
        if rank0 and ref_steps[0]["grad_norm"]
        else None
    )
    resume_diff = None
    if resumed is not None:
        resumed_losses = resumed.losses()
        resume_diff = first_loss_diff(resumed_losses, ref_losses, after=RESUME_AT)
        if resume_diff is None and relative_distance(resumed.params(), ref_params) > PARAM_RTOL:
            resume_diff = STEPS
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
        resume_diff=resume_diff,
    )
    details = {
        "distance": distance,
        "drifting": drifting,
        "ranks": len(ranks),
        "data_ranks": data_ranks,
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


def check(args) -> int:
    script = Path(args.script)
    if not script.is_file():
        raise CannotRun(f"{args.script}: no such file")
    source = script.read_text(errors="replace")
    chapter = chapter_of(script, source, args.chapter)
    if chapter not in CHAPTERS:
        raise CannotRun(f"--chapter {chapter}: the chapters are 1 to 5")
    nproc = args.nproc_per_node
    if nproc > 1 and chapter < 4:
        raise CannotRun(f"chapter {chapter:02d} runs in one process: drop --nproc-per-node")
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
    root = Path(args.out_root)
    corpus_file, data, corpus = prepared_corpus(root)
    folder = fresh_folder(root, script)
    shape = f"{nproc} rank(s) x " if chapter >= 4 else ""
    if chapter >= 2:
        shape += f"{split['grad_accum']} micro-batch(es) x {split['batch_size']}"
    else:
        shape = f"--batch-size {split['batch_size']}"
    print(
        f"checking {shown(script)} as chapter {chapter:02d} ({shape}) against chapter 01 (--batch-size 8)"
    )
    print(
        f"  float64, tiny model, {STEPS} steps over 3 epochs of a small corpus; runs in {shown(folder)}/"
    )

    script_args = run_flags(corpus_file, data, folder / "run", **split)
    proc, run = start(script, nproc, script_args, folder, "run")
    try:
        # meanwhile, unless an earlier check made it
        ref = reference_run(root, corpus_file, data, corpus)
    except BaseException:
        stop(proc)
        raise
    run = finish(proc, run)
    losses, ref_losses = run.losses(), ref.losses()
    if not losses:
        raise CannotRun(f"{failure_line(run, script)} (the whole output: {shown(run.log)})")

    resumed = None
    if not args.no_resume and run.status == 0 and first_loss_diff(losses, ref_losses) is None:
        first = run_one(
            script,
            nproc,
            run_flags(corpus_file, data, folder / "resumed", RESUME_AT, **split),
            folder,
            "resumed",
        )
        if first.status == 0:
            resumed = run_one(
                script,
                nproc,
                run_flags(corpus_file, data, folder / "resumed", resume=True, **split),
                folder,
                "resumed",
            )
        if first.status != 0 or resumed.status != 0:
            failed = first if first.status != 0 else resumed
            raise CannotRun(
                f"the resume check failed: {failure_line(failed, script)} (see {shown(failed.log)})"
            )

    facts, details = gather_facts(chapter, nproc, split, run, ref, resumed)
    (folder / "facts.json").write_text(json.dumps(asdict(facts), indent=1))
    if args.facts:
        print(json.dumps(asdict(facts), indent=1))

    same = (
        facts.first_loss_diff is None
        and facts.params_equal
        and facts.ranks_drift_from is None
        and facts.stopped_after is None
        and facts.resume_diff is None
    )
    first = facts.first_loss_diff
    if not args.no_plot:
        png = folder / "losses.png"
        if plot(
            png,
            losses,
            ref_losses,
            first,
            facts.steps_per_epoch,
            f"{shown(script)} against chapter 01",
        ):
            where = f"plot: {shown(png)}"
        else:
            where = "plot: none (matplotlib is not installed)"
    else:
        where = None
    ranks = f"on all {details['ranks']} ranks" if nproc > 1 else "in its one process"
    if same:
        resumed_text = (
            "; stopped at step 5 and resumed: the same end" if resumed is not None else ""
        )
        print(
            f"same run: all {STEPS} losses and the final parameters equal chapter 01's, {ranks}{resumed_text}"
        )
        if chapter in NOT_SEEN_HERE:
            print(f"note: {NOT_SEEN_HERE[chapter]}")
        if where:
            print(where)
        return 0
    print("not the same run:")
    if first is not None:
        if first in losses:
            a, b = losses[first], ref_losses[first]
            print(
                f"  the loss differs from step {first}: {a:.6f} here, {b:.6f} in chapter 01 "
                f"(by {abs(a - b):.2e}, relative {abs(a - b) / abs(b):.1e})"
            )
        else:
            print(f"  steps 1-{first - 1} are chapter 01's, then the script logged no more")
    elif not facts.params_equal:
        print(
            "  every loss equals chapter 01's, but the final parameters differ "
            f"(relative {details['distance']:.1e})"
        )
    if facts.stopped_after is not None:
        print(f"  the script stopped after step {facts.stopped_after}: {failure_line(run, script)}")
    if nproc > 1:
        if facts.ranks_drift_from is not None:
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
    mistake = diagnose(facts)
    if mistake is None:
        step = first or facts.ranks_drift_from or facts.resume_diff or STEPS
        print(
            f"diagnosis: differs from step {step}; no known signature "
            f"(the facts: {shown(folder / 'facts.json')})"
        )
    else:
        print(f"diagnosis: {mistake.name}: {mistake.did}")
        print(f"  {where_to_look(mistake, source, shown(script))}")
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
    p.add_argument("--no-resume", action="store_true", help="skip the stop-and-resume check")
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
