"""The GPT: its size, its first loss, that it can learn, and that it is GPT-2
(the same logits as Hugging Face's)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.gpt2 import load_hf_gpt2_state_dict
from common.model import GPT, PRESETS, GPTConfig, model_config
from tools.launch import run_python

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: small matmuls, one thread


@pytest.mark.quick
def test_presets_and_overrides():
    cfg = model_config("tiny", n_embd=64, block_size=None)
    assert cfg.n_embd == 64
    # None keeps the preset's value
    assert cfg.block_size == PRESETS["tiny"].block_size
    with pytest.raises(KeyError):  # --preset offers only the presets' names
        model_config("huge")


def expected_params(cfg: GPTConfig) -> int:
    """Embeddings (tied: counted once) + per layer 12 C^2 weights and 13 C biases/gains + the
    final LayerNorm."""
    C = cfg.n_embd
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * (12 * C * C + 13 * C) + 2 * C


def test_num_params():
    for cfg in (
        PRESETS["tiny"],
        model_config("tiny", n_layer=3, n_embd=48, n_head=3, block_size=20),
    ):
        model = GPT(cfg)
        assert model.num_params(non_embedding=False) == expected_params(cfg)
        # positions left out
        assert model.num_params() == expected_params(cfg) - cfg.block_size * cfg.n_embd
        assert model.lm_head.weight is model.transformer.wte.weight  # tied: counted once
    # GPT-2 small has 124,439,808 parameters; ours has 47 padded vocabulary rows more: 50,304 is
    # the smallest multiple of 64 that holds GPT-2's 50,257 tokens, in every preset
    assert expected_params(PRESETS["gpt2"]) == 124_439_808 + 47 * 768
    assert {cfg.vocab_size for cfg in PRESETS.values()} == {50304}


def test_flops_per_token():
    model = GPT(PRESETS["tiny"])
    cfg = model.config
    expected = 6 * model.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    assert model.flops_per_token() == expected > 0


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    cfg = model_config("tiny", n_embd=16, block_size=16)
    model = GPT(cfg)
    x = torch.randint(0, 1000, (4, 16))
    y = torch.roll(x, -1, dims=1)
    optimizer = torch.optim.AdamW(model.optimizer_groups(0.0), lr=1e-2)
    first = None
    for _ in range(80):
        _, loss = model(x, y)
        first = loss.item() if first is None else first
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert first > 10.0
    assert loss.item() < 0.5, f"loss only fell from {first:.2f} to {loss.item():.2f}"


def test_optimizer_groups_decay_matrices_only():
    model = GPT(PRESETS["tiny"])
    decay, no_decay = model.optimizer_groups(0.1)
    assert decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == model.num_params(non_embedding=False)


def test_generate_shape_and_determinism():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).eval()
    prompt = torch.tensor([[15496, 995]])
    runs = [
        model.generate(prompt, 40, top_k=50, generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]
    assert runs[0].shape == (1, 42)  # longer than block_size 32: the context is cropped
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0][:, :2], prompt)
    assert runs[0].max() < 50257  # the padding rows are never sampled
    other = model.generate(prompt, 40, top_k=50, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(other, runs[0])


def test_longer_than_block_size_refused():
    model = GPT(PRESETS["tiny"])
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def hf_gpt2():
    """A small GPT-2 of Hugging Face's, biases and gains random too (none hides behind 0 or 1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 50257}
    model = GPT2LMHeadModel(GPT2Config(**shape, activation_function="gelu_new")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(mean=1.0 if ".ln_" in name else 0.0, std=0.1)
    return model


def ours(block_size: int, n_embd: int = 32) -> GPT:
    """Our GPT in the small model's shape, with the plain loss (logits at every position)."""
    config = GPTConfig(block_size=block_size, n_layer=2, n_head=2, n_embd=n_embd, bias=True)
    return GPT(replace(config, chunked_loss=False)).eval()


def test_hugging_face_logits_match():
    hf = hf_gpt2()
    model = ours(64)
    load_hf_gpt2_state_dict(model, hf.state_dict())
    idx = torch.randint(0, 50257, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(idx).logits
        logits, _ = model(idx, idx)  # with targets: logits at every position
        last, _ = model(idx)  # the generation path: the last position alone
    assert logits.shape == (3, 64, 50304)
    torch.testing.assert_close(logits[..., :50257], theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last[:, 0, :50257], theirs[:, -1], atol=1e-5, rtol=1e-5)
    # a shorter block takes the first positions; another width does not fit
    short = ours(16)
    load_hf_gpt2_state_dict(short, hf.state_dict())
    with torch.no_grad():
        logits, _ = short(idx[:, :16], idx[:, :16])
    torch.testing.assert_close(logits[..., :50257], theirs[:, :16], atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError):
        load_hf_gpt2_state_dict(ours(64, n_embd=64), hf.state_dict())


def test_the_gpt2_command_fails_in_one_line(tmp_path):
    """python -m common.gpt2: more positions than GPT-2 has, or no network, are one line each, and
    nothing is written."""
    too_long = ["-m", "common.gpt2", "--block-size", 2048, "--out-dir", tmp_path]
    proc = run_python(too_long, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "error: --block-size 2048 is larger than GPT-2's 1024 positions; use at most that\n"
    )
    proc = run_python(["-m", "common.gpt2", "--out-dir", tmp_path], check=False, HF_HUB_OFFLINE="1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: could not fetch GPT-2's weights ("), proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "ckpt.pt").exists()
