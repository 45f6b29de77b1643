"""Chapter 08: DiLoCo's rare syncs, proved against what they generalise."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_same_run,
    outputs_of,
    read_until,
    replace_statement,
    start,
    tiny_run_args,
    train_losses,
)
from machines import machine_set, static_launch
from statements import Pattern, replace

from common.model import GPT, GPTConfig
from layout import REPO
from tools.launch import child_env, free_port, shown_command, stop_launchers, torchrun_command

SCRIPT = REPO / "08_slow_link" / "train.py"
CHAPTER05 = REPO / "05_multinode" / "train.py"
STEPS = 6
SENT = re.compile(r"sent ([\d,]+) bytes of pseudo-gradients in (\d+) steps")
# the run's last count, by kind: each rank's bytes handed to collectives
BY_KIND = re.compile(
    r"sent ([\d,]+) bytes of pseudo-gradients .*?, ([\d,]+) bytes of logged losses, "
    r"([\d,]+) bytes of checkpoints, ([\d,]+) bytes of the first parameters"
)

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


def torchrun(
    script: Path, args: list, timeout: float = 240, nproc: int = 2, status: int = 0
) -> str:
    """`nproc` ranks of `script` under torchrun; its output, or the test fails with it unless it
    ends with `status`."""
    cmd = torchrun_command(script, nproc, args)
    env = child_env(PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == status, f"{shown_command(cmd)} exited {done.returncode}\n{output}"
    return output


def parameters(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "ckpt.pt", weights_only=True)["model"]


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
    assert_same_run(h1, float64_runs["ddp_sgd"][0], 1e-9, 1e-9, 1e-9)


@pytest.mark.slow
def test_outer_lr_1_without_momentum_is_local_sgd(float64_runs, data_dir, tmp_path):
    """Periodic averaging of the copies' parameters, with AdamW inside: the copies really
    differ between syncs (the run's losses are not DDP's)."""
    local_sgd = float64_runs["local_sgd"][0]
    averaging = variant(averaged_sync(SCRIPT.read_text()), tmp_path / "averaging_script")
    torchrun(averaging, float64_args(data_dir, tmp_path / "averaging", sync_every=3))
    assert_same_run(local_sgd, tmp_path / "averaging", 1e-9, 1e-9, 1e-9)
    assert train_losses(local_sgd)[STEPS] != pytest.approx(
        train_losses(float64_runs["h1"][0])[STEPS]
    )


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
    the same losses and parameters as a run never stopped, also from the files a stop leaves
    between the copies and ckpt.pt. The pseudo-gradient goes in bfloat16."""
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
    for rank in (0, 1):  # each rank's own copy of that step: its latest, or the one before
        copies = stopped.glob(f"ckpt.rank{rank}*.pt")
        steps = [torch.load(path, weights_only=True)["iter_num"] for path in copies]
        assert at in steps, steps
    # The window a stop can leave between the copies and ckpt.pt: every rank has saved its copy of
    # a later step (here the uninterrupted run's last), ckpt.pt still names `at`, and each rank's
    # copy of `at` is the one before. A resume takes that one.
    window = tmp_path / "window"
    shutil.copytree(stopped, window)
    for rank in (0, 1):
        latest = window / f"ckpt.rank{rank}.pt"
        if torch.load(latest, weights_only=True)["iter_num"] == at:
            latest.replace(window / f"ckpt.rank{rank}.previous.pt")
            shutil.copy(whole / f"ckpt.rank{rank}.pt", latest)
    for out in (stopped, window):
        output = torchrun(SCRIPT, args(out, resume=True))
        assert f"resuming from {out / 'ckpt.pt'} at step {at}" in output
        assert_same_run(out, whole, 1e-6, 1e-6, 1e-6)


# ---- the outer step by hand --------------------------------------------------------------------
H = 4  # inner steps of a round
NO_SYNC = 1000  # an H that never comes: the copies train apart, the global parameters stay


def round_args(data_dir: Path, out: Path, iters: int, batch_size: int = 2, **more) -> list[str]:
    """float64, the learning rate's schedule independent of --max-iters (no warm-up, the decay over
    100 steps), a checkpoint at the end of the first round."""
    return tiny_run_args(
        data_dir,
        out,
        iters,
        dtype="float64",
        batch_size=batch_size,
        warmup_iters=0,
        lr_decay_iters=100,
        eval_interval=H,
        **more,
    )


def stopped_before_the_first_sync(data_dir: Path, out: Path, ranks: int) -> dict:
    """A run whose sync never comes, stopped after its checkpoint of step H: its global
    parameters are the start (theta0), and its ranks' files hold the copies after the H inner
    steps that the first round of a run with --sync-every H ends with."""
    args = round_args(data_dir, out, 100, sync_every=NO_SYNC)
    proc = start(torchrun_command(SCRIPT, ranks, args))
    try:
        # rank 0's loss of the step after: every rank has saved its copy of step H by then
        seen = read_until(proc, f"iter {H + 1:>6} |")
        assert f"iter {H + 1:>6} |" in seen, seen
        stop_launchers([proc])
    finally:
        outputs_of([proc], timeout=60)
    checkpoint = torch.load(out / "ckpt.pt", weights_only=True)
    assert checkpoint["iter_num"] == H, "stopped too late: the next checkpoint came"
    copies = [torch.load(out / f"ckpt.rank{r}.pt", weights_only=True) for r in range(ranks)]
    assert [c["iter_num"] for c in copies] == [H] * ranks
    return {"global": checkpoint["model"], "copies": [c["model"] for c in copies]}


def parameter_names(out: Path) -> list[str]:
    """The model's parameters in the outer optimizer's order (the tied weight once)."""
    config = GPTConfig(**torch.load(out / "ckpt.pt", weights_only=True)["model_config"])
    return [name for name, _ in GPT(config).named_parameters()]


def mean_pseudo_gradient(start: dict, name: str) -> torch.Tensor:
    """The ranks' mean of (global - copy) for one parameter, in float64."""
    moved = [start["global"][name] - copy[name] for copy in start["copies"]]
    return torch.stack(moved).mean(dim=0)


@pytest.fixture(scope="module")
def two_copies(data_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("chapter08_round") / "no_sync"
    return out, stopped_before_the_first_sync(data_dir, out, ranks=2)


def test_the_outer_step_is_nesterovs_on_the_mean_pseudo_gradient(two_copies, data_dir, tmp_path):
    """The default outer SGD (lr 0.7, Nesterov momentum 0.9) over two rounds. As torch.optim.SGD
    defines it: buf = g in the first step, buf = 0.9 buf + g after; the step is lr (g + 0.9 buf)."""
    _, start = two_copies
    out = tmp_path / "two_rounds"
    output = torchrun(SCRIPT, round_args(data_dir, out, 2 * H, sync_every=H))
    assert f"a sync every {H} steps, outer SGD lr 0.7, momentum 0.9" in output
    lr, momentum = 0.7, 0.9
    final = torch.load(out / "ckpt.pt", weights_only=True)
    buffers = final["optimizer"]["state"]
    for index, name in enumerate(parameter_names(out)):
        # round 1, by hand from the ranks' copies
        g1 = mean_pseudo_gradient(start, name)
        buf1 = g1
        theta1 = start["global"][name] - lr * (g1 + momentum * buf1)  # 1.33 g1
        # round 2: its mean pseudo-gradient is what the momentum added
        buf2 = buffers[index]["momentum_buffer"]
        g2 = buf2 - momentum * buf1
        theta2 = theta1 - lr * (g2 + momentum * buf2)
        torch.testing.assert_close(final["model"][name], theta2, rtol=1e-9, atol=1e-12, msg=name)
    assert final["round_start"] == 2 * H


def assert_bfloat16_mean(out: Path, start: dict) -> None:
    """The global parameters after one round with --sync-bf16, outer lr 1 and no momentum: theta0
    - the mean pseudo-gradient sent in bfloat16."""
    moved = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    ranks = len(start["copies"])
    rounded_somewhere = False
    for name in parameter_names(out):
        exact = mean_pseudo_gradient(start, name)
        sent = start["global"][name] - moved[name]
        scale = torch.stack([start["global"][name] - c[name] for c in start["copies"]]).abs()
        bound = ranks * 2**-8 * scale.mean(dim=0) + 1e-12
        assert bool(((sent - exact).abs() <= bound).all()), name
        rounded_somewhere |= not torch.equal(sent, exact)
    assert rounded_somewhere  # it was sent in bfloat16


def test_bfloat16_sync_is_the_mean_within_its_rounding_with_2_ranks(two_copies, data_dir, tmp_path):
    _, start = two_copies
    out = tmp_path / "bf16"
    args = round_args(data_dir, out, H, sync_every=H, sync_bf16=True, outer_lr=1, outer_momentum=0)
    torchrun(SCRIPT, args)
    assert_bfloat16_mean(out, start)


def test_a_resume_with_another_h_or_other_ranks_is_refused(two_copies, data_dir):
    """Stopped mid-round (step H of a round that never ends): resumed with another H, the run
    would end its round at once, or never; with another number of ranks, no rank has its copy."""
    out, _ = two_copies
    saved = {path.name: path.read_bytes() for path in out.glob("ckpt*.pt")}
    args = round_args(data_dir, out, 100, sync_every=2, resume=True)
    output = torchrun(SCRIPT, args, status=1)  # torchrun's status when its ranks failed
    refusal = (
        f"error: the checkpoint was trained with --sync-every {NO_SYNC}, this run has "
        "--sync-every 2: resume with the same --sync-every, or start a new run in a new --out-dir"
    )
    assert f"[rank 0] {refusal}" in output and f"[rank 1] {refusal}" in output
    # one rank with the global batch of two: the same data order, but not the same ranks
    args = round_args(data_dir, out, 100, sync_every=NO_SYNC, resume=True, batch_size=4)
    output = torchrun(SCRIPT, args, nproc=1, status=1)
    assert (
        f"[rank 0] error: {out}/ckpt.rank0.pt was saved by rank 0 of 2 on node 0, and this is "
        "rank 0 of 1 on node 0: resume with the same ranks on the same nodes" in output
    )
    assert {path.name: path.read_bytes() for path in out.glob("ckpt*.pt")} == saved


@pytest.mark.slow
def test_across_two_machines_a_resume_from_node_local_folders_equals_the_uninterrupted_run(
    data_dir, tmp_path
):
    """Two machines of machines.sh, one rank on each, each with its own --out-dir (its node's
    disk): a checkpoint sends nothing over the link, and a run stopped mid-round resumes from the
    two folders as if never stopped. With the folders swapped, it is refused."""
    iters, every, eval_every = 12, 5, 6  # the checkpoint of step 6 is inside the second round

    def args(out: Path, **more) -> list[str]:
        return tiny_run_args(
            data_dir, out, iters, batch_size=4, sync_every=every, eval_interval=eval_every, **more
        )

    whole = tmp_path / "whole"
    torchrun(SCRIPT, args(whole))  # the uninterrupted run: 2 ranks on this machine
    folders = [tmp_path / "node0", tmp_path / "node1"]
    with machine_set(machines=2) as machines:

        def both_nodes(folders: list[Path], **more) -> list:
            port = free_port()
            return [
                start(
                    machines.run_command(
                        node, static_launch(str(SCRIPT), node, port) + args(folder, **more)
                    )
                )
                for node, folder in enumerate(folders)
            ]

        nodes = both_nodes(folders)
        try:
            seen = read_until(nodes[0], f"iter {eval_every + 1:>6} |")
            assert f"iter {eval_every + 1:>6} |" in seen, seen
            stop_launchers(nodes)
        finally:
            outputs_of(nodes, timeout=60)
        # each node's folder: ckpt.pt and the copy of its own rank, nothing of the other's
        for node, folder in enumerate(folders):
            names = sorted(path.name for path in folder.glob("ckpt*.pt"))
            assert names == ["ckpt.pt", f"ckpt.rank{node}.pt"], names
            checkpoint = torch.load(folder / "ckpt.pt", weights_only=True)
            assert (checkpoint["iter_num"], checkpoint["round_start"]) == (eval_every, every)
        # the folders swapped: no rank finds a copy of its own, and both nodes say so
        nodes = both_nodes(folders[::-1], resume=True)
        outputs = outputs_of(nodes, timeout=240)
        missing = (
            f"rank 0 on node 0 finds no copy of its own of step {eval_every} at "
            f"{folders[1]}/ckpt.rank0.pt"
        )
        for node, output in zip(nodes, outputs):
            assert node.returncode != 0 and f"error: {missing}" in output, output
        sent_before = [machines.sent_bytes(node) for node in (0, 1)]
        nodes = both_nodes(folders, resume=True)
        outputs = outputs_of(nodes, timeout=240)
        sent = [machines.sent_bytes(node) - sent_before[node] for node in (0, 1)]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output
    # what each machine's eth0 sent is what its rank counted, by kind, and the little besides
    # (the meeting, TCP's headers): rank 0 broadcasts the first parameters, rank 1 receives them
    counts = BY_KIND.search(outputs[0])
    pseudo, losses, checkpoints, first = (int(n.replace(",", "")) for n in counts.groups())
    assert checkpoints == 0
    for node, counted in ((0, pseudo + losses + first), (1, pseudo + losses)):
        assert counted <= sent[node] <= counted * 1.01 + 200_000, (node, sent[node], counted)
    assert f"resuming from {folders[0] / 'ckpt.pt'} at step {eval_every}" in outputs[0]
    assert "bytes of logged losses, 0 bytes of checkpoints" in outputs[0]
    assert_same_run(folders[0], whole, 1e-6, 1e-6, 1e-6)
    # node 1 keeps the same global parameters, written on its own disk
    for name, value in parameters(folders[0]).items():
        assert torch.equal(parameters(folders[1])[name], value), name
