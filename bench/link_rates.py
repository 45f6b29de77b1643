"""Chapter 05's step time against the rate of the link between its machines, measured on two
machines of 05_multinode/machines.sh and predicted by bench/scaling_model.py. Needs root.

    sudo env "PATH=$PATH" python -m bench.link_rates                        # minutes
    sudo env "PATH=$PATH" python -m bench.link_rates --rates 100mbit --iters 20   # a shorter one

For each rate in turn, with one process on each machine and both directions of each machine's link
limited to the rate (tc's tbf): the busbw of 05_multinode/preflight.py between the machines
(all-reduces of 1 MB, of the model's gradients and of 25 MB); the bare step of one rank's share
(bench/bare_step.py) on both machines at once, as the ranks share the cores; chapter 05 across the
machines, its median step after the first log interval; and the step that scaling_model.predict
gives from the bare step and the busbw at the gradients' size. Writes --out
(bench/results/link_rates.json) with the commands and the machine's load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import scaling_model
from common.data import prepare
from common.metrics import read_metrics
from layout import REPO
from tools.launch import child_env, flags, measured_run_flags, run_together, shown_command

MACHINES = ["bash", "05_multinode/machines.sh"]
WORLD = 2  # one process on each of the two machines


def load_average() -> float | None:
    """The machine's load over the last minute, where the system tells it."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_description(device: str) -> dict:
    """This machine, as a benchmark's JSON records it."""
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        cpu = names[0] if names else cpu
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__}
    info.update(python=platform.python_version(), os=platform.system())
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count())
    return info


def machines(*args: str) -> str:
    """machines.sh VERB ARGS (its one-line refusal, as it is, when it cannot make machines)."""
    done = subprocess.run([*MACHINES, *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip())
    return done.stdout


def on_both(prefix: str, commands: list[list[str]], log: Path, env: dict, timeout: float) -> int:
    """Command i on machine i, at once, into one log; the first non-zero exit status, else 0."""
    on_machines = [
        [*MACHINES, "run", "--prefix", prefix, str(i), *c] for i, c in enumerate(commands)
    ]
    with open(log, "w") as sink:
        return run_together(on_machines, env, [sink] * len(commands), timeout)


def preflight(prefix: str, sizes_mb: list[float], iters: int, work: Path, env: dict) -> dict:
    """busbw (GB/s) for each size, from the preflight between the two machines."""
    args = ["--sizes-mb", ",".join(f"{mb:g}" for mb in sizes_mb), "--iters", str(iters)]
    commands = []
    for node in range(WORLD):
        settings = [f"NODE_RANK={node}", "MASTER_ADDR=10.0.0.1", "MASTER_PORT=29500"]
        settings += ["NPROC_PER_NODE=1", "SCRIPT=05_multinode/preflight.py"]
        commands.append(["env", *settings, "bash", "05_multinode/launch_static.sh", *args])
    log = work / "preflight.log"
    status = on_both(prefix, commands, log, env, timeout=900)
    printed = log.read_text(errors="replace")
    rows = re.findall(r"^\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)$", printed, re.MULTILINE)
    if status != 0 or len(rows) != len(sizes_mb):
        raise SystemExit(f"error: the preflight failed (status {status}):\n{printed[-2000:]}")
    return {
        "command": " ".join(commands[1]),
        "rows": [
            {"size_mb": float(size), "ms": float(ms), "busbw_gbs": float(busbw)}
            for size, ms, busbw in rows
        ],
    }


def bare_step(prefix: str, args, work: Path, env: dict) -> dict:
    """bench/bare_step.py for one rank's share, on both machines at once: the two processes share
    the cores as the run's two ranks do. The mean of the two medians."""
    commands = []
    for node in range(WORLD):
        bare = flags(preset=args.preset, batch_size=args.batch_size, iters=args.bare_iters)
        bare += flags(warmup=5, data_dir=args.data_dir, out=work / f"bare{node}.json")
        commands.append([sys.executable, "-m", "bench.bare_step", *bare])
    status = on_both(prefix, commands, work / "bare.log", env, timeout=900)
    if status != 0:
        raise SystemExit(f"error: the bare step failed:\n{(work / 'bare.log').read_text()}")
    each = [json.loads((work / f"bare{node}.json").read_text()) for node in range(WORLD)]
    return {
        "command": shown_command(commands[0]).replace(str(work), "WORK") + " (on both at once)",
        "step_ms": statistics.mean(result["step_ms"] for result in each),
        "step_ms_each": [result["step_ms"] for result in each],
        "threads": each[0]["threads"],
    }


def chapter_run(
    prefix: str,
    args,
    work: Path,
    env: dict,
    script: str = "05_multinode/train.py",
    more: tuple[str, ...] = (),
    name: str = "run",
) -> dict:
    """A chapter across the two machines (chapter 05 unless `script` names another), in
    work/NAME, with `more` flags after the measured run's own: its step time, read from the
    metrics.jsonl it writes."""
    run_dir = work / name
    train = measured_run_flags(
        args.iters, args.log_interval, eval_batches=2, preset=args.preset, seed=1337
    )
    train += flags(batch_size=args.batch_size, device="cpu", dtype="float32")
    train += flags(data_dir=args.data_dir)
    train += list(more)  # after the defaults: the last of a flag given twice counts
    command = ["bash", "05_multinode/simulate_two_nodes.sh", *train]
    settings = {"MACHINES": prefix, "NPROC_PER_NODE": "1", "SHARED_FS": "1"}
    if script != "05_multinode/train.py":
        settings["SCRIPT"] = script
    log = work / f"{name}.log"
    with open(log, "w") as sink:
        done = subprocess.run(
            command,
            cwd=REPO,
            env=env | settings | {"RUN_DIR": str(run_dir)},
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=1800,
        )
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise SystemExit(f"error: {script} failed (status {done.returncode}):\n{tail}")
    steps = [m["dt_ms"] for m in read_metrics(run_dir / "metrics.jsonl") if "dt_ms" in m]
    shown = " ".join(f"{k}={v}" for k, v in settings.items()) + " " + shown_command(command)
    return {
        "command": shown.replace(prefix, "PREFIX").replace(str(work), "WORK"),
        "interval_step_ms": steps,
        "step_ms": statistics.median(steps[1:]),  # the first interval is the warm-up
    }


def measure_rate(prefix: str, rate: str, args, layout: dict) -> dict:
    work = Path(args.work_dir) / rate
    # this script's own folder, from an earlier measurement: start it afresh (a chapter refuses a
    # folder that holds a run)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = child_env(threads=1)
    machines("up", "--prefix", prefix, "--machines", str(WORLD), "--rate", rate)
    loads = [load_average()]
    sizes = [1.0, round(layout["grad_bytes"] / 1e6, 3), 25.0]
    link = preflight(prefix, sizes, args.preflight_iters, work, env)
    loads.append(load_average())
    bare = bare_step(prefix, args, work, env)
    loads.append(load_average())
    run = chapter_run(prefix, args, work, env)
    loads.append(load_average())
    busbw = link["rows"][1]["busbw_gbs"]  # at the size of the gradients
    predicted = scaling_model.predict(bare["step_ms"] / 1000, args.preset, busbw * 1e9, WORLD)
    print(
        f"{rate}: busbw {busbw:.4f} GB/s, bare step {bare['step_ms']:.1f} ms, predicted "
        f"{1000 * predicted['step_s']:.1f} ms, measured {run['step_ms']:.1f} ms",
        flush=True,
    )
    return {
        "rate": rate,
        "preflight": link,
        "busbw_gbs": busbw,
        "bare": bare,
        "run": run,
        "predicted_ms": {k: 1000 * v for k, v in predicted.items() if k.endswith("_s")},
        "load_average": [round(load, 2) for load in loads if load is not None],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rates", default="unlimited,1gbit,100mbit", help="tc's rates, in turn")
    p.add_argument("--preset", default="tiny", help="the model, as in chapter 05's run")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--iters", type=int, default=40, help="steps of each chapter 05 run")
    p.add_argument("--log-interval", type=int, default=5, help="steps per timed interval")
    p.add_argument("--preflight-iters", type=int, default=5, help="all-reduces per size")
    p.add_argument("--bare-iters", type=int, default=30, help="steps of the bare step")
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--work-dir", default=str(REPO / "out" / "link_rates"))
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "link_rates.json")
    args = p.parse_args(argv)
    prepare("shakespeare", args.data_dir, log=lambda *a: None)
    layout = scaling_model.gradient_layout(args.preset)
    prefix = "lr" + secrets.token_hex(3)  # this run's machines, nobody else's
    started = time.perf_counter()
    rows = []
    try:
        for rate in args.rates.split(","):
            rows.append(measure_rate(prefix, rate, args, layout))
    finally:
        machines("down", "--prefix", prefix)
    import torch

    result = {
        "made_by": " ".join(["python -m bench.link_rates", *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "wall_s": round(time.perf_counter() - started),
        "machine": machine_description("cpu"),
        "torch": torch.__version__,
        "settings": {
            "preset": args.preset,
            "batch_size_per_rank": args.batch_size,
            "ranks": WORLD,
            "iters": args.iters,
            "log_interval": args.log_interval,
            "threads_per_rank": 1,
        },
        "gradients": layout,
        "rates": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
