"""Chapter 08 against chapter 05 over a slow link: bench/slow_link.py's arithmetic on a run's
metrics and printed lines, its measurement across two machines of machines.sh (the slow stage; it
needs root).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from machines import namespaces, require_machines

from bench import slow_link
from layout import REPO

# metrics.jsonl as a chapter writes it: a log step every 10 steps of 512 tokens, an evaluation
METRICS = [
    {"iter": 10, "loss": 10.5, "tokens_seen": 5120, "dt_ms": 300.0},
    {"iter": 20, "loss": 9.5, "tokens_seen": 10240, "dt_ms": 100.0},
    {"iter": 20, "val_loss": 9.4},
    {"iter": 30, "loss": 8.5, "tokens_seen": 15360, "dt_ms": 150.0},
]


def test_the_clock_adds_up_the_log_intervals_and_leaves_out_evaluations():
    points = slow_link.clock(METRICS)
    assert [p["iter"] for p in points] == [10, 20, 30]
    assert [p["t_s"] for p in points] == pytest.approx([3.0, 4.0, 5.5])
    assert [p["loss"] for p in points] == [10.5, 9.5, 8.5]


def test_tokens_per_second_leaves_out_the_warm_up_steps():
    # steps 11 to 30: 10,240 tokens in 1.0 s + 1.5 s
    assert slow_link.tokens_per_sec(METRICS, warmup_steps=10) == pytest.approx(10240 / 2.5)
    assert slow_link.tokens_per_sec(METRICS, warmup_steps=0) == pytest.approx(15360 / 5.5)
    with pytest.raises(SystemExit, match="train longer"):
        slow_link.tokens_per_sec(METRICS, warmup_steps=30)


def test_the_bytes_are_chapter_08s_own_count():
    printed = (
        "[node 0 rank 0 local 0] step 60: val loss 6.9867, checkpoint saved to out/ckpt.pt\n"
        "[node 0 rank 0 local 0] sent 13,089,792 bytes of pseudo-gradients in 60 steps: "
        "218,163 bytes per step\n"
    )
    assert slow_link.pseudo_gradient_bytes(printed) == {
        "bytes": 13089792,
        "steps": 60,
        "bytes_per_step": 218163,
    }
    with pytest.raises(SystemExit, match="printed no"):
        slow_link.pseudo_gradient_bytes("parameters identical on all 2 rank(s): yes\n")


@pytest.mark.slow
def test_slow_link_measures_across_machines_and_removes_them(tmp_path):
    require_machines()
    # bench/slow_link.py's sets are named sl and 6 hex digits
    before = [name for name in namespaces() if name.startswith("sl")]
    out = tmp_path / "slow_link.json"
    command = [sys.executable, "-m", "bench.slow_link", "--rates", "100mbit", "--presets", "tiny"]
    command += ["--iters", "60", "--sync-every", "10", "--out", out, "--work-dir", tmp_path / "w"]
    subprocess.run(command, cwd=REPO, check=True, timeout=1200)
    assert [name for name in namespaces() if name.startswith("sl")] == before  # its machines went
    measured = json.loads(out.read_text())
    assert measured["complete"]
    (row,) = measured["rates"]
    ddp, diloco = row["runs"]
    # DDP sends every gradient every step; DiLoCo, counted by chapter 08, a tenth of it
    assert diloco["sent"]["steps"] == 60
    assert 10 * diloco["sent"]["bytes"] == 60 * ddp["sent"]["bytes_per_step"]
    assert len(measured["timeline"]["diloco"]["step_ms"]) == 10
