"""04_ddp/ddp_by_hand.py against DistributedDataParallel and one process: one torchrun of 2 ranks
runs tests/workers/ddp_by_hand_worker.py (DDP, the naive and bucketed wrappers, three broken ones;
K = 1 and K = 3 micro-steps) and the tests assert on the distances it writes."""

from __future__ import annotations

import json

import pytest

from tools.launch import run_torchrun

# long end-to-end runs: the slow stage's (python -m pytest -m slow; CI runs it)
pytestmark = pytest.mark.slow

ATOL = 1e-6  # float32, dropout 0: only floating-point reassociation separates the gradients
WRONG = 1e-3  # a broken variant must be off by far more than rounding
KS = (1, 3)
CORRECT = ("naive", "bucketed", "bucketed_one_bucket")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ddp_by_hand")
    run_torchrun("tests.workers.ddp_by_hand_worker", 2, [out], timeout=240, extra=["-m"])
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("impl", ["ddp", *CORRECT])
def test_wrapper_matches_ddp_and_one_process(results, impl, K):
    r = results[f"{impl}/K={K}"]
    # the broadcast: ranks started different and hold rank 0's parameters after wrapping
    assert r["init_before_wrap"] > 1e-3
    assert r["init_across_ranks"] == 0.0
    # before every optimizer step: the same gradient on every rank, and it is the gradient of one
    # process over the whole global batch
    assert r["grad_across_ranks"] == 0.0, r
    assert r["grad_vs_single"] < ATOL, r
    # after several AdamW steps: the parameters DDP reaches
    assert r["params_vs_ddp"] < ATOL, r


@pytest.mark.parametrize("K", KS)
def test_communication_counts(results, K):
    """no_sync() defers it all to the last micro-step: one all-reduce per parameter or bucket."""
    naive, bucketed, one = (results[f"{i}/K={K}"] for i in CORRECT)
    assert naive["comm_calls_per_step"] == naive["n_params"]
    assert bucketed["n_buckets"] >= 3, "the test's small bucket size should give several buckets"
    assert bucketed["comm_calls_per_step"] == bucketed["n_buckets"]
    assert one["n_buckets"] == 1
    assert one["comm_calls_per_step"] == 1


@pytest.mark.parametrize("K", KS)
def test_buckets_launch_during_backward_in_order(results, K):
    """Each bucket's all-reduce starts once its gradients are final: overlap with backward."""
    r = results[f"bucketed/K={K}"]
    ready = r["grads_ready_at_each_launch"]
    assert len(ready) == r["n_buckets"]
    assert ready == sorted(ready)
    assert ready[0] < r["n_params"] // 2, ready
    assert ready[-1] == r["n_params"]


# register_hook fires before .grad is accumulated: every rank averages the stale .grad alike.
# Averaging the (already equal) parameters: each rank steps with its own gradient; copies drift.
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("impl", ["broken_stale_grad_hook", "broken_reduce_parameter"])
def test_a_wrapper_that_reduces_the_wrong_tensor_is_caught(results, impl, K):
    r = results[f"{impl}/K={K}"]
    if impl == "broken_reduce_parameter":
        assert r["grad_across_ranks"] > WRONG, r
    assert r["grad_vs_single"] > WRONG, r
    assert r["params_vs_ddp"] > WRONG, r


def test_incoming_grad_hook_is_caught_only_with_accumulation(results):
    """Reducing the incoming gradient is right at K = 1, wrong at K = 3: why the tests run both."""
    ok = results["broken_incoming_grad_hook/K=1"]
    assert ok["grad_vs_single"] < ATOL, ok
    assert ok["params_vs_ddp"] < ATOL, ok
    bad = results["broken_incoming_grad_hook/K=3"]
    assert bad["grad_across_ranks"] > WRONG, bad  # the first two micro-steps stayed local
    assert bad["grad_vs_single"] > WRONG, bad
    assert bad["params_vs_ddp"] > WRONG, bad
