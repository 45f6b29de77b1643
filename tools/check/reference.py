"""The run a check compares with: chapter 01's (in one process, with the global batch of 8), or,
where the plan says so (chapter 08, whose run is not chapter 01's), the chapter's own train.py run
as the check runs the script. Made once per version of the course and kept under the check's root,
keyed by a hash of everything it depends on; with the small corpus and the flags both runs take."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path

from common.chapters import CHAPTERS
from tools.check.plan import GLOBAL_BATCH, SEED, STEPS, Plan
from tools.check.runner import RUN_TIMEOUT, CannotRun, Launch, Run, failure_line, run_one
from tools.launch import REPO, flags

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
