"""The course's figures, from real runs: loss parity (with a float64 control) and, on GPUs, memory.

    python -m maintainer.make_plots     # run every chapter alike, then plot (minutes on a CPU)
    python -m maintainer.make_plots --iters 300 --global-batch 16
    python -m maintainer.make_plots --from-runs out/plots   # plot runs already made, run nothing

Every chapter of common/chapters.py whose run is chapter 01's trains the same model on the same
data with the same global batch G sequences per optimizer step, launched the way it teaches:

    01_single_gpu         python train.py --batch-size G
    02_grad_accumulation  python train.py --batch-size G/K --grad-accum K
    03_dataparallel       python train.py --batch-size G/GPUS  (one replica per GPU; 1 on a CPU)
    05_multinode          two torchrun "nodes" on 127.0.0.1, W/2 processes each:
                          train.py --batch-size G/W --shared-fs
    06_fault_tolerance    the same
    any other chapter     torchrun --standalone --nproc-per-node W train.py --batch-size G/W

A chapter is known by its idea, its folder less its number (LAUNCHES), so that renumbering the
chapters, or inserting one launched by torchrun, changes nothing here.

and writes <out-root>/<chapter>/{metrics.jsonl, stdout.log, run.json}. As a control it runs
chapters 01 and 04 once more in float64 (--float64-chapters; <out-root>/<chapter>-float64): the
same runs with rounding errors about 1e-16 instead of 1e-7, so their distance shows how much of the
float32 distance is rounding. Then it draws, into docs/figures/ (or --figures):

    parity_loss.png        training loss against tokens seen for every chapter, and each chapter's
                           distance from chapter 01 step by step, float32 and float64
    memory_per_device.png  peak memory of rank 0's device per chapter, only where a run was on a GPU
    CAPTIONS.md            what each figure shows, the machine and the settings that made it

Throughput is not drawn here: these runs share one machine with whatever else runs on it,
and their log lines are too short to time. bench/benchmark.py measures it, under the conditions
its table states.

Every figure says in its subtitle which machine (CPU model and cores or GPU name, torch version)
and which settings made it. On a CPU every chapter gets the same number of cores in all (--threads,
default W): one process with W threads, or W processes with one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import textwrap
import time
from pathlib import Path

from common.chapters import CHAPTERS, NOT_CHAPTER_01S_RUN
from layout import REPO
from tools import launch

NUMBER = {folder: number for number, folder in CHAPTERS.items()}  # 04_ddp -> 4
# A chapter's name in the figures, by its idea; another chapter's is its idea in words
NAMES = {
    "single_gpu": "one device",
    "grad_accumulation": "gradient accumulation",
    "dataparallel": "DataParallel",
    "ddp": "DDP",
    "multinode": "two nodes",
    "fault_tolerance": "restarts and stops",
    "fsdp": "FSDP",
}
# How a chapter is launched, by its idea, where it is not torchrun on one node (chapter_plans)
LAUNCHES = {
    "single_gpu": "python",
    "grad_accumulation": "python",
    "dataparallel": "python",
    "multinode": "two_nodes",
    "fault_tolerance": "two_nodes",
}
# where maintainer/step_pictures.py's section of CAPTIONS.md begins (this script keeps it)
STEP_PICTURES_SECTION = "<!-- step_pictures: begin -->"
FLOAT64 = "-float64"  # the key (and run folder) of a chapter's float64 control run: 04_ddp-float64


def idea(folder: str) -> str:
    """A chapter's idea: its folder less its number, 04_ddp -> ddp."""
    return folder.split("_", 1)[1]


def label(key: str) -> str:
    """A run's name in the figures: 04 DDP, or 04 DDP in float64 for its control run."""
    folder = key.removesuffix(FLOAT64)
    name = NAMES.get(idea(folder), idea(folder).replace("_", " "))
    in_float64 = " in float64" if key.endswith(FLOAT64) else ""
    return f"{NUMBER[folder]:02d} {name}{in_float64}"


def numbers(text: str) -> set[str]:
    """The chapters a flag names, as two digits: "1, 04" -> {"01", "04"}."""
    return {part.strip().zfill(2) for part in text.split(",") if part.strip()}


# ---- what machine is this ----------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_description(device: str) -> dict:
    import torch

    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.system(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def machine_text(info: dict) -> str:
    if info.get("gpu"):
        hardware = f"{info.get('gpus', 1)} x {info['gpu']}"
    else:
        hardware = f"CPU {info.get('cpu', '?')}, {info.get('cores', '?')} cores"
    return f"{hardware}; torch {info.get('torch', '?')}"


# ---- running the chapters ----------------------------------------------------------------------


def largest_divisor(n: int, candidates=(4, 2, 1)) -> int:
    return next(k for k in candidates if n % k == 0)


def count(n: int, word: str) -> str:
    """3 processes, 1 process, 4 micro-batches."""
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}" + ("es" if word.endswith(("s", "h")) else "s")


def chapter_plans(args, device: str) -> dict[str, dict]:
    """For each chapter whose run is chapter 01's: its launch (one or more commands) and how it
    is laid out."""
    import torch

    G, W = args.global_batch, args.nproc
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    K = largest_divisor(G)
    replicas = max(gpus, 1)
    micro_batches = f"{count(K, 'micro-batch')} of {G // K}"
    # idea -> (its own flags, the layout in words, processes per node), where it has its own
    layouts = {
        "single_gpu": (["--batch-size", G], "1 process", 1),
        "grad_accumulation": (
            ["--batch-size", G // K, "--grad-accum", K],
            f"1 process, {micro_batches}",
            1,
        ),
        "dataparallel": (
            ["--batch-size", G // replicas],
            f"1 process, {count(replicas, 'replica')}",
            1,
        ),
    }
    nodes = f"2 nodes x {count(W // 2, 'process')}"
    torchrun = (["--batch-size", G // W], count(W, "process"), W)
    two_nodes = (["--batch-size", G // W, "--shared-fs"], nodes, W // 2)
    dtype = "float32" if device == "cpu" else "auto"
    shared = launch.measured_run_flags(
        args.iters, args.log_interval, eval_batches=4, preset=args.preset, seed=args.seed
    )
    shared += launch.flags(device=device, dtype=dtype, data_dir=args.data_dir)
    plans = {}
    for number, folder in CHAPTERS.items():
        if number in NOT_CHAPTER_01S_RUN:
            continue
        how = LAUNCHES.get(idea(folder), "torchrun")
        if how == "two_nodes" and W % 2:
            continue  # two nodes need an even --nproc
        if idea(folder) == "dataparallel" and replicas > 1 and G % replicas:
            continue
        if how == "python":
            own, layout, per_node = layouts[idea(folder)]
            nproc = 1
        else:
            own, layout, per_node = two_nodes if how == "two_nodes" else torchrun
            nproc = W
        run_args = [*own, *shared, "--out-dir", Path(args.out_root) / folder]
        commands = launch.launch_commands(how, f"{folder}/train.py", nproc, run_args)
        plans[folder] = dict(layout=layout, procs=per_node, commands=commands)
    return plans


def run_chapter(
    folder: str, plan: dict, args, machine: dict, device: str, dtype: str = "float32"
) -> Path:
    """Run one chapter; with dtype float64 its control run, in <out-root>/<chapter>-float64."""
    key = folder + (FLOAT64 if dtype == "float64" else "")
    out = Path(args.out_root) / key
    if dtype == "float64":  # the same commands, with --dtype float64 and their own --out-dir
        swap = {"--dtype": "float64", "--out-dir": str(out)}
        plan = dict(
            plan,
            commands=[
                [swap.get(prev, c) for prev, c in zip(["", *cmd], cmd)] for cmd in plan["commands"]
            ],
        )
    # the plots' own run folder, from an earlier drawing: start it afresh (a chapter refuses
    # a folder that holds a run)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    # the same cores for every chapter: W threads in one process, or one per process
    if device == "cpu":
        env = launch.child_env(max(1, args.threads // plan["procs"]), CUDA_VISIBLE_DEVICES="")
    else:  # on GPUs, the threads the caller asked for, if any
        env = launch.child_env(os.environ.get("OMP_NUM_THREADS"))
    shown = [launch.shown_command(cmd) for cmd in plan["commands"]]
    print(f"{key}: " + "\n    & ".join(shown), flush=True)
    load_before = load_average()
    start = time.perf_counter()
    with open(out / "stdout.log", "w") as log:  # every node writes to the one log
        status = launch.run_together(
            plan["commands"], env, [log] * len(plan["commands"]), args.timeout
        )
    wall = time.perf_counter() - start
    if status != 0:
        tail = "\n".join((out / "stdout.log").read_text().splitlines()[-20:])
        raise SystemExit(
            f"error: {folder} failed (exit status {status}); "
            f"the end of {out / 'stdout.log'}:\n{tail}"
        )
    # Other programs on the machine slow a run down: the load average says whether there were any.
    load = max(filter(None, [load_before, load_average()]), default=None)
    info = {
        "chapter": folder,
        "dtype": dtype,
        "layout": plan["layout"],
        "commands": shown,
        "made_by": args.command,
        "wall_s": round(wall, 1),
        "load_average": round(load, 1) if load is not None else None,
        "threads_per_process": env.get("OMP_NUM_THREADS"),
        "machine": machine,
        "settings": settings_dict(args, device),
    }
    (out / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"    done in {wall:.0f} s", flush=True)
    return out


def load_average() -> float | None:
    """The machine's load over the last minute, where the system tells it."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def settings_dict(args, device: str) -> dict:
    return {
        "preset": args.preset,
        "iters": args.iters,
        "global_batch": args.global_batch,
        "nproc": args.nproc,
        "threads": args.threads if device == "cpu" else None,
        "seed": args.seed,
        "device": device,
    }


# ---- reading runs ------------------------------------------------------------------------------


def find_runs(folders: list[Path]) -> dict[str, Path]:
    """run key -> run folder, from folders that are runs themselves or hold one folder per run."""
    runs: dict[str, Path] = {}
    for folder in folders:
        if (folder / "metrics.jsonl").exists():
            candidates = [folder]
        else:
            candidates = sorted(folder.iterdir()) if folder.is_dir() else []
        for run in candidates:
            if not (run / "metrics.jsonl").exists():
                continue
            key = run_key(run)
            if key and key not in runs:
                runs[key] = run
    if not runs:
        raise SystemExit(
            f"error: no runs (folders with metrics.jsonl) in {', '.join(map(str, folders))}"
        )
    return dict(sorted(runs.items()))


def run_key(run: Path) -> str | None:
    """The chapter's folder a run belongs to (04_ddp), with -float64 for a control run."""
    info = run / "run.json"
    record = json.loads(info.read_text()) if info.exists() else {}
    if record.get("chapter"):
        return record["chapter"] + (FLOAT64 if record.get("dtype") == "float64" else "")
    # a run folder named after its chapter (out/01_single_gpu, out/04_ddp-float64) ...
    for folder in CHAPTERS.values():
        if folder in run.name:
            return folder + (FLOAT64 if run.name.endswith(FLOAT64) else "")
    ckpt = run / "ckpt.pt"  # ... or its checkpoint says
    if ckpt.exists():
        import torch

        config = torch.load(ckpt, map_location="cpu", weights_only=True).get("train_config", {})
        if config.get("chapter"):
            return CHAPTERS[int(config["chapter"])]
    return None


def run_info(run: Path) -> dict:
    info = run / "run.json"
    if info.exists():
        return json.loads(info.read_text())
    settings = {}
    ckpt = run / "ckpt.pt"
    if ckpt.exists():
        import torch

        config = torch.load(ckpt, map_location="cpu", weights_only=True).get("train_config", {})
        settings = {
            k: config.get(k) for k in ("preset", "max_iters", "global_batch", "device", "seed")
        }
    return {"chapter": run_key(run), "layout": "", "machine": {}, "settings": settings}


# ---- figures -----------------------------------------------------------------------------------


def caption_lines(infos: dict[str, dict]) -> tuple[str, str]:
    """(machine, settings) in words, from the runs' records; 'mixed' where runs differ."""
    machines = {
        machine_text(i["machine"]) if i.get("machine") else "machine not recorded"
        for i in infos.values()
    }
    settings = [i.get("settings", {}) for i in infos.values()]
    first = settings[0] if settings else {}
    same = all(s == first for s in settings)
    if first.get("iters") is not None:
        batch = f"global batch {first['global_batch']} sequences"
        steps = f"{first['iters']} steps, seed {first['seed']}, dropout 0"
        words = f"preset {first['preset']}, {batch}, {steps}"
        words += f", {first['device']}"
        if first.get("threads"):
            words += f", {first['threads']} CPU threads per chapter in all"
    else:
        words = (
            ", ".join(f"{k} {v}" for k, v in first.items() if v is not None)
            or "settings not recorded"
        )
    loads = [i["load_average"] for i in infos.values() if i.get("load_average") is not None]
    cores = next((i["machine"].get("cores") for i in infos.values() if i.get("machine")), None)
    # busy with other work: say so next to the numbers
    if loads and cores and max(loads) > 1.5 * cores:
        words += "; machine shared with other work "
        words += f"(load average up to {max(loads):.0f} on {cores} cores)"
    return (
        " / ".join(sorted(machines)),
        words if same else words + " (settings differ between runs)",
    )


def plot_all(runs: dict[str, Path], figures: Path, command: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.metrics import read_metrics

    figures.mkdir(parents=True, exist_ok=True)
    metrics = {key: read_metrics(run / "metrics.jsonl") for key, run in runs.items()}
    train = {key: [m for m in rows if "loss" in m] for key, rows in metrics.items()}
    infos = {key: run_info(run) for key, run in runs.items()}
    machine, settings = caption_lines(infos)
    subtitle = "\n".join(textwrap.wrap(machine, 120) + textwrap.wrap(settings, 120))
    written, captions = [], []

    # 1. parity: loss against tokens seen, and the distance from chapter 01 at every logged step
    # drawn for the site's column: 7 inches at 170 dpi, opened full size by a click
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.2), sharex=True, height_ratios=[2.5, 1.7])
    reference_style = dict(lw=6, alpha=0.3, color="black")  # chapter 01's line, under the rest
    styles = [  # the other chapters' lines, in their order
        dict(ls="--", lw=1.6, color="tab:blue"),
        dict(ls="none", marker="o", ms=3, markevery=5, color="tab:orange"),
        dict(ls="-.", lw=1.4, color="tab:green"),
        dict(ls=(0, (1, 3)), lw=2.5, marker=".", ms=4, color="tab:red"),
        dict(ls="none", marker="s", ms=3, markevery=9, color="tab:pink"),
        dict(ls="none", marker="x", ms=4, markevery=7, color="tab:brown"),
        dict(ls=":", lw=1.4, color="tab:olive"),
        dict(ls="none", marker="^", ms=3, markevery=11, color="tab:cyan"),
    ]
    # where a distance of exactly 0 is drawn on the log axis (metrics.jsonl keeps 6 decimals)
    floor = 1e-7
    # run key -> its largest distance from chapter 01 (of the same dtype)
    worst: dict[str, float] = {}
    for key, rows in train.items():
        number = NUMBER[key.removesuffix(FLOAT64)]
        float64 = key.endswith(FLOAT64)
        style = reference_style if number == 1 else styles[(number - 2) % len(styles)]
        if not float64:
            layout = infos[key].get("layout")
            top.plot(
                [m["tokens_seen"] for m in rows],
                [m["loss"] for m in rows],
                label=label(key) + (f" ({layout})" if layout else ""),
                **style,
            )
        reference = train.get(CHAPTERS[1] + (FLOAT64 if float64 else ""))
        if reference is None or number == 1:
            continue
        ref_by_iter = {m["iter"]: m["loss"] for m in reference}
        pairs = [
            (m["tokens_seen"], abs(m["loss"] - ref_by_iter[m["iter"]]))
            for m in rows
            if m["iter"] in ref_by_iter
        ]
        if not pairs:
            continue
        worst[key] = max(p[1] for p in pairs)
        line = {k: v for k, v in style.items() if k != "alpha"}
        if float64:
            line = dict(lw=2.2, color="tab:purple")
        name = label(key) + (": 0 at every step" if worst[key] == 0 else "")
        bottom.plot([p[0] for p in pairs], [max(p[1], floor) for p in pairs], label=name, **line)
    top.set_ylabel("training loss", fontsize=8.5)
    top.legend(fontsize=7.5)
    top.grid(alpha=0.3)
    top.set_title("The same run in every chapter: training loss against tokens seen", fontsize=9.5)
    fig.text(0.5, 0.995, subtitle, fontsize=7, ha="center", va="top", color="#444")
    bottom.set_yscale("log")
    bottom.set_ylim(floor / 2, max([1e-4, *worst.values()]) * 3)
    bottom.set_ylabel("|loss - loss of 01|\n(0 drawn at 1e-7)", fontsize=8.5)
    bottom.set_xlabel("tokens seen", fontsize=8.5)
    # under the axes, clear of the lines
    bottom.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.42), ncol=3)
    bottom.grid(alpha=0.3)
    for ax in (top, bottom):
        ax.tick_params(labelsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    path = figures / "parity_loss.png"
    fig.savefig(path, dpi=170)
    plt.close(fig)
    written.append(path)
    float32_worst = {k: d for k, d in worst.items() if not k.endswith(FLOAT64)}
    float64_worst = {k: d for k, d in worst.items() if k.endswith(FLOAT64)}
    float32_distances = ", ".join(f"{label(k)} {d:.1e}" for k, d in float32_worst.items())
    float64_distances = ", ".join(
        f"{label(k)}: largest distance {d:.1e}" for k, d in float64_worst.items()
    )
    parity_caption = (
        "*Every chapter's run against chapter 01's.* "
        "Training loss against tokens seen for every chapter (top) and each chapter's distance "
        "from chapter 01 at every logged step (bottom; metrics.jsonl rounds losses to 1e-6, so "
        "a distance of 0 means equal to 6 decimals, drawn at 1e-7). Largest distance in float32: "
        f"{float32_distances or 'no chapter to compare'}. "
        "The chapters add the same numbers in different orders, so their float32 losses differ by "
        "rounding at first, and over a long run at a high learning rate training amplifies those "
        "differences from step to step. The control is the same runs in float64, whose rounding is "
        f"about a billion times smaller: {float64_distances or 'no float64 runs were made'}. "
        "What a bug would change (the data, the gradient's scale) does not depend on the number "
        "format, so a distance that shrinks with the rounding is rounding. The tests compare short "
        "float32 runs, where the distance stays at rounding level."
    )
    captions.append(
        ("parity_loss.png", "Every chapter's training loss against tokens seen", parity_caption)
    )

    # 3. memory: peak memory of rank 0's device (only GPU runs report max_mem_mb)
    memory = {
        key: max(m["max_mem_mb"] for m in rows if "max_mem_mb" in m)
        for key, rows in train.items()
        if any("max_mem_mb" in m for m in rows)
    }
    stale = figures / "memory_per_device.png"
    if memory:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        bars = ax.bar(range(len(memory)), list(memory.values()), color="tab:orange")
        ax.bar_label(bars, labels=[f"{v:,.0f} MiB" for v in memory.values()])
        ax.set_xticks(
            range(len(memory)),
            [label(s) + f"\n{infos[s].get('layout', '')}" for s in memory],
            fontsize=8,
        )
        ax.set_ylabel("peak memory allocated on rank 0's device (MiB)")
        ax.set_title(f"Peak memory per device\n{subtitle}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(stale, dpi=170)
        plt.close(fig)
        written.append(stale)
        captions.append(
            (
                "memory_per_device.png",
                "Peak memory on rank 0's device, per chapter",
                "*Peak memory per device.* "
                "Peak memory allocated by PyTorch on rank 0's device during training "
                "(max_mem_mb in metrics.jsonl), per chapter. Gradient accumulation lowers it "
                "by holding one micro-batch's activations at a time.",
            )
        )
    elif stale.exists():
        stale.unlink()  # a memory figure from older runs would not match these

    made_by = sorted({i["made_by"] for i in infos.values() if i.get("made_by")})
    lines = [
        "# Figures",
        "",
        "Drawn by `"
        + command
        + "` from real runs"
        + (" made by `" + "`, `".join(made_by) + "`" if made_by and made_by != [command] else "")
        + "; do not edit by hand.",
        "",
        f"- Machine: {machine}",
        f"- Settings: {settings}",
        "",
    ]
    for key, info in infos.items():
        if info.get("commands"):
            commands = [
                c.replace("python -m torch.distributed.run", "torchrun") for c in info["commands"]
            ]
            lines.append(f"- {label(key)}: `" + "` and `".join(commands) + "`")
    lines.append("")
    for name, alt, text in captions:
        lines += [
            f"## {name}",
            "",
            f"![{alt}]({name})",
            "",
            text,
            "",
            f"Made on: {machine}; {settings}.",
            "",
        ]
    if not memory:
        lines += [
            "No `memory_per_device.png`: none of these runs was on a GPU "
            "(only GPU runs report peak memory).",
            "",
        ]
    captions_path = figures / "CAPTIONS.md"
    # maintainer/step_pictures.py's section, about figures of its own, stays as it is
    kept = ""
    if captions_path.exists() and STEP_PICTURES_SECTION in captions_path.read_text():
        kept = STEP_PICTURES_SECTION + captions_path.read_text().split(STEP_PICTURES_SECTION, 1)[1]
    captions_path.write_text("\n".join(lines) + ("\n" + kept if kept else ""))
    written.append(captions_path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--from-runs",
        nargs="+",
        type=Path,
        default=None,
        metavar="DIR",
        help="plot these runs (a run folder, or a folder of them) instead of running the chapters",
    )
    every = ",".join(f"{number:02d}" for number in CHAPTERS if number not in NOT_CHAPTER_01S_RUN)
    p.add_argument("--chapters", default=every, help="which chapters to run, e.g. 01,02,04")
    p.add_argument("--preset", default="tiny", help="model preset for every chapter")
    p.add_argument("--iters", type=int, default=150, help="optimizer steps per chapter")
    p.add_argument(
        "--global-batch",
        type=int,
        default=8,
        help="sequences per optimizer step, the same in every chapter",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (W) of a torchrun chapter")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads per chapter in all (default: --nproc)",
    )
    p.add_argument("--log-interval", type=int, default=1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="cpu",
        help="cpu (default; the same numbers on every machine) "
        "or cuda (also draws memory per device)",
    )
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--out-root", default=str(REPO / "out" / "plots"), help="where the runs go")
    p.add_argument(
        "--figures", type=Path, default=REPO / "docs" / "figures", help="where the figures go"
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds one chapter's run may take")
    p.add_argument(
        "--float64-chapters",
        default="01,04",
        help="chapters run once more in float64 as the control for rounding (empty: none)",
    )
    args = p.parse_args(argv)
    args.command = command = "python -m maintainer.make_plots" + "".join(
        f" {shlex.quote(a)}" for a in (argv if argv is not None else sys.argv[1:])
    )

    if args.from_runs:
        runs = find_runs(args.from_runs)
    else:
        import torch

        device = (
            "cuda"
            if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
            else "cpu"
        )
        if device == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("error: --device cuda, but this PyTorch sees no CUDA GPU")
            args.nproc = min(args.nproc, torch.cuda.device_count())
        args.threads = args.threads or min(args.nproc, os.cpu_count() or 1)
        if args.global_batch % args.nproc:
            raise SystemExit(
                f"error: --global-batch {args.global_batch} "
                f"must be a multiple of --nproc {args.nproc}"
            )
        machine = machine_description(device)
        plans = chapter_plans(args, device)
        runs = {}
        for number, folder in CHAPTERS.items():
            if f"{number:02d}" not in numbers(args.chapters):
                continue
            if not (REPO / folder / "train.py").exists():
                print(f"{folder}: no train.py yet, skipped")
                continue
            if number in NOT_CHAPTER_01S_RUN:
                print(f"{folder}: its run is not chapter 01's (common/chapters.py), skipped")
                continue
            if folder not in plans:
                print(
                    f"{folder}: cannot run with --nproc {args.nproc} (two nodes need an even "
                    "one; DataParallel a global batch its GPUs divide), skipped"
                )
                continue
            runs[folder] = run_chapter(folder, plans[folder], args, machine, device)
        # the control: the same runs in float64, where rounding is a billion times smaller
        for number, folder in CHAPTERS.items():
            if folder in runs and f"{number:02d}" in numbers(args.float64_chapters):
                runs[folder + FLOAT64] = run_chapter(
                    folder, plans[folder], args, machine, device, dtype="float64"
                )
        if not runs:
            raise SystemExit("error: no chapter to run")
    for path in plot_all(runs, args.figures, command):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
