"""Chapter 08 against chapter 05 as the papers compare them: bench/slow_link.py's settings and
summary, and its arms run for a few steps (the slow stage)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import slow_link
from layout import REPO


def test_every_evaluation_comes_just_after_a_sync_and_the_schedule_spans_the_run():
    args = slow_link.run_flags(300, 10, 1337, 8)
    value = dict(zip(args[::2], args[1::2]))
    assert int(value["--eval-interval"]) % 10 == 0 and int(value["--eval-interval"]) >= 10
    assert value["--lr-decay-iters"] == "300" and value["--warmup-iters"] == "30"
    assert value["--seed"] == "1337" and value["--batch-size"] == "8"


def test_each_arm_against_ddp_is_the_median_and_range_over_the_seeds():
    seeds = {
        1: {"ddp": {"final": 5.0}, "diloco2": {"final": 5.5}},
        2: {"ddp": {"final": 4.0}, "diloco2": {"final": 4.0}},
        3: {"ddp": {"final": 5.0}, "diloco2": {"final": 5.0}},
    }
    summary = slow_link.against_ddp(seeds)
    assert summary["diloco2"]["val_loss"] == {"median": 5.0, "min": 4.0, "max": 5.5}
    assert summary["diloco2"]["ratio_to_ddp"] == {"median": 1.0, "min": 1.0, "max": 1.1}
    assert summary["ddp"]["ratio_to_ddp"]["median"] == 1.0


@pytest.mark.slow
def test_the_quick_plan_runs_every_arm_and_writes_the_losses(data_dir, tmp_path):
    """Every arm of the measurement for a few steps (H = 2), for real: the outer lr chosen, the
    arms at equal tokens, the warm start from ddp's weights."""
    out = tmp_path / "arms.json"
    command = [sys.executable, "-m", "bench.slow_link", "--quick", "--data-dir", data_dir]
    command += ["--work-dir", tmp_path / "w", "--out", out]
    subprocess.run([str(word) for word in command], cwd=REPO, check=True, timeout=1500)
    measured = json.loads(out.read_text())
    assert measured["outer_lr"]["chosen"] in slow_link.OUTER_LRS
    assert sorted(measured["outer_lr"]["final"]) == ["0.4", "0.6", "0.8"]
    (h,) = measured["by_h"].values()
    (runs,) = h["seeds"].values()
    assert sorted(runs) == ["ddp", "diloco1", "diloco2"]
    for run in runs.values():  # every arm evaluated at the same steps: equal tokens
        assert sorted(run["val_loss"]) == sorted(runs["ddp"]["val_loss"])
    assert h["warm2"]["from_step"] == 2
    assert "--init-from" in h["warm2"]["command"]
