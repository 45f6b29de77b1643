"""Starting a script under the probe (tools/check/probe.py), as `python`, torchrun or two nodes of
torchrun, waiting for it, and reading what it left: its metrics, the probe's facts, its log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.launch import (
    REPO,
    child_env,
    free_port,
    shown_command,
    start_together,
    torchrun_command,
    wait_together,
)

PROBE_MODULE = "tools.check.probe"
# a collective that waits this long while the other ranks wait in others is a hang; the run's
# --dist-timeout ends it anyway after DIST_TIMEOUT
HANG_AFTER, DIST_TIMEOUT = 15, 60
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


@dataclass
class Started:
    procs: list[subprocess.Popen]
    run: Run
    nproc: int


def start(script: Path, launch: Launch, args: list[str], folder: Path, name: str) -> Started:
    facts, log = folder / f"{name}_facts", folder / f"{name}.log"
    commands = launch.commands([str(facts), str(script.resolve()), *args])
    # the CPU, even where GPUs are visible (chapter 03 would refuse --device cpu next to them)
    env = child_env(CUDA_VISIBLE_DEVICES="", **dict(launch.env))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if launch.nproc > 1:
        env["CHECK_HANG_AFTER"] = str(HANG_AFTER)
    out = log.open("w")
    for cmd in commands:
        out.write(f"$ {shown_command(cmd)}\n")
    out.flush()
    procs = start_together(commands, env, [out] * len(commands))
    out.close()  # each process holds its own copy
    return Started(procs, Run(folder / name, facts, log, -1), launch.nproc)


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


def finish(started: Started) -> Run:
    run, nproc = started.run, started.nproc
    run.status = wait_together(started.procs, RUN_TIMEOUT, give_up=lambda: end_hang(run, nproc))
    if run.status not in (0, 124) and run.finished_script(nproc):
        # every rank's script returned: what failed came after it (a process that aborted on its
        # way out of the interpreter), which is not the script's run
        with run.log.open("a") as log:
            log.write(f"check: exit status {run.status} after every rank's script had ended\n")
        run.status = 0
    return run


def stop(started: Started) -> None:
    wait_together(started.procs, 0, give_up=lambda: True)


def run_one(script: Path, launch: Launch, args: list[str], folder: Path, name: str) -> Run:
    return finish(start(script, launch, args, folder, name))


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
