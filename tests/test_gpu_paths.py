"""The GPU decisions, checked on the CPU with the facts real GPUs report.

No GPU runs these tests. Each GPU path is a small function of plain facts (a compute capability,
a device name, a thread's autocast state), driven here with the values that torch reports on real
hardware; bench/gpu_check.sh runs the same paths on a GPU.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import threading

import pytest
import torch

from common.chapters import CHAPTERS
from common.checkpoint import load_checkpoint, restore_training_state, write_checkpoint
from common.dataparallel import choose_dataparallel_gpus, in_autocast
from common.device import auto_dtype, pick_dtype
from common.metrics import Throughput
from common.model import GPT, model_config
from common.support.corpus import shakespeare_texts
from common.support.errors import CourseError
from common.support.gpus import peak_flops
from layout import REPO
from tools.launch import run_torchrun

# ---- 1. DataParallel's replica threads and autocast's per-thread number format ---------------


def run_like_parallel_apply(module, x: torch.Tensor, autocast_enabled: bool) -> torch.dtype:
    """What torch/nn/parallel/parallel_apply.py does with each replica: a new thread that turns
    autocast on with `torch.amp.autocast(device_type, enabled=...)`, no dtype, and calls it."""
    seen = {}

    def worker():
        with torch.amp.autocast("cpu", enabled=autocast_enabled):
            seen["dtype"] = module(x).dtype

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return seen["dtype"]


def test_a_new_thread_forgets_the_autocast_dtype_and_in_autocast_restores_it():
    cpu = torch.device("cpu")
    # what a fresh thread gets (float16 for CUDA, bfloat16 here)
    default = torch.get_autocast_dtype("cpu")
    # the run chose the other one
    chosen = torch.float16 if default == torch.bfloat16 else torch.bfloat16
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=chosen):
        enabled = torch.is_autocast_enabled("cpu")
        # the trap: the replica's thread computes in the default format, not the chosen one
        assert run_like_parallel_apply(torch.nn.Linear(8, 8), x, enabled) == default
        # the fix chapter 03 uses: the replica enters autocast itself, inside its thread
        assert (
            run_like_parallel_apply(in_autocast(torch.nn.Linear(8, 8), cpu, chosen), x, enabled)
            == chosen
        )
    # and float32 stays float32 (no autocast entered)
    assert (
        run_like_parallel_apply(in_autocast(torch.nn.Linear(8, 8), cpu, torch.float32), x, False)
        == torch.float32
    )


def load_chapter03():
    spec = importlib.util.spec_from_file_location(
        "chapter03_train", REPO / "03_dataparallel" / "train.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the class and main(); main() does not run
    return module


def test_chapter03_dataparallel_hands_its_threads_replicas_in_the_chosen_dtype(monkeypatch):
    """nn.DataParallel.parallel_apply needs GPUs; here the function above plays its threads."""
    chapter03 = load_chapter03()
    chosen = torch.float16 if torch.get_autocast_dtype("cpu") == torch.bfloat16 else torch.bfloat16
    seen = []

    def threads_like_torch(self, replicas, inputs, kwargs):
        seen.extend(
            run_like_parallel_apply(r, *i, autocast_enabled=True) for r, i in zip(replicas, inputs)
        )
        return []

    monkeypatch.setattr(torch.nn.DataParallel, "parallel_apply", threads_like_torch)
    dp = chapter03.AutocastDataParallel(torch.nn.Linear(8, 8), torch.device("cpu"), chosen)
    replicas = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    dp.parallel_apply(replicas, [(torch.randn(2, 8),), (torch.randn(2, 8),)], [{}, {}])
    assert seen == [chosen, chosen]
    # checkpoints still use model.module
    assert isinstance(dp, torch.nn.DataParallel)
    assert dp.module is not None


def test_chapter03_gpu_choice_for_machines_this_cpu_is_not():
    """The GPUs DataParallel spreads over, from the machine's GPU count, and the settings
    it refuses with one line."""
    cuda = torch.device("cuda")
    assert choose_dataparallel_gpus(cuda, None, False, cuda_gpus=4) == [0, 1, 2, 3]
    assert choose_dataparallel_gpus(cuda, 2, False, cuda_gpus=4) == [0, 1]
    # one GPU is the one --device named
    assert choose_dataparallel_gpus(torch.device("cuda", 1), 1, True, cuda_gpus=4) == [1]
    assert choose_dataparallel_gpus(torch.device("cpu"), None, True, cuda_gpus=0) == []
    refused = {
        "--gpus 5, but only 4 CUDA GPU(s) are visible: ask for at most 4": (cuda, 5, False, 4),
        "--gpus 2: DataParallel splits over CUDA GPUs, and this run's device is cpu; drop --gpus": (
            torch.device("cpu"),
            2,
            False,
            0,
        ),
        "this run's device is cpu; drop --gpus to train on the cpu": (
            torch.device("cpu"),
            2,
            False,
            2,
        ),
        "hide them with CUDA_VISIBLE_DEVICES=": (torch.device("cpu"), None, False, 2),
        "gathers on cuda:0: use --device cuda": (torch.device("cuda", 1), None, False, 2),
        "--compile cannot speed up DataParallel": (cuda, None, True, 2),
    }
    for message, (device, requested, compile, cuda_gpus) in refused.items():
        with pytest.raises(CourseError, match=re.escape(message)):
            choose_dataparallel_gpus(device, requested, compile, cuda_gpus)


# ---- 2. MFU counts every device's tokens against every device's peak -------------------------


def test_mfu_divides_by_the_peak_of_all_devices():
    # 4 devices, 1,000 tokens each per step
    speed = Throughput(4 * 1000, 1e9, torch.device("cpu"), torch.float32, devices=4)
    speed.peak = 1e15  # each device's, as if the table knew this one
    speed.since -= 1.0  # 10 steps in about a second
    figures = speed.measure(10)
    assert figures["mfu"] == pytest.approx(1e9 * figures["tokens_per_sec"] / (4 * 1e15))
    speed.peak = None  # unknown device: no MFU
    speed.since -= 1.0
    assert speed.measure(20)["mfu"] is None
    # and every chapter that spreads tokens over devices says over how many
    for script, devices in (
        ("03_dataparallel", "replicas"),
        ("04_ddp", "world_size"),
        ("05_multinode", "world_size"),
        ("06_fault_tolerance", "world_size"),
    ):
        calls = [
            node
            for node in ast.walk(ast.parse((REPO / script / "train.py").read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Throughput"
        ]
        assert len(calls) == 1, script
        # devices: Throughput's fifth argument, by position or by name
        given = [ast.unparse(a) for a in calls[0].args[4:5]]
        given += [ast.unparse(k.value) for k in calls[0].keywords if k.arg == "devices"]
        assert given == [devices], script


# ---- 3. --dtype auto from the compute capability ---------------------------------------------


@pytest.mark.parametrize(
    "gpu, capability, expected",
    [
        ("Tesla V100", (7, 0), torch.float16),  # bfloat16 only emulated: slow, and compile skips it
        ("Tesla T4", (7, 5), torch.float16),
        ("A100", (8, 0), torch.bfloat16),
        ("RTX 3090", (8, 6), torch.bfloat16),
        ("L4 / L40S / RTX 4090", (8, 9), torch.bfloat16),
        ("H100 / H200", (9, 0), torch.bfloat16),
    ],
)
def test_auto_dtype_follows_bf16_tensor_cores(gpu, capability, expected):
    assert auto_dtype(capability) == expected, gpu


def test_auto_dtype_is_float32_off_cuda():
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("auto", torch.device("mps")) == torch.float32


# ---- 9. the peak-FLOPs table, looked up with the names torch.cuda.get_device_name returns -----

DEVICE_NAMES = {  # name -> its bfloat16 peak: the variants and look-alike names tell apart
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L40": 181e12,
    "NVIDIA L4": 121e12,
    "NVIDIA GeForce RTX 4090": 165e12,
    "Tesla T4": None,  # no bfloat16 tensor cores: no bf16 peak to claim
    "Tesla V100-SXM2-32GB": None,
}


@pytest.mark.parametrize("name", DEVICE_NAMES)
def test_peak_flops_lookup_by_real_device_names(name):
    assert peak_flops(name, torch.bfloat16) == DEVICE_NAMES[name]


def test_float16_peaks_of_older_gpus_and_unknown_gpus():
    assert peak_flops("Tesla T4", torch.float16) == 65e12
    assert peak_flops("Tesla V100-SXM2-32GB", torch.float16) == 125e12
    # the variant, not the bare name
    assert peak_flops("Tesla V100-PCIE-16GB", torch.float16) == 112e12
    assert peak_flops("NVIDIA RTX A6000", torch.bfloat16) is None  # not in the table: no guess


# ---- 8. a resumed GPU run continues exactly: loss scale and GPU random state in the checkpoint --


def test_checkpoint_keeps_the_loss_scaler_and_cuda_rng(tmp_path):
    config = model_config("tiny")
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A float16 run's scaler (the CPU's GradScaler works the same way): two overflowing steps
    # cut the loss scale from 65,536 to 16,384.
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    tokens = torch.randint(0, 100, (1, 8))
    for _ in range(2):
        _, loss = model(tokens, tokens)
        scaler.scale(loss).backward()
        model.lm_head.weight.grad.fill_(float("inf"))  # as if float16 had overflowed
        scaler.step(optimizer)  # skipped: inf gradients
        scaler.update()
        optimizer.zero_grad()
    assert scaler.get_scale() == 16384.0

    def saved_and_loaded(iter_num: int, scaler: torch.amp.GradScaler) -> dict:
        states = {"model_state": model.state_dict(), "optimizer_state": optimizer.state_dict()}
        write_checkpoint(
            tmp_path,
            **states,
            iter_num=iter_num,
            model_config=config,
            train_config={},
            scaler_state=scaler.state_dict(),
        )
        return load_checkpoint(tmp_path)

    checkpoint = saved_and_loaded(7, scaler)
    assert checkpoint["scaler"]["scale"] == 16384.0
    # this process never used CUDA; on a GPU it holds its generator
    assert checkpoint["rng_cuda"] is None

    resumed = torch.amp.GradScaler("cpu", init_scale=65536.0)
    assert (
        restore_training_state(checkpoint, torch.optim.AdamW(model.parameters(), lr=1e-3), resumed)
        == 7
    )
    assert resumed.get_scale() == 16384.0  # not back at 65,536

    # a bfloat16/float32 run has a disabled scaler: it saves nothing and loads nothing
    checkpoint = saved_and_loaded(8, torch.amp.GradScaler("cpu", enabled=False))
    assert checkpoint["scaler"] == {}
    assert (
        restore_training_state(checkpoint, torch.optim.AdamW(model.parameters(), lr=1e-3), resumed)
        == 8
    )
    assert resumed.get_scale() == 16384.0  # an empty state leaves an enabled scaler as it was


def test_every_chapter_saves_the_scaler_and_restores_through_one_function():
    for chapter in CHAPTERS.values():
        tree = ast.parse((REPO / chapter / "train.py").read_text())
        calls = {getattr(n.func, "id", None): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert "restore_training_state" in calls, chapter
        # chapter 07 gathers its shards first; every other chapter saves its own copy
        save = calls.get("save_checkpoint") or calls["gather_and_save"]
        assert "scaler" in [getattr(a, "id", None) for a in save.args], chapter


# ---- 6. preparing the data may take longer than a training collective may wait ---------------


def test_ranks_wait_for_data_preparation_longer_than_dist_timeout(tmp_path):
    """Rank 1 waits while rank 0 tokenizes a corpus that takes longer than --dist-timeout: the wait
    has its own long timeout, so the run goes on instead of failing at the barrier."""
    play = shakespeare_texts()[0]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(play * 200)  # ~5M tokens: tokenizing them in one process takes well over 2 s
    proc = run_torchrun(
        "04_ddp/train.py",
        2,
        [
            "--preset",
            "tiny",
            "--max-iters",
            1,
            "--eval-batches",
            1,
            "--sample-tokens",
            0,
            "--batch-size",
            2,
            "--device",
            "cpu",
            "--dataset",
            corpus,
            "--num-proc",
            1,
            "--dist-timeout",
            2,
            "--data-dir",
            tmp_path / "data",
            "--out-dir",
            tmp_path / "out",
        ],
        timeout=300,
    )
    assert "prepared" in proc.stdout
    assert "parameters identical on all 2 rank(s): yes" in proc.stdout
