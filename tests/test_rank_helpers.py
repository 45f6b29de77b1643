"""The decisions chapters 04 to 07 take from common/ (GPU per rank, shared GPUs, CPU threads,
retired flags, copies that differ), checked for machines this CPU is not, from plain numbers."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.config import CourseParser
from common.distributed import (
    cpu_threads_per_rank,
    one_rank_first,
    ranks_sharing_a_gpu,
    ranks_unlike_rank0,
    ranks_use_gpus,
)
from common.support.errors import CourseError
from tools.launch import free_port

# (--device, LOCAL_RANK, LOCAL_WORLD_SIZE, visible CUDA GPUs) -> the ranks drive GPUs, or the error
GPU_DECISIONS = [
    # every rank of an 8-GPU node (the second node's ranks 8-15 are its local ranks 0-7)
    *[("auto", local_rank, 8, 8, True) for local_rank in range(8)],
    *[("cuda", local_rank, 8, 8, True) for local_rank in range(8)],
    ("auto", 8, 9, 8, r"LOCAL_RANK 8, but this machine has 8 GPU\(s\).*--nproc_per_node"),
    # one visible GPU and LOCAL_RANK 1 or more: several ranks on one GPU, refused before NCCL
    *[
        (device, rank, 8, 1, rf"LOCAL_RANK {rank}, but this machine has 1 GPU\(s\)")
        for device in ("auto", "cuda")
        for rank in (1, 3, 7)
    ],
    ("auto", 0, 1, 1, True),
    # a named GPU: every rank takes cuda:LOCAL_RANK
    ("cuda:1", 0, 1, 2, "every rank takes cuda:LOCAL_RANK; use --device cuda"),
    ("cuda:1", 0, 2, 2, "every rank takes cuda:LOCAL_RANK; use --device cuda"),
    ("cuda:3", 0, 1, 2, r"--device cuda:3: only 2 CUDA GPU\(s\) are visible"),
    ("auto", 1, 2, 0, False),
    ("cpu", 1, 2, 8, False),
    ("cuda", 0, 2, 0, "sees no CUDA GPU; use --device cpu"),
    ("mps", 0, 1, 0, "mps"),  # NCCL and gloo cannot send Apple's GPU tensors
]


@pytest.mark.parametrize("device, local_rank, local_world, gpus, expected", GPU_DECISIONS)
def test_which_ranks_drive_gpus(device, local_rank, local_world, gpus, expected, capsys):
    if isinstance(expected, bool):
        assert ranks_use_gpus(device, local_rank, local_world, cuda_gpus=gpus) == expected
        assert capsys.readouterr().out == ""  # silently
    else:
        with pytest.raises(CourseError, match=expected):
            ranks_use_gpus(device, local_rank, local_world, cuda_gpus=gpus)


def test_ranks_that_share_a_gpu_are_found_from_their_hosts_and_gpu_ids():
    distinct = [("node-a", "GPU-0"), ("node-a", "GPU-1"), ("node-b", "GPU-0"), ("node-b", "GPU-1")]
    # the same GPU id on two machines is two GPUs
    assert ranks_sharing_a_gpu(distinct) == []
    # two torchruns on one machine that both count from cuda:0 (two simulated nodes)
    doubled = [("node-a", "GPU-0"), ("node-a", "GPU-1"), ("node-a", "GPU-0"), ("node-a", "GPU-1")]
    assert ranks_sharing_a_gpu(doubled) == [[0, 2], [1, 3]]
    # ranks without a GPU share nothing
    assert ranks_sharing_a_gpu([("node-a", None), ("node-a", None)]) == []


@pytest.mark.parametrize(
    "ranks, cores, omp, expected",
    [
        (2, 16, None, 8),  # torch alone would give each rank all 16
        (2, 16, "1", 8),  # torchrun's OMP_NUM_THREADS=1 would leave 14 idle
        (3, 2, None, 1),  # never fewer than one
        (2, 16, "4", None),  # the reader's own choice stays
        (1, 16, None, None),  # a single rank has the CPU to itself
    ],
)
def test_ranks_on_one_cpu_share_its_cores(ranks, cores, omp, expected):
    assert cpu_threads_per_rank(ranks, cores, omp) == expected


def test_a_retired_flag_is_refused_after_its_last_chapter():
    for chapter, script in ((4, "04_ddp/train.py"), (6, "06_fault_tolerance/train.py")):
        with pytest.raises(CourseError) as refused:
            CourseParser(chapter=chapter, description="").parse_args(["--gpus", "2"])
        message = str(refused.value)
        assert message.startswith("--gpus is chapter 03's DataParallel flag"), message
        assert message.endswith(f"torchrun --standalone --nproc_per_node=N {script}"), message


def _count_differing_copies(rank: int, port: int, results) -> None:
    """One rank of a real gloo group of two on 127.0.0.1, with copies that start equal, then not."""
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        groups_before = len(dist.distributed_c10d._world.pg_map)
        with one_rank_first(rank == 0):
            pass
        # its side group is destroyed once done: no connections left open for the whole run
        results[rank, "side groups left"] = len(dist.distributed_c10d._world.pg_map) - groups_before
        for same_start in (True, False):
            torch.manual_seed(0 if same_start else rank)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
            results[rank, same_start] = ranks_unlike_rank0(model)
        # the same start, and rank 1's last weight one float32 step away: the copies differ
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        if rank == 1:
            with torch.no_grad():
                last = model[1].bias
                last[-1] = torch.nextafter(last[-1], torch.tensor(float("inf")))
        results[rank, "one bit"] = ranks_unlike_rank0(model)
    finally:
        dist.destroy_process_group()


def test_ranks_unlike_rank0_counts_the_copies_that_differ():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_count_differing_copies, args=(free_port(), results), nprocs=2)
        # every rank hears the same count: each can print the verdict, or act on it
        assert dict(results) == {
            (0, True): 0,
            (1, True): 0,
            (0, False): 1,
            (1, False): 1,
            (0, "one bit"): 1,
            (1, "one bit"): 1,
            (0, "side groups left"): 0,
            (1, "side groups left"): 0,
        }
