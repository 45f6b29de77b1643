"""The link between two machines, in figures: chapter 05's step time against the link's rate,
predicted and measured (bench/link_rates.py), and chapter 08 (DiLoCo) against chapter 05 (DDP)
over a slow link (bench/slow_link.py, with --slow-link).

    python -m maintainer.link_picture                 # bench/results/link_rates.json
    python -m maintainer.link_picture --slow-link     # bench/results/slow_link.json
    python -m maintainer.link_picture [--slow-link] --from FILE --figures DIR --no-record

Draws docs/figures/link_rate_step.png (or into --figures), writes its section of
docs/figures/CAPTIONS.md, and stores two entries in bench/results/results.json (then renders
bench/RESULTS.md): the bus bandwidths the preflight measured at each rate, and the step times,
predicted against measured, each with the machine, its load, the command and the date.

With --slow-link: docs/figures/slow_link_loss_clock.png (the loss against the time trained, at
100 Mbit) and slow_link_round.png (one round of DiLoCo, step by step, and DDP's steps at the same
rate), their section of CAPTIONS.md, and two entries: the table of every rate, method and model
(tokens/s, bytes per step, validation loss), and the goals at 100 Mbit.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from bench import scaling_model
from layout import REPO
from maintainer import results as registry
from maintainer.make_plots import machine_text
from maintainer.step_pictures import write_section

FIGURE = "link_rate_step.png"
SECTION = "Chapter 05 across two machines: the link (bench/link_rates.py)"
CAPTIONS_BEGIN = "<!-- link_rates: begin -->"
CAPTIONS_END = "<!-- link_rates: end -->"
ENTRY_NAMES = {
    "busbw": "The link between two machines: all-reduce bus bandwidth at each rate",
    "steps": "Chapter 05's step across two machines at each link rate, predicted and measured",
}

SLOW_FIGURES = {"clock": "slow_link_loss_clock.png", "round": "slow_link_round.png"}
SLOW_SECTION = "Chapter 08 across two machines: DDP against DiLoCo over a slow link"
SLOW_BEGIN = "<!-- slow_link: begin -->"
SLOW_END = "<!-- slow_link: end -->"
SLOW_ENTRY_NAMES = {
    "table": "Chapter 05 (DDP) against chapter 08 (DiLoCo) across two machines at each link rate: "
    "tokens/s, bytes per step, validation loss",
    "goals": "Chapter 08's goals at 100 Mbit: DiLoCo H=50's tokens/s against DDP's on the "
    "unlimited link, and its validation loss against DDP's",
    "round": "Chapter 08's round at 100 Mbit: a quiet step, and the sync beyond it",
}
GOAL_RATE = "100mbit"
GOAL_SPEED = 0.85  # at least this share of DDP's tokens/s on the unlimited link
GOAL_LOSS = 0.03  # at most this much above DDP's validation loss, at equal tokens
COLORS = {"ddp": "black", "diloco H=10": "tab:orange", "diloco H=50": "tab:blue"}


def link_name(rate: str) -> str:
    """The link as the texts name it: tbf 100mbit, unlimited."""
    return rate if rate == "unlimited" else f"tbf {rate}"


def loads(measured: dict) -> str:
    values = [load for row in measured["rates"] for load in row["load_average"]]
    return f"load average {min(values):.1f} to {max(values):.1f} during the runs"


def subtitle(measured: dict) -> str:
    settings = measured["settings"]
    return (
        f"{machine_text(dict(measured['machine'], torch=measured['torch']))}, {loads(measured)}; "
        f"{settings['ranks']} machines of machines.sh, 1 process each, gloo, preset "
        f"{settings['preset']}, batch {settings['batch_size_per_rank']} per rank"
    )


def draw(measured: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = measured["rates"]
    settings = measured["settings"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    # the model's curve: the mean bare step, every bandwidth from below the slowest to the fastest
    compute = sum(row["bare"]["step_ms"] for row in rows) / len(rows) / 1000
    low = min(row["busbw_gbs"] for row in rows) / 2
    high = max(row["busbw_gbs"] for row in rows) * 2
    curve = [low * (high / low) ** (i / 60) for i in range(61)]
    steps = [
        1000
        * scaling_model.link_step(compute, settings["preset"], bw * 1e9, settings["ranks"])[
            "step_s"
        ]
        for bw in curve
    ]
    ax.plot(
        [8 * bw for bw in curve],
        steps,
        "--",
        color="tab:blue",
        label=f"bench/scaling_model.py with the mean bare step ({1000 * compute:.0f} ms)",
    )
    for n, row in enumerate(rows):
        x = 8 * row["busbw_gbs"]
        first = n == 0
        ax.plot(
            x,
            row["predicted_ms"]["step_s"],
            "x",
            color="tab:blue",
            markersize=10,
            label="predicted, from that rate's busbw and bare step" if first else None,
        )
        ax.plot(
            x,
            row["run"]["step_ms"],
            "o",
            color="black",
            label="measured: chapter 05 across the two machines" if first else None,
        )
        ax.annotate(
            link_name(row["rate"]),
            (x, row["run"]["step_ms"]),
            textcoords="offset points",
            xytext=(8, 8),
            fontsize=9,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bus bandwidth between the machines (Gbit/s), as the preflight measures it")
    ax.set_ylabel("step time (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper right")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    wrapped = "\n".join(textwrap.wrap(subtitle(measured), 85))
    ax.set_title(f"Chapter 05's step against the link between its machines\n{wrapped}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=170)
    plt.close(fig)


def busbw_table(measured: dict) -> str:
    sizes = [r["size_mb"] for r in measured["rates"][0]["preflight"]["rows"]]
    head = " | ".join(f"{size:g} MB" for size in sizes)
    lines = [
        f"| link | busbw (GB/s): {head} | at the gradients' size, in Mbit/s |",
        "|---|" + "---:|" * (len(sizes) + 1),
    ]
    for row in measured["rates"]:
        cells = " | ".join(f"{r['busbw_gbs']:.4f}" for r in row["preflight"]["rows"])
        lines.append(f"| {link_name(row['rate'])} | {cells} | {8000 * row['busbw_gbs']:,.1f} |")
    return "\n".join(lines)


def steps_table(measured: dict) -> str:
    lines = [
        "| link | busbw (GB/s) | bare step (ms) | predicted step (ms) | of it, the all-reduce "
        "(ms) | measured step (ms) | predicted / measured |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in measured["rates"]:
        predicted = row["predicted_ms"]["step_s"]
        step = row["run"]["step_ms"]
        lines.append(
            f"| {link_name(row['rate'])} | {row['busbw_gbs']:.4f} | {row['bare']['step_ms']:.1f} "
            f"| {predicted:.1f} | {row['predicted_ms']['exposed_s']:.1f} | {step:.1f} "
            f"| {predicted / step:.2f} |"
        )
    return "\n".join(lines)


def entries(measured: dict) -> list[dict]:
    machine = measured["machine"]
    words = f"{machine.get('cores')} CPU cores ({machine.get('cpu')}), {machine.get('os')}"
    words += f", {loads(measured)}: other work running"
    first = measured["rates"][0]
    common = {
        "section": SECTION,
        "machine": words,
        "torch": measured["torch"],
        "command": measured["made_by"],
        "date": measured["date"],
    }
    grad_mb = measured["gradients"]["grad_bytes"] / 1e6
    by_rate = {row["rate"]: row for row in measured["rates"]}
    busbw = ", ".join(f"{r['busbw_gbs']:.4f} GB/s {link_name(r['rate'])}" for r in by_rate.values())
    ratios = ", ".join(
        f"{r['predicted_ms']['step_s'] / r['run']['step_ms']:.2f} {link_name(r['rate'])}"
        for r in by_rate.values()
    )
    return [
        common
        | {
            "name": ENTRY_NAMES["busbw"],
            "value": f"{busbw} (all-reduces of {grad_mb:.3f} MB)",
            "what": "the all-reduce bus bandwidth between two machines of machines.sh (1 process "
            "each, gloo), measured by 05_multinode/preflight.py at three sizes with both "
            "directions of each machine's link limited by tc's tbf, or not limited",
            "table": busbw_table(measured),
            "source": "bench/results/link_rates.json",
            "notes": [f"preflight: `{first['preflight']['command']}` on each machine"],
        },
        common
        | {
            "name": ENTRY_NAMES["steps"],
            "value": f"predicted / measured: {ratios}",
            "what": "chapter 05's step time across two machines (1 process each), predicted by "
            "bench/scaling_model.py from the busbw at the gradients' size and the bare step, "
            "against the median step of the run; the facts of docs/figures/" + FIGURE,
            "table": steps_table(measured),
            "source": "bench/results/link_rates.json",
            "notes": [
                f"run: `{first['run']['command']}`",
                f"bare step: `{first['bare']['command']}`",
            ],
        },
    ]


def caption(measured: dict) -> str:
    settings = measured["settings"]
    return (
        "*Chapter 05's step against the link's rate, predicted and measured.* "
        "Chapter 05's step time across two machines of `05_multinode/machines.sh` (one process "
        f"each, gloo, the `{settings['preset']}` model, batch {settings['batch_size_per_rank']} "
        "per rank), with both directions of each machine's link limited by tc's tbf, or not "
        "limited, against the all-reduce bus bandwidth that `05_multinode/preflight.py` measured "
        "between the machines at each rate. Black dots: the median step of the run; blue "
        "crosses: bench/scaling_model.py's prediction from that rate's busbw (at the gradients' "
        "size) and the bare step of one rank's share measured just before; the dashed line: the "
        "same model for every bandwidth, with the mean bare step. The tiny model's gradients are "
        "one DDP bucket (the tied embedding is most of them), so nothing of the all-reduce hides "
        "behind backward: the step is the compute plus the whole all-reduce, and the slower the "
        "link, the more of the step is waiting for it."
    )


# ---- chapter 08 against chapter 05 over a slow link (bench/slow_link.py) ------------------------


AGAIN = ", again"  # the goal's two runs once more, back to back, at the end (bench's --again)


def slow_runs(measured: dict) -> dict[tuple[str, str, str], dict]:
    """Every run, by (rate, preset, method); the goal's runs made again at the end as their method
    and AGAIN."""
    runs = {
        (row["rate"], run["preset"], run["method"]): run
        for row in measured["rates"]
        for run in row["runs"]
    }
    for run in (measured.get("again") or {}).get("runs", []):
        runs[(run["rate"], run["preset"], run["method"] + AGAIN)] = run
    return runs


def final_val(run: dict) -> tuple[int, float]:
    """The last evaluation: (step, validation loss)."""
    step = max(int(s) for s in run["val_loss"])
    return step, run["val_loss"][str(step)]


def slow_loads(measured: dict) -> str:
    values = [load for run in slow_runs(measured).values() for load in run["load_average"]]
    return f"load average {min(values):.1f} to {max(values):.1f} during the runs"


def slow_subtitle(measured: dict) -> str:
    machine = machine_text(dict(measured["machine"], torch=measured["torch"]))
    return (
        f"{machine}, {slow_loads(measured)}; {measured['settings']['ranks']} machines of "
        "machines.sh, 1 process each, gloo"
    )


def preset_words(measured: dict, preset: str) -> str:
    """tiny: 1.64M parameters, 200 steps of 2 x 8 sequences of 32 tokens."""
    plan = measured["settings"]["presets"][preset]
    return (
        f"{preset}: {plan['params'] / 1e6:.2f}M parameters, {plan['iters']} steps of "
        f"{measured['settings']['ranks']} x {plan['batch_size_per_rank']} sequences of "
        f"{plan['block_size']} tokens"
    )


def slow_table(measured: dict) -> str:
    lines = [
        "| model | link | method | tokens/s | bytes sent per step (each rank) | validation loss "
        "(at step) | against DDP's | load average (start, end) |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    runs = slow_runs(measured)
    for (rate, preset, method), run in runs.items():
        step, val = final_val(run)
        _, ddp_val = final_val(runs[(rate, preset, "ddp")])
        lines.append(
            f"| {preset} | {link_name(rate)} | {method} | {run['tokens_per_sec']:,.0f} "
            f"| {run['sent']['bytes_per_step']:,} | {val:.4f} ({step}) "
            f"| {100 * (val / ddp_val - 1):+.1f}% "
            f"| {', '.join(f'{load:.1f}' for load in run['load_average'])} |"
        )
    # the presets one after the other, each with its rates in the measured order
    order = {preset: n for n, preset in enumerate(measured["settings"]["presets"])}
    body = sorted(lines[2:], key=lambda line: order[line.split("|")[1].strip()])
    return "\n".join(lines[:2] + body)


def goals(measured: dict) -> dict[str, dict]:
    """For each preset: DiLoCo H=50 at 100 Mbit against DDP, the two goals, whether each holds.
    The speed from the two runs made back to back at the end where there are such (the load of
    other work nearly the same for both), else from the first ones; `first_speed` from those."""
    runs = slow_runs(measured)
    met = {}
    for preset in measured["settings"]["presets"]:
        diloco = runs.get((GOAL_RATE, preset, "diloco H=50"))
        ddp_fast = runs.get(("unlimited", preset, "ddp"))
        ddp_here = runs.get((GOAL_RATE, preset, "ddp"))
        if not (diloco and ddp_fast and ddp_here):
            continue
        first_speed = diloco["tokens_per_sec"] / ddp_fast["tokens_per_sec"]
        speed = first_speed
        diloco_again = runs.get((GOAL_RATE, preset, "diloco H=50" + AGAIN))
        ddp_again = runs.get(("unlimited", preset, "ddp" + AGAIN))
        if diloco_again and ddp_again:
            speed = diloco_again["tokens_per_sec"] / ddp_again["tokens_per_sec"]
        loss = final_val(diloco)[1] / final_val(ddp_here)[1] - 1
        met[preset] = {
            "speed": speed,
            "back_to_back": bool(diloco_again and ddp_again),
            "first_speed": first_speed,
            "speed_met": speed >= GOAL_SPEED,
            "loss": loss,
            "loss_met": loss <= GOAL_LOSS,
        }
    return met


def goals_text(measured: dict) -> str:
    parts = []
    for preset, goal in goals(measured).items():
        speed = "met" if goal["speed_met"] else "missed"
        loss = "met" if goal["loss_met"] else "missed"
        how = ""
        if goal["back_to_back"]:
            how = f", the two run back to back ({goal['first_speed']:.2f}× from the first runs)"
        parts.append(
            f"{preset}: {goal['speed']:.2f}× DDP's tokens/s on the unlimited link{how}: {speed}; "
            f"validation loss {100 * goal['loss']:+.1f}% against DDP's: {loss}"
        )
    return "; ".join(parts)


def draw_clock(measured: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = slow_runs(measured)
    presets = list(measured["settings"]["presets"])
    fig, axes = plt.subplots(1, len(presets), figsize=(7, 4.2), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for method, color in COLORS.items():
            run = runs.get((GOAL_RATE, preset, method))
            if run is None:
                continue
            times = [0.0] + [point["t_s"] for point in run["clock"]]
            losses = [None] + [point["loss"] for point in run["clock"]]
            ax.plot(times[1:], losses[1:], color=color, label=method, linewidth=1.4)
            at = {point["iter"]: point["t_s"] for point in run["clock"]}
            for step, val in run["val_loss"].items():
                ax.plot(at[int(step)], val, "o", color=color, markersize=5, markeredgecolor="white")
        ax.set_title(preset_words(measured, preset).replace(", ", "\n", 1), fontsize=8)
        ax.set_xlabel("time trained (s), measured", fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    axes[0][0].set_ylabel("loss (line: training; dots: validation)", fontsize=9)
    axes[0][0].legend(fontsize=8)
    shown = [
        run for (rate, _, method), run in runs.items() if rate == GOAL_RATE and method in COLORS
    ]
    values = [load for run in shown for load in run["load_average"]]
    machine = machine_text(dict(measured["machine"], torch=measured["torch"]))
    wrapped = (
        f"{machine}, load average {min(values):.1f} to {max(values):.1f} during these runs; 2 "
        "machines of machines.sh, 1 process each, gloo"
    )
    wrapped = "\n".join(textwrap.wrap(wrapped, 100))
    fig.suptitle(
        f"The loss against the time trained, link {link_name(GOAL_RATE)}\n{wrapped}", fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=170, bbox_inches="tight")
    plt.close(fig)


def round_split(step_ms: list[float]) -> dict:
    """One round's step times: the quiet steps' median, and the last step's time beyond it (the
    sync: the pseudo-gradient's all-reduce and the outer step)."""
    quiet = sorted(step_ms[1:-1])  # the first step carries the run's warm-up
    median = quiet[len(quiet) // 2] if len(quiet) % 2 else sum(quiet[len(quiet) // 2 - 1 :][:2]) / 2
    return {"quiet_ms": median, "sync_ms": step_ms[-1] - median, "round_ms": sum(step_ms)}


def draw_round(measured: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    view = measured["timeline"]
    diloco = view["diloco"]["step_ms"]
    ddp = view["ddp"]["step_ms"]
    split = round_split(diloco)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    start = 0.0
    for n, ms in enumerate(diloco):
        shade = "tab:blue" if n % 2 == 0 else "lightsteelblue"
        if n == len(diloco) - 1:
            ax.barh(1, split["quiet_ms"] / 1000, left=start / 1000, color=shade, height=0.5)
            sync_at = (start + split["quiet_ms"]) / 1000
            ax.barh(1, split["sync_ms"] / 1000, left=sync_at, color="tab:red", height=0.5)
            ax.annotate(
                "the sync",
                (sync_at + split["sync_ms"] / 2000, 1.25),
                xytext=(0, 12),
                textcoords="offset points",
                ha="right",
                fontsize=8,
                color="tab:red",
                arrowprops={"arrowstyle": "->", "color": "tab:red"},
            )
        else:
            ax.barh(1, ms / 1000, left=start / 1000, color=shade, height=0.5)
        start += ms
    start = 0.0
    for n, ms in enumerate(ddp):
        shade = "dimgray" if n % 2 == 0 else "silver"
        ax.barh(0, ms / 1000, left=start / 1000, color=shade, height=0.5)
        start += ms
    h = view["sync_every"]
    ax.set_yticks([0, 1])
    ax.set_yticklabels([f"DDP\n({len(ddp)} steps)", f"DiLoCo H={h}\n(one round)"], fontsize=8)
    ax.set_xlabel("time (s), each step's as chapter 05 and chapter 08 measured it", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(
        handles=[
            Patch(color="tab:blue", label="an inner step, nothing sent (shades alternate)"),
            Patch(
                color="tab:red",
                label=f"the sync: {split['sync_ms'] / 1000:.2f} s beyond a quiet step",
            ),
            Patch(
                color="dimgray", label="a DDP step: compute and the all-reduce of every gradient"
            ),
        ],
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28),
        ncol=2,
    )
    title = (
        f"One round of DiLoCo, step by step, link {link_name(view['rate'])} (the tiny model)\n"
        f"{machine_text(dict(measured['machine'], torch=measured['torch']))}, "
        f"{round_loads(view)}"
    )
    ax.set_title(title, fontsize=9)
    ax.set_ylim(-0.5, 1.8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=170, bbox_inches="tight")
    plt.close(fig)


def round_loads(view: dict) -> str:
    values = view["diloco"]["load_average"] + view["ddp"]["load_average"]
    return f"load average {min(values):.1f} to {max(values):.1f}"


def slow_entries(measured: dict) -> list[dict]:
    machine = measured["machine"]
    words = f"{machine.get('cores')} CPU cores ({machine.get('cpu')}), {machine.get('os')}"
    words += f", {slow_loads(measured)}: other work running"
    command = measured["made_by"]
    if measured.get("again"):
        command += f", then {measured['again']['made_by']}"
    common = {
        "section": SLOW_SECTION,
        "machine": words,
        "torch": measured["torch"],
        "command": command,
        "date": measured["date"],
        "source": "bench/results/slow_link.json",
    }
    runs = slow_runs(measured)
    notes = [preset_words(measured, preset) for preset in measured["settings"]["presets"]]
    for method in ("ddp", "diloco H=50"):
        run = runs.get((GOAL_RATE, "tiny", method))
        if run is not None:
            notes.append(f"{method}: `{run['command']}`")
    notes.append(
        "tokens/s: the tokens of the steps after each model's warm-up (whole rounds of every H) "
        "over the sum of the chapter's own log intervals, evaluations excluded; DDP's bytes: "
        "every gradient once a step, 4 bytes a parameter (float32), counted from the model's "
        "parameters; DiLoCo's: the count chapter 08 prints"
    )
    if measured.get("again"):
        notes.append(
            f"rows marked '{AGAIN.strip(', ')}': the goal's two runs once more at the end, back "
            "to back for each model, so that the load of other work was nearly the same for "
            "both; the speed goal compares these two"
        )
    if not measured.get("complete", True):
        notes.append("the measurement was cut short: only the rows above were measured")
    entries = [
        common
        | {
            "name": SLOW_ENTRY_NAMES["table"],
            "value": None,
            "what": "chapter 05 (DDP) and chapter 08 (DiLoCo, --sync-every H) trained across two "
            "machines of machines.sh (1 process each, gloo, the same seed, data and steps), "
            "with both directions of each machine's link limited by tc's tbf, or not limited; "
            "the validation loss at the last step, so at equal tokens; the facts of "
            f"docs/figures/{SLOW_FIGURES['clock']}",
            "table": slow_table(measured),
            "notes": notes,
        },
        common
        | {
            "name": SLOW_ENTRY_NAMES["goals"],
            "value": goals_text(measured),
            "what": f"the goals, for DiLoCo with H=50 at 100 Mbit: at least {GOAL_SPEED:.2f}× the "
            "tokens/s DDP has on the unlimited link, and a validation loss at most "
            f"{100 * GOAL_LOSS:.0f}% above DDP's at equal tokens (the last step)",
        },
    ]
    if measured["timeline"]:
        split = round_split(measured["timeline"]["diloco"]["step_ms"])
        quiet = f"{split['quiet_ms']:.0f} ms"
        sync = f"{split['sync_ms'] / 1000:.2f} s"
        entries.append(
            common
            | {
                "name": SLOW_ENTRY_NAMES["round"],
                "value": f"a quiet step took {quiet} (the median); the sync {sync} more",
                "what": "one round of chapter 08 (tiny, the largest H) step by step: the median "
                "of its inner steps (the first left out: its warm-up) and the last step's time "
                f"beyond it; the facts of docs/figures/{SLOW_FIGURES['round']}",
            }
        )
    return entries


def slow_captions(measured: dict) -> dict[str, str]:
    split = round_split(measured["timeline"]["diloco"]["step_ms"]) if measured["timeline"] else None
    texts = {
        "clock": (
            "*The loss against the time trained, DDP and DiLoCo over a 100 Mbit link.* Chapter 05 "
            "(DDP) and chapter 08 (DiLoCo with a sync every 10 or 50 steps) across two machines "
            "of `05_multinode/machines.sh`, one process each, both directions of each machine's "
            "link limited to 100 Mbit/s by tc's tbf; the same seed, data and steps. The lines "
            "are the training loss at each log step (every 10 steps; for DiLoCo the mean over "
            "the ranks of each copy's loss on its own batch, which in runs this short stays "
            "below the global parameters' loss), the dots the global parameters' validation "
            "loss. The time is what the chapters measured: the sum of their log intervals, "
            "evaluations excluded. DDP sends every gradient at every step and spends most of "
            "its step waiting for the link; DiLoCo sends 1/H of those bytes and reaches the "
            "same step sooner. A 2-core machine that other work shared: the load moved from run "
            "to run, and each run's clock with it (each run's load is in the results, beside "
            "its tokens/s and its validation loss at equal tokens)."
        ),
    }
    if split:
        texts["round"] = (
            "*One round of DiLoCo, step by step, against DDP's steps over the same link.* The "
            "tiny model across two machines of `05_multinode/machines.sh` at 100 Mbit/s, one "
            "process each, every step timed by the chapter itself (`--log-interval 1`: each "
            "step also all-reduces its 4-byte loss). The top row is one run of chapter 08 for one "
            "round: its inner steps send nothing; the last step ends with the sync, the "
            "all-reduce of the pseudo-gradient and the outer step, drawn in red as that step's "
            f"time beyond the median quiet step ({split['quiet_ms']:.0f} ms). The bottom row is "
            "chapter 05 (DDP) for a few steps, each one compute and the all-reduce of every "
            "gradient. The first step of each run carries its warm-up. A busy 2-core machine: "
            "the quiet steps vary with the other work on it."
        )
    return texts


def slow_main(args) -> int:
    source = args.source or REPO / "bench" / "results" / "slow_link.json"
    measured = json.loads(source.read_text())
    draw_clock(measured, args.figures / SLOW_FIGURES["clock"])
    print(f"wrote {args.figures / SLOW_FIGURES['clock']}")
    texts = slow_captions(measured)
    if "round" in texts:
        draw_round(measured, args.figures / SLOW_FIGURES["round"])
        print(f"wrote {args.figures / SLOW_FIGURES['round']}")
    lines = [
        "",
        "## Chapter 08 across two machines",
        "",
        f"Drawn by `python -m maintainer.link_picture --slow-link` from `{measured['made_by']}`"
        f"{' (and `--again`)' if measured.get('again') else ''}, "
        "whose runs at 100 Mbit were, for the tiny model:",
        "",
    ]
    runs = slow_runs(measured)
    for method in COLORS:
        run = runs.get((GOAL_RATE, "tiny", method))
        if run is not None:
            lines.append(f"- {method}: `{run['command']}`")
    lines.append("")
    for key, text in texts.items():
        figure = SLOW_FIGURES[key]
        lines += [f"### {figure}", "", f"![{figure}]({figure})", "", text, ""]
    lines += [f"*{slow_subtitle(measured)}.*", ""]
    print(f"wrote {write_section(args.figures, SLOW_BEGIN, SLOW_END, lines)}")
    if args.record:
        stored = registry.load()
        entries = slow_entries(measured)
        for entry in entries:
            registry.store(stored, entry)
        registry.save(stored)
        print(f"recorded {len(entries)} entries in {registry.RESULTS_JSON.relative_to(REPO)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--from",
        dest="source",
        type=Path,
        help="what bench/link_rates.py measured (bench/results/link_rates.json), or with "
        "--slow-link bench/slow_link.py (bench/results/slow_link.json)",
    )
    p.add_argument("--slow-link", action="store_true", help="chapter 08 against chapter 05")
    p.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    p.add_argument("--no-record", dest="record", action="store_false", help="leave results.json")
    args = p.parse_args(argv)
    if args.slow_link:
        return slow_main(args)
    source = args.source or REPO / "bench" / "results" / "link_rates.json"
    measured = json.loads(source.read_text())
    draw(measured, args.figures / FIGURE)
    print(f"wrote {args.figures / FIGURE}")
    lines = [
        "",
        "## Chapter 05 across two machines",
        "",
        f"Drawn by `python -m maintainer.link_picture` from `{measured['made_by']}`:",
        "",
        f"### {FIGURE}",
        "",
        f"![{FIGURE}]({FIGURE})",
        "",
        caption(measured),
        "",
        f"*{subtitle(measured)}.*",
        "",
    ]
    print(f"wrote {write_section(args.figures, CAPTIONS_BEGIN, CAPTIONS_END, lines)}")
    if args.record:
        stored = registry.load()
        for entry in entries(measured):
            registry.store(stored, entry)
        registry.save(stored)
        print(f"recorded {len(entries)} entries in {registry.RESULTS_JSON.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
