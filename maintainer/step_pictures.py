"""Pictures of what happens inside one training step, from real runs traced by torch.profiler.

    python -m maintainer.step_pictures                    # trace, measure, draw, record (minutes)
    python -m maintainer.step_pictures --from-runs out/step_pictures   # draw runs already made

It runs workers/step_trace.py under torchrun, 2 ranks on 127.0.0.1 (a free port), on the CPU with
gloo, and draws into docs/figures/ (or --figures):

    ddp_step.png              chapter 04: one optimizer step of 2 micro-steps under DDP, each
                              rank's main thread and its gloo threads: the first micro-step under
                              no_sync() sends nothing, the last one's backward all-reduces bucket
                              after bucket while it is still computing
    ddp_step_trace.json.gz    its trace, both ranks in one file (Perfetto opens it)
    fsdp_step.png             chapter 07: one FSDP2 step: the all-gather of every block before
                              its forward and again before its backward, the reduce-scatter of
                              its gradient after it; the root unit's, gathered once
    fsdp_step_trace.json.gz   its trace
    memory_per_rank.png       chapter 07: what one rank of 2 holds under DDP, ZeRO-1 and FSDP:
                              parameters, gradients, AdamW's state, and the root unit that FSDP2
                              holds whole from the end of forward to its backward; tiny and small
                              measured, GPT-2 124M counted from its shapes

Their captions go into docs/figures/CAPTIONS.md (a section of its own, which
maintainer/make_plots.py keeps), and their facts into bench/results/results.json (then
bench/RESULTS.md is rendered again), with the machine, its load, torch's version and the command.
A CPU's timeline is not a GPU's: what carries over is the order of the operations and which
of them overlap.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

from common.data import prepare
from layout import REPO as ROOT
from maintainer import results as registry
from maintainer.make_plots import (
    STEP_PICTURES_SECTION,
    load_average,
    machine_description,
    machine_text,
)
from tools import launch

WORLD = 2
WORKER = "workers.step_trace"  # started as a module: torchrun -m
TRACE_PRESET = "small"
MEMORY_PRESETS = ("tiny", "small")
COUNTED_PRESET = "gpt2"
SECTION = "Pictures of one step (docs/figures)"
# the section of docs/figures/CAPTIONS.md this script writes; maintainer/make_plots.py keeps it
CAPTIONS_BEGIN = STEP_PICTURES_SECTION
CAPTIONS_END = "<!-- step_pictures: end -->"
TRACE_FILES = {"ddp": "ddp_step_trace.json.gz", "fsdp": "fsdp_step_trace.json.gz"}
FIGURES = {"ddp": "ddp_step.png", "fsdp": "fsdp_step.png", "memory": "memory_per_rank.png"}
ENTRY_NAMES = {
    "ddp": "Chapter 04's step, traced: DDP buckets during backward",
    "fsdp": "Chapter 07's step, traced: FSDP2's all-gathers and reduce-scatters",
    "memory": "Chapter 07's memory per rank, with the root unit FSDP2 holds whole",
}


# ---- running the traced steps ------------------------------------------------------------------


def run_worker(mode: str, preset: str, out: Path, data_dir: Path, *more: str) -> str:
    """workers/step_trace.py under torchrun, 2 ranks on 127.0.0.1; returns its command as a
    reader types it."""
    args = ["--mode", mode, "--preset", preset, "--data-dir", data_dir, "--out", out, *more]
    port = launch.free_port()
    launch.run_torchrun(WORKER, WORLD, args, timeout=900, port=port, extra=["-m"])
    shown = launch.shown_command(
        launch.torchrun_command(WORKER, WORLD, args, port=port, extra=["-m"])
    )
    return shown.replace(f"--master-port={port}", "--master-port=PORT")


def make_runs(out: Path, data_dir: Path) -> dict:
    """The traced steps and the measured memory; what ran, how long, under what load."""
    prepare("shakespeare", data_dir, log=lambda *a: None)
    out.mkdir(parents=True, exist_ok=True)
    commands = {}
    loads = [load_average()]
    start = time.perf_counter()
    commands["ddp"] = run_worker("ddp", TRACE_PRESET, out, data_dir, "--grad-accum", "2")
    print(f"ddp: {commands['ddp']}", flush=True)
    loads.append(load_average())
    commands["fsdp"] = run_worker("fsdp", TRACE_PRESET, out, data_dir, "--memory")
    print(f"fsdp: {commands['fsdp']}", flush=True)
    loads.append(load_average())
    for preset in MEMORY_PRESETS:
        if preset != TRACE_PRESET:
            commands[f"memory {preset}"] = run_worker(
                "fsdp", preset, out, data_dir, "--memory", "--no-profile"
            )
            loads.append(load_average())
    wall = time.perf_counter() - start
    for mode in ("ddp", "fsdp"):
        merged = merge_ranks([out / f"{mode}_rank{rank}.json" for rank in range(WORLD)])
        with gzip.open(out / TRACE_FILES[mode], "wt") as f:
            json.dump(merged, f)
    import torch

    run = {
        "commands": commands,
        "wall_s": round(wall, 1),
        "load_average": max((load for load in loads if load is not None), default=None),
        "machine": machine_description("cpu"),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    return run


def merge_ranks(paths: list[Path]) -> dict:
    """Every rank's trace in one Chrome trace: process r is rank r, time 0 is the first event."""
    events = []
    for rank, path in enumerate(paths):
        trace = json.loads(path.read_text())
        for event in trace["traceEvents"]:
            if not isinstance(event.get("pid"), int):  # the profiler's own span, not the step
                continue
            if event.get("ph") == "M" and event["name"] in ("process_name", "process_labels"):
                continue
            events.append(dict(event, pid=rank))
        events.append(
            dict(ph="M", name="process_name", pid=rank, tid=0, args={"name": f"rank {rank}"})
        )
    start = min(e["ts"] for e in events if e.get("ph") == "X")
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - start, 3)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# ---- reading a trace ---------------------------------------------------------------------------


def read_trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def elements(event: dict) -> int:
    dims = event.get("args", {}).get("Input Dims") or [[]]
    return math.prod(dims[0]) if dims[0] else 0


def rank_timeline(trace: dict, rank: int) -> dict:
    """One rank's step: its main thread's labelled spans and operators, and its collectives.

    With gloo on the CPU a collective runs on one of gloo's own threads (pt_gloo_runloop), as a
    span named gloo:<collective>; the main thread only enqueues it (a c10d:: operator) and, where
    it needs the result, waits. The k-th collective enqueued is the k-th one a gloo thread runs.
    """
    mine = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") == rank]
    # the main thread runs nearly every operator; the profiler may name a thread twice
    main = Counter(e["tid"] for e in mine).most_common(1)[0][0]
    gloo = set()
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == rank:
            if "gloo" in e["args"]["name"] and e["tid"] != main:
                gloo.add(e["tid"])
    gloo = sorted(gloo)
    on_main = sorted((e for e in mine if e["tid"] == main), key=lambda e: e["ts"])
    spans = [
        e for e in on_main if e["name"].startswith(("forward (", "backward (", "optimizer step"))
    ]
    enqueued = [e for e in on_main if e["name"].startswith("c10d::") and "barrier" not in e["name"]]
    runs = sorted(
        (e for e in mine if e["tid"] in gloo and e["name"].startswith("gloo:")),
        key=lambda e: e["ts"],
    )
    collectives = []
    for launch_event, run in zip(enqueued, runs):
        collectives.append(
            {
                "kind": run["name"].removeprefix("gloo:"),
                "op": launch_event["name"],
                "start": run["ts"],
                "end": run["ts"] + run["dur"],
                "enqueued": launch_event["ts"],
                "lane": gloo.index(run["tid"]),
                "elements": elements(run),
                "bytes": 4 * elements(run),  # float32
            }
        )
    return {
        "main": on_main,
        "spans": spans,
        "collectives": collectives,
        "lanes": len(gloo),
        "enqueued": len(enqueued),
        "runs": len(runs),
    }


def span_of(timeline: dict, prefix: str) -> dict:
    return next(e for e in timeline["spans"] if e["name"].startswith(prefix))


def inside(t: float, event: dict) -> bool:
    return event["ts"] <= t <= event["ts"] + event["dur"]


def computing(main: list[dict], span: dict) -> list[tuple[float, float]]:
    """The intervals in `span` during which backward computed: autograd's functions, DDP's hooks
    and FSDP's waits left out."""
    out = []
    for e in main:
        name = e["name"]
        if not name.startswith("autograd::engine::evaluate_function:"):
            continue
        if "AccumulateGrad" in name or not inside(e["ts"], span):
            continue
        out.append((e["ts"], e["ts"] + e["dur"]))
    return out


def overlap(a: tuple[float, float], intervals: list[tuple[float, float]]) -> float:
    """How long interval a runs together with the (non-overlapping) intervals."""
    return sum(max(0.0, min(a[1], end) - max(a[0], start)) for start, end in intervals)


def ddp_facts(trace: dict) -> dict:
    """What the DDP trace shows, per rank: the buckets' all-reduces, when they run against
    backward, and that the no_sync micro-step sends nothing."""
    ranks = []
    for rank in range(WORLD):
        tl = rank_timeline(trace, rank)
        quiet = span_of(tl, "backward (micro-step 1")
        synced = span_of(tl, "backward (micro-step 2")
        step = span_of(tl, "optimizer step")
        buckets = [c for c in tl["collectives"] if c["kind"] == "all_reduce"]
        during_quiet = [c for c in buckets if c["start"] < synced["ts"]]
        compute = computing(tl["main"], synced)
        last_gradient = max(end for _, end in compute)
        ranks.append(
            {
                "buckets": len(buckets),
                "bucket_mb": [round(c["bytes"] / 1e6, 2) for c in buckets],
                "all_reduces_in_no_sync_micro_step": len(during_quiet),
                "started_before_last_gradient": sum(c["start"] < last_gradient for c in buckets),
                "all_reduce_ms": round(sum(c["end"] - c["start"] for c in buckets) / 1e3, 1),
                "all_reduce_ms_while_computing": round(
                    sum(overlap((c["start"], c["end"]), compute) for c in buckets) / 1e3, 1
                ),
                "synced_backward_ms": round(synced["dur"] / 1e3, 1),
                "no_sync_backward_ms": round(quiet["dur"] / 1e3, 1),
                "waits_after_last_gradient_ms": round(
                    (synced["ts"] + synced["dur"] - last_gradient) / 1e3, 1
                ),
                "all_done_before_optimizer_step": all(c["end"] <= step["ts"] for c in buckets),
            }
        )
    return {"ranks": ranks}


def unit_of(label: str) -> str:
    """FSDP's unit in one of its labels: 'FSDP::all_gather (transformer.h.0)' -> 'h.0'; the root's
    labels name no module."""
    if "(" in label and label.rstrip(")").split("(")[-1].strip():
        return label.rstrip(")").split("(")[-1].strip().removeprefix("transformer.")
    return "root"


def fsdp_units(timeline: dict) -> list[dict]:
    """Every collective of the FSDP step with its unit and its part: all-gather before forward,
    all-gather before backward, reduce-scatter after backward."""
    main = timeline["main"]
    labelled = [
        e
        for e in main
        if e["name"].startswith(("FSDP::all_gather (", "FSDP::post_backward_reduce"))
    ]
    labelled += [e for e in main if e["name"] == "FSDP::all_gather"]
    forward = span_of(timeline, "forward (")
    backward = span_of(timeline, "backward (")
    out = []
    for c in timeline["collectives"]:
        owner = next((e for e in labelled if inside(c["enqueued"], e)), None)
        if owner is None:
            continue
        if "post_backward_reduce" in owner["name"]:
            part = "reduce-scatter"
        elif inside(c["enqueued"], forward):
            part = "all-gather for forward"
        elif inside(c["enqueued"], backward):
            part = "all-gather for backward"
        else:
            continue
        out.append(dict(c, unit=unit_of(owner["name"]), part=part))
    return out


def block_compute(main: list[dict], phase: str) -> list[tuple[str, float, float]]:
    """(unit, start, end) of every block's own computation in forward or backward, between FSDP's
    hooks around it."""
    begin, finish = {
        "forward": ("FSDP::pre_forward (", "FSDP::post_forward ("),
        "backward": ("FSDP::pre_backward (", "FSDP::post_backward_accumulate ("),
    }[phase]
    starts = {unit_of(e["name"]): e["ts"] + e["dur"] for e in main if e["name"].startswith(begin)}
    ends = {unit_of(e["name"]): e["ts"] for e in main if e["name"].startswith(finish)}
    return [(u, starts[u], ends[u]) for u in sorted(starts) if u in ends and ends[u] > starts[u]]


def fsdp_facts(trace: dict) -> dict:
    ranks = []
    for rank in range(WORLD):
        units = fsdp_units(rank_timeline(trace, rank))
        per_unit: dict[str, list[str]] = {}
        for c in units:
            per_unit.setdefault(c["unit"], []).append(c["part"])
        ranks.append(
            {
                "units": per_unit,
                "gloo_reduce_scatter_as": sorted(
                    {c["kind"] for c in units if c["part"] == "reduce-scatter"}
                ),
            }
        )
    return {"ranks": ranks}


# ---- memory ------------------------------------------------------------------------------------


def root_bytes_counted(preset: str) -> int:
    """The bytes of the root unit's parameters (all but the blocks'), from the shapes."""
    import torch

    from common.model import GPT, model_config

    with torch.device("meta"):
        model = GPT(model_config(preset))
    total = 0
    for name, param in model.named_parameters():  # the tied matrix once
        if not name.startswith("transformer.h."):
            total += param.numel() * 4
    return total


def memory_rows(out: Path) -> list[dict]:
    """Per model: rank 0's bytes (MB) under DDP, ZeRO-1 and FSDP by kind, and FSDP's root unit."""
    from bench.memory_per_rank import counted

    rows = []
    for preset in MEMORY_PRESETS:
        facts = json.loads((out / f"fsdp_memory_{preset}.json").read_text())
        held = {kind: [b / 1e6 for b in pair] for kind, pair in facts["held_bytes"].items()}
        whole = sum(facts["whole_after_forward"].values()) / 1e6
        names = sorted(facts["whole_after_forward"])
        rows.append(dict(preset=preset, how="measured", held=held, root=whole, root_names=names))
    held = counted(COUNTED_PRESET)
    held.pop("total")
    rows.append(
        dict(
            preset=COUNTED_PRESET,
            how="counted",
            held=held,
            root=root_bytes_counted(COUNTED_PRESET) / 1e6,
            root_names=[],
        )
    )
    for row in rows:
        p, g, s = (row["held"][k] for k in ("parameters", "gradients", "optimizer state"))
        row["bars"] = {
            "DDP": [p[1], g[1], s[1], 0.0],
            "ZeRO-1": [p[1], g[1], s[0], 0.0],
            "FSDP": [p[0], g[0], s[0], row["root"]],
        }
    return rows


# ---- drawing -----------------------------------------------------------------------------------

COLOURS = {
    "forward": "#9ecae1",
    "backward": "#fdae6b",
    "optimizer": "#a1d99b",
    "waits": "#d9d9d9",
    "all_reduce": "#d62728",
    "all_gather": "#6a3d9a",
    "reduce-scatter": "#8c564b",
    "block": "#3182bd",
}


def phase_colour(name: str) -> str:
    if name.startswith("forward"):
        return COLOURS["forward"]
    if name.startswith("backward"):
        return COLOURS["backward"]
    return COLOURS["optimizer"]


def draw_timeline(ax, timelines: list[dict], extras, window: tuple[float, float], labels: bool):
    """Rows, top to bottom: rank 0's main thread, its gloo threads, rank 1's, ... (times in ms)."""
    rows = []
    for rank, tl in enumerate(timelines):
        base = -3 * rank
        rows += [(base, f"rank {rank}\nmain thread"), (base - 1.4, f"rank {rank}\ngloo threads")]
        for e in tl["spans"]:
            ax.barh(
                base,
                e["dur"] / 1e3,
                left=e["ts"] / 1e3,
                height=0.8,
                color=phase_colour(e["name"]),
                edgecolor="black",
                lw=0.4,
            )
        for start, end, colour, text in extras(rank, tl):
            ax.barh(base, (end - start) / 1e3, left=start / 1e3, height=0.5, color=colour, lw=0)
            if labels and text and window[0] <= start / 1e3 <= window[1]:
                ax.text(
                    (start + end) / 2e3,
                    base,
                    text,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                    clip_on=True,
                )
        lane_height = 0.8 / max(tl["lanes"], 1)
        for c in tl["collectives"]:
            y = base - 1.4 + 0.4 - lane_height * (c["lane"] + 0.5)
            colour = COLOURS["reduce-scatter" if c.get("part") == "reduce-scatter" else c["kind"]]
            ax.barh(
                y,
                (c["end"] - c["start"]) / 1e3,
                left=c["start"] / 1e3,
                height=lane_height * 0.9,
                color=colour,
                lw=0,
            )
            if labels and c.get("text") and window[0] <= c["start"] / 1e3 <= window[1]:
                ax.text(
                    c["start"] / 1e3,
                    y + lane_height * 0.5,
                    c["text"],
                    fontsize=5.5,
                    va="bottom",
                    clip_on=True,
                )
    ax.set_yticks([y for y, _ in rows], [name for _, name in rows], fontsize=7)
    ax.set_xlim(*window)
    ax.set_ylim(-3 * len(timelines) + 1, 0.9)
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(axis="x", labelsize=7)


def ddp_extras(rank: int, tl: dict):
    """On DDP's main thread: the end of the synced backward, where it waits for the last buckets."""
    synced = span_of(tl, "backward (micro-step 2")
    last = max(end for _, end in computing(tl["main"], synced))
    return [(last, synced["ts"] + synced["dur"], COLOURS["waits"], "")]


def fsdp_extras(rank: int, tl: dict):
    """On FSDP's main thread: each block's own computation, and the waits for FSDP's collectives."""
    out = []
    for phase in ("forward", "backward"):
        for unit, start, end in block_compute(tl["main"], phase):
            out.append((start, end, COLOURS["block"], unit))
    for e in tl["main"]:
        if e["name"].startswith(("FSDP::all_gather", "FSDP::post_backward_reduce")):
            if "copy_out" not in e["name"]:
                out.append((e["ts"], e["ts"] + e["dur"], COLOURS["waits"], ""))
    return out


def legend(fig, entries: list[tuple[str, str]]):
    import matplotlib.patches as mpatches

    handles = [mpatches.Patch(color=colour, label=text) for text, colour in entries]
    fig.legend(
        handles=handles, loc="lower center", ncol=min(len(entries), 4), fontsize=7, frameon=False
    )


def draw_step(kind: str, trace: dict, path: Path, title: str, zooms, entries, extras, texts):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = [rank_timeline(trace, rank) for rank in range(WORLD)]
    for tl in timelines:
        texts(tl)
    end = max(e["ts"] + e["dur"] for tl in timelines for e in tl["spans"]) / 1e3
    fig = plt.figure(figsize=(11, 7.2))
    windows = zooms(timelines)
    grid = fig.add_gridspec(2, len(windows), height_ratios=[1, 1.25], hspace=0.45, wspace=0.08)
    top = fig.add_subplot(grid[0, :])
    draw_timeline(top, timelines, extras, (0, end * 1.01), labels=False)
    top.set_title("the whole step (ms)", fontsize=8)
    for i, (name, window) in enumerate(windows):
        ax = fig.add_subplot(grid[1, i])
        draw_timeline(ax, timelines, extras, window, labels=True)
        ax.set_title(f"{name} (ms)", fontsize=8)
        if i:
            ax.set_yticklabels([])
        top.axvspan(*window, color="black", alpha=0.06)
    fig.suptitle(title, fontsize=9)
    legend(fig, entries)
    fig.subplots_adjust(left=0.09, right=0.99, top=0.9, bottom=0.11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ms(event: dict) -> tuple[float, float]:
    return event["ts"] / 1e3, (event["ts"] + event["dur"]) / 1e3


def across(timelines: list[dict], first: str, last: str) -> tuple[float, float]:
    """From the earliest start of span `first` on any rank to the latest end of span `last` (ms)."""
    start = min(ms(span_of(tl, first))[0] for tl in timelines)
    end = max(ms(span_of(tl, last))[1] for tl in timelines)
    return start, end


def draw_ddp(trace: dict, path: Path, subtitle: str) -> None:
    def zooms(timelines):
        quiet = across(timelines, "backward (micro-step 1", "backward (micro-step 1")
        synced = across(timelines, "backward (micro-step 2", "optimizer step")
        pad = 0.04 * (synced[1] - synced[0])
        return [
            ("micro-step 1's backward, under no_sync()", (quiet[0] - pad, quiet[1] + pad)),
            ("micro-step 2's backward and the optimizer step", (synced[0] - pad, synced[1] + pad)),
        ]

    def texts(tl):
        for i, c in enumerate(c for c in tl["collectives"] if c["kind"] == "all_reduce"):
            c["text"] = str(i + 1)

    sizes = ", ".join(f"{mb:.1f}" for mb in ddp_facts(trace)["ranks"][0]["bucket_mb"])
    entries = [
        ("forward", COLOURS["forward"]),
        ("backward", COLOURS["backward"]),
        ("optimizer step", COLOURS["optimizer"]),
        ("backward waits for the last all-reduces", COLOURS["waits"]),
        (f"all-reduce of bucket 1, 2, ... (gloo thread): {sizes} MB", COLOURS["all_reduce"]),
    ]
    title = (
        "Chapter 04, one optimizer step of 2 micro-steps under DDP, 2 ranks: the buckets' "
        f"all-reduces run during the last backward\n{subtitle}"
    )
    draw_step("ddp", trace, path, title, zooms, entries, ddp_extras, texts)


def draw_fsdp(trace: dict, path: Path, subtitle: str) -> None:
    def zooms(timelines):
        forward = across(timelines, "forward (", "forward (")
        blocks = [end for tl in timelines for _, _, end in block_compute(tl["main"], "forward")]
        last_block = max(blocks) / 1e3
        backward = across(timelines, "backward (", "optimizer step")
        pad = 0.03 * (last_block - forward[0])
        return [
            (
                "forward: the root's all-gather, then each block's",
                (forward[0] - pad, last_block + pad),
            ),
            ("backward and the optimizer step", (backward[0] - pad, backward[1] + pad)),
        ]

    def texts(tl):
        for c in fsdp_units(tl):
            match = next(x for x in tl["collectives"] if x["start"] == c["start"])
            match["part"] = c["part"]
            match["text"] = c["unit"]

    entries = [
        ("forward", COLOURS["forward"]),
        ("backward", COLOURS["backward"]),
        ("optimizer step", COLOURS["optimizer"]),
        ("a block's own computation", COLOURS["block"]),
        ("main thread waits for FSDP's collective", COLOURS["waits"]),
        ("all-gather (gloo thread)", COLOURS["all_gather"]),
        ("reduce-scatter (gloo: an all-reduce)", COLOURS["reduce-scatter"]),
    ]
    title = (
        "Chapter 07, one FSDP2 step, 2 ranks: every block gathered before its forward and again "
        f"before its backward, its gradient reduce-scattered after\n{subtitle}"
    )
    draw_step("fsdp", trace, path, title, zooms, entries, fsdp_extras, texts)


def draw_memory(rows: list[dict], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [
        ("parameters", "#6baed6", ""),
        ("gradients", "#fd8d3c", ""),
        ("AdamW state", "#74c476", ""),
        ("root unit held whole, end of forward to its backward", "white", "///"),
    ]
    fig, axes = plt.subplots(1, len(rows), figsize=(11, 4.6))
    for ax, row in zip(axes, rows):
        names = list(row["bars"])
        bottoms = [0.0] * len(names)
        for k, (kind, colour, hatch) in enumerate(kinds):
            heights = [row["bars"][n][k] for n in names]
            ax.bar(
                names,
                heights,
                bottom=bottoms,
                color=colour,
                hatch=hatch,
                edgecolor="black",
                lw=0.5,
                label=kind,
            )
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        for i, n in enumerate(names):
            held = sum(row["bars"][n][:3])
            text = f"{held:,.2f} MB"
            if row["bars"][n][3]:
                text += f"\n+ {row['bars'][n][3]:,.2f} MB"
            ax.text(i, bottoms[i], text, ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, max(bottoms) * 1.22)
        ax.set_title(f"{row['preset']} ({row['how']})", fontsize=9)
        ax.set_ylabel("MB (10^6 bytes) on rank 0", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(
        f"Chapter 07: what one rank of 2 holds during a step, float32 with AdamW\n{subtitle}",
        fontsize=9,
    )
    fig.subplots_adjust(left=0.07, right=0.99, top=0.85, bottom=0.16, wspace=0.35)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the facts, in the results file and the captions ------------------------------------------


def ddp_table(facts: dict) -> str:
    lines = [
        "| rank | buckets | their sizes (MB) | all-reduces during the no_sync micro-step "
        "| all-reduces started before the last gradient was computed | all-reduce time (ms) "
        "| of it while backward computes (ms) | backward waits after its last gradient (ms) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for rank, r in enumerate(facts["ranks"]):
        sizes = ", ".join(f"{mb:.2f}" for mb in r["bucket_mb"])
        lines.append(
            f"| {rank} | {r['buckets']} | {sizes} | {r['all_reduces_in_no_sync_micro_step']} "
            f"| {r['started_before_last_gradient']} of {r['buckets']} | {r['all_reduce_ms']:.1f} "
            f"| {r['all_reduce_ms_while_computing']:.1f} "
            f"| {r['waits_after_last_gradient_ms']:.1f} |"
        )
    return "\n".join(lines)


def fsdp_table(facts: dict) -> str:
    lines = ["| unit | " + " | ".join(f"rank {r}" for r in range(WORLD)) + " |"]
    lines.append("|---|" + "---|" * WORLD)
    units = list(facts["ranks"][0]["units"])
    for unit in units:
        cells = [", ".join(r["units"].get(unit, [])) for r in facts["ranks"]]
        lines.append(f"| {unit} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    lines = [
        "| model | kind | DDP (MB) | ZeRO-1 (MB) | FSDP (MB) |",
        "|---|---|---:|---:|---:|",
    ]
    kinds = [
        "parameters",
        "gradients",
        "AdamW state",
        "root unit held whole from forward to backward",
    ]
    for row in rows:
        for k, kind in enumerate(kinds):
            cells = [
                f"{row['bars'][n][k]:,.2f}" if row["bars"][n][k] else "-"
                for n in ("DDP", "ZeRO-1", "FSDP")
            ]
            lines.append(
                f"| `{row['preset']}` ({row['how']}) | {kind} | " + " | ".join(cells) + " |"
            )
        totals = [f"{sum(row['bars'][n][:3]):,.2f}" for n in ("DDP", "ZeRO-1", "FSDP")]
        lines.append(
            f"| `{row['preset']}` ({row['how']}) | parameters + gradients + AdamW state | "
            + " | ".join(totals)
            + " |"
        )
    return "\n".join(lines)


def subtitle_of(run: dict) -> str:
    load = run.get("load_average")
    busy = f", load average up to {load:.1f}" if load is not None else ""
    return (
        f"{machine_text(dict(run['machine'], torch=run['torch']))}{busy}; "
        f"gloo on the CPU, 1 thread per rank, preset {TRACE_PRESET}, batch 4 per rank"
    )


def entry(
    name: str, value: str, what: str, run: dict, table: str, source: str, notes: list[str]
) -> dict:
    machine = run["machine"]
    load = run.get("load_average")
    words = f"{machine.get('cores')} CPU cores ({machine.get('cpu')}), {machine.get('os')}"
    if load is not None:
        words += f", load average up to {load:.1f} during the runs"
    return {
        "section": SECTION,
        "name": name,
        "value": value,
        "what": what,
        "machine": words,
        "torch": run["torch"],
        "command": "python -m maintainer.step_pictures",
        "date": run["date"],
        "table": table,
        "source": source,
        "notes": notes,
    }


CAPTIONS = {
    "ddp": (
        "Chapter 04's step, traced by torch.profiler on the CPU (gloo, 2 ranks under torchrun, "
        "the `small` model, batch 4 per rank, 2 micro-steps, `bucket_cap_mb=1` so that the small "
        "model has several buckets; chapter 04 keeps DDP's default of 25; a tensor larger than "
        "the cap, the token embedding, gets a bucket of its own). Each rank has two rows: "
        "its main thread (forward, backward, the optimizer step) and gloo's threads, where the "
        "all-reduces run. The first micro-step runs under `no_sync()`: its backward sends nothing. "
        "In the last micro-step's backward every bucket's all-reduce starts as soon as its "
        "gradients are ready, while autograd is still computing the earlier layers' gradients; the "
        "token embedding (tied to the output layer) is the last bucket, since its gradient is "
        "complete only after the embedding's backward. Backward returns once every bucket is "
        "averaged (the grey part). An all-reduce completes only when both ranks have joined it: "
        "where one rank runs behind the other (on a busy machine, by hundreds of milliseconds), "
        "the other's all-reduce bars stretch until it catches up. The chunked loss computes its "
        "gradient during forward, which is why forward is the long part here. A CPU's timeline "
        "is not a GPU's: here compute and communication share two busy cores, and the durations "
        "mean little. What carries over to GPUs with NCCL is the order and the overlap: "
        "buckets in the order the gradients become ready, communicating during backward, "
        "nothing during `no_sync()`."
    ),
    "fsdp": (
        "Chapter 07's step, traced the same way (FSDP2's `fully_shard` on every block, then on the "
        "whole model, as chapter 07 shards it; one micro-step). In forward the root unit (the "
        "embeddings, the last LayerNorm, the output layer) is gathered first, then each block's "
        "parameters just before it runs (h.0 to h.3); in backward each block is gathered again, "
        "the next one early (FSDP's prefetch), and right after its backward its gradient is "
        "reduce-scattered, so that each rank keeps the sum of its own shard. The root unit is "
        "not gathered again for backward: FSDP2 keeps the root's parameters whole from forward to "
        "backward (torch's FSDPState sets the root's post-forward resharding off), and "
        "reduce-scatters its gradient last. gloo has no reduce-scatter of its own: it all-reduces "
        "the whole gradient and each rank keeps its shard (NCCL's reduce-scatter sends half the "
        "bytes). On the CPU the main thread waits for each collective (grey); on a GPU they run "
        "on their own streams, beside the computation. The durations mean little; the order and "
        "what runs before what are the same on GPUs."
    ),
    "memory": (
        "What rank 0 of 2 holds, float32 with AdamW: parameters, gradients (as large as the "
        "parameters during the step; freed between steps by `zero_grad`) and AdamW's two averages. "
        "`tiny` and `small` measured in 2-rank FSDP2 runs (workers/step_trace.py: the bytes of "
        "each rank's tensors, as chapter 07 prints them, DDP's being the whole tensors), GPT-2 "
        "124M counted from its shapes (bench/memory_per_rank.py). ZeRO-1 is DDP's parameters and "
        "gradients with FSDP's optimizer-state shard. The hatched part is what FSDP2 holds whole "
        "on top of its shards from the end of forward until its backward: the root unit's "
        "parameters (the token embedding, tied to the output layer, the positions and the last "
        "LayerNorm), measured as the parameters that are still whole tensors, not DTensor shards, "
        "right after forward. With a vocabulary of 50,304 tokens the token embedding is most of "
        "`tiny` and `small`, so their root unit is most of the model; in GPT-2 124M it is about a "
        "third. Activations, and the block or two FSDP has gathered at a moment, come on top."
    ),
}


def write_section(figures: Path, begin: str, end: str, lines: list[str]) -> Path:
    """docs/figures/CAPTIONS.md with its section from `begin` to `end` replaced by `lines`, or
    with them appended where it has no such section yet; the other sections stay as they are.
    Every figure drawn outside maintainer/make_plots.py keeps its captions in a section so marked
    (make_plots keeps all of them: everything after this script's)."""
    path = figures / "CAPTIONS.md"
    old = path.read_text() if path.exists() else "# Figures\n"
    section = "\n".join([begin, *lines, end])
    if begin in old:
        before = old.split(begin)[0]
        after = old.split(end, 1)[1] if end in old else ""
    else:
        before, after = old.rstrip("\n") + "\n\n", ""
    path.write_text(before + section + after.rstrip("\n") + "\n")
    return path


def write_captions(figures: Path, subtitles: dict[str, str], commands: dict) -> Path:
    lines = [
        "",
        "## Inside one step",
        "",
        "Drawn by `python -m maintainer.step_pictures` from runs it made:",
        "",
    ]
    lines += [f"- {what}: `{command}`" for what, command in commands.items()]
    lines.append("")
    for key in ("ddp", "fsdp", "memory"):
        name = FIGURES[key]
        lines += [f"### {name}", "", f"![{name}]({name})", "", CAPTIONS[key], ""]
        if key in TRACE_FILES:
            lines += [
                f"The trace, both ranks: [{TRACE_FILES[key]}]({TRACE_FILES[key]}) (open it in "
                "https://ui.perfetto.dev or chrome://tracing).",
                "",
            ]
        lines += [f"*{subtitles[key]}.*", ""]
    return write_section(figures, CAPTIONS_BEGIN, CAPTIONS_END, lines)


def draw_all(out: Path, figures: Path, record: bool) -> None:
    import shutil

    run = json.loads((out / "run.json").read_text())
    subtitle = subtitle_of(run)
    figures.mkdir(parents=True, exist_ok=True)
    traces = {mode: read_trace(out / TRACE_FILES[mode]) for mode in TRACE_FILES}
    draw_ddp(traces["ddp"], figures / FIGURES["ddp"], subtitle)
    draw_fsdp(traces["fsdp"], figures / FIGURES["fsdp"], subtitle)
    rows = memory_rows(out)
    memory_subtitle = subtitle.split("; gloo")[0]  # the machine: no trace settings
    draw_memory(rows, figures / FIGURES["memory"], memory_subtitle)
    for name in TRACE_FILES.values():
        if (out / name).resolve() != (figures / name).resolve():
            shutil.copyfile(out / name, figures / name)
    for path in [
        *(figures / n for n in FIGURES.values()),
        *(figures / n for n in TRACE_FILES.values()),
    ]:
        print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")
    subtitles = {"ddp": subtitle, "fsdp": subtitle, "memory": memory_subtitle}
    print(f"wrote {write_captions(figures, subtitles, run['commands'])}")
    if not record:
        return
    ddp = ddp_facts(traces["ddp"])["ranks"][0]
    fsdp = fsdp_facts(traces["fsdp"])
    blocks = [u for u in fsdp["ranks"][0]["units"] if u != "root"]
    small = next(r for r in rows if r["preset"] == TRACE_PRESET)
    entries = [
        entry(
            ENTRY_NAMES["ddp"],
            f"{ddp['buckets']} buckets, {ddp['started_before_last_gradient']} of "
            f"{ddp['buckets']} all-reduces started before backward's last gradient; "
            "none in the no_sync micro-step",
            "one optimizer step of chapter 04's DDP (2 micro-steps, the first under no_sync(), "
            "bucket_cap_mb=1), `small`, 2 ranks, gloo on the CPU, traced by torch.profiler; the "
            "facts of docs/figures/ddp_step.png, read from its trace.",
            run,
            ddp_table(ddp_facts(traces["ddp"])),
            f"docs/figures/{TRACE_FILES['ddp']}",
            [f"worker: `{run['commands']['ddp']}`", "a CPU's durations, on a shared machine"],
        ),
        entry(
            ENTRY_NAMES["fsdp"],
            f"{len(blocks)} blocks, each gathered before its forward and before its backward and "
            "reduce-scattered after it; the root unit gathered once and reduce-scattered last",
            "one step of chapter 07's FSDP2 (fully_shard per block and on the model), `small`, "
            "2 ranks, gloo on the CPU, traced by torch.profiler: each unit's collectives in the "
            "order they ran; the facts of docs/figures/fsdp_step.png, read from its trace.",
            run,
            fsdp_table(fsdp),
            f"docs/figures/{TRACE_FILES['fsdp']}",
            [
                f"worker: `{run['commands']['fsdp']}`",
                "gloo runs a reduce-scatter as an all-reduce of the whole gradient",
            ],
        ),
        entry(
            ENTRY_NAMES["memory"],
            f"small: the root unit holds {small['root']:,.2f} MB whole from forward to backward",
            "what rank 0 of 2 holds (float32, AdamW): tiny and small measured in 2-rank FSDP2 "
            "runs, gpt2 counted; ZeRO-1 = DDP's parameters and gradients + FSDP's optimizer-state "
            "shard; the figures of docs/figures/memory_per_rank.png.",
            run,
            memory_table(rows),
            "workers/step_trace.py --memory (common/sharding.py's held_bytes; the parameters still "
            "whole after forward)",
            [
                f"{what}: `{command}`"
                for what, command in run["commands"].items()
                if "memory" in what
            ],
        ),
    ]
    results = registry.load()
    for e in entries:
        registry.store(results, e)
    registry.save(results)
    print(f"recorded {len(entries)} entries in {registry.RESULTS_JSON.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--from-runs", type=Path, default=None, metavar="DIR", help="draw these runs")
    p.add_argument("--out-root", type=Path, default=ROOT / "out" / "step_pictures")
    p.add_argument("--figures", type=Path, default=ROOT / "docs" / "figures")
    p.add_argument("--data-dir", type=Path, default=ROOT / "data")
    p.add_argument("--no-record", dest="record", action="store_false", help="leave results.json")
    args = p.parse_args(argv)
    out = args.from_runs or args.out_root
    if args.from_runs is None:
        make_runs(out, args.data_dir)
    draw_all(out, args.figures, record=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
