r"""The course's measured figures: bench/results/results.json, rendered to bench/RESULTS.md.

Every figure a text quotes (a time, a rate, a speed-up, a loss, a memory size) is held by one entry
of results.json, with the machine, its load, torch's version, the command and the date of the run
that gave it. The entries are data: each benchmark writes its own JSON beside them
(bench/results/*.json, named in an entry's `source`). tests/test_results.py fails when a text
quotes a figure that no entry holds.

    python -m maintainer.results                # render bench/RESULTS.md from results.json
    python -m maintainer.results --check        # exit 1 if bench/RESULTS.md is out of step
    python -m maintainer.results --scan         # list the texts' figures no entry holds
    python -m maintainer.results record NAME --what "..." [--from REGEX] -- COMMAND...

`record` runs COMMAND and stores an entry: its wall time ("4 min 4 s"), or the first group of
REGEX in what it printed (`--from "val loss ([0-9.]+)"`), with the printed lines."""

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
from collections import Counter
from pathlib import Path

from layout import REPO
from maintainer import REGENERATE

RESULTS_JSON = REPO / "bench" / "results" / "results.json"
RESULTS_MD = REPO / "bench" / "RESULTS.md"
# The texts that quote figures: the main path, the deep dives and bench/'s own page.
TEXTS = ["README.md", "0*/README.md", "docs/**/*.md", "04_ddp/*.md", "bench/README.md"]
# docs/WORKSHOP.md is a workshop's agenda: its times are a plan for the day, not measurements.
NOT_TEXTS = ["docs/WORKSHOP.md"]

# What a measured figure looks like in a text. A number (1,940 or 1.61 or 9), or a range of two.
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_RANGE = rf"(?:{_NUM})(?: ?[–-] ?(?:{_NUM}))?"
_SUP = "⁰¹²³⁴⁵⁶⁷⁸⁹"
# kind -> (pattern, the context a line needs for a figure of that kind to count, or None)
KINDS = {
    "duration": (
        rf"\b\d+ min \d+ s\b|\b{_RANGE} ?(?:ms|µs|s|seconds?|minutes?|min|hours?)\b(?!/)",
        None,
    ),
    "rate": (rf"\b{_RANGE}[KM]? ?(?:tokens/s|samples/s|[KMGT]B/s|TFLOP/s)", None),
    "speedup": (r"\b\d+\.\d+ ?[×x](?![\w-])", None),
    # an efficiency, an MFU or a share of a step, not any percentage
    "percent": (rf"\b(?:{_NUM})%", r"efficien|MFU|scaling|share|communication|all-reduce"),
    "loss": (r"\b\d{1,2}\.\d{3,4}\b", None),
    "memory": (rf"\b{_RANGE} ?(?:[KMGT]i?B|bytes)\b(?!/)", None),
    # how closely two things agree (1e-7, 1.6·10⁻⁵), not a learning rate or an epsilon
    "tolerance": (
        rf"\b\d(?:\.\d+)?e-\d{{1,2}}\b|(?<![\w.·])(?:\d(?:\.\d+)?·)?10⁻[{_SUP}]+",
        r"agree|within|differ|off by|toleran|rtol|atol|rounding|relative|away from|below|at most",
    ),
    # an exact count too large to be a setting (57,989,328 bytes or parameters)
    "count": (r"\b\d{1,3}(?:,\d{3}){2,}\b(?![.,]\d)", None),
    "share": (r"\b\d+ of \d+\b(?! ?[%A-Za-z]*/s)", None),  # 11 of 28 (gradients ready)
    # a measured number said approximately: about 0.07, ~0.4
    "about": (r"(?:(?<=about )|(?<=~)|(?<=≈ ))\d+\.\d+\b(?!\.\d)(?! ?(?:[%×/]|x\b|[A-Zµ]))", None),
    # the step a printed line names, in an example output (a fenced block) only
    "step": (r"\bstep \d+\b", "```"),
}
_FIGURE = re.compile("|".join(f"(?P<{kind}>{pattern})" for kind, (pattern, _) in KINDS.items()))
# a table cell that is a measured number (its unit in the column's header): 1,638.3 or 0.876 or 413
_CELL = re.compile(r"^\s*(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d{3,})\s*$")


def normal(figure: str) -> str:
    """A figure as the check compares it: "1.61x" is "1.61×", "460–480" is "460-480"."""
    figure = figure.replace("\u00a0", " ").replace("\u202f", " ")
    figure = re.sub(r"(\d) ?[–-] ?(\d)", r"\1-\2", figure)
    return re.sub(r"(\d) ?[x×]$", r"\1×", figure)


def figures_in(text: str, measured: bool = False) -> list[tuple[int, str]]:
    """Every measured figure in `text`, as (line number, figure). Inline code, ```diff blocks and
    the diffs a chapter README embeds are skipped. A figure counts only in its kind's context,
    unless `measured` (the results' own text, where every figure is measured)."""
    found = []
    embedded = in_block = in_diff = False
    for line_no, line in enumerate(text.splitlines(), 1):
        if "<!-- diff:begin -->" in line:
            embedded = True
        if "<!-- diff:end -->" in line:
            embedded = False
            continue
        if line.lstrip().startswith("```"):
            in_block = not in_block
            in_diff = in_block and line.strip() == "```diff"
            continue
        if embedded or in_diff:
            continue
        plain = re.sub(r"`[^`]*`", lambda code: " " * len(code.group()), line)
        for m in _FIGURE.finditer(plain):
            context = KINDS[m.lastgroup][1]
            if measured or context is None:
                counts = True
            elif context == "```":
                counts = in_block
            else:
                counts = re.search(context, line, re.IGNORECASE) is not None
            if counts:
                found.append((line_no, normal(m.group())))
    return found


def text_files(repo: Path = REPO) -> list[Path]:
    files = {p for pattern in TEXTS for p in repo.glob(pattern)}
    return sorted(p for p in files if str(p.relative_to(repo)) not in NOT_TEXTS)


def load(path: Path = RESULTS_JSON) -> dict:
    return json.loads(path.read_text())


def number(figure: str) -> str:
    """The number of a figure: '1,638.3 MiB' -> '1,638.3' ('step 21' stays itself)."""
    found = re.match(r"[\d,.]+(?:-[\d,.]+)?", figure)
    return found.group().rstrip(".") if found else figure


def held(results: dict) -> set[str]:
    """Every figure in the entries' values, tables and printed lines; a table's number cell is
    held as '#1,638.3', and a text's figure matches it by its number."""
    figures = {normal(f) for f in results.get("not_measured", {})}
    for entry in results["entries"]:
        for field in ("value", "table", "output"):
            figures.update(f for _, f in figures_in(entry.get(field) or "", measured=True))
        for line in (entry.get("table") or "").splitlines():
            cells = line.strip().strip("|").split("|")
            figures.update("#" + c.strip() for c in cells if _CELL.match(c))
    return figures


def unheld(repo: Path = REPO, results: dict | None = None) -> list[str]:
    """'file:line: figure' for every measured figure a text quotes that the results do not hold."""
    allowed = held(results or load(repo / "bench" / "results" / "results.json"))
    return [
        f"{path.relative_to(repo)}:{line}: {figure}"
        for path in text_files(repo)
        for line, figure in figures_in(path.read_text())
        if figure not in allowed and "#" + number(figure) not in allowed
    ]


# a machine as the entries describe it: what it is, then what it was doing (its load)
_MACHINE = re.compile(r"^(.*?)(?:,? ?((?:no GPU, )?(?:load average|nothing else|other work).*))?$")


def render(results: dict) -> str:
    """bench/RESULTS.md: each entry's figure or table, the machine and its load, and the command.
    A table a benchmark renders itself (bench/results/*.md) is linked, not copied; the machines
    are listed once."""
    machines: dict[str, str] = {}  # what the machine is -> its short name
    torch = Counter(entry["torch"] for entry in results["entries"]).most_common(1)[0][0]
    for entry in results["entries"]:
        what = _MACHINE.match(entry["machine"]).group(1)
        machines.setdefault(what, f"M{len(machines) + 1}")
    out = [
        "# Results: every figure the course quotes",
        "",
        "Rendered by `python -m maintainer.results` from `bench/results/results.json`, which also",
        "holds each entry's description, notes and printed lines. Texts quote these figures as",
        "written; `tests/test_results.py` fails when a text quotes one that is not held here.",
        "",
        "The machines: " + "; ".join(f"{short}: {what}" for what, short in machines.items()) + ".",
        f"Every run used torch {torch} unless its line names another.",
    ]
    sections: dict[str, list[dict]] = {}
    for entry in results["entries"]:
        sections.setdefault(entry["section"], []).append(entry)
    for section, entries in sections.items():
        out += ["", f"## {section}"]
        for n, entry in enumerate(entries):
            value = f": {entry['value']}" if entry.get("value") else ""
            out += ["", f"**{entry['name']}**{value}", ""]
            pages = re.findall(r"bench/results/\w+\.md", entry.get("source") or "")
            if pages:
                out += [f"Table: [{p}]({p.removeprefix('bench/')})" for p in pages] + [""]
            elif entry.get("table"):
                # cells without the spaces around them: the same table, read the same
                rows = entry["table"].strip("\n").splitlines()
                out += ["|".join(cell.strip() for cell in row.split("|")) for row in rows] + [""]
            if entry.get("figure"):  # a committed figure drawn from this entry's figures
                path, caption = entry["figure"]
                out += [f"![{Path(path).name}](../{path})", "", f"*{caption}*", ""]
            run = [entry[key] for key in ("machine", "torch", "date", "command")]
            following = entries[n + 1] if n + 1 < len(entries) else {}
            if run == [following.get(key) for key in ("machine", "torch", "date", "command")]:
                continue  # the next entry comes from the same run: its line says it once for both
            what, load = _MACHINE.match(entry["machine"]).groups()
            where = machines[what] + (f", {load}" if load else "")
            if entry["torch"] != torch:
                where += f"; torch {entry['torch']}"
            out.append(f"{where}; {entry['date']}: `{entry['command']}`")
    out += ["", "## Figures texts may quote that are not measurements", ""]
    out += [f"- {figure}: {why}" for figure, why in results.get("not_measured", {}).items()]
    return "\n".join(out) + "\n"


def record(name: str, what: str, section: str, command: list[str], pattern: str | None) -> dict:
    """Run `command` and return its entry: its wall time, or `pattern`'s first group."""
    import torch

    machine = f"{os.cpu_count()} CPU cores ({platform.machine()}), {platform.system()}"
    if hasattr(os, "getloadavg"):
        machine += f", load average {os.getloadavg()[0]:.1f} at the start"
    start = time.perf_counter()
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = round(time.perf_counter() - start)
    printed = run.stdout + run.stderr
    if run.returncode != 0:
        sys.exit(
            f"error: the command exited {run.returncode}; nothing recorded:\n{printed[-2000:]}"
        )
    value = f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"
    if pattern:
        found = re.search(pattern, printed)
        if found is None:
            sys.exit(f"error: {pattern!r} is not in what the command printed; nothing recorded")
        value = found.group(1)
    return {
        "section": section,
        "name": name,
        "value": value,
        "what": what,
        "machine": machine,
        "torch": torch.__version__,
        "command": " ".join(command),
        "date": datetime.date.today().isoformat(),
        "output": printed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if bench/RESULTS.md is out of step")
    p.add_argument("--scan", action="store_true", help="list the figures no entry holds")
    sub = p.add_subparsers(dest="verb")
    r = sub.add_parser("record", help="run a command and store its entry")
    r.add_argument("name")
    r.add_argument("--what", required=True, help="what the figure is, in one sentence")
    r.add_argument("--section", default="Runs", help="the section of RESULTS.md")
    r.add_argument("--from", dest="pattern", help="a regex whose first group is the value")
    argv = sys.argv[1:]
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.verb == "record":
        if not command:
            sys.exit("error: give the command to run after --")
        entry = record(args.name, args.what, args.section, command, args.pattern)
        results = load()  # read again: another record may have finished while the command ran
        results["entries"] = [e for e in results["entries"] if e["name"] != entry["name"]]
        results["entries"].append(entry)
        RESULTS_JSON.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        print(f"recorded {entry['name']}: {entry['value']}")
    if args.scan:
        missing = unheld()
        print("\n".join(missing) or "every figure the texts quote is in the results")
        sys.exit(1 if missing else 0)
    rendered = render(load())
    if args.check:
        if not RESULTS_MD.exists() or RESULTS_MD.read_text() != rendered:
            sys.exit(
                f"error: bench/RESULTS.md is out of step with results.json; run `{REGENERATE}`"
            )
        return
    RESULTS_MD.write_text(rendered)


if __name__ == "__main__":
    main()
