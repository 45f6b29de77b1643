"""The chunked output layer + loss (common/chunked_loss.py) is the plain `F.cross_entropy(h @
W.T, y)` up to rounding: loss and gradients, on any chunking, under autocast, in DataParallel's
replica threads, with the tied embedding, and under `no_grad`."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from common.chunked_loss import CPU_CHUNK, chunked_cross_entropy
from common.model import GPT, PRESETS

VOCAB = PRESETS["tiny"].vocab_size  # 50,304: the size that makes the chunking worth it


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: small matmuls, one thread


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, relative to the largest value of the reference."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def loss_and_grads(fn, h, weight, targets):
    h, weight = h.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, weight, targets)
    loss.backward()
    return loss.detach(), h.grad, weight.grad


def plain(h, weight, targets):
    return F.cross_entropy((h @ weight.t()).float(), targets)


@pytest.mark.parametrize(
    "positions, width, vocab, chunk",
    [
        (256, 32, VOCAB, 128),  # two whole chunks
        (200, 32, VOCAB, 128),  # a last chunk of 72: the chunk size does not divide the positions
        (37, 16, VOCAB, 128),  # fewer positions than one chunk
        (300, 24, 777, 64),  # an odd vocabulary, five chunks and a remainder
    ],
)
def test_loss_and_gradients_match_the_plain_computation(positions, width, vocab, chunk):
    gen = torch.Generator().manual_seed(positions)
    h = torch.randn(positions, width, generator=gen)
    weight = 0.05 * torch.randn(vocab, width, generator=gen)
    targets = torch.randint(0, vocab, (positions,), generator=gen)
    ref_loss, ref_h, ref_w = loss_and_grads(plain, h, weight, targets)
    loss, grad_h, grad_w = loss_and_grads(
        lambda *a: chunked_cross_entropy(*a, chunk=chunk), h, weight, targets
    )
    assert loss.dtype == torch.float32
    assert grad_h.dtype == grad_w.dtype == torch.float32
    assert rel_diff(loss, ref_loss) <= 1e-6
    assert rel_diff(grad_h, ref_h) <= 1e-5
    assert rel_diff(grad_w, ref_w) <= 1e-5


def tiny_pair() -> tuple[GPT, GPT]:
    """The tiny GPT twice, same weights: with the chunked loss (the default) and the plain one."""
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    chunked = GPT(config)
    plain_model = GPT(replace(config, chunked_loss=False))
    plain_model.load_state_dict(chunked.state_dict())
    return chunked, plain_model


def batch():
    gen = torch.Generator().manual_seed(1)
    shape = (8, PRESETS["tiny"].block_size)  # 8 x 32 = 256 positions: 2 chunks of CPU_CHUNK
    x = torch.randint(0, 50257, shape, generator=gen)
    y = torch.randint(0, 50257, shape, generator=gen)
    return x, y


def assert_same_gradients(models, loss, ref_loss, loss_tol=1e-6, grad_tol=1e-5) -> None:
    """Both losses' backward: the same loss and parameter gradients, up to the tolerances."""
    loss.backward()
    ref_loss.backward()
    assert rel_diff(loss, ref_loss) <= loss_tol
    chunked, plain_model = models
    for (name, p), q in zip(chunked.named_parameters(), plain_model.parameters()):
        assert rel_diff(p.grad, q.grad) <= grad_tol, name


def test_the_model_trains_on_the_same_loss_and_gradients():
    chunked, plain_model = tiny_pair()
    # the default everywhere
    assert chunked.config.chunked_loss
    assert PRESETS["small"].chunked_loss
    x, y = batch()
    logits, loss = chunked(x, y)
    assert logits is None  # the full logits are never built, so there are none to return
    ref_logits, ref_loss = plain_model(x, y)
    assert ref_logits.shape == (*x.shape, VOCAB)
    assert_same_gradients((chunked, plain_model), loss, ref_loss)
    # generation never takes the chunked path: without targets, the last position's logits
    with torch.no_grad():
        torch.testing.assert_close(chunked(x)[0], plain_model(x)[0])


def test_tied_weight_gradient_arrives_once():
    """The tied matrix's gradient is accumulated once, so DDP's and the by-hand hooks fire once."""
    for model in tiny_pair():
        fired = {name: 0 for name, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            # the defaults bind this model's counts and this parameter's name to the hook
            p.register_post_accumulate_grad_hook(
                lambda _, n=name, f=fired: f.__setitem__(n, f[n] + 1)
            )
        x, y = batch()
        model(x, y)[1].backward()
        # one tensor, one name
        assert "transformer.wte.weight" in fired
        assert "lm_head.weight" not in fired
        assert set(fired.values()) == {1}, fired


def count_matmuls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(
        e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::addmm_")
    )


def test_no_grad_does_no_gradient_work():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(3 * CPU_CHUNK, 16, generator=gen, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, VOCAB, (3 * CPU_CHUNK,), generator=gen)
    with torch.no_grad():
        # the logits of 3 chunks
        assert count_matmuls(lambda: chunked_cross_entropy(h, weight, targets)) == 3
        loss = chunked_cross_entropy(h, weight, targets)
    assert loss.grad_fn is None
    # with gradients: 3 products per chunk (the logits, then d/dh and d/dW computed right away)
    assert count_matmuls(lambda: chunked_cross_entropy(h, weight, targets)) == 9
    assert rel_diff(loss, chunked_cross_entropy(h, weight, targets)) == 0


def test_gradients_come_back_in_the_inputs_dtypes():
    """Chapter 07 casts weights to bfloat16 without autocast: their gradients come back bfloat16."""
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(40, 16, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(64, 16, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, 64, (40,), generator=gen)
    chunked_cross_entropy(h, weight, targets, chunk=16).backward()
    assert h.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_bfloat16_autocast_on_the_cpu():
    chunked, plain_model = tiny_pair()
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked(x, y)[1]
        ref_loss = plain_model(x, y)[1]
    # the softmax runs in float32 on both paths
    assert loss.dtype == ref_loss.dtype == torch.float32
    # both from bf16 products, only their rounding differs; bfloat16 keeps ~3 significant digits
    assert_same_gradients((chunked, plain_model), loss, ref_loss, loss_tol=1e-3, grad_tol=3e-2)


def test_in_replica_threads_as_dataparallel_runs_it():
    """nn.DataParallel's forwards run in threads, one backward over the gathered losses."""
    chunked, plain_model = tiny_pair()
    x, y = batch()
    losses, errors = [None, None], []

    def replica(i, xs, ys):
        try:
            # DataParallel sets each thread's autocast state
            with torch.autocast("cpu", enabled=False):
                losses[i] = chunked(xs, ys)[1]
        except Exception as err:  # any error: reported below, in the test's thread
            errors.append(err)

    threads = [
        threading.Thread(target=replica, args=(i, xs, ys))
        for i, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    loss = torch.stack(losses).mean()  # what chapter 03 does with the gathered vector
    assert_same_gradients((chunked, plain_model), loss, plain_model(x, y)[1])


def test_float16_gradients_cannot_overflow_where_the_plain_path_does_not():
    """One target everywhere, hidden states of 1,000: a chunk's sum (128 x -1,000) passes float16's
    65,504; the plain gradient of the mean stays near -1,000, and the chunked one must too."""
    positions, width, vocab = 2 * CPU_CHUNK, 8, 64
    h = torch.full((positions, width), 1000.0)
    weight = torch.randn(vocab, width) * 1e-3
    targets = torch.zeros(positions, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.float16):  # the products in float16, as on an older GPU
        loss, grad_h, grad_w = loss_and_grads(chunked_cross_entropy, h, weight, targets)
    ref_loss, ref_h, ref_w = loss_and_grads(plain, h.half().float(), weight.half().float(), targets)
    assert torch.isfinite(grad_w).all()
    assert torch.isfinite(grad_h).all()
    assert rel_diff(loss, ref_loss) <= 1e-3
    assert rel_diff(grad_w, ref_w) <= 1e-3
    assert rel_diff(grad_h, ref_h) <= 1e-3
