"""Benchmark every chapter under identical settings and write a table of where the time goes.

    python -m bench.benchmark                          # small model, CPU or GPU, every setup
    python -m bench.benchmark --preset tiny --iters 6 --log-interval 2 --repeats 1   # a smoke test
    python -m bench.benchmark --device cuda --preset gpt2 --batch-size 16 --setups 01,03,04x1

A setup is a chapter launched one way (04x2: chapter 04 on 2 ranks), one row of the table. Every
setup runs as a reader runs it (`python SCRIPT` or `torchrun ... SCRIPT`, unchanged) for the same
number of optimizer steps on the same global batch of --batch-size sequences. The figures come from
the metrics.jsonl each run writes, with the first log interval (the warm-up) left out:

    tokens/s, step time, MFU, CUDA memory  medians of the chapter's own metrics lines
    step / bare                            the setup's step time over that of the bare model math
                                           on pre-built batches (bench/bare_step.py)

With --repeats R, the setups run R times in turn (interleaved, so a burst of load from elsewhere
hits one repeat, not one setup), and each setup keeps its fastest repeat. Results go to
<results-dir>/benchmark.md and benchmark.json; every run's logs stay under <work-dir>.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import scaling_model
from bench.bench_tools import stop_children_on_sigterm
from bench.tables import cell, percent, row
from common.chapters import CHAPTERS
from common.metrics import read_metrics
from common.model import PRESETS
from layout import REPO
from tools.launch import (
    child_env,
    flags,
    launch_commands,
    measured_run_flags,
    run_together,
    shown_command,
)

BENCH = REPO / "bench"
# the setups, as --setups names them, in the table's order
SETUP_KEYS = ("01", "02", "03", "04x1", "04x2", "05", "07x1")


@dataclass
class Setup:
    """A chapter's script, launched one way: one row of the table."""

    key: str  # one of SETUP_KEYS
    label: str
    script: str  # relative to the repository root
    launch: str  # "python", "torchrun" or "two_nodes" (tools.launch.launch_commands)
    ranks: int = 1  # processes in all
    micro_batches: int = 1  # grad-accum micro-steps per optimizer step
    flags: list = field(default_factory=list)


def setups(args) -> list[Setup]:
    """Every setup, in the order of SETUP_KEYS, each with its share of the global batch."""
    g, k = args.batch_size, args.grad_accum
    script = {number: f"{folder}/train.py" for number, folder in CHAPTERS.items()}
    # On the CPU (or one GPU) DataParallel has one replica: the whole batch goes through it.
    dp_flags = ["--batch-size", g // args.dp_replicas]
    if args.cuda_devices:
        dp_flags += ["--gpus", args.dp_replicas]
    return [
        Setup("01", "01 one device", script[1], "python", flags=["--batch-size", g]),
        Setup(
            "02",
            f"02 grad accum x{k}",
            script[2],
            "python",
            micro_batches=k,
            flags=["--batch-size", g // k, "--grad-accum", k],
        ),
        Setup("03", "03 DataParallel", script[3], "python", flags=dp_flags),
        Setup("04x1", "04 DDP, 1 rank", script[4], "torchrun", ranks=1, flags=["--batch-size", g]),
        Setup(
            "04x2",
            "04 DDP, 2 ranks",
            script[4],
            "torchrun",
            ranks=2,
            flags=["--batch-size", g // 2],
        ),
        # both simulated nodes see the one --data-dir, as on a shared file system: rank 0
        # alone prepares the data
        Setup(
            "05",
            "05 2 nodes x 1 rank",
            script[5],
            "two_nodes",
            ranks=2,
            flags=["--batch-size", g // 2, "--shared-fs"],
        ),
        # FSDP2 with one rank: the flags of 04's one-rank row (chapter 07 takes chapter 06's)
        Setup("07x1", "07 FSDP2, 1 rank", script[7], "torchrun", flags=["--batch-size", g]),
    ]


# ---------------------------------------------------------------------------------------------
# Running processes


def run_commands(
    commands: list[list[str]], env: dict, log_path: Path, timeout: float
) -> tuple[int, str]:
    """Start the commands together (the nodes of one run), wait for all; (exit status, output tail).

    Each command writes to its own log, which starts with the command: log_path for one command,
    log_path.node<i>.log for several.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    paths = [log_path]
    if len(commands) > 1:
        paths = [log_path.with_suffix(f".node{i}.log") for i in range(len(commands))]
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(path, "w")) for path in paths]
        for log, cmd in zip(logs, commands):
            log.write(f"$ {shown_command(cmd)}\n")
            log.flush()
        status = run_together(commands, env, logs, timeout)
    tail = []
    for path in paths:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        tail += lines[-3:]
    return status, "\n".join(tail)


def run_for_result(
    commands: list[list[str]], env: dict, out: Path, timeout: float
) -> tuple[dict | None, str]:
    """Run a worker that writes its result as JSON to `out`; return the result (None if it
    wrote none) and the tail of its output."""
    out.unlink(missing_ok=True)
    status, tail = run_commands(commands, env, out.with_suffix(".log"), timeout)
    if status != 0 or not out.exists():
        return None, tail
    return json.loads(out.read_text()), tail


def run_env(args, threads: int | None) -> dict:
    """The environment of every run: `threads` torch threads a process (None: torch's choice)."""
    # a CPU run hides the GPUs, which chapter 03's DataParallel would take
    hide_gpus = {"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}
    # the repository first, then the caller's own PYTHONPATH
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return child_env(threads, PYTHONPATH=path, **hide_gpus)


# ---------------------------------------------------------------------------------------------
# Reading what a run left behind


def run_figures(out_dir: Path, log_path: Path) -> dict:
    """Medians over the metrics lines after the first (warm-up) interval, and the number of
    threads the run printed."""
    lines = [m for m in read_metrics(out_dir / "metrics.jsonl") if "dt_ms" in m]
    timed = lines[1:] or lines  # the first interval holds start-up costs (allocation, compilation)
    if not timed:
        raise RuntimeError(f"{out_dir / 'metrics.jsonl'} has no training lines")

    def median(key):
        values = [m[key] for m in timed if m.get(key) is not None]
        return statistics.median(values) if values else None

    # every chapter prints its device and threads first: "device cpu (1 threads), float32; ..."
    logs = [log_path, *sorted(log_path.parent.glob(log_path.stem + ".node*.log"))]
    threads = re.search(r"\((\d+) threads?\)", "".join(p.read_text() for p in logs if p.exists()))
    return {
        "step_ms": median("dt_ms"),
        "tokens_per_sec": median("tokens_per_sec"),
        "mfu": median("mfu"),
        "cuda_max_mem_mb": max(
            (m["max_mem_mb"] for m in lines if m.get("max_mem_mb") is not None), default=None
        ),
        "threads_per_rank": int(threads.group(1)) if threads else None,
        "timed_intervals": len(timed),
    }


# ---------------------------------------------------------------------------------------------
# The benchmark


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="global batch: sequences per optimizer step, in every setup",
    )
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step in chapter 02")
    p.add_argument("--iters", type=int, default=30, help="optimizer steps per run")
    p.add_argument(
        "--log-interval",
        type=int,
        default=5,
        help="steps per metrics line; the first interval is warm-up",
    )
    p.add_argument("--repeats", type=int, default=2, help="runs of each setup; the fastest counts")
    p.add_argument(
        "--setups",
        default=",".join(SETUP_KEYS[:-1]),
        help="which to run, comma-separated (04x2: chapter 04 on 2 ranks; 07x1, chapter 07 on one "
        "rank, only when named)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (cuda where present)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--compile", action="store_true", help="torch.compile in every setup and in the bare step"
    )
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of every training process, single-process setups and ranks alike "
        "(default: CPU cores / 2, at least 1): the same compute per device in every row, "
        "so 2 ranks fill the machine and scaling compares like with like",
    )
    p.add_argument(
        "--no-bare", action="store_true", help="skip the bare-model reference (bench/bare_step.py)"
    )
    p.add_argument(
        "--data-dir", default="data", help="where the prepared corpus is (prepared here if missing)"
    )
    p.add_argument(
        "--work-dir", default=str(BENCH / "out"), help="run folders: logs, metrics.jsonl"
    )
    p.add_argument(
        "--results-dir",
        default=str(BENCH / "results"),
        help="benchmark.md and benchmark.json go here",
    )
    p.add_argument(
        "--timeout", type=float, default=900, help="seconds one run may take before it is stopped"
    )
    args = p.parse_args(argv)
    if args.log_interval < 1 or args.iters < 2 * args.log_interval:
        p.error(
            "--iters must be at least twice --log-interval: "
            "the first interval is dropped as warm-up"
        )
    if args.batch_size % 2 or args.batch_size % args.grad_accum:
        batch = f"--batch-size {args.batch_size}"
        p.error(f"{batch} must split evenly over 2 ranks and over --grad-accum {args.grad_accum}")
    args.setup_keys = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not args.setup_keys or set(args.setup_keys) - set(SETUP_KEYS):
        p.error(f"--setups takes a comma-separated subset of {', '.join(SETUP_KEYS)}")
    return args


def resolve_device(args) -> None:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "error: --device cuda, but this PyTorch sees no CUDA GPU; use --device cpu"
        )
    args.cuda_devices = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    # DataParallel over one device: the same work as chapter 01 through the wrapper
    args.dp_replicas = 1
    if args.threads_per_rank is None:
        args.threads_per_rank = max(1, (os.cpu_count() or 1) // 2)
    args.default_threads = torch.get_num_threads()
    args.device_name = (
        torch.cuda.get_device_name(0)
        if args.cuda_devices
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )


def setup_args(args, setup: Setup, out_dir: Path) -> list[str]:
    """The chapter script's flags: the same short measured run everywhere, then the setup's own."""
    run = measured_run_flags(args.iters, args.log_interval, eval_batches=1, preset=args.preset)
    where = flags(device=args.device, dtype=args.dtype, data_dir=args.data_dir, out_dir=out_dir)
    return [*run, *where, *map(str, setup.flags), *flags(compile=args.compile)]


def run_setup(args, setup: Setup, repeat: int) -> dict:
    run_dir = Path(args.work_dir) / f"setup_{setup.key}" / f"repeat{repeat}"
    out_dir = run_dir / "out"
    # this run folder is the benchmark's own, from an earlier benchmark: start it afresh
    # (a chapter refuses a folder that holds a run)
    shutil.rmtree(out_dir, ignore_errors=True)
    commands = launch_commands(
        setup.launch, REPO / setup.script, setup.ranks, setup_args(args, setup, out_dir)
    )
    env = run_env(args, args.threads_per_rank)
    started = time.monotonic()
    status, tail = run_commands(commands, env, run_dir / "run.log", args.timeout)
    result = {
        "command": shown_command(commands[0]),
        "seconds": round(time.monotonic() - started, 1),
    }
    if status != 0:
        last_line = tail.splitlines()[-1] if tail else ""
        return result | {"status": "failed", "note": f"exit status {status}: {last_line}"[:300]}
    try:
        figures = run_figures(out_dir, run_dir / "run.log")
    except (OSError, RuntimeError, KeyError, json.JSONDecodeError) as err:
        return result | {"status": "failed", "note": f"no figures: {err}"[:300]}
    return result | {"status": "ok"} | figures


def run_bare(args, batch_size: int, threads: int | None, repeat: int) -> dict | None:
    """bench/bare_step.py: the model's math alone on pre-built batches, timed after the warm-up."""
    out = (
        Path(args.work_dir) / "bare" / f"b{batch_size}_t{threads or 'default'}_repeat{repeat}.json"
    )
    worker = flags(
        preset=args.preset,
        batch_size=batch_size,
        iters=args.iters,
        warmup=args.log_interval,
        group=args.log_interval,
        device=args.device,
        dtype=args.dtype,
        data_dir=args.data_dir,
        out=out,
    )
    commands = launch_commands(
        "python", BENCH / "bare_step.py", 1, worker + flags(compile=args.compile)
    )
    result, tail = run_for_result(commands, run_env(args, threads), out, args.timeout)
    if result is None:
        print(f"  bare step (batch {batch_size}) failed: {tail[-200:]}", flush=True)
    return result


def predict_two_ranks(args, report: dict) -> dict | None:
    """bench/scaling_model.py's 04 DDP step with 2 ranks, from this run's measured inputs: the bare
    step and the bus bandwidth that 05_multinode/preflight.py measures in the same launch layout,
    for one all-reduce of all the gradients."""
    two_ranks_ok = any(r["setup"] == "04x2" and r["status"] == "ok" for r in report["setups"])
    if args.no_bare or not two_ranks_ok:
        return None
    mb = scaling_model.gradient_layout(args.preset)["grad_bytes"] / 1e6
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    preflight = flags(backend=backend, sizes_mb=f"{mb:.3f}", iters=5)
    commands = launch_commands("torchrun", REPO / CHAPTERS[5] / "preflight.py", 2, preflight)
    log = Path(args.work_dir) / "preflight.log"
    status, tail = run_commands(commands, run_env(args, args.threads_per_rank), log, args.timeout)
    rows = re.findall(
        r"^\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)$", log.read_text(errors="replace"), re.MULTILINE
    )
    if status != 0 or not rows:
        print(f"  preflight failed, no prediction: {tail[-200:]}", flush=True)
        return None
    size, busbw = map(float, rows[-1])
    return scaling_model.against_benchmark(
        report, busbw, f"{CHAPTERS[5]}/preflight.py, 2 ranks, all-reduce of {size:g} MB"
    )


def best(results: list[dict | None], key: str) -> dict | None:
    """The repeat with the smallest `key` (the least disturbed by other load on the machine)."""
    ok = [r for r in results if r and r.get(key) is not None]
    return min(ok, key=lambda r: r[key]) if ok else None


def bare_key(args, s: Setup) -> tuple:
    """The bare step a setup is compared with: one device's share of the batch, the same threads."""
    return (args.batch_size // s.ranks, args.threads_per_rank)


def build_report(args, chosen: list[Setup], runs: dict, bare: dict, skipped: dict, argv) -> dict:
    """Rows of the table from every repeat of every run: the fastest repeat of each."""
    block = PRESETS[args.preset].block_size
    rows = []
    for s in chosen:
        row = {
            "setup": s.key,
            "label": s.label,
            "script": s.script,
            "launch": s.launch,
            "processes": s.ranks,
            "devices": s.ranks if s.launch != "python" else max(args.dp_replicas, 1),
            "micro_batch": int(s.flags[1]),
            "grad_accum": s.micro_batches,
        }
        if s.key in skipped:
            rows.append(
                row
                | {
                    "status": "missing" if "exist" in skipped[s.key] else "skipped",
                    "note": skipped[s.key],
                }
            )
            continue
        ok = best([r for r in runs[s.key] if r["status"] == "ok"], "step_ms")
        if ok is None:
            rows.append(
                row
                | {
                    "status": "failed",
                    "note": runs[s.key][-1].get("note", ""),
                    "command": runs[s.key][-1]["command"],
                }
            )
            continue
        row |= {
            "status": "ok",
            "command": ok["command"],
            "step_ms_repeats": [round(r["step_ms"], 2) for r in runs[s.key] if r["status"] == "ok"],
        }
        row["step_ms"] = ok["step_ms"]
        row["tokens_per_sec"] = ok["tokens_per_sec"]
        row["tokens_per_sec_per_device"] = ok["tokens_per_sec"] / row["devices"]
        row["mfu"] = ok["mfu"]
        row["threads_per_rank"] = ok["threads_per_rank"] or args.threads_per_rank
        # metrics.jsonl's max_mem_mb: torch.cuda.max_memory_allocated on rank 0; nothing on a CPU
        row["peak_mem_mb"] = ok["cuda_max_mem_mb"]
        b = best(bare.get(bare_key(args, s), []), "step_ms")
        row["bare_step_ms"] = b["step_ms"] if b else None
        row["bare_ratio"] = row["step_ms"] / b["step_ms"] if b else None
        rows.append(row)

    by_key = {r["setup"]: r for r in rows}
    scaling = {}
    one = by_key.get("04x1")
    for key in ("04x2", "05"):
        two = by_key.get(key)
        if one and two and one.get("status") == two.get("status") == "ok":
            scaling[key] = {
                "ranks": 2,
                "against": "04x1",
                "efficiency": two["tokens_per_sec"] / (2 * one["tokens_per_sec"]),
                "speedup": two["tokens_per_sec"] / one["tokens_per_sec"],
            }
    report = {
        "settings": {
            "preset": args.preset,
            "block_size": block,
            "global_batch": args.batch_size,
            "tokens_per_step": args.batch_size * block,
            "iters": args.iters,
            "log_interval": args.log_interval,
            "warmup_steps_dropped": args.log_interval,
            "repeats": args.repeats,
            "device": args.device,
            "device_name": args.device_name,
            "dtype": args.dtype,
            "compile": args.compile,
            "threads_per_rank": args.threads_per_rank,
            "torch_default_threads": args.default_threads,
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": __import__("torch").__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python -m bench.benchmark "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "setups": rows,
        "bare": [{"batch_size": k[0], "threads_env": k[1], "runs": v} for k, v in bare.items()],
        "scaling": scaling,
    }
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    # stopped with SIGTERM: the runs it started are stopped too, then it exits
    stop_children_on_sigterm()
    resolve_device(args)
    from common.data import prepare

    prepare("shakespeare", args.data_dir)  # once, before any clock starts
    block = PRESETS[args.preset].block_size
    chosen = [s for s in setups(args) if s.key in args.setup_keys]
    gpu_short = args.device.startswith("cuda") and args.cuda_devices < 2
    batch = f"global batch {args.batch_size} x {block} tokens"
    steps = f"{args.iters} steps (first {args.log_interval} dropped)"
    print(
        f"benchmark: {args.preset} preset, {batch}, {steps}, {args.repeats} repeat(s), "
        f"{args.device_name}",
        flush=True,
    )

    runs: dict[str, list[dict]] = {s.key: [] for s in chosen}
    bare: dict[tuple, list] = {}
    skipped: dict[str, str] = {}
    for s in chosen:
        if not (REPO / s.script).exists():
            skipped[s.key] = f"not run: {s.script} does not exist yet"
        elif gpu_short and s.ranks > args.cuda_devices:
            skipped[s.key] = (
                f"not run: {s.ranks} ranks need {s.ranks} GPUs, {args.cuda_devices} visible"
            )

    for repeat in range(args.repeats):
        for s in chosen:
            if s.key in skipped:
                continue
            print(f"[repeat {repeat + 1}/{args.repeats}] {s.label} ...", end=" ", flush=True)
            r = run_setup(args, s, repeat)
            runs[s.key].append(r)
            print(
                f"{r['step_ms']:.1f} ms/step"
                if r["status"] == "ok"
                else r["status"] + ": " + r["note"],
                f"({r['seconds']} s)",
                flush=True,
            )
        if not args.no_bare:
            for key in sorted({bare_key(args, s) for s in chosen if s.key not in skipped}, key=str):
                b = run_bare(args, key[0], key[1], repeat)
                bare.setdefault(key, []).append(b)
                if b:
                    print(
                        f"  bare step, batch {key[0]}, {b['threads']} thread(s): "
                        f"{b['step_ms']:.1f} ms",
                        flush=True,
                    )

    report = build_report(args, chosen, runs, bare, skipped, argv)
    report["prediction"] = predict_two_ranks(args, report)
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "benchmark.json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    (results / "benchmark.md").write_text(table)
    print("\n" + table)
    print(f"written: {results / 'benchmark.md'}, {results / 'benchmark.json'}")
    return 1 if any(r["status"] == "failed" for r in report["setups"]) else 0


# ---------------------------------------------------------------------------------------------
# The table

COLUMNS = [
    "Setup",
    "Processes x threads",
    "tokens/s",
    "tokens/s per device",
    "Step (ms)",
    "MFU",
    "Peak memory per device (MB)",
    "Step / bare",
]


def markdown(report: dict) -> str:
    s = report["settings"]
    sequences = f"{s['global_batch']} sequences x {s['block_size']} tokens"
    batch = f"{sequences} = {s['tokens_per_step']:,} tokens"
    steps = f"{s['iters']} steps per run, the first {s['warmup_steps_dropped']} dropped as warm-up"
    compiled = ", torch.compile" if s["compile"] else ""
    lines = [
        f"# Benchmark: {s['preset']} preset on {s['device_name']}",
        "",
        f"Global batch {batch} per step in every setup; {steps}; dtype {s['dtype']}{compiled}; "
        f"fastest of {s['repeats']} repeat(s). torch {s['torch']}, {s['date']}.",
        "",
        f"Command: `{s['command']}`",
        "",
        row(COLUMNS),
        "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|",
    ]
    for r in report["setups"]:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | {r['note']} |" + " |" * (len(COLUMNS) - 2))
            continue
        cells = [
            r["label"],
            f"{r['processes']} x {cell(r['threads_per_rank'], '{}')}",
            cell(r["tokens_per_sec"]),
            cell(r["tokens_per_sec_per_device"]),
            cell(r["step_ms"], "{:,.1f}"),
            percent(r["mfu"]),
            cell(r["peak_mem_mb"]),
            cell(r["bare_ratio"], "{:.3f}"),
        ]
        lines.append(row(cells))
    for key, sc in report["scaling"].items():
        lines.append("")
        speedup = f"{sc['speedup']:.2f}x the tokens/s of one rank"
        efficiency = f"efficiency {100 * sc['efficiency']:.0f}%"
        efficiency += " (tokens/s of 2 ranks / (2 x tokens/s of 1 rank))"
        lines.append(
            f"Scaling, {key} against 04x1 (same threads per rank): {speedup}, {efficiency}."
        )
    bare = [
        (b["batch_size"], best(b["runs"], "step_ms"), best(b["runs"], "step_cpu_ms"))
        for b in report["bare"]
    ]
    if any(b for _, b, _ in bare):
        lines.append("")
        lines.append(
            "Bare step (forward + backward + clip + AdamW on pre-built batches), fastest repeat: "
            + "; ".join(
                f"batch {bs}, {b['threads']} thread(s): {b['step_ms']:.1f} ms "
                f"({c['step_cpu_ms']:.1f} ms CPU)"
                for bs, b, c in bare
                if b
            )
            + "."
        )
    lines += scaling_model.markdown_lines(report.get("prediction"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
