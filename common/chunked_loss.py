"""The output layer and the loss in pieces: `F.cross_entropy(h @ W.T, targets)` without the logits
(why: docs/deep/MEMORY.md). A few positions at a time: the chunk's logits, its loss and right away
its gradient (softmax minus one-hot), turned into its share of the gradients of `h` and `W`;
backward only scales them. The idea of Liger Kernel's fused linear cross-entropy, in plain PyTorch.
"""

import torch

# Positions per chunk. Each chunk re-reads the whole output matrix, so much smaller chunks cost more
# than they save. On a CPU 128 measured fastest for the small model (bench/README.md); on a GPU
# 1,024 keeps the temporaries near 0.5 GB (reasoned; bench/gpu_check.sh measures it).
CPU_CHUNK = 128
GPU_CHUNK = 1024


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean cross-entropy of (h @ weight.T) against targets; gradients computed in forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, dtype, want_grads):
        """The mean loss; and, if wanted, the gradients of the summed loss, grad_h (N, C) and grad_w
        (V, C), kept for backward. h (N, C), weight (V, C), targets (N,); the products run in
        `dtype`, the softmax and the sums in float32 (float64 in a float64 run)."""
        acc = torch.promote_types(dtype, torch.float32)
        h_lo = h.to(dtype)  # no copy when already in dtype (float32 on the CPU)
        w_lo = weight.to(dtype)
        # The gradient products carry no loss scale (it is known only in backward), so under
        # float16 a sum over a chunk could pass 65,504 where the plain path's GradScaler would have
        # lowered the scale. So they run in float32 there; bfloat16 has float32's range.
        grad_dtype = torch.float32 if dtype == torch.float16 else dtype
        h_g = h.to(grad_dtype)
        w_g = weight.to(grad_dtype)
        # every position counts: the course's targets are all token ids (no ignore_index)
        targets_2d = targets.unsqueeze(1)  # (N, 1)
        loss_sum = torch.zeros((), dtype=acc, device=h.device)
        grad_h = None
        grad_w = None
        if want_grads:
            grad_h = torch.empty(h.shape, dtype=acc, device=h.device)
            grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device)
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            h_c = h_lo[rows]  # (c, C)
            y_c = targets_2d[rows]  # (c, 1)
            # the chunk's logits, the one large tensor, in float32 for the softmax: the plain path
            # does the same
            log_probs = torch.log_softmax((h_c @ w_lo.t()).to(acc), dim=1)  # (c, V)
            loss_sum -= log_probs.gather(1, y_c).sum()
            if want_grads:
                # d(loss_i)/d(logits_i) = softmax(logits_i) - one_hot(y_i), made in the same buffer
                minus_one = torch.full_like(y_c, -1, dtype=log_probs.dtype)
                grad_logits = log_probs.exp_().scatter_add_(1, y_c, minus_one).to(grad_dtype)
                grad_h[rows] = grad_logits @ w_g  # (c, C)
                if grad_dtype == acc:  # the product adds itself into grad_w (V, C)
                    grad_w.addmm_(grad_logits.t(), h_g[rows])
                else:  # bfloat16 products, summed in float32
                    grad_w += grad_logits.t() @ h_g[rows]
                del grad_logits
            del log_probs  # free this chunk's (c, V) buffers before the next chunk's are made
        ctx.save_for_backward(grad_h, grad_w)
        ctx.positions = h.shape[0]
        return loss_sum / ctx.positions

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        # d(mean)/d(sum); both gradients were summed in the same dtype
        scale = grad_loss.to(grad_h.dtype) / ctx.positions
        # autograd hands each gradient on in its input's dtype (it casts what backward returns)
        return grad_h * scale, grad_w * scale, None, None, None, None


def chunked_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """`F.cross_entropy(h @ weight.T, targets)`, `chunk` positions at a time (default: by device).

    Under autocast the products run in the autocast dtype and the softmax in float32, as in the
    plain `F.cross_entropy(lm_head(h).float(), targets)`. The gradients come back in the inputs'
    dtypes: float32 for the model's weight, summed over the chunks in float32 and never rounded
    to bfloat16."""
    device_type = h.device.type
    if chunk is None:
        chunk = CPU_CHUNK if device_type == "cpu" else GPU_CHUNK
    # the products in the dtype the plain path's lm_head would run in
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(h.dtype, weight.dtype)
    # under no_grad (evaluation, generation) no gradient is computed ahead
    want_grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):  # the function chooses its own precisions
        return ChunkedLinearCrossEntropy.apply(h, weight, targets, chunk, dtype, want_grads)
