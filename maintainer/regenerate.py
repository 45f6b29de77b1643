"""Regenerate everything derived from the chapter scripts, after an edit to one of them.

    python -m maintainer.regenerate          # rewrite whatever is stale
    python -m maintainer.regenerate --check  # write nothing; exit 1 if something is stale

In order: the published diffs and the diff excerpts of the chapter READMEs (publish_diffs.py), the
exercises (make_exercises.py), the README's reading-map totals (reading_map.py), bench/RESULTS.md
from the results file and the scan for figures the texts quote that it does not hold
(results.py), then the notebooks (build_notebooks.py): only the stale ones are run again, since
each takes a minute. A figure the scan finds needs a measurement, not a regeneration: it is named,
with the command that records one. An exercise that holds someone's work is never overwritten.
"""

from __future__ import annotations

import argparse
import sys

import nbformat

from layout import REPO
from maintainer import (
    REGENERATE,
    build_notebooks,
    make_exercises,
    publish_diffs,
    reading_map,
    results,
)


def figures(check: bool) -> int:
    """bench/RESULTS.md rendered from results.json, and every quoted figure held by it."""
    rendered = results.render(results.load())
    status = 0
    if results.RESULTS_MD.read_text() != rendered:
        if check:
            print(f"stale: bench/RESULTS.md (run {REGENERATE})", file=sys.stderr)
            status = 1
        else:
            results.RESULTS_MD.write_text(rendered)
            print("wrote bench/RESULTS.md")
    missing = results.unheld()
    for line in missing:
        print(f"not in the results: {line}", file=sys.stderr)
    if missing:
        print(
            "measure each, then `python -m maintainer.results record NAME --what ... -- COMMAND`",
            file=sys.stderr,
        )
        status = 1
    return status


def stale_notebooks() -> list[str]:
    """The chapters whose notebook.ipynb is not their notebook.py, run without an error."""
    stale = []
    for folder in sorted(REPO.glob("0*/notebook.py")):
        path = folder.with_suffix(".ipynb")
        wanted = build_notebooks.source(folder.parent)
        if not path.exists() or build_notebooks.problems(nbformat.read(path, 4), wanted):
            stale.append(folder.parent.name)
    return stale


def notebooks(check: bool) -> int:
    if check:
        return build_notebooks.main(["--check"])
    stale = stale_notebooks()
    if not stale:
        return 0
    return build_notebooks.main(stale)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = p.parse_args(argv)
    check = ["--check"] if args.check else []
    statuses = [
        publish_diffs.main(check),
        make_exercises.main(check),
        reading_map.main(check),
        figures(args.check),
        notebooks(args.check),
    ]
    failed = any(statuses)
    if args.check:
        print("something is stale: see above" if failed else "everything derived is current")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
