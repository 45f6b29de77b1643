"""The run folder (--out-dir): one run at a time, and never another run's files overwritten."""

import errno
import fcntl
import os
from pathlib import Path

import torch.distributed as dist

from ..checkpoint import CKPT_NAME
from ..metrics import METRICS_NAME
from .errors import CourseError

# On NFS a flock keeps out only the same machine's processes. Lustre without flock (ENOSYS) and NFS
# without its lock service (ENOLCK) cannot lock: COURSE_NO_LOCK=1 goes on without it.
NO_LOCK = "COURSE_NO_LOCK"


def claim_out_dir(out_dir: str | Path, resume: bool) -> None:
    """Refuse a folder in use, or holding a run without --resume; lock it while this process lives."""
    distributed = dist.is_available() and dist.is_initialized()
    verdict = [_claim(Path(out_dir), resume) if not distributed or dist.get_rank() == 0 else None]
    if distributed:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise CourseError(verdict[0])


def _claim(out_dir: Path, resume: bool) -> str | None:
    """What is wrong with the folder, if anything (None: it is this run's now)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # a flock, by a descriptor never closed: dropped however the process ends (even kill -9)
    lock = os.open(out_dir, os.O_RDONLY)
    try:
        if os.environ.get(NO_LOCK) != "1":
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(lock)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):  # another process holds the lock
            return (
                f"{out_dir} is in use by a run that is still going (it holds a lock on the folder); "
                "wait for it to end, or give this run another --out-dir"
            )
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
