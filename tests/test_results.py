"""One number, one source: bench/RESULTS.md is rendered from bench/results/results.json, and every
measured figure the texts quote (diffs, inline code and results.json's not_measured skipped) is
one the results hold."""

from __future__ import annotations

from layout import REPO
from maintainer import REGENERATE, results


def test_results_md_is_rendered_from_the_json():
    rendered = results.render(results.load())
    assert (REPO / "bench" / "RESULTS.md").read_text() == rendered, (
        f"bench/RESULTS.md is out of step with bench/results/results.json: run `{REGENERATE}`"
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
        "`python -m maintainer.results record`):\n" + "\n".join(missing)
    )


def test_the_checker_finds_a_planted_figure(tmp_path):
    """A text that quotes a figure the results do not hold fails; with the figure in the
    results, it passes."""
    (tmp_path / "README.md").write_text(
        "The run took 4 min 4 s at 1,940 tokens/s,\n"
        "two ranks gave 1.23x and 71% scaling efficiency.\n"
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
            "1.61× and 1.59x; loss 10.7934; 29 MB and 1.2 GiB; 400 steps of 1,024 tokens; lr 6e-4; "
            "8 x 128"
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


def test_agreements_counts_ranges_and_example_steps_are_figures():
    """The kinds a reader cannot tell from a measurement: each is found, in its context only."""
    text = (
        "With four it agrees to about 1e-7, and the losses stay within 1.6·10⁻⁵ (relative).\n"
        "lr 6e-4 and eps 1e-8 are settings.\n"
        "Parameters: 28,994,560 bytes each, 57,989,328 in all; a float is 4 bytes.\n"
        "The first bucket launches with 11 of 28 gradients ready; they differ by about 0.4.\n"
        "nccl-tests report 460–480 GB/s on 8 GPUs, about 0.86 GFLOP per token.\n"
        "The run stops at step 11 when asked.\n"
        "```text\n"
        "stopped by SIGTERM at step 21: checkpoint saved\n"
        "```\n"
    )
    found = [f for _, f in results.figures_in(text)]
    assert found == [
        "1e-7",
        "1.6·10⁻⁵",
        "28,994,560 bytes",
        "57,989,328",
        "4 bytes",
        "11 of 28",
        "0.4",
        "460-480 GB/s",
        "step 21",
    ]
    # the results' own text: every figure in it is measured, wherever it stands
    assert results.figures_in("step 11; lr 6e-4", measured=True) == [(1, "step 11"), (1, "6e-4")]
