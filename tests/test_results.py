"""One number, one source: the texts quote only figures that bench/results/results.json holds.

bench/RESULTS.md is rendered from results.json (as publish_diffs renders the diffs), and every
measured
figure in the main path, the deep dives and bench/README.md (a time, a rate, a speed-up, an
efficiency, a loss, a memory size) must be one the results hold. The texts are read when the test
runs, so a rewritten text is checked as it is. Skipped: the embedded diffs, ```diff blocks, inline
code (flags, settings, error messages) and the short list of figures that are not measurements,
each with its reason (maintainer/results.py's NOT_MEASURED, also printed at the end of RESULTS.md).
"""

from __future__ import annotations

import sys

from tools.launch import REPO

sys.path.insert(0, str(REPO / "maintainer"))

import results


def test_results_md_is_rendered_from_the_json():
    rendered = results.render(results.load())
    assert (REPO / "bench" / "RESULTS.md").read_text() == rendered, (
        "bench/RESULTS.md is out of step with bench/results/results.json: run `python maintainer/results.py`"
    )


def test_every_entry_says_where_when_and_how_it_was_measured():
    for entry in results.load()["entries"]:
        missing = [
            k
            for k in ("section", "name", "what", "machine", "torch", "command", "date")
            if not entry.get(k)
        ]
        assert not missing, f"entry {entry.get('name')!r} lacks {missing}"
        assert entry.get("value") or entry.get("table") or entry.get("output"), (
            f"entry {entry['name']!r} holds no figure"
        )
    names = [e["name"] for e in results.load()["entries"]]
    assert len(names) == len(set(names)), "two entries share a name"


def test_every_figure_the_texts_quote_is_in_the_results():
    missing = results.unheld()
    assert not missing, (
        f"{len(missing)} measured figure(s) in the texts are not in bench/results/results.json "
        "(quote a figure from bench/RESULTS.md, or record the run that gave it with "
        "`python maintainer/results.py record`):\n" + "\n".join(missing)
    )


def test_the_checker_finds_a_planted_figure(tmp_path):
    """A text quoting a figure the results do not hold fails; the same figure in the results passes."""
    (tmp_path / "README.md").write_text(
        "The run took 4 min 4 s at 1,940 tokens/s,\ntwo ranks gave 1.23x and 71% scaling efficiency.\n"
        "<!-- diff:begin -->\n+ took 99 s\n<!-- diff:end -->\n```diff\n+ 3.1415 loss\n```\n"
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "deep.md").write_text("Peak memory 87 MB, val loss 5.4321.\n")
    entry = {"value": "4 min 4 s"}
    held = {"entries": [entry, {"value": "1,940 tokens/s"}, {"value": "87 MB"}]}
    assert results.unheld(tmp_path, held) == [
        "README.md:2: 1.23×",
        "README.md:2: 71%",
        "docs/deep.md:1: 5.4321",
    ]
    held["entries"].append({"table": "| 1.23× | 71% |", "output": "step 6: val loss 5.4321"})
    assert results.unheld(tmp_path, held) == []


def test_figures_are_recognised_and_ordinary_numbers_are_not():
    found = [
        f
        for _, f in results.figures_in(
            "took 9 s, 32 seconds and 1 min 22 s; 2.0 ms a step; 2,369 tokens/s; busbw 0.876 GB/s; "
            "1.61× and 1.59x; loss 10.7934; 29 MB and 1.2 GiB; 400 steps of 1,024 tokens; lr 6e-4; 8 x 128"
        )
    ]
    assert found == [
        "9 s",
        "32 seconds",
        "1 min 22 s",
        "2.0 ms",
        "2,369 tokens/s",
        "0.876 GB/s",
        "1.61×",
        "1.59×",
        "10.7934",
        "29 MB",
        "1.2 GiB",
    ]
    # A percentage counts when it is an efficiency, an MFU or a share, not as any number.
    assert results.figures_in("80% scaling efficiency") == [(1, "80%")]
    assert results.figures_in("a 50% discount") == []
