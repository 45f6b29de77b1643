"""The output layer and the loss in pieces: `F.cross_entropy(h @ W.T, targets)` without the logits.

Why this exists. GPT-2's vocabulary has 50,304 entries, so the logits of a batch are
positions x 50,304 numbers: 206 MB for 1,024 positions in float32, 6.6 GB for a GPU micro-batch of
32 x 1,024 (plus a bfloat16 copy and the gradients of both). The plain computation writes them,
reads them for the softmax, writes the softmax's gradient of the same size and reads it twice for
the two matrix products of the backward pass. In the course's small model that traffic is most of
a training step on a CPU, and on a GPU it is most of the memory a step needs beyond the weights.

`chunked_cross_entropy` computes the same loss and the same gradients a few rows (positions) at a
time. For each chunk of positions it computes the chunk's logits, their log-softmax and loss, and
right away the chunk's gradient with respect to the logits (softmax minus one-hot), which it turns
into its share of the two gradients that matter: of the hidden states `h` (chunk x n_embd) and of
the output matrix `W` (added up over the chunks). The chunk's logits are then dropped. Nothing of
size positions x vocabulary is ever held, and the logits are read while they are still in cache.

The gradients are computed during the forward pass, before anyone asks for them: a training step
always calls backward, and it saves computing the logits a second time. The backward pass only
multiplies them by the incoming gradient (1 for `loss.backward()`, the loss scale under float16,
1/K with gradient accumulation). Under `torch.no_grad()` (evaluation) no gradient work is done.

It is the idea of Liger Kernel's fused linear cross-entropy (which also computes the gradients
in the forward pass), written in plain PyTorch operations.
"""

from __future__ import annotations

import torch

# Positions per chunk. Each chunk reads the whole output matrix (V x C) three times, so a chunk much
# smaller than the width C costs more in re-reading the matrix than it saves; a chunk whose logits
# (chunk x V float32) outgrow the cache loses what chunking gains. On a CPU, 128 measured fastest
# for the small model (C = 128, bench/README.md): 128 x 50,304 float32 = 26 MB, inside this
# machine's 32 MB L3 cache. On a GPU, 1,024: about 0.5 GB of temporaries for GPT-2's vocabulary
# (against the plain path's tens of GB) and big enough that the GPU, not the Python loop launching
# its kernels, sets the pace. The GPU figure is reasoned, not yet measured: bench/gpu_check.sh
# measures it.
CPU_CHUNK = 128
GPU_CHUNK = 1024


def _loss_and_grads(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    ignore_index: int,
    dtype: torch.dtype,
    want_grad_h: bool,
    want_grad_w: bool,
):
    """The summed loss and (if wanted) the gradients of that sum, chunk by chunk.

    h (N, C), weight (V, C), targets (N,); the matrix products run in `dtype` (the gradient ones
    in float32 when `dtype` is float16), the softmax in float32 (float64 in a float64 run).
    Returns the summed loss (0-dim), the number of positions that count, and grad_h (N, C) and
    grad_w (V, C), in that precision, or None where not wanted.
    """
    n = h.shape[0]
    acc = torch.promote_types(dtype, torch.float32)  # float32, or float64 when the run is float64
    h_lo, w_lo = h.to(dtype), weight.to(dtype)  # no copy when already in dtype (float32 on the CPU)
    # The gradient products carry no loss scale: it is known only in backward. float16 ends at
    # 65,504, and a sum over a chunk's positions can pass it. The plain path's products carry the
    # scale, which the GradScaler lowers until they fit; here it could not, and one inf would make
    # it skip every step. So under float16 they run in float32. bfloat16 has float32's range.
    grad_dtype = torch.float32 if dtype == torch.float16 else dtype
    h_g, w_g = h.to(grad_dtype), weight.to(grad_dtype)  # no copy when already in that format
    valid = targets != ignore_index  # (N,) positions that count, as F.cross_entropy's ignore_index
    # (N, 1): an ignored position gathers column 0, then counts 0
    safe_targets = targets.clamp(min=0).unsqueeze(1)
    loss_sum = torch.zeros((), dtype=acc, device=h.device)
    grad_h = torch.empty(h.shape, dtype=acc, device=h.device) if want_grad_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if want_grad_w else None
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        h_c, y_c, keep = h_lo[rows], safe_targets[rows], valid[rows].unsqueeze(1)  # (c, C), (c, 1), (c, 1)
        # the chunk's logits, in float32 for the softmax as the plain path does: the one large tensor
        log_probs = torch.log_softmax((h_c @ w_lo.t()).to(acc), dim=1)  # (c, V)
        loss_sum -= (log_probs.gather(1, y_c) * keep).sum()
        if want_grad_h or want_grad_w:
            # d(loss_i)/d(logits_i) = softmax(logits_i) - one_hot(y_i), made in the same buffer
            grad_logits = log_probs.exp_().scatter_add_(
                1, y_c, torch.full_like(y_c, -1, dtype=log_probs.dtype)
            )
            # the products run in the matmul's precision, as in the plain path (float16: float32)
            grad_logits = grad_logits.to(grad_dtype)
            if want_grad_h:
                grad_h[rows] = (grad_logits @ w_g) * keep  # (c, C); an ignored position gets zero
            if want_grad_w and grad_dtype == acc:  # the product adds itself into grad_w
                grad_w.addmm_(grad_logits.t(), h_g[rows] * keep)  # (V, C), summed over the chunks
            elif want_grad_w:  # bfloat16 products, summed in float32 (on the CPU the add
                grad_w += grad_logits.t() @ (h_g[rows] * keep)  # makes a float32 copy of each product first)
            del grad_logits
        del log_probs  # free this chunk's (c, V) buffers before the next chunk's are made
    return loss_sum, valid.sum(), grad_h, grad_w


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean cross-entropy of (h @ weight.T) against targets; gradients computed in forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, ignore_index, dtype):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_sum, count, grad_h, grad_w = _loss_and_grads(
            h, weight, targets, chunk, ignore_index, dtype, want_h, want_w
        )
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_loss.to(grad_h.dtype if grad_h is not None else grad_w.dtype) / count  # d(mean)/d(sum)
        h_dtype, w_dtype = ctx.dtypes
        return (
            None if grad_h is None else (grad_h * scale).to(h_dtype),
            None if grad_w is None else (grad_w * scale).to(w_dtype),
            None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """`F.cross_entropy(h @ weight.T, targets)` (mean over positions), computed `chunk` positions at a time.

    h (N, C) hidden states, weight (V, C) the output matrix, targets (N,) token ids; `chunk`
    positions at a time (default: CPU_CHUNK on a CPU, GPU_CHUNK elsewhere). Under autocast the
    products run in the autocast dtype and the softmax in float32, as in the plain
    `F.cross_entropy(lm_head(h).float(), targets)`; the gradients come back in the inputs' dtypes
    (float32 for the model's weight: summed over the chunks in float32, never rounded to bfloat16).
    """
    device_type = h.device.type
    chunk = chunk or (CPU_CHUNK if device_type == "cpu" else GPU_CHUNK)
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)  # what autocast gives the plain path's lm_head
    else:
        dtype = torch.promote_types(h.dtype, weight.dtype)
    with torch.autocast(device_type, enabled=False):  # the function chooses its own precisions
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return ChunkedLinearCrossEntropy.apply(h, weight, targets, chunk, ignore_index, dtype)
        loss_sum, count, _, _ = _loss_and_grads(h, weight, targets, chunk, ignore_index, dtype, False, False)
        return loss_sum / count
