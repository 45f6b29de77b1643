"""What bench/gpu_check.sh writes: rows.json (one row per step that ran, with the figures its
results files hold), summary.md (the steps, then the figures) and details.tar.gz (every step's log
and results files), rewritten after every step so that a check stopped from outside keeps what ran.

    python3 -m bench.gpu_summary record --out OUT --detail DETAIL --step NAME --status passed ...
    python3 -m bench.gpu_summary DETAIL      # the figures of a folder of results, on the screen
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path

from bench.benchmark import cell, percent, row

# the results files each step writes under the detail folder; their content goes into its row
RESULTS = {
    "compile_probe": ["compile_probe.json"],
    "eager": ["eager/benchmark.json"],
    "compile": ["compile/benchmark.json"],
    "fsdp": ["fsdp/benchmark.json"],
}
# the lines of a step's log that are its figures, for steps that write no results file
LOG_LINES = {"preflight": "preflight ", "by_hand": "mean step time", "prepare_data": "prepar"}


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def summary(detail: Path, rows: list[dict] | None = None) -> str:
    """The figures under `detail` (the check's results folder), after a table of `rows` if given."""
    lines = [
        "| Run | tokens/s | MFU | Peak memory (MB) | Step (ms) | Step / bare | Status |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    device = None
    # the benchmark's folders: the step that wrote each, and how its model ran
    for folder, variant in (("eager", "eager"), ("compile", "compile"), ("fsdp", "eager")):
        report = _load(detail / folder / "benchmark.json")
        if report is None:
            lines.append(f"| {folder} | | | | | | no results (see {folder}.log) |")
            continue
        s = report["settings"]
        batch = f"batch {s['global_batch']} x {s['block_size']}"
        device = device or f"{s['device_name']}, {s['preset']} preset, {batch}, {s['dtype']}"
        for r in report["setups"]:
            name = f"{r['label']} ({variant})"
            if r["status"] != "ok":
                lines.append(f"| {name} | | | | | | {r['status']}: {r.get('note', '')} |")
                continue
            step = [
                cell(r["peak_mem_mb"]),
                cell(r["step_ms"], "{:.1f}"),
                cell(r["bare_ratio"], "{:.3f}"),
            ]
            lines.append(row([name, cell(r["tokens_per_sec"]), percent(r["mfu"]), *step, "ok"]))
    text = [f"# GPU check: {device or 'no benchmark results'}", ""]
    if rows is not None:
        text += [steps_table(rows), ""]
    text += [*lines, ""]
    probe = _load(detail / "compile_probe.json")
    if probe is None:
        text.append("- compile probe: no results (see compile_probe.log)")
    elif probe["passed"]:
        text.append(
            f"- compile probe: a compiled x * 2 ran on {probe['device']} in {probe['seconds']} s"
        )
    else:
        text.append(
            f"- compile probe: FAILED on {probe['device']}: {probe['error']}; "
            "the compile steps were skipped"
        )
    for name in ("preflight", "by_hand"):
        found = _lines(detail / f"{name}.log", LOG_LINES[name])
        text.append(f"- {name}: " + ("; ".join(found) if found else f"no results (see {name}.log)"))
    text += [
        "",
        "Not measured on one GPU: DataParallel's imbalance between GPUs (cuda:0 holds the gathered "
        "outputs) and NCCL's scaling over GPUs and nodes need two GPUs or more.",
    ]
    return "\n".join(text) + "\n"


def steps_table(rows: list[dict]) -> str:
    """One line per step, from the last try of each; then the steps that did not pass, and how
    to rerun them."""
    last = {r["step"]: r for r in rows}
    lines = ["| Step | Status | Seconds | Limit (s) |", "|---|---|---:|---:|"]
    lines += [
        row([r["step"], r["status"], str(r["seconds"]), str(r["limit"])]) for r in last.values()
    ]
    again = [name for name, r in last.items() if r["status"] != "passed"]
    if again:
        rerun = f"STEPS={','.join(again)} TOTAL=250 bash bench/gpu_check.sh"
        lines += ["", f"Not passed: rerun them alone with `{rerun}`."]
    return "\n".join(lines)


def _lines(path: Path, marker: str) -> list[str]:
    """The lines of a step's log that hold `marker`, without the torchrun rank prefix."""
    try:
        return [
            line.strip() for line in path.read_text(errors="replace").splitlines() if marker in line
        ]
    except OSError:
        return []


def _write_atomically(path: Path, data: bytes) -> None:
    """A reader (or a copy taken when the check is stopped) sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def record(out: Path, detail: Path, step: dict) -> None:
    """Add one finished step to rows.json, then rewrite summary.md and details.tar.gz."""
    rows_path = out / "rows.json"
    report = _load(rows_path) or {"check": "bench/gpu_check.sh", "rows": []}
    if "environment" not in report:
        env = out / "environment.txt"
        report["environment"] = env.read_text(errors="replace") if env.exists() else None
    step = dict(step, ended=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    step["results"] = {name: _load(detail / name) for name in RESULTS.get(step["step"], [])}
    if step["step"] in LOG_LINES:
        step["lines"] = _lines(detail / f"{step['step']}.log", LOG_LINES[step["step"]])
    report["rows"].append(step)
    _write_atomically(rows_path, (json.dumps(report, indent=1) + "\n").encode())
    _write_atomically(out / "summary.md", summary(detail, report["rows"]).encode())
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(detail, arcname="details")
    _write_atomically(out / "details.tar.gz", buffer.getvalue())


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "record":
        print(summary(Path(argv[0] if argv else "bench/results/gpu")), end="")
        return
    p = argparse.ArgumentParser(prog="gpu_summary.py record")
    p.add_argument("--out", type=Path, required=True, help="the results folder (four files)")
    p.add_argument("--detail", type=Path, required=True, help="the steps' logs and results files")
    p.add_argument("--step", required=True)
    p.add_argument("--status", required=True, choices=["passed", "failed", "stopped", "skipped"])
    p.add_argument("--exit-status", type=int, default=None)
    p.add_argument("--seconds", type=int, required=True)
    p.add_argument("--limit", type=int, required=True)
    p.add_argument("--command", default="")
    p.add_argument("--note", default="")
    args = p.parse_args(argv[1:])
    fields = ("step", "status", "exit_status", "seconds", "limit", "command", "note")
    record(args.out, args.detail, {k: getattr(args, k) for k in fields})


if __name__ == "__main__":
    main(sys.argv[1:])
