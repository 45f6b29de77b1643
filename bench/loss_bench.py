"""The plain and the chunked output layer + loss (common/chunked_loss.py), side by side in one run.

    python -m bench.loss_bench steps  # bare step and chapter 01, plain vs chunked: time, peak RSS
    python -m bench.loss_bench loss   # the loss alone at GPT-2's width: time, peak memory by chunk

`steps` runs, for each configuration (--configs: tiny, small, 4x128 = tiny with 4 layers of
width 128) and each repeat, four processes in turn: bench/bare_step.py and chapter 01 (as
bench/benchmark.py runs it), each with `--no-chunked-loss` and with the default chunked loss. The
order alternates from one repeat to the next, so that load from elsewhere on the machine falls on
both paths alike. Reported per program: the median over the repeats of the step time (wall; CPU
seconds of the process for the bare step), the median of the per-repeat ratios plain / chunked,
and the peak memory (the bare step's RSS on the CPU; torch.cuda.max_memory_allocated on a GPU,
where --compile also adds compiled bare steps).

`loss` times the output layer + loss alone, forward and backward, on (positions, --width) hidden
states and the (50,304, --width) output matrix, for the plain path (chunk 0) and each --chunks
size, alternating; and measures its peak memory above the inputs: on the CPU with torch.profiler's
record of the allocator (as 02_grad_accumulation/measure_memory.py does), on CUDA with
max_memory_allocated. The plain path keeps its logits alive through the backward pass, as the
model's caller does. Memory is linear in the positions beyond one chunk, so the two --positions
sizes give bytes per position, and --extrapolate-to computes the peak for a larger batch
(32 x 1,024 for a GPT-2 micro-batch on a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from bench.bench_tools import stop_children_on_sigterm
from bench.benchmark import run_commands, run_env, run_figures, run_for_result
from bench.step_timer import StepTimer
from bench.tables import cell, row
from common.chapters import CHAPTERS
from common.chunked_loss import chunked_cross_entropy
from common.model import PRESETS
from layout import REPO, chapter_module
from tools.launch import flags, launch_commands, measured_run_flags

BENCH = REPO / "bench"
# chapter 02's memory probe; 02_grad_accumulation is no package name
measure_memory = chapter_module("02_grad_accumulation", "measure_memory")

MiB = 2**20
# configuration name -> model flags, shared by bare_step.py and the chapters' scripts
CONFIGS = {
    "tiny": ["--preset", "tiny"],
    "small": ["--preset", "small"],
    "gpt2": ["--preset", "gpt2"],
    "4x128": ["--preset", "tiny", "--n-layer", "4", "--n-embd", "128"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("steps", help="bare step and chapter 01, plain vs chunked")
    s.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), default=["tiny", "small", "4x128"]
    )
    s.add_argument("--programs", nargs="+", choices=["bare", "01"], default=["bare", "01"])
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--iters", type=int, default=20, help="steps per run")
    s.add_argument(
        "--log-interval", type=int, default=5, help="steps per timed group; the first is warm-up"
    )
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    s.add_argument(
        "--compile", action="store_true", help="bare steps compiled too (eager and compiled rows)"
    )
    s.add_argument("--data-dir", default="data")
    s.add_argument("--work-dir", default=str(BENCH / "out" / "loss_steps"))
    s.add_argument("--timeout", type=float, default=900)
    s.add_argument("--out", default=None, help="JSON of every run here")
    c = sub.add_parser(
        "check",
        parents=[s],
        add_help=False,
        conflict_handler="resolve",
        help="for bench/gpu_check.sh: `steps` of bare steps, "
        "then `loss` at the model's width and batch",
    )
    c.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[0, 256, 1024, 4096],
        help="for the loss alone; 0: plain",
    )
    m = sub.add_parser("loss", help="the loss alone: time and peak memory, plain vs chunk sizes")
    m.add_argument("--width", type=int, default=768, help="n_embd (768: GPT-2 small)")
    m.add_argument(
        "--positions", type=int, nargs=2, default=[1024, 2048], help="two batch sizes in positions"
    )
    m.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[0, 128, 1024],
        help="positions per chunk; 0: plain",
    )
    m.add_argument(
        "--extrapolate-to", type=int, default=32 * 1024, help="positions of the computed peak"
    )
    m.add_argument("--repeats", type=int, default=3, help="timed runs of each, alternating")
    m.add_argument("--device", default="cpu")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m.add_argument("--out", default=None)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# steps: whole training steps, as the bare model and as chapter 01


def run_one(args, config: str, program: str, chunked: bool, repeat: int) -> dict:
    name = f"{config}_{program}_{side_name(chunked)}_r{repeat}"
    run_dir = Path(args.work_dir) / name
    model = [
        *CONFIGS[config],
        *flags(
            device=args.device, dtype=args.dtype, data_dir=args.data_dir, batch_size=args.batch_size
        ),
        *flags(no_chunked_loss=not chunked),
    ]
    env = run_env(args, args.threads)
    if program.startswith("bare"):
        out = run_dir / "bare.json"
        timing = flags(iters=args.iters, warmup=args.log_interval, group=args.log_interval, out=out)
        compiled = flags(compile=program == "bare_compiled")
        commands = launch_commands(
            "python", BENCH / "bare_step.py", 1, [*model, *timing, *compiled]
        )
        r, tail = run_for_result(commands, env, out, args.timeout)
        if r is None:
            return {"status": "failed", "note": tail[-300:]}
        tokens = r["batch_size"] * r["block_size"]
        return {
            "status": "ok",
            "step_ms": r["step_ms"],
            "step_cpu_ms": r["step_cpu_ms"],
            "peak_mb": r["cuda_max_mem_mb"] or r["maxrss_mb"],
            "tokens_per_sec": 1000 * tokens / r["step_ms"],
        }
    out_dir = run_dir / "out"
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    run = measured_run_flags(args.iters, args.log_interval, eval_batches=1, out_dir=out_dir)
    commands = launch_commands("python", REPO / CHAPTERS[1] / "train.py", 1, [*model, *run])
    status, tail = run_commands(commands, env, run_dir / "run.log", args.timeout)
    if status != 0:
        return {"status": "failed", "note": tail[-300:]}
    fig = run_figures(out_dir, run_dir / "run.log")
    # the chapter's metrics give its wall time per step and, on CUDA, its peak memory; no CPU time
    return {
        "status": "ok",
        "step_ms": fig["step_ms"],
        "step_cpu_ms": None,
        "peak_mb": fig["cuda_max_mem_mb"],
        "tokens_per_sec": fig["tokens_per_sec"],
    }


def steps(args) -> dict:
    programs = list(args.programs) + (["bare_compiled"] if args.compile else [])
    runs = {
        (c, p, chunked): [] for c in args.configs for p in programs for chunked in (False, True)
    }
    for repeat in range(args.repeats):
        # every other repeat runs the chunked side of each pair first
        order = list(runs) if repeat % 2 == 0 else [(c, p, not chunked) for c, p, chunked in runs]
        for key in order:
            result = run_one(args, *key, repeat)
            runs[key].append(result)
            print(
                f"  repeat {repeat}: {key[0]} {key[1]} {side_name(key[2])}: {outcome(result)}",
                flush=True,
            )
    rows = []
    for c in args.configs:
        for p in programs:
            plain, chunked = runs[(c, p, False)], runs[(c, p, True)]
            pairs = [(a, b) for a, b in zip(plain, chunked) if a["status"] == b["status"] == "ok"]
            if not pairs:
                rows.append({"config": c, "program": p, "status": "failed"})
                continue
            ratio = [a["step_ms"] / b["step_ms"] for a, b in pairs]
            cpu_ratio = [
                a["step_cpu_ms"] / b["step_cpu_ms"]
                for a, b in pairs
                if a["step_cpu_ms"] and b["step_cpu_ms"]
            ]
            rows.append(
                {
                    "config": c,
                    "program": p,
                    "status": "ok",
                    "repeats": len(pairs),
                    "plain_ms": median_of(pairs, 0, "step_ms"),
                    "chunked_ms": median_of(pairs, 1, "step_ms"),
                    "plain_cpu_ms": median_of(pairs, 0, "step_cpu_ms"),
                    "chunked_cpu_ms": median_of(pairs, 1, "step_cpu_ms"),
                    "speedup": statistics.median(ratio),
                    "speedup_cpu": statistics.median(cpu_ratio) if cpu_ratio else None,
                    "plain_peak_mb": max((a["peak_mb"] or 0 for a, _ in pairs), default=0) or None,
                    "chunked_peak_mb": max((b["peak_mb"] or 0 for _, b in pairs), default=0)
                    or None,
                    "plain_tokens_per_sec": median_of(pairs, 0, "tokens_per_sec"),
                    "chunked_tokens_per_sec": median_of(pairs, 1, "tokens_per_sec"),
                }
            )
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "what"},
        "rows": rows,
        "runs": {f"{c} {p} {side_name(ch)}": r for (c, p, ch), r in runs.items()},
    }


def side_name(chunked: bool) -> str:
    return "chunked" if chunked else "plain"


def outcome(result: dict) -> str:
    """One run in words: its step time and peak memory, or why it failed."""
    if result["status"] != "ok":
        return result["note"]
    cpu, peak = result["step_cpu_ms"] or 0, result["peak_mb"] or 0
    return f"{result['step_ms']:.1f} ms ({cpu:.1f} ms CPU), {peak:,.0f} MB"


def median_of(pairs: list[tuple[dict, dict]], side: int, key: str) -> float | None:
    """The median of `key` on one side (0: plain, 1: chunked) of the (plain, chunked) pairs."""
    values = [pair[side][key] for pair in pairs if pair[side][key] is not None]
    return statistics.median(values) if values else None


def steps_table(report: dict) -> str:
    mem = "peak memory (MB)" if report["settings"]["device"].startswith("cuda") else "peak RSS (MB)"
    step_columns = "step plain (ms) | step chunked (ms) | speed-up | CPU ms plain | CPU ms chunked"
    rate_columns = (
        f"speed-up (CPU time) | tokens/s plain | tokens/s chunked | {mem} plain | {mem} chunked"
    )
    lines = [
        f"| config | program | {step_columns} | {rate_columns} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {r['program']} | failed | | | | | | | | | |")
            continue
        ms, ratio = "{:,.1f}", "{:.2f}x"
        steps = [cell(r["plain_ms"], ms), cell(r["chunked_ms"], ms), cell(r["speedup"], ratio)]
        cpu = [
            cell(r["plain_cpu_ms"], ms),
            cell(r["chunked_cpu_ms"], ms),
            cell(r["speedup_cpu"], ratio),
        ]
        rates = [cell(r["plain_tokens_per_sec"]), cell(r["chunked_tokens_per_sec"])]
        peaks = [cell(r["plain_peak_mb"]), cell(r["chunked_peak_mb"])]
        lines.append(row([r["config"], r["program"], *steps, *cpu, *rates, *peaks]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# loss: the output layer and the loss alone


def loss_alone(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    vocab = PRESETS["gpt2"].vocab_size
    gen = torch.Generator().manual_seed(0)
    # the output layer's weight, a leaf that requires its gradient, as a parameter does
    weight = (0.02 * torch.randn(vocab, args.width, generator=gen)).to(device).requires_grad_()
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def make(n):
        h = torch.randn(n, args.width, generator=gen).to(device).requires_grad_()  # ln_f's output
        return h, torch.randint(0, 50257, (n,), generator=gen).to(device)

    def step(chunk, h, y):
        with autocast:
            if chunk == 0:  # the plain path as the model writes it; the caller holds the logits
                logits = F.linear(h, weight)
                loss = F.cross_entropy(logits.float(), y)
            else:
                loss = chunked_cross_entropy(h, weight, y, chunk=chunk)
        loss.backward()
        h.grad = weight.grad = None
        return loss

    def peak_added(chunk, h, y) -> int:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            step(chunk, h, y)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - before
        return measure_memory.cpu_peak_added(lambda: step(chunk, h, y))

    memory = {}
    for n in args.positions:
        h, y = make(n)
        for chunk in args.chunks:
            step(chunk, h, y)  # warm-up: one-off allocations, kernel choices
            memory[(chunk, n)] = peak_added(chunk, h, y)
    h, y = make(args.positions[0])
    timer = StepTimer(device)
    for repeat in range(args.repeats):
        for chunk in args.chunks if repeat % 2 == 0 else args.chunks[::-1]:
            with timer.group(kind=str(chunk)):
                step(chunk, h, y)
    (n1, n2), target = args.positions, args.extrapolate_to
    rows = []
    for chunk in args.chunks:
        per_position = (memory[(chunk, n2)] - memory[(chunk, n1)]) / (n2 - n1)
        rows.append(
            {
                "chunk": chunk,
                "ms": timer.median(str(chunk)),
                "cpu_ms": timer.median(str(chunk), cpu=True),
                "peak_mib": {n: memory[(chunk, n)] / MiB for n in args.positions},
                "bytes_per_position": per_position,
                "extrapolated_mib": (memory[(chunk, n2)] + per_position * (target - n2)) / MiB,
            }
        )
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "what"}
        | {
            "vocab": vocab,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        },
        "rows": rows,
    }


def loss_table(report: dict) -> str:
    s = report["settings"]
    n1, n2 = s["positions"]
    time_columns = f"time, {n1:,} positions (ms) | CPU time (ms)"
    memory_columns = (
        f"peak above inputs, {n1:,} positions (MiB) | at {n2:,} (MiB) | per position (KiB) | "
        f"computed for {s['extrapolate_to']:,} positions (MiB)"
    )
    lines = [
        f"| path | {time_columns} | {memory_columns} | vs plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain = next((r for r in report["rows"] if r["chunk"] == 0), None)
    for r in report["rows"]:
        name = "plain" if r["chunk"] == 0 else f"chunked, {r['chunk']} positions per chunk"
        less = (
            f"{plain['extrapolated_mib'] / r['extrapolated_mib']:.1f}x less"
            if plain and r["chunk"]
            else "1"
        )
        peaks = [r["peak_mib"][k] for k in sorted(r["peak_mib"], key=int)]
        lines.append(
            f"| {name} | {r['ms']:,.0f} | {r['cpu_ms']:,.0f} | {peaks[0]:,.1f} | {peaks[1]:,.1f} | "
            f"{r['bytes_per_position'] / 1024:,.1f} | {r['extrapolated_mib']:,.0f} | {less} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    # stopped from outside (the GPU check's `timeout`): no compiled run is left behind
    stop_children_on_sigterm()
    if args.what == "steps":
        report = steps(args)
        text = steps_table(report)
    elif args.what == "check":
        # one configuration: its bare steps, then its loss alone at half and full batch
        args.programs = ["bare"]
        report = steps(args)
        text = steps_table(report)
        config = PRESETS[CONFIGS[args.configs[0]][1]]
        positions = args.batch_size * config.block_size
        dtype = "float32" if args.dtype == "auto" else args.dtype
        chunks = [str(k) for k in args.chunks if k <= positions // 2]
        sizes = ["--positions", str(positions // 2), str(positions), "--chunks", *chunks]
        more = flags(
            width=config.n_embd,
            extrapolate_to=positions,
            device=args.device,
            repeats=args.repeats,
            dtype=dtype,
        )
        loss_args = parse_args(["loss", *sizes, *more])
        report["loss"] = loss_alone(loss_args)
        text += "\n\nThe output layer + loss alone, forward and backward:\n\n" + loss_table(
            report["loss"]
        )
    else:
        report = loss_alone(args)
        text = loss_table(report)
    report["command"] = "python -m bench.loss_bench " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        Path(args.out).with_suffix(".md").write_text(f"`{report['command']}`\n\n{text}\n")


if __name__ == "__main__":
    main()
