"""Benchmark every chapter under identical settings and write a table of where the time goes.

    python -m bench.benchmark                          # small model, CPU or GPU, every setup
    python -m bench.benchmark --preset tiny --iters 6 --log-interval 2 --repeats 1   # a smoke test
    python -m bench.benchmark --device cuda --preset gpt2 --batch-size 16 --setups 01,03,04x1

A setup is a chapter launched one way (04x2: chapter 04 on 2 ranks), one row of the table, run as
a reader runs it, unchanged, for the same steps on the same global batch. The figures are medians
of the chapter's own metrics.jsonl, the first log interval (warm-up) left out; step / bare divides
the step by bench/bare_step.py's. The setups take turns --repeats times, each keeping its fastest
repeat. Results: <results-dir>/benchmark.{md,json}; every run's logs stay under <work-dir>.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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


@dataclass
class Setup:
    """A chapter's script, launched one way: one row of the table."""

    key: str  # one of SETUP_KEYS
    label: str
    chapter: int
    launch: str  # "python", "torchrun" or "two_nodes" (tools.launch.launch_commands)
    ranks: int  # processes in all
    flags: list[str]  # the setup's share of the global batch

    @property
    def script(self) -> str:
        return f"{CHAPTERS[self.chapter]}/train.py"


def setups(args) -> list[Setup]:
    """Every setup, in the order of SETUP_KEYS, each with its share of the global batch."""
    whole = ["--batch-size", str(args.batch_size)]
    half = ["--batch-size", str(args.batch_size // 2)]
    k = args.grad_accum
    accumulated = ["--batch-size", str(args.batch_size // k), "--grad-accum", str(k)]
    # DataParallel over one device: the whole batch goes through its one replica
    data_parallel = whole
    if args.cuda_devices:
        data_parallel = whole + ["--gpus", "1"]
    return [
        Setup("01", "01 one device", 1, "python", 1, whole),
        Setup("02", f"02 grad accum x{k}", 2, "python", 1, accumulated),
        Setup("03", "03 DataParallel", 3, "python", 1, data_parallel),
        Setup("04x1", "04 DDP, 1 rank", 4, "torchrun", 1, whole),
        Setup("04x2", "04 DDP, 2 ranks", 4, "torchrun", 2, half),
        # both simulated nodes see the one --data-dir, as on a shared file system
        Setup("05", "05 2 nodes x 1 rank", 5, "two_nodes", 2, half + ["--shared-fs"]),
        # FSDP2 with one rank: the flags of 04's one-rank row
        Setup("07x1", "07 FSDP2, 1 rank", 7, "torchrun", 1, whole),
    ]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=list(PRESETS), default="small", help="model size")
    p.add_argument("--batch-size", type=int, default=8, help="global batch: sequences per step")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step in chapter 02")
    p.add_argument("--iters", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--log-interval", type=int, default=5, help="steps per metrics line")
    p.add_argument("--repeats", type=int, default=2, help="runs of each setup; the fastest counts")
    p.add_argument(
        "--setups",
        default=",".join(SETUP_KEYS[:-1]),
        help="which to run, comma-separated (07x1 only when named)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (cuda where present)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--compile", action="store_true", help="torch.compile everywhere")
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of every process (default: cores / 2): the same compute per device",
    )
    p.add_argument("--no-bare", action="store_true", help="skip bench/bare_step.py")
    p.add_argument("--data-dir", default="data", help="the prepared corpus (prepared if missing)")
    p.add_argument("--work-dir", default=str(BENCH / "out"), help="run folders: logs, metrics")
    p.add_argument("--results-dir", default=str(BENCH / "results"), help="benchmark.md, .json")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    args = p.parse_args(argv)
    if args.log_interval < 1 or args.iters < 2 * args.log_interval:
        p.error("--iters must be at least twice --log-interval: the first interval is warm-up")
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
    args.cuda_devices = 0
    args.device_name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    if args.device.startswith("cuda"):
        args.cuda_devices = torch.cuda.device_count()
        args.device_name = torch.cuda.get_device_name(0)
    if args.threads_per_rank is None:
        args.threads_per_rank = max(1, (os.cpu_count() or 1) // 2)
    args.torch = torch.__version__


def exit_on_sigterm(signum: int, frame) -> None:
    """SIGTERM (as `timeout` sends it) ends the benchmark with exit status 143 as an exception does:
    on the way out, the run in progress is stopped with all it started (tools/launch.py's
    wait_together stops its launchers in a `finally`)."""
    print("stopped by SIGTERM", file=sys.stderr, flush=True)
    sys.exit(143)


def run_commands(commands: list[list[str]], env: dict, log_path: Path, timeout: float) -> tuple:
    """Start the commands together (the nodes of one run) into one log that starts with the first
    command; (exit status, the log's last lines)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write(f"$ {shown_command(commands[0])}\n")
        log.flush()
        status = run_together(commands, env, [log] * len(commands), timeout)
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return status, "\n".join(lines[-3:])


def run_env(args) -> dict:
    """The environment of every run: --threads-per-rank threads a process, the repository first
    on the import path."""
    # a CPU run hides the GPUs, which chapter 03's DataParallel would take
    hide_gpus = {"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return child_env(args.threads_per_rank, PYTHONPATH=path, **hide_gpus)


def run_setup(args, setup: Setup, repeat: int) -> dict:
    """One run of a setup: its command and, from its metrics.jsonl, its figures."""
    run_dir = Path(args.work_dir) / f"setup_{setup.key}" / f"repeat{repeat}"
    out_dir = run_dir / "out"
    # the benchmark's own folder from an earlier run: a chapter refuses a folder that holds a run
    shutil.rmtree(out_dir, ignore_errors=True)
    chapter_flags = measured_run_flags(
        args.iters, args.log_interval, eval_batches=1, preset=args.preset
    )
    chapter_flags += flags(device=args.device, dtype=args.dtype, data_dir=args.data_dir)
    chapter_flags += flags(out_dir=out_dir)
    chapter_flags += setup.flags
    chapter_flags += flags(compile=args.compile)
    commands = launch_commands(setup.launch, REPO / setup.script, setup.ranks, chapter_flags)
    started = time.monotonic()
    env = run_env(args)
    status, tail = run_commands(commands, env, run_dir / "run.log", args.timeout)
    result = {
        "command": shown_command(commands[0]),
        "seconds": round(time.monotonic() - started, 1),
    }
    if status != 0:
        last_line = tail.splitlines()[-1] if tail else ""
        return result | {"status": "failed", "note": f"exit status {status}: {last_line}"[:300]}
    lines = [m for m in read_metrics(out_dir / "metrics.jsonl") if "dt_ms" in m]
    timed = lines[1:]  # the first interval holds start-up costs (allocation, compilation)
    if not timed:
        return result | {"status": "failed", "note": "no metrics lines after the warm-up"}

    def median(key: str):
        values = [m[key] for m in timed if m.get(key) is not None]
        return statistics.median(values) if values else None

    # every chapter prints its device and threads first: "device cpu (1 threads), float32; ..."
    threads = re.search(r"\((\d+) threads?\)", (run_dir / "run.log").read_text(errors="replace"))
    memory = [m["max_mem_mb"] for m in lines if m.get("max_mem_mb") is not None]
    return result | {
        "status": "ok",
        "step_ms": median("dt_ms"),
        "tokens_per_sec": median("tokens_per_sec"),
        "mfu": median("mfu"),
        # metrics.jsonl's max_mem_mb: torch.cuda.max_memory_allocated on rank 0; none on a CPU
        "peak_mem_mb": max(memory) if memory else None,
        "threads_per_rank": int(threads.group(1)) if threads else args.threads_per_rank,
    }


def run_bare(args, batch_size: int, repeat: int) -> dict | None:
    """bench/bare_step.py on `batch_size` sequences: the model's math alone."""
    out = Path(args.work_dir) / "bare" / f"b{batch_size}_repeat{repeat}.json"
    out.unlink(missing_ok=True)
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
        compile=args.compile,
    )
    commands = launch_commands("python", BENCH / "bare_step.py", 1, worker)
    env = run_env(args)
    status, tail = run_commands(commands, env, out.with_suffix(".log"), args.timeout)
    if status != 0 or not out.exists():
        print(f"  bare step (batch {batch_size}) failed: {tail[-200:]}", flush=True)
        return None
    return json.loads(out.read_text())


def fastest(results: list[dict | None]) -> dict | None:
    """The repeat with the shortest step (the least disturbed by other load on the machine)."""
    measured = [r for r in results if r and r.get("step_ms") is not None]
    if not measured:
        return None
    return min(measured, key=lambda r: r["step_ms"])


def build_report(args, chosen: list[Setup], runs: dict, bare: dict, skipped: dict, argv) -> dict:
    """The table's rows, from the fastest repeat of each setup, with the run's settings."""
    block = PRESETS[args.preset].block_size
    rows = []
    for s in chosen:
        row = {
            "setup": s.key,
            "label": s.label,
            "script": s.script,
            "launch": s.launch,
            "processes": s.ranks,
            "devices": s.ranks,
            "micro_batch": int(s.flags[1]),
            "grad_accum": int(s.flags[3]) if "--grad-accum" in s.flags else 1,
        }
        ok = fastest([r for r in runs[s.key] if r["status"] == "ok"])
        if s.key in skipped:
            row |= {"status": "skipped", "note": skipped[s.key]}
        elif ok is None:
            last = runs[s.key][-1]
            row |= {"status": "failed", "note": last.get("note", ""), "command": last["command"]}
        else:
            row |= ok
            row["step_ms_repeats"] = [r["step_ms"] for r in runs[s.key] if r["status"] == "ok"]
            row["tokens_per_sec_per_device"] = ok["tokens_per_sec"] / row["devices"]
            # for 2 ranks, the bare step of one rank's share
            b = fastest(bare.get(args.batch_size // s.ranks, []))
            row["bare_step_ms"] = b["step_ms"] if b else None
            row["bare_ratio"] = ok["step_ms"] / b["step_ms"] if b else None
        rows.append(row)

    by_key = {r["setup"]: r for r in rows}
    scaling = {}
    one = by_key.get("04x1", {})
    for key in ("04x2", "05"):
        two = by_key.get(key, {})
        if one.get("status") == two.get("status") == "ok":
            speedup = two["tokens_per_sec"] / one["tokens_per_sec"]
            scaling[key] = {
                "ranks": 2,
                "against": "04x1",
                "efficiency": speedup / 2,
                "speedup": speedup,
            }
    command = " ".join(argv if argv is not None else sys.argv[1:])
    settings = {
        "preset": args.preset,
        "block_size": block,
        "global_batch": args.batch_size,
        "tokens_per_step": args.batch_size * block,
        "iters": args.iters,
        "warmup_steps_dropped": args.log_interval,
        "repeats": args.repeats,
        "device": args.device,
        "device_name": args.device_name,
        "dtype": args.dtype,
        "compile": args.compile,
        "threads_per_rank": args.threads_per_rank,
        "torch": args.torch,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": f"python -m bench.benchmark {command}".strip(),
    }
    bare_runs = [{"batch_size": size, "runs": found} for size, found in bare.items()]
    return {"settings": settings, "setups": rows, "bare": bare_runs, "scaling": scaling}


def cell(value, spec: str = "{:,.0f}") -> str:
    """A number in a table: n/a where nothing was measured."""
    return "n/a" if value is None else spec.format(value)


def percent(share) -> str:
    """A share (0.073) as a percentage (7.3%): n/a where nothing was measured."""
    return "n/a" if share is None else f"{100 * share:.1f}%"


def row(cells: list[str]) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(cells) + " |"


def markdown(report: dict) -> str:
    s = report["settings"]
    batch = f"{s['global_batch']} sequences x {s['block_size']} tokens = {s['tokens_per_step']:,}"
    steps = f"{s['iters']} steps per run, the first {s['warmup_steps_dropped']} dropped as warm-up"
    compiled = ", torch.compile" if s["compile"] else ""
    lines = [
        f"# Benchmark: {s['preset']} preset on {s['device_name']}",
        "",
        f"Global batch {batch} tokens per step in every setup; {steps}; dtype {s['dtype']}"
        f"{compiled}; fastest of {s['repeats']} repeat(s). torch {s['torch']}, {s['date']}.",
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
            f"{r['processes']} x {r['threads_per_rank']}",
            cell(r["tokens_per_sec"]),
            cell(r["tokens_per_sec_per_device"]),
            cell(r["step_ms"], "{:,.1f}"),
            percent(r["mfu"]),
            cell(r["peak_mem_mb"]),
            cell(r["bare_ratio"], "{:.3f}"),
        ]
        lines.append(row(cells))
    for key, sc in report["scaling"].items():
        speedup = f"{sc['speedup']:.2f}x the tokens/s of one rank"
        efficiency = f"efficiency {100 * sc['efficiency']:.0f}%"
        lines += [
            "",
            f"Scaling, {key} against 04x1 (same threads per rank): {speedup}, {efficiency}.",
        ]
    bare = [(b["batch_size"], fastest(b["runs"])) for b in report["bare"]]
    if any(b for _, b in bare):
        each = [
            f"batch {size}: {b['step_ms']:.1f} ms ({b['step_cpu_ms']:.1f} ms CPU)"
            for size, b in bare
            if b
        ]
        lines += ["", "Bare step (bench/bare_step.py), fastest repeat: " + "; ".join(each) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    resolve_device(args)
    from common.data import prepare

    prepare("shakespeare", args.data_dir)  # once, before any clock starts
    chosen = [s for s in setups(args) if s.key in args.setup_keys]
    print(
        f"benchmark: {args.preset} preset, global batch {args.batch_size}, {args.iters} steps "
        f"(first {args.log_interval} dropped), {args.repeats} repeat(s), {args.device_name}",
        flush=True,
    )
    skipped = {}
    for s in chosen:
        if args.cuda_devices and s.ranks > args.cuda_devices:
            skipped[s.key] = (
                f"not run: {s.ranks} ranks need {s.ranks} GPUs, {args.cuda_devices} visible"
            )
    runs = {s.key: [] for s in chosen}
    bare = {}
    for repeat in range(args.repeats):
        for s in chosen:
            if s.key in skipped:
                continue
            print(f"[repeat {repeat + 1}/{args.repeats}] {s.label} ...", end=" ", flush=True)
            r = run_setup(args, s, repeat)
            runs[s.key].append(r)
            done = f"{r['step_ms']:.1f} ms/step" if r["status"] == "ok" else f"failed: {r['note']}"
            print(done, f"({r['seconds']} s)", flush=True)
        if args.no_bare:
            continue
        for size in sorted({args.batch_size // s.ranks for s in chosen if s.key not in skipped}):
            b = run_bare(args, size, repeat)
            bare.setdefault(size, []).append(b)
            if b:
                print(f"  bare step, batch {size}: {b['step_ms']:.1f} ms", flush=True)

    report = build_report(args, chosen, runs, bare, skipped, argv)
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "benchmark.json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    (results / "benchmark.md").write_text(table)
    print("\n" + table)
    print(f"written: {results / 'benchmark.md'}, {results / 'benchmark.json'}")
    return 1 if any(r["status"] == "failed" for r in report["setups"]) else 0


if __name__ == "__main__":
    sys.exit(main())
