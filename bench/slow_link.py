"""Chapter 08 (DiLoCo) against chapter 05 (DDP) over a slow link: both trained across two
machines of machines.sh, one process on each, at three rates of the link between them. Needs root
(network namespaces).

    sudo env "PATH=$PATH" python -m bench.slow_link            # about 40 minutes on 2 busy cores
    sudo env "PATH=$PATH" python -m bench.slow_link --rates 100mbit --presets tiny --iters 100
    sudo env "PATH=$PATH" python -m bench.slow_link --again    # then the goal's pair again
    python -m maintainer.link_picture --slow-link              # then its figures and results

For each preset, at each rate in turn (tc's tbf on both directions of each machine's link, or
none), the same run three times, the same seed, data and steps:

    ddp         chapter 05 (DDP: an all-reduce of every gradient at every step)
    diloco H    chapter 08 with --sync-every H, for each H of --sync-every (10 and 50): an
                all-reduce of the pseudo-gradient every H steps, nothing in between

For each run, from its own metrics.jsonl and its printed lines:

    tokens/s        the tokens of the steps after the first warmup_steps over their time (the sum of
                    the log intervals' times, evaluations excluded as the chapters exclude them):
                    a whole number of rounds for every H, so each run pays its syncs' full share
    bytes per step  what each rank hands to all-reduce per optimizer step. DDP: every gradient,
                    4 bytes a parameter in float32 (bench/scaling_model.py counts the model's
                    parameters); DiLoCo: the count chapter 08 prints at its end
    val loss        the global parameters' validation loss at each evaluation (every run of a
                    preset sees the same tokens at the same step)
    the clock       the loss at each log step against the time trained so far (the same sum)

Then, at --timeline-rate, one round seen step by step: chapter 08 with the tiny model and the
largest H for one round, and chapter 05 for a few steps, each with --log-interval 1 (every step's
time; each log step all-reduces the 4-byte loss).

With --again, afterwards: the goal's two runs once more for each model, back to back (DDP on the
unlimited link, then DiLoCo with the largest H at 100mbit), added to --out: on a machine that other
work shares, the load moves tokens/s from run to run, and two runs in a row see nearly the same.

Writes --out (bench/results/slow_link.json): every figure, with the commands that gave it and the
machine's load; each run's logs stay under --work-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import secrets
import shutil
import sys
import time
from pathlib import Path

from bench import scaling_model
from bench.link_rates import WORLD, chapter_run, machines
from common.data import prepare
from common.metrics import read_metrics
from common.model import PRESETS
from layout import REPO
from maintainer.make_plots import load_average, machine_description
from tools.launch import child_env

DDP = "05_multinode/train.py"
DILOCO = "08_slow_link/train.py"
LOG_INTERVAL = 10  # steps per timed interval: a divisor of every H, so rounds end at log steps
# Each preset's run: steps, sequences per rank, evaluations (on every H's syncs), and the steps
# left out of tokens/s (whole rounds of every H, so that what is measured is whole rounds too).
# Short, to fit a 2-core machine that other work shares, where a tiny step can take 1 s: two
# rounds of H = 50 for the tiny model; one for the small one, on a smaller batch (its step is
# about ten times the tiny one's), its first step included in its tokens/s.
PLAN = {
    "tiny": {"iters": 100, "batch_size": 8, "eval_interval": 50, "warmup_steps": 50},
    "small": {"iters": 50, "batch_size": 2, "eval_interval": 50, "warmup_steps": 0},
}
TIMELINE_DDP_STEPS = 10
SENT = re.compile(
    r"sent ([\d,]+) bytes of pseudo-gradients in (\d+) steps: ([\d,]+) bytes per step"
)


def method_name(sync_every: int | None) -> str:
    """ddp, or diloco H=50."""
    return "ddp" if sync_every is None else f"diloco H={sync_every}"


def clock(metrics: list[dict]) -> list[dict]:
    """The log steps, each with the time trained up to it (s): the sum of the intervals so far,
    each interval's dt_ms (its mean step) times its steps."""
    points = []
    elapsed = 0.0
    previous = 0
    for record in metrics:
        if "dt_ms" not in record:
            continue
        elapsed += record["dt_ms"] * (record["iter"] - previous) / 1000
        previous = record["iter"]
        points.append({"iter": record["iter"], "t_s": round(elapsed, 4), "loss": record["loss"]})
    return points


def tokens_per_sec(metrics: list[dict], warmup_steps: int) -> float:
    """Tokens over time for the log intervals after the first `warmup_steps` steps."""
    tokens = 0
    seconds = 0.0
    previous = {"iter": 0, "tokens_seen": 0}
    for record in metrics:
        if "dt_ms" not in record:
            continue
        if previous["iter"] >= warmup_steps:
            tokens += record["tokens_seen"] - previous["tokens_seen"]
            seconds += record["dt_ms"] * (record["iter"] - previous["iter"]) / 1000
        previous = record
    if seconds == 0:
        raise SystemExit(f"error: no log interval after step {warmup_steps}: train longer")
    return tokens / seconds


def pseudo_gradient_bytes(printed: str) -> dict:
    """Chapter 08's own count of what it sent, from its last lines."""
    found = SENT.search(printed)
    if found is None:
        raise SystemExit("error: chapter 08 printed no 'sent N bytes of pseudo-gradients' line")
    return {
        "bytes": int(found.group(1).replace(",", "")),
        "steps": int(found.group(2)),
        "bytes_per_step": int(found.group(3).replace(",", "")),
    }


def one_run(prefix: str, preset: str, sync_every: int | None, run: argparse.Namespace, work: Path):
    """One chapter's run across the machines, and what it measured."""
    name = f"{preset}_ddp" if sync_every is None else f"{preset}_diloco{sync_every}"
    more = ["--eval-interval", str(run.eval_interval)]
    script = DDP
    if sync_every is not None:
        script = DILOCO
        more += ["--sync-every", str(sync_every)]
    loads = [load_average()]
    done = chapter_run(prefix, run, work, child_env(threads=1), script, tuple(more), name)
    loads.append(load_average())
    metrics = read_metrics(work / name / "metrics.jsonl")
    if sync_every is None:
        sent = {
            "bytes_per_step": scaling_model.gradient_layout(preset)["grad_bytes"],
            "how": "every gradient once a step, 4 bytes a parameter (float32)",
        }
    else:
        sent = pseudo_gradient_bytes((work / name / "node0.log").read_text(errors="replace"))
        sent["how"] = "chapter 08's printed count"
    result = {
        "preset": preset,
        "method": method_name(sync_every),
        "sync_every": sync_every,
        "command": done["command"],
        "tokens_per_sec": round(tokens_per_sec(metrics, run.warmup_steps), 1),
        "sent": sent,
        "val_loss": {str(m["iter"]): m["val_loss"] for m in metrics if "val_loss" in m},
        "clock": clock(metrics),
        "load_average": [round(load, 2) for load in loads if load is not None],
    }
    print(
        f"  {preset} {result['method']}: {result['tokens_per_sec']:,.0f} tokens/s, "
        f"{sent['bytes_per_step']:,} bytes/step, val loss {result['val_loss']}",
        flush=True,
    )
    return result


def timeline(prefix: str, sync_every: int, args, work: Path) -> dict:
    """Every step's time: chapter 08 with the tiny model for one round of `sync_every` steps, and
    chapter 05 for a few, each with --log-interval 1."""
    rows = {}
    for script, steps, more, name in (
        (DILOCO, sync_every, ("--sync-every", str(sync_every)), "timeline_diloco"),
        (DDP, TIMELINE_DDP_STEPS, (), "timeline_ddp"),
    ):
        run = argparse.Namespace(
            iters=steps, log_interval=1, preset="tiny", batch_size=PLAN["tiny"]["batch_size"]
        )
        run.data_dir = args.data_dir
        loads = [load_average()]
        done = chapter_run(prefix, run, work, child_env(threads=1), script, more, name)
        loads.append(load_average())
        metrics = read_metrics(work / name / "metrics.jsonl")
        rows[name.removeprefix("timeline_")] = {
            "command": done["command"],
            "step_ms": [m["dt_ms"] for m in metrics if "dt_ms" in m],
            "load_average": [round(load, 2) for load in loads if load is not None],
        }
    rows["sync_every"] = sync_every
    rows["rate"] = args.timeline_rate
    return rows


def again(args, argv: list[str] | None) -> int:
    """The goal's two runs once more, back to back for each model of the measurement in --out, so
    that the load of other work is nearly the same for both: DDP on the unlimited link, then
    DiLoCo with the largest H at 100 Mbit. Added to --out as its "again" runs."""
    measured = json.loads(args.out.read_text())
    work = Path(args.work_dir) / "again"
    shutil.rmtree(work, ignore_errors=True)
    prefix = "sl" + secrets.token_hex(3)
    largest = max(run["sync_every"] or 0 for row in measured["rates"] for run in row["runs"])
    runs = []
    try:
        for preset, plan in measured["settings"]["presets"].items():
            run = argparse.Namespace(
                preset=preset,
                data_dir=args.data_dir,
                iters=plan["iters"],
                batch_size=plan["batch_size_per_rank"],
                eval_interval=plan["eval_interval"],
                warmup_steps=plan["warmup_steps"],
                log_interval=measured["settings"]["log_interval"],
            )
            for rate, sync_every in (("unlimited", None), ("100mbit", largest)):
                machines("up", "--prefix", prefix, "--machines", str(WORLD), "--rate", rate)
                print(f"{rate}, again:", flush=True)
                (work / rate).mkdir(parents=True, exist_ok=True)
                runs.append(one_run(prefix, preset, sync_every, run, work / rate) | {"rate": rate})
    finally:
        machines("down", "--prefix", prefix)
    measured["again"] = {
        "made_by": " ".join(["python -m bench.slow_link", *(argv or sys.argv[1:])]),
        "runs": runs,
    }
    args.out.write_text(json.dumps(measured, indent=1) + "\n")
    print(f"added to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rates", default="unlimited,1gbit,100mbit", help="tc's rates, in turn")
    p.add_argument("--presets", default="tiny,small", help="the models, each of PLAN")
    p.add_argument("--sync-every", default="10,50", help="chapter 08's H, one run each")
    p.add_argument("--iters", type=int, help="steps of every run (default: each preset's PLAN)")
    p.add_argument("--timeline-rate", default="100mbit", help="the rate of the step-by-step runs")
    p.add_argument(
        "--again",
        action="store_true",
        help="only the goal's two runs once more for each model of --out, back to back (DDP on "
        "the unlimited link, DiLoCo with the largest H at 100mbit), added there: other work on "
        "the machine moves tokens/s between runs",
    )
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--work-dir", default=str(REPO / "out" / "slow_link"))
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "slow_link.json")
    args = p.parse_args(argv)
    if args.again:
        return again(args, argv)
    presets = args.presets.split(",")
    unknown = [preset for preset in presets if preset not in PLAN]
    if unknown:
        raise SystemExit(f"error: --presets {','.join(unknown)}: choose among {','.join(PLAN)}")
    syncs = [int(h) for h in args.sync_every.split(",")]
    plans = {}
    for preset in presets:
        plan = PLAN[preset] | {"log_interval": LOG_INTERVAL}
        if args.iters:
            plan |= {"iters": args.iters, "eval_interval": args.iters}
        plans[preset] = plan
        for h in syncs:
            if h % LOG_INTERVAL or plan["warmup_steps"] % h or plan["iters"] % h:
                raise SystemExit(
                    f"error: --sync-every {h}: a multiple of {LOG_INTERVAL} that divides "
                    f"{preset}'s steps ({plan['iters']}) and warm-up ({plan['warmup_steps']})"
                )
    prepare("shakespeare", args.data_dir, log=lambda *a: None)
    prefix = "sl" + secrets.token_hex(3)  # this run's machines, nobody else's
    started = time.perf_counter()
    rates = args.rates.split(",")
    for rate in rates:
        # this script's own folders, from an earlier measurement: start them afresh (a chapter
        # refuses a folder that holds a run)
        shutil.rmtree(Path(args.work_dir) / rate, ignore_errors=True)
    import torch

    result = {
        "made_by": " ".join(["python -m bench.slow_link", *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "wall_s": None,
        "complete": False,
        "machine": machine_description("cpu"),
        "torch": torch.__version__,
        "settings": {
            "ranks": WORLD,
            "threads_per_rank": 1,
            "log_interval": LOG_INTERVAL,
            "eval_batches": 2,
            "presets": {
                preset: {
                    "iters": plans[preset]["iters"],
                    "batch_size_per_rank": plans[preset]["batch_size"],
                    "eval_interval": plans[preset]["eval_interval"],
                    "warmup_steps": plans[preset]["warmup_steps"],
                    "block_size": PRESETS[preset].block_size,
                    "params": scaling_model.gradient_layout(preset)["params"],
                }
                for preset in presets
            },
        },
        "rates": [{"rate": rate, "runs": []} for rate in rates],
        "timeline": None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        # the tiny model at every rate first, then the small one: a measurement cut short still
        # has a whole table for the first preset (the file is written after each rate)
        for preset in presets:
            run = argparse.Namespace(preset=preset, data_dir=args.data_dir, **plans[preset])
            for row in result["rates"]:
                rate = row["rate"]
                work = Path(args.work_dir) / rate
                work.mkdir(parents=True, exist_ok=True)
                machines("up", "--prefix", prefix, "--machines", str(WORLD), "--rate", rate)
                print(f"{rate}:", flush=True)
                for sync_every in [None, *syncs]:
                    row["runs"].append(one_run(prefix, preset, sync_every, run, work))
                if rate == args.timeline_rate and preset == "tiny":
                    result["timeline"] = timeline(prefix, max(syncs), args, work)
                result["wall_s"] = round(time.perf_counter() - started)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        machines("down", "--prefix", prefix)
    result["complete"] = True
    result["wall_s"] = round(time.perf_counter() - started)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
