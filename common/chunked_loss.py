"""The output layer and the loss in pieces: `F.cross_entropy(h @ W.T, targets)` without the logits.

Why: with GPT-2's 50,304-entry vocabulary the logits of a GPU micro-batch of 32 x 1,024 positions
take 6.6 GB in float32, and the plain computation writes and reads them (and their gradient) several
times: on a CPU that traffic is most of a training step, on a GPU most of the memory beyond the weights.

How: a few positions at a time, compute the chunk's logits, its loss, and right away its gradient
(softmax minus one-hot), turned into the chunk's share of the gradients of `h` and `W`; then drop
the chunk's logits. The gradients are computed in the forward pass (a training step always calls
backward); backward only scales them. Under `torch.no_grad()` no gradient work is done. It is
the idea of Liger Kernel's fused linear cross-entropy, in plain PyTorch.
"""

from __future__ import annotations

import torch

# Positions per chunk. Each chunk re-reads the whole output matrix, so much smaller chunks cost more
# than they save; logits (chunk x V float32) that outgrow the cache lose the gain. On a CPU 128
# measured fastest for the small model (bench/README.md); on a GPU 1,024 keeps the temporaries near
# 0.5 GB and the GPU, not the Python loop, sets the pace (reasoned; bench/gpu_check.sh measures it).
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
