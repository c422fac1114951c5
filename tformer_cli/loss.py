"""Label-smoothed cross-entropy (§5.4) fused with the output projection, computed in chunks.

The vocabulary projection and softmax dominate a small model's cost, and the (tokens x vocabulary)
logits dominate its memory. Here they are formed a chunk of tokens at a time; the gradient with
respect to the logits has a closed form,

    d loss / d logits = softmax(logits) - (1 - eps) * onehot(target) - eps / V,

so each chunk's gradients for the hidden states and the projection matrix are computed right away
and the logits are dropped. Backward then only scales the stored gradients: no (N, V) tensor
outlives its chunk, and no log-softmax, gather or mean has to be differentiated.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_TOKENS = 512  # on CPU: (512 x 37,000) fp32 logits are 72 MiB; 1,024 was no faster and doubled them
GPU_CHUNK_TOKENS = 8192  # on a GPU, fewer and larger matrix products keep it busy


class _LinearSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float):  # noqa: ANN001
        """hidden (N, d), weight (V, d), target (N,) -> (loss sum, NLL sum)."""
        compute = _compute_dtype(hidden)  # bf16/fp16 under autocast: in-place and out= products are not cast
        w = weight.to(compute)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)  # fp32 at least, fp64 stays fp64
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if ctx.needs_input_grad[1] else None
        loss = hidden.new_zeros((), dtype=accumulate)
        nll_total = hidden.new_zeros((), dtype=accumulate)
        chunk = CHUNK_TOKENS if hidden.device.type == "cpu" else GPU_CHUNK_TOKENS
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            chunk_loss, chunk_nll = _chunk(hidden[rows].to(compute), w, target[rows, None], smoothing, accumulate,
                                           None if grad_hidden is None else grad_hidden[rows], grad_weight)
            loss += chunk_loss
            nll_total += chunk_nll
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(nll_total)
        return loss, nll_total

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor):  # noqa: ANN001
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None


def _chunk(h: Tensor, w: Tensor, t: Tensor, smoothing: float, accumulate: torch.dtype,
           grad_hidden: Tensor | None, grad_weight: Tensor | None) -> tuple[Tensor, Tensor]:
    """Loss and NLL sums of one chunk: h (n, d), w (V, d), t (n, 1). Writes the chunk's hidden-state
    gradient into grad_hidden (n, d) and adds its weight gradient to grad_weight (V, d), where given.
    Its (n, V) tensors are freed on return, before the next chunk's are made."""
    V = w.shape[0]
    logits = (h @ w.T).to(accumulate)  # (n, V)
    target_logit, mean_logit = logits.gather(1, t), logits.mean(dim=-1, keepdim=True)  # (n, 1) each
    peak = logits.amax(dim=-1, keepdim=True)  # (n, 1)
    exp = logits.sub_(peak).exp_()  # in place: logsumexp would hold a second (n, V) tensor
    total = exp.sum(dim=-1, keepdim=True)  # (n, 1)
    lse = total.log() + peak
    nll = lse - target_logit
    loss = ((1 - smoothing) * nll + smoothing * (lse - mean_logit)).sum()
    if grad_hidden is None and grad_weight is None:
        return loss, nll.sum()
    grad = exp.div_(total)  # softmax, in place: (n, V)
    grad.sub_(smoothing / V)
    grad.scatter_add_(1, t, grad.new_full(t.shape, smoothing - 1.0))
    grad = grad.to(h.dtype)
    if grad_hidden is not None:
        grad_hidden.copy_(grad @ w)
    if grad_weight is not None:
        if grad.dtype == accumulate:
            grad_weight.addmm_(grad.T, h)
        else:
            grad_weight += (grad.T @ h).to(accumulate)
    return loss, nll.sum()


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def linear_smoothed_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor,
                                  smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """Sum over tokens of (1 - eps) * NLL + eps * mean_v(-log p_v) for logits = hidden @ weight^T.

    Args:
        hidden: (N, d_model) decoder states at real target positions.
        weight: (V, d_model) output projection.
        target: (N,) token ids.

    Returns:
        (loss sum, differentiable; NLL sum, not differentiable).
    """
    return _LinearSmoothedCrossEntropy.apply(hidden, weight, target, smoothing)
