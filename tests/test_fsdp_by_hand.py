"""07_fsdp/fsdp_by_hand.py against one process on the whole batch and against FSDP2: torchrun of
2 and of 3 ranks runs tests/workers/fsdp_by_hand_worker.py (the tiny GPT, its tied matrix in the
root, and an MLP whose two layers share a gain; SGD and AdamW; float32, float64 as the rounding
control, bfloat16 compute, two forwards before one backward)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import outputs_of, start

from common.model import model_config
from tools.launch import torchrun_command

# long end-to-end runs: the slow stage's (python -m pytest -m slow; CI runs it)
pytestmark = pytest.mark.slow

WORKER = "tests.workers.fsdp_by_hand_worker"  # a module: `torchrun -m` from the repository root
WORLDS = (2, 3)
STEPS = 3
# float32: the ranks' average of averages is the one process's sum in another order
GRAD_ATOL = 1e-6
LOSS_ATOL = 1e-5  # the GPT's loss is about 6.3, the MLP's about 1: float32 keeps 7 digits
# after AdamW steps: its division lifts rounding in a tiny gradient (as in test_zero.py)
PARAM_ATOL = 2e-5
FLOAT64_ATOL = 1e-12  # the control: the same runs in float64 differ by rounding alone
FLOAT32_CASES = [
    "gpt/sgd/float32",
    "gpt/adamw/float32",
    "mlp/sgd/float32",
    "mlp/adamw/float32",
    "mlp/adamw/float32/two_forwards",  # two forwards, then one backward of their mean
]
LOW_PRECISION = ["gpt/adamw/bfloat16", "mlp/adamw/bfloat16"]
WITH_FSDP2 = ["gpt/adamw/float32", "gpt/adamw/float64", "gpt/adamw/bfloat16", "mlp/adamw/float32"]
ALL_CASES = [*FLOAT32_CASES, "gpt/adamw/float64", *LOW_PRECISION]


def gpt_owned_numels() -> list[int]:
    """The root owns the tied matrix, the positions and ln_f; each block the rest of itself."""
    c = model_config("tiny", vocab_size=512)
    C = c.n_embd
    block = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    root = c.vocab_size * C + c.block_size * C + 2 * C
    return [root, *[block] * c.n_layer]


# the MLP: the shared gain (9) is the root's; layer1 (7 -> 9), layer2 (9 -> 9), the head (9 -> 3)
MLP_OWNED_NUMELS = [9, 7 * 9 + 9, 9 * 9 + 9, 9 * 3 + 3]


def owned_numels(case: str) -> list[int]:
    return gpt_owned_numels() if case.startswith("gpt") else MLP_OWNED_NUMELS


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    root = tmp_path_factory.mktemp("fsdp_by_hand")
    procs = [
        start(torchrun_command(WORKER, world, [root / f"w{world}"], extra=["-m"]))
        for world in WORLDS
    ]
    for proc, output in zip(procs, outputs_of(procs, timeout=300)):
        assert proc.returncode == 0, output
    return {w: json.loads((root / f"w{w}" / "results.json").read_text()) for w in WORLDS}


@pytest.mark.parametrize("case", FLOAT32_CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_float32_matches_one_process_step_for_step(results, world, case):
    r = results[world][case]
    assert r["loss_vs_single"] < LOSS_ATOL, r
    assert r["grad_vs_single"] < GRAD_ATOL, r
    assert r["params_vs_single"] < PARAM_ATOL, r


@pytest.mark.parametrize("world", WORLDS)
def test_float64_control_differs_by_rounding_alone(results, world):
    r = results[world]["gpt/adamw/float64"]
    assert r["loss_vs_single"] < FLOAT64_ATOL, r
    assert r["grad_vs_single"] < FLOAT64_ATOL, r
    assert r["params_vs_single"] < FLOAT64_ATOL, r


@pytest.mark.parametrize("case", WITH_FSDP2)
@pytest.mark.parametrize("world", WORLDS)
def test_matches_fsdp2(results, world, case):
    """fully_shard on the same units (the MLP's: head and root), MixedPrecisionPolicy for bf16."""
    r = results[world][case]
    atol = FLOAT64_ATOL if case.endswith("float64") else PARAM_ATOL
    assert r["loss_vs_fsdp2"] < LOSS_ATOL, r
    assert r["params_vs_fsdp2"] < atol, r


@pytest.mark.parametrize("case", LOW_PRECISION)
@pytest.mark.parametrize("world", WORLDS)
def test_bfloat16_compute_within_its_precision(results, world, case):
    """Within a few percent of float32 (8 bits kept), and far from equal: the weights were cast."""
    r = results[world][case]
    full_precision = results[world][case.replace("bfloat16", "float32")]
    assert r["grad_vs_single"] < 0.05 * r["grad_scale"], r
    assert r["grad_vs_single"] > 100 * full_precision["grad_vs_single"], r
    assert r["loss_vs_single"] < 1e-2, r


@pytest.mark.parametrize("case", ALL_CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_a_parameter_belongs_to_the_innermost_unit_around_all_its_places(results, world, case):
    """The GPT's tied matrix and the MLP's shared gain in the root; rank 0's model everywhere."""
    r = results[world][case]
    assert r["init_vs_single"] == 0.0  # each rank built its own: the broadcast gave it rank 0's
    assert r["owned_numels"] == owned_numels(case)
    assert sum(r["owned_numels"]) == r["n_params"]


@pytest.mark.parametrize("case", ALL_CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_holds_one_wth(results, world, case):
    """Each unit padded to a multiple of W, one slice of each per rank; AdamW: two moments and a
    step count per shard, SGD's momentum one buffer."""
    r = results[world][case]
    padded = [math.ceil(n / world) * world for n in owned_numels(case)]
    assert r["padded_numels"] == padded
    assert r["shard_numel"] == [sum(padded) // world] * world
    master = 8 if "float64" in case else 4
    shard_bytes = sum(padded) // world * master
    if "/adamw/" in case:
        expected_state = 2 * shard_bytes + 4 * len(padded)  # float32 step counts, one per shard
    else:
        expected_state = shard_bytes
    assert r["state_bytes"] == [expected_state] * world


@pytest.mark.parametrize("case", ALL_CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_bytes_per_step_equal_the_formula(results, world, case):
    """Per rank and step: two all-gathers (compute dtype) and a reduce-scatter (master dtype), each
    (W - 1)/W of the padded parameters: 3 (W - 1)/W Psi in one dtype, DDP's 2 (W - 1)/W Psi."""
    r = results[world][case]
    psi = sum(math.ceil(n / world) * world for n in owned_numels(case))  # padded numbers
    master = 8 if "float64" in case else 4
    compute = 2 if "bfloat16" in case else master
    forwards = 2 if case.endswith("two_forwards") else 1  # each forward's backward: its own three
    gather = forwards * (world - 1) * psi // world * compute
    reduce = forwards * (world - 1) * psi // world * master
    expected = {
        "all_gather_forward": gather,
        "all_gather_backward": gather,
        "reduce_scatter": reduce,
    }
    assert r["comm_bytes"] == [expected] * STEPS
    if compute == master:
        assert sum(expected.values()) == forwards * 3 * (world - 1) * psi * master // world
