"""Start course scripts the way a reader does: as real processes, under real torchrun."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """The environment for a child process: one thread per process, since ranks share 2 cores."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def run_python(args: list[str], timeout: float = 300, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository root, as the README shows it."""
    proc = subprocess.run(
        [sys.executable, *map(str, args)], cwd=REPO, env=child_env(**env),
        capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"python {' '.join(map(str, args))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def torchrun_command(script: str | Path, nproc: int, args: list[str], nnodes: int = 1,
                     node_rank: int = 0, port: int | None = None, extra: list[str] | None = None,
                     rdzv_id: str | None = None) -> list[str]:
    """A torchrun command line on 127.0.0.1. One node: --standalone unless a port is given.

    With rdzv_id: elastic c10d rendezvous, the same line on every node (no node rank, no master).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and port is None:
        cmd.append("--standalone")
    elif rdzv_id is not None:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={rdzv_id}"]
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
                f"--master-port={port}"]
    cmd += list(extra or [])
    return cmd + [str(script), *map(str, args)]


def run_torchrun(script: str | Path, nproc: int, args: list[str], timeout: float = 300, check: bool = True,
                 **kw) -> subprocess.CompletedProcess:
    cmd = torchrun_command(script, nproc, args, **kw)
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def stop_launchers(procs: list[subprocess.Popen]) -> None:
    """Stop torchrun launchers that are still running, started with start_new_session=True.

    torchrun passes SIGTERM on to the processes it started; a launcher that does not end within
    15 s has its whole process group killed, so no worker outlives its test.
    """
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
