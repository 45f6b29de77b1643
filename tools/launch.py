"""Starting the chapters' scripts as a reader does: `python X`, `torchrun X`, or two torchruns as
two nodes. The tests, the benchmark, the notebooks and the checker start runs through this; no
chapter imports it."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from layout import REPO

# `torchrun` is `python -m torch.distributed.run`: this spelling uses the running Python, whatever
# environment it is in, where a bare `torchrun` could find another one on the PATH.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(threads: int | None = 1, **extra: str) -> dict[str, str]:
    """A started run's environment: `threads` torch threads a process (None: torch's choice)."""
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if threads is None:
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


def torchrun_command(
    script: str | Path,
    nproc: int,
    args: list,
    nnodes: int = 1,
    node_rank: int = 0,
    port: int | None = None,
    extra: list[str] | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """A torchrun command line on 127.0.0.1: --standalone for one node without a port; else a static
    rendezvous at 127.0.0.1:port with this node's rank, or with rdzv_id the c10d one."""
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}"]
    if nnodes == 1 and port is None:
        cmd.append("--standalone")
    elif rdzv_id is not None:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
        cmd.append(f"--rdzv-id={rdzv_id}")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1"]
        cmd.append(f"--master-port={port}")
    cmd += list(extra or [])
    return cmd + [str(script), *map(str, args)]


def two_node_commands(script: str | Path, nproc_per_node: int, args: list) -> list[list[str]]:
    """Two torchruns that meet on 127.0.0.1, one per node, as two machines would over a network."""
    port = free_port()
    return [
        torchrun_command(script, nproc_per_node, args, nnodes=2, node_rank=node, port=port)
        for node in (0, 1)
    ]


def shown_command(cmd: list) -> str:
    """A command as a reader would type it: `python`, `torchrun`, paths relative to the root."""
    words = [str(word) for word in cmd]
    if words[: len(TORCHRUN)] == TORCHRUN:
        words = ["torchrun", *words[len(TORCHRUN) :]]
    elif words and words[0] == sys.executable:
        words[0] = "python"
    return " ".join(shlex.quote(word.replace(f"{REPO}/", "")) for word in words)


def run_command(
    cmd: list[str], env: dict, timeout: float, check: bool
) -> subprocess.CompletedProcess:
    """Run from the repository root; check=True fails as a test assertion does, with the output."""
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{shown_command(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def run_python(
    args: list, timeout: float = 300, check: bool = True, **env: str
) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository root, as the README shows it, with one thread."""
    return run_command([sys.executable, *map(str, args)], child_env(**env), timeout, check)


def run_torchrun(
    script: str | Path, nproc: int, args: list, timeout: float = 300, check: bool = True, **kw
) -> subprocess.CompletedProcess:
    """`torchrun --standalone` (or the rendezvous `kw` asks for), one thread a rank."""
    return run_command(torchrun_command(script, nproc, args, **kw), child_env(), timeout, check)


def stop_launchers(procs: list[subprocess.Popen], grace: float = 15) -> None:
    """Stop launchers still running (each started with start_new_session=True): SIGTERM, which
    torchrun passes on; after `grace` seconds, or once the launcher has ended, its whole process
    group killed, so nothing it started (a compile's helpers, a shell's children) outlives it."""
    for proc in procs:
        if proc.poll() is not None:
            continue
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_together(commands: list[list[str]], env: dict, logs: list) -> list[subprocess.Popen]:
    """Start the commands at once (the nodes of one run), each writing to its open log, each a
    launcher in a session of its own (stop_launchers ends it with everything it started)."""
    return [
        subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        for cmd, log in zip(commands, logs)
    ]


def wait_together(
    procs: list[subprocess.Popen], timeout: float, give_up: Callable[[], bool] | None = None
) -> int:
    """Wait for all the started commands: the first non-zero exit status, else 0. Whatever still
    runs is stopped when one fails (the others would wait for it), after `timeout` seconds (124), or
    when give_up() says so (a hang the caller recognised)."""
    deadline = time.monotonic() + timeout
    try:
        while any(proc.poll() is None for proc in procs):
            failed = [proc.returncode for proc in procs if proc.poll() not in (None, 0)]
            if failed:
                return failed[0]
            if time.monotonic() > deadline:
                return 124
            if give_up is not None and give_up():
                return 1
            time.sleep(0.25)
        return next((proc.returncode for proc in procs if proc.returncode != 0), 0)
    finally:
        stop_launchers(procs, grace=5)


def run_together(commands: list[list[str]], env: dict, logs: list, timeout: float) -> int:
    """start_together, then wait_together: the first non-zero exit status (124 after `timeout`
    seconds), else 0."""
    return wait_together(start_together(commands, env, logs), timeout)


def flags(**values) -> list[str]:
    """Flags from keyword arguments: max_iters=30 -> --max-iters 30; True: the bare flag; False and
    None: left out."""
    words = []
    for name, value in values.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return words


def measured_run_flags(iters: int, log_interval: int, eval_batches: int, **more) -> list[str]:
    """The flags of a run made for its numbers: one evaluation, at the end; no sample, no dropout;
    `more` as flags() takes them."""
    return flags(
        max_iters=iters,
        log_interval=log_interval,
        eval_interval=iters,
        eval_batches=eval_batches,
        sample_tokens=0,
        dropout=0,
        **more,
    )


def launch_commands(launch: str, script: str | Path, nproc: int, args: list) -> list[list[str]]:
    """One run's command lines, one per node: "python", "torchrun" (nproc processes) or
    "two_nodes" (two torchruns of nproc // 2 each)."""
    if launch == "python":
        return [[sys.executable, str(script), *map(str, args)]]
    if launch == "torchrun":
        return [torchrun_command(script, nproc, args)]
    if launch == "two_nodes":
        return two_node_commands(script, nproc // 2, args)
    raise ValueError(f"unknown launch {launch!r}: python, torchrun or two_nodes")
