"""ckpt.pt: plain tensors read with weights_only=True, written so that a crash loses nothing."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from common.checkpoint import (
    check_same_shape,
    clean_state_dict,
    gpu_rng_plan,
    load_checkpoint,
    write_checkpoint,
)
from common.model import GPT, PRESETS, GPTConfig, model_config
from common.support.errors import CourseError
from common.training import build_model
from tools.launch import run_python


def save_tiny(out_dir: Path, iter_num: int, model: GPT | None = None, **train_config) -> GPT:
    model = model or GPT(PRESETS["tiny"])
    optimizer = torch.optim.AdamW(model.parameters())
    write_checkpoint(
        out_dir,
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        iter_num=iter_num,
        model_config=model.config,
        train_config={"seed": 1, **train_config},
    )
    return model


def test_round_trip_with_weights_only(tmp_path):
    # only plain values of the training configuration are kept, since a Path or an object
    # would need pickled code
    model = save_tiny(tmp_path, 7, data_dir="data", lr=0.5, a_path=tmp_path, an_object=object())
    raw = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert raw["iter_num"] == 7
    assert raw["train_config"] == {"seed": 1, "data_dir": "data", "lr": 0.5}
    ckpt = load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 7  # the folder or the file
    check_same_shape(ckpt, model_config("tiny", dropout=0.1))  # dropout is not part of the shape
    restored = GPT(GPTConfig(**ckpt["model_config"]))
    restored.load_state_dict(ckpt["model"])
    for (name, a), (_, b) in zip(model.state_dict().items(), restored.state_dict().items()):
        assert torch.equal(a, b), name
    assert isinstance(ckpt["rng_cpu"], torch.Tensor)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # the temporary file was renamed


def test_wrapper_prefixes_removed():
    state = {
        "module.lm_head.weight": 1,
        "_orig_mod.module.ln_f.bias": 2,
        "transformer.h.0.ln_1.weight": 3,
    }
    assert clean_state_dict(state) == {
        "lm_head.weight": 1,
        "ln_f.bias": 2,
        "transformer.h.0.ln_1.weight": 3,
    }


def test_truncated_and_foreign_checkpoints(tmp_path):
    save_tiny(tmp_path, 3)
    ckpt = tmp_path / "ckpt.pt"
    data = ckpt.read_bytes()
    for broken in (data[:100], b"", b"\x00" * 1000):
        ckpt.write_bytes(broken)
        with pytest.raises(CourseError, match="unreadable, truncated or corrupted"):
            load_checkpoint(tmp_path)
    torch.save({"weights": torch.zeros(2)}, ckpt)
    with pytest.raises(CourseError, match="not a checkpoint of this course"):
        load_checkpoint(tmp_path)


# Saves a good checkpoint, then SIGKILLs itself halfway through writing the next one.
KILLED_MID_WRITE = r"""
import os, signal, sys
import torch
import common.checkpoint as ck
from common.model import GPT, PRESETS

out_dir = sys.argv[1]
model = GPT(PRESETS["tiny"])
ck.write_checkpoint(out_dir, model_state=model.state_dict(), optimizer_state={}, iter_num=1,
                   model_config=model.config, train_config={})
real_save = torch.save

def save_half_then_die(obj, f):
    import io
    buffer = io.BytesIO()
    real_save(obj, buffer)
    f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

ck.torch.save = save_half_then_die
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
ck.write_checkpoint(out_dir, model_state=model.state_dict(), optimizer_state={}, iter_num=2,
                   model_config=model.config, train_config={})
print("not reached")
"""


def test_killed_mid_write_keeps_previous_checkpoint(tmp_path):
    proc = run_python(["-c", KILLED_MID_WRITE, tmp_path], timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "not reached" not in proc.stdout
    leftovers = [p for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert len(leftovers) == 1  # the half-written temporary file
    assert leftovers[0].stat().st_size > 0
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["iter_num"] == 1  # the previous one, whole
    GPT(GPTConfig(**ckpt["model_config"])).load_state_dict(ckpt["model"])
    save_tiny(tmp_path, 3)  # and the next save replaces it as usual
    assert load_checkpoint(tmp_path)["iter_num"] == 3


def test_resume_drops_a_metrics_line_cut_short_by_a_crash(tmp_path):
    from common.metrics import RunLog, Throughput, read_metrics

    path = tmp_path / "metrics.jsonl"
    # the last line was cut short when the run was killed
    path.write_text('{"iter": 1, "loss": 10.8}\n{"iter": 2, "loss": 10.7}\n{"iter": 3, "lo')
    speed = Throughput(256, 1e6, torch.device("cpu"), torch.float32)
    RunLog(tmp_path, start=2, speed=speed)  # resumed from step 2
    assert read_metrics(path) == [{"iter": 1, "loss": 10.8}, {"iter": 2, "loss": 10.7}]


def test_every_gpus_random_state_goes_back_to_its_gpu():
    """What restore_training_state sets on GPUs, from facts a CPU can stand in for."""
    states = [torch.tensor([i], dtype=torch.uint8) for i in range(4)]  # GPU i's generator, as saved

    def effective(checkpoint, gpus, current):  # later settings of one GPU replace earlier ones
        return {i: int(s) for i, s in gpu_rng_plan(checkpoint, gpus, current)}

    # chapter 03 on 4 GPUs: one process, current GPU 0; each replica's GPU continues its own stream
    dataparallel = {"rng_cuda": states[0], "rng_cuda_all": states}
    assert effective(dataparallel, 4, 0) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert effective(dataparallel, 2, 0) == {0: 0, 1: 1}  # resumed on fewer GPUs: those it has
    # DDP: rank 0 saved; rank 2 resumes on GPU 2 with the stream of rank 0's GPU, drawn as often
    assert effective(dataparallel, 4, 2)[2] == 0
    # a checkpoint from before every GPU's state was kept, and one of a CPU run
    assert effective({"rng_cuda": states[0]}, 4, 0) == {0: 0}
    assert effective({"rng_cuda": None, "rng_cuda_all": None}, 4, 0) == {}


def test_a_run_starts_from_another_runs_weights(tmp_path):
    """--init-from: a fresh run takes another run's weights, from its folder or its ckpt.pt."""
    earlier = save_tiny(tmp_path / "earlier", 7)
    for source in (tmp_path / "earlier", tmp_path / "earlier" / "ckpt.pt"):
        started = build_model(PRESETS["tiny"], str(source), None)
        for name, tensor in earlier.state_dict().items():
            assert torch.equal(started.state_dict()[name], tensor), name
