"""Dropout (§5.4, "Residual Dropout") with a cheaper mask on CPU.

torch's CPU dropout draws its mask with ``bernoulli_``, one call of its Mersenne Twister per element
(``torch.rand`` is no cheaper), and keeps the mask for backward as float32. A generator call costs
about the same whatever its width, so here each 64-bit draw gives four 16-bit lanes, and a lane
compared with a threshold is a Bernoulli(1 - p) draw with p rounded to a multiple of 1/65536 (at least
1/65536): the draws take a third of ``torch.rand``'s time, and the mask is kept as one byte. Measured on
a d_model-256 batch of 1,536 tokens: 0.77 ms against 1.54 ms for comparing ``torch.rand`` with p, and
2.2 ms for ``F.dropout``. On GPUs torch's fused kernel already does both, so it is used there.

Around a sublayer the dropout feeds a residual sum, x + Dropout(y) (§5.4), which ``residual_dropout``
makes one ``addcmul`` with a mask of the activations' dtype (a one-byte mask is first copied to float
for every multiply): forward and backward on the batch above, 0.52 against 0.68 ms.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LANES = 65536  # values of a 16-bit lane


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1 / (1 - p); identity when not training."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p == 1.0:
        return F.dropout(x, p, training=True)
    keep, scale = keep_mask(x.shape, p, x.device)
    # The mask's bytes read as uint8: torch multiplies by uint8 2x faster than by bool (which it first
    # copies to float); autograd keeps only the one-byte mask
    return (x * keep.view(torch.uint8)).mul_(scale)


def residual_dropout(x: Tensor, y: Tensor, p: float, training: bool = True) -> Tensor:
    """x + dropout(y, p), the residual connection around a sublayer; x and y have one shape."""
    if not training or p == 0.0:
        return x + y
    if y.device.type != "cpu" or p == 1.0:
        return x + F.dropout(y, p, training=True)
    keep, scale = keep_mask(y.shape, p, y.device, dtype=torch.result_type(x, y))
    return _AddKept.apply(x, y, keep, scale)


class _AddKept(torch.autograd.Function):
    """x + scale * keep * y in one pass; backward keeps only the mask."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, keep: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.addcmul(x, y, keep, value=scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        (keep,) = ctx.saved_tensors
        grad_y = (grad * keep).mul_(ctx.scale) if ctx.needs_input_grad[1] else None
        return grad, grad_y, None, None


def keep_mask(shape: torch.Size, p: float, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.bool) -> tuple[Tensor, float]:
    """A mask, True (or 1) with probability 1 - p' where p' is p rounded to a multiple of 1/65536,
    and 1 / (1 - p'), the scale that keeps the expected value."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-2**63, 2**63 - 1)
    lanes = words.view(torch.int16)[:n].view(shape)  # uniform over [-32768, 32767]
    dropped = min(max(round(p * LANES), 1), LANES - 1)  # lanes below the threshold are dropped
    keep = torch.empty(shape, dtype=dtype, device=device)
    torch.ge(lanes, dropped - LANES // 2, out=keep)
    return keep, LANES / (LANES - dropped)


class Dropout(nn.Dropout):
    """``nn.Dropout`` computed by :func:`dropout`."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def residual(self, x: Tensor, y: Tensor) -> Tensor:
        """x + Dropout(y)."""
        return residual_dropout(x, y, self.p, self.training)
