"""Chapter 05's step against the link between its machines: bench/scaling_model.py's prediction,
bench/link_rates.py's measurement across two machines of machines.sh (the slow stage; it needs
root).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from machines import namespaces, require_machines

from bench import scaling_model
from layout import REPO


def test_the_tiny_models_step_is_its_compute_and_the_whole_all_reduce():
    """Its gradients are one DDP bucket, so nothing hides behind backward: on 2 ranks the ring
    sends all of their bytes, 2(W-1)/W = 1 times, at the bus bandwidth."""
    grad_bytes = scaling_model.gradient_layout("tiny")["grad_bytes"]
    step = scaling_model.predict(0.2, "tiny", busbw=12.5e6, world=2)
    assert step["step_s"] == pytest.approx(0.2 + grad_bytes / 12.5e6)
    assert step["exposed_s"] == pytest.approx(step["allreduce_s"])
    # four ranks: each link carries 2 x 3/4 of the bytes
    four = scaling_model.predict(0.2, "tiny", busbw=12.5e6, world=4)
    assert four["allreduce_s"] == pytest.approx(1.5 * grad_bytes / 12.5e6)


def test_the_predictor_takes_the_bandwidth_on_its_command_line():
    printed = subprocess.run(
        [sys.executable, "-m", "bench.scaling_model", "--busbw", "0.0125", "--compute-ms", "200"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exposed = 1000 * scaling_model.gradient_layout("tiny")["grad_bytes"] / 12.5e6
    assert printed.strip() == (
        f"predicted step {200 + exposed:.1f} ms: compute 200.0 ms + all-reduce not hidden "
        f"{exposed:.1f} ms (tiny, 2 ranks, busbw 0.0125 GB/s)"
    )


@pytest.mark.slow
def test_link_rates_measures_across_machines_and_removes_them(tmp_path):
    require_machines()
    # bench/link_rates.py's sets are named lr and 6 hex digits
    before = [name for name in namespaces() if name.startswith("lr")]
    out = tmp_path / "link_rates.json"
    command = [sys.executable, "-m", "bench.link_rates", "--rates", "100mbit", "--iters", "10"]
    command += ["--preflight-iters", "2", "--bare-iters", "10", "--out", out]
    command += ["--work-dir", tmp_path / "work"]
    subprocess.run(command, cwd=REPO, check=True, timeout=900)
    assert [name for name in namespaces() if name.startswith("lr")] == before  # its machines went
    (row,) = json.loads(out.read_text())["rates"]
    # the rate limit holds: at most 110 Mbit/s at every size
    for size in row["preflight"]["rows"]:
        assert size["busbw_gbs"] <= 0.110 / 8, size
    assert len(row["run"]["interval_step_ms"]) == 2
    assert row["predicted_ms"]["step_s"] > row["bare"]["step_ms"]
