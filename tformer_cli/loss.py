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

CHUNK_TOKENS = 1024  # on CPU, (1024 x V) fp32 logits stay within a few tens of MB and mostly in cache
GPU_CHUNK_TOKENS = 8192  # on a GPU, fewer and larger matrix products keep it busy


class _LinearSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float):  # noqa: ANN001
        """hidden (N, d), weight (V, d), target (N,) -> (loss sum, NLL sum)."""
        V = weight.shape[0]
        compute = _compute_dtype(hidden)  # bf16/fp16 under autocast: in-place and out= products are not cast
        w = weight.to(compute)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)  # fp32 at least, fp64 stays fp64
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if ctx.needs_input_grad[1] else None
        loss = hidden.new_zeros((), dtype=accumulate)
        nll_total = hidden.new_zeros((), dtype=accumulate)
        chunk = CHUNK_TOKENS if hidden.device.type == "cpu" else GPU_CHUNK_TOKENS
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk].to(compute)  # (n, d)
            t = target[start:start + chunk, None]  # (n, 1)
            logits = (h @ w.T).to(accumulate)  # (n, V)
            lse = logits.logsumexp(dim=-1, keepdim=True)  # (n, 1)
            nll = lse - logits.gather(1, t)  # (n, 1)
            smooth = lse - logits.mean(dim=-1, keepdim=True)
            loss += ((1 - smoothing) * nll + smoothing * smooth).sum()
            nll_total += nll.sum()
            if grad_hidden is None and grad_weight is None:
                continue
            grad = logits.sub_(lse).exp_()  # softmax, in place: (n, V)
            grad.sub_(smoothing / V)
            grad.scatter_add_(1, t, grad.new_full(t.shape, smoothing - 1.0))
            grad = grad.to(compute)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = grad @ w
            if grad_weight is not None:
                if grad.dtype == accumulate:
                    grad_weight.addmm_(grad.T, h)
                else:
                    grad_weight += (grad.T @ h).to(accumulate)
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
