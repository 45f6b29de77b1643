"""Chapter 01 from the command line, as a reader runs it: files, numbers, sampling, exact resume."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_run_args

from common.metrics import read_metrics
from common.model import GPT, GPTConfig
from tools.launch import run_python

SCRIPT = "01_single_gpu/train.py"
# The same schedule whether a run stops at 10 or goes on to 20 steps, so the runs can be compared.
SCHEDULE = dict(warmup_iters=5, lr_decay_iters=20, eval_interval=10)
TRAIN_KEYS = {"iter", "loss", "lr", "tokens_seen", "dt_ms", "tokens_per_sec"}


def train(data_dir, out_dir, max_iters, **flags):
    return run_python([SCRIPT, *tiny_run_args(data_dir, out_dir, max_iters, **(SCHEDULE | flags))])


def training_lines(out_dir):
    return [m for m in read_metrics(out_dir / "metrics.jsonl") if "loss" in m]


def eval_lines(out_dir):
    return [m for m in read_metrics(out_dir / "metrics.jsonl") if "val_loss" in m]


@pytest.fixture(scope="module")
def full_run(data_dir, tmp_path_factory):
    """An uninterrupted run of 20 steps with a final sample: the reference for the tests below."""
    out_dir = tmp_path_factory.mktemp("full")
    proc = train(data_dir, out_dir, 20, sample_tokens=12)
    return out_dir, proc


@pytest.mark.quick
def test_prints_the_global_batch(full_run):
    _, proc = full_run
    assert "global batch: 8 sequences x 32 tokens = 256 tokens per step" in proc.stdout
    assert "tiny" in proc.stdout
    assert "parameters" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.quick
def test_metrics_lines(full_run):
    out_dir, _ = full_run
    lines = training_lines(out_dir)
    assert [m["iter"] for m in lines] == list(range(1, 21))  # --log-interval 1: every step
    for m in lines:
        assert TRAIN_KEYS <= m.keys(), m
        assert m["tokens_seen"] == m["iter"] * 8 * 32
        assert math.isfinite(m["loss"])
        assert m["lr"] > 0
        assert m["dt_ms"] > 0
        assert m["tokens_per_sec"] > 0
        assert "mfu" not in m  # no peak is known for a CPU, so no MFU is claimed
    assert abs(lines[0]["loss"] - math.log(50304)) < 0.2  # the first loss: a uniform guess
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.3  # it learns
    assert max(m["lr"] for m in lines) == pytest.approx(2e-3, rel=1e-3)  # warm-up reaches --lr
    assert [m["iter"] for m in eval_lines(out_dir)] == [10, 20]
    assert all(math.isfinite(m["val_loss"]) for m in eval_lines(out_dir))


@pytest.mark.quick
def test_checkpoint_file(full_run):
    out_dir, _ = full_run
    ckpt = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)
    assert ckpt["iter_num"] == 20
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])
    config = GPTConfig(**ckpt["model_config"])
    assert (config.n_layer, config.n_embd, config.block_size) == (2, 32, 32)
    GPT(config).load_state_dict(ckpt["model"])  # strict: every weight has its place
    assert ckpt["optimizer"]["state"]  # AdamW's moments, to continue exactly
    assert ckpt["train_config"]["chapter"] == 1
    assert ckpt["train_config"]["global_batch"] == 8
    assert not list(out_dir.glob(".*tmp*")), "no temporary checkpoint left behind"


def final_sample(stdout: str) -> str:
    marker = "---- a sample from the model (12 tokens) ----\n"
    assert marker in stdout
    return stdout.split(marker, 1)[1]


def test_sampling_command(full_run):
    """`python -m common.sample` reads the checkpoint and, with the same settings, writes
    the same text."""
    out_dir, proc = full_run
    sample = run_python(
        ["-m", "common.sample", "--out-dir", out_dir, "--tokens", 12, "--device", "cpu"]
    )
    assert "# checkpoint of chapter 1 at step 20" in sample.stdout
    text = sample.stdout.split("\n", 1)[1].rsplit("---", 1)[0]
    assert text.strip()
    assert text.rstrip("\n") == final_sample(proc.stdout).rstrip("\n")
