"""Linear layers that, at inference on a CPU, multiply by a copy of their weight packed for oneDNN.

A decoding step multiplies a few dozen rows (sentences x beams) by every weight matrix. ``F.linear``
hands such products to MKL with the weight as stored, and with few rows they are bound by reading
the weight, not by arithmetic. Packed once into oneDNN's blocked layout (what ``torch.compile``'s
freezing pass does for inference), the same products ran 1.3-2x faster for 64 rows and 3-4x faster
for 4-16 rows on a 2-core AVX-512 CPU, the vocabulary projection most; under bf16 autocast, which
casts the weight at every call, 2-4x. Training, fp16 and other devices keep ``F.linear``. The packed
copy lives on the module, outside the state dict, and is rebuilt when the weight changes (an
optimizer step, loading or averaging checkpoints).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# torch's own (underscored) ops behind torch.compile's CPU weight packing; where absent, F.linear
PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """``nn.Linear``; without autograd on a CPU, in fp32 or under bf16 autocast, computed from a
    oneDNN-packed weight."""

    def forward(self, x: Tensor) -> Tensor:
        dtype = self._packed_dtype(x)
        if dtype is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1]).to(dtype)  # (N, in_features)
        weight, bias = self._packed_weight(dtype, rows.shape[0])
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def _packed_dtype(self, x: Tensor) -> torch.dtype | None:
        """The dtype to multiply in with a packed weight, or None to use F.linear."""
        if (not PACKING or torch.is_grad_enabled() or x.device.type != "cpu" or x.numel() == 0
                or self.weight.dtype != torch.float32):
            return None
        if torch.is_autocast_enabled("cpu"):  # autocast would cast the weight again at every call
            return torch.bfloat16 if torch.get_autocast_dtype("cpu") == torch.bfloat16 else None
        return torch.float32 if x.dtype == torch.float32 else None

    def _packed_weight(self, dtype: torch.dtype, rows: int) -> tuple[Tensor, Tensor | None]:
        """The packed weight and the bias in ``dtype``, packed again whenever the weight has changed."""
        cache = getattr(self, "_packed", None)  # (weight it was packed from, its version, dtype, weight, bias)
        version = _version(self.weight)
        if (cache is None or version is None or cache[1:3] != (version, dtype)
                or cache[0].data_ptr() != self.weight.data_ptr()):
            source = self.weight.detach()  # held, so no other tensor can take its address
            bias = None if self.bias is None else self.bias.detach().to(dtype)
            cache = (source, version, dtype, torch.ops.mkldnn._reorder_linear_weight(source.to(dtype), rows), bias)
            self._packed = cache
        return cache[3], cache[4]


def _version(weight: Tensor) -> int | None:
    """How often the weight was modified in place; None for inference tensors, which do not count."""
    try:
        return weight._version
    except RuntimeError:
        return None
