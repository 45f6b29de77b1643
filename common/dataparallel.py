"""What chapter 03 adds to common/: `in_autocast`, which the chapter teaches
(docs/deep/AUTOCAST_TRAP.md), which GPUs nn.DataParallel may spread over, and the mean of its
replicas' losses, which it does not.

DataParallel runs one replica per GPU in the device_ids it is given, gathers on the first one,
and runs its replicas in threads. Each of those facts refuses a setting that would otherwise
fail deep inside torch, or silently train somewhere else; the refusals live here, as one call.
"""

from __future__ import annotations

import torch

from .device import autocast_context
from .support.errors import CourseError


def in_autocast(module, device: torch.device, dtype: torch.dtype):
    """`module` called inside autocast, which DataParallel's replica threads lose (the trap
    that docs/deep/AUTOCAST_TRAP.md describes)."""

    def call(*args, **kwargs):
        with autocast_context(device, dtype):
            return module(*args, **kwargs)

    return call


def choose_dataparallel_gpus(
    device: torch.device, requested: int | None, compile: bool, cuda_gpus: int
) -> list[int]:
    """The GPU numbers DataParallel spreads over, or [] on a machine without a CUDA GPU.

    `requested` is --gpus (None: every visible GPU); one GPU is the one --device named (cuda:1
    trains on GPU 1 alone). `cuda_gpus` is the machine's count, torch.cuda.device_count(), as a
    plain number, so the tests can check the choice on a CPU for machines they do not have.
    """
    visible_gpus = 0
    if device.type == "cuda":
        visible_gpus = cuda_gpus
    n_gpus = requested or visible_gpus
    if requested and device.type != "cuda":
        raise CourseError(
            f"--gpus {requested}: DataParallel splits over CUDA GPUs, and this run's device is "
            f"{device.type}; drop --gpus to train on the {device.type}"
        )
    if requested and requested > visible_gpus:
        raise CourseError(
            f"--gpus {requested}, but only {visible_gpus} CUDA GPU(s) are visible: ask for at most "
            f"{visible_gpus} (CUDA_VISIBLE_DEVICES chooses which)"
        )
    # DataParallel would take the GPUs anyway, whatever --device says
    if device.type == "cpu" and cuda_gpus > 0:
        raise CourseError(
            "DataParallel takes every visible GPU: "
            "to train on the CPU here, hide them with CUDA_VISIBLE_DEVICES="
        )
    if n_gpus > 1 and device.index not in (None, 0):
        raise CourseError("with several GPUs DataParallel gathers on cuda:0: use --device cuda")
    if n_gpus > 1 and compile:
        # torch.compile works per thread, and the replicas run in threads it never enters
        raise CourseError(
            "--compile cannot speed up DataParallel over several GPUs: its replicas run in threads "
            "that compiled code does not reach; drop --compile, or compile under DDP in chapter 04"
        )
    if n_gpus == 0:
        # no CUDA GPU: DataParallel calls the model as it is
        return []
    if n_gpus == 1:
        # one GPU: the one --device chose
        return [device.index or 0]
    return list(range(n_gpus))


def mean_of_replicas(losses: torch.Tensor, sequences: int) -> torch.Tensor:
    """The mean loss of a batch of `sequences`, from the losses DataParallel's replicas return.

    Each replica returns the mean loss of its share of the batch, and DataParallel cuts the batch
    as torch.chunk does: shares of ceil(sequences / GPUs), the last one smaller when they do not
    divide. The mean of the replicas' means is the batch's mean only when every share is as large,
    which is when `sequences` is a multiple of the losses' count; any other batch is refused.
    Without GPUs the model returns one loss, the batch's own.
    """
    replicas = losses.numel()
    if sequences % replicas != 0:
        raise CourseError(
            f"a batch of {sequences} sequences does not split evenly over DataParallel's "
            f"{replicas} replicas, so the mean of their losses is not the batch's: give every "
            "batch a multiple of the GPUs' count of sequences"
        )
    return losses.mean()
