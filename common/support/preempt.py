"""A scheduler's stop signal ends a run at a step's end, with a checkpoint of that step.

SLURM and Kubernetes send SIGTERM (SLURM: or the signal chosen with `sbatch --signal`) some time
before they stop a job, then SIGKILL. Stopping at once would lose every step since the last
checkpoint. Instead, a chapter's loop asks once per step:

    if preemption.requested():   # SIGTERM, or --stop-signal, arrived during this step
        save(iter_num)           # the chapter's own checkpoint (rank 0 writes it)
        preemption.stop(iter_num)

and the run ends with one line and exit status 75 (errors.EXIT_STOPPED), which says: stopped on purpose,
continue with --resume. The resumed run continues exactly where it stopped.

What falls back to the immediate stop (common/support/errors.py: run_main's one line, status 130,
the last checkpoint intact):
- a second stop signal, more than SAME_STOP_S seconds after the first (a scheduler that has run
  out of patience, or a reader who means it); Ctrl-C (SIGINT) always stops at once;
- a rank that cannot finish its step: one waiting in a collective for a peer that died fails when
  the process group's timeout (--dist-timeout) runs out, and a launcher ends a rank that takes too
  long with SIGKILL (torchrun waits 30 s). Neither breaks anything: a checkpoint is written to a
  temporary file and renamed, so ckpt.pt is always a whole checkpoint, the new one or the last.
"""

from __future__ import annotations

import argparse
import signal
import time

import torch
import torch.distributed as dist

from .errors import Stopped

# A launcher passes a signal on to its workers, which may have had it already: torchrun passes on
# the SIGTERM that the whole process group got, srun the one that SLURM sent to every process of the
# job step. Repeats this close to the first are the same request, not a second one.
SAME_STOP_S = 5.0
NOT_STOP_SIGNALS = {"SIGINT": "Ctrl-C stops at once", "SIGKILL": "it cannot be caught", "SIGSTOP": ""}


def stop_signal(name: str) -> str:
    """--stop-signal: a signal's name, with or without SIG (USR1, SIGUSR1, TERM), as SIGNAME."""
    full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    if not hasattr(signal.Signals, full) or full in NOT_STOP_SIGNALS:
        why = f" ({NOT_STOP_SIGNALS[full]})" if NOT_STOP_SIGNALS.get(full) else ""
        raise argparse.ArgumentTypeError(
            f"{name} cannot ask the run to stop{why}; use TERM, USR1, USR2 or HUP"
        )
    return full


class Preemption:
    """Listens for SIGTERM and `signal_name`; tells the loop, after a step, whether to save and stop.

    With `agree_on` (the device of a process group's collectives) the ranks agree on the step:
    a signal reaches them at slightly different times, and a rank that stopped alone would leave
    the others waiting for it in the next collective.
    """

    def __init__(self, signal_name: str = "SIGTERM", agree_on: torch.device | None = None):
        self.agree_on = agree_on
        self.received: str | None = None  # the first stop signal's name
        self._received_at = 0.0
        # run_main's handler of SIGINT stops at once and remembers the signal for its line; a
        # second stop signal is passed to it (outside run_main there is none: KeyboardInterrupt)
        self._stop_now = signal.getsignal(signal.SIGINT)
        for name in {"SIGTERM", stop_signal(signal_name)}:
            signal.signal(signal.Signals[name], self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._received_at = signal.Signals(signum).name, now
            note = getattr(self._stop_now, "note", None)
            if note is not None:
                note(signum)  # a collective that fails from now on is part of this stop
            return
        if now - self._received_at < SAME_STOP_S:
            return  # the same request, passed on by a launcher
        if callable(self._stop_now):
            self._stop_now(signum, frame)
        raise KeyboardInterrupt

    def requested(self) -> bool:
        """Whether the run should save this step and stop; the same answer on every rank."""
        if self.agree_on is None:
            return self.received is not None
        # One number per step, summed over the ranks: little next to the gradients DDP all-reduces
        # in every step. Reading it back makes the host wait for the step to end on the GPU before
        # it queues the next one: the GPU idles while the next step's first kernels are launched.
        flag = torch.tensor(float(self.received is not None), device=self.agree_on)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)  # SUM works on every backend
        return flag.item() > 0

    def stop(self, step: int) -> None:
        """End the run after the checkpoint of `step` is written: raises Stopped for run_main."""
        speaks = True
        if self.agree_on is not None:
            dist.barrier()  # rank 0 has written the checkpoint before any rank ends
            speaks = dist.get_rank() == 0
        raise Stopped(self.received or "another rank's stop signal", step, speaks)
