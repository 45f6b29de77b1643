"""The pictures of one step (maintainer/step_pictures.py): the committed figures and their traces
exist, each trace holds what its figure shows, and the results file says what the traces say.

The traces are read as Perfetto reads them: gzipped Chrome trace JSON, one process per rank."""

from __future__ import annotations

import gzip
import json

import pytest

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
    printed = next(e for e in registry.load()["entries"] if e["name"].startswith("07 memory"))
    for preset in ("tiny", "small", "gpt2"):
        ddp, _, fsdp = rows[(preset, "parameters + gradients + AdamW state")]
        line = next(x for x in printed["output"].splitlines() if f"`{preset}`" in x)
        assert f"| {ddp} MB |" in line and line.rstrip().endswith(f"| {fsdp} MB |"), line
