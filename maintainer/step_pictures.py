"""Pictures of what happens inside one training step, from real runs traced by torch.profiler.

    python -m maintainer.step_pictures                    # trace, measure, record, draw (minutes)
    python -m maintainer.step_pictures --from-runs out/step_pictures   # keep runs already made
    python -m maintainer.step_pictures --redraw           # run nothing: draw what is kept

It runs workers/step_trace.py under torchrun, 2 ranks on 127.0.0.1 (a free port), on the CPU with
gloo, keeps the traces in docs/figures/ (or --figures) and the runs' facts in
bench/results/results.json, with the machine, its load, torch's version and the commands. Then,
from what is kept (the traces and those entries, never from anything else), it draws:

    ddp_step.png              chapter 04: one optimizer step of 2 micro-steps under DDP, each
                              rank's main thread and its gloo threads: the first micro-step under
                              no_sync() sends nothing, the last one's backward all-reduces bucket
                              after bucket while it is still computing
    ddp_step_trace.json.gz    its trace, both ranks in one file (Perfetto opens it)
    ddp_step_gpu.png          a diagram, not a measurement: the same step on a GPU's compute and
                              communication streams, and which communication they hide
    fsdp_step.png             chapter 07: one FSDP2 step: the all-gather of every block before
                              its forward and again before its backward, the reduce-scatter of
                              its gradient after it; the root unit's, gathered once
    fsdp_step_trace.json.gz   its trace
    fsdp_step_gpu.png         its diagram on a GPU's two streams
    memory_per_rank.png       chapter 07: what one rank of 2 holds under DDP, ZeRO-1 and FSDP:
                              parameters, gradients, AdamW's state, and the root unit that FSDP2
                              holds whole from the end of forward to its backward; tiny and small
                              measured, GPT-2 124M counted from its shapes

Their captions go into docs/figures/CAPTIONS.md (a section of its own, which
maintainer/make_plots.py keeps), then bench/RESULTS.md is rendered again (`python -m
maintainer.results`). A CPU's timeline is not a GPU's: what carries over is the order of the
operations and which of them overlap.
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
FIGURES = {  # the pictures, in the order CAPTIONS.md shows them
    "ddp": "ddp_step.png",
    "ddp_gpu": "ddp_step_gpu.png",
    "fsdp": "fsdp_step.png",
    "fsdp_gpu": "fsdp_step_gpu.png",
    "memory": "memory_per_rank.png",
}
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
                **forward_and_backward(tl, "micro-step 2"),
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


LOSS = "ChunkedLinearCrossEntropy"  # common/chunked_loss.py's autograd function, as traced


def loss_of(timeline: dict, forward: dict) -> dict:
    """The loss inside a forward span: the chunked loss, which computes the output layer's
    gradient there too (its backward only hands the gradient on)."""
    return next(e for e in timeline["main"] if e["name"] == LOSS and inside(e["ts"], forward))


def forward_and_backward(timeline: dict, micro_step: str) -> dict:
    """One micro-step's forward, the loss's part of it, and its backward, in ms."""
    forward = span_of(timeline, f"forward ({micro_step}")
    backward = span_of(timeline, f"backward ({micro_step}")
    return {
        "forward_ms": round(forward["dur"] / 1e3, 1),
        "loss_in_forward_ms": round(loss_of(timeline, forward)["dur"] / 1e3, 1),
        "backward_ms": round(backward["dur"] / 1e3, 1),
    }


def fsdp_facts(trace: dict) -> dict:
    ranks = []
    for rank in range(WORLD):
        timeline = rank_timeline(trace, rank)
        units = fsdp_units(timeline)
        per_unit: dict[str, list[str]] = {}
        for c in units:
            per_unit.setdefault(c["unit"], []).append(c["part"])
        ranks.append(
            {
                "units": per_unit,
                "gloo_reduce_scatter_as": sorted(
                    {c["kind"] for c in units if c["part"] == "reduce-scatter"}
                ),
                **forward_and_backward(timeline, "micro-step 1"),
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

# Drawn for the site's column: 7 inches at 170 dpi is 1,190 pixels, which a page shows at about
# 650 and a click opens whole; the fonts are sized for the column.
WIDTH_IN = 7.0
DPI = 170
FONT = 8.5  # labels, ticks, legends
TITLE_FONT = 10

COLOURS = {
    "forward": "#9ecae1",
    "backward": "#fdae6b",
    "optimizer": "#a1d99b",
    "waits": "#d9d9d9",
    "all_reduce": "#d62728",
    "all_gather": "#6a3d9a",
    "reduce-scatter": "#8c564b",
    "block": "#3182bd",
    "hidden": "#31a354",
    "exposed": "#de2d26",
}
LOSS_HATCH = "////"
LOSS_EDGE = "#3c6e8f"


def phase_colour(name: str) -> str:
    if name.startswith("forward"):
        return COLOURS["forward"]
    if name.startswith("backward"):
        return COLOURS["backward"]
    return COLOURS["optimizer"]


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def hatch_loss(ax, y: float, start: float, length: float, height: float) -> None:
    """The loss's part of a forward, hatched over the forward's colour."""
    ax.barh(
        y,
        length,
        left=start,
        height=height,
        color="none",
        hatch=LOSS_HATCH,
        edgecolor=LOSS_EDGE,
        lw=0,
    )


RANK_ROWS = 3.6  # the height of one rank's rows: its main thread, then its gloo threads
GLOO_ROW = 1.6  # how far below the main thread the gloo threads are drawn


def draw_timeline(ax, timelines: list[dict], extras, window: tuple[float, float], labels: bool):
    """Rows, top to bottom: rank 0's main thread, its gloo threads, rank 1's, ... (times in ms).
    The loss inside each forward is hatched, and labelled where there is room. Labels: a
    block's inside it; an all-gather's or all-reduce's above its row, a reduce-scatter's below."""
    rows = []
    for rank, tl in enumerate(timelines):
        base = -RANK_ROWS * rank
        gloo = base - GLOO_ROW
        rows += [(base, f"rank {rank} main"), (gloo, f"rank {rank} gloo")]
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
            if e["name"].startswith("forward"):
                start, end = ms(loss_of(tl, e))
                hatch_loss(ax, base, start, end - start, 0.8)
                if not labels:  # the whole step's panel: the loss in words
                    ax.text(
                        (start + end) / 2,
                        base,
                        f"the loss and its gradient: {end - start:,.0f} ms",
                        ha="center",
                        va="center",
                        fontsize=FONT,
                        bbox=dict(facecolor="white", edgecolor="none", pad=1.0, alpha=0.85),
                        clip_on=True,
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
                    fontsize=FONT - 1,
                    color="white",
                    clip_on=True,
                )
        lane_height = 0.8 / max(tl["lanes"], 1)
        for c in tl["collectives"]:
            y = gloo + 0.4 - lane_height * (c["lane"] + 0.5)
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
                below = c.get("part") == "reduce-scatter"
                ax.text(
                    c["start"] / 1e3,
                    gloo - 0.45 if below else gloo + 0.45,
                    c["text"],
                    fontsize=FONT - 1,
                    va="top" if below else "bottom",
                    color=colour,
                    clip_on=True,
                )
    ax.set_yticks([y for y, _ in rows], [name for _, name in rows], fontsize=FONT)
    ax.set_xlim(*window)
    ax.set_ylim(-RANK_ROWS * (len(timelines) - 1) - GLOO_ROW - 1.3, 0.6)
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(axis="x", labelsize=FONT)


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


def legend(fig, entries: list[tuple[str, str]], columns: int = 2):
    import matplotlib.patches as mpatches

    handles = []
    for text, colour in entries:
        if colour == "loss":
            patch = mpatches.Patch(
                facecolor="white", hatch=LOSS_HATCH, edgecolor=LOSS_EDGE, label=text
            )
        else:
            patch = mpatches.Patch(color=colour, label=text)
        handles.append(patch)
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=columns,
        fontsize=FONT,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )


def draw_step(trace: dict, path: Path, title: str, zooms, entries, extras, texts, machine: str):
    """The whole step on top, then two parts of it enlarged, each as wide as the picture."""
    plt = pyplot()
    timelines = [rank_timeline(trace, rank) for rank in range(WORLD)]
    for tl in timelines:
        texts(tl)
    end = max(e["ts"] + e["dur"] for tl in timelines for e in tl["spans"]) / 1e3
    fig = plt.figure(figsize=(WIDTH_IN, 5.2))
    windows = zooms(timelines)
    grid = fig.add_gridspec(len(windows) + 1, 1, hspace=0.62)
    top = fig.add_subplot(grid[0])
    draw_timeline(top, timelines, extras, (0, end * 1.01), labels=False)
    top.set_title("the whole step (ms)", fontsize=FONT, loc="left")
    for i, (name, window) in enumerate(windows):
        ax = fig.add_subplot(grid[i + 1])
        draw_timeline(ax, timelines, extras, window, labels=True)
        ax.set_title(f"enlarged: {name} (ms)", fontsize=FONT, loc="left")
        top.axvspan(*window, color="black", alpha=0.08)
    fig.suptitle(title, fontsize=TITLE_FONT, x=0.01, ha="left", y=0.995)
    fig.text(0.01, 0.958, wrapped(machine), fontsize=FONT - 1, ha="left", va="top", color="#444")
    legend(fig, entries)
    fig.subplots_adjust(left=0.12, right=0.99, top=0.86, bottom=0.2)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def wrapped(line: str, width: int = 130) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(line, width))


def ms(event: dict) -> tuple[float, float]:
    return event["ts"] / 1e3, (event["ts"] + event["dur"]) / 1e3


def across(timelines: list[dict], first: str, last: str) -> tuple[float, float]:
    """From the earliest start of span `first` on any rank to the latest end of span `last` (ms)."""
    start = min(ms(span_of(tl, first))[0] for tl in timelines)
    end = max(ms(span_of(tl, last))[1] for tl in timelines)
    return start, end


def draw_ddp(trace: dict, path: Path, machine: str) -> None:
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
        ("the loss and its gradient (in forward)", "loss"),
        ("backward", COLOURS["backward"]),
        ("backward waits for the last all-reduces", COLOURS["waits"]),
        ("optimizer step", COLOURS["optimizer"]),
        (f"all-reduce of bucket 1, 2, ...: {sizes} MB", COLOURS["all_reduce"]),
    ]
    title = "Chapter 04 · one DDP step of 2 micro-steps on 2 CPU ranks, traced"
    draw_step(trace, path, title, zooms, entries, ddp_extras, texts, machine)


def draw_fsdp(trace: dict, path: Path, machine: str) -> None:
    def zooms(timelines):
        forward = across(timelines, "forward (", "forward (")
        blocks = [end for tl in timelines for _, _, end in block_compute(tl["main"], "forward")]
        last_block = max(blocks) / 1e3
        backward = across(timelines, "backward (", "optimizer step")
        pad = 0.12 * (last_block - forward[0])
        return [
            (
                "forward: the root's all-gather, then each block's, then the loss",
                (forward[0] - 0.02 * last_block, last_block + pad),
            ),
            ("backward and the optimizer step", (backward[0] - pad / 4, backward[1] + pad / 4)),
        ]

    def texts(tl):
        for c in fsdp_units(tl):
            match = next(x for x in tl["collectives"] if x["start"] == c["start"])
            match["part"] = c["part"]
            match["text"] = c["unit"]

    entries = [
        ("forward", COLOURS["forward"]),
        ("the loss and its gradient (in forward)", "loss"),
        ("backward", COLOURS["backward"]),
        ("optimizer step", COLOURS["optimizer"]),
        ("a block's own computation", COLOURS["block"]),
        ("main thread waits for FSDP's collective", COLOURS["waits"]),
        ("all-gather", COLOURS["all_gather"]),
        ("reduce-scatter (gloo: an all-reduce)", COLOURS["reduce-scatter"]),
    ]
    title = "Chapter 07 · one FSDP2 step on 2 CPU ranks, traced"
    draw_step(trace, path, title, zooms, entries, fsdp_extras, texts, machine)


# ---- the same step on a GPU: a diagram -----------------------------------------------------------

# Illustrative lengths: a block's backward does twice its forward's arithmetic (the gradients of
# its inputs and of its weights); the collectives are shorter than the computation they hide
# behind, as on GPUs with NCCL and a large enough batch.
BLOCK_FORWARD, BLOCK_BACKWARD, LOSS_LENGTH = 1.0, 2.0, 2.0
EMBEDDING_BACKWARD, OPTIMIZER = 0.7, 2.5
COMPUTE, COMMUNICATION = 0, 1  # the diagram's rows (streams)


class Streams:
    """A step laid out on two streams: each piece starts once its stream is free and what it
    needs is done."""

    def __init__(self) -> None:
        self.free = {COMPUTE: 0.0, COMMUNICATION: 0.0}
        self.pieces: list[tuple[int, float, float, str, str]] = []

    def add(self, stream: int, length: float, text: str, colour: str, after: float = 0.0) -> float:
        start = max(self.free[stream], after)
        self.free[stream] = start + length
        self.pieces.append((stream, start, length, text, colour))
        return start + length


def ddp_streams(buckets: int, blocks: int) -> Streams:
    """Chapter 04's step: micro-step 1 under no_sync() sends nothing; in micro-step 2 each
    bucket's all-reduce starts once backward has made its gradients, the token embedding's last."""
    s = Streams()
    for micro_step in (1, 2):
        s.add(COMPUTE, blocks * BLOCK_FORWARD, f"forward {micro_step}", COLOURS["forward"])
        s.add(COMPUTE, LOSS_LENGTH, "loss", "loss")
        if micro_step == 1:
            s.add(
                COMPUTE,
                blocks * BLOCK_BACKWARD + EMBEDDING_BACKWARD,
                "backward 1: no_sync()",
                COLOURS["backward"],
            )
            continue
        part = blocks * BLOCK_BACKWARD / (buckets - 1)
        done = 0.0
        middle = (buckets - 1) // 2 + 1  # the part whose label is the whole backward's
        for bucket in range(1, buckets):
            text = "backward 2" if bucket == middle else ""
            ready = s.add(COMPUTE, part, text, COLOURS["backward"])
            done = s.add(COMMUNICATION, 0.6 * part, str(bucket), COLOURS["all_reduce"], ready)
        ready = s.add(COMPUTE, EMBEDDING_BACKWARD, "", COLOURS["backward"])
        done = s.add(COMMUNICATION, 1.2 * part, str(buckets), COLOURS["all_reduce"], ready)
    s.add(COMPUTE, OPTIMIZER, "optimizer", COLOURS["optimizer"], done)
    return s


def fsdp_streams(blocks: list[str]) -> Streams:
    """Chapter 07's step: the root's all-gather, then each block's, the next one while the block
    before it computes; in backward each block gathered again, a block early, and its gradient
    reduce-scattered while the next block computes; the root's last."""
    s = Streams()
    s.add(COMMUNICATION, 0.8, "root", COLOURS["all_gather"])
    ready = s.add(COMMUNICATION, 0.6, blocks[0], COLOURS["all_gather"])
    for k, unit in enumerate(blocks):
        started = max(s.free[COMPUTE], ready)
        s.add(COMPUTE, BLOCK_FORWARD, unit, COLOURS["block"], ready)
        if k + 1 < len(blocks):  # the next block's all-gather, beside this block's forward
            ready = s.add(COMMUNICATION, 0.6, blocks[k + 1], COLOURS["all_gather"], started)
    computed = s.add(COMPUTE, LOSS_LENGTH, "loss", "loss")
    backward = list(reversed(blocks))
    ready = s.add(COMMUNICATION, 0.6, backward[0], COLOURS["all_gather"], computed)
    scattered = 0.0
    for k, unit in enumerate(backward):
        started = max(s.free[COMPUTE], ready)
        done = s.add(COMPUTE, BLOCK_BACKWARD, unit, COLOURS["backward"], ready)
        if k + 1 < len(backward):  # the next block's all-gather, prefetched
            ready = s.add(COMMUNICATION, 0.6, backward[k + 1], COLOURS["all_gather"], started)
        scattered = s.add(COMMUNICATION, 0.7, unit, COLOURS["reduce-scatter"], done)
    done = s.add(COMPUTE, EMBEDDING_BACKWARD, "root", COLOURS["backward"])
    scattered = s.add(COMMUNICATION, 1.0, "root", COLOURS["reduce-scatter"], max(done, scattered))
    s.add(COMPUTE, OPTIMIZER, "optimizer", COLOURS["optimizer"], scattered)
    return s


def hidden_and_exposed(streams: Streams) -> list[tuple[float, float, bool]]:
    """The communication's pieces cut where computation runs beside them: (start, end, hidden)."""
    busy = [(p[1], p[1] + p[2]) for p in streams.pieces if p[0] == COMPUTE]
    out = []
    for stream, start, length, _, _ in streams.pieces:
        if stream != COMMUNICATION:
            continue
        cuts = sorted(
            {start, start + length, *(t for b in busy for t in b if start < t < start + length)}
        )
        for a, b in zip(cuts, cuts[1:]):
            middle = (a + b) / 2
            out.append((a, b, any(x <= middle < y for x, y in busy)))
    return out


def draw_streams(streams: Streams, path: Path, title: str, entries: list[tuple[str, str]]) -> None:
    """A diagram of one step on a GPU: its compute stream, its communication stream, and which
    parts of the communication the computation hides."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 2.5))
    rows = {COMPUTE: 1.0, COMMUNICATION: 0.0}
    for stream, start, length, text, colour in streams.pieces:
        y = rows[stream]
        if colour == "loss":
            ax.barh(
                y,
                length,
                left=start,
                height=0.7,
                color=COLOURS["forward"],
                edgecolor="black",
                lw=0.5,
            )
            hatch_loss(ax, y, start, length, 0.7)
        else:
            ax.barh(y, length, left=start, height=0.7, color=colour, edgecolor="black", lw=0.5)
        light = colour in (
            COLOURS["all_reduce"],
            COLOURS["all_gather"],
            COLOURS["block"],
            COLOURS["reduce-scatter"],
        )
        if text:
            ax.text(
                start + length / 2,
                y,
                text,
                ha="center",
                va="center",
                fontsize=FONT - 1,
                color="white" if light else "black",
            )
    for start, end, hidden in hidden_and_exposed(streams):
        ax.barh(
            -0.62,
            end - start,
            left=start,
            height=0.22,
            color=COLOURS["hidden" if hidden else "exposed"],
            lw=0,
        )
    ax.set_yticks(
        [1.0, 0.0, -0.62],
        ["compute stream", "communication\nstream (NCCL)", "communication\nhidden / exposed"],
        fontsize=FONT,
    )
    ax.set_xticks([])
    ax.set_ylim(-0.9, 1.5)
    ax.set_xlim(-0.1, max(p[1] + p[2] for p in streams.pieces) + 0.1)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    fig.suptitle(title, fontsize=TITLE_FONT, x=0.01, ha="left", y=0.98)
    fig.text(
        0.01,
        0.86,
        "A DIAGRAM, NOT A MEASUREMENT: lengths illustrative, time runs left to right",
        fontsize=FONT,
        ha="left",
        color="#b30000",
        weight="bold",
    )
    entries = entries + [
        ("communication beside computation: hidden", COLOURS["hidden"]),
        ("communication the step waits for: exposed", COLOURS["exposed"]),
    ]
    legend(fig, entries, columns=3)
    fig.subplots_adjust(left=0.17, right=0.99, top=0.8, bottom=0.3)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def draw_ddp_gpu(facts: dict, path: Path) -> None:
    buckets = facts["ranks"][0]["buckets"]
    streams = ddp_streams(buckets, blocks_of(TRACE_PRESET))
    entries = [
        ("forward", COLOURS["forward"]),
        ("the loss and its gradient", "loss"),
        ("backward", COLOURS["backward"]),
        ("all-reduce of a bucket", COLOURS["all_reduce"]),
    ]
    title = "Chapter 04 · the same DDP step on a GPU: the buckets' all-reduces beside backward"
    draw_streams(streams, path, title, entries)


def draw_fsdp_gpu(facts: dict, path: Path) -> None:
    blocks = [unit for unit in facts["ranks"][0]["units"] if unit != "root"]
    entries = [
        ("a block's forward", COLOURS["block"]),
        ("the loss and its gradient", "loss"),
        ("backward", COLOURS["backward"]),
        ("all-gather", COLOURS["all_gather"]),
        ("reduce-scatter", COLOURS["reduce-scatter"]),
    ]
    title = "Chapter 07 · the same FSDP2 step on a GPU: the collectives beside the blocks"
    draw_streams(fsdp_streams(blocks), path, title, entries)


def blocks_of(preset: str) -> int:
    from common.model import model_config

    return model_config(preset).n_layer


def draw_memory(rows: list[dict], path: Path, machine: str) -> None:
    plt = pyplot()
    kinds = [
        ("parameters", "#6baed6", ""),
        ("gradients", "#fd8d3c", ""),
        ("AdamW state", "#74c476", ""),
        ("root unit held whole, end of forward to its backward", "white", "///"),
    ]
    fig, axes = plt.subplots(1, len(rows), figsize=(WIDTH_IN, 3.9))
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
            text = f"{held:,.1f}"
            if row["bars"][n][3]:
                text += f"\n+ {row['bars'][n][3]:,.1f}"
            ax.text(i, bottoms[i], text, ha="center", va="bottom", fontsize=FONT - 0.5)
        ax.set_ylim(0, max(bottoms) * 1.3)
        ax.set_title(f"{row['preset']} ({row['how']})", fontsize=FONT)
        ax.tick_params(labelsize=FONT - 0.5)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("MB (10^6 bytes) on rank 0", fontsize=FONT)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=FONT, frameon=False)
    fig.suptitle(
        "Chapter 07 · what one rank of 2 holds during a step, float32 with AdamW",
        fontsize=TITLE_FONT,
        x=0.01,
        ha="left",
    )
    fig.text(0.01, 0.905, wrapped(machine), fontsize=FONT - 1, ha="left", va="top", color="#444")
    fig.subplots_adjust(left=0.1, right=0.99, top=0.8, bottom=0.22, wspace=0.4)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# ---- the facts, in the results file and the captions ------------------------------------------

MEMORY_KINDS = [
    "parameters",
    "gradients",
    "AdamW state",
    "root unit held whole from forward to backward",
]
LAYOUTS = ("DDP", "ZeRO-1", "FSDP")


def ddp_table(facts: dict) -> str:
    lines = [
        "| rank | buckets | their sizes (MB) | all-reduces during the no_sync micro-step "
        "| all-reduces started before the last gradient was computed | all-reduce time (ms) "
        "| of it while backward computes (ms) | backward waits after its last gradient (ms) "
        "| micro-step 2: forward (ms) | of it the loss and its gradient (ms) | backward (ms) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rank, r in enumerate(facts["ranks"]):
        sizes = ", ".join(f"{mb:.2f}" for mb in r["bucket_mb"])
        lines.append(
            f"| {rank} | {r['buckets']} | {sizes} | {r['all_reduces_in_no_sync_micro_step']} "
            f"| {r['started_before_last_gradient']} of {r['buckets']} | {r['all_reduce_ms']:.1f} "
            f"| {r['all_reduce_ms_while_computing']:.1f} "
            f"| {r['waits_after_last_gradient_ms']:.1f} | {r['forward_ms']:.1f} "
            f"| {r['loss_in_forward_ms']:.1f} | {r['backward_ms']:.1f} |"
        )
    return "\n".join(lines)


def fsdp_table(facts: dict) -> str:
    lines = [
        "| unit, or part of the step | " + " | ".join(f"rank {r}" for r in range(WORLD)) + " |"
    ]
    lines.append("|---|" + "---|" * WORLD)
    units = list(facts["ranks"][0]["units"])
    for unit in units:
        cells = [", ".join(r["units"].get(unit, [])) for r in facts["ranks"]]
        lines.append(f"| {unit} | " + " | ".join(cells) + " |")
    for key, words in (
        ("forward_ms", "forward (ms)"),
        ("loss_in_forward_ms", "of it the loss and its gradient (ms)"),
        ("backward_ms", "backward (ms)"),
    ):
        cells = [f"{r[key]:.1f}" for r in facts["ranks"]]
        lines.append(f"| {words} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    lines = [
        "| model | kind | DDP (MB) | ZeRO-1 (MB) | FSDP (MB) |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        for k, kind in enumerate(MEMORY_KINDS):
            cells = [f"{row['bars'][n][k]:,.2f}" if row["bars"][n][k] else "-" for n in LAYOUTS]
            lines.append(
                f"| `{row['preset']}` ({row['how']}) | {kind} | " + " | ".join(cells) + " |"
            )
        totals = [f"{sum(row['bars'][n][:3]):,.2f}" for n in LAYOUTS]
        lines.append(
            f"| `{row['preset']}` ({row['how']}) | parameters + gradients + AdamW state | "
            + " | ".join(totals)
            + " |"
        )
    return "\n".join(lines)


def memory_rows_from_table(table: str) -> list[dict]:
    """The memory bars as the results file holds them (memory_table's rows, read back)."""
    rows: dict[str, dict] = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        model, kind, values = cells[0], cells[1], cells[2:]
        if kind not in MEMORY_KINDS:
            continue  # the totals
        preset, how = model.split(" ", 1)
        row = rows.setdefault(
            model,
            dict(preset=preset.strip("`"), how=how.strip("()"), bars={n: [] for n in LAYOUTS}),
        )
        for name, value in zip(LAYOUTS, values):
            row["bars"][name].append(0.0 if value == "-" else float(value.replace(",", "")))
    return list(rows.values())


def machine_line(entry: dict) -> str:
    """The machine and settings of the runs a picture was drawn from, from their entry."""
    return (
        f"{entry['machine']}; torch {entry['torch']}; gloo, 1 thread per rank, "
        f"preset {TRACE_PRESET}, batch 4 per rank"
    )


def ms_text(value: float) -> str:
    return f"{value:,.1f} ms"


def captions(ddp: dict, fsdp: dict) -> dict[str, str]:
    """What each picture shows, with the figures its trace gives (rank 0's)."""
    d = ddp["ranks"][0]
    f = fsdp["ranks"][0]
    return {
        "ddp": (
            "*Chapter 04's step, traced by torch.profiler on the CPU.* Gloo, 2 ranks under "
            "torchrun, the `small` model, batch 4 per rank, 2 micro-steps, `bucket_cap_mb=1` so "
            "that the small model has several buckets (chapter 04 keeps DDP's default of 25; a "
            "tensor larger than the cap, the token embedding, gets a bucket of its own). Each rank "
            "has two rows: its main thread (forward, backward, the optimizer step) and gloo's "
            "threads, where the all-reduces run. The first micro-step runs under `no_sync()`: its "
            "backward sends nothing. In the last micro-step's backward every bucket's all-reduce "
            "starts as soon as its gradients are ready, while autograd is still computing the "
            "earlier layers' gradients; the token embedding (tied to the output layer) is the last "
            "bucket, since its gradient is complete only after the embedding's backward. Backward "
            "returns once every bucket is averaged (the grey part). An all-reduce completes only "
            "when both ranks have joined it: where one rank runs behind the other, the other's "
            "all-reduce bars stretch until it catches up. Most of each forward is the loss "
            "(hatched): the chunked loss computes the output layer's gradient during forward, so "
            f"on rank 0 it took {ms_text(d['loss_in_forward_ms'])} of micro-step 2's "
            f"{ms_text(d['forward_ms'])} forward, and backward {ms_text(d['backward_ms'])}. A "
            "CPU's timeline is not a GPU's: here compute and communication share two busy cores, "
            "and the durations mean little. What carries over to GPUs with NCCL is the order and "
            "the overlap: buckets in the order the gradients become ready, communicating during "
            "backward, nothing during `no_sync()`."
        ),
        "ddp_gpu": (
            "*A diagram, not a measurement: chapter 04's step on a GPU.* The same two micro-steps "
            f"and {d['buckets']} buckets as the trace, on a GPU's two streams: the computation on "
            "one, NCCL's all-reduces on another, so that they run at the same time. Each "
            "bucket's all-reduce starts once backward has made its gradients and runs beside the "
            "rest of backward (green: hidden); only what is left when backward ends is waited for "
            "(red: exposed), the token embedding's bucket above all. Under `no_sync()` nothing is "
            "sent. The lengths are illustrative: a block's backward twice its forward (it computes "
            "the gradients of its inputs and of its weights), the collectives shorter than the "
            "computation beside them."
        ),
        "fsdp": (
            "*Chapter 07's step, traced the same way.* FSDP2's `fully_shard` on every block, then "
            "on the whole model, as chapter 07 shards it; one micro-step. In forward the root unit "
            "(the embeddings, the last LayerNorm, the output layer) is gathered first, then each "
            "block's parameters just before it runs (h.0 to h.3); in backward each block is "
            "gathered again, the next one early (FSDP's prefetch), and right after its backward "
            "its gradient is reduce-scattered, so that each rank keeps the sum of its own shard. "
            "The root unit is not gathered again for backward: FSDP2 keeps the root's parameters "
            "whole from forward to backward (with `reshard_after_forward` left at its default, "
            "torch's FSDPState sets the root's post-forward resharding off), and reduce-scatters "
            "its gradient last. gloo has no reduce-scatter of its own: it all-reduces the whole "
            "gradient and each rank keeps its shard (NCCL's reduce-scatter sends half the bytes). "
            "On the CPU the main thread waits for each collective (grey). Most of the forward is "
            f"the loss (hatched): on rank 0, {ms_text(f['loss_in_forward_ms'])} of the "
            f"forward's {ms_text(f['forward_ms'])}, against a backward of "
            f"{ms_text(f['backward_ms'])}. That ratio is not a GPU's, for three reasons. The "
            "chunked loss computes the output layer's gradient during forward (its backward only "
            "hands it on), so part of the backward's work is drawn as forward. In `small` that "
            "output layer, 128 × 50,304, does far more arithmetic than the four small blocks, "
            "where in GPT-2 124M the twelve blocks do most of it and backward does about twice "
            "forward's arithmetic. And on the CPU, one thread per rank, an operation's time "
            "follows how well it uses that thread, and backward's includes the waits for the "
            "collectives. The durations mean little; the order, and what runs before what, are "
            "the same on GPUs."
        ),
        "fsdp_gpu": (
            "*A diagram, not a measurement: chapter 07's step on a GPU.* The same units as the "
            "trace (the root, then h.0 to h.3) on a GPU's two streams. FSDP2 issues each "
            "all-gather on a stream of its own, so the next block's parameters arrive while the "
            "current block computes (green: hidden); the step waits only for the first "
            "all-gathers, the first one of backward and the root's reduce-scatter at the end "
            "(red: exposed). In backward each block's reduce-scatter runs beside the next block's "
            "backward. The lengths are illustrative: a block's backward twice its forward, the "
            "collectives shorter than the computation beside them."
        ),
        "memory": (
            "*What rank 0 of 2 holds, float32 with AdamW.* Parameters, gradients (as large as the "
            "parameters during the step; freed between steps by `zero_grad`) and AdamW's two "
            "averages. `tiny` and `small` measured in 2-rank FSDP2 runs (workers/step_trace.py: "
            "the bytes of each rank's tensors, as chapter 07 prints them, DDP's being the whole "
            "tensors), GPT-2 124M counted from its shapes (bench/memory_per_rank.py). ZeRO-1 is "
            "DDP's parameters and gradients with FSDP's optimizer-state shard. The hatched part is "
            "what FSDP2 holds whole on top of its shards from the end of forward until its "
            "backward: the root unit's parameters (the token embedding, tied to the output layer, "
            "the positions and the last LayerNorm), measured as the parameters that are still "
            "whole tensors, not DTensor shards, right after forward. With a vocabulary of 50,304 "
            "tokens the token embedding is most of `tiny` and `small`, so their root unit is most "
            "of the model; in GPT-2 124M it is about a third. Activations, and the block or two "
            "FSDP has gathered at a moment, come on top."
        ),
    }


ALT = {  # each picture's alternative text
    "ddp": "Chapter 04's step, traced on 2 CPU ranks",
    "ddp_gpu": "A diagram of chapter 04's step on a GPU's two streams",
    "fsdp": "Chapter 07's step, traced on 2 CPU ranks",
    "fsdp_gpu": "A diagram of chapter 07's step on a GPU's two streams",
    "memory": "What one rank holds under DDP, ZeRO-1 and FSDP",
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


def write_captions(figures: Path, entries: dict[str, dict], texts: dict[str, str]) -> Path:
    """The pictures' section of docs/figures/CAPTIONS.md, the rest of it left as it is."""
    lines = [
        "",
        "## Inside one step",
        "",
        "Drawn by `python -m maintainer.step_pictures` from the traces and measurements of runs it "
        "made:",
        "",
    ]
    for key, entry in entries.items():
        for note in entry["notes"]:
            what, _, command = note.partition(": ")
            if command.startswith("`"):  # "worker: `torchrun ...`", "memory tiny: `...`"
                lines.append(f"- {key if what == 'worker' else what}: {command}")
    lines.append("")
    for key in FIGURES:
        name = FIGURES[key]
        lines += [f"### {name}", "", f"![{ALT[key]}]({name})", "", texts[key], ""]
        if key in TRACE_FILES:
            lines += [
                f"The trace, both ranks: [{TRACE_FILES[key]}]({TRACE_FILES[key]}) (open it in "
                "https://ui.perfetto.dev or chrome://tracing).",
                "",
            ]
        if not key.endswith("_gpu"):
            line = machine_line(entries[key])
            if key == "memory":
                line = entries[key]["machine"] + f"; torch {entries[key]['torch']}"
            lines += [f"Made on: {line}.", ""]
    return write_section(figures, CAPTIONS_BEGIN, CAPTIONS_END, lines)


def recorded(results: dict) -> dict[str, dict]:
    """The three entries the pictures are drawn from, by key."""
    by_name = {e["name"]: e for e in results["entries"]}
    missing = [name for name in ENTRY_NAMES.values() if name not in by_name]
    if missing:
        raise SystemExit(
            f"error: bench/results/results.json has no entry {missing[0]!r}: "
            "run `python -m maintainer.step_pictures` to trace and measure the step"
        )
    return {key: by_name[name] for key, name in ENTRY_NAMES.items()}


def with_trace_facts(entries: dict[str, dict], traces: dict) -> None:
    """The ddp and fsdp entries' figures, as their kept traces give them."""
    ddp = ddp_facts(traces["ddp"])
    fsdp = fsdp_facts(traces["fsdp"])
    d = ddp["ranks"][0]
    blocks = [u for u in fsdp["ranks"][0]["units"] if u != "root"]
    entries["ddp"].update(
        value=(
            f"{d['buckets']} buckets, {d['started_before_last_gradient']} of {d['buckets']} "
            "all-reduces started before backward's last gradient; none in the no_sync micro-step"
        ),
        what=(
            "one optimizer step of chapter 04's DDP (2 micro-steps, the first under no_sync(), "
            "bucket_cap_mb=1), `small`, 2 ranks, gloo on the CPU, traced by torch.profiler; the "
            "facts of docs/figures/ddp_step.png, read from its trace."
        ),
        table=ddp_table(ddp),
        source=f"docs/figures/{TRACE_FILES['ddp']}",
    )
    entries["fsdp"].update(
        value=(
            f"{len(blocks)} blocks, each gathered before its forward and before its backward and "
            "reduce-scattered after it; the root unit gathered once and reduce-scattered last"
        ),
        what=(
            "one step of chapter 07's FSDP2 (fully_shard per block and on the model), `small`, "
            "2 ranks, gloo on the CPU, traced by torch.profiler: each unit's collectives in the "
            "order they ran, and the forward, its loss and the backward; the facts of "
            "docs/figures/fsdp_step.png, read from its trace."
        ),
        table=fsdp_table(fsdp),
        source=f"docs/figures/{TRACE_FILES['fsdp']}",
    )


def new_entries(run: dict, rows: list[dict]) -> dict[str, dict]:
    """The entries of a run just made: where, when and how; the figures come after."""
    machine = run["machine"]
    load = run.get("load_average")
    words = f"{machine.get('cores')} CPU cores ({machine.get('cpu')}), {machine.get('os')}"
    if load is not None:
        words += f", load average up to {load:.1f} during the runs"
    small = next(r for r in rows if r["preset"] == TRACE_PRESET)

    def entry(key: str, notes: list[str]) -> dict:
        return {
            "section": SECTION,
            "name": ENTRY_NAMES[key],
            "machine": words,
            "torch": run["torch"],
            "command": "python -m maintainer.step_pictures",
            "date": run["date"],
            "notes": notes,
        }

    memory_notes = [
        f"{what}: `{command}`" for what, command in run["commands"].items() if "memory" in what
    ]
    entries = {
        "ddp": entry(
            "ddp",
            [f"worker: `{run['commands']['ddp']}`", "a CPU's durations, on a shared machine"],
        ),
        "fsdp": entry(
            "fsdp",
            [
                f"worker: `{run['commands']['fsdp']}`",
                "gloo runs a reduce-scatter as an all-reduce of the whole gradient",
            ],
        ),
        "memory": dict(
            entry("memory", memory_notes),
            value=f"small: the root unit holds {small['root']:,.2f} MB whole from forward to "
            "backward",
            what=(
                "what rank 0 of 2 holds (float32, AdamW): tiny and small measured in 2-rank FSDP2 "
                "runs, gpt2 counted; ZeRO-1 = DDP's parameters and gradients + FSDP's "
                "optimizer-state shard; the figures of docs/figures/memory_per_rank.png."
            ),
            table=memory_table(rows),
            source=(
                "workers/step_trace.py --memory (common/sharding.py's held_bytes; the parameters "
                "still whole after forward)"
            ),
        ),
    }
    return entries


def draw_kept(figures: Path) -> None:
    """Every picture and its caption, from the kept traces (docs/figures/*_trace.json.gz) and the
    results file's entries of the runs that made them; the entries' trace figures, read again."""
    results = registry.load()
    entries = recorded(results)
    traces = {mode: read_trace(figures / TRACE_FILES[mode]) for mode in TRACE_FILES}
    with_trace_facts(entries, traces)  # the entries in place, where the results file has them
    registry.save(results)
    ddp = ddp_facts(traces["ddp"])
    fsdp = fsdp_facts(traces["fsdp"])
    draw_ddp(traces["ddp"], figures / FIGURES["ddp"], machine_line(entries["ddp"]))
    draw_ddp_gpu(ddp, figures / FIGURES["ddp_gpu"])
    draw_fsdp(traces["fsdp"], figures / FIGURES["fsdp"], machine_line(entries["fsdp"]))
    draw_fsdp_gpu(fsdp, figures / FIGURES["fsdp_gpu"])
    memory_machine = f"{entries['memory']['machine']}; torch {entries['memory']['torch']}"
    rows = memory_rows_from_table(entries["memory"]["table"])
    draw_memory(rows, figures / FIGURES["memory"], memory_machine)
    for name in FIGURES.values():
        path = figures / name
        print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")
    print(f"wrote {write_captions(figures, entries, captions(ddp, fsdp))}")
    print(f"recorded {len(entries)} entries in {registry.RESULTS_JSON.relative_to(ROOT)}")


def record_runs(out: Path, figures: Path) -> None:
    """Keep a run's traces in docs/figures and its entries in the results file."""
    import shutil

    run = json.loads((out / "run.json").read_text())
    rows = memory_rows(out)
    figures.mkdir(parents=True, exist_ok=True)
    for name in TRACE_FILES.values():
        if (out / name).resolve() != (figures / name).resolve():
            shutil.copyfile(out / name, figures / name)
    results = registry.load()
    for entry in new_entries(run, rows).values():
        registry.store(results, entry)
    registry.save(results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument("--from-runs", type=Path, default=None, metavar="DIR", help="keep these runs")
    how.add_argument(
        "--redraw", action="store_true", help="run nothing: draw from the kept traces and results"
    )
    p.add_argument("--out-root", type=Path, default=ROOT / "out" / "step_pictures")
    p.add_argument("--figures", type=Path, default=ROOT / "docs" / "figures")
    p.add_argument("--data-dir", type=Path, default=ROOT / "data")
    args = p.parse_args(argv)
    if not args.redraw:
        out = args.from_runs or args.out_root
        if args.from_runs is None:
            make_runs(out, args.data_dir)
        record_runs(out, args.figures)
    draw_kept(args.figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
