"""One summary of what bench/gpu_check.sh wrote: the benchmark runs and the checks.

python bench/gpu_summary.py bench/results/gpu
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tables import cell, percent, row


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def summary(out: Path) -> str:
    lines = [
        "| Run | tokens/s | MFU | Peak memory (MB) | Step (ms) | Step / bare | Status |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    device = None
    for variant in ("eager", "compile"):
        report = _load(out / variant / "benchmark.json")
        if report is None:
            lines.append(f"| {variant} | | | | | | no results (see {variant}.log) |")
            continue
        s = report["settings"]
        batch = f"batch {s['global_batch']} x {s['block_size']}"
        device = device or f"{s['device_name']}, {s['preset']} preset, {batch}, {s['dtype']}"
        for r in report["setups"]:
            name = f"{r['label']} ({variant})"
            if r["status"] != "ok":
                lines.append(f"| {name} | | | | | | {r['status']}: {r.get('note', '')} |")
                continue
            step = [cell(r["peak_mem_mb"]), cell(r["step_ms"], "{:.1f}"), cell(r["bare_ratio"], "{:.3f}")]
            lines.append(row([name, cell(r["tokens_per_sec"]), percent(r["mfu"]), *step, "ok"]))
    check = _load(out / "gpu_vs_cpu.json")
    text = [f"# GPU check: {device or 'no benchmark results'}", "", *lines, ""]
    if check is None:
        text.append("- bf16 vs float32 check: no results (see gpu_vs_cpu.log)")
    else:
        sides = f"{check['test']} against {check['reference']}, {check['steps']} steps"
        verdict = "PASS" if check["passed"] else "FAIL"
        difference = f"largest relative loss difference {check['max_rel_diff']:.2e} (rtol {check['rtol']:g})"
        text.append(f"- bf16 vs float32 check ({sides}): {verdict}, {difference}")
    replica = _load(out / "replica_dtype.json")
    if replica is None:
        text.append("- DataParallel replica dtype: no results (see replica_dtype.log)")
    else:
        text.append(
            f"- DataParallel replica dtype, {replica['chosen']} chosen: torch's replica threads compute in "
            f"{', '.join(replica['plain'])}; chapter 03's in {', '.join(replica['chapter03'])}: "
            f"{'PASS' if replica['passed'] else 'FAIL'} (two GPUs: {replica['chapter03_two_gpus']})"
        )
    for name, marker in (("preflight", "preflight "), ("from_scratch", "mean step time")):
        found = _lines(out / f"{name}.log", marker)
        text.append(f"- {name}: " + ("; ".join(found) if found else f"no results (see {name}.log)"))
    chunked = out / "loss_chunked.md"
    text += [
        "",
        "## Plain vs chunked loss",
        "",
        chunked.read_text().strip() if chunked.exists() else "no results (see loss_chunked.log)",
    ]
    text += [
        "",
        "Not measured on one GPU: DataParallel's imbalance between GPUs (cuda:0 holds the gathered "
        "outputs) and NCCL's scaling over GPUs and nodes need two GPUs or more.",
    ]
    return "\n".join(text) + "\n"


def _lines(path: Path, marker: str) -> list[str]:
    """The lines of a step's log that hold `marker`, without the torchrun rank prefix."""
    try:
        return [line.strip() for line in path.read_text(errors="replace").splitlines() if marker in line]
    except OSError:
        return []


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/gpu")), end="")
