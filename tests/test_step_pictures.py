"""The pictures of one step (maintainer/step_pictures.py): the committed figures and their traces
exist, drawn for the site's column, each trace holds what its figure shows, the results file says
what the traces say, and the diagrams of the same steps on a GPU keep the order of the trace.

The traces are read as Perfetto reads them: gzipped Chrome trace JSON, one process per rank."""

from __future__ import annotations

import gzip
import json

import pytest

from common.chapters import CHAPTERS
from maintainer import results as registry
from maintainer import step_pictures as pictures
from tools.launch import REPO

FIGURES = REPO / "docs" / "figures"
BLOCKS = 4  # the small model's transformer blocks


def entry(key: str) -> dict:
    name = pictures.ENTRY_NAMES[key]
    found = [e for e in registry.load()["entries"] if e["name"] == name]
    assert found, (
        f"bench/results/results.json has no entry {name!r}: run python -m maintainer.step_pictures"
    )
    return found[0]


@pytest.fixture(scope="module")
def traces() -> dict:
    return {
        mode: pictures.read_trace(FIGURES / name) for mode, name in pictures.TRACE_FILES.items()
    }


def test_the_figures_and_their_traces_are_committed():
    for name in pictures.FIGURES.values():
        data = (FIGURES / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, f"{name} is not a figure"
        # drawn for the site's column (about 650 px) and opened whole in a window of 1280 x 900
        width = int.from_bytes(data[16:20], "big")
        height = int.from_bytes(data[20:24], "big")
        assert 1000 <= width <= 1280 and height <= 900, f"{name} is {width} x {height} px"
    for name in pictures.TRACE_FILES.values():
        path = FIGURES / name
        assert path.stat().st_size < 2_000_000, f"{name} is too large to keep in the repository"
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        complete = [e for e in events if e.get("ph") == "X"]
        assert complete and all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in complete)
        ranks = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert ranks == {"rank 0", "rank 1"}, f"{name}: one process per rank, named"
    captions = (FIGURES / "CAPTIONS.md").read_text()
    for name in [*pictures.FIGURES.values(), *pictures.TRACE_FILES.values()]:
        assert f"({name})" in captions, f"docs/figures/CAPTIONS.md does not show {name}"
    assert "not a GPU's" in captions
    for key in ("ddp_gpu", "fsdp_gpu"):
        shown = captions.split(f"({pictures.FIGURES[key]})", 1)[1]
        assert shown.lstrip().startswith("*A diagram, not a measurement"), key


def test_the_loss_is_inside_each_forward_and_the_captions_quote_the_trace(traces):
    captions = (FIGURES / "CAPTIONS.md").read_text()
    for key, facts in (
        ("ddp", pictures.ddp_facts(traces["ddp"])),
        ("fsdp", pictures.fsdp_facts(traces["fsdp"])),
    ):
        for r in facts["ranks"]:
            assert 0 < r["loss_in_forward_ms"] < r["forward_ms"], (key, r)
        first = facts["ranks"][0]
        caption = captions.split(f"({pictures.FIGURES[key]})", 1)[1].split("\n\n")[1]
        for figure in ("loss_in_forward_ms", "forward_ms", "backward_ms"):
            assert pictures.ms_text(first[figure]) in caption, f"{key}'s caption lacks {figure}"


def test_the_gpu_diagrams_keep_the_order_of_the_traced_steps(traces):
    """The diagrams are drawn, not measured, from the traced steps' structure: their buckets and
    units, in the order the traces show them."""
    compute = pictures.COMPUTE
    communication = pictures.COMMUNICATION

    def pieces(streams, stream: int, colour: str | None = None) -> list[tuple[float, float, str]]:
        found = []
        for on, start, length, text, drawn in streams.pieces:
            if on == stream and colour in (None, drawn):
                found.append((start, start + length, text))
        return found

    def start_of(found: list, text: str) -> float:
        return next(start for start, _, name in found if name == text)

    buckets = pictures.ddp_facts(traces["ddp"])["ranks"][0]["buckets"]
    ddp = pictures.ddp_streams(buckets, BLOCKS)
    sent = pieces(ddp, communication)
    assert [text for _, _, text in sent] == [str(b) for b in range(1, buckets + 1)]
    synced = start_of(pieces(ddp, compute), "forward 2")
    assert all(start > synced for start, _, _ in sent), "no_sync(): micro-step 1 sends nothing"
    optimizer = start_of(pieces(ddp, compute), "optimizer")
    assert all(end <= optimizer for _, end, _ in sent), "every bucket averaged before the step"
    parts = pictures.hidden_and_exposed(ddp)
    assert any(hidden for *_, hidden in parts) and not all(hidden for *_, hidden in parts)

    units = pictures.fsdp_facts(traces["fsdp"])["ranks"][0]["units"]
    blocks = [unit for unit in units if unit != "root"]
    fsdp = pictures.fsdp_streams(blocks)
    computed = pieces(fsdp, compute)
    gathers = pieces(fsdp, communication, pictures.COLOURS["all_gather"])
    scatters = pieces(fsdp, communication, pictures.COLOURS["reduce-scatter"])
    for unit in blocks:
        runs = [(start, end) for start, end, text in computed if text == unit]
        gathered = [end for _, end, text in gathers if text == unit]
        scattered = [start for start, _, text in scatters if text == unit]
        assert len(runs) == 2 and len(gathered) == 2 and len(scattered) == 1, unit
        forward, backward = runs
        assert gathered[0] <= forward[0], f"{unit}'s forward before its all-gather"
        assert gathered[1] <= backward[0], f"{unit}'s backward before its all-gather"
        assert scattered[0] >= backward[1], f"{unit}'s reduce-scatter before its backward"
    root = [text for _, _, text in gathers].count("root")
    assert root == 1, "the root unit is gathered once"
    assert any(hidden for *_, hidden in pictures.hidden_and_exposed(fsdp))


def test_the_memory_bars_read_back_from_the_results_as_they_were_recorded():
    """The bars are drawn from the results file: each kind's figure as recorded (the totals of
    the recorded figures, rounded, may differ from the recorded totals in the last digit)."""
    table = entry("memory")["table"]
    again = pictures.memory_table(pictures.memory_rows_from_table(table))
    total = "parameters + gradients + AdamW state"
    kinds = [line for line in table.splitlines() if total not in line]
    assert [line for line in again.splitlines() if total not in line] == kinds


def test_the_ddp_trace_overlaps_backward_with_the_buckets_all_reduces(traces):
    for rank, facts in enumerate(pictures.ddp_facts(traces["ddp"])["ranks"]):
        assert facts["buckets"] >= 3, f"rank {rank}: the figure shows several buckets"
        # no_sync(): the first micro-step's backward sends nothing
        assert facts["all_reduces_in_no_sync_micro_step"] == 0
        # some buckets are sent while backward still computes the earlier layers' gradients
        assert facts["started_before_last_gradient"] >= 1
        assert facts["all_reduce_ms_while_computing"] > 0
        # every bucket is averaged before the optimizer steps
        assert facts["all_done_before_optimizer_step"]


def test_the_fsdp_trace_gathers_and_scatters_every_block(traces):
    block = ["all-gather for forward", "all-gather for backward", "reduce-scatter"]
    for facts in pictures.fsdp_facts(traces["fsdp"])["ranks"]:
        units = facts["units"]
        assert {f"h.{i}" for i in range(BLOCKS)} | {"root"} == set(units)
        for i in range(BLOCKS):
            assert units[f"h.{i}"] == block, f"block h.{i}: {units[f'h.{i}']}"
        # the root unit stays whole from forward to backward: gathered once
        assert units["root"] == ["all-gather for forward", "reduce-scatter"]


def test_the_results_say_what_the_traces_say(traces):
    assert entry("ddp")["table"] == pictures.ddp_table(pictures.ddp_facts(traces["ddp"]))
    assert entry("fsdp")["table"] == pictures.fsdp_table(pictures.fsdp_facts(traces["fsdp"]))
    for key in ("ddp", "fsdp"):
        assert entry(key)["source"] == f"docs/figures/{pictures.TRACE_FILES[key]}"


def test_the_memory_bars_agree_with_the_shapes_and_with_chapter_07():
    table = entry("memory")["table"]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[(cells[0].split()[0].strip("`"), cells[1])] = cells[2:]
    # GPT-2 is counted: its rows are the shapes' arithmetic
    counted = pictures.root_bytes_counted("gpt2") / 1e6
    assert rows[("gpt2", "root unit held whole from forward to backward")][2] == f"{counted:,.2f}"
    # tiny and small are measured: the root unit held whole is exactly the root's parameters
    for preset in ("tiny", "small"):
        root = pictures.root_bytes_counted(preset) / 1e6
        assert rows[(preset, "root unit held whole from forward to backward")][2] == f"{root:,.2f}"
    # the totals are what chapter 07 itself printed (bench/memory_per_rank.py's entry)
    fsdp = next(number for number, folder in CHAPTERS.items() if folder.endswith("_fsdp"))
    name = f"{fsdp:02d} memory per rank"
    printed = next(e for e in registry.load()["entries"] if e["name"].startswith(name))
    for preset in ("tiny", "small", "gpt2"):
        ddp, _, fsdp = rows[(preset, "parameters + gradients + AdamW state")]
        line = next(x for x in printed["output"].splitlines() if f"`{preset}`" in x)
        assert f"| {ddp} MB |" in line and line.rstrip().endswith(f"| {fsdp} MB |"), line
