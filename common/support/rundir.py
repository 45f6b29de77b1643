"""The run folder (--out-dir): one run at a time, and never another run's files overwritten."""

import errno
import fcntl
import os
import socket
from pathlib import Path

from .errors import CourseError

# The files of a run folder (common/checkpoint.py and common/metrics.py write the first two).
CKPT_NAME = "ckpt.pt"
METRICS_NAME = "metrics.jsonl"
# The claim: a lock on this regular file, and in it who holds it (host, process id, SLURM job id).
LOCK_NAME = "run.lock"
# fcntl.lockf holds across hosts on NFS (its server keeps it) and on Lustre with flock (its default
# since 2.12.3). Lustre's noflock (ENOSYS), NFSv3 without lockd (ENOLCK): no lock; COURSE_NO_LOCK=1
# runs without. NFS's nolock or local_lock=posix/all, Lustre's localflock: it holds on one host.
NO_LOCK = "COURSE_NO_LOCK"


def claim_out_dir(out_dir: str | Path, resume: bool) -> None:
    """Refuse a folder in use, or one holding a run without --resume; then lock it for as long as
    this process lives."""
    problem = folder_problem(Path(out_dir), resume)
    if problem is not None:
        raise CourseError(problem)


def folder_problem(out_dir: Path, resume: bool) -> str | None:
    """Claim the folder: what is wrong with it, if anything, or None once this process has locked
    it (it is this run's now)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # a descriptor never closed: the lock goes however the process ends (even kill -9), and closing
    # any descriptor of the file in this process would drop it
    lock = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.environ.get(NO_LOCK) != "1":
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        # another process has it (POSIX's two codes for that; EWOULDBLOCK is EAGAIN)
        if err.errno in (errno.EAGAIN, errno.EACCES):
            holder = os.pread(lock, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(lock)
            return (
                f"{out_dir} is in use by a run that is still going ({holder} holds its "
                f"{LOCK_NAME}); wait for it to end, or give this run another --out-dir"
            )
        os.close(lock)
        return (
            f"the file system of {out_dir} cannot lock the folder ({os.strerror(err.errno or 0)}): "
            f"use an --out-dir on another file system, or run with {NO_LOCK}=1 to go on without "
            "the lock, making sure no other run writes into this folder"
        )
    metrics = out_dir / METRICS_NAME
    if not resume and (
        (out_dir / CKPT_NAME).exists() or (metrics.exists() and metrics.stat().st_size > 0)
    ):
        os.close(lock)
        return (
            f"{out_dir} already holds a run (its {CKPT_NAME} / {METRICS_NAME}); continue it "
            f"with --resume, start a new run with another --out-dir, or delete {out_dir} first"
        )
    holder = f"host {socket.gethostname()} pid {os.getpid()}"
    if "SLURM_JOB_ID" in os.environ:
        holder += f" job {os.environ['SLURM_JOB_ID']}"
    os.ftruncate(lock, 0)
    os.pwrite(lock, f"{holder}\n".encode(), 0)
    return None
