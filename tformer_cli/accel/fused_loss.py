"""On a GPU: the label-smoothed loss's softmax and logit gradient in two passes over the logits.

``tformer_cli.loss`` forms a chunk of logits, then its loss terms and its gradient
``softmax - eps / V - (1 - eps) * onehot`` one torch op at a time: a copy to fp32, log-softmax, exp,
subtract, scatter and a copy back to the product's dtype, each a pass over (tokens x vocabulary)
numbers. On an H100 at paper scale those passes took about a fifth of a bf16 training step: the
products around them are fast and the passes are bound by memory. Here ``torch.compile`` fuses them
into one reduction (log-sum-exp and the mean logit, in fp32) and one pass that writes the gradient in
the logits' own dtype. The arithmetic is the same as the plain path's (tests/test_loss.py).

``enable`` is set by ``accelerate`` for a CUDA model in mode auto (piece "loss"). Where torch.compile
cannot compile it, the loss falls back to the plain path after one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

_enabled = False
_compiled: Callable | None = None


def enable(on: bool) -> None:
    global _enabled
    _enabled = on


def applies(hidden: Tensor) -> bool:
    """Whether the loss of these decoder states computes its terms here: on, and on a GPU."""
    return _enabled and hidden.is_cuda


def smoothed_terms(logits: Tensor, t: Tensor, smoothing: float) -> tuple[Tensor, Tensor, Tensor]:
    """logits (n, V) in any float dtype, t (n, 1) -> (loss sum, NLL sum) in fp32 (or fp64) and the
    logit gradient in the logits' dtype. With lse = log sum_v exp(logit_v): NLL = lse - logit_t, the smoothed
    term mean_v(-log p_v) = lse - mean_v logit_v."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least, fp64 stays fp64
    V = x.shape[1]
    lse = torch.logsumexp(x, dim=1, keepdim=True)
    nll = lse - x.gather(1, t)
    loss = ((1 - smoothing) * nll + smoothing * (lse - x.mean(dim=1, keepdim=True))).sum()
    target = torch.arange(V, device=x.device) == t  # (n, V), formed inside the fused pass
    grad = torch.exp(x - lse) - smoothing / V - (1 - smoothing) * target
    return loss, nll.sum(), grad.to(logits.dtype)


def fused_smoothed_terms(logits: Tensor, t: Tensor, smoothing: float) -> tuple[Tensor, Tensor, Tensor] | None:
    """``smoothed_terms`` compiled; None (and the plain path from then on) where it cannot be."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(smoothed_terms, dynamic=True)
    try:
        return _compiled(logits, t, smoothing)
    except Exception as error:  # noqa: BLE001 (no compiler, no Triton, an unsupported torch: stay correct)
        warnings.warn(f"the fused GPU loss did not compile ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); the loss runs on the plain path",
                      stacklevel=2)
        enable(False)
        return None
