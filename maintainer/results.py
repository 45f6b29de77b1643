r"""The course's measured figures: one results file, bench/results/results.json, rendered
to bench/RESULTS.md.

Every figure a text quotes (a time, a rate, a speed-up, a loss, a memory size) is the `value`
of one entry here, written exactly as the texts quote it, with the machine, torch version,
command and date of the run that gave it. tests/test_results.py fails when a text quotes a
figure no entry holds.

    python -m maintainer.results                       # render bench/RESULTS.md from results.json
    python -m maintainer.results --check               # exit 1 if bench/RESULTS.md is out of step
    python -m maintainer.results --scan                # list the texts' figures that no entry holds
    python -m maintainer.results record NAME --what "..." [--from REGEX] [--keep-output] \
        -- COMMAND...                                  # run COMMAND, time it, store an entry

`record` stores the wall time ("4 min 4 s") as the value, or the first group of REGEX in what the
command printed (`--from "val loss ([0-9.]+)"`); `--keep-output` keeps the printed lines, so a
chapter's text can show them."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from layout import REPO
from maintainer import REGENERATE

RESULTS_JSON = REPO / "bench" / "results" / "results.json"
RESULTS_MD = REPO / "bench" / "RESULTS.md"

# The texts that quote figures: the main path, the deep dives and bench/'s own page.
TEXTS = ["README.md", "0*/README.md", "docs/**/*.md", "04_ddp/*.md", "bench/README.md"]
# docs/WORKSHOP.md is a workshop's agenda: its times are a plan for the day, not measurements.
NOT_TEXTS = ["docs/WORKSHOP.md"]

# What a measured figure looks like in a text. A number: 1,940 or 1.61 or 9.
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# A number or a range of two: 460–480 (normal() writes the dash as "-").
_RANGE = rf"(?:{_NUM})(?: ?[–-] ?(?:{_NUM}))?"
_SUPERSCRIPT = "⁰¹²³⁴⁵⁶⁷⁸⁹"
FIGURE_PATTERNS = {
    "duration": rf"\b\d+ min \d+ s\b|\b{_RANGE} ?(?:ms|µs|s|seconds?|minutes?|min|hours?)\b(?!/)",
    "rate": rf"\b{_RANGE}[KM]? ?(?:tokens/s|samples/s|[KMGT]B/s|TFLOP/s)",
    "speed-up": r"\b\d+\.\d+ ?[×x](?![\w-])",
    "percentage": rf"\b(?:{_NUM})%",
    "loss": r"\b\d{1,2}\.\d{3,4}\b",
    "memory": rf"\b{_RANGE} ?(?:[KMGT]i?B|bytes)\b(?!/)",
    # a difference or a tolerance: 1e-7, 1.6·10⁻⁵ (counted on a line about agreement, below)
    "tolerance": rf"\b\d(?:\.\d+)?e-\d{{1,2}}\b|(?<![\w.·])(?:\d(?:\.\d+)?·)?10⁻[{_SUPERSCRIPT}]+",
    # an exact count too large to be a setting: 57,989,328 (bytes, parameters) in a table or text
    "count": r"\b\d{1,3}(?:,\d{3}){2,}\b(?![.,]\d)",
    # a share of a whole: 11 of 28 (gradients ready)
    "share": r"\b\d+ of \d+\b(?! ?[%A-Za-z]*/s)",
    # a measured number said approximately, without a unit: about 0.07, ~0.4
    "approximate": r"(?:(?<=about )|(?<=~)|(?<=≈ ))\d+\.\d+\b(?!\.\d)(?! ?(?:[%×/]|x\b|[A-Zµ]))",
    # the step a printed line names, in an example output: "stopped by SIGTERM at step 21"
    "step": r"\bstep \d+\b",
}
_FIGURE = re.compile(
    "|".join(f"(?P<{k.replace('-', '_')}>{p})" for k, p in FIGURE_PATTERNS.items())
)
# A percentage is a measured figure when it is an efficiency, an MFU or a share of a step.
_PERCENT_CONTEXT = re.compile(r"efficien|MFU|scaling|share|communication|all-reduce", re.IGNORECASE)
# A number like 1e-7 is a measured figure when the line is about how closely two things agree (not a
# learning rate or an epsilon in code).
_TOLERANCE_CONTEXT = re.compile(
    r"agree|within|differ|off by|toleran|rtol|atol|rounding|relative|away from|below|at most",
    re.IGNORECASE,
)
# "step N" is a figure in a printed example output (a fenced block), not in a sentence that
# explains what step N does.
_IN_OUTPUT_ONLY = {"step"}

# Figures a text may quote that are not measurements of this course. Keep this short and honest.
NOT_MEASURED = {
    "25 MiB": "DDP's default bucket cap (torch's bucket_cap_mb=25)",
    "25 MB": "DDP's default bucket cap, as torch's docs write it",
    "1 MiB": "DDP's first bucket after the rebuild (torch's default first-bucket cap)",
    "1 MB": "the bucket cap the by-hand runs set (--bucket-mb 1)",
    "10 KB": "the bucket cap of the by-hand test (4 buckets)",
    "100%": "perfect scaling, a definition",
    "450 GB/s": "NVLink 4 per direction, NVIDIA's H100 datasheet",
    "470 GB/s": "the scaling model's NVLink busbw: the middle of nccl-tests' published "
    "460-480 GB/s, 8 x H100",
    "460-480 GB/s": "nccl-tests' published busbw on 8 x H100 (normalised, not a link's bytes)",
    "900 GB/s": "NVLink 4 both directions, NVIDIA's H100 datasheet",
    "989 TFLOP/s": "H100/H200 dense bf16 peak, NVIDIA's datasheet",
    "4.8 TB/s": "H200 memory bandwidth, NVIDIA's datasheet",
    "12.5 GB/s": "a 100 Gb/s link's line rate (100 / 8)",
    "50 GB/s": "one 400 Gb/s InfiniBand NDR link's line rate (400 / 8)",
    "400 GB/s": "8 x 400 Gb/s InfiniBand per node, line rate (8 x 50)",
    "300 s": "the course's --dist-timeout default",
    "6 hours": "the timeout of the chapters' gloo group for checkpoint barriers "
    "(common/distributed.py)",
    "10 minutes": "the test suite's time budget (a goal)",
    "30 minutes": "gloo's default process-group timeout in torch",
    "15 minutes": "how long torchrun's static rendezvous retries its store (timeout=900000ms in "
    "its retry lines, torch 2.13)",
    "90 s": "the NFSv4 lease, the default of Linux's NFS server (nfsv4leasetime)",
    "4 bytes": "one float32 number's size (AdamW's `step` per parameter tensor)",
    "16 bytes": "per parameter under DDP: float32 weight, gradient and AdamW's two averages "
    "(4 + 4 + 8), arithmetic",
    "step 100": "chapter 01's default --eval-interval: the form of its first evaluation line",
    "1e-9": "the relative tolerance tests/test_preemption.py asserts on a resumed run, a setting",
    "10⁻⁵": "the relative tolerance tests/test_zero.py asserts on the losses (REL), a setting",
    "2·10⁻⁵": "the tolerance tests/test_zero.py asserts on the parameters (PARAM_ATOL), a setting",
    "10⁻⁶": "the tolerance tests/test_fsdp_by_hand.py asserts on the gradients, a setting",
    "10⁻¹²": "the float64 tolerance tests/test_fsdp_by_hand.py asserts, a setting",
}


def normal(figure: str) -> str:
    """A figure as the checker compares it: "1.61x" and "1.61×" are one figure, spaces are plain."""
    figure = figure.replace("\u00a0", " ").replace("\u202f", " ")
    # a range's dash: 460–480 and 460-480 are one figure
    figure = re.sub(r"(\d) ?[–-] ?(\d)", r"\1-\2", figure)
    return re.sub(r"(\d) ?[x×]$", r"\1×", figure)


def figures_in(text: str, measured: bool = False) -> list[tuple[int, str]]:
    """Every measured figure in `text`, as (line number, figure).

    A percentage counts only on a line about efficiency, MFU or a share, a tolerance like 1e-7 only
    on a line about agreement, and "step N" only in a fenced block (an example output), unless
    `measured` (the results' own text, where every figure is measured). Skips ```diff blocks and
    the diffs a chapter README embeds (between publish_diffs' markers).
    """
    found = []
    skipping = False  # inside an embedded diff
    in_block = False  # inside a fenced block
    in_diff = False  # inside a ```diff block
    for line_no, line in enumerate(text.splitlines(), 1):
        if "<!-- diff:begin -->" in line:
            skipping = True
        if "<!-- diff:end -->" in line:
            skipping = False
            continue
        if line.lstrip().startswith("```"):
            in_block = not in_block
            in_diff = in_block and line.strip() == "```diff"
            continue
        if skipping or in_diff:
            continue
        # Inline code is a flag, a setting or an error message, not a figure the text quotes.
        plain = re.sub(r"`[^`]*`", lambda c: " " * len(c.group()), line)
        for m in _FIGURE.finditer(plain):
            if not measured and not _counts(m.lastgroup, line, in_block):
                continue
            found.append((line_no, normal(m.group())))
    return found


def _counts(kind: str, line: str, in_block: bool) -> bool:
    """Whether a figure of this kind, found on this line of a text, is one the text quotes."""
    if kind == "percentage":
        return bool(_PERCENT_CONTEXT.search(line))
    if kind == "tolerance":
        return bool(_TOLERANCE_CONTEXT.search(line))
    if kind in _IN_OUTPUT_ONLY:
        return in_block
    return True


def text_files(repo: Path = REPO) -> list[Path]:
    """The texts whose figures must come from the results (docs/diffs holds no Markdown)."""
    files = {p for pattern in TEXTS for p in repo.glob(pattern)}
    return sorted(p for p in files if str(p.relative_to(repo)) not in NOT_TEXTS)


def load(path: Path = RESULTS_JSON) -> dict:
    return json.loads(path.read_text())


_CELL = re.compile(r"^\s*(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d{3,})\s*$")


def number(figure: str) -> str:
    """The number of a figure: '1,638.3 MiB' -> '1,638.3'."""
    found = re.match(r"[\d,.]+(?:-[\d,.]+)?", figure)
    if found is None:  # "step 21"
        return figure
    return found.group().rstrip(".")


def held(results: dict) -> set[str]:
    """Every figure the results hold: those in each entry's value, table and printed output.

    A table's cells carry their unit in the column's header, so a cell's number (with a decimal
    point or a thousands comma, or three digits or more: not a count like 8) is held as `#1,638.3`,
    and a text's figure matches it by its number.
    """
    figures = set()
    for entry in results["entries"]:
        for field in ("value", "table", "output"):
            if entry.get(field):
                figures.update(f for _, f in figures_in(entry[field], measured=True))
        for line in (entry.get("table") or "").splitlines():
            for cell in line.strip().strip("|").split("|"):
                if _CELL.match(cell):
                    figures.add("#" + cell.strip())
    return figures


def unheld(repo: Path = REPO, results: dict | None = None) -> list[str]:
    """'file:line: figure' for every measured figure a text quotes that the results do not hold."""
    results = results or load(repo / "bench" / "results" / "results.json")
    allowed = held(results) | {normal(f) for f in NOT_MEASURED}
    return [
        f"{path.relative_to(repo)}:{line}: {figure}"
        for path in text_files(repo)
        for line, figure in figures_in(path.read_text())
        if figure not in allowed and "#" + number(figure) not in allowed
    ]


def render(results: dict) -> str:
    """bench/RESULTS.md: every entry, grouped by its section, with where and how it was measured."""
    out = [
        "# Results: every figure the course quotes",
        "",
        "Generated by `python -m maintainer.results` from `bench/results/results.json`: "
        "edit the JSON (or",
        "record a new run with `python -m maintainer.results record`), then rerun it. "
        "Texts quote these",
        "figures exactly as written here; `tests/test_results.py` fails when a text quotes "
        "a measured",
        "figure that is not here.",
        "",
    ]
    # every section once, where its first entry stands; an entry appended later joins its section
    sections: dict[str, list[dict]] = {}
    for entry in results["entries"]:
        sections.setdefault(entry["section"], []).append(entry)
    ordered = [entry for entries in sections.values() for entry in entries]
    section = None
    for entry in ordered:
        if entry["section"] != section:
            section = entry["section"]
            out += [f"## {section}", ""]
        out.append(
            f"**{entry['name']}**: {entry['value']}"
            if entry.get("value")
            else f"**{entry['name']}**"
        )
        out.append("")
        if entry.get("what"):
            out += [entry["what"], ""]
        if entry.get("table"):
            out += [entry["table"].rstrip("\n"), ""]
        if entry.get("output"):
            out += ["```text", entry["output"].rstrip("\n"), "```", ""]
        out.append(f"- machine: {entry['machine']}; torch {entry['torch']}; {entry['date']}")
        out.append(f"- command: `{entry['command']}`")
        if entry.get("source"):
            out.append(f"- source: {entry['source']}")
        if entry.get("kept_over"):
            out.append(f"- one answer: {entry['kept_over']}")
        out += [f"- note: {note}" for note in entry.get("notes", [])]
        out.append("")
    out += ["## Figures texts may quote that are not measurements", ""]
    out += [f"- {figure}: {why}" for figure, why in NOT_MEASURED.items()]
    return "\n".join(out) + "\n"


def duration(seconds: float) -> str:
    """A wall time as the texts write it: '9 s', '4 min 4 s'."""
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"


def machine() -> str:
    """This machine in words, with its load when the run started (a shared machine says so)."""
    cores = os.cpu_count()
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    busy = f", load average {load1:.1f} at the start" if load1 is not None else ""
    return f"{cores} CPU cores ({platform.machine()}), {platform.system()}{busy}"


def record(
    results: dict,
    name: str,
    what: str,
    section: str,
    command: list[str],
    pattern: str | None,
    keep_output: bool,
) -> dict:
    """Run `command`, time it, and put its entry in `results` (replacing one of the same name)."""
    import torch

    entry_machine = machine()
    start = time.perf_counter()
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    printed = run.stdout + run.stderr
    if run.returncode != 0:
        sys.exit(
            f"error: the command failed with status {run.returncode}; nothing recorded:\n"
            f"{printed[-2000:]}"
        )
    if pattern:
        m = re.search(pattern, printed)
        if not m:
            sys.exit(f"error: {pattern!r} is not in what the command printed; nothing recorded")
        value = m.group(1)
    else:
        value = duration(wall)
    entry = {
        "section": section,
        "name": name,
        "value": value,
        "what": what,
        "machine": entry_machine,
        "torch": torch.__version__,
        "command": " ".join(command),
        "date": datetime.date.today().isoformat(),
    }
    if keep_output:
        entry["output"] = printed
    store(results, entry)
    return entry


def store(results: dict, entry: dict) -> None:
    """Put `entry` in `results`, in place of an entry of the same name."""
    results["entries"] = [e for e in results["entries"] if e["name"] != entry["name"]]
    results["entries"].append(entry)


def save(results: dict) -> None:
    """Write results.json and render bench/RESULTS.md from it."""
    RESULTS_JSON.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    RESULTS_MD.write_text(render(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if bench/RESULTS.md is out of step")
    p.add_argument(
        "--scan", action="store_true", help="list the texts' figures the results do not hold"
    )
    sub = p.add_subparsers(dest="verb")
    r = sub.add_parser("record", help="run a command, time it, store an entry")
    r.add_argument("name")
    r.add_argument("--what", required=True, help="what the figure is, in one sentence")
    r.add_argument("--section", default="Runs", help="the section of RESULTS.md")
    r.add_argument(
        "--from", dest="pattern", help="regex whose first group is the value (default: wall time)"
    )
    r.add_argument("--keep-output", action="store_true", help="store the printed lines")
    r.add_argument(
        "--note", action="append", default=[], help="a note under the entry (repeatable)"
    )
    argv = sys.argv[1:]
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    results = load()
    if args.verb == "record":
        if not command:
            sys.exit("error: give the command to run after --")
        entry = record(
            results, args.name, args.what, args.section, command, args.pattern, args.keep_output
        )
        if args.note:
            entry["notes"] = args.note
        # read again: another record may have finished while the command ran
        results = load()
        store(results, entry)
        RESULTS_JSON.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        print(f"recorded {entry['name']}: {entry['value']}")
    if args.scan:
        missing = unheld()
        print("\n".join(missing) or "every figure the texts quote is in the results")
        sys.exit(1 if missing else 0)
    if args.check:
        if not RESULTS_MD.exists() or RESULTS_MD.read_text() != render(results):
            sys.exit(
                f"error: bench/RESULTS.md is out of step with results.json; run `{REGENERATE}`"
            )
        return
    RESULTS_MD.write_text(render(results))


if __name__ == "__main__":
    main()
