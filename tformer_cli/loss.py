"""Label-smoothed cross-entropy (§5.4) fused with the output projection, computed in chunks.

The vocabulary projection and softmax dominate a small model's cost, and the (tokens x vocabulary)
logits dominate its memory. Here they are formed a chunk of tokens at a time; the gradient with
respect to the logits has a closed form,

    d loss / d logits = softmax(logits) - (1 - eps) * onehot(target) - eps / V,

so each chunk's gradients for the hidden states and the projection matrix are computed right away,
and the next chunk's logits overwrite its own in one buffer. Backward then only scales the stored
gradients: no (N, V) tensor is ever made, and no log-softmax, gather or mean has to be differentiated.

With R-Drop (Liang et al. 2021) the hidden states come from two passes of the same batch under
different dropout masks, and the loss adds alpha times their symmetric KL divergence,

    1/2 (CE_1 + CE_2) + alpha * 1/2 (KL(p_1 || p_2) + KL(p_2 || p_1)),

whose logit gradient is closed-form too: with d = log p_1 - log p_2, the KL term's gradient for the
first pass is 1/2 (p_1 * (d - sum_v p_1 d) + p_1 - p_2), and symmetrically for the second.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tformer_cli.accel import fused_loss, gemm, ops

CHUNK_TOKENS = 512  # on CPU: larger chunks were no faster and hold more logits (benchmarks/README.md)
# On a CPU a chunk's rows are padded with zeros to a multiple of this: oneDNN compiles and keeps a
# kernel (~1-2.5 MB) for every shape it multiplies, and a batch's last chunk had any of 512 row counts
ROW_MULTIPLE = 64
GPU_CHUNK_TOKENS = 8192  # on a GPU, fewer and larger matrix products keep it busy


class _LinearSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float,  # noqa: ANN001
                rdrop: float):
        """hidden (N, d), or (2N, d) with rdrop (two passes of the same N tokens, one after the other);
        weight (V, d), target (N,) -> (loss sum, NLL sum) over the N tokens."""
        compute = _compute_dtype(hidden)  # bf16/fp16 under autocast: in-place and out= products are not cast
        w = weight.to(compute)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)  # fp32 at least, fp64 stays fp64
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if ctx.needs_input_grad[1] else None
        loss = hidden.new_zeros((), dtype=accumulate)
        nll_total = hidden.new_zeros((), dtype=accumulate)
        n = target.shape[0]
        chunk = CHUNK_TOKENS if hidden.device.type == "cpu" else GPU_CHUNK_TOKENS
        chunk = chunk // 2 if rdrop else chunk  # both passes' rows of a chunk are projected together
        multiple = ROW_MULTIPLE if hidden.device.type == "cpu" else 1
        want_grad = grad_hidden is not None or grad_weight is not None
        # on a GPU the speed layer computes a chunk's terms from the product's own logits in two passes
        fused = want_grad and not rdrop and fused_loss.applies(hidden)
        # torch's products write every chunk's logits into one buffer (a new one per chunk is slower on a
        # CPU); oneDNN's have no out= form, and each chunk's are freed before the next
        buffer = None if fused or gemm.onednn_applies(hidden, weight) else \
            hidden.new_empty((gemm.round_up(min(n, chunk) * (2 if rdrop else 1), multiple), weight.shape[0]),
                             dtype=accumulate)
        mean_weight = None  # the mean logit of a row is h . mean_weight (the plain path's, made when needed)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            rows = [slice(start, stop), slice(n + start, n + stop)] if rdrop else [slice(start, stop)]
            h = (hidden[rows[0]] if len(rows) == 1 else torch.cat([hidden[r] for r in rows])).to(compute)
            m = h.shape[0]
            h = gemm.zero_rows_to(h, gemm.round_up(m, multiple))  # few distinct product shapes (ROW_MULTIPLE)
            padded_logits = _project(h, w, buffer)  # (rows, V)
            logits, t = padded_logits[:m], target[rows[0], None]
            terms = fused_loss.fused_smoothed_terms(logits, t, smoothing) if fused else None
            if terms is not None:
                chunk_loss, chunk_nll, grad = terms
            elif rdrop:
                chunk_loss, chunk_nll, grad = _rdrop_logit_grad(logits, t, smoothing, rdrop, want_grad)
            else:
                logits = logits.to(accumulate)  # already fp32, except where the fused terms did not compile
                if mean_weight is None:
                    mean_weight = weight.to(accumulate).mean(dim=0, keepdim=True).T  # (d, 1)
                mean_logit = h[:m].to(accumulate) @ mean_weight  # (rows, 1)
                chunk_loss, chunk_nll, grad = _smoothed_logit_grad(logits, t, mean_logit, smoothing, want_grad)
            loss += chunk_loss
            nll_total += chunk_nll
            if grad is not None:
                if grad.data_ptr() == padded_logits.data_ptr():  # made in place: the padding rows follow it
                    grad = padded_logits
                    grad[m:] = 0
                _backpropagate(gemm.zero_rows_to(grad, h.shape[0]).to(compute), h, w, rows, grad_hidden, grad_weight)
            logits = padded_logits = grad = None  # not alive while the next chunk's are made
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
        return grad_hidden, grad_weight, None, None, None


def _project(h: Tensor, w: Tensor, buffer: Tensor | None) -> Tensor:
    """h (rows, d) @ w^T: a new tensor from oneDNN (``buffer`` None), else written into the first rows
    of ``buffer`` and converted to its dtype where the product runs in a lower one."""
    if buffer is None:
        return gemm.linear(h, w)
    out = buffer[:h.shape[0]]
    if h.dtype == out.dtype:
        return torch.mm(h, w.T, out=out)
    return out.copy_(h @ w.T)


def _smoothed_logit_grad(logits: Tensor, t: Tensor, mean_logit: Tensor, smoothing: float,
                         want_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Loss sum, NLL sum and d loss / d logits of one chunk: logits (n, V), consumed; t and mean_logit (n, 1).

    One fused log-softmax, in place, and one exp make the softmax: half the passes over the (n, V)
    logits of max, subtract, exp, sum and divide. With lse = log sum_v exp(logit_v), the smoothed
    term mean_v(-log p_v) is lse - mean_logit, and lse = logit_t - log p_t.
    """
    V = logits.shape[1]
    target_logit = logits.gather(1, t)  # (n, 1)
    log_p = _log_softmax_(logits)
    nll = -log_p.gather(1, t)  # (n, 1)
    lse = target_logit + nll
    loss = ((1 - smoothing) * nll + smoothing * (lse - mean_logit)).sum()
    if not want_grad:
        return loss, nll.sum(), None
    grad = log_p.exp_()  # softmax, in place: (n, V)
    grad.sub_(smoothing / V)
    grad.scatter_add_(1, t, grad.new_full(t.shape, smoothing - 1.0))
    return loss, nll.sum(), grad


def _log_softmax_(logits: Tensor) -> Tensor:
    """log_softmax over the last dimension, written over ``logits`` where torch can (tests/test_loss.py
    checks that its kernel may alias input and output)."""
    return ops.log_softmax_(logits)


def _rdrop_logit_grad(logits: Tensor, t: Tensor, smoothing: float, alpha: float,
                      want_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """The same for R-Drop: logits (2n, V), the first pass's n rows then the second's; t (n, 1).
    The loss and NLL are the passes' mean, plus alpha times their symmetric KL divergence."""
    n, V = t.shape[0], logits.shape[1]
    t2 = torch.cat([t, t])
    log_p = _log_softmax_(logits)  # (2n, V)
    nll = -log_p.gather(1, t2)
    ce = (1 - smoothing) * nll - smoothing * log_p.mean(dim=-1, keepdim=True)
    p = log_p.exp()
    d = log_p[:n] - log_p[n:]  # (n, V)
    p_diff = p[:n] - p[n:]
    loss = 0.5 * ce.sum() + alpha * 0.5 * (p_diff * d).sum()
    if not want_grad:
        return loss, 0.5 * nll.sum(), None
    grad = p.sub(smoothing / V).scatter_add_(1, t2, p.new_full(t2.shape, smoothing - 1.0)).mul_(0.5)
    for half, sign in ((slice(0, n), 1.0), (slice(n, 2 * n), -1.0)):
        p_half = p[half]
        kl_grad = p_half * (d - (p_half * d).sum(dim=-1, keepdim=True)) + p_diff  # (n, V)
        grad[half].add_(kl_grad, alpha=sign * 0.5 * alpha)  # sign * kl_grad = d (KL_12 + KL_21) / d this pass's logits
    return loss, 0.5 * nll.sum(), grad


def _backpropagate(grad: Tensor, h: Tensor, w: Tensor, rows: list[slice], grad_hidden: Tensor | None,
                   grad_weight: Tensor | None) -> None:
    """From a chunk's logit gradient grad (m, V): write the hidden-state gradient of its rows (h (m, d)
    stacks them in order) into grad_hidden, and add the weight gradient to grad_weight (V, d)."""
    if grad_hidden is not None:
        sizes = [r.stop - r.start for r in rows]  # the rows past them are padding
        for r, part in zip(rows, gemm.linear(grad, w.t())[:sum(sizes)].split(sizes)):
            grad_hidden[r] = part
    if grad_weight is not None:
        if gemm.onednn_applies(grad, h, grad_weight):
            grad_weight += gemm.weight_gradient(grad, h)
        elif grad.dtype == grad_weight.dtype:
            grad_weight.addmm_(grad.T, h)
        else:
            grad_weight += (grad.T @ h).to(grad_weight.dtype)


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def linear_smoothed_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float = 0.0,
                                  rdrop: float = 0.0) -> tuple[Tensor, Tensor]:
    """Sum over tokens of (1 - eps) * NLL + eps * mean_v(-log p_v) for logits = hidden @ weight^T.

    Args:
        hidden: (N, d_model) decoder states at real target positions; with ``rdrop``, (2N, d_model):
            two dropout passes over the same N tokens, the first pass's rows then the second's.
        weight: (V, d_model) output projection.
        target: (N,) token ids.
        rdrop: R-Drop weight alpha; the loss becomes the two passes' mean plus alpha times their
            symmetric KL divergence (module docstring).

    Returns:
        (loss sum, differentiable; NLL sum, not differentiable; with rdrop both over N tokens).
    """
    if not torch.is_grad_enabled():  # evaluation: autograd.Function still asks for the parameters' gradients
        hidden, weight = hidden.detach(), weight.detach()
    return _LinearSmoothedCrossEntropy.apply(hidden, weight, target, smoothing, rdrop)
