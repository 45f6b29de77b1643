"""The benchmark command (bench/benchmark.py) and the CPU-runnable parts of the GPU check.

One short benchmark run of the tiny model over every setup (a chapter launched one way);
the tests check the shape of what it writes (the table's columns, the JSON's keys and types, a row
per setup), never timings. That run launches every chapter, so the tests that read it are in the
slow stage (python -m pytest -q -m slow)."""

from __future__ import annotations

import itertools
import json

import pytest

from bench import benchmark, gpu_summary
from tools.launch import run_python

ROW_NUMBERS = [
    "tokens_per_sec",
    "tokens_per_sec_per_device",
    "step_ms",
    "bare_step_ms",
    "bare_ratio",
]


@pytest.fixture(scope="module")
def bench_run(data_dir, tmp_path_factory):
    """One benchmark run: tiny model, 4 steps (the first 2 are warm-up), every setup, one repeat."""
    tmp = tmp_path_factory.mktemp("bench")
    proc = run_python(
        [
            "-m",
            "bench.benchmark",
            "--preset",
            "tiny",
            "--iters",
            4,
            "--log-interval",
            2,
            "--batch-size",
            4,
            "--repeats",
            1,
            "--device",
            "cpu",
            "--data-dir",
            data_dir,
            "--work-dir",
            tmp / "work",
            "--results-dir",
            tmp / "results",
        ],
        timeout=600,
    )
    results = tmp / "results"
    return (
        proc,
        json.loads((results / "benchmark.json").read_text()),
        (results / "benchmark.md").read_text(),
        tmp,
    )


def expected_setups() -> list:
    args = benchmark.parse_args(["--batch-size", "4"])
    args.cuda_devices, args.dp_replicas = 0, 1  # what resolve_device finds on a CPU
    return [s for s in benchmark.setups(args) if s.key in args.setup_keys]


@pytest.mark.slow
def test_json_has_a_complete_row_per_setup(bench_run):
    proc, report, _, _ = bench_run
    settings = report["settings"]
    assert settings["preset"] == "tiny"
    assert settings["global_batch"] == 4
    assert settings["tokens_per_step"] == 4 * 32
    assert settings["warmup_steps_dropped"] == 2
    assert settings["device"] == "cpu"
    rows = {r["setup"]: r for r in report["setups"]}
    assert list(rows) == ["01", "02", "03", "04x1", "04x2", "05"]
    for setup in expected_setups():
        row = rows[setup.key]
        assert row["status"] == "ok", row
        for key in ROW_NUMBERS:
            assert isinstance(row[key], float), (key, row)
            assert row[key] > 0, (key, row)
        assert row["mfu"] is None  # no known peak FLOP/s for a CPU
        assert row["peak_mem_mb"] is None  # metrics.jsonl's max_mem_mb is CUDA's
        # the chapters ran unchanged: their own metrics and printed lines are the figures
        assert setup.script in row["command"]
        assert "probe" not in row["command"]
        assert isinstance(row["threads_per_rank"], int)
        assert row["threads_per_rank"] >= 1
        assert row["devices"] == row["processes"] == setup.ranks
        # the same global batch everywhere
        assert row["micro_batch"] * row["grad_accum"] * row["devices"] == 4
    if rows["04x2"]["status"] == "ok":
        # the same threads per rank on one rank and on two: like with like
        assert rows["04x1"]["threads_per_rank"] == rows["04x2"]["threads_per_rank"]
        assert isinstance(report["scaling"]["04x2"]["efficiency"], float)
    assert "| 01 one device |" in proc.stdout  # the table is printed too


@pytest.mark.slow
def test_markdown_table_is_well_formed(bench_run):
    _, report, table, _ = bench_run
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| Setup |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    assert columns == benchmark.COLUMNS
    assert set(lines[header + 1].strip("|").split("|")) <= {"---", "---:"}
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[header + 2 :]))
    assert len(rows) == len(report["setups"])
    for line, row in zip(rows, report["setups"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(columns)
        assert cells[0] == row["label"]
        if row["status"] == "ok":
            assert cells[5] == "n/a"  # MFU on a CPU
            assert float(cells[2].replace(",", "")) > 0
        else:
            assert "not run" in cells[1] or row["status"] in cells[1]


def test_bad_benchmark_flags_are_refused():
    with pytest.raises(SystemExit) as exit_info:
        benchmark.parse_args(["--setups", "01,09"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        # nothing left after the warm-up
        benchmark.parse_args(["--iters", "5", "--log-interval", "5"])


@pytest.mark.slow
def test_gpu_summary_names_a_step_that_wrote_nothing(bench_run, tmp_path):
    _, report, _, _ = bench_run
    (tmp_path / "eager").mkdir()
    (tmp_path / "eager" / "benchmark.json").write_text(json.dumps(report))
    text = gpu_summary.summary(tmp_path)
    assert "| 01 one device (eager) |" in text
    # a step that wrote nothing is named, not skipped
    assert "| compile | | | | | | no results" in text
    assert "compile probe: no results" in text
