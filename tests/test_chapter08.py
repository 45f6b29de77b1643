"""Chapter 08: DiLoCo's rare syncs, proved against what they generalise.

Every run is real: torchrun with 2 ranks, gloo on 127.0.0.1, the tiny model on the CPU.

    DDP with SGD          chapter 05 with SGD for AdamW, float64: the reference of the first proof
    H = 1                 chapter 08 with an inner SGD and an outer SGD of lr 1 without momentum:
                          the same steps as DDP with SGD, within 1e-9 in float64
    local SGD             chapter 08 whose sync averages the parameters themselves (the plain way):
                          the same run as chapter 08 with outer lr 1 and no momentum
    bytes                 what each rank hands to all-reduce per step: DDP's (counted by a hook on
                          its buckets) divided by H, and by 2H in bfloat16
    resume                stopped mid-round and resumed: the uninterrupted run's losses and
                          parameters

The suite runs the proofs of H = 1 and of the bytes; the slow stage (python -m pytest -m slow)
all four.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import outputs_of, read_until, replace_statement, start, tiny_run_args

from common.metrics import read_metrics
from layout import REPO
from tools.launch import child_env, shown_command, stop_launchers, torchrun_command
from tools.statements import Pattern, replace

SCRIPT = REPO / "08_slow_link" / "train.py"
CHAPTER05 = REPO / "05_multinode" / "train.py"
STEPS = 6
SENT = re.compile(r"sent ([\d,]+) bytes of pseudo-gradients in (\d+) steps")

# Chapter 05 with SGD for AdamW, and DDP's all-reduce of each gradient bucket counted: the hook is
# DDP's own all-reduce (it averages as DDP does), after adding up the bytes it hands on.
SGD = "optimizer = torch.optim.SGD(model.optimizer_groups(args.weight_decay), lr=args.lr)"
ADAMW = """optimizer = torch.optim.AdamW(
    model.optimizer_groups(args.weight_decay),
    lr=args.lr,
    betas=(args.beta1, args.beta2),
    fused=device.type == "cuda",
)"""
COUNTED = """raw_model = model.module
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
bucket_bytes = []
def counted_all_reduce(state, bucket):
    bucket_bytes.append(bucket.buffer().numel() * bucket.buffer().element_size())
    return default_hooks.allreduce_hook(state, bucket)
model.register_comm_hook(None, counted_all_reduce)"""
REPORTED = """differing = ranks_unlike_rank0(raw_model)
log(f"DDP handed {sum(bucket_bytes)} bytes to all-reduce in {iter_num} steps")"""

# Local SGD written the plain way: every sync averages the copies' parameters, no outer optimizer.
# (The course's form sends the pseudo-gradient instead, which the outer step's momentum needs.)
AVERAGED = """with torch.no_grad():
    for p, g in zip(raw_model.parameters(), global_model.parameters()):
        dist.all_reduce(p, op=dist.ReduceOp.SUM)
        p.div_(world_size)
        g.copy_(p)
round_start = iter_num"""


def variant(source: str, folder: Path) -> Path:
    """A changed copy of a chapter script, run from `folder` (common/ found through PYTHONPATH)."""
    script = folder / "train.py"
    folder.mkdir(parents=True)
    script.write_text(source)
    return script


def torchrun(script: Path, args: list, timeout: float = 240) -> str:
    """Two ranks of `script` under torchrun; its output, or the test fails with it."""
    cmd = torchrun_command(script, 2, args)
    env = child_env(PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{shown_command(cmd)} exited {done.returncode}\n{output}"
    return output


def losses(out_dir: Path) -> dict[int, float]:
    return {m["iter"]: m["loss"] for m in read_metrics(out_dir / "metrics.jsonl") if "loss" in m}


def parameters(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "ckpt.pt", weights_only=True)["model"]


def assert_same_run(run: Path, reference: Path, rel: float) -> None:
    """The same loss at every step and the same final parameters, within `rel`."""
    expected = losses(reference)
    assert sorted(losses(run)) == sorted(expected) == list(range(1, len(expected) + 1))
    assert losses(run) == pytest.approx(expected, rel=rel)
    final = parameters(run)
    for name, value in parameters(reference).items():
        torch.testing.assert_close(final[name], value, rtol=rel, atol=rel, msg=name)


def sent_per_step(output: str) -> float:
    found = SENT.search(output)
    assert found, output
    return int(found.group(1).replace(",", "")) / int(found.group(2))


def float64_args(data_dir: Path, out_dir: Path, **more) -> list[str]:
    """SGD's proofs: float64, no weight decay and no clipping (each rank would clip its own
    gradient, DDP the averaged one), a global batch of 8."""
    return tiny_run_args(
        data_dir,
        out_dir,
        STEPS,
        dtype="float64",
        batch_size=4,
        lr_decay_iters=STEPS,
        weight_decay=0,
        grad_clip=0,
        **more,
    )


@pytest.fixture(scope="module")
def float64_runs(data_dir, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Each run's folder and output, by name."""
    root = tmp_path_factory.mktemp("chapter08")
    source = CHAPTER05.read_text()
    source = replace_statement(source, ADAMW, SGD, str(CHAPTER05))
    source = replace_statement(source, "raw_model = model.module", COUNTED, str(CHAPTER05))
    source = replace_statement(
        source, "differing = ranks_unlike_rank0(raw_model)", REPORTED, str(CHAPTER05)
    )
    ddp_sgd = variant(source, root / "ddp_sgd_script")
    runs = {
        "ddp_sgd": (ddp_sgd, {}),
        "h1": (SCRIPT, dict(sync_every=1, inner_optimizer="sgd", outer_lr=1, outer_momentum=0)),
        "local_sgd": (SCRIPT, dict(sync_every=3, outer_lr=1, outer_momentum=0)),
    }
    made = {}
    for name, (script, more) in runs.items():
        out = root / name
        made[name] = (out, torchrun(script, float64_args(data_dir, out, **more)))
    return made


def averaged_sync(source: str) -> str:
    """Chapter 08 whose sync, from the pseudo-gradient to the reset, is AVERAGED instead."""
    header = "if iter_num - round_start == args.sync_every or last_step:\n"
    body = "".join(f"    {line}\n" for line in AVERAGED.splitlines())
    return replace(source, Pattern(kind="if", uses="sync_every"), header + body, str(SCRIPT))


def test_one_inner_sgd_step_per_sync_is_ddp_with_sgd(float64_runs):
    h1, output = float64_runs["h1"]
    assert "a sync every 1 steps, outer SGD lr 1.0, momentum 0.0" in output
    assert_same_run(h1, float64_runs["ddp_sgd"][0], rel=1e-9)


@pytest.mark.slow
def test_outer_lr_1_without_momentum_is_local_sgd(float64_runs, data_dir, tmp_path):
    """Periodic averaging of the copies' parameters, with AdamW inside: the copies really
    differ between syncs (the run's losses are not DDP's)."""
    local_sgd = float64_runs["local_sgd"][0]
    averaging = variant(averaged_sync(SCRIPT.read_text()), tmp_path / "averaging_script")
    torchrun(averaging, float64_args(data_dir, tmp_path / "averaging", sync_every=3))
    assert_same_run(local_sgd, tmp_path / "averaging", rel=1e-9)
    assert losses(local_sgd)[STEPS] != pytest.approx(losses(float64_runs["h1"][0])[STEPS])


def test_bytes_sent_per_step_are_ddps_divided_by_h(float64_runs, data_dir, tmp_path):
    ddp_output = float64_runs["ddp_sgd"][1]
    counted = re.search(r"DDP handed (\d+) bytes to all-reduce in (\d+) steps", ddp_output)
    assert counted, ddp_output
    ddp_per_step = int(counted.group(1)) / int(counted.group(2))
    # the model's parameters, each once: the tied embedding and lm_head weight is one tensor
    unique = {v.data_ptr(): v.numel() for v in parameters(float64_runs["h1"][0]).values()}
    parameters_count = sum(unique.values())
    assert ddp_per_step == 8 * parameters_count  # every gradient, in float64, once a step
    assert sent_per_step(float64_runs["h1"][1]) == ddp_per_step
    assert sent_per_step(float64_runs["local_sgd"][1]) == ddp_per_step / 3
    # bfloat16 in a float32 run: 2 bytes for DDP's 4 per parameter
    out = tmp_path / "bf16"
    args = tiny_run_args(data_dir, out, STEPS, batch_size=4, sync_every=3, sync_bf16=True)
    ddp_float32_per_step = ddp_per_step / 2
    assert sent_per_step(torchrun(SCRIPT, args)) == ddp_float32_per_step / (2 * 3)


@pytest.mark.slow
def test_resume_mid_round_equals_the_uninterrupted_run(data_dir, tmp_path):
    """Stopped after a checkpoint inside a round (every rank's copy and AdamW in it) and resumed:
    the same losses and parameters as a run never stopped. The pseudo-gradient goes in bfloat16."""
    iters, every, eval_every = 24, 5, 6  # checkpoints at 6, 12, 18: each inside a round

    def args(out: Path, **more) -> list[str]:
        return tiny_run_args(
            data_dir,
            out,
            iters,
            batch_size=4,
            sync_every=every,
            sync_bf16=True,
            eval_interval=eval_every,
            **more,
        )

    whole = tmp_path / "whole"
    torchrun(SCRIPT, args(whole))
    stopped = tmp_path / "stopped"
    proc = start(torchrun_command(SCRIPT, 2, args(stopped)))
    try:
        seen = read_until(proc, f"step {eval_every}: val loss")
        assert f"step {eval_every}: val loss" in seen, seen
        stop_launchers([proc])  # SIGTERM to torchrun, which passes it on to both ranks
    finally:
        outputs_of([proc], timeout=60)
    checkpoint = torch.load(stopped / "ckpt.pt", weights_only=True)
    at = checkpoint["iter_num"]
    assert at < iters and at % every != 0, f"not stopped inside a round: step {at}"
    assert at - checkpoint["round_start"] == at % every
    assert len(checkpoint["copies"]) == 2
    output = torchrun(SCRIPT, args(stopped, resume=True))
    assert f"resuming from {stopped / 'ckpt.pt'} at step {at}" in output
    assert_same_run(stopped, whole, rel=1e-6)
