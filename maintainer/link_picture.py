"""Chapter 05's step time against the link between its machines, predicted and measured: the
figure, its captions and its figures in the results, from what bench/link_rates.py measured.

    python -m maintainer.link_picture                 # bench/results/link_rates.json
    python -m maintainer.link_picture --from FILE --figures DIR --no-record

Draws docs/figures/link_rate_step.png (or into --figures), writes its section of
docs/figures/CAPTIONS.md, and stores two entries in bench/results/results.json (then renders
bench/RESULTS.md): the bus bandwidths the preflight measured at each rate, and the step times,
predicted against measured, each with the machine, its load, the command and the date.
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
    fig, ax = plt.subplots(figsize=(8, 4.8))
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
    wrapped = "\n".join(textwrap.wrap(subtitle(measured), 95))
    ax.set_title(f"Chapter 05's step against the link between its machines\n{wrapped}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=REPO / "bench" / "results" / "link_rates.json",
        help="what bench/link_rates.py measured",
    )
    p.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    p.add_argument("--no-record", dest="record", action="store_false", help="leave results.json")
    args = p.parse_args(argv)
    measured = json.loads(args.source.read_text())
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
        print(f"recorded 2 entries in {registry.RESULTS_JSON.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
