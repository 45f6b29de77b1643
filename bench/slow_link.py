"""Chapter 08 (DiLoCo) against chapter 05 (DDP) as the papers compare them: at equal tokens, the
same data and seed, over 30 rounds or more (Douillard et al. 2023, arXiv 2311.08105; Charles et
al. 2025, arXiv 2503.09799), and the tokens/s across two machines of machines.sh.

    python -m bench.slow_link                      # the losses: about 7,500 steps of tiny
    python -m bench.slow_link --quick              # every arm for a few steps: that it all runs
    sudo env "PATH=$PATH" python -m bench.slow_link --speed   # then the tokens/s (needs root)

The arms, for each H (10 for 300 steps of tiny, 30 for 900), each with warm-up then cosine decay
over the run's steps, B sequences a step:

    ddp      chapter 05, 2 ranks of B / 2 (a global batch of B)
    diloco2  chapter 08, M = 2 ranks of B / 2, a sync every H steps
    diloco1  chapter 08, M = 1 rank of B, the same H and outer optimizer (DiLoCo as a lookahead)
    warm2    chapter 08, M = 2, from ddp's weights at 27% of the steps (--init-from) for the rest:
             its learning rate decays from ddp's at that step (the chapters start a schedule at
             step 0, so the rest is a cosine of its own), and its data order starts again

The outer lr is chosen from OUTER_LRS by diloco2's last validation loss with H = 10 on the first
seed; every arm then uses it (all three losses are recorded). The losses run on this machine
(torchrun, 127.0.0.1): the loss at equal tokens does not depend on the link. --speed: ddp and
diloco2 with the largest H across two machines, on the unlimited link and at 100 Mbit, REPEATS
times back to back each: the tokens/s after the first round, median and range.

Writes --out (bench/results/slow_link_arms.json): every loss and figure, with the commands.
"""

from __future__ import annotations

import argparse
import datetime
import json
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.link_rates import chapter_run, load_average, machine_description, machines
from common.data import prepare
from common.metrics import read_metrics
from common.training import lr_at
from layout import REPO
from tools.launch import child_env, flags, shown_command, torchrun_command

DDP = "05_multinode/train.py"
DILOCO = "08_slow_link/train.py"
BATCH = 16  # B: sequences of 32 tokens a step, in every arm
LR, MIN_LR = 2e-3, 2e-4  # the chapters' defaults, written out: the warm start continues them
OUTER_LRS = [0.4, 0.6, 0.8]
WARM_SHARE = 0.27  # the DiLoCo paper's warm start: 24,000 of 88,000 steps
REPEATS = 3
# H -> (steps, seeds): 30 rounds or more
FULL = {10: (300, [1337, 1338, 1339]), 30: (900, [1337])}
QUICK = {2: (8, [1337])}
EVALUATIONS = 10  # per run, each just after a sync
FIGURE = REPO / "docs" / "figures" / "slow_link_arms.png"


def median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_flags(steps: int, h: int, seed: int, batch: int) -> list[str]:
    """A measured run of the tiny model: warm-up over a tenth of the steps, then cosine decay to
    the last step; an evaluation every few rounds (just after a sync) and at the end."""
    every = max(h, steps // EVALUATIONS // h * h)
    return flags(
        preset="tiny",
        device="cpu",
        dtype="float32",
        max_iters=steps,
        warmup_iters=steps // 10,
        lr_decay_iters=steps,
        lr=LR,
        min_lr=MIN_LR,
        eval_interval=every,
        eval_batches=4,
        log_interval=h,
        sample_tokens=0,
        dropout=0,
        seed=seed,
        batch_size=batch,
    )


def train(script: str, ranks: int, args: list[str], out: Path) -> dict:
    """One arm's run (torchrun on this machine, one thread a rank): its validation losses."""
    command = torchrun_command(script, ranks, [*args, "--out-dir", out])
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    started = time.perf_counter()
    with open(log, "w") as sink:
        done = subprocess.run(command, cwd=REPO, env=child_env(), stdout=sink, stderr=sink)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise SystemExit(f"error: {script} failed (status {done.returncode}):\n{tail}")
    metrics = read_metrics(out / "metrics.jsonl")
    losses = {m["iter"]: m["val_loss"] for m in metrics if "val_loss" in m}
    last = max(losses)
    print(f"  {out.name}: val loss {losses[last]:.4f} at step {last}", flush=True)
    shown = shown_command(command).replace(str(out.parent), "WORK")
    return {
        "command": shown,
        "val_loss": losses,
        "final": losses[last],
        "wall_s": round(time.perf_counter() - started),
    }


def arms(h: int, steps: int, seed: int, outer_lr: float, work: Path, data: list[str]) -> dict:
    """ddp, diloco2 and diloco1 with one H and seed (and warm2 on the first seed)."""
    base = run_flags(steps, h, seed, BATCH // 2) + data
    outer = flags(sync_every=h, outer_lr=outer_lr)
    runs = {
        "ddp": train(DDP, 2, base, work / "ddp"),
        "diloco2": train(DILOCO, 2, base + outer, work / "diloco2"),
    }
    one_rank = run_flags(steps, h, seed, BATCH) + data + outer
    runs["diloco1"] = train(DILOCO, 1, one_rank, work / "diloco1")
    return runs


def warm_start(h: int, steps: int, seed: int, outer_lr: float, work: Path, data: list[str]):
    """ddp up to WARM_SHARE of the steps (a whole number of rounds), then diloco2 from its
    weights for the rest."""
    start = max(h, round(steps * WARM_SHARE / h) * h)
    base = run_flags(steps, h, seed, BATCH // 2) + data
    # the same schedule as the whole ddp run (the last --max-iters counts): stopped at `start`
    first = train(DDP, 2, base + flags(max_iters=start), work / "ddp_first")
    schedule = argparse.Namespace(lr=LR, min_lr=MIN_LR, warmup_iters=steps // 10)
    schedule.lr_decay_iters = steps
    rest = run_flags(steps - start, h, seed, BATCH // 2) + data
    lr_there = lr_at(start, schedule)
    rest += flags(init_from=work / "ddp_first" / "ckpt.pt", warmup_iters=0, lr=lr_there)
    rest += flags(sync_every=h, outer_lr=outer_lr)
    warm = train(DILOCO, 2, rest, work / "warm2")
    warm["from_step"] = start
    warm["ddp_first"] = first
    return warm


def against_ddp(seeds: dict) -> dict:
    """Each arm's last validation loss over the seeds (median, range), and its ratio to ddp's."""
    summary = {}
    names = {name for runs in seeds.values() for name in runs}
    for name in sorted(names):
        finals = [runs[name]["final"] for runs in seeds.values() if name in runs]
        ratios = [
            runs[name]["final"] / runs["ddp"]["final"] for runs in seeds.values() if name in runs
        ]
        summary[name] = {"val_loss": median_range(finals), "ratio_to_ddp": median_range(ratios)}
    return summary


def speed(h: int, steps: int, args) -> dict:
    """ddp and diloco2 across two machines, unlimited and 100mbit, REPEATS times back to back:
    the tokens/s after the first round (its first step warms up)."""
    prefix = "sl" + secrets.token_hex(3)  # this run's machines, nobody else's
    result = {}
    run = argparse.Namespace(iters=steps, log_interval=h, preset="tiny", data_dir=args.data_dir)
    run.batch_size = BATCH // 2
    try:
        for rate in ("unlimited", "100mbit"):
            machines("up", "--prefix", prefix, "--machines", "2", "--rate", rate)
            for name, script, more in (
                ("ddp", DDP, ()),
                ("diloco2", DILOCO, ("--sync-every", str(h), "--outer-lr", str(args.outer_lr))),
            ):
                rates = []
                for repeat in range(REPEATS):
                    work = Path(args.work_dir) / "speed" / rate
                    work.mkdir(parents=True, exist_ok=True)
                    label = f"{name}_{repeat}"
                    done = chapter_run(prefix, run, work, child_env(), script, more, label)
                    metrics = read_metrics(work / label / "metrics.jsonl")
                    timed = [m for m in metrics if "dt_ms" in m and m["iter"] > h]
                    seconds = sum(m["dt_ms"] * h / 1000 for m in timed)
                    rates.append(len(timed) * h * BATCH * 32 / seconds)
                result.setdefault(rate, {})[name] = {
                    "command": done["command"],
                    "tokens_per_sec": [round(r, 1) for r in rates],
                    **median_range(rates),
                    "load_average": load_average(),
                }
                print(f"  {rate} {name}: {statistics.median(rates):,.0f} tokens/s", flush=True)
    finally:
        machines("down", "--prefix", prefix)
    return result


def draw(measured: dict, path: Path) -> None:
    """The validation loss of every arm against the tokens (the first seed; warm2 from ddp's
    step), for each H; then ddp's and diloco2's against the clock at 100 Mbit: each token count
    divided by the arm's median tokens/s across the two machines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_h = measured["by_h"]
    fig, axes = plt.subplots(1, len(by_h) + 1, figsize=(5 * len(by_h) + 5, 3.8))
    for ax, (h, at_h) in zip(axes, by_h.items()):
        runs = dict(next(iter(at_h["seeds"].values())))
        runs["warm2"] = at_h["warm2"]
        for name, run in runs.items():
            start = run.get("from_step", 0)
            steps = sorted(run["val_loss"], key=int)
            thousands = [(start + int(step)) * BATCH * 32 / 1000 for step in steps]
            ax.plot(thousands, [run["val_loss"][step] for step in steps], marker=".", label=name)
        title = f"H = {h}, {at_h['steps']} steps"
        ax.set(title=title, xlabel="thousands of tokens", ylabel="validation loss")
        ax.legend()
    speed = measured["speed"]
    at_h = by_h[str(speed["sync_every"])]
    runs = next(iter(at_h["seeds"].values()))
    for name in ("ddp", "diloco2"):
        rate = speed["100mbit"][name]["median"]
        steps = sorted(runs[name]["val_loss"], key=int)
        minutes = [int(step) * BATCH * 32 / rate / 60 for step in steps]
        losses = [runs[name]["val_loss"][step] for step in steps]
        axes[-1].plot(minutes, losses, marker=".", label=f"{name}, {rate:,.0f} tokens/s")
    title = f"H = {speed['sync_every']} at 100 Mbit/s"
    axes[-1].set(title=title, xlabel="minutes at 100 Mbit/s", ylabel="validation loss")
    axes[-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="every arm for a few steps (H = 2)")
    p.add_argument("--speed", action="store_true", help="only the tokens/s, added to --out")
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--work-dir", default=str(REPO / "out" / "slow_link"))
    out_default = REPO / "bench" / "results" / "slow_link_arms.json"
    p.add_argument("--out", type=Path, default=out_default)
    p.add_argument("--figure", type=Path, default=FIGURE, help="--speed draws the losses here")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    prepare("shakespeare", args.data_dir, log=lambda *a: None)
    data = flags(data_dir=args.data_dir)
    work = Path(args.work_dir)
    started = time.perf_counter()
    if args.speed:
        measured = json.loads(args.out.read_text())
        args.outer_lr = measured["outer_lr"]["chosen"]
        h = max(plan)
        speed_steps = 3 * h  # one round of warm-up, two timed
        measured["speed"] = {"sync_every": h, "steps": speed_steps, **speed(h, speed_steps, args)}
        slow = measured["speed"]["100mbit"]
        # the goal: DiLoCo at least 3 times DDP's tokens/s at 100 Mbit
        measured["speed"]["ratio_at_100mbit"] = slow["diloco2"]["median"] / slow["ddp"]["median"]
        measured["speed"]["wall_s"] = round(time.perf_counter() - started)
        args.out.write_text(json.dumps(measured, indent=1) + "\n")
        draw(measured, args.figure)
        print(f"added the tokens/s to {args.out}; drew {args.figure}")
        return 0
    import torch

    result = {
        "made_by": " ".join(["python -m bench.slow_link", *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "machine": machine_description("cpu"),
        "torch": torch.__version__,
        "load_average_start": load_average(),
        "settings": {"preset": "tiny", "batch": BATCH, "block_size": 32, "eval_batches": 4},
        "outer_lr": {},
        "by_h": {},
    }
    # the outer lr: diloco2 with the first H and seed, each of OUTER_LRS
    h, (steps, seeds) = next(iter(plan.items()))
    tried = {}
    for outer_lr in OUTER_LRS:
        args_lr = run_flags(steps, h, seeds[0], BATCH // 2) + data
        args_lr += flags(sync_every=h, outer_lr=outer_lr)
        tried[outer_lr] = train(DILOCO, 2, args_lr, work / f"lr{outer_lr}" / "diloco2")
    chosen = min(tried, key=lambda lr: tried[lr]["final"])
    result["outer_lr"] = {
        "chosen": chosen,
        "by": f"diloco2's last validation loss, H = {h}, seed {seeds[0]}",
        "final": {str(lr): run["final"] for lr, run in tried.items()},
    }
    for h, (steps, seeds) in plan.items():
        by_seed = {}
        for seed in seeds:
            by_seed[seed] = arms(h, steps, seed, chosen, work / f"h{h}_seed{seed}", data)
        warm = warm_start(h, steps, seeds[0], chosen, work / f"h{h}_warm", data)
        result["by_h"][str(h)] = {
            "steps": steps,
            "tokens": steps * BATCH * 32,
            "rounds": steps // h,
            "seeds": {str(seed): runs for seed, runs in by_seed.items()},
            "summary": against_ddp(by_seed),
            "warm2": warm,
            "warm2_ratio_to_ddp": warm["final"] / by_seed[seeds[0]]["ddp"]["final"],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # a run cut short keeps its H
    result["wall_s"] = round(time.perf_counter() - started)
    result["load_average_end"] = load_average()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
